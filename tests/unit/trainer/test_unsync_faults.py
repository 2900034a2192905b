"""Unsynchronised faults (issue 11.1, contract 3): `kill@save[=K]` and `kill@time=SECONDS`.

Each test says whether its fault is synchronised. The unit tests run the real FaultInjector and
Checkpointer in a child process that really SIGKILLs itself; the drills run the real trainer
under torchrun (2 ranks, gloo) and resume it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.errors import ConfigError
from trainer.faults import Fault, FaultInjector, parse_fault

ROOT = Path(__file__).resolve().parents[3]
RESUME = re.compile(r"^gangflow: resuming from checkpoint step-(\d+) \((.+)\)$", re.MULTILINE)


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
    injector.stop_clock()
    time.sleep(0.4)
    assert not injector.marker.exists() and injector.armed


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


# --- drills through the trainer: torchrun, 2 ranks, gloo ------------------------------------------

DRILL = ("train.max_steps=600", "checkpoint.every_steps=50", "train.log_every_steps=10")
INTERVAL = 50


@pytest.fixture(scope="module")
def drill_reference(h, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("unsync") / "reference"
    h.check_ok(h.run(run_dir, DRILL))
    return run_dir


def _final(run_dir: Path) -> bytes:
    return (run_dir / "final" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_kill_at_save_drill_resumes_from_the_last_committed_checkpoint(h, drill_reference, tmp_path):
    """kill@save=2 (unsynchronised) on the writer, rank 0, async saves: the first attempt dies while
    checkpoint step-100 is being written (the loop has moved on). The retry ignores and removes
    the half-written folder, resumes from step-50, loses <= 2 intervals, and ends bitwise equal
    to an uninterrupted run."""
    run_dir = tmp_path / "run"
    first = h.run(run_dir, DRILL, GANGFLOW_FAULT="kill@save=2,rank=0")
    assert first.returncode != 0 and -9 in h.torchrun_exitcodes(first.stdout), first.stdout[-3000:]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    partial = [n for n in names if n.startswith(".tmp-step-100-")]
    assert partial and "step-50" in names and "step-100" not in names, names
    assert not (run_dir / "checkpoints" / partial[0] / "manifest.json").exists()
    fired = json.loads((run_dir / "faults" / "kill@save=2_rank=0.fired").read_text())
    second = h.check_ok(h.run(run_dir, DRILL, GANGFLOW_FAULT="kill@save=2,rank=0"))
    assert "already fired in an earlier attempt" in second
    resumed = int(RESUME.search(second).group(1))
    assert resumed == 50
    assert fired["step"] - resumed <= 2 * INTERVAL, fired
    assert not any(p.name.startswith(".tmp-") for p in (run_dir / "checkpoints").iterdir())
    assert _final(run_dir) == _final(drill_reference)


@pytest.mark.slow
def test_kill_at_time_drill_on_rank_1_resumes_and_matches(h, drill_reference, tmp_path):
    """kill@time=1.5,rank=1 (unsynchronised): rank 1 is SIGKILLed by a timer mid-loop, with no
    barrier and no drain (rank 0 may be mid-step or mid-write). The retry resumes from the last
    committed checkpoint, loses <= 2 intervals, and ends bitwise equal to an uninterrupted run."""
    run_dir = tmp_path / "run"
    first = h.run(run_dir, DRILL, GANGFLOW_FAULT="kill@time=1.5,rank=1")
    assert first.returncode != 0, first.stdout[-3000:]
    marker = run_dir / "faults" / "kill@time=1.5_rank=1.fired"
    assert marker.is_file(), "the loop ended before the timer: make the drill longer\n" + first.stdout[-3000:]
    fired = json.loads(marker.read_text())
    assert fired["rank"] == 1 and 0 < fired["step"] < 600
    assert -9 in h.torchrun_exitcodes(first.stdout), first.stdout[-3000:]
    second = h.check_ok(h.run(run_dir, DRILL, GANGFLOW_FAULT="kill@time=1.5,rank=1"))
    match = RESUME.search(second)
    resumed = int(match.group(1)) if match else 0
    assert resumed % INTERVAL == 0 and resumed <= fired["step"]
    assert fired["step"] - resumed <= 2 * INTERVAL, (fired, resumed)
    assert _final(run_dir) == _final(drill_reference)


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below `root` (from /proc)."""
    parents, cmdlines = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdlines[int(entry)] = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found.update({pid: cmdlines.get(pid, "") for pid in frontier})
    return found


@pytest.mark.slow
def test_writer_process_killed_at_random_moments_costs_nothing(h, drill_reference, tmp_path):
    """Rude faults on the checkpoint writer process (what the OOM killer might pick): SIGKILL it
    again and again during a 2-rank run, alternately at a random moment and in the middle of a
    write (while a `.tmp-step-*` folder exists). The run still succeeds, no half-written folder is
    left, every committed checkpoint verifies, and the final weights are bitwise equal to an
    uninterrupted run."""
    import random
    import signal
    import threading

    from trainer.checkpoint import Checkpointer

    rng = random.Random(20261201)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(h.command(run_dir, DRILL), cwd=h.ROOT, env=h.trainer_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killed: list[int] = []

    def writing() -> bool:
        try:
            return any(name.startswith(".tmp-step-") for name in os.listdir(run_dir / "checkpoints"))
        except FileNotFoundError:
            return False

    def assassin() -> None:
        mid_write = False
        while proc.poll() is None:
            time.sleep(rng.uniform(0.3, 0.8))  # apart enough that one commit sees at most one kill
            mid_write = not mid_write
            # Find the writer first: a commit lasts a few milliseconds, less than a scan of /proc.
            writers = [pid for pid, cmdline in _descendants(proc.pid).items() if "trainer.checkpoint_commit" in cmdline]
            deadline = time.monotonic() + 2.0
            while mid_write and not writing() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.0002)
            for pid in writers:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass

    thread = threading.Thread(target=assassin, daemon=True)
    thread.start()
    out, _ = proc.communicate(timeout=300)
    thread.join(timeout=5)
    assert proc.returncode == 0, out[-4000:]
    assert len(set(killed)) >= 2, f"the writer was killed {len(set(killed))} times: make the drill longer\n{out[-2000:]}"
    assert "starting a new writer and committing step-" in out, "no kill landed in the middle of a commit"
    for name in sorted(p.name for p in (run_dir / "checkpoints").iterdir()):
        assert name.startswith("step-"), name  # nothing half-written left behind
        Checkpointer.verify(run_dir / "checkpoints" / name)
    assert _final(run_dir) == _final(drill_reference)
