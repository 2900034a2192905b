"""The drill's servers on 127.0.0.1: moto's S3 API (`moto_server`) and `mlflow server`.

Each runs in a session of its own (`start_new_session`), so `stop()` ends it with every child
(mlflow's uvicorn workers) by process group: SIGTERM, then SIGKILL after a grace period. Output
goes to a log file under the drill dir. Values go as argv, never through a shell.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from operators.utils.ports import free_port
from operators.utils.processes import stop_group


class DrillServerError(RuntimeError):
    """A server the drill needs did not start (its log tail is in the message)."""


def executable(name: str) -> str:
    """A console script of this environment (beside sys.executable), else from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise DrillServerError(f"{name} not found beside {sys.executable} nor on PATH: run `make install` (dev extras)")
    return found


class Server:
    """One server process; `url` once `start()` returned."""

    name = "server"

    def __init__(self, workdir: Path, *, port: int | None = None):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def ready_path(self) -> str:
        return "/"

    def start(self, timeout: float = 180.0) -> Server:
        return self.launch().wait_ready(timeout)

    def launch(self) -> Server:
        """Start the process without waiting (start several, then `wait_ready` each)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, env=self.env(), start_new_session=True,
            )  # fmt: skip
        return self

    def wait_ready(self, timeout: float = 180.0) -> Server:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DrillServerError(f"{self.name} exited with {self.proc.returncode} at start: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path(), timeout=2) as resp:
                    if resp.status < 500:
                        return self
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise DrillServerError(f"{self.name} not answering on {self.url} after {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None


class MotoS3Server(Server):
    """moto's server mode: an in-memory S3 API (what s3fs and DVC test against)."""

    name = "moto"

    def argv(self) -> list[str]:
        return [executable("moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]

    def ready_path(self) -> str:
        return "/moto-api/"


class MlflowServer(Server):
    """`mlflow server` on SQLite with an artifact proxy (`--serve-artifacts`): pods log weights
    over HTTP and never see the artifact folder."""

    name = "mlflow"

    def __init__(self, workdir: Path, *, port: int | None = None):
        super().__init__(workdir, port=port)
        self.backend_store_uri = f"sqlite:///{self.workdir / 'mlflow.db'}"
        self.artifacts = self.workdir / "mlartifacts"

    def argv(self) -> list[str]:
        return [
            executable("mlflow"), "server",
            "--backend-store-uri", self.backend_store_uri,
            "--artifacts-destination", str(self.artifacts),
            "--serve-artifacts",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", "1",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # the server is the cluster's: nothing of the worker's MLflow/Airflow settings leaks in
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AIRFLOW", "GANGFLOW_"))}
        # no job runner: it starts seven huey consumers, which tracking and artifacts do not need
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        return env

    def ready_path(self) -> str:
        return "/health"
