"""`make cluster-drill` end to end (slow): `train_pipeline` with backend=kubernetes, the rendered
pods run as local processes, moto's S3 API and an MLflow server on 127.0.0.1.

Each drill runs in a subprocess (`python -m operators.cli.drill --keep DIR`) on the worker's
drill state dir (conftest.py); its report.json says what every pod was rendered with and started with, and the
audit hook's logs say what every pod process opened.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from drill_runs import processes_touching, report_pods, run_drill, start_drill
from pipeline_runs import PROJECT_ROOT

from operators.cli.drill.audit_hook import read

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fault_run(drill_home, tmp_path_factory) -> dict:
    """One drill shows both paths (CI time): the first try's rank 1 is killed at step 30, the
    classified retry resumes from the committed checkpoint and the model is promoted."""
    return run_drill(drill_home, tmp_path_factory, "fault", GANGFLOW_FAULT="kill@step=30,rank=1", GANGFLOW_RETRY_BASE_DELAY="1")


def test_drill_trains_evaluates_promotes_through_the_kubernetes_backend(fault_run):
    summary = fault_run["summary"]
    assert fault_run["code"] == 0, fault_run["output"][-8000:]
    assert summary["state"] == "success" and summary["backend"] == "kubernetes"
    assert summary["checkpoint_uri"].startswith("s3://gangflow-drill/checkpoints/train-pipeline-")
    assert summary["runtime"] == "process" and summary["image_digest"] is None  # no image runs: local processes
    assert summary["tracking_uri"].startswith("http://127.0.0.1:")
    assert summary["model_version"] and summary["promoted"] and summary["accuracy"] > 0.5
    assert len(summary["dataset_version"]) == 32


def test_pods_run_exactly_the_rendered_container(fault_run):
    report = fault_run["report"]
    pods = report_pods(report)
    assert len(pods) == 4, [p["pod"] for p in pods]  # two tries of two ranks
    keep = str(fault_run["keep"])
    for attempt in ("-t1-", "-t2-"):
        tried = sorted((p for p in pods if attempt in p["pod"]), key=lambda p: p["pod"])
        assert len(tried) == 2, [p["pod"] for p in pods]
        for index, pod in enumerate(tried):
            rendered, run = pod["rendered_argv"], pod["argv"]
            assert rendered[0] == "torchrun" and f"--node-rank={index}" in rendered  # $(JOB_COMPLETION_INDEX) expanded
            assert not any("$(" in a for a in rendered)
            assert len(rendered) == len(run)
            for before, after in zip(rendered, run):
                if before == after:
                    continue
                # the only rewrites: the rank-0 host -> 127.0.0.1, and container paths -> their mounts
                host_rewrite = before.startswith("--rdzv-endpoint=") and after.startswith("--rdzv-endpoint=127.0.0.1:")
                mount_rewrite = before.startswith(("/app/", "/tmp", "/dev/termination-log")) and after.startswith(keep)
                assert host_rewrite or mount_rewrite, (before, after)
            env, rendered_env = pod["env"], pod["rendered_env"]
            for name, value in rendered_env.items():
                if value.startswith(("/tmp", "/dev/termination-log", "/app")):
                    assert env[name].startswith(keep), (name, env[name])
                else:
                    assert env[name] == value, name
            # credentials came from the Secrets in the API double, not from the drill's environment
            assert rendered_env["AWS_ACCESS_KEY_ID"].startswith("drill") and rendered_env["AWS_SECRET_ACCESS_KEY"]
            assert rendered_env.get("MLFLOW_TRACKING_TOKEN")
            assert env["HOME"] == env["TMPDIR"] == str(Path(pod["dir"]) / "tmp")
            # the drill's own additions are only these (the fault is the drill's, never rendered)
            assert set(env) - set(rendered_env) <= {"PYTHONPATH", "GANGFLOW_DRILL_AUDIT", "GANGFLOW_DRILL_POD",
                                                     "PATH", "PYTHONDONTWRITEBYTECODE", "XDG_CACHE_HOME", "MPLCONFIGDIR",
                                                     "TORCHINDUCTOR_CACHE_DIR", "GANGFLOW_FAULT", "GANGFLOW_ALLOW_FAULTS"}  # fmt: skip
        if attempt == "-t2-":
            assert all(pod["exit_code"] == 0 for pod in tried)


def test_no_pod_touched_the_worker_state_dir(fault_run, drill_home):
    report = fault_run["report"]
    state = str(Path(report["state_dir"]).resolve())
    assert state == str(drill_home.resolve())
    for pod in report_pods(report):
        paths = read(pod["audit_path"])
        # the hook saw the rank at work: the dataset it fetched into its own /tmp, the image's params
        assert any(p.startswith(pod["dir"] + "/tmp/") and p.endswith(".parquet") for p in paths), paths[-50:]
        assert any(p.endswith("/image/app/params.yaml") for p in paths)
        # the image's params.yaml is the read-only copy, never the checkout's; no data from the checkout
        assert str(PROJECT_ROOT / "params.yaml") not in paths
        assert not any(p.startswith(str(PROJECT_ROOT / "data") + "/") for p in paths)
        touched = [p for p in paths if p == state or p.startswith(state + "/")]
        assert touched == [], touched
        assert not any(state in item for item in [*pod["argv"], *pod["env"].values()])


def test_nothing_left_running_after_the_drill(fault_run):
    assert processes_touching(fault_run["keep"]) == []


def test_killed_rank_is_retried_once_and_resumes_from_step_30(fault_run):
    summary = fault_run["summary"]
    assert fault_run["code"] == 0, fault_run["output"][-8000:]
    assert summary["state"] == "success" and summary["train_attempts"] == 2
    assert summary["resumed_from_step"] == 30
    pods = report_pods(fault_run["report"])
    assert len(pods) == 4
    first_try = [p for p in pods if "-t1-" in p["pod"]]
    assert any(p["exit_code"] not in (0, None) for p in first_try)
    # the drill gave the fault to its pods; the backend itself never forwards it
    assert all(p["env"].get("GANGFLOW_FAULT") == "kill@step=30,rank=1" and p["env"]["GANGFLOW_ALLOW_FAULTS"] == "1" for p in pods)
    assert all("GANGFLOW_FAULT" not in p["rendered_env"] for p in pods)
    assert any("JobSet" in e and "failed" in e for e in fault_run["report"]["events"])
    assert processes_touching(fault_run["keep"]) == []


def test_an_interrupted_drill_stops_everything_it_started(drill_home, tmp_path):
    keep = tmp_path / "drill"
    log = tmp_path / "drill.log"
    proc = start_drill(drill_home, keep, log, {"max_steps": 400, "checkpoint_every_steps": 50})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if "[cluster] pod " in log.read_text() and " started (pid " in log.read_text():
            break
        time.sleep(1)
    assert proc.poll() is None, log.read_text()[-6000:]
    time.sleep(3)  # the ranks are up
    assert processes_touching(keep), "expected the pods and servers to be running"
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    assert code != 0
    summary = json.loads(log.read_text().strip().splitlines()[-1])
    assert summary["state"] == "failed"
    time.sleep(1)
    assert processes_touching(keep) == []


def test_summary_names_the_jobset_api_that_ran(fault_run):
    assert fault_run["summary"]["api"] == "jobset"
    assert all("-rank-0-" in p["pod"] for p in report_pods(fault_run["report"]))
