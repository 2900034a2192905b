"""Helpers for the trainer tests: run the real trainer (python -m trainer / torchrun) in subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# Small, fast runs: 60 steps, a checkpoint every 20.
SMALL = ("train.max_steps=60", "checkpoint.every_steps=20", "train.log_every_steps=10")


def trainer_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GANGFLOW_FAULT", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "TORCHELASTIC_ERROR_FILE",
                        "GANGFLOW_TERMINATION_LOG", "RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("OMPI_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


# A private copy of the digits data (set by the `digits` fixture): other work in the same tree
# may rebuild data/digits while these tests run.
DATA: dict[str, Path] = {}


def command(run_dir: Path, sets=SMALL, nproc: int | None = 2) -> list[str]:
    args = ["-m", "trainer", "--run-dir", str(run_dir), "--config", str(ROOT / "params.yaml")]
    if DATA:
        sets = (f"data.train_path={DATA['train']}", f"data.test_path={DATA['test']}", *sets)
    for item in sets:
        args += ["--set", item]
    if nproc is None:
        return [PYTHON, *args]
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0", *args]


def run(run_dir: Path, sets=SMALL, nproc: int | None = 2, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run the trainer to completion; stdout+stderr together in `.stdout`."""
    proc = subprocess.run(command(run_dir, sets, nproc), cwd=ROOT, env=trainer_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc


def check_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun_exitcodes(output: str) -> list[int]:
    """Child exit codes torchrun reported in its failure summary."""
    return [int(m) for m in re.findall(r"^\s+exitcode\s+:\s+(-?\d+)", output, re.MULTILINE)]


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    """A private copy of data/digits ({train,test}.parquet), built first if missing."""
    folder = ROOT / "data" / "digits"
    copy = tmp_path_factory.mktemp("digits")
    for attempt in range(3):
        try:
            if not (folder / "train.parquet").is_file() or not (folder / "test.parquet").is_file():
                subprocess.run([PYTHON, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True,
                               capture_output=True, timeout=300)
            for name in ("train.parquet", "test.parquet"):
                shutil.copyfile(folder / name, copy / name)
            break
        except (OSError, subprocess.CalledProcessError):
            if attempt == 2:
                raise
            time.sleep(1)
    DATA.update(train=copy / "train.parquet", test=copy / "test.parquet")
    return copy


def root_cause_exitcode(output: str) -> int | None:
    """The exit code of torchrun's "Root Cause (first observed failure)"."""
    _, _, tail = output.partition("Root Cause (first observed failure)")
    codes = torchrun_exitcodes(tail)
    return codes[0] if codes else None


class Helpers:
    ROOT = ROOT
    SMALL = SMALL
    command = staticmethod(command)
    run = staticmethod(run)
    check_ok = staticmethod(check_ok)
    metrics = staticmethod(metrics)
    torchrun_exitcodes = staticmethod(torchrun_exitcodes)
    root_cause_exitcode = staticmethod(root_cause_exitcode)
    trainer_env = staticmethod(trainer_env)


@pytest.fixture(scope="session")
def h(digits) -> type[Helpers]:
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return Helpers
