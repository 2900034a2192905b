"""`make ui`: Airflow on this machine (api-server, scheduler, dag-processor, triggerer) with
gangflow's DAGs, pool and MLflow settings ready, so you can trigger `train_pipeline` from the
UI's form. Every process has the pipelines' package_roots on its PYTHONPATH; only the api-server
listens (127.0.0.1 unless --host says otherwise). Stops with Ctrl-C (or SIGTERM/SIGHUP), taking
every Airflow process with it.

    python -m operators.cli.ui [--port 8080] [--host 127.0.0.1]     (or GANGFLOW_UI_PORT=8081 make ui)
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

from operators.config import embedded

from operators.config import settings
from operators.utils.ports import free_port, port_is_free
from operators.utils.processes import stop_tree, tagged_env

# Components `wait_healthy` waits for (the triggerer is not needed to run train_pipeline).
REQUIRED_COMPONENTS = ("metadatabase", "scheduler", "dag_processor")


def password_file() -> Path:
    return settings.airflow_home() / "simple_auth_manager_passwords.json.generated"


def admin_password(timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(password_file().read_text())["admin"]
        except (FileNotFoundError, ValueError, KeyError):  # not there yet, or being written
            time.sleep(0.5)
    raise TimeoutError(f"no password for 'admin' in {password_file()} after {timeout_s:.0f}s")


def _log_server_port(default: int, taken: set[int]) -> int:
    """Airflow's default log-server port when free, else any free one (a second Airflow)."""
    port = default if default not in taken and port_is_free(default, "0.0.0.0") else free_port()
    while port in taken:
        port = free_port()
    taken.add(port)
    return port


#: The `airflow` standalone starts its components with (it runs `airflow <component>` from PATH).
_SHIM = '''#!{python}
"""gangflow's `airflow` for `make ui` (operators/cli/ui.py wrote it): Airflow's own CLI, with the
scheduler's and the triggerer's log servers off. Airflow binds them to every interface
([::]:8793/8794, no setting names the host); on one machine the api-server reads the task logs
from their files."""
import os
import sys

args = sys.argv[1:]
if args[:1] in (["scheduler"], ["triggerer"]) and "--skip-serve-logs" not in args:
    args.append("--skip-serve-logs")
if os.environ.get("GANGFLOW_AIRFLOW_SHIM_DRY_RUN"):
    print(" ".join(["airflow", *args]))
    sys.exit(0)
sys.argv = ["airflow", *args]
from airflow.__main__ import main

sys.exit(main())
'''


def airflow_shim(folder: Path) -> Path:
    """Write the `airflow` standalone runs its components with into `folder`; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "airflow"
    tmp = folder / ".airflow.tmp"
    tmp.write_text(_SHIM.format(python=sys.executable))
    tmp.chmod(0o755)
    tmp.replace(shim)
    return shim


def python_path(existing: str = "") -> str:
    """PYTHONPATH for Airflow's processes: every readable pipeline's package_roots, the project
    root, then `existing`."""
    from operators.config.pipelines import pipeline_files

    roots = [root for config in pipeline_files().configs.values() for root in config.package_roots]
    return os.pathsep.join(dict.fromkeys([*roots, str(settings.PROJECT_ROOT), *filter(None, existing.split(os.pathsep))]))


def health(url: str) -> dict:
    """The api-server's `/api/v2/monitor/health` answer ({component: {"status": ...}})."""
    with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as resp:
        return json.load(resp)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    """Wait until the api-server answers and reports the metadata DB, the scheduler and the
    dag-processor healthy, so a triggered run is picked up at once."""
    deadline = time.monotonic() + timeout_s
    last: object = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited with {proc.returncode}")
        try:
            status = health(url)
            last = {name: (status.get(name) or {}).get("status") for name in REQUIRED_COMPONENTS}
            if all(state == "healthy" for state in last.values()):
                return
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(1)
    raise TimeoutError(f"Airflow at {url} not healthy within {timeout_s:.0f}s (last: {last})")


def start(
    port: int = 8080, log_path: Path | None = None, *, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen, str]:
    """Start `airflow standalone` in its own session; returns the process and the UI URL.

    Refuses a port that is taken (the health check would otherwise talk to whatever answers
    there), and moves the worker/triggerer log servers off Airflow's defaults (8793, 8794) when
    another Airflow holds them.
    """
    if not port_is_free(port, host):
        raise RuntimeError(f"port {port} is in use: is another Airflow running? Pick one with --port")
    taken = {port}
    environ = embedded.airflow_environ(
        api_port=port,
        api_host=host,
        worker_log_server_port=_log_server_port(embedded.WORKER_LOG_SERVER_PORT, taken),
        trigger_log_server_port=_log_server_port(embedded.TRIGGER_LOG_SERVER_PORT, taken),
    )
    env = {**os.environ, **environ}
    # Every component (api-server, dag-processor, scheduler, triggerer, the task workers and the
    # ranks they start) imports the user's packages: the pipelines' package_roots and the project.
    env["PYTHONPATH"] = python_path(env.get("PYTHONPATH", ""))
    # standalone starts its components through `airflow` on PATH: gangflow's shim (log servers
    # off, so every server binds 127.0.0.1), then this venv's.
    shim = airflow_shim(settings.state_dir() / "bin")
    env["PATH"] = os.pathsep.join([str(shim.parent), str(Path(sys.executable).parent), env.get("PATH", "")])
    env = tagged_env(env)  # `stop` finds every process standalone started by it
    out = open(log_path, "ab") if log_path else None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "airflow", "standalone"], env=env, start_new_session=True,
            cwd=settings.PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT if out else None,
        )  # fmt: skip
        proc.tree_env = env  # for `stop`
    finally:
        if out:
            out.close()  # the child holds its own copy
    return proc, f"http://localhost:{port}"


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop standalone and everything it started: its process group, and descendants that left
    the group (e.g. a training task's torchrun runs in a session of its own)."""
    stop_tree(proc, timeout_s, env=getattr(proc, "tree_env", None))


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("GANGFLOW_UI_PORT") or 8080),
        help="api-server port (default: $GANGFLOW_UI_PORT or 8080)",
    )  # fmt: skip
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the api-server binds (default 127.0.0.1; 0.0.0.0 for all)"
    )
    args = parser.parse_args(argv)
    # Airflow runs in a session of its own: Ctrl-C, SIGTERM or SIGHUP here must still stop it
    # (finally below), also when started with SIGINT ignored (e.g. `make ui &` from a script).
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGHUP, _raise_keyboard_interrupt)
    try:
        proc, url = start(args.port, host=args.host)
    except RuntimeError as exc:
        print(f"gangflow: {exc}", file=sys.stderr)
        return 1
    try:
        wait_healthy(url, proc)
        print(f"\ngangflow: Airflow UI at {url}  (user: admin, password: {admin_password()})", flush=True)
        print("gangflow: open DAG 'train_pipeline', press Trigger, fill the form. Ctrl-C stops.", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not orphan it
            signal.signal(signum, signal.SIG_IGN)
        print("gangflow: stopping Airflow ...", file=sys.stderr, flush=True)
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
