"""`make ui`'s servers bind 127.0.0.1 (issue 23, item 6): standalone starts the scheduler and the
triggerer through the `airflow` first on PATH; gangflow's turns their log servers (which Airflow
binds to every interface, [::]:8793/8794, with no setting for the host) off."""

from __future__ import annotations

import os
import subprocess

from operators.cli import ui


def test_the_airflow_standalone_runs_starts_scheduler_and_triggerer_without_log_servers(tmp_path):
    shim = ui.airflow_shim(tmp_path)
    assert os.access(shim, os.X_OK) and shim.name == "airflow"
    for command in ("scheduler", "triggerer"):
        done = subprocess.run([str(shim), command, "--help"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "GANGFLOW_AIRFLOW_SHIM_DRY_RUN": "1"})  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == f"airflow {command} --help --skip-serve-logs"
    done = subprocess.run([str(shim), "api-server", "--port", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GANGFLOW_AIRFLOW_SHIM_DRY_RUN": "1"})  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "airflow api-server --port 1"
