"""trainer.datastore against a real `dvc add` + `dvc push` (tests/unit/trainer/test_datastore.py
has the data store's unit tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from trainer_fixtures import DATASET_FILES

from trainer.datastore import dir_listing, fetch_dataset, listing_digest


@pytest.mark.slow
def test_against_a_real_dvc_push(tmp_path):
    """`dvc add` + `dvc push` into a local remote; the version is the .dir md5 dvc records."""
    dvc = str(Path(sys.executable).with_name("dvc"))
    repo = tmp_path / "repo"
    (repo / "digits").mkdir(parents=True)
    for name in ("train.parquet", "test.parquet"):
        (repo / "digits" / name).write_bytes(DATASET_FILES[name])
    remote = tmp_path / "dvc-remote"
    for args in (["init", "--no-scm", "-q"], ["remote", "add", "-d", "local", str(remote)], ["add", "-q", "digits"],
                 ["push", "-q"]):
        out = subprocess.run([dvc, *args], cwd=repo, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
    import yaml

    version = yaml.safe_load((repo / "digits.dvc").read_text())["outs"][0]["md5"].removesuffix(".dir")
    got = fetch_dataset(f"file://{remote}", version, tmp_path / "scratch")
    assert got["train.parquet"].read_bytes() == DATASET_FILES["train.parquet"]
    assert listing_digest(dir_listing(str(remote), version)) == version
