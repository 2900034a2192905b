"""operators.hooks.mlflow against a real MLflow on a temporary SQLite store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from operators.config import settings

from operators.hooks import mlflow as tracking
from operators.exceptions import InfraError, RegistryUnavailable

PROJECT_ROOT = Path(__file__).resolve().parents[4]


def test_get_client_defaults_to_sqlite_under_the_state_dir(home, client):
    uri = tracking.client_uri(client)
    assert uri == f"sqlite:///{home.resolve() / 'mlflow.db'}" == settings.tracking_uri()
    assert client._registry_uri == uri  # registry on the same store


def test_ensure_experiment_puts_artifacts_under_the_state_dir(home, client):
    exp_id = tracking.ensure_experiment(client, "gangflow-test")
    assert tracking.ensure_experiment(client, "gangflow-test") == exp_id  # idempotent
    location = client.get_experiment(exp_id).artifact_location
    assert urlparse(location).scheme == "file"
    assert Path(urlparse(location).path) == home.resolve() / "mlartifacts" / "gangflow-test"


def test_ensure_experiment_restores_a_deleted_one(client):
    exp_id = tracking.ensure_experiment(client, "gangflow-deleted")
    client.delete_experiment(exp_id)
    assert tracking.ensure_experiment(client, "gangflow-deleted") == exp_id
    assert client.get_experiment(exp_id).lifecycle_stage == "active"


def test_ensure_run_reuses_the_run_of_the_same_dag_run(client):
    exp_id = tracking.ensure_experiment(client, "gangflow-runs")
    first = tracking.ensure_run(client, exp_id, dag_id="train_dag", dag_run_id="manual__2026-11-29T10:00:00+00:00",
                                run_name="try-1", tags={"gangflow.try_number": 1})
    again = tracking.ensure_run(client, exp_id, dag_id="train_dag", dag_run_id="manual__2026-11-29T10:00:00+00:00",
                                run_name="try-2")
    other = tracking.ensure_run(client, exp_id, dag_id="train_dag", dag_run_id="manual__2026-11-29T11:00:00+00:00")
    other_dag = tracking.ensure_run(client, exp_id, dag_id="other_dag",
                                    dag_run_id="manual__2026-11-29T10:00:00+00:00")
    assert first == again
    assert len({first, other, other_dag}) == 3
    run = client.get_run(first)
    assert run.info.run_name == "try-1"
    assert run.data.tags[tracking.TAG_DAG_ID] == "train_dag"
    assert run.data.tags[tracking.TAG_DAG_RUN_ID] == "manual__2026-11-29T10:00:00+00:00"
    assert run.data.tags["gangflow.try_number"] == "1"


def test_ensure_run_handles_quotes_in_ids(client):
    exp_id = tracking.ensure_experiment(client, "gangflow-runs")
    a = tracking.ensure_run(client, exp_id, dag_id="d", dag_run_id="it's a run")
    assert tracking.ensure_run(client, exp_id, dag_id="d", dag_run_id="it's a run") == a


def test_unreachable_server_is_registry_unavailable(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = "http://127.0.0.1:9"  # discard port: connection refused
    client = tracking.get_client(uri)
    with pytest.raises(RegistryUnavailable, match="127.0.0.1:9") as info:
        tracking.ensure_experiment(client, "gangflow")
    assert isinstance(info.value, InfraError) and info.value.retryable


def test_other_mlflow_errors_pass_through(client):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException) as info:
        with tracking.mlflow_errors(tracking.client_uri(client), "read a run"):
            client.get_run("0" * 32)
    assert not isinstance(info.value, RegistryUnavailable)


@pytest.mark.parametrize(
    ("uri", "local"),
    [("sqlite:////tmp/x.db", True), ("file:///tmp/mlruns", True), ("/tmp/mlruns", True),
     ("http://mlflow:5000", False), ("https://mlflow.example.com", False), ("databricks", False)],
)
def test_is_local_store(uri, local):
    assert tracking.is_local_store(uri) is local


def test_operator_modules_import_no_heavy_libraries():
    code = (
        "import sys\n"
        "import operators.hooks.mlflow, operators.evaluation, operators.registry.versions, operators.promotion\n"
        "import operators.registry.served_model\n"
        "heavy = [m for m in ('torch', 'mlflow', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_registry_unavailable_shows_no_password_in_its_message_or_traceback():
    """MLflow's own error text repeats the URL it called, password included."""
    import traceback

    import requests

    password = "".join(reversed("terc3S"))  # not in this file's text, which a traceback quotes
    with pytest.raises(RegistryUnavailable) as info:
        with tracking.mlflow_errors(f"http://alice:{password}@127.0.0.1:9/", "read the champion"):
            raise requests.ConnectionError(f"API request to http://alice:{password}@127.0.0.1:9/api/2.0/mlflow/x failed")
    shown = "".join(traceback.format_exception(info.value))
    assert password not in shown and "http://alice:***@127.0.0.1:9/api/2.0/mlflow/x failed" in shown
