"""A temp state dir with its own MLflow SQLite store, per test module (`home`, `client` fixtures)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One temp state dir (so one SQLite store) per module: MLflow's migrations take seconds.

    The cwd moves to an empty folder meanwhile: anything that ignored the tracking URI and fell
    back to MLflow's defaults (./mlflow.db, ./mlruns) would show up there.
    """
    path = tmp_path_factory.mktemp("gangflow-home")
    cwd = tmp_path_factory.mktemp("cwd")
    mp = pytest.MonkeyPatch()
    mp.setenv("GANGFLOW_HOME", str(path))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.chdir(cwd)
    yield path
    mp.undo()
    assert not list(cwd.iterdir()), f"MLflow wrote to the cwd: {list(cwd.iterdir())}"


@pytest.fixture(scope="module")
def client(home):
    from operators.hooks import mlflow as tracking

    return tracking.get_client()
