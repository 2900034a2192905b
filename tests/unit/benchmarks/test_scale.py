"""benchmarks/scale.py at its tiny size (issue 26 item 5): it runs, its last line is one JSON object
with each figure's ratio to its limit, and the growth it reports follows from the numbers. The full
run is a benchmark, never a test (benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmark_modules import benchmark_module

ROOT = Path(__file__).resolve().parents[3]
growth = benchmark_module("scale").growth


def test_growth_names_constant_linear_and_worse():
    assert growth([1, 10, 100], [2.0, 2.1, 1.9])["grows"] == "constant"
    assert growth([1, 10, 100], [1.0, 10.0, 100.0]) == {"slope": 1.0, "grows": "linear"}
    assert growth([1, 10, 100], [1.0, 100.0, 10000.0])["grows"] == "worse than linear"


def test_a_tiny_run_prints_its_ratios_as_the_last_line(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/scale.py", "--tiny", "--only", "checkpoint", "--only", "fetch", "--s3-max-mb", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tiny"] is True
    assert result["checkpoint_save_over_disk_bandwidth_0.03m"] > 0 and result["fetch_verify_over_read_hash_10mb"] > 0
    assert result["checkpoint"]["0.03m"]["params"] == 30_000 and result["checkpoint"]["0.03m"]["bytes"] > 30_000 * 8
    assert result["worst_size"]["checkpoint_save_over_disk"] == {"size": "0.03m", "ratio": result["checkpoint"]["0.03m"]["save_over_disk"]}
    assert "largest_gap" not in result  # the goals are at the largest sizes, which --tiny does not run
    assert "checkpoint save / disk write" in done.stdout  # the table, before the JSON line
