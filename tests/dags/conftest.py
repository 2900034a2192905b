"""Fixtures of the pipeline tests: one state dir per session, an uninterrupted baseline run."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_runs import FAST, run_pipeline, setup_state


@pytest.fixture(scope="session")
def pipeline_home(tmp_path_factory) -> Path:
    """One state dir for the pipeline tests: runs follow each other as a user's would."""
    home = tmp_path_factory.mktemp("gangflow-home")
    setup_state(home)
    return home


@pytest.fixture(scope="session")
def baseline(pipeline_home, tmp_path_factory) -> dict:
    """An uninterrupted run: the first in its registry, so it is promoted."""
    log = tmp_path_factory.mktemp("logs") / "baseline.log"
    summary, output, code = run_pipeline(pipeline_home, FAST, log)
    assert code == 0, output[-6000:]
    return {"summary": summary, "output": output}
