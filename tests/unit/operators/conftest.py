"""Fixtures shared by the operator tests: a temp state dir and its MLflow client (tests/support/mlflow_store.py),
and `digits`, which builds data/digits when missing (a fresh clone has no data: tests/support/trainer_fixtures.py)."""

from mlflow_store import client, home  # noqa: F401
from trainer_fixtures import digits  # noqa: F401
