"""The `ray` backend's kill drill (issue 24.1) on a real Ray cluster on this machine (a head started
here with `ray start --head --block`, reached through the backend's `address`, as RAY_ADDRESS
would): Ray Train's TorchTrainer runs 2 workers of the trainer; rank 1's worker process is
SIGKILLed by a timer mid-loop (kill@time, unsynchronised). Ray's evidence is judged infra, the
retry resumes from the last committed checkpoint (gangflow's, in the run dir) and ends bitwise
equal to an uninterrupted torchrun run. (Each try of the DAG's `train_ray` starts a cluster of its
own instead: `make demo BACKEND=ray`.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operators.backends.base import GangSpec
from operators.failures import classify
from trainer_fixtures import DRILL_INTERVAL as INTERVAL
from trainer_fixtures import drill_spec


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray head on this machine (2 CPUs, no dashboard, a temp dir of its own), stopped by its
    process group at the end: never `ray stop`, which would stop every Ray on the machine."""
    from operators.utils.ports import free_port

    ray = Path(sys.executable).with_name("ray")
    if not ray.is_file():
        pytest.fail("ray is missing: `make install` installs the pinned ray[train] (the `ray` extra)")
    port, temp = free_port(), tmp_path_factory.mktemp("ray")
    log = open(temp / "head.log", "w")
    token = secrets.token_hex(32)  # the cluster's own (Ray's token auth), given to the driver by env
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    proc = subprocess.Popen(
        [str(ray), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
         "--num-gpus", "0", "--include-dashboard", "false", "--temp-dir", str(temp), "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (started := re.search(r"ray start --address='([^']+)'", (temp / "head.log").read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("ray start --head did not start:\n" + (temp / "head.log").read_text()[-3000:])
            time.sleep(0.2)
        yield started.group(1), token  # the GCS address the head registered (Ray picks the node's IP)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:  # the head drains for up to 30 s on SIGTERM; nothing of this cluster needs draining
            proc.wait(3)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # whatever of the head's group is left
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


@pytest.mark.slow
def test_ray_kill_at_time_on_rank_1_is_infra_resumes_and_matches_torchrun(h, ray_cluster, drill_reference, tmp_path, monkeypatch):
    from operators.backends.ray import RayBackend

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GANGFLOW_FAULT", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    ray_address, token = ray_cluster
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    run_dir, lines, fault = tmp_path / "run", [], h.mid_loop_kill(drill_reference)
    first = RayBackend(address=ray_address).run(drill_spec("ray-drill", run_dir, 1, fault), lines.append)
    output = "\n".join(lines)
    assert not first.succeeded, output[-4000:]
    marker = h.fault_marker(run_dir, fault)
    assert marker.is_file(), "the loop ended before the timer: make the drill longer\n" + output[-3000:]
    fired = json.loads(marker.read_text())
    assert fired["rank"] == 1 and 0 < fired["step"] < 600
    assert first.evidence["rank"] == 1, first.evidence.get("rank")
    assert "The actor died unexpectedly" in first.evidence["log_tail"]  # Ray's own word, not ours
    verdict = classify(first.evidence)
    assert verdict.kind == "infra" and verdict.retryable, verdict.reason
    assert (run_dir / "ray" / "try-1.log").is_file()

    committed = h.newest_committed_step(run_dir)
    lines.clear()
    second = RayBackend(address=ray_address).run(drill_spec("ray-drill", run_dir, 2, fault), lines.append)
    output = "\n".join(lines)
    assert second.succeeded, output[-4000:]
    resumed = second.resumed_from_step
    # The marker's step bounds the kill from below (the loop runs on while the marker is written):
    # the resume is the first try's newest committed checkpoint, the loss at most two intervals.
    assert resumed and resumed == committed and resumed % INTERVAL == 0 and fired["step"] - resumed <= 2 * INTERVAL, (fired, committed, resumed)
    final = (run_dir / "final" / "model.safetensors").read_bytes()
    assert final == (drill_reference / "final" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_a_paused_ray_gang_stops_waits_and_resumes_from_its_newest_checkpoint(h, ray_cluster, tmp_path, monkeypatch):
    """Issue 25.2 for backend ray: `python -m operators.cli.gang pause GANG --local` stops the
    driver (its workers with it), the task waits, `resume` launches it again from the newest
    committed checkpoint; `pauses: 1`. On a cluster it did not start (this one) the workers are
    not in the driver's process group: they end with their actors, without a final checkpoint."""
    import threading

    from operators.backends.ray import RayBackend
    from operators.cli.gang import control
    from trainer.checkpoint_commit import committed_steps
    from trainer_fixtures import DATA

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GANGFLOW_FAULT", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    ray_address, token = ray_cluster
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    run_dir, lines, out = tmp_path / "run", [], {}
    sets = (f"data.train_path={DATA['train']}", f"data.test_path={DATA['test']}", "train.max_steps=1500",
            "checkpoint.every_steps=50", "train.log_every_steps=200")
    spec = GangSpec(name="ray-pause", run_dir=str(run_dir), world_size=2, config_path=str(h.ROOT / "params.yaml"), overrides=sets)
    gang = threading.Thread(target=lambda: out.setdefault("result", RayBackend(address=ray_address).run(spec, lines.append)))
    gang.start()
    deadline = time.monotonic() + 180
    while not committed_steps(run_dir / "checkpoints") or committed_steps(run_dir / "checkpoints")[0] < 100:
        assert gang.is_alive() and time.monotonic() < deadline, "\n".join(lines[-40:])
        time.sleep(0.05)
    assert control(["pause", "ray-pause", "--local"])[0] == 0
    while not any("waiting for `python -m operators.cli.gang resume" in line for line in lines):
        assert gang.is_alive() and time.monotonic() < deadline, "\n".join(lines[-40:])
        time.sleep(0.05)
    at_pause = committed_steps(run_dir / "checkpoints")[0]
    assert control(["resume", "ray-pause", "--local"])[0] == 0
    gang.join(240)
    result, text = out["result"], "\n".join(lines[-60:])
    assert result.succeeded and result.pauses == 1, text
    assert result.resumed_from_step == at_pause >= 100, text
    assert committed_steps(run_dir / "checkpoints")[0] == 1500
