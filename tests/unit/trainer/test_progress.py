"""Progress you can watch (issue 11.7): rank 0's progress line, in the task log through the local
backend, the same values as MLflow metrics, and the attempt's record on the MLflow run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from trainer.tracking import Progress, Tracker

LINE = re.compile(r"gangflow: progress: step (\d+)/(\d+) \(\d+%\), loss (-|\d+\.\d{4}), (\d+) samples/s, "
                  r"ETA (\d+:\d\d:\d\d|-), last checkpoint step (none|\d+)$")


def test_progress_line_fields_and_disabled(tmp_path, monkeypatch):
    """No fault. A fake clock: one line per interval, none with progress_every_s = 0."""
    now = [100.0]
    monkeypatch.setattr("trainer.tracking.time.monotonic", lambda: now[0])
    monkeypatch.setenv("GANGFLOW_TRY_NUMBER", "2")
    lines: list[str] = []
    tracker = Tracker(tmp_path, enabled=True)
    progress = Progress(tracker, log=lines.append, every_s=1.0, total=100, global_batch=32, start_step=40,
                        committed_step=40)
    for step in range(41, 61):
        now[0] += 0.25
        if step == 50:
            progress.loss = 0.5
            progress.committed({"step": 50, "duration_s": 0.1, "bytes": 1000})
        progress.tick(step)
    assert len(lines) == 5, lines  # 20 steps of 0.25 s, one line a second
    m = LINE.match(lines[-1])
    assert m and m.group(1) == "60" and m.group(2) == "100" and m.group(3) == "0.5000" and m.group(6) == "50", lines
    assert m.group(4) == "128"  # 4 steps x 32 samples in 1 s
    assert m.group(5) == "0:00:10"  # 40 steps left at 20 steps per 5 s
    progress.attempt_record(60)
    tracker.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    attempt = [r for r in records if r.get("event") == "attempt"]
    assert attempt and attempt[0]["attempt"] == 2 and attempt[0]["checkpoint_bytes"] == 1000 and attempt[0]["checkpoints"] == 1
    assert sum(r.get("event") == "progress" for r in records) == 5

    quiet: list[str] = []
    (tmp_path / "off").mkdir()
    off = Progress(Tracker(tmp_path / "off", enabled=True), log=quiet.append, every_s=0, total=10, global_batch=1,
                   start_step=0, committed_step=None)
    for step in range(1, 11):
        now[0] += 10
        off.tick(step)
    assert quiet == []


@pytest.mark.slow
def test_progress_reaches_the_task_log_and_mlflow(h, digits, tmp_path):
    """No fault. The real gang through the local backend (what the Airflow task runs; its `log` is
    the task log): a 2-rank run with progress every 0.5 s shows >= 2 progress lines from rank 0
    with every field, and the MLflow run gets progress_* metrics and the attempt's record
    (attempt_* at MLflow step = the try number). Rank 0 logs to MLflow itself here
    (`relay_tracking=False`, as pods do); tests/unit/operators/hooks/test_mlflow_relay.py covers the relay."""
    from mlflow.tracking import MlflowClient

    from operators.backends import GangSpec
    from operators.backends.local import LocalBackend

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("progress", artifact_location=(tmp_path / "mlartifacts").as_uri())).info.run_id
    sets = [f"data.train_path={digits / 'train.parquet'}", f"data.test_path={digits / 'test.parquet'}",
            "train.max_steps=1500", "checkpoint.every_steps=300", "tracking.progress_every_s=0.5",
            "tracking.flush_every_s=0.5"]
    spec = GangSpec(name="progress-test", run_dir=str(tmp_path / "run"), world_size=2,
                    config_path=str(h.ROOT / "params.yaml"), overrides=sets, attempt=3,
                    env={"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id, "GANGFLOW_TRY_NUMBER": "3"})
    log: list[str] = []
    old = os.getcwd()
    os.chdir(h.ROOT)
    try:
        result = LocalBackend(nproc_limit=2, relay_tracking=False).run(spec, log.append)
    finally:
        os.chdir(old)
    assert result.succeeded, "\n".join(log[-60:])
    lines = [x for x in log if x.startswith("[rank 0] gangflow: progress:")]
    assert len(lines) >= 2, "\n".join(log[-60:])
    unmatched = [x for x in lines if not LINE.match(x.removeprefix("[rank 0] "))]
    assert not unmatched, unmatched
    assert not any(x.startswith("[rank 1] gangflow: progress:") for x in log)  # rank 0 only
    metrics = client.get_run(run_id).data.metrics
    for key in ("progress_loss", "progress_samples_per_sec", "progress_eta_s", "attempt_startup_s", "attempt_run_s",
                "attempt_checkpoint_s", "attempt_checkpoint_bytes"):
        assert key in metrics, (key, sorted(metrics))
    history = client.get_metric_history(run_id, "attempt_startup_s")
    assert {m.step for m in history} == {3} and 0 < history[0].value < 600
    assert metrics["attempt_checkpoint_bytes"] > 0 and metrics["progress_samples_per_sec"] > 0
    assert len(client.get_metric_history(run_id, "progress_samples_per_sec")) >= 2


def test_a_process_start_is_read_to_the_clock_not_to_the_whole_second():
    # /proc/stat's btime is whole seconds: a start built on it came out up to a second early,
    # and attempt_startup_s and attempt_queue_wait_s were off by as much.
    import subprocess
    import sys
    import time

    code = "import time; from trainer.tracking import _process_start; print(_process_start(), time.time())"
    for _ in range(3):
        before = time.time()
        started, at_import = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                       check=True).stdout.split())
        assert before - 0.02 <= started <= at_import  # /proc ticks are 10 ms
