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
