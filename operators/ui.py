"""`make ui`: Airflow on this machine (api-server, scheduler, dag-processor, triggerer) with
gangflow's DAGs, pool and MLflow settings ready, so you can trigger `train_pipeline` from the
UI's form. Stops with Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from operators import embedded, settings


def password_file() -> Path:
    return settings.airflow_home() / "simple_auth_manager_passwords.json.generated"


def admin_password(timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if password_file().exists():
            return json.loads(password_file().read_text())["admin"]
        time.sleep(0.5)
    raise TimeoutError(f"no password file at {password_file()} after {timeout_s:.0f}s")


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"Airflow did not answer at {url} within {timeout_s:.0f}s")


def start(port: int = 8080, log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start `airflow standalone` in its own session; returns the process and the UI URL."""
    env = {**os.environ, **embedded.airflow_environ(api_port=port)}
    # standalone starts its components through `airflow` on PATH: this venv's first.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow", "standalone"], env=env, start_new_session=True,
        stdout=out or None, stderr=subprocess.STDOUT if out else None,
    )  # fmt: skip
    return proc, f"http://localhost:{port}"


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8080, help="api-server port (default 8080)")
    args = parser.parse_args(argv)
    proc, url = start(args.port)
    try:
        wait_healthy(url, proc)
        print(f"\ngangflow: Airflow UI at {url}  (user: admin, password: {admin_password()})", flush=True)
        print("gangflow: open DAG 'train_pipeline', press Trigger, fill the form. Ctrl-C stops.", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
