"""Fixtures shared by the operator system tests: a temp state dir and its MLflow client (tests/support/mlflow_store.py)."""

from mlflow_store import client, home  # noqa: F401
