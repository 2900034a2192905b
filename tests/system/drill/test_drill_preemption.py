"""`GANGFLOW_DRILL_EVENT=preempt@step=30 make cluster-drill` (issue 25.1): the drill's Kueue evicts the
running Workload; the task re-launches the gang in the same try, no retry spent."""

from __future__ import annotations

import json

import pytest
from drill_runs import pod_log, processes_touching, report_pods, run_drill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def preempt_run(drill_home, tmp_path_factory) -> dict:
    # long enough that the eviction (polled every 0.25 s once step 30 is committed) lands mid-run
    conf = {"max_steps": 150, "checkpoint_every_steps": 10}
    return run_drill(drill_home, tmp_path_factory, "preempt", conf, GANGFLOW_DRILL_EVENT="preempt@step=30")


def test_a_kueue_preemption_costs_no_retry_and_resumes(preempt_run):
    """The drill's Kueue evicts the running Workload (reason Preempted) once checkpoint step 30 is
    committed: the pods get DisruptionTarget and SIGTERM, the ranks commit a final checkpoint and
    exit 75; the task re-launches the gang, which Kueue admits again (issue 25.1)."""
    summary = preempt_run["summary"]
    assert preempt_run["code"] == 0, preempt_run["output"][-8000:]
    assert summary["state"] == "success" and summary["train_attempts"] == 1, summary
    assert summary["preemptions"] == 1, summary
    assert "Kueue" in summary["preemption_reasons"][0] and "Preempted" in summary["preemption_reasons"][0], summary
    assert summary["resumed_from_step"] and 30 <= summary["resumed_from_step"] < 150, summary
    events = preempt_run["report"]["events"]
    assert any("evicted" in e and "Preempted" in e for e in events), events
    assert sum("Kueue admitted JobSet" in e for e in events) == 2, events
    pods = report_pods(preempt_run["report"])
    assert len(pods) == 4 and all("-t1-" in p["pod"] for p in pods)  # one Airflow try, two gangs
    stopped = [p for p in pods if "gangflow: preempted (SIGTERM)" in pod_log(p)]
    assert len(stopped) == 1, [p["pod"] for p in pods]  # rank 0 of the first gang: every rank committed, then exited 75
    # the MLflow run says it too
    import sqlite3

    with sqlite3.connect(preempt_run["keep"] / "mlflow" / "mlflow.db") as db:
        tags = dict(db.execute("select key, value from tags where key like 'gangflow.preemption%'").fetchall())
    assert tags["gangflow.preemptions"] == "1" and json.loads(tags["gangflow.preemption_reasons"]) == summary["preemption_reasons"]
    assert processes_touching(preempt_run["keep"]) == []
