"""`make cluster-drill`: run `train_pipeline` with `backend=kubernetes` without a cluster.

The gang's rendered pods run as isolated local processes; an S3-API server (moto) and an MLflow
server run on 127.0.0.1; `api_double.InMemoryKubernetesApi`, a TEST DOUBLE of the Kubernetes API
server, stands in for the API server. See docs/kubernetes.md, "The cluster drill".

Importing this package imports nothing heavy.
"""
