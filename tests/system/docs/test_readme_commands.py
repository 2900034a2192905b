"""README's commands run as written, in a clone of the repository with the project's venv (listed
in COVERED of tests/unit/docs/test_readme.py): `make data` (DVC with the project's interpreter,
whatever `python` comes first on the caller's PATH; a failed repro keeps the data), the
trainer's torchrun line and `--help`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import PROJECT_ROOT, canonical, readme_commands

VENV = Path(sys.prefix)  # the project's venv: the clone's .venv points at it
TORCHRUN_LINE = ".venv/bin/torchrun --standalone --nproc-per-node 2 -m trainer --run-dir /tmp/run1 --set train.max_steps=300"


FOREIGN_PYTHON = """#!/bin/sh
# A Python that is not the project's (no site-packages: no pyarrow), first on the caller's PATH.
exec {base} -I -S "$@"
"""


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(PROJECT_ROOT), str(clone)], check=True, timeout=120)
    (clone / ".venv").symlink_to(VENV, target_is_directory=True)
    stamp = VENV / ".gangflow-installed"
    if stamp.exists():  # `make install` is up to date: the clone's pyproject/constraints are older than the venv
        old = stamp.stat().st_mtime - 60
        for name in ("pyproject.toml", "constraints.txt"):
            os.utime(clone / name, (old, old))
    return clone


def _env(clone: Path, foreign: Path) -> dict[str, str]:
    """A user's shell: the project's venv NOT on PATH, another `python` first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW", "MLFLOW", "AIRFLOW", "DVC", "VIRTUAL_ENV"))}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != (VENV / "bin").resolve()]
    return env | {"PATH": os.pathsep.join([str(foreign), *path]), "GANGFLOW_HOME": str(clone / ".gangflow"),
                  "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip


def _run(words: list[str], clone: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    assignments = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words[0].partition("=")
        assignments[name] = value
        words = words[1:]
    if words[0] == "make" and not (VENV / ".gangflow-installed").exists():
        words = [*words[:1], "-o", ".venv/.gangflow-installed", *words[1:]]  # a venv not made by make: do not reinstall it
    return subprocess.run(words, cwd=clone, env=env | assignments, capture_output=True, text=True, timeout=timeout)


def _digests(folder: Path) -> dict[str, str]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    assert files, f"{folder} is empty"
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest() for p in files}


def _set_param(clone: Path, old: str, new: str) -> None:
    params = clone / "params.yaml"
    text = params.read_text()
    assert old in text, old
    params.write_text(text.replace(old, new, 1))


@pytest.mark.slow
def test_make_data_uses_the_projects_interpreter_and_a_failed_repro_keeps_the_data(tmp_path):
    commands = readme_commands()
    clone = _clone(tmp_path)
    foreign = tmp_path / "foreign-bin"
    foreign.mkdir()
    (foreign / "python").write_text(FOREIGN_PYTHON.format(base=shlex.quote(os.path.realpath(sys._base_executable))))
    (foreign / "python").chmod(0o755)
    env = _env(clone, foreign)
    outs = [clone / "data" / "digits", clone / "data" / "diabetes"]

    # 1. `make data`, as README writes it: the stages run the project's interpreter although another
    #    `python` comes first on the caller's PATH, and rebuild the pinned versions byte for byte.
    done = _run(commands["make data"], clone, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pip install" not in done.stdout + done.stderr  # the venv was not reinstalled
    assert subprocess.run(["git", "diff", "--exit-code", "dvc.lock"], cwd=clone, capture_output=True).returncode == 0
    pinned = {out: _digests(out) for out in outs}

    # 2. The trainer's lines, as written (the run dir moved under the test's tmp dir).
    words = [str(tmp_path / "run1") if w == "/tmp/run1" else w for w in commands[canonical(TORCHRUN_LINE)]]
    done = _run(words, clone, env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    card = json.loads((tmp_path / "run1" / "final" / "model_card.json").read_text())
    assert card["metrics"]["test_accuracy"] > 0.9
    done = _run(commands[".venv/bin/python -m trainer --help"], clone, env)
    assert done.returncode == 0 and "--run-dir" in done.stdout, done.stderr[-3000:]

    # 3. The case: `.venv/bin/dvc repro` with the foreign `python` first (a changed param
    #    makes both stages run): they fail, say which interpreter to use, and the data stays.
    _set_param(clone, "seed: 20261129", "seed: 7")
    done = subprocess.run([".venv/bin/dvc", "repro"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stdout[-3000:]
    assert "run it with the project's interpreter" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    assert {out: _digests(out) for out in outs} == pinned

    # 4. `make data` with a stage that fails (a bad param): the error names it, the data stays.
    _set_param(clone, "seed: 7", "seed: 20261129")
    _set_param(clone, "test_fraction: 0.25", "test_fraction: 1.5")
    done = _run(commands["make data"], clone, env)
    assert done.returncode != 0
    assert "prepare.test_fraction=1.5" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    assert {out: _digests(out) for out in outs} == pinned
