"""`GANGFLOW_DRILL_EVENT=lose-worker@step=30 make cluster-drill MULTIKUEUE=2` (issue 25.4): the
Airflow worker talks to the MultiKueue manager; the gang is dispatched whole to a worker cluster,
that worker is lost mid-run (its pods SIGKILLed, no answer), Kueue evicts the manager's Workload
(AdmissionCheck), the verdict is infra, and the retry is dispatched to the other worker and resumes
from the checkpoint in object storage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from drill_runs import processes_touching, report_pods, run_drill, run_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def multikueue_run(drill_home, tmp_path_factory) -> dict:
    conf = {"max_steps": 120, "checkpoint_every_steps": 10}
    return run_drill(drill_home, tmp_path_factory, "multikueue", conf, multikueue=2, GANGFLOW_DRILL_EVENT="lose-worker@step=30",
                     GANGFLOW_RETRY_BASE_DELAY="1")


def test_a_lost_worker_cluster_is_infra_and_the_retry_runs_on_the_other_from_object_storage(multikueue_run):
    summary = multikueue_run["summary"]
    assert multikueue_run["code"] == 0, multikueue_run["output"][-8000:]
    assert summary["state"] == "success" and summary["train_attempts"] == 2, summary
    # read back through the manager by the DAG (the training task's result), not from the drill's bookkeeping
    assert summary["dispatched_to"] == "worker-2", summary
    assert summary["multikueue"] == {"workers": ["worker-1", "worker-2"], "lost": ["worker-1"],
                                     "dispatches": [{"jobset": d["jobset"], "worker": w} for d, w in
                                                    zip(summary["multikueue"]["dispatches"], ["worker-1", "worker-2"])]}
    assert [d["jobset"][-3:] for d in summary["multikueue"]["dispatches"]] == ["-t1", "-t2"]
    assert summary["preemptions"] == 0  # a lost cluster is a failure (infra), not a preemption
    assert summary["resumed_from_step"] and 30 <= summary["resumed_from_step"] < 120, summary
    assert summary["checkpoint_uri"].startswith("s3://")
    pods = report_pods(multikueue_run["report"])
    assert {Path(p["dir"]).parent.name for p in pods} == {"worker-1", "worker-2"}  # each try's pods on its worker
    # the first try's verdict: the rule for a lost worker, on the evidence the manager had
    record = json.loads((run_folder(multikueue_run) / "failures" / "try-1.json").read_text())
    assert record["verdict"]["kind"] == "infra" and "MultiKueue" in record["verdict"]["reason"], record["verdict"]
    assert record["evidence"]["dispatched_to"] == "worker-1"
    assert processes_touching(multikueue_run["keep"]) == []
