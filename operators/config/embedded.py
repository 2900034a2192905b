"""The embedded defaults of one machine, as environment variables for Airflow and MLflow.

`make setup`, `make demo`, `make ui` and the tests all take the environment from here, so
they agree on one state dir (the embedded defaults: SQLite metadata, LocalExecutor, a small parallelism).
"""

from __future__ import annotations

import os

from operators.config import settings

# Airflow's own defaults for the log servers of the scheduler (LocalExecutor workers) and the
# triggerer. Two Airflows on one machine need different ones (see operators.cli.ui.start).
WORKER_LOG_SERVER_PORT = 8793
TRIGGER_LOG_SERVER_PORT = 8794


def airflow_environ(
    *,
    api_port: int = 8080,
    api_host: str = "127.0.0.1",
    worker_log_server_port: int = WORKER_LOG_SERVER_PORT,
    trigger_log_server_port: int = TRIGGER_LOG_SERVER_PORT,
) -> dict[str, str]:
    """Airflow's and MLflow's settings for the state dir (GANGFLOW_HOME or `.gangflow/`).

    The api-server listens on `api_host:api_port`; the default host is loopback only, since the
    simple auth manager keeps its generated password in plain text under the state dir.
    """
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
        "AIRFLOW__API__HOST": api_host,
        "AIRFLOW__API__PORT": str(api_port),
        # Also where task workers reach the Execution API (`<base_url>/execution/`).
        "AIRFLOW__API__BASE_URL": f"http://localhost:{api_port}",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_server_port),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_server_port),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "MLFLOW_TRACKING_URI": settings.tracking_uri(),
        "GIT_PYTHON_REFRESH": "quiet",
    }


def apply() -> dict[str, str]:
    """Export the embedded environment into this process (before importing airflow)."""
    env = airflow_environ()
    os.environ.update(env)
    return env
