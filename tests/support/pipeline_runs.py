"""Helpers that run the real DAG through `python -m operators.cli.demo` (Airflow on SQLite, MLflow on SQLite,
DVC local remote, torchrun with gloo), each run in a subprocess: Airflow binds its config at import.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Small, fast runs: 60 steps on 2 ranks, a checkpoint every 10. Sixty steps reach about 0.88
# test accuracy (the default 600 reach > 0.95), so the floor is lowered to match.
FAST = {"max_steps": 60, "checkpoint_every_steps": 10, "world_size": 2, "promotion_floor": 0.8}
# The same small runs per pipeline (the drills are parametrised over these); the diabetes gate
# keeps its own ceiling (an RMSE, lower is better).
FAST_RUNS = {"digits": FAST, "diabetes": {"max_steps": 60, "checkpoint_every_steps": 10, "world_size": 2}}
# The killed-rank drills of the BYO and framework pipelines: rank 1 dies as it hands its second
# checkpoint over (unsynchronised), so the first is committed however slow the machine is (a timer
# could fire before it on a loaded one).
KILL_AT_SECOND_SAVE = "kill@save=2,rank=1"


def pipeline_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "GANGFLOW"))}
    env |= {"GANGFLOW_HOME": str(home), "GANGFLOW_RETRY_BASE_DELAY": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return env | extra


def last_line_of_python(code: str, home: Path, timeout: float = 120, **env: str) -> str:
    """Run `code` in a fresh interpreter on state dir `home` (Airflow binds its config at import); its last stdout line."""
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=pipeline_env(home, **env), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def setup_state(home: Path) -> None:
    subprocess.run([sys.executable, "-m", "operators.cli.setup"], cwd=PROJECT_ROOT, env=pipeline_env(home), check=True, timeout=600)


def start_pipeline(home: Path, conf: dict, log: Path, *, pipeline: str = "digits", **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "operators.cli.demo", "--pipeline", pipeline, "--conf", json.dumps(conf)],
        cwd=PROJECT_ROOT, env=pipeline_env(home, **env), stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, log: Path, timeout: float = 900) -> tuple[dict, str, int]:
    """The demo's summary, its output preceded by the Airflow log it names, and its exit code."""
    code = proc.wait(timeout)
    output = log.read_text()
    last = output.strip().splitlines()[-1] if output.strip() else ""
    named = re.search(r"Airflow's log: (\S+)", output)
    if named and Path(named.group(1)).is_file():  # the demo's account is short; Airflow's lines are there
        output = Path(named.group(1)).read_text(errors="replace") + output
    try:
        summary = json.loads(last)
    except ValueError:
        pytest.fail(f"the last line of {log.name} is not JSON (exit {code}):\n{output[-6000:]}")
    return summary, output, code


def run_pipeline(home: Path, conf: dict, log: Path, *, pipeline: str = "digits", **env: str) -> tuple[dict, str, int]:
    return finish(start_pipeline(home, conf, log, pipeline=pipeline, **env), log)


def dag_run_folder(home: Path, summary: dict) -> Path:
    """The run dir of the DAG run `summary` describes (runs/<dag_id>/<run key>): runs of other tests
    share the state dir, so a glob over runs/ alone would find theirs too."""
    from operators.config.settings import run_stem

    (folder,) = Path(home).glob(f"runs/*/{run_stem(summary['dag_run_id'])}-*")
    return folder


def failure_record(home: Path, summary: dict, attempt: int = 1) -> dict:
    """The failure record of the DAG run's try `attempt` (failures/try-<n>.json in its run dir)."""
    return json.loads((dag_run_folder(home, summary) / "failures" / f"try-{attempt}.json").read_text())
