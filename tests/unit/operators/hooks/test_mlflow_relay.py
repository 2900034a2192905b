"""The training task relays the ranks' metrics.jsonl to MLflow (operators.hooks.mlflow_relay, issue 11): the
ranks of a local gang import no MLflow; metrics arrive while the gang runs; the final weights are
logged after a successful gang only; a retry logs into the same run; the relay stops on kill.
All against a real MLflow SQLite store; a real torchrun gang is tests/system/operators/hooks/test_mlflow_relay.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from operators.hooks.mlflow_relay import RelayFinalUploadError, TrackingRelay
from trainer.tracking import FinalUploadError, Tracker, mlflow_items

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def experiment(client):
    from operators.hooks import mlflow as tracking

    return tracking.ensure_experiment(client, "relay-tests")


def _new_run(client, experiment) -> str:
    return client.create_run(experiment).info.run_id


def _wait(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_one_mapping_for_lines(tmp_path):
    """Tracker lines carry what MLflow gets: steps as metrics, events by their `mlflow` key only."""
    tracker = Tracker(tmp_path, enabled=True, params={"train": {"lr": 0.1, "hidden": [8, 4]}}, tags={"gangflow.world_size": "2"})
    tracker.step(5, loss=0.5, lr=0.1)
    tracker.event("checkpoint", 5, mlflow_prefix="checkpoint_", duration_s=0.2, bytes=10, path="p")
    tracker.event("start", 0, world_size=2)  # not for MLflow
    tracker.event("attempt", 9, attempt=3, run_s=1.5, queue_wait_s=None, mlflow_prefix="attempt_", mlflow_step=3)
    tracker.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    items = [mlflow_items(r) for r in lines]
    assert items[0][1] == [("train.lr", "0.1"), ("train.hidden", "[8, 4]")] and items[0][2] == [("gangflow.world_size", "2")]
    assert sorted((k, v, s) for k, v, _, s in items[1][0]) == [("loss", 0.5, 5), ("lr", 0.1, 5)]
    assert sorted((k, v, s) for k, v, _, s in items[2][0]) == [("checkpoint_bytes", 10.0, 5), ("checkpoint_duration_s", 0.2, 5)]
    assert items[3] == ([], [], [])
    assert [(k, v, s) for k, v, _, s in items[4][0]] == [("attempt_run_s", 1.5, 3)]


def test_metrics_arrive_while_running_and_final_is_logged(client, experiment, tmp_path):
    run_id = _new_run(client, experiment)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0, "time": 1.0}) + "\n")  # an earlier try
    relay = TrackingRelay(tmp_path, open_run=lambda: (client, run_id), flush_every_s=0.1, log=lambda m: None).start()
    tracker = Tracker(tmp_path, enabled=True, params={"train": {"lr": 0.1}})
    tracker.step(10, loss=1.0)
    tracker.event("progress", 10, mlflow_prefix="progress_", sync=False, loss=1.0, samples_per_sec=50.0)
    assert _wait(lambda: "progress_samples_per_sec" in client.get_run(run_id).data.metrics), "not relayed while running"
    assert client.get_run(run_id).data.params["train.lr"] == "0.1"
    tracker.step(20, loss=0.5)
    tracker.close()
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"weights")
    assert relay.finish(succeeded=True, final_dir=final) == run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(10, 1.0), (20, 0.5)]  # not step 1
    assert [f.path for f in client.list_artifacts(run_id, "final")] == ["final/model.safetensors"]


def test_failure_flushes_metrics_and_never_logs_final(client, experiment, tmp_path):
    run_id = _new_run(client, experiment)
    relay = TrackingRelay(tmp_path, open_run=lambda: (client, run_id), flush_every_s=60, log=lambda m: None).start()
    tracker = Tracker(tmp_path, enabled=True)
    tracker.step(7, loss=2.0)
    tracker.close()
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_bytes(b"half")
    assert relay.finish(succeeded=False, final_dir=tmp_path / "final") == run_id
    assert client.get_run(run_id).data.metrics["loss"] == 2.0  # flushed at the end, not by the 60 s timer
    assert client.list_artifacts(run_id) == []


def test_run_that_cannot_open_fails_a_finished_gang_only(tmp_path):
    from operators.exceptions import RegistryUnavailable

    def down():
        raise RegistryUnavailable("MLflow at http://127.0.0.1:9 unavailable")

    logged: list[str] = []
    relay = TrackingRelay(tmp_path, open_run=down, flush_every_s=0.1, log=logged.append).start()
    assert relay.finish(succeeded=False) is None  # the gang's own failure is what the task reports
    assert len(logged) == 1 and "could not be opened" in logged[0]
    relay = TrackingRelay(tmp_path, open_run=down, flush_every_s=0.1, log=logged.append).start()
    with pytest.raises(RegistryUnavailable, match="127.0.0.1:9"):
        relay.finish(succeeded=True, final_dir=tmp_path)


def test_final_upload_failure_is_infra(client, experiment, tmp_path, monkeypatch):
    run_id = _new_run(client, experiment)
    relay = TrackingRelay(tmp_path, open_run=lambda: (client, run_id), flush_every_s=0.1, log=lambda m: None).start()
    with pytest.raises(RelayFinalUploadError, match=f"MLflow run {run_id}.*missing or empty") as info:
        relay.finish(succeeded=True, final_dir=tmp_path / "no-such-final")
    assert info.value.retryable and info.value.kind == "infra" and isinstance(info.value, FinalUploadError)
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"w")

    def refused(*args, **kwargs):
        raise PermissionError("artifact store refused the write")

    monkeypatch.setattr(client, "log_artifacts", refused)
    relay = TrackingRelay(tmp_path, open_run=lambda: (client, run_id), flush_every_s=0.1, log=lambda m: None).start()
    with pytest.raises(RelayFinalUploadError, match="PermissionError: artifact store refused"):
        relay.finish(succeeded=True, final_dir=final)


def test_relay_errors_are_reported_once_and_never_raise(tmp_path):
    class Broken:
        calls = 0

        def log_batch(self, *a, **k):
            Broken.calls += 1
            raise ConnectionError("refused")

    logged: list[str] = []
    relay = TrackingRelay(tmp_path, open_run=lambda: (Broken(), "r1"), flush_every_s=0.05, log=logged.append).start()
    tracker = Tracker(tmp_path, enabled=True)
    for step in range(1, 4):
        tracker.step(step, loss=1.0)
        assert _wait(lambda s=step: Broken.calls >= s)
    tracker.close()
    assert relay.finish(succeeded=False) == "r1"
    assert len(logged) == 1 and "ConnectionError" in logged[0]


def test_relay_stops_on_kill_even_while_mlflow_hangs(tmp_path):
    """on_kill must not wait: stop() returns at once, the thread ends at its next wake; a run that
    never opens cannot hold finish() beyond its bounded join."""
    relay = TrackingRelay(tmp_path, open_run=lambda: (object(), "r1"), flush_every_s=0.05, log=lambda m: None).start()
    assert _wait(lambda: relay.run_id == "r1")
    relay.stop()
    assert _wait(lambda: not relay._thread.is_alive(), 2.0)

    gate = threading.Event()

    def hang():
        gate.wait(30)
        return object(), "r2"

    hung = TrackingRelay(tmp_path, open_run=hang, log=lambda m: None, join_timeout_s=1.5).start()
    t0 = time.monotonic()
    assert hung.stop() is False and time.monotonic() - t0 < 1.0  # a stop that joined would take the 1.5 s
    from operators.exceptions import RegistryUnavailable

    with pytest.raises(RegistryUnavailable, match="did not answer"):
        hung.finish(succeeded=True, final_dir=tmp_path)
    assert time.monotonic() - t0 < 5
    gate.set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_relay_yields_the_cpu_to_the_gang(tmp_path):
    """The relay's thread (not the task's) runs at RELAY_NICE above the task's niceness."""
    import os

    from operators.hooks.mlflow_relay import RELAY_NICE

    seen: list[int] = []
    gate = threading.Event()

    def open_run():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        gate.set()
        return object(), "r1"

    base = os.getpriority(os.PRIO_PROCESS, 0)
    relay = TrackingRelay(tmp_path, open_run=open_run, flush_every_s=0.05, log=lambda m: None).start()
    assert gate.wait(5)
    relay.stop(2)
    assert seen == [min(19, base + RELAY_NICE)] and os.getpriority(os.PRIO_PROCESS, 0) == base


def test_operator_kill_stops_the_relay(tmp_path):
    from operators.training import GangTrainingOperator

    op = GangTrainingOperator(task_id="t", world_size=1)
    op._relay = TrackingRelay(tmp_path, open_run=lambda: (object(), "r1"), flush_every_s=0.05, log=lambda m: None).start()
    op.on_kill()
    assert _wait(lambda: not op._relay._thread.is_alive(), 2.0)


def test_queue_wait_is_from_the_try_start(tmp_path, monkeypatch):
    """The task passes its try's start (GANGFLOW_TRY_STARTED_AT, forwarded to pods too); rank 0
    records launch - start as attempt_queue_wait_s at its first step."""
    from operators.kubernetes.builders import FORWARDED_ENV
    from operators.training import GangTrainingOperator, try_started_at
    from trainer import tracking

    start = datetime(2026, 12, 1, 0, 0, 0, tzinfo=timezone.utc)
    assert try_started_at(SimpleNamespace(start_date=start)) == start.timestamp()
    assert try_started_at(SimpleNamespace(start_date=start.replace(tzinfo=None))) == start.timestamp()  # naive = UTC
    assert try_started_at(SimpleNamespace(start_date=None)) is None
    ti = SimpleNamespace(dag_id="d", try_number=2, start_date=start)
    spec = GangTrainingOperator(task_id="t", world_size=1).build_spec({"ti": ti, "run_id": "r"}, mlflow_run_id=None)
    assert float(spec.env["GANGFLOW_TRY_STARTED_AT"]) == start.timestamp()
    assert "GANGFLOW_TRY_STARTED_AT" in FORWARDED_ENV  # Kubernetes pods measure it too

    launched = time.time() - 2.0
    monkeypatch.setenv("GANGFLOW_TRY_STARTED_AT", f"{launched - 4.25:.3f}")
    monkeypatch.setattr(tracking, "launch_time", lambda: (launched, "torchrun launch"))
    tracker = tracking.Tracker(tmp_path, enabled=True)
    progress = tracking.Progress(tracker, log=lambda m: None, every_s=0, total=10, global_batch=8, start_step=0, committed_step=None)
    progress.tick(1)
    tracker.close()
    first = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"first_step"' in x][0]
    assert first["queue_wait_s"] == 4.25
    monkeypatch.setenv("GANGFLOW_TRY_STARTED_AT", f"{launched + 30:.3f}")  # a node clock behind the worker's
    (tmp_path / "skew").mkdir()
    progress = tracking.Progress(tracking.Tracker(tmp_path / "skew", enabled=True), log=lambda m: None, every_s=0, total=10,
                                 global_batch=8, start_step=0, committed_step=None)
    progress.tick(1)
    assert progress.queue_wait_s == 0.0


def test_a_refused_param_does_not_cost_the_metrics(client, experiment, tmp_path):
    """A retry whose params differ (MLflow refuses to change a logged param) still relays its metrics."""
    run_id = _new_run(client, experiment)
    client.log_param(run_id, "train.log_every_steps", "10")
    logged: list[str] = []
    relay = TrackingRelay(tmp_path, open_run=lambda: (client, run_id), flush_every_s=60, log=logged.append).start()
    tracker = Tracker(tmp_path, enabled=True, params={"train": {"log_every_steps": 20}})
    tracker.step(3, loss=0.25)
    tracker.close()
    assert relay.finish(succeeded=False) == run_id
    assert client.get_run(run_id).data.metrics["loss"] == 0.25
    assert len(logged) == 1 and "failed" in logged[0]


def test_an_outage_that_ends_while_the_gang_trains_costs_nothing(client, experiment, tmp_path):
    """MLflow unreachable when the try starts (RegistryUnavailable twice): the relay retries with
    backoff and relays once it opens. Before, the first failure ended the relay and a gang that
    trained to the end failed its try."""
    from operators.exceptions import RegistryUnavailable

    run_id = _new_run(client, experiment)
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise RegistryUnavailable("MLflow at http://127.0.0.1:9 unavailable")
        return client, run_id

    logged: list[str] = []
    relay = TrackingRelay(tmp_path, open_run=flaky, flush_every_s=0.1, log=logged.append, max_backoff_s=0.2).start()
    tracker = Tracker(tmp_path, enabled=True)
    tracker.step(10, loss=1.0)
    assert _wait(lambda: "loss" in client.get_run(run_id).data.metrics), "not relayed after the outage"
    tracker.close()
    assert relay.finish(succeeded=False) == run_id and len(calls) == 3
    assert sum("could not be opened" in m for m in logged) == 1 and any("opened after all" in m for m in logged)


def test_mlflow_back_only_after_the_gang_still_gets_the_final_weights(client, experiment, tmp_path):
    """Down for the whole try (the relay keeps retrying), back when the gang ends: finish opens
    the run once more and logs final/ instead of failing a finished gang."""
    from operators.exceptions import RegistryUnavailable

    run_id = _new_run(client, experiment)
    up = threading.Event()
    tries: list[int] = []

    def down_until_up():
        tries.append(1)
        if not up.is_set():
            raise RegistryUnavailable("MLflow at http://127.0.0.1:9 unavailable")
        return client, run_id

    relay = TrackingRelay(tmp_path, open_run=down_until_up, flush_every_s=0.1, log=lambda m: None, max_backoff_s=5.0).start()
    assert _wait(lambda: tries), "the relay never tried to open the run"  # down while the gang trains
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"weights")
    up.set()
    assert relay.finish(succeeded=True, final_dir=final) == run_id
    assert [f.path for f in client.list_artifacts(run_id, "final")] == ["final/model.safetensors"]


def test_an_error_that_cannot_heal_stops_the_gang_at_once(tmp_path):
    """A refused request (not an outage) is fatal: on_fatal fires without retrying, and finish
    raises that error whether or not the gang finished (it was stopped for it)."""
    calls, fatal = [], []

    def refused():
        calls.append(1)
        raise PermissionError("403 Forbidden: user may not create runs in experiment 'gangflow'")

    relay = TrackingRelay(tmp_path, open_run=refused, flush_every_s=0.1, log=lambda m: None, on_fatal=fatal.append).start()
    assert _wait(lambda: bool(fatal), 5.0) and isinstance(fatal[0], PermissionError)
    with pytest.raises(PermissionError, match="403"):
        relay.finish(succeeded=False)
    assert len(calls) == 1


def test_local_backend_killed_before_its_gang_starts_stops_it_at_start(tmp_path, monkeypatch):
    """The relay may give up before `run` has launched the gang: kill() then has no process to
    signal, so run() must stop the gang as soon as it starts instead of letting it train."""
    from operators.backends import GangSpec
    from operators.backends.local import LocalBackend

    backend = LocalBackend(grace_period_s=5)
    sleeper = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    monkeypatch.setattr(backend, "command", lambda spec, log_dir: sleeper)
    backend.kill()
    started = time.monotonic()
    result = backend.run(GangSpec(name="g", run_dir=str(tmp_path), world_size=1), lambda line: None)
    assert not result.succeeded and result.exit_code == -15
    assert time.monotonic() - started < 20


def test_task_stops_its_gang_when_the_run_cannot_open_for_good(tmp_path, monkeypatch):
    """Through GangTrainingOperator.execute with the local backend (its gang replaced by a 60 s
    sleeper): the MLflow run is refused (not an outage), so the task stops the gang at once and
    fails with that error, instead of training for a try that must fail."""
    from operators.backends.local import LocalBackend
    from operators.training import GangTrainingOperator

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(LocalBackend, "command", lambda self, spec, log_dir: sleeper)
    op = GangTrainingOperator(task_id="train_local_1", world_size=1, run_dir=str(tmp_path / "run"),
                              config_path=str(ROOT / "params.yaml"), backend_options={"grace_period_s": 5})

    def refused(context):
        time.sleep(0.5)  # the gang has started by now, or has not: either way it must stop
        raise PermissionError("403 Forbidden: user may not create runs")

    monkeypatch.setattr(op, "_open_run", refused)
    ti = SimpleNamespace(dag_id="relay_dag", try_number=1, start_date=datetime.now(timezone.utc))
    started = time.monotonic()
    with pytest.raises(PermissionError, match="403"):
        op.execute({"ti": ti, "run_id": "manual__refused"})
    assert time.monotonic() - started < 30


def test_a_link_in_final_is_refused_never_uploaded(client, experiment, tmp_path):
    """Issue 28.2: paths taken from a run dir are never followed: a `final/` entry linked to a file
    of the worker (its airflow.cfg, a key) would be uploaded to MLflow for anyone to download."""
    from operators.exceptions import UserError

    secret = tmp_path / "worker-secret.txt"
    secret.write_text("the worker's key")
    run_id = _new_run(client, experiment)
    run = tmp_path / "run"
    final = run / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"weights")
    (final / "card.json").symlink_to(secret)
    relay = TrackingRelay(run, open_run=lambda: (client, run_id), flush_every_s=0.1, log=lambda m: None).start()
    with pytest.raises(UserError, match="card.json"):
        relay.finish(succeeded=True, final_dir=final)
    assert client.list_artifacts(run_id, "final") == []


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_relay_never_follows_a_link_or_waits_on_a_fifo_as_metrics_jsonl(tmp_path, plant):
    """A run dir is not trusted: metrics.jsonl as a link was read (outside the run dir), as a FIFO it
    blocked the relay's pump."""
    import os

    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"step": 1, "secret": 42.0}) + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sent, logged = [], []

    class Client:
        def log_batch(self, run_id, **call):
            sent.append(call)

    relay = TrackingRelay(run_dir, open_run=lambda: (Client(), "r1"), flush_every_s=0.05, log=logged.append)
    relay.run_id, relay.client = "r1", Client()
    if plant == "link":
        (run_dir / "metrics.jsonl").symlink_to(outside)
    else:
        os.mkfifo(run_dir / "metrics.jsonl")
    done = threading.Event()
    threading.Thread(target=lambda: (relay.pump(), relay.pump(), done.set()), daemon=True).start()
    assert done.wait(5), "the pump blocked"
    assert sent == [] and len([m for m in logged if "not a regular file" in m]) == 1
