"""Shared fixtures. Tests mirror the package layout: tests/trainer, tests/operators, tests/dags, ..."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = Path(os.environ.get("GANGFLOW_SHARED", PROJECT_ROOT.parent / "shared"))


@pytest.fixture(scope="session")
def project_root() -> Path:
    return PROJECT_ROOT


@pytest.fixture(scope="session")
def crds_dir() -> Path:
    path = SHARED_DIR / "crds"
    if not path.is_dir():
        pytest.fail(f"upstream CRDs not found at {path}: set GANGFLOW_SHARED to the shared/ folder")
    return path
