"""Fixtures of the pipeline tests: one state dir per session, an uninterrupted baseline run."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_runs import FAST, FAST_RUNS, run_pipeline, setup_state


@pytest.fixture(scope="session")
def pipeline_home(tmp_path_factory) -> Path:
    """One state dir for the pipeline tests: runs follow each other as a user's would."""
    home = tmp_path_factory.mktemp("gangflow-home")
    setup_state(home)
    return home


def _baseline(home: Path, pipeline: str, log: Path) -> dict:
    summary, output, code = run_pipeline(home, FAST_RUNS[pipeline], log, pipeline=pipeline)
    assert code == 0, output[-6000:]
    return {"summary": summary, "output": output}


@pytest.fixture(scope="session")
def baseline(pipeline_home, tmp_path_factory) -> dict:
    """An uninterrupted run: the first in its registry, so it is promoted."""
    assert FAST_RUNS["digits"] is FAST
    return _baseline(pipeline_home, "digits", tmp_path_factory.mktemp("logs") / "baseline.log")


@pytest.fixture(scope="session")
def diabetes_home(tmp_path_factory) -> Path:
    """The diabetes drills' own state dir: their runs register gangflow-diabetes versions, and
    tests/system/dags/test_pipelines_end_to_end.py needs the first diabetes run on pipeline_home."""
    home = tmp_path_factory.mktemp("gangflow-home-diabetes")
    setup_state(home)
    return home


@pytest.fixture(scope="session")
def diabetes_baseline(diabetes_home, tmp_path_factory) -> dict:
    """An uninterrupted diabetes run at the drills' world size (FAST_RUNS["diabetes"])."""
    return _baseline(diabetes_home, "diabetes", tmp_path_factory.mktemp("logs") / "diabetes-baseline.log")
