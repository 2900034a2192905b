"""Shared fixtures, and the pytest-xdist groups. Unit tests mirror the package layout under tests/unit;
tests/system holds the DAG runs, torchrun drills, the cluster drill and the browser."""

from __future__ import annotations

from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Upstream CRDs vendored in the package (operators/kubernetes/crds/README.md names their commits):
# the tests need nothing beside the repository (contract 8, docs/contracts.md).
CRDS_DIR = PROJECT_ROOT / "operators" / "kubernetes" / "crds"


# Under pytest-xdist (`make test`: `-n 2 --dist loadfile`) a worker builds every session fixture it uses
# for itself. A folder whose tests must share one (ui: the Airflow it starts) counts as one file. The
# DAG runs, the longest folder, are two such groups side by side, each with a state dir of its own
# (pipeline_home: about a minute to set up); no test there reads what a test of the other group left.
# The drill files need no group: each drill brings its own servers, and a worker prepares one
# drill_home for all the drill files it runs. (The xdist_group marks of --dist loadgroup are lost
# under pytest 9: xdist 3.8 renames item._nodeid.)
ONE_WORKER_FOLDERS = ("tests/system/dags/", "tests/system/ui/")
SECOND_DAG_GROUP = ("test_baseline.py", "test_byo_pipeline.py", "test_checkpoint_auto_pipeline.py", "test_demo_cli.py",
                    "test_framework_pipelines.py", "test_prometheus.py")


def worker_scope(path: str) -> str:
    """The scheduling unit of a test file: its folder when that is one of ONE_WORKER_FOLDERS."""
    folder = next((folder for folder in ONE_WORKER_FOLDERS if path.startswith(folder)), None)
    if folder is None:
        return path
    if folder == "tests/system/dags/" and path.removeprefix(folder).split("::")[0] in SECOND_DAG_GROUP:
        return folder + "(second group)"
    return folder


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    # Collection order, not xdist's default of most tests first: tests/system (the long DAG runs and
    # drills) then tests/unit, so the short unit files fill the end instead of a DAG group.
    config.option.loadscopereorder = False

    class LoadFileOrFolder(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(super()._split_scope(nodeid))

    return LoadFileOrFolder(config, log)


@pytest.fixture(scope="session")
def project_root() -> Path:
    return PROJECT_ROOT


@pytest.fixture(scope="session")
def crds_dir() -> Path:
    if not any(CRDS_DIR.glob("*.yaml")):
        pytest.fail(f"vendored upstream CRDs missing under {CRDS_DIR}: restore them from git or run operators/kubernetes/crds/refresh.py")
    return CRDS_DIR


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test leaves os.environ as it found it: code under test writes to it (trainer.distributed
    exports RANK/WORLD_SIZE; trainer.user its runtime variables), and monkeypatch restores only the keys
    it touched, so a leaked RANK made a later test's trainer wait silently for peers that never come."""
    import os

    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)
