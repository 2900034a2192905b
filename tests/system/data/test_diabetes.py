"""`dvc repro` of the project's stages in a clone of the repository, with the project's
interpreter first on PATH: both pinned versions are rebuilt byte for byte, and a failed repro
leaves the previous data whole (real DVC; tests/unit/data/test_diabetes.py checks the data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[3]
DVC = str(Path(sys.executable).with_name("dvc"))


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(PROJECT_ROOT), str(clone)], check=True, timeout=120)
    for rel in ("dvc.yaml", "dvc.lock", "params.yaml", "data/prepare.py"):  # the working tree's versions
        shutil.copy(PROJECT_ROOT / rel, clone / rel)
    return clone


@pytest.mark.slow
def test_dvc_repro_with_the_projects_interpreter_pins_both_versions_and_a_failure_keeps_the_data(tmp_path):
    from operators.hooks.dvc import pinned_version

    clone = _clone(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW", "DVC"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # what `make data` does
    done = subprocess.run([DVC, "repro"], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The same bytes as pinned in the committed dvc.lock: nothing to commit after a fresh repro.
    for out in ("data/digits", "data/diabetes"):
        assert pinned_version(clone, out) == pinned_version(PROJECT_ROOT, out)
    before = {p.name: p.read_bytes() for p in (clone / "data" / "digits").iterdir()}
    params = clone / "params.yaml"
    params.write_text(params.read_text().replace("test_fraction: 0.25", "test_fraction: 2"))
    failed = subprocess.run([DVC, "repro", "prepare"], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0 and "prepare.test_fraction=2" in failed.stdout + failed.stderr
    assert {p.name: p.read_bytes() for p in (clone / "data" / "digits").iterdir()} == before  # persist: true
