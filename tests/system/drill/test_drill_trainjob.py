"""`make cluster-drill API=trainjob` (issue 24.3): the TrainJob run as Kubeflow Trainer v2 would
(operators/cli/drill/trainer_controller.py). One run with a killed rank shows both paths: the first
try's TrainJob fails, the retry's succeeds, resumes and the model is promoted."""

from __future__ import annotations

import pytest
from drill_runs import processes_touching, report_pods, run_drill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainjob_run(drill_home, tmp_path_factory) -> dict:
    return run_drill(drill_home, tmp_path_factory, "trainjob", api="trainjob", GANGFLOW_FAULT="kill@step=30,rank=1",
                     GANGFLOW_RETRY_BASE_DELAY="1")


def test_trainjob_killed_rank_is_retried_once_resumes_and_is_promoted(trainjob_run):
    summary = trainjob_run["summary"]
    assert trainjob_run["code"] == 0, trainjob_run["output"][-8000:]
    assert summary["state"] == "success" and summary["backend"] == "kubernetes" and summary["api"] == "trainjob"
    assert summary["train_attempts"] == 2 and summary["resumed_from_step"] == 30
    assert summary["model_version"] and summary["accuracy"] > 0.5
    pods = report_pods(trainjob_run["report"])
    assert len(pods) == 4 and all("-node-0-" in p["pod"] for p in pods)
    assert any(p["exit_code"] not in (0, None) for p in pods if "-t1-" in p["pod"])
    assert all(p["exit_code"] == 0 for p in pods if "-t2-" in p["pod"])
    events = trainjob_run["report"]["events"]
    assert any("Kueue admitted TrainJob" in e for e in events)
    assert any("Trainer created JobSet" in e and "ClusterTrainingRuntime torch-distributed" in e for e in events)
    # the failed JobSet's condition reached gangflow through the TrainJob, as Trainer mirrors it
    assert any("TrainJob" in e and "Failed" in e for e in events)
    assert processes_touching(trainjob_run["keep"]) == []


def test_trainjob_pods_rendezvous_through_the_pet_variables(trainjob_run):
    pods = report_pods(trainjob_run["report"])
    for attempt in ("-t1-", "-t2-"):
        tried = sorted((p for p in pods if attempt in p["pod"]), key=lambda p: p["pod"])
        assert len(tried) == 2, [p["pod"] for p in pods]
        name = tried[0]["pod"].split("-node-0-")[0]
        for index, pod in enumerate(tried):
            assert pod["pod"].startswith(f"{name}-node-0-{index}-")
            rendered, env = pod["rendered_env"], pod["env"]
            assert (rendered["PET_NNODES"], rendered["PET_NPROC_PER_NODE"], rendered["PET_NODE_RANK"]) == ("2", "1", str(index))
            assert rendered["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}" and env["PET_MASTER_ADDR"] == "127.0.0.1"
            # torchrun got no multi-node flag from the TrainJob: nodes, rank and rendezvous came from PET_*
            assert pod["rendered_argv"][0] == "torchrun"
            assert not any(a.startswith(("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master")) for a in pod["rendered_argv"])
    no_state = [p for p in pods if any(str(trainjob_run["report"]["state_dir"]) in v for v in p["env"].values())]
    assert no_state == []
