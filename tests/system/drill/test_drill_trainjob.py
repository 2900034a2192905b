"""`make cluster-drill API=trainjob` (issue 24.3): the TrainJob run as Kubeflow Trainer v2 would
(operators/cli/drill/trainer_controller.py). One run with a killed rank shows both paths: the first
try's TrainJob fails, the retry's succeeds, resumes and the model is promoted; the retry is also
paused and resumed (issue 25.2) through its Kueue Workload, as a JobSet gang is."""

from __future__ import annotations

import pytest
from drill_runs import pod_logs, processes_touching, report_pods, run_drill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainjob_run(drill_home, tmp_path_factory) -> dict:
    # long enough that the pause (fired once the retry committed step 60) lands mid-run
    return run_drill(drill_home, tmp_path_factory, "trainjob", {"max_steps": 300}, api="trainjob",
                     GANGFLOW_FAULT="kill@step=30,rank=1", GANGFLOW_RETRY_BASE_DELAY="1", GANGFLOW_DRILL_EVENT="pause@step=60")


def test_trainjob_killed_rank_is_retried_once_resumes_and_is_promoted(trainjob_run):
    summary = trainjob_run["summary"]
    assert trainjob_run["code"] == 0, trainjob_run["output"][-8000:]
    assert summary["state"] == "success" and summary["backend"] == "kubernetes" and summary["api"] == "trainjob"
    assert summary["train_attempts"] == 2 and summary["model_version"] and summary["accuracy"] > 0.5
    events = trainjob_run["report"]["events"]
    assert any("resuming from checkpoint step-30" in log for log in pod_logs(trainjob_run["report"], "-t2-")), events
    pods = report_pods(trainjob_run["report"])
    assert len(pods) == 6 and all("-node-0-" in p["pod"] for p in pods)  # 2 failed, 2 paused, 2 resumed
    assert any(p["exit_code"] not in (0, None) for p in pods if "-t1-" in p["pod"])
    # the retry's pods: the two its pause stopped (SIGTERM), then the two that finished
    assert sorted(p["exit_code"] == 0 for p in pods if "-t2-" in p["pod"]) == [False, False, True, True]
    events = trainjob_run["report"]["events"]
    assert any("Kueue admitted TrainJob" in e for e in events)
    assert any("Trainer created JobSet" in e and "ClusterTrainingRuntime torch-distributed" in e for e in events)
    # the failed JobSet's condition reached gangflow through the TrainJob, as Trainer mirrors it
    assert any("TrainJob" in e and "Failed" in e for e in events)
    assert processes_touching(trainjob_run["keep"]) == []


def test_a_paused_trainjob_releases_its_pods_and_resumes_from_its_final_checkpoint(trainjob_run):
    summary, events = trainjob_run["summary"], trainjob_run["report"]["events"]
    assert summary["pauses"] == 1 and summary["preemptions"] == 0, summary
    assert summary["resumed_from_step"] and 60 <= summary["resumed_from_step"] < 300, summary
    paused, evicted, suspended, resumed = (
        next(i for i, e in enumerate(events) if needle in e) for needle in (
            "python -m operators.cli.gang pause", "InactiveWorkload: spec.active is false); the TrainJob is suspended",
            "suspended: the Job controller deletes its pods", "python -m operators.cli.gang resume"))  # fmt: skip
    assert "exit 0" in events[paused] and "exit 0" in events[resumed], events
    assert evicted < suspended < resumed, events  # (the pause's own line is written once the command returned)
    # Kueue admits it again once resumed: after the pause, and possibly before the resume's own line,
    # which is written when the command returns (it waits for the gang to be admitted again)
    assert any("again (spec.active is true)" in e and "TrainJob" in e for e in events[paused:]), events
    logs = pod_logs(trainjob_run["report"], "-t2-")
    assert sum("gangflow: preempted (SIGTERM)" in log for log in logs) == 1  # rank 0 of the paused pods committed
    assert sum(f"resuming from checkpoint step-{summary['resumed_from_step']}" in log for log in logs) == 1


def test_trainjob_pods_rendezvous_through_the_pet_variables(trainjob_run):
    pods = report_pods(trainjob_run["report"])
    for attempt, count in (("-t1-", 2), ("-t2-", 4)):  # the retry's pods twice: before and after its pause
        tried = [p for p in pods if attempt in p["pod"]]
        assert len(tried) == count, [p["pod"] for p in pods]
        name = tried[0]["pod"].split("-node-0-")[0]
        assert sorted(int(p["pod"].split("-node-0-")[1].split("-")[0]) for p in tried) == sorted([0, 1] * (count // 2))
        for pod in tried:
            index = int(pod["pod"].split("-node-0-")[1].split("-")[0])
            assert pod["pod"].startswith(f"{name}-node-0-{index}-")
            rendered, env = pod["rendered_env"], pod["env"]
            assert (rendered["PET_NNODES"], rendered["PET_NPROC_PER_NODE"], rendered["PET_NODE_RANK"]) == ("2", "1", str(index))
            assert rendered["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}" and env["PET_MASTER_ADDR"] == "127.0.0.1"
            # torchrun got no multi-node flag from the TrainJob: nodes, rank and rendezvous came from PET_*
            assert pod["rendered_argv"][0] == "torchrun"
            assert not any(a.startswith(("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master")) for a in pod["rendered_argv"])
    no_state = [p for p in pods if any(str(trainjob_run["report"]["state_dir"]) in v for v in p["env"].values())]
    assert no_state == []
