"""The gang's Prometheus series from metrics.jsonl records (trainer/prometheus.py, issue 26 item 1):
every figure the issue names, with the gang's labels, read back from the exposition text."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainer.prometheus import GangMetrics, labels_from_env, serve

LABELS = {"dag_id": "train_pipeline", "dag_run_id": "manual__1", "pipeline": "digits", "mlflow_run_id": "abc123", "gang": "train-pipeline-0123456789"}
RECORDS = [
    {"event": "resume", "step": 10, "restore_s": 0.25},
    {"event": "first_step", "step": 11, "startup_s": 3.5, "queue_wait_s": 1.25},
    {"step": 20, "loss": 0.5, "lr": 0.1, "samples_per_sec": 640.0, "epoch": 0, "step_time_s": 0.1},
    {"event": "progress", "step": 20, "total_steps": 60, "eta_s": 4.0, "mlflow": {"prefix": "progress_"}},
    {"event": "checkpoint", "step": 20, "duration_s": 0.2, "blocked_s": 0.01, "bytes": 4096, "path": "x"},
    {"event": "preempted", "step": 25},
    {"event": "attempt", "step": 25, "attempt": 3},
]


def samples(metrics: GangMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.text()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def one(found, name, **labels):
    matches = [s for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, found.get(name))
    return matches[0]


def test_each_figure_of_a_gang_becomes_a_labelled_series():
    metrics = GangMetrics(LABELS)
    metrics.started(attempt=3)
    for record in RECORDS:
        metrics.observe(record)
    metrics.ended(failure_kind="infra", exit_codes={0: -9, 1: 75})
    found = samples(metrics)
    expected = {
        "gangflow_queue_wait_seconds": 1.25, "gangflow_startup_seconds": 3.5, "gangflow_step_seconds": 0.1,
        "gangflow_samples_per_second": 640.0, "gangflow_loss": 0.5, "gangflow_step": 20, "gangflow_total_steps": 60,
        "gangflow_checkpoint_bytes": 4096, "gangflow_checkpoint_step": 20, "gangflow_restore_seconds": 0.25,
        "gangflow_checkpoint_save_seconds_sum": 0.2, "gangflow_checkpoint_save_seconds_count": 1,
        "gangflow_checkpoint_blocked_seconds_count": 1,
        "gangflow_restarts": 2, "gangflow_preemptions_total": 1, "gangflow_gang_running": 0,
    }  # fmt: skip
    for name, value in expected.items():
        sample = one(found, name, **LABELS)
        assert sample.value == pytest.approx(value), name
    assert one(found, "gangflow_failure", kind="infra", **LABELS).value == 1
    assert one(found, "gangflow_rank_exit_code", rank="0", **LABELS).value == -9
    assert one(found, "gangflow_rank_exit_code", rank="1", **LABELS).value == 75
    assert one(found, "gangflow_loss", **LABELS).labels["rank"] == "0"  # rank 0's (mean over ranks)


def test_model_version_on_promote_and_unknown_labels_refused():
    metrics = GangMetrics(LABELS)
    metrics.promoted(model_name="gangflow-digits", model_version=4, promoted=True)
    sample = one(samples(metrics), "gangflow_model_version", **LABELS)
    assert (sample.labels["model_version"], sample.labels["promoted"]) == ("4", "true")
    with pytest.raises(ValueError, match="namespace.*accepted labels are dag_id"):
        GangMetrics({**LABELS, "namespace": "x"})


def test_records_without_numbers_change_nothing():
    metrics = GangMetrics(LABELS)
    for record in ({"event": "tracking", "params": {}}, {"step": 1, "loss": None}, {"event": "checkpoint", "bytes": "4k"}):
        metrics.observe(record)
    assert [name for name in samples(metrics) if not name.endswith("_created")] == ["gangflow_step"]


def test_labels_come_from_the_rank_environment_and_the_registry_is_served():
    env = {"GANGFLOW_DAG_ID": "d", "GANGFLOW_DAG_RUN_ID": "r", "GANGFLOW_PIPELINE": "p", "MLFLOW_RUN_ID": "m", "GANGFLOW_GANG": "g"}
    metrics = GangMetrics(labels_from_env(env))
    metrics.observe({"step": 5, "loss": 1.5})
    server, (host, port) = serve(metrics, "127.0.0.1", 0)
    try:
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'gangflow_loss{dag_id="d",dag_run_id="r",gang="g",mlflow_run_id="m",pipeline="p",rank="0"} 1.5' in body


def test_rank_zero_in_a_pod_serves_what_it_tracks(tmp_path, monkeypatch):
    """GANGFLOW_METRICS_PORT (set on Kubernetes pods): rank 0's Tracker serves its records."""
    import socket

    from trainer.tracking import Tracker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GANGFLOW_METRICS_PORT", str(port))
    monkeypatch.setenv("MLFLOW_RUN_ID", "run-9")
    monkeypatch.setenv("GANGFLOW_TRY_NUMBER", "2")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(tmp_path, enabled=True)
    try:
        tracker.step(12, loss=0.75, samples_per_sec=100.0, step_time_s=0.32)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        tracker.close()
    assert 'gangflow_step_seconds{' in body and 'mlflow_run_id="run-9"' in body and "} 0.32" in body
    assert 'gangflow_restarts{dag_id="",dag_run_id="",gang="",mlflow_run_id="run-9",pipeline=""} 1.0' in body
