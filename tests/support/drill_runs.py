"""Running `python -m operators.cli.drill` from the drill tests (tests/system/drill): start one on a
state dir, read its summary and report.json, and find what it left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline_runs import PROJECT_ROOT, dag_run_folder, pipeline_env
from pipeline_runs import finish as finish_run

CONF = {"max_steps": 60, "checkpoint_every_steps": 10}


def processes_touching(folder: Path) -> list[str]:
    """Live processes whose command line, environment or working dir names `folder`."""
    needle = str(folder).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
            cwd = os.readlink(f"/proc/{entry}/cwd").encode()
        except OSError:
            continue
        if needle in cmdline or needle in environ or cwd.startswith(needle):
            found.append(entry + ": " + cmdline.replace(b"\0", b" ").decode(errors="replace")[:200])
    return found


def start_drill(home: Path, keep: Path, log: Path, conf: dict | None = None, api: str | None = None, multikueue: int = 0,
                **env: str) -> subprocess.Popen:  # fmt: skip
    argv = [sys.executable, "-m", "operators.cli.drill", "--keep", str(keep), "--conf", json.dumps(conf or CONF)]
    argv += ["--api", api] if api else []
    argv += ["--multikueue", str(multikueue)] if multikueue else []
    return subprocess.Popen(argv, cwd=PROJECT_ROOT, env=pipeline_env(home, **env), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, keep: Path, timeout: float = 1200) -> dict:
    summary, output, code = finish_run(proc, log, timeout)  # the drill ends with a JSON summary line, as demo does
    report_path = keep / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return {"code": code, "summary": summary, "output": output, "report": report}


def run_drill(home: Path, tmp_path_factory, name: str, conf: dict | None = None, **options) -> dict:
    """One drill to its end on the state dir `home`, its files kept in a fresh folder: `finish`'s
    result plus `keep` (that folder), `home` and `seconds`. `options`: start_drill's."""
    import time

    keep = tmp_path_factory.mktemp(f"drill-{name}")
    log = keep.parent / f"drill-{name}.log"
    started = time.monotonic()
    result = finish(start_drill(home, keep, log, conf, **options), log, keep)
    return result | {"keep": keep, "home": home, "seconds": time.monotonic() - started}


def run_folder(result: dict) -> Path:
    """The run dir of this drill's own DAG run (the drills of a worker share its state dir)."""
    return dag_run_folder(result["home"], result["summary"])


def report_pods(report: dict) -> list[dict]:
    return report.get("pods") or []


def pod_log(pod: dict) -> str:
    """What one pod of a drill's report printed (its container.log)."""
    return (Path(pod["dir"]) / "container.log").read_text(errors="replace")


def pod_logs(report: dict, name_part: str = "") -> list[str]:
    """The logs of the report's pods whose name holds `name_part` (e.g. "-t2-": one try's)."""
    return [pod_log(p) for p in report_pods(report) if name_part in p["pod"]]
