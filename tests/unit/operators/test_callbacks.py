"""operators.callbacks: the task failure record `make demo` and the cluster drill report."""

from __future__ import annotations

from types import SimpleNamespace

from operators import callbacks
from operators.exceptions import StorageUnavailable


def test_record_failure_round_trips_through_read_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    ti = SimpleNamespace(dag_id="train_pipeline", task_id="validate_dataset", try_number=2)
    assert callbacks.read_failure("train_pipeline", "manual__1") == {}
    callbacks.record_failure({"ti": ti, "run_id": "manual__1", "exception": StorageUnavailable("remote down")})
    assert callbacks.read_failure("train_pipeline", "manual__1") == {
        "task_id": "validate_dataset", "try_number": 2, "kind": "infra", "reason": "remote down"}
    folder = callbacks.failure_record_path("train_pipeline", "manual__1").parent
    assert [p.name for p in folder.iterdir()] == [callbacks.failure_record_path("train_pipeline", "manual__1").name]


# -- the DAG run's MLflow run ends (issue 23, item 6) ----------------------------------------------


def _dag_run(client, dag_run_id: str) -> str:
    from operators.hooks import mlflow as tracking

    experiment = tracking.ensure_experiment(client, "gangflow")
    return tracking.ensure_run(client, experiment, dag_id="train_pipeline", dag_run_id=dag_run_id)


def test_a_finally_failed_task_ends_its_dag_runs_mlflow_run_failed(home, client):
    run_id = _dag_run(client, "manual__fails")
    assert client.get_run(run_id).info.status == "RUNNING"
    ti = SimpleNamespace(dag_id="train_pipeline", task_id="train_local_2", try_number=4)
    callbacks.record_failure({"ti": ti, "run_id": "manual__fails", "task": SimpleNamespace(), "exception": RuntimeError("boom")})
    info = client.get_run(run_id).info
    assert info.status == "FAILED" and info.end_time


def test_a_failed_validation_leaves_no_mlflow_run_behind(home, client):
    """No run was created before training: the callback creates none either."""
    from operators.hooks import mlflow as tracking

    ti = SimpleNamespace(dag_id="train_pipeline", task_id="validate_dataset", try_number=1)
    callbacks.record_failure({"ti": ti, "run_id": "manual__novalidate", "task": SimpleNamespace(), "exception": RuntimeError("bad data")})
    experiment = tracking.ensure_experiment(client, "gangflow")
    assert tracking.find_run(client, experiment, dag_id="train_pipeline", dag_run_id="manual__novalidate") is None


def test_end_run_marks_the_run_finished(home, client):
    from operators.hooks import mlflow as tracking

    run_id = _dag_run(client, "manual__ok")
    tracking.end_run(client, run_id, succeeded=True)
    info = client.get_run(run_id).info
    assert info.status == "FINISHED" and info.end_time
