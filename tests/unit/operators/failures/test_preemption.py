"""`operators.failures.preemption`: which ended gangs are preemptions (the task re-launches them
without spending a retry) and which are failures (the classifier's verdict, unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from operators.failures import classify
from operators.failures.preemption import preemption_reason

EVIDENCE = Path(__file__).parent / "evidence"


@pytest.mark.parametrize("reason", ["Preempted", "InactiveWorkload", "PodsReadyTimeout"])
def test_a_kueue_eviction_is_a_preemption_naming_kueue_s_reason(reason):
    evidence = {"pod_reason": reason, "pod_message": f"Kueue evicted Workload jobset-x: {reason} by the drill",
                "pod_conditions": [{"type": "Evicted", "status": "True", "reason": reason, "message": "evicted"}],
                "ranks": []}
    found = preemption_reason(evidence)
    assert found is not None and reason in found and "Kueue" in found


@pytest.mark.parametrize("disruption", ["PreemptionByScheduler", "EvictionByEvictionAPI", "DeletionByTaintManager"])
def test_a_pod_disruption_target_is_a_preemption(disruption):
    evidence = {"exit_code": 143, "pod_phase": "Failed",
                "pod_conditions": [{"type": "DisruptionTarget", "status": "True", "reason": disruption, "message": "m"}]}
    found = preemption_reason(evidence)
    assert found is not None and disruption in found


def test_the_trainer_s_final_checkpoint_exit_is_a_preemption():
    evidence = {"exit_code": 75, "rank": 0, "log_tail": "gangflow: preempted (SIGTERM): stopped at step 25; exiting with 75",
                "ranks": [{"rank": 0, "exit_code": 75}, {"rank": 1, "exit_code": 75}]}
    found = preemption_reason(evidence)
    assert found is not None and "75" in found


def test_the_scheduler_preemption_case_of_the_corpus_is_a_preemption():
    case = json.loads((EVIDENCE / "k8s_disruption_preemption_by_scheduler.json").read_text())
    assert "PreemptionByScheduler" in (preemption_reason(case["evidence"]) or "")


@pytest.mark.parametrize("evidence", [
    {"exit_code": 1, "log_tail": 'Traceback (most recent call last):\n  File "trainer/loop.py", line 3\nValueError: bad'},
    {"exit_code": 137, "termination_reason": "OOMKilled"},
    {"exit_code": 137, "signal": "SIGKILL"},  # infra, but no preemption
    {"exit_code": 143, "signal": "SIGTERM"},  # a bare SIGTERM without the final checkpoint
    {"pod_reason": "Evicted", "pod_message": "The node was low on resource: memory. Container trainer was using 2Gi, which exceeds its request of 0."},
    {},
])
def test_failures_are_not_preemptions(evidence):
    assert preemption_reason(evidence) is None


def test_the_classifier_s_verdict_is_unchanged_for_preemptions():
    # the corpus and its benchmark score kinds: a preemption stays `infra` there
    assert classify({"exit_code": 75}, precedents=False).kind == "infra"
