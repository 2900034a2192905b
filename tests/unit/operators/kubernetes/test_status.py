"""Reading the cluster's words from realistic objects: the fixtures themselves validate against
the upstream schemas; the evidence has the classifier's keys (contract 4, docs/contracts.md)."""

from __future__ import annotations

import copy
import json

import pytest

from operators.kubernetes import status as st
from operators.cli.render import render_documents
from operators.kubernetes.validation import validate_object

POD_STATES = ["unschedulable", "container_creating", "image_pull_backoff", "running", "oomkilled", "peer_nccl_error", "user_error", "preempted", "evicted", "succeeded"]
CLASSIFIER_KEYS = set(st.EVIDENCE_KEYS) | set(st.IDENTITY_KEYS) | {"ranks"}


@pytest.mark.parametrize("state", POD_STATES)
def test_pod_fixtures_are_valid_pods(state, fx):
    validate_object(fx.pod(state, rank=1))


@pytest.mark.parametrize("state", ["pending_quota", "pending_topology", "inadmissible", "admitted", "evicted_preempted"])
def test_workload_fixtures_match_kueue_crd(state, fx, crd_registry):
    validate_object(fx.workload(state), crd_registry)


@pytest.mark.parametrize("state", ["suspended", "running", "failed", "completed"])
def test_jobset_status_fixtures_match_jobset_crd(state, fx, crd_registry):
    (js,) = render_documents(world_size=4, name="train-demo", namespace="ml", dataset_version="5d41402abc4b2a76b9719d911017c592")
    js["status"] = fx.jobset_status(state)
    validate_object(js, crd_registry)


def test_volcano_fixtures_match_crds(fx, crd_registry):
    validate_object(fx.podgroup("unschedulable"), crd_registry)
    (job,) = render_documents(world_size=4, scheduler="volcano", dataset_version="5d41402abc4b2a76b9719d911017c592")
    for state in ("pending", "running", "terminated"):
        job["status"] = fx.volcano_status(state)
        validate_object(job, crd_registry)


def test_gang_state_from_fixtures(fx):
    js = {"spec": {"suspend": True}, "status": fx.jobset_status("suspended")}
    assert st.gang_state("JobSet", js).state == "suspended"
    assert st.gang_state("JobSet", {"spec": {}, "status": fx.jobset_status("running")}).state == "running"
    failed = st.gang_state("JobSet", {"status": fx.jobset_status("failed")})
    assert (failed.state, failed.reason, failed.message) == ("failed", "FailedJobs", "jobset failed due to one or more job failures")
    assert st.gang_state("JobSet", {"status": fx.jobset_status("completed")}).state == "succeeded"
    assert st.gang_state("VolcanoJob", {"status": fx.volcano_status("pending")}).state == "pending"
    assert st.gang_state("VolcanoJob", {"status": fx.volcano_status("running")}).state == "running"
    assert st.gang_state("VolcanoJob", {"status": fx.volcano_status("terminated")}).state == "failed"
    assert st.gang_state("TrainJob", {"status": {"conditions": [{"type": "Complete", "status": "True", "reason": "JobsCompleted"}]}}).state == "succeeded"


def test_workload_waiting_reasons_in_kueues_words(fx):
    pending = st.workload_state(fx.workload("pending_quota"))
    assert not pending.admitted and not pending.quota_reserved
    assert pending.waiting == "couldn't assign flavors to pod set rank: insufficient unused quota for nvidia.com/gpu in flavor a100, 8 more needed"
    topo = st.workload_state(fx.workload("pending_topology"))
    assert 'topology "gpu-topology" doesn\'t allow to fit any of 4 pod(s)' in topo.waiting
    assert st.workload_state(fx.workload("inadmissible")).waiting == "ClusterQueue gpu-cluster-queue is inactive"
    admitted = st.workload_state(fx.workload("admitted"))
    assert admitted.admitted and admitted.admitted_at == "2026-11-29T10:02:10Z" and admitted.waiting is None
    evicted = st.workload_state(fx.workload("evicted_preempted"))
    assert evicted.evicted["reason"] == "Preempted"
    assert evicted.evicted["message"].startswith("Preempted to accommodate a workload (UID: ")
    pg = st.podgroup_waiting(fx.podgroup("unschedulable"))
    assert "4/4 tasks in gang unschedulable: pod group is not ready, 4 Pending, 4 minAvailable" in pg


def test_pod_views(fx):
    v = st.pod_view(fx.pod("unschedulable", 2))
    assert (v.rank, v.scheduled, v.ready, v.failed) == (2, False, False, False)
    assert v.unschedulable.startswith("0/6 nodes are available: 2 Insufficient nvidia.com/gpu")
    v = st.pod_view(fx.pod("image_pull_backoff", 1))
    assert v.scheduled and v.waiting_reason == "ImagePullBackOff" and v.waiting_reason in st.IMAGE_PULL_REASONS
    assert st.pod_view(fx.pod("running", 0)).ready
    assert st.pod_view(fx.pod("succeeded", 0)).ready and st.pod_view(fx.pod("succeeded", 0)).succeeded
    assert st.pod_view(fx.pod("oomkilled", 0)).failed


def _assert_contract_shape(ev: dict) -> None:
    assert set(ev) <= CLASSIFIER_KEYS, set(ev) - CLASSIFIER_KEYS
    json.dumps(ev)  # serialisable (it travels in a TriggerEvent and into the classifier CLI)
    for cond in ev.get("pod_conditions") or []:
        assert set(cond) == {"type", "reason", "message"}
    for event in ev.get("events") or []:
        assert set(event) == {"reason", "message"}


def test_evidence_oomkilled(fx):
    pod = fx.pod("oomkilled", 2)
    ev = st.pod_evidence(pod, events=fx.events("oom", fx.pod_name(2)), log="step 100 loss 0.3\nstep 110 loss 0.29\n", container="trainer")
    _assert_contract_shape(ev)
    assert ev["exit_code"] == 137 and ev["signal"] == 9 and ev["termination_reason"] == "OOMKilled"
    assert ev["pod_phase"] == "Failed" and ev["rank"] == 2 and ev["pod"] == fx.pod_name(2)
    assert ev["log_tail"].endswith("step 110 loss 0.29")
    assert ev["events"] == [{"reason": "Started", "message": "Started container trainer"}]


def test_evidence_preempted_with_disruption_target_and_error_record(fx):
    ev = st.pod_evidence(fx.pod("preempted", 0), events=fx.events("preempted", fx.pod_name(0)))
    _assert_contract_shape(ev)
    assert ev["exit_code"] == 75 and "signal" not in ev
    assert {"type": "DisruptionTarget", "reason": "PreemptionByScheduler", "message": "default-scheduler: preempting to accommodate a higher priority pod"} in ev["pod_conditions"]
    assert ev["error_file"]["message"]["message"].startswith("Preempted: SIGTERM received")
    assert ev["events"][0]["reason"] == "Preempted"


def test_evidence_evicted(fx):
    ev = st.pod_evidence(fx.pod("evicted", 3))
    _assert_contract_shape(ev)
    assert ev["pod_reason"] == "Evicted" and ev["pod_message"].startswith("The node was low on resource: memory.")
    assert ev["termination_reason"] == "ContainerStatusUnknown"
    assert any(c["type"] == "DisruptionTarget" and c["reason"] == "TerminationByKubelet" for c in ev["pod_conditions"])
    assert "error_file" not in ev and ev["log_tail"] == "The container could not be located when the pod was terminated"


def test_evidence_image_pull_backoff(fx):
    ev = st.pod_evidence(fx.pod("image_pull_backoff", 0), events=fx.events("image_pull", fx.pod_name(0)))
    _assert_contract_shape(ev)
    assert ev["termination_reason"] == "ImagePullBackOff" and ev["pod_phase"] == "Pending"
    assert ev["pod_message"].startswith('Back-off pulling image "ghcr.io/gangflow/trainer@sha256:')
    assert [e["reason"] for e in ev["events"]] == ["Scheduled", "Pulling", "Failed", "BackOff"]
    assert "exit_code" not in ev


def test_evidence_user_error_record(fx):
    ev = st.pod_evidence(fx.pod("user_error", 1))
    _assert_contract_shape(ev)
    assert ev["exit_code"] == 1 and ev["termination_reason"] == "Error"
    assert ev["error_file"]["message"]["message"] == "ValueError: injected fault at step 3 (GANGFLOW_FAULT=raise@step=3)"


def test_gang_evidence_root_cause_is_the_first_failure(fx):
    oom = st.pod_evidence(fx.pod("oomkilled", 2))  # finished 10:14:07
    peers = [st.pod_evidence(fx.pod("peer_nccl_error", r)) for r in (0, 1, 3)]  # finished 10:14:11
    evidence = st.gang_evidence(peers + [oom], extra={"pod_conditions": [{"type": "JobSetFailed", "reason": "FailedJobs", "message": "jobset failed due to one or more job failures"}]})
    _assert_contract_shape({k: v for k, v in evidence.items() if k != "ranks"})
    assert evidence["termination_reason"] == "OOMKilled" and evidence["rank"] == 2 and evidence["exit_code"] == 137
    assert [r["rank"] for r in evidence["ranks"]] == [0, 1, 2, 3]
    assert evidence["pod_conditions"][-1]["type"] == "JobSetFailed"
    for rank in evidence["ranks"]:
        _assert_contract_shape(rank)


def test_gang_evidence_prefers_disruption_within_the_same_second(fx):
    evicted = st.pod_evidence(fx.pod("evicted", 3))
    peer = copy.deepcopy(st.pod_evidence(fx.pod("peer_nccl_error", 0)))
    peer["finished_at"] = evicted["finished_at"]
    evidence = st.gang_evidence([peer, evicted])
    assert evidence["pod_reason"] == "Evicted" and evidence["rank"] == 3


def test_a_timestamp_reads_back_to_its_second_and_nonsense_reads_as_none():
    assert st.timestamp(1767225600.9) == "2026-01-01T00:00:00Z"
    assert st.parse_time(st.timestamp(1767225600)) == 1767225600
    assert st.parse_time("2026-01-01T00:00:00.5+00:00") == 1767225600.5  # other RFC 3339 spellings too
    assert st.parse_time(None) is None and st.parse_time("") is None and st.parse_time("yesterday") is None
