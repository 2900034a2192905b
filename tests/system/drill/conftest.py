"""The drill tests' state dir: one per test session (per xdist worker), prepared once; the drills
of a worker follow each other on it, each with its own S3-API server, MLflow server and cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_runs import setup_state


@pytest.fixture(scope="session")
def drill_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("gangflow-drill-home")
    setup_state(home)
    return home
