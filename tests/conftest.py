"""Shared fixtures, and the pytest-xdist groups. Unit tests mirror the package layout under tests/unit;
tests/system holds the DAG runs, torchrun drills, the cluster drill and the browser."""

from __future__ import annotations

from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Upstream CRDs vendored in the package (operators/kubernetes/crds/README.md names their commits):
# the tests need nothing beside the repository (contract 8, docs/contracts.md).
CRDS_DIR = PROJECT_ROOT / "operators" / "kubernetes" / "crds"


# Under pytest-xdist (`make test`: `-n 2 --dist loadgroup`) a worker builds every session fixture it uses
# for itself: tests sharing one that prepares a state dir stay on one worker. A folder of these is one
# group (dags: pipeline_home and the baselines; drill: drill_home; ui: the Airflow it starts); every
# other file is a group of its own, so its module fixtures (a reference run, an MLflow store) are built once.
ONE_WORKER_FOLDERS = {PROJECT_ROOT / "tests" / "system" / name for name in ("dags", "drill", "ui")}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = next((f for f in ONE_WORKER_FOLDERS if f in item.path.parents), None)
        group = (folder or item.path).relative_to(PROJECT_ROOT).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def project_root() -> Path:
    return PROJECT_ROOT


@pytest.fixture(scope="session")
def crds_dir() -> Path:
    if not any(CRDS_DIR.glob("*.yaml")):
        pytest.fail(f"vendored upstream CRDs missing under {CRDS_DIR}: restore them from git or run operators/kubernetes/crds/refresh.py")
    return CRDS_DIR
