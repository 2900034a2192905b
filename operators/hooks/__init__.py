"""Clients of the outside systems gangflow talks to: MLflow, DVC, the Kubernetes API."""
