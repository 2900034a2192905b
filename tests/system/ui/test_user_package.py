"""User code imports under the real scheduler (issue 23, item 1): a pipeline whose model lives in
a package outside the project root, named by the pipeline file's `package_roots`, runs from an
Asset event under `airflow standalone` as `make ui` starts it (dag-processor, scheduler, worker,
ranks) and is promoted. Nothing else puts the package on a path: the test's own environment
does not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

from airflow_ui import AirflowUI, quote, wait_for
from pipeline_runs import FAST, PROJECT_ROOT, pipeline_env

NAME = "outside"
DAG_ID = f"train_{NAME}"


def user_project(base: Path) -> Path:
    """A pipelines folder whose only pipeline trains a model from a package under `base/src`."""
    pkg = base / "src" / "outsidemodels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(textwrap.dedent('''
        """A user model: gangflow's MLP, built by a factory of the user's own package."""

        from trainer.models import mlp


        def small_mlp(hidden: int = 128, num_classes: int = 10, input_dim: int = 64):
            return mlp(hidden=hidden, num_classes=num_classes, input_dim=input_dim)
    '''))
    trainer = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    trainer.pop("prepare", None)
    trainer["model"]["factory"] = "outsidemodels.nets:small_mlp"
    # The Asset-triggered run trains the Params' defaults, which come from this file: a short run.
    trainer["train"]["max_steps"], trainer["checkpoint"]["every_steps"] = FAST["max_steps"], FAST["checkpoint_every_steps"]
    (base / "trainer.yaml").write_text(yaml.safe_dump(trainer))
    pipelines = base / "pipelines"
    pipelines.mkdir()
    digits = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())
    digits.pop("dag_id"), digits.pop("publish_dag_id")
    (pipelines / f"{NAME}.yaml").write_text(yaml.safe_dump(digits | {
        "name": NAME, "schedule": "none", "trainer_config": str(base / "trainer.yaml"),
        "dataset": digits["dataset"] | {"asset": "gangflow-dataset-outside"},
        "model_name": "gangflow-outside", "allowed_models": ["outsidemodels.nets:small_mlp"],
        "package_roots": [str(base / "src")], "gate": {"threshold": FAST["promotion_floor"]},
        "local_world_sizes": [1, 2],
    }))  # fmt: skip
    return pipelines


def _connections(p):
    try:
        return p.net_connections(kind="inet")
    except psutil.Error:
        return []


@pytest.mark.slow
def test_an_asset_triggered_run_of_a_user_package_pipeline_is_promoted_under_standalone(tmp_path):
    from operators.cli import ui
    from operators.utils.ports import free_port

    started = time.monotonic()
    pipelines = user_project(tmp_path / "user")
    home, log = tmp_path / "state", tmp_path / "airflow.log"
    env = pipeline_env(home, GANGFLOW_PIPELINES=str(pipelines), GANGFLOW_RETRY_BASE_DELAY="1")
    env.pop("PYTHONPATH", None)  # only package_roots may put the user's package on a path
    subprocess.run([sys.executable, "-m", "operators.cli.setup", "--pipeline", NAME], cwd=PROJECT_ROOT, env=env,
                   check=True, timeout=600)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:  # the environment `make ui` would see, nothing from the outer shell
        for key in [k for k in os.environ if k.startswith(("AIRFLOW", "MLFLOW", "GANGFLOW")) or k == "PYTHONPATH"]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        proc, url = ui.start(free_port(), log)
    try:
        ui.wait_healthy(url, proc, timeout_s=180)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GANGFLOW_HOME", str(home))
            password = ui.admin_password(timeout_s=30)
        airflow = AirflowUI(url=url, home=home, log=log, password=password)
        wait_for(f"DAG {DAG_ID} parsed", lambda: airflow.api("GET", f"dags/{DAG_ID}")[0] == 200, 120, 2)
        errors = airflow.get("importErrors")
        assert errors["total_entries"] == 0, errors
        # Every server `make ui` starts listens on 127.0.0.1 (the log servers would take [::]).
        listening = {(c.laddr.ip, c.laddr.port) for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                     for c in _connections(p) if c.status == psutil.CONN_LISTEN}  # fmt: skip
        assert listening and all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening
        (asset,) = [a for a in airflow.get("assets?name_pattern=gangflow-dataset-outside")["assets"]]
        version = airflow.get(f"dags/{DAG_ID}/details")["params"]["dataset_version"]["value"]
        status, event = airflow.api("POST", "assets/events", {"asset_id": asset["id"], "extra": {"version": version}})
        assert status == 200, event
        run = wait_for("an Asset-triggered run", lambda: next(
            (r for r in airflow.get(f"dags/{DAG_ID}/dagRuns")["dag_runs"] if r["run_type"] == "asset_triggered"), None), 120, 2)
        run_path = f"dags/{DAG_ID}/dagRuns/{quote(run['dag_run_id'])}"
        done = wait_for("the run to finish", lambda: (lambda r: r if r["state"] in ("success", "failed") else None)(
            airflow.get(run_path)), 480, 2)  # a hang guard: a loaded machine runs the DAG several times slower
        states = {ti["task_id"]: ti["state"] for ti in airflow.get(f"{run_path}/taskInstances")["task_instances"]}
        assert done["state"] == "success", (states, airflow.log_tail())
        promoted = airflow.get(f"{run_path}/taskInstances/promote/xcomEntries/promoted")["value"]  # pushed by key
        assert promoted in (True, "True", "true"), (promoted, airflow.log_tail())
        assert time.monotonic() - started < 300
    finally:
        ui.stop(proc)
