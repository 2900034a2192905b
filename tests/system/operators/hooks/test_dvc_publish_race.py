"""Two dataset publishes at once in one project (two `make demo`s, two test workers setting up their
state dirs from a fresh clone): the second waits for the first instead of failing with DVC's
"... is busy, it is being blocked by" (operators.hooks.dvc.publish)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[4]
PROJECT_FILES = ("data/prepare.py", "params.yaml", "dvc.yaml", "dvc.lock", ".gitignore")

pytestmark = pytest.mark.slow


def test_two_publishes_at_once_both_give_the_pinned_version(tmp_path):
    from dvc.repo import Repo

    root = tmp_path / "project"  # as a fresh clone: the pipeline files, no data, empty cache
    for rel in PROJECT_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT_ROOT / rel, root / rel)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    Repo.init(str(root)).close()
    pinned = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["prepare"]["outs"][0]["md5"].removesuffix(".dir")
    code = f"from operators.hooks import dvc; print(dvc.publish({str(root)!r}))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW", "DVC"))}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=PROJECT_ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**env, "GANGFLOW_HOME": str(tmp_path / f"home-{i}")})
             for i in range(2)]  # fmt: skip
    outcomes = [(*p.communicate(timeout=300), p.returncode) for p in procs]
    for out, err, returncode in outcomes:
        assert returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == pinned
