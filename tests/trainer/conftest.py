"""Helpers for the trainer tests: run the real trainer (python -m trainer / torchrun) in subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


def command(run_dir: Path, sets=SMALL, nproc: int | None = 2) -> list[str]:
    args = ["-m", "trainer", "--run-dir", str(run_dir), "--config", str(ROOT / "params.yaml")]
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
def digits() -> Path:
    folder = ROOT / "data" / "digits"
    if not (folder / "train.parquet").is_file():
        subprocess.run([PYTHON, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True)
    return folder


class Helpers:
    ROOT = ROOT
    SMALL = SMALL
    command = staticmethod(command)
    run = staticmethod(run)
    check_ok = staticmethod(check_ok)
    metrics = staticmethod(metrics)
    torchrun_exitcodes = staticmethod(torchrun_exitcodes)
    trainer_env = staticmethod(trainer_env)


@pytest.fixture(scope="session")
def h(digits) -> type[Helpers]:
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return Helpers
