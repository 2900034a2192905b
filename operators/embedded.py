"""The embedded defaults of one machine, as environment variables for Airflow and MLflow.

`make setup`, `make demo`, `make ui` and the tests all take the environment from here, so
they agree on one state dir (DESIGN.md: SQLite metadata, LocalExecutor, a small parallelism).
"""

from __future__ import annotations

import os

from operators import settings


def airflow_environ(*, api_port: int = 8080) -> dict[str, str]:
    state = settings.state_dir()
    home = settings.airflow_home()
    return {
        "GANGFLOW_HOME": str(state),
        "GANGFLOW_PROJECT": str(settings.PROJECT_ROOT),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(settings.PROJECT_ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        # LocalExecutor starts `parallelism` worker processes: keep it to what a laptop holds.
        "AIRFLOW__CORE__PARALLELISM": os.environ.get("AIRFLOW__CORE__PARALLELISM", "4"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API__BASE_URL": f"http://localhost:{api_port}",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "MLFLOW_TRACKING_URI": settings.tracking_uri(),
        "GIT_PYTHON_REFRESH": "quiet",
    }


def apply() -> dict[str, str]:
    """Export the embedded environment into this process (before importing airflow)."""
    env = airflow_environ()
    os.environ.update(env)
    return env
