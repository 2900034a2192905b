"""The drill tests' state dir: one per test module (a module's drills follow each other on it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_runs import setup_state


@pytest.fixture(scope="module")
def drill_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("gangflow-drill-home")
    setup_state(home)
    return home
