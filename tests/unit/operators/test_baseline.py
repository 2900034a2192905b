"""The baseline's comparison (operators/baseline.py): direction per figure, the threshold, and the
first baseline with nothing to compare with. The DAG twice: tests/system/dags/test_baseline.py."""

from __future__ import annotations

import subprocess

import pytest
import tempfile
from pathlib import Path

from operators import baseline
from operators.baseline import compare, higher_is_better, regression_message


def test_directions():
    assert higher_is_better("allreduce_busbw_gbps_r2_1mb") and higher_is_better("storage_read_mbps")
    assert not higher_is_better("step_time_ms_digits_r2")


def test_only_figures_worse_beyond_the_threshold_regress():
    accepted = {"allreduce_busbw_gbps_r2_1mb": 10.0, "storage_read_mbps": 100.0, "step_time_ms_digits_r1": 10.0, "gone": 1.0}
    now = {"allreduce_busbw_gbps_r2_1mb": 7.0, "storage_read_mbps": 80.0, "step_time_ms_digits_r1": 13.0, "new": 5.0}
    result = compare(now, accepted, threshold=0.25, accepted_run="r1")
    assert result.compared_with == "r1"
    assert [(r["figure"], r["worse_by"]) for r in result.regressions] == [("allreduce_busbw_gbps_r2_1mb", 0.3),
                                                                         ("step_time_ms_digits_r1", 0.3)]
    summary = {"regressions": result.regressions, "threshold": 0.25, "compared_with": "r1"}
    assert regression_message(summary).startswith("2 figure(s) regressed beyond 25% against accepted baseline r1: allreduce_busbw_gbps_r2_1mb 7 vs 10")


def test_better_figures_and_the_first_baseline_do_not_regress():
    assert compare({"step_time_ms_x_r1": 5.0}, {"step_time_ms_x_r1": 10.0}, threshold=0.1).regressions == []
    first = compare({"step_time_ms_x_r1": 5.0}, None, threshold=0.1)
    assert (first.compared_with, first.regressions) == (None, [])


def test_a_gang_leaves_nothing_in_the_machines_temp_folder(tmp_path, monkeypatch):
    """torchrun writes its ranks' error files under a temp folder of its own when no --log-dir is
    given, and never removes it: the baseline names one and removes it after the gang."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    class Torchrun:  # what the gang leaves in its --log-dir, without a gang
        returncode = 0

        def __init__(self, cmd, **kwargs):
            log_dir = Path(cmd[cmd.index("--log-dir") + 1])
            (log_dir / "run-id" / "attempt_0" / "0").mkdir(parents=True)
            (log_dir / "run-id" / "attempt_0" / "0" / "error.json").write_text("{}")
            seen.append(log_dir)

        def communicate(self, timeout=None):
            return "", None

    monkeypatch.setattr(baseline.subprocess, "Popen", Torchrun)
    baseline._torchrun(2, ["trainer.collectives", "--out", "x"], cwd=tmp_path, timeout_s=5)
    assert seen and seen[0].is_relative_to(tmp_path) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), 0, -0.1, True])
def test_a_threshold_that_is_not_a_finite_fraction_is_refused(threshold):
    """NaN compares false with everything: a regressed baseline was recorded as accepted."""
    from operators.exceptions import InvalidParams

    with pytest.raises(InvalidParams, match="threshold=.*must be a finite fraction > 0"):
        compare({"storage_read_mbps": 1.0}, {"storage_read_mbps": 100.0}, threshold=threshold)


def test_the_baseline_form_refuses_a_nan_threshold():
    """`--conf '{"threshold": NaN}'` (Python's json reads NaN) passed the Param's schema."""
    import importlib.util
    import json

    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("baseline_dag_under_test", root / "dags" / "platform_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    params = ParamsDict()
    params.update(module.platform_baseline().params)
    with pytest.raises(ParamValidationError, match="threshold"):
        params.update(json.loads('{"threshold": NaN}'))  # the merge validates, as the worker's does
        params.validate()


def test_a_measurement_past_its_time_limit_leaves_no_rank_running(tmp_path):
    """subprocess.run's timeout killed torchrun's agent only: its ranks (each in a session of its own)
    ran on, sharing the machine with every later measurement and gang."""
    import os
    import signal
    import time

    from operators.config import settings
    from operators.exceptions import GangflowError

    marker = str(tmp_path / "orphan.json")

    def ranks() -> list[int]:
        listing = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
        return [int(line.split()[0]) for line in listing.splitlines() if marker in line and "trainer.collectives" in line]

    with pytest.raises(GangflowError, match=r"trainer.collectives on 2 rank\(s\) did not finish within 20 s"):
        baseline._torchrun(2, ["trainer.collectives", "--out", marker, "--sizes", "67108864", "--iters", "100000"],
                           cwd=settings.PROJECT_ROOT, timeout_s=20)
    time.sleep(1)
    left = ranks()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_a_broken_pipeline_file_hides_no_other_pipelines_step_time(tmp_path, monkeypatch):
    """measure_step_time read every pipeline with load_pipelines(), which raises the first broken
    file's error: `pipelines: ["digits"]` failed on another team's broken file."""
    from operators.config import pipelines as pipeline_module
    from operators.config.pipelines import PipelineConfigError

    root = Path(__file__).resolve().parents[3]
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "digits.yaml").write_text((root / "pipelines" / "digits.yaml").read_text())
    (folder / "other.yaml").write_text("name: other\n")
    monkeypatch.setenv("GANGFLOW_PIPELINES", str(folder))
    measured: list[list[str]] = []

    def fake_gang(nproc, module_args, **_):  # no gang: which pipelines are measured is under test
        run_dir = Path(module_args[module_args.index("--run-dir") + 1])
        (run_dir / "metrics.jsonl").write_text('{"step": 5, "step_time_s": 0.1}\n{"step": 10, "step_time_s": 0.2}\n')
        measured.append(module_args)

    monkeypatch.setattr(baseline, "_torchrun", fake_gang)
    lines: list[str] = []
    try:
        assert set(baseline.measure_step_time(2, pipelines=["digits"], log=lines.append)) == {
            "step_time_ms_digits_r1", "step_time_ms_digits_r2"}
        assert set(baseline.measure_step_time(2, log=lines.append)) == {"step_time_ms_digits_r1", "step_time_ms_digits_r2"}
        assert any("step time of other: not measured, its pipeline file is broken" in line for line in lines)
        with pytest.raises(PipelineConfigError, match="other.yaml"):
            baseline.measure_step_time(2, pipelines=["other"], log=lines.append)
    finally:
        pipeline_module._pipeline_files.cache_clear()
