"""The start-up probe that restart.py and pipeline.py use to split a launch into phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROBE = Path(__file__).resolve().parents[3] / "benchmarks" / "probe"


def test_process_start_is_between_the_launch_and_the_interpreter_being_up(tmp_path):
    # /proc/stat's btime is whole seconds: a process_start built on it came out up to a second
    # before the launch (0.38 s here), and the rank's interpreter start-up looked 10x too long.
    env = {**os.environ, "GANGFLOW_BENCH_PROBE": str(tmp_path), "PYTHONPATH": str(PROBE)}
    for _ in range(3):
        for old in tmp_path.glob("*.jsonl"):
            old.unlink()
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        t1 = time.time()
        (record,) = tmp_path.glob("*.jsonl")
        marks = {m["mark"]: m["t"] for m in map(json.loads, record.read_text().splitlines())}
        assert t0 - 0.02 <= marks["process_start"] <= marks["site"] <= t1  # /proc ticks are 10 ms
