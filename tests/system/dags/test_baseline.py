"""`make baseline` (issue 26 item 4): the platform_baseline DAG run twice on one state dir; the first
has nothing to compare with, the second compares with the first (the accepted baseline), and a
regression seeded into the accepted baseline's MLflow figures is named, failing the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pipeline_runs import PROJECT_ROOT, pipeline_env

CONF = {"pipelines": ["digits"], "step_time_steps": 10}


def _baseline(home, log):
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "operators.cli.baseline", "--conf", json.dumps(CONF)], cwd=PROJECT_ROOT,
                              env=pipeline_env(home), stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    output = log.read_text()
    return json.loads(output.strip().splitlines()[-1]), output, code


@pytest.mark.slow
def test_the_second_baseline_compares_with_the_first_and_names_a_regression(pipeline_home, tmp_path):
    first, output, code = _baseline(pipeline_home, tmp_path / "first.log")
    assert code == 0, output[-6000:]
    assert first["compared_with"] is None and first["regressions"] == [] and first["state"] == "success"
    figures = {k: v for k, v in first.items() if isinstance(v, float)}
    for name in ("allreduce_algbw_gbps_r1_1mb", "allreduce_busbw_gbps_r2_1mb", "storage_read_mbps",
                 "step_time_ms_digits_r1", "step_time_ms_digits_r2"):
        assert figures[name] > 0, name
    assert {"runtime", "image", "driver_version", "torch_version"} <= set(first["environment"])

    # Seed a regression: the accepted baseline's read throughput, 100 times what was measured.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{pipeline_home / 'mlflow.db'}")
    run = client.get_run(first["run_id"])
    assert run.data.tags["gangflow.baseline.accepted"] == "true"
    assert run.data.tags["gangflow.baseline.torch_version"] == first["environment"]["torch_version"]
    client.log_metric(first["run_id"], "storage_read_mbps", figures["storage_read_mbps"] * 100)

    second, output, code = _baseline(pipeline_home, tmp_path / "second.log")
    assert second["compared_with"] == first["run_id"]
    named = [r["figure"] for r in second["regressions"]]
    assert "storage_read_mbps" in named, second["regressions"]
    assert code == 1 and second["state"] == "failed"
    assert "BaselineRegressed" in output and "storage_read_mbps" in output  # the check task's failure names it
    assert client.get_run(second["run_id"]).data.tags["gangflow.baseline.accepted"] == "false"
