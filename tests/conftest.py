"""Shared fixtures. Tests mirror the package layout: tests/trainer, tests/operators, tests/dags, ..."""

from __future__ import annotations

from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Upstream CRDs vendored in the package (operators/kubernetes/crds/README.md names their commits):
# the tests need nothing beside the repository (contract 8, docs/contracts.md).
CRDS_DIR = PROJECT_ROOT / "operators" / "kubernetes" / "crds"


@pytest.fixture(scope="session")
def project_root() -> Path:
    return PROJECT_ROOT


@pytest.fixture(scope="session")
def crds_dir() -> Path:
    if not any(CRDS_DIR.glob("*.yaml")):
        pytest.fail(f"vendored upstream CRDs missing under {CRDS_DIR}: restore them from git or run operators/kubernetes/crds/refresh.py")
    return CRDS_DIR
