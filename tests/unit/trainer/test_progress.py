"""Progress you can watch (issue 11.7): rank 0's progress line and the attempt's record
(through a real gang, the task log and MLflow: tests/system/trainer/test_progress.py)."""

from __future__ import annotations

import json

from trainer_fixtures import PROGRESS_LINE

from trainer.tracking import Progress, Tracker


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
    m = PROGRESS_LINE.match(lines[-1])
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
