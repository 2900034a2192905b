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

from trainer.faults import marker_name

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# Small, fast runs: 60 steps, a checkpoint every 20.
SMALL = ("train.max_steps=60", "checkpoint.every_steps=20", "train.log_every_steps=10")
# The trainer's resume line and rank 0's progress line (trainer.tracking.Progress).
RESUME = re.compile(r"^gangflow: resuming from checkpoint step-(\d+) \((.+)\)$", re.MULTILINE)
PROGRESS_LINE = re.compile(r"gangflow: progress: step (\d+)/(\d+) \(\d+%\), loss (-|\d+\.\d{4}), (\d+) samples/s, "
                           r"ETA (\d+:\d\d:\d\d|-), last checkpoint step (none|\d+)$")
# A dataset version's files, for the data-store tests.
DATASET_FILES = {"train.parquet": b"train-bytes" * 100, "test.parquet": b"test-bytes" * 50, "README": b"x"}


def trainer_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("GANGFLOW_FAULT", "GANGFLOW_ALLOW_FAULTS", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "TORCHELASTIC_ERROR_FILE",
                        "GANGFLOW_TERMINATION_LOG", "RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("OMPI_")}
    if "GANGFLOW_FAULT" in extra:
        extra.setdefault("GANGFLOW_ALLOW_FAULTS", "1")  # drills opt in (docs/trainer.md, fault injection)
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
    # --log-dir beside a local run dir: without one, torchrun leaves a torchelastic_* folder in /tmp each run
    log_dir = [] if "://" in str(run_dir) else ["--log-dir", str(Path(run_dir).parent / "torchrun-logs")]
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0", *log_dir, *args]


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


def newest_committed_step(run_dir: Path) -> int:
    """The newest checkpoint an attempt committed (a `step-N` folder with its manifest), 0 if none:
    what the next attempt must resume from. A killed rank's fault marker only bounds it from below
    (the loop runs on while the marker is written), so drills compare the resume with this."""
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*")
             if p.name[5:].isdigit() and (p / "manifest.json").is_file()]
    return max(steps, default=0)


def mid_loop_kill(reference: Path, rank: int = 1, fraction: float = 0.5) -> str:
    """A `kill@time` fault that lands mid-loop on this machine now: the timer is a fraction of the
    reference run's own training time (its metrics' final `train_s`), not a fixed number of seconds,
    which a quiet machine outran (a fixed 1.5 s against a 600-step loop that took 1.46 s)."""
    train_s = [m for m in metrics(reference) if m.get("event") == "final"][-1]["train_s"]
    return f"kill@time={max(0.3, round(fraction * train_s, 2)):g},rank={rank}"


def fault_marker(run_dir: Path, fault: str) -> Path:
    """The marker a fired fault leaves in the run dir."""
    return run_dir / marker_name(fault)


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
    mid_loop_kill = staticmethod(mid_loop_kill)
    fault_marker = staticmethod(fault_marker)
    newest_committed_step = staticmethod(newest_committed_step)
    root_cause_exitcode = staticmethod(root_cause_exitcode)
    trainer_env = staticmethod(trainer_env)


@pytest.fixture(scope="session")
def h(digits) -> type[Helpers]:
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return Helpers


# --- an S3-API server on 127.0.0.1 (moto's server mode, what s3fs and DVC test against) ----------


class S3Server:
    """`env` holds the standard AWS variables for child processes (botocore honours AWS_ENDPOINT_URL)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def bucket(self, name: str) -> str:
        import boto3

        # region us-east-1: s3fs's mkdir sends a location constraint moto refuses
        client = boto3.client("s3", region_name="us-east-1", endpoint_url=self.endpoint,
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket=name)
        return f"s3://{name}"


# The unsynchronised kill drills (torchrun, mpirun, Ray): 600 steps, a checkpoint every 50.
DRILL = ("train.max_steps=600", "checkpoint.every_steps=50", "train.log_every_steps=10")
DRILL_INTERVAL = 50


@pytest.fixture(scope="session")
def drill_reference(h, tmp_path_factory) -> Path:
    """The kill drills' uninterrupted run (torchrun, 2 ranks), made once a worker: each drill ends
    bitwise equal to it and times its kill from its loop time."""
    run_dir = tmp_path_factory.mktemp("drill-reference") / "reference"
    h.check_ok(h.run(run_dir, DRILL))
    return run_dir


def drill_spec(name: str, run_dir: Path, attempt: int, fault: str, **spec):
    """The GangSpec of one try of a kill drill run through a backend (mpirun, Ray): `DRILL` on the
    digits data, 2 ranks, `fault` armed."""
    from operators.backends.base import GangSpec

    sets = (f"data.train_path={DATA['train']}", f"data.test_path={DATA['test']}", *DRILL)
    return GangSpec(name=name, run_dir=str(run_dir), world_size=2, config_path=str(ROOT / "params.yaml"), overrides=sets,
                    attempt=attempt, env={"GANGFLOW_FAULT": fault, "GANGFLOW_ALLOW_FAULTS": "1"}, **spec)  # fmt: skip


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A moto S3 server for this session (started once), as the cluster drill starts it."""
    from operators.cli.drill.servers import MotoS3Server

    server = MotoS3Server(tmp_path_factory.mktemp("moto")).start(timeout=60)
    try:
        yield S3Server(server.url)
    finally:
        server.stop()


@pytest.fixture()
def s3(s3_server, monkeypatch):
    """The S3 server, with the standard AWS_* env set in this process for this test only (s3fs
    reads it, as the trainer does); pass `s3.env` to child processes."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


def make_dvc_remote(root: Path, files: dict[str, bytes]) -> str:
    """Write `files` as a DVC 3 remote (objects + the .dir listing, through dvc_data's own Tree, as
    `dvc push` writes them); returns the dataset version (the listing's md5)."""
    import hashlib

    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.meta import Meta
    from dvc_data.hashfile.tree import Tree

    from trainer.datastore import object_path

    tree = Tree()
    for relpath, data in files.items():
        md5 = hashlib.md5(data).hexdigest()
        target = Path(object_path(str(root), md5))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        tree.add((relpath,), Meta(size=len(data)), HashInfo("md5", md5))
    tree.digest()
    version = tree.hash_info.value.removesuffix(".dir")
    listing = Path(object_path(str(root), version, ".dir"))
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_bytes(tree.as_bytes())
    return version


@pytest.fixture(scope="session")
def make_remote():
    return make_dvc_remote


@pytest.fixture()
def runtime_env(tmp_path, monkeypatch):
    """Make `trainer.runtime.Run`s of one rank, run dir tmp_path/run; closes them and restores
    SIGTERM's handler afterwards."""
    import signal

    from trainer import runtime

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GANGFLOW_FAULT", "GANGFLOW_ALLOW_FAULTS", "MLFLOW_TRACKING_URI",
                "MLFLOW_RUN_ID", runtime.ENV_DATA_REMOTE, runtime.ENV_DATA_VERSION):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(runtime.ENV_RUN_DIR, str(tmp_path / "run"))
    monkeypatch.setenv(runtime.ENV_CODE, "tests:train")
    monkeypatch.setenv(runtime.ENV_PROGRESS, "0")
    previous = signal.getsignal(signal.SIGTERM)
    runs: list[runtime.Run] = []

    def make(**kwargs) -> runtime.Run:
        run = runtime.Run(device="cpu", **kwargs)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close(status=None)
        # A SIGTERM a test sent armed the rank's exit watchdog: it would end this worker process.
        run.preemption.disarm()
    signal.signal(signal.SIGTERM, previous)
