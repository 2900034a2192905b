"""Progress you can watch (issue 11.7), through a real 2-rank gang: rank 0's progress line in the task
log through the local backend, the same values as MLflow metrics, and the attempt's record on the
MLflow run (tests/unit/trainer/test_progress.py has the line's unit tests)."""

from __future__ import annotations

import os

import pytest
from trainer_fixtures import PROGRESS_LINE


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
    unmatched = [x for x in lines if not PROGRESS_LINE.match(x.removeprefix("[rank 0] "))]
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
