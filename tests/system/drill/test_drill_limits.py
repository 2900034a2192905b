"""Time limits with reasons (issue 25.3), whole DAG runs through the cluster drill: the pipeline file's
`training.max_run_time_seconds` stops the gang through its pods' `activeDeadlineSeconds` (a JobSet) or
its own (a TrainJob): the ranks commit a final checkpoint, the try fails as the user's, not retried; `training.max_queue_wait_seconds`
ends a gang Kueue has no quota for with Kueue's own reason and the time waited, and the gang is
deleted (its Workload with it: no quota held) before the next try."""

from __future__ import annotations

from pathlib import Path

import pytest
from drill_runs import pod_logs, processes_touching, report_pods, run_drill

pytestmark = pytest.mark.slow
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def _pipelines(folder: Path, training: str, retries: int = 3) -> str:
    """A pipelines folder holding digits.yaml with these `training:` keys (and `retries`)."""
    folder.mkdir()
    text = (PROJECT_ROOT / "pipelines" / "digits.yaml").read_text().replace("\nretries: 3\n", f"\nretries: {retries}\n")
    (folder / "digits.yaml").write_text(text + f"\ntraining:\n{training}\n")
    return str(folder)


# The run-time limit: 12 s, longer only when the ranks had not reached their training loop by then (a
# loaded machine: a SIGTERM while torch imports ends a rank with nothing to commit, which says
# nothing of the limit's checkpoint), so the verdict does not depend on the machine's speed.
RUN_TIME_LIMITS_S = (12, 30, 75)


def _reached_the_loop(result: dict) -> bool:
    """Rank 0 chose where to start (its SIGTERM handler is installed by then)."""
    return any("gangflow: starting from step" in log or "gangflow: resuming from checkpoint" in log for log in pod_logs(result["report"]))


@pytest.fixture(scope="module", params=["jobset", "trainjob"])
def run_time_run(request, drill_home, tmp_path_factory) -> dict:
    """A JobSet's pods carry the limit as their activeDeadlineSeconds (the kubelet stops them); a
    TrainJob carries it itself (Trainer fails it DeadlineExceeded and deletes its JobSet)."""
    conf = {"max_steps": 1_000_000, "checkpoint_every_steps": 50}  # far more than any limit's training
    for limit in RUN_TIME_LIMITS_S:
        pipelines = _pipelines(tmp_path_factory.mktemp("limits") / "pipelines", f"  max_run_time_seconds: {limit}")
        result = run_drill(drill_home, tmp_path_factory, f"run-time-{request.param}-{limit}s", conf, api=request.param,
                           GANGFLOW_PIPELINES=pipelines)
        if _reached_the_loop(result):
            break
    return result | {"api": request.param, "limit": limit}


@pytest.fixture(scope="module")
def queue_wait_run(drill_home, tmp_path_factory) -> dict:
    pipelines = _pipelines(tmp_path_factory.mktemp("limits") / "pipelines", "  max_queue_wait_seconds: 4", retries=1)
    return run_drill(drill_home, tmp_path_factory, "queue-wait", None, GANGFLOW_PIPELINES=pipelines, GANGFLOW_DRILL_EVENT="no-quota")


def test_past_its_run_time_the_gang_checkpoints_and_fails_as_the_users_without_a_retry(run_time_run):
    summary = run_time_run["summary"]
    assert run_time_run["code"] == 1 and summary["state"] == "failed", run_time_run["output"][-6000:]
    assert summary["train_attempts"] == 1 and summary["preemptions"] == 0, summary  # not retried, not a preemption
    assert summary["failure"]["kind"] == "user" and "DeadlineExceeded" in summary["failure"]["reason"], summary["failure"]
    pods = report_pods(run_time_run["report"])
    assert len(pods) == 2, pods  # one try: its two pods
    events = run_time_run["report"]["events"]
    if run_time_run["api"] == "jobset":
        assert all(p["exit_code"] is not None for p in pods), pods  # the kubelet ended them
    else:  # Trainer deleted the JobSet: its pods were deleted (SIGTERM, then their grace period)
        assert sum(f"pod {p['pod']} deleted: SIGTERM" in e for p in pods for e in events) == 2, events
    logs = pod_logs(run_time_run["report"])
    assert sum("gangflow: preempted (SIGTERM)" in log for log in logs) == 1, logs[0][-3000:]  # rank 0 committed a final checkpoint
    assert any(f"activeDeadlineSeconds={run_time_run['limit']}" in e for e in events), events
    assert processes_touching(run_time_run["keep"]) == []


def test_past_its_queue_wait_the_gang_fails_with_kueues_reason_and_holds_no_quota(queue_wait_run):
    summary = queue_wait_run["summary"]
    assert queue_wait_run["code"] == 1 and summary["state"] == "failed", queue_wait_run["output"][-6000:]
    assert summary["train_attempts"] == 2, summary  # infra (no capacity now): retried within the budget, with backoff
    reason = summary["failure"]["reason"]
    assert "not admitted within training.max_queue_wait_seconds=4 (waited " in reason, reason
    assert "insufficient unused quota for cpu in flavor default-flavor, 2 more needed" in reason, reason
    assert report_pods(queue_wait_run["report"]) == []  # no pod ever ran
    # each try's gang was deleted before the try ended, its Workload with it: nothing holds quota
    left = queue_wait_run["report"]["left_in_cluster"]
    assert {"jobsets", "workloads", "pods"} <= set(left) and all(names == [] for names in left.values()), left
    events = queue_wait_run["report"]["events"]
    assert sum("Kueue has no quota for JobSet" in e for e in events) == 2, events
