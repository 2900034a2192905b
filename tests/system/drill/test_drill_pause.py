"""`GANGFLOW_DRILL_EVENT=pause@step=30 make cluster-drill` (issue 25.2): the gang is paused through
`python -m operators.cli.gang pause` and resumed a few seconds later; the same try resumes from the
final checkpoint the pause made, no retry and no preemption spent."""

from __future__ import annotations

import pytest
from drill_runs import pod_logs, processes_touching, report_pods, run_drill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pause_run(drill_home, tmp_path_factory) -> dict:
    # Long enough that the pause (fired once step 30 is committed) lands mid-run; ten times longer
    # only when it landed after the last step (a loaded machine: the pause command's start took
    # longer than the training), so the verdict does not depend on the machine's speed.
    for max_steps in (300, 3000):
        conf = {"max_steps": max_steps, "checkpoint_every_steps": 10}
        result = run_drill(drill_home, tmp_path_factory, f"pause-{max_steps}", conf, GANGFLOW_DRILL_EVENT="pause@step=30")
        if result["code"] != 0 or (result["summary"].get("resumed_from_step") or 0) < max_steps:
            break
    return result | {"max_steps": max_steps}


def test_a_paused_gang_releases_its_pods_and_resumes_from_its_final_checkpoint(pause_run):
    summary = pause_run["summary"]
    assert pause_run["code"] == 0, pause_run["output"][-8000:]
    assert summary["state"] == "success" and summary["train_attempts"] == 1, summary
    assert summary["pauses"] == 1 and summary["preemptions"] == 0, summary
    assert summary["resumed_from_step"] and 30 <= summary["resumed_from_step"] < pause_run["max_steps"], summary
    events = pause_run["report"]["events"]
    assert any("python -m operators.cli.gang pause" in e and "exit 0" in e for e in events), events
    assert any("InactiveWorkload" in e for e in events), events  # Kueue released the quota
    assert any("admitted Workload" in e and "again" in e for e in events), events
    assert any("python -m operators.cli.gang resume" in e and "exit 0" in e for e in events), events
    pods = report_pods(pause_run["report"])
    assert len(pods) == 4 and all("-t1-" in p["pod"] for p in pods)  # one try, one JobSet, its pods twice
    logs = pod_logs(pause_run["report"])
    assert sum("gangflow: preempted (SIGTERM)" in log for log in logs) == 1  # rank 0 of the paused pods committed
    assert sum(f"resuming from checkpoint step-{summary['resumed_from_step']}" in log for log in logs) == 1
    # Kueue's eviction comes before the resume and before the admission again
    evicted, resumed, admitted = (next(i for i, e in enumerate(events) if needle in e) for needle in
                                  ("InactiveWorkload", "python -m operators.cli.gang resume", "again (spec.active is true)"))
    assert evicted < resumed and evicted < admitted, events
    assert processes_touching(pause_run["keep"]) == []
