"""Pause and resume a real local gang (issue 25.2 for backend local): a 2-rank trainer gang through
the local backend, paused by the command once it committed a checkpoint, resumed a second later."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_a_paused_local_gang_commits_waits_and_resumes_from_that_checkpoint(digits, tmp_path, monkeypatch, launcher):
    from operators.backends import GangSpec
    from operators.backends.local import LocalBackend, mpirun_path
    from operators.cli.gang import control
    from trainer.checkpoint_commit import committed_steps

    if launcher == "mpirun":
        mpirun_path()  # the project's `mpi` extra is part of `make install`: missing is a failure, not a skip

    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    sets = [f"data.train_path={digits / 'train.parquet'}", f"data.test_path={digits / 'test.parquet'}",
            "train.max_steps=3000", "checkpoint.every_steps=40", "train.log_every_steps=200"]
    spec = GangSpec(name="pause-drill", run_dir=str(run_dir), world_size=2, config_path=str(ROOT / "params.yaml"), overrides=sets,
                    launcher=launcher)
    log: list[str] = []
    out: dict = {}
    gang = threading.Thread(target=lambda: out.setdefault("result", LocalBackend(nproc_limit=2, relay_tracking=False).run(spec, log.append)))
    gang.start()
    deadline = time.monotonic() + 120
    while not committed_steps(run_dir / "checkpoints") or committed_steps(run_dir / "checkpoints")[0] < 80:
        assert gang.is_alive() and time.monotonic() < deadline, "\n".join(log[-40:])
        time.sleep(0.05)
    code, paused = control(["pause", "pause-drill", "--local", "--reason", "drill"])
    assert code == 0 and paused["paused"], paused
    while not any("waiting for `python -m operators.cli.gang resume" in line for line in log):
        assert gang.is_alive() and time.monotonic() < deadline, "\n".join(log[-40:])
        time.sleep(0.05)
    at_pause = committed_steps(run_dir / "checkpoints")[0]
    time.sleep(1.0)
    assert committed_steps(run_dir / "checkpoints")[0] == at_pause  # nothing trains while paused
    assert control(["resume", "pause-drill", "--local"])[0] == 0
    gang.join(180)
    result = out["result"]
    text = "\n".join(log[-60:])
    assert result.succeeded and result.pauses == 1, text
    # the ranks' final checkpoint of the pause (SIGTERM), not the last periodic one, is where it resumed
    assert result.resumed_from_step == at_pause and at_pause >= 80, text
    assert committed_steps(run_dir / "checkpoints")[0] == 3000
    assert not (tmp_path / "home" / "gangs").exists() or not list((tmp_path / "home" / "gangs").iterdir())
