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

    def torchrun(cmd, **kwargs):
        log_dir = Path(cmd[cmd.index("--log-dir") + 1])
        (log_dir / "run-id" / "attempt_0" / "0").mkdir(parents=True)
        (log_dir / "run-id" / "attempt_0" / "0" / "error.json").write_text("{}")
        seen.append(log_dir)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(baseline.subprocess, "run", torchrun)
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
