"""Fixtures shared by the operator system tests: a temp state dir and its MLflow client (tests/support/mlflow_store.py),
and `digits`, which builds data/digits when missing (tests/support/trainer_fixtures.py)."""

from mlflow_store import client, home  # noqa: F401
from trainer_fixtures import digits  # noqa: F401
