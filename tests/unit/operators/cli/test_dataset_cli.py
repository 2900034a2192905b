"""`python -m operators.cli.dataset publish|validate --pipeline NAME` and `make demo PIPELINE=x`
publishing only x's dataset (issue 23, item 6)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline_runs import PROJECT_ROOT, pipeline_env


def test_make_demo_publishes_only_its_pipelines_dataset():
    """`make demo PIPELINE=x` reproduces x's DVC stage only (make setup publishes every pipeline)."""
    done = subprocess.run(["make", "-n", "demo", "PIPELINE=diabetes"], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert "operators.cli.setup --pipeline diabetes" in done.stdout, done.stdout
    done = subprocess.run(["make", "-n", "setup"], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert "operators.cli.setup" in done.stdout and "--pipeline" not in done.stdout


def test_setup_selects_the_named_pipeline_or_refuses_an_unknown_one():
    from operators.cli.setup import selected_pipelines
    from operators.config.pipelines import PipelineConfigError

    assert [p.name for p in selected_pipelines("diabetes")] == ["diabetes"]
    assert [p.name for p in selected_pipelines(None)] == ["charlm", "diabetes", "digits-cnn", "digits-lightning", "digits"]
    with pytest.raises(PipelineConfigError, match="known pipelines: charlm, diabetes, digits-cnn, digits-lightning, digits"):
        selected_pipelines("cancer")


def test_the_dataset_cli_names_the_pipeline_and_refuses_an_unknown_one(tmp_path):
    done = subprocess.run([sys.executable, "-m", "operators.cli.dataset", "validate", "--pipeline", "cancer"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, env=pipeline_env(tmp_path / "home"), timeout=120)  # fmt: skip
    assert done.returncode == 2 and "pipeline='cancer'" in done.stderr and "known pipelines" in done.stderr
    done = subprocess.run([sys.executable, "-m", "operators.cli.dataset", "--help"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert "publish" in done.stdout and "validate" in done.stdout
