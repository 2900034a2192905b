"""`make cluster-drill`: run `train_pipeline` with `backend=kubernetes` without a cluster.

The gang's rendered pods run as isolated local processes beside an S3-API server (moto), an MLflow
server and a TEST DOUBLE of the Kubernetes API server, all on 127.0.0.1 (docs/kubernetes.md,
"The cluster drill"). Importing this package imports nothing heavy.
"""
