"""Where gangflow keeps its state, and the embedded defaults derived from it.

The state dir is `.gangflow/` in the project root unless `GANGFLOW_HOME` says otherwise.
Everything one machine needs lives under it:

    <state>/airflow/        AIRFLOW_HOME (SQLite metadata DB, logs)
    <state>/mlflow.db       MLflow tracking + registry store (SQLite)
    <state>/mlartifacts/    MLflow artifacts
    <state>/dvc-remote/     DVC's local remote
    <state>/dvc-cache/      DVC's cache (content-addressed, read-only data versions)
    <state>/runs/           training run dirs, one per DAG run
    <state>/reports/        Great Expectations Data Docs
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PROJECT_ROOT = Path(os.environ.get("GANGFLOW_PROJECT", Path(__file__).resolve().parents[1]))


def state_dir() -> Path:
    return Path(os.environ.get("GANGFLOW_HOME") or PROJECT_ROOT / ".gangflow").resolve()


def airflow_home() -> Path:
    return state_dir() / "airflow"


def tracking_uri() -> str:
    """MLflow tracking URI: MLFLOW_TRACKING_URI when set, else SQLite under the state dir."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state_dir() / 'mlflow.db'}"


def artifact_root() -> Path:
    return state_dir() / "mlartifacts"


def dvc_remote() -> Path:
    return state_dir() / "dvc-remote"


def dvc_cache() -> Path:
    return state_dir() / "dvc-cache"


def runs_dir() -> Path:
    return state_dir() / "runs"


def run_key(run_id: str) -> str:
    """A DAG run id as a folder or file name (run ids hold ':' and '+')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id)


def run_dir(dag_id: str, run_id: str) -> Path:
    """The training run dir of one DAG run: the same for all its tries, so a retry resumes."""
    return runs_dir() / dag_id / run_key(run_id)


def reports_dir() -> Path:
    return state_dir() / "reports"


def params_file() -> Path:
    return PROJECT_ROOT / "params.yaml"
