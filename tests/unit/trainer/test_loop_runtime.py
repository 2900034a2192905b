"""gangflow's own loop is a user of the runtime API (issue 22): each run opens exactly one
`trainer.runtime.Session`, and its metrics, step bookkeeping, checkpoints, fault drills and
preemption go through it. The runtime does not import the loop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SESSION_CALLS = ("__init__", "report", "step_done", "save_snapshot", "preempted", "close")


@pytest.fixture()
def loop_run(digits, tmp_path, monkeypatch):
    """Run gangflow's loop in this process on one CPU rank (trainer.loop.run, as the entry point
    does): (run_dir, fault spec) -> exit code."""
    from trainer import loop
    from trainer.config import load_config
    from trainer.distributed import Launch
    from trainer.faults import parse_fault
    from trainer.preemption import Preemption

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GANGFLOW_FAULT", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID",
                "GANGFLOW_METRICS_PORT"):
        monkeypatch.delenv(key, raising=False)
    previous = signal.getsignal(signal.SIGTERM)
    preemptions: list[Preemption] = []

    def go(run_dir: Path, fault: str | None = None) -> int:
        cfg = load_config(ROOT / "params.yaml", [
            f"data.train_path={digits / 'train.parquet'}", f"data.test_path={digits / 'test.parquet'}",
            "train.max_steps=30", "checkpoint.every_steps=10", "train.log_every_steps=10", "train.device=cpu",
            "tracking.progress_every_s=0"])
        preempt = Preemption(600.0)  # the watchdog never ends this test process; disarmed below
        preempt.install()
        preemptions.append(preempt)
        return loop.run(cfg, parse_fault(fault), Launch(0, 1, 0, "single"), run_dir, preempt)

    yield go
    for preempt in preemptions:
        preempt.disarm()
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture()
def session_calls(monkeypatch) -> dict[str, list]:
    """Every call of the runtime Session's methods below: name -> [(session, args, kwargs)]."""
    from trainer import runtime

    calls: dict[str, list] = defaultdict(list)
    for name in SESSION_CALLS:
        original = getattr(runtime.Session, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls[_name].append((self, args, kwargs))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(runtime.Session, name, spy)
    return calls


def _steps(calls: list) -> list[int]:
    return [args[0] if args else kwargs["step"] for _, args, kwargs in calls]


def test_the_loops_pieces_are_made_once_by_the_runtime(loop_run, tmp_path, monkeypatch):
    """The tracker, progress, checkpointer, fault injector and stop agreement of a loop run are
    made once each, by trainer.runtime (the loop builds none of them itself)."""
    from trainer import checkpoint, distributed, faults, tracking

    makers: dict[str, list[str]] = defaultdict(list)
    for owner, name in ((tracking, "Tracker"), (tracking, "Progress"), (checkpoint, "Checkpointer"),
                        (faults, "FaultInjector"), (distributed, "StopAgreement")):
        cls = getattr(owner, name)

        def init(self, *args, _original=cls.__init__, _name=name, **kwargs):
            makers[_name].append(sys._getframe(1).f_globals["__name__"])
            _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", init)
    assert loop_run(tmp_path / "run") == 0
    assert dict(makers) == {name: ["trainer.runtime"] for name in
                            ("Tracker", "Progress", "Checkpointer", "FaultInjector", "StopAgreement")}


def test_the_loop_trains_on_one_runtime_session(loop_run, session_calls, tmp_path):
    """One Session per run; the loop's metrics (run.report), step bookkeeping (run.step_done),
    checkpoints (run.save_snapshot, contract 2's layout) and ending (run.close) go through it."""
    from trainer import runtime

    run_dir = tmp_path / "run"
    assert loop_run(run_dir) == 0
    calls = session_calls
    [(session, _, _)] = calls["__init__"]
    assert type(session) is runtime.Session and runtime.current() is None  # not a user's Run
    assert all(call[0] is session for name in SESSION_CALLS for call in calls[name])
    assert _steps(calls["report"]) == [10, 20, 30]
    assert _steps(calls["step_done"]) == list(range(1, 31))
    assert [args[0].step for _, args, _ in calls["save_snapshot"]] == [10, 20, 30]
    assert [kwargs["status"] if "status" in kwargs else args[0] for _, args, kwargs in calls["close"]][:1] == ["FINISHED"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-20", "step-30"]
    assert {"model.safetensors", "optimizer.safetensors", "state.json", "manifest.json"} <= {
        p.name for p in (run_dir / "checkpoints" / "step-30").iterdir()}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in records if "loss" in r and "event" not in r]
    assert [r["step"] for r in lines] == [10, 20, 30]
    assert set(lines[0]) == {"step", "loss", "lr", "samples_per_sec", "epoch", "step_time_s", "time"}
    assert isinstance(lines[0]["epoch"], int)  # as the loop always wrote it
    assert [r["event"] for r in records if r.get("event") in ("start", "final", "attempt")] == ["start", "final", "attempt"]


def test_a_term_fault_preempts_the_loop_through_the_runtime_and_the_retry_resumes(loop_run, session_calls, tmp_path, capsys):
    """term@step=15: the runtime's step_done fires it after the step (SIGTERM to this process);
    run.should_stop stops the loop, which commits step-15 and ends through run.preempted: exit 75
    and contract 1's log line. The retry resumes from step-15; the fault is spent (its marker)."""
    run_dir = tmp_path / "run"
    assert loop_run(run_dir, "term@step=15") == 75
    calls = session_calls
    assert len(calls["__init__"]) == 1
    assert _steps(calls["step_done"]) == list(range(1, 16))
    [(_, args, kwargs)] = calls["preempted"]
    assert (args or (kwargs["saved"],))[0] == "checkpoint step-15 committed"
    out = capsys.readouterr().out
    assert "gangflow: preempted (SIGTERM): stopped at step 15; checkpoint step-15 committed " in out
    assert out.rstrip().endswith("exiting with 75")
    assert (run_dir / "faults" / "term@step=15.fired").is_file()

    assert loop_run(run_dir, "term@step=15") == 0
    assert len(calls["__init__"]) == 2
    assert "gangflow: resuming from checkpoint step-15 (" in capsys.readouterr().out
    assert _steps(calls["step_done"])[15:] == list(range(16, 31))


def test_the_runtime_does_not_import_the_loop():
    """The dependency points one way: trainer.loop imports trainer.runtime, never the reverse."""
    code = "import sys, trainer.runtime; print(sorted(m for m in sys.modules if m == 'trainer.loop'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
