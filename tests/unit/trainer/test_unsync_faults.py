"""Unsynchronised faults (issue 11.1, contract 3): `kill@save[=K]` and `kill@time=SECONDS`.

Each test says whether its fault is synchronised. These run the real FaultInjector and
Checkpointer in a child process that really SIGKILLs itself; the drills through the real trainer
under torchrun (2 ranks, gloo) are tests/system/trainer/test_unsync_faults.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.errors import ConfigError
from trainer.faults import Fault, FaultInjector, parse_fault

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "text, fault",
    [
        ("kill@save", Fault("kill", None, None, None, "save")),
        ("kill@save=3,rank=1", Fault("kill", None, 1, None, "save", nth=3)),
        ("kill@time=2.5", Fault("kill", None, None, None, "time", seconds=2.5)),
        ("kill@time=7,rank=0", Fault("kill", None, 0, None, "time", seconds=7.0)),
    ],
)
def test_parse_unsynchronised(text, fault):
    assert parse_fault(text) == fault
    assert parse_fault(fault.spec) == fault and not fault.synchronised
    assert parse_fault("kill@step=3").synchronised


@pytest.mark.parametrize("text, needle", [("term@save", "kill only"), ("exit=3@time=2", "kill only"),
                                          ("raise@save", "kill only"), ("kill@time=0", "SECONDS > 0"),
                                          ("kill@save=0", "K >= 1"), ("kill@time=-1", "kill@time=SECONDS"),
                                          ("kill@saved", "kill@save[=K]"), ("kill@time=x", "kill@time=SECONDS")])
def test_malformed_unsynchronised_specs_name_the_accepted_forms(text, needle):
    with pytest.raises(ConfigError, match="GANGFLOW_FAULT=") as err:
        parse_fault(text)
    assert needle in str(err.value)


def test_a_timer_that_the_loop_outlives_is_cancelled_without_a_marker(tmp_path):
    """kill@time (unsynchronised): a loop that ends first cancels the timer; nothing fires."""
    injector = FaultInjector(parse_fault("kill@time=0.2"), tmp_path, rank=0, world_size=1)
    injector.start_clock()
    timer = injector._timer
    injector.stop_clock()
    timer.join(60)  # a cancelled timer ends at once without firing; one that fires ends after firing
    assert not timer.is_alive() and not injector.marker.exists() and injector.armed


def _child(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_kill_at_save_strikes_between_the_data_files_and_the_commit(tmp_path):
    """kill@save=2 (unsynchronised) on an async save: the writer thread SIGKILLs the process after
    the tensors and state are written and before the manifest, so the second checkpoint is left
    half-written (a `.tmp-step-2-*` folder without manifest.json) and only step-1 is committed.
    With the old drain-then-fire behaviour no partial checkpoint could exist."""
    code = f"""
import torch
from trainer.checkpoint import Checkpointer, Snapshot
from trainer.config import CheckpointConfig
from trainer.faults import FaultInjector, parse_fault
inj = FaultInjector(parse_fault("kill@save=2"), {str(tmp_path)!r}, rank=0, world_size=1)
ck = Checkpointer({str(tmp_path / "checkpoints")!r}, CheckpointConfig(async_save=True), at_save=inj.at_save)
for step in (1, 2):
    inj.step = step
    ck.save(Snapshot(step, {{"w": torch.ones(4) * step}}, {{}}, {{"step": step}}))
ck.wait()
print("survived")
"""
    out = _child(code, tmp_path)
    assert out.returncode == -9, out.stdout + out.stderr
    assert "survived" not in out.stdout
    assert "kill@save=2 fires on rank 0 at step 2 (checkpoint step-2 in flight)" in out.stdout
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders[0].startswith(".tmp-step-2-") and folders[1:] == ["step-1"], folders
    partial = tmp_path / "checkpoints" / folders[0]
    assert sorted(p.name for p in partial.iterdir()) == ["model.safetensors", "optimizer.safetensors", "state.json"]
    record = json.loads((tmp_path / "faults" / "kill@save=2.fired").read_text())
    assert record["step"] == 2 and record["rank"] == 0
    from trainer.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig

    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(), log=lambda _m: None)
    ck.cleanup_stale()  # the next attempt's start: the half-written one is removed, step-1 is used
    assert ck.select()[0] == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]


def test_kill_at_time_fires_from_a_timer_wherever_the_loop_is(tmp_path):
    """kill@time=0.3 (unsynchronised): a timer thread SIGKILLs the process while the main thread
    is busy elsewhere (here: sleeping inside a 'step'); the marker records the step reached."""
    code = f"""
import time
from trainer.faults import FaultInjector, parse_fault
inj = FaultInjector(parse_fault("kill@time=0.3"), {str(tmp_path)!r}, rank=0, world_size=1)
inj.start_clock()
for step in range(1, 100):
    time.sleep(0.05)
    inj.step = step
print("survived")
"""
    t0 = time.monotonic()
    out = _child(code, tmp_path)
    assert out.returncode == -9, out.stdout + out.stderr
    assert "survived" not in out.stdout and time.monotonic() - t0 < 60
    record = json.loads((tmp_path / "faults" / "kill@time=0.3.fired").read_text())
    assert 1 <= record["step"] < 99, record  # mid-loop (~6 steps of 0.05 s; a loaded machine fires later)
    assert not FaultInjector(parse_fault("kill@time=0.3"), tmp_path, rank=0, world_size=1).armed  # once per run dir

