"""End to end against the API TEST DOUBLE (`InMemoryKubernetesApi`, real REST paths on 127.0.0.1,
exercised through the provider's hooks and the real kubernetes_asyncio client).

Steps script what the cluster's controllers would do, one per poll of the gang object.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time

import pytest
import yaml

from operators.backends.base import GangSpec
from operators.backends.kubernetes import KubernetesBackend
from operators.exceptions import (
    GangAdmissionTimeout,
    GangCapacityError,
    GangConfigError,
    KubernetesApiError,
    KubernetesRequestError,
)
from operators.kubernetes.status import timestamp
from operators.triggers.gang import GangTrigger

from gangflow_tests_k8s_support import CONN_ID, GANG, NAMESPACE, RUNTIME, Fixtures  # loaded by conftest.py

JS = ("jobset.x-k8s.io", "jobsets")
VJ = ("batch.volcano.sh", "jobs")
KQ = ("kueue.x-k8s.io", "workloads")


def backend(**kwargs) -> KubernetesBackend:
    kwargs.setdefault("poll_interval", 0.01)
    return KubernetesBackend(kubernetes_conn_id=CONN_ID, **kwargs)


GPUS = RUNTIME["resources"]["gpu"]  # processes per pod
VERSION = "5d41402abc4b2a76b9719d911017c592"


def spec(attempt: int = 1, pods: int = 4) -> GangSpec:
    """A gang of `pods` pods (world size = pods x GPUs per pod) training a pinned dataset version."""
    return GangSpec(name=GANG, run_dir=f"/runs/{GANG}", world_size=pods * GPUS, attempt=attempt, overrides=(f"data.version={VERSION}",))


def run_trigger(trigger: GangTrigger) -> dict:
    async def first():
        events = []
        async for event in trigger.run():
            events.append(event)
        assert len(events) == 1, "a trigger yields exactly one event"
        return events[0].payload

    return asyncio.run(asyncio.wait_for(first(), timeout=30))


def fixtures_for(handle: dict) -> Fixtures:
    return Fixtures(attempt=handle["attempt"], name=handle["name"], uid=handle["uid"])


# --- scripted controllers -----------------------------------------------------------------------


def kueue_pending(fx: Fixtures, state: str = "pending_quota"):
    def step(api):
        api.set_status(*JS, NAMESPACE, fx.name, fx.jobset_status("suspended"))
        api.put(*KQ, fx.workload(state))

    return step


def kueue_admit(fx: Fixtures, pod_state: str = "container_creating", ranks=range(4)):
    def step(api):
        workload = fx.workload("admitted")
        for cond in workload["status"]["conditions"]:
            cond["lastTransitionTime"] = timestamp()  # admitted now, as Kueue would stamp it
        api.put(*KQ, workload)
        api.set_status(*JS, NAMESPACE, fx.name, fx.jobset_status("running"), suspend=False)
        for rank in ranks:
            api.put("", "pods", fx.pod(pod_state, rank))

    return step


def pods(fx: Fixtures, state: str, ranks, *, log: str | None = None, events: str | None = None):
    def step(api):
        for rank in ranks:
            pod = fx.pod(state, rank)
            api.put("", "pods", pod)
            if log is not None:
                api.logs[(NAMESPACE, pod["metadata"]["name"])] = log
            if events:
                for event in fx.events(events, pod["metadata"]["name"]):
                    api.put("", "events", event)

    return step


def jobset_status(fx: Fixtures, state: str):
    return lambda api: api.set_status(*JS, NAMESPACE, fx.name, fx.jobset_status(state), suspend=False)


def nothing(api):
    pass


# --- the main story -------------------------------------------------------------------------------


def test_full_flow_quota_admit_run_oom_evidence_teardown(fake_k8s, crd_registry):
    api = fake_k8s
    b = backend(delete_on_success=True)
    handle = b.submit(spec())
    assert api.count("POST", "/jobsets") == 1
    created = api.get(*JS, NAMESPACE, handle["name"])
    assert created is not None and handle["uid"] == created["metadata"]["uid"]
    assert handle["name"] == "train-demo-t1" and handle["kind"] == "JobSet" and not handle["reattached"]
    json.dumps(handle)  # the handle travels through the trigger's kwargs

    fx = fixtures_for(handle)
    oom_log = "step 410 loss 0.412\nstep 420 loss 0.409\nRuntimeError: CUDA out of memory? no: host OOM\n"
    api.steps = [
        kueue_pending(fx),  # Kueue: insufficient quota
        nothing,
        kueue_admit(fx),  # admitted, pods creating
        pods(fx, "running", range(4)),  # every rank Ready
        nothing,
        pods(fx, "oomkilled", [2], log=oom_log, events="oom"),  # rank 2 OOMKilled
    ]
    trigger = b.trigger(handle)
    classpath, kwargs = trigger.serialize()
    assert classpath == "operators.triggers.gang.GangTrigger"
    trigger = GangTrigger(**json.loads(json.dumps(kwargs)))  # round-trips through JSON like the triggerer
    event = run_trigger(trigger)

    assert event["status"] == "failed" and event["phase"] == "running"
    assert "1 of 4 rank(s) failed" in event["message"]
    # the wait was logged in Kueue's own words, with how long
    reasons = [w["reason"] for w in event["waiting"]]
    assert any(
        "Kueue Workload jobset-train-demo-t1-4f0d2: couldn't assign flavors to pod set rank: insufficient unused quota for nvidia.com/gpu in flavor a100, 8 more needed" in r
        for r in reasons
    ), reasons
    assert any("waiting for admission for" in line and "insufficient unused quota" in line for line in trigger.reports)
    assert any("admitted after" in line for line in trigger.reports)
    assert any("running: 4/4 ranks Ready" in line for line in trigger.reports)
    snapshot = event["evidence"]
    assert snapshot["termination_reason"] == "OOMKilled" and snapshot["rank"] == 2

    # meanwhile the Job controller fails the others (later), then collect gathers and tears down
    for rank in (0, 1, 3):
        api.put("", "pods", fx.pod("peer_nccl_error", rank))
    api.set_status(*JS, NAMESPACE, fx.name, fx.jobset_status("failed"))
    result = b.collect(handle, event)

    assert result.succeeded is False and result.exit_code == 137
    ev = result.evidence
    assert ev["termination_reason"] == "OOMKilled" and ev["signal"] == 9 and ev["rank"] == 2
    assert ev["pod_phase"] == "Failed" and "host OOM" in ev["log_tail"]
    assert [r["rank"] for r in ev["ranks"]] == [0, 1, 2, 3]
    assert all("error_file" in r for r in ev["ranks"] if r["rank"] != 2)
    assert {"type": "JobSetFailed", "reason": "FailedJobs", "message": "jobset failed due to one or more job failures"} in ev["pod_conditions"]
    # torn down: the gang, its pods and its Workload are gone (foreground propagation requested)
    assert api.get(*JS, NAMESPACE, handle["name"]) is None
    assert not api.items("", "pods", NAMESPACE) and not api.items(*KQ)
    delete = [p for m, p in api.requests if m == "DELETE"]
    assert delete == [f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NAMESPACE}/jobsets/train-demo-t1"]
    assert api.count("POST", "/jobsets") == 1


def test_worker_restart_reattaches_without_a_second_create(fake_k8s):
    api = fake_k8s
    first = backend().submit(spec())
    again = backend().submit(spec())  # a new worker process, same try
    assert again["reattached"] and again["uid"] == first["uid"] and again["name"] == first["name"]
    assert api.count("POST", "/jobsets") == 1


def test_create_race_409_reattaches(fake_k8s):
    api = fake_k8s
    b = backend()
    plan = b.plan(spec())
    api.put(*JS, copy.deepcopy(plan.body))  # another worker created it between our get and create
    api.fail("GET", f"/jobsets/{plan.name}", 404, times=1)
    handle = b.submit(spec())
    assert handle["reattached"] and api.count("POST", "/jobsets") == 1


def test_later_try_adopts_a_running_gang_and_deletes_finished_ones(fake_k8s):
    api = fake_k8s
    t1 = backend().submit(spec(attempt=1))
    api.set_status(*JS, NAMESPACE, t1["name"], Fixtures().jobset_status("running"), suspend=False)
    t2 = backend().submit(spec(attempt=2))  # the try-1 worker died; its gang still trains
    assert t2["name"] == "train-demo-t1" and t2["reattached"] and t2["attempt"] == 1
    assert t2["pod_selector"] == "gangflow.io/gang=train-demo,gangflow.io/attempt=1"
    api.set_status(*JS, NAMESPACE, t1["name"], Fixtures().jobset_status("failed"))
    t3 = backend().submit(spec(attempt=3))  # the old one finished (failed): delete it, start fresh
    assert t3["name"] == "train-demo-t3" and not t3["reattached"]
    assert api.get(*JS, NAMESPACE, "train-demo-t1") is None
    assert api.count("POST", "/jobsets") == 2


def test_kill_and_trigger_on_kill_delete_the_gang(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    b.kill()
    assert api.get(*JS, NAMESPACE, handle["name"]) is None
    b.kill()  # already gone: no error
    handle = backend().submit(spec(attempt=2))
    asyncio.run(b.trigger(handle).on_kill())
    assert api.get(*JS, NAMESPACE, handle["name"]) is None
    fresh = backend()
    fresh.kill()  # nothing submitted by this instance: a no-op
    fresh.kill(handle)  # explicit handle: already gone, no error


def test_success_deletes_or_keeps_the_gang(fake_k8s):
    api = fake_k8s
    for delete_on_success, attempt in ((True, 1), (False, 2)):
        b = backend(delete_on_success=delete_on_success)
        handle = b.submit(spec(attempt=attempt))
        fx = fixtures_for(handle)
        api.steps = [kueue_admit(fx, "running"), pods(fx, "succeeded", range(4)), jobset_status(fx, "completed")]
        event = run_trigger(b.trigger(handle))
        assert event["status"] == "success", event
        result = b.collect(handle, event)
        assert result.succeeded and result.exit_code == 0 and "succeeded" in result.detail
        assert (api.get(*JS, NAMESPACE, handle["name"]) is None) is delete_on_success


def test_admission_timeout_raises_with_kueues_reason_and_tears_down(fake_k8s):
    api = fake_k8s
    b = backend(runtime={"admissionTimeoutSeconds": 2}, poll_interval=0.2)
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    api.steps = [kueue_pending(fx, "pending_topology")]
    trigger = b.trigger(handle)
    event = run_trigger(trigger)
    assert event["status"] == "timeout" and event["phase"] == "admission"
    assert "not admitted within admissionTimeoutSeconds=2" in event["message"]
    assert any("waiting for admission for" in line for line in trigger.reports)
    assert 'topology \\"gpu-topology\\" doesn\'t allow to fit any of 4 pod(s)' in json.dumps(event["message"])
    with pytest.raises(GangAdmissionTimeout, match="admissionTimeoutSeconds=2 "):
        b.collect(handle, event)
    assert api.get(*JS, NAMESPACE, handle["name"]) is None


def test_the_pipelines_queue_wait_limit_bounds_admission_and_is_named(fake_k8s):
    """Issue 25.3: `training.max_queue_wait_seconds` (GangSpec.max_queue_wait_s) bounds the wait for
    admission instead of the runtime's admissionTimeoutSeconds; the timeout names the pipeline key,
    the time waited and Kueue's last reason, and the gang is deleted so it holds no quota."""
    api = fake_k8s
    b = backend(runtime={"admissionTimeoutSeconds": 3600}, poll_interval=0.2)
    handle = b.submit(dataclasses.replace(spec(), max_queue_wait_s=2))
    assert handle["admission_timeout_seconds"] == 2
    fx = fixtures_for(handle)
    api.steps = [kueue_pending(fx, "pending_topology")]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "timeout" and event["phase"] == "admission"
    assert "not admitted within training.max_queue_wait_seconds=2 (waited " in event["message"]
    assert 'topology \\"gpu-topology\\" doesn\'t allow to fit any of 4 pod(s)' in json.dumps(event["message"])
    with pytest.raises(GangAdmissionTimeout, match="training.max_queue_wait_seconds=2 "):
        b.collect(handle, event)
    assert api.get(*JS, NAMESPACE, handle["name"]) is None
    # without it, the runtime's admissionTimeoutSeconds
    assert b.submit(spec(attempt=2))["admission_timeout_seconds"] == 3600


@pytest.mark.parametrize("value", [0, -3, 1.5, "30m", True])
def test_the_queue_wait_limit_is_a_positive_integer(value):
    with pytest.raises(ValueError, match=r"max_queue_wait_s=.*must be an integer >= 1"):
        dataclasses.replace(spec(), max_queue_wait_s=value)


def test_startup_timeout_names_unschedulable_ranks(fake_k8s):
    api = fake_k8s
    b = backend(runtime={"startupTimeoutSeconds": 1})
    handle = b.submit(spec())
    fx = fixtures_for(handle)

    def admit_long_ago(a):
        kueue_admit(fx, "running", ranks=[0, 1])(a)
        for rank in (2, 3):
            pod = fx.pod("unschedulable", rank)
            a.put("", "pods", pod)
            for event in fx.events("failed_scheduling", pod["metadata"]["name"]):
                a.put("", "events", event)
        wl = a.get(*KQ, NAMESPACE, "jobset-train-demo-t1-4f0d2")
        long_ago = timestamp(time.time() - 30)
        for cond in wl["status"]["conditions"]:
            cond["lastTransitionTime"] = long_ago

    api.steps = [admit_long_ago]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "timeout" and event["phase"] == "startup"
    assert "not all ranks became Ready within startupTimeoutSeconds=1" in event["message"]
    assert "2/4 ranks Ready" in event["message"]
    assert "FailedScheduling: 0/6 nodes are available: 2 Insufficient nvidia.com/gpu" in event["message"]
    with pytest.raises(GangAdmissionTimeout, match="startupTimeoutSeconds=1"):
        b.collect(handle, event)
    assert api.get(*JS, NAMESPACE, handle["name"]) is None


def test_startup_timeout_names_a_running_ranks_failed_readiness_probe(fake_k8s):
    """A rank that runs but never passes its readiness probe (a Ray node that never gets healthy):
    the timeout says so in the kubelet's words, from its Unhealthy event."""
    api = fake_k8s
    b = backend(runtime={"startupTimeoutSeconds": 1})
    handle = b.submit(spec())
    fx = fixtures_for(handle)

    def admit_long_ago(a):
        kueue_admit(fx, "running", ranks=[0, 1, 2])(a)
        pod = fx.pod("running_not_ready", 3)
        a.put("", "pods", pod)
        for event in fx.events("readiness_failed", pod["metadata"]["name"]):
            a.put("", "events", event)
        wl = a.get(*KQ, NAMESPACE, "jobset-train-demo-t1-4f0d2")
        for cond in wl["status"]["conditions"]:
            cond["lastTransitionTime"] = timestamp(time.time() - 30)

    api.steps = [admit_long_ago]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "timeout" and event["phase"] == "startup"
    assert "3/4 ranks Ready" in event["message"]
    assert "Running, not Ready: Readiness probe failed: HTTP probe failed with statuscode: 503" in event["message"]


def test_kueue_preemption_is_a_failure_with_eviction_evidence(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)

    def preempt(a):
        a.put(*KQ, fx.workload("evicted_preempted"))
        for rank in range(4):  # Kueue suspends the JobSet: pods are terminating, none failed yet
            pod = fx.pod("running", rank)
            pod["metadata"]["deletionTimestamp"] = "2026-11-29T10:20:10Z"
            a.put("", "pods", pod)

    api.steps = [kueue_admit(fx, "running"), nothing, preempt]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "failed" and "Kueue evicted Workload jobset-train-demo-t1-4f0d2 (Preempted)" in event["message"]
    result = b.collect(handle, event)
    ev = result.evidence
    assert ev["pod_reason"] == "Preempted"
    assert ev["pod_message"].startswith("Kueue evicted Workload jobset-train-demo-t1-4f0d2: Preempted to accommodate a workload")
    assert any(c["type"] == "Evicted" and c["reason"] == "Preempted" and "due to prioritization in the ClusterQueue" in c["message"] for c in ev["pod_conditions"])
    assert api.get(*JS, NAMESPACE, handle["name"]) is None


def test_preempted_rank_with_disruption_target(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    api.steps = [kueue_admit(fx, "running"), pods(fx, "preempted", [1], events="preempted", log="saving final checkpoint at step 412\n")]
    event = run_trigger(b.trigger(handle))
    result = b.collect(handle, event)
    ev = result.evidence
    assert ev["exit_code"] == 75 and ev["rank"] == 1
    assert any(c["type"] == "DisruptionTarget" for c in ev["pod_conditions"])
    assert ev["error_file"]["message"]["message"].startswith("Preempted: SIGTERM received")
    assert any(e["reason"] == "Preempted" for e in ev["events"])


def test_evicted_rank(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    api.steps = [kueue_admit(fx, "running"), pods(fx, "evicted", [3])]
    result = b.collect(handle, run_trigger(b.trigger(handle)))
    assert result.evidence["pod_reason"] == "Evicted" and result.evidence["rank"] == 3
    assert result.evidence["pod_message"].startswith("The node was low on resource: memory.")


def test_image_pull_backoff_fails_after_the_grace_period(fake_k8s):
    api = fake_k8s
    b = backend(image_pull_grace_seconds=0.05)
    handle = b.submit(spec())
    fx = fixtures_for(handle)

    def admit_with_bad_image(a):
        kueue_admit(fx, "image_pull_backoff")(a)
        for event in fx.events("image_pull", fx.pod_name(0)):
            a.put("", "events", event)

    api.steps = [admit_with_bad_image]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "failed" and "cannot start" in event["message"]
    result = b.collect(handle, event)
    ev = result.evidence
    assert ev["termination_reason"] == "ImagePullBackOff" and ev["pod_phase"] == "Pending"
    assert any(e["reason"] == "Failed" and "not found" in e["message"] for e in ev["events"])
    assert len(ev["ranks"]) == 4
    assert api.get(*JS, NAMESPACE, handle["name"]) is None


def test_user_error_evidence(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    api.steps = [kueue_admit(fx, "running"), pods(fx, "user_error", [0])]
    result = b.collect(handle, run_trigger(b.trigger(handle)))
    assert result.exit_code == 1
    assert result.evidence["error_file"]["message"]["message"].startswith("ValueError: injected fault")


def test_gang_deleted_outside_gangflow(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    api.steps = [lambda a: a.remove(*JS, NAMESPACE, handle["name"])]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "failed" and "was deleted outside gangflow" in event["message"]
    result = b.collect(handle, event)
    assert result.evidence["pod_reason"] == "GangDeleted"


def test_trigger_rides_out_transient_api_errors(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    api.fail("GET", "/jobsets/train-demo-t1", 503, "etcdserver: request timed out", times=2)
    api.steps = [kueue_admit(fx, "succeeded"), jobset_status(fx, "completed")]
    trigger = b.trigger(handle)
    event = run_trigger(trigger)
    assert event["status"] == "success"
    assert any("Kubernetes API error 1/6" in r and "HTTP 503" in r and "etcdserver: request timed out" in r for r in trigger.reports)


def test_trigger_gives_up_on_forbidden(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    api.fail("GET", "/pods", 403, 'pods is forbidden: User "system:serviceaccount:airflow:worker" cannot list resource "pods" in API group "" in the namespace "ml"', times=10)
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "error" and "cannot list resource" in event["message"]
    with pytest.raises(KubernetesApiError, match="cannot list resource"):
        b.collect(handle, event)


# --- API errors on submit --------------------------------------------------------------------------


def test_create_forbidden_is_a_user_error_naming_namespace_and_name(fake_k8s):
    fake_k8s.fail("POST", "/jobsets", 403, 'jobsets.jobset.x-k8s.io is forbidden: User "system:serviceaccount:airflow:worker" cannot create resource "jobsets"')
    with pytest.raises(KubernetesRequestError) as exc:
        backend().submit(spec())
    assert "create JobSet ml/train-demo-t1: HTTP 403" in str(exc.value) and "cannot create resource" in str(exc.value)
    assert exc.value.retryable is False


def test_create_server_error_is_retryable(fake_k8s):
    fake_k8s.fail("POST", "/jobsets", 503, "the server is currently unable to handle the request")
    with pytest.raises(KubernetesApiError) as exc:
        backend().submit(spec())
    assert "create JobSet ml/train-demo-t1: HTTP 503" in str(exc.value) and exc.value.retryable is True


def test_invalid_object_is_refused_with_the_api_message(fake_k8s):
    b = backend()
    b.runtime()  # load, then break the plan to show 422 handling
    original = b.plan

    def broken(s):
        plan = original(s)
        plan.body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "x"
        return plan

    b.plan = broken
    with pytest.raises(KubernetesRequestError, match="(?s)create JobSet ml/train-demo-t1: HTTP 422.*imagePullPolicy2"):
        b.submit(spec())


# --- runtime ConfigMap -------------------------------------------------------------------------------


def test_runtime_configmap_missing_or_bad(fake_k8s, runtime_mapping):
    fake_k8s.remove("", "configmaps", NAMESPACE, "gangflow-runtime")
    with pytest.raises(GangConfigError, match="ConfigMap ml/gangflow-runtime key runtime.yaml not found"):
        backend().runtime()
    bad = dict(runtime_mapping, image="ghcr.io/gangflow/trainer:latest")
    fake_k8s.put("", "configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gangflow-runtime", "namespace": NAMESPACE}, "data": {"runtime.yaml": yaml.safe_dump(bad)}})
    with pytest.raises(GangConfigError, match=r"runtime image='ghcr.io/gangflow/trainer:latest': must be pinned by digest .*ConfigMap ml/gangflow-runtime"):
        backend().runtime()
    # per-task overrides win over the ConfigMap
    good = backend(runtime={"image": runtime_mapping["image"], "queue": "team-b"}).runtime()
    assert good.queue == "team-b"


# --- check_capacity ----------------------------------------------------------------------------------


def _queues(api, *, gpu_quota: str, cohort: bool = False, borrowing: str | None = None):
    api.put("kueue.x-k8s.io", "localqueues", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "gangflow", "namespace": NAMESPACE}, "spec": {"clusterQueue": "gpu-cluster-queue"}})
    gpu = {"name": "nvidia.com/gpu", "nominalQuota": gpu_quota}
    if borrowing is not None:
        gpu["borrowingLimit"] = borrowing
    cq = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": "gpu-cluster-queue"},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                    "flavors": [{"name": "a100", "resources": [{"name": "cpu", "nominalQuota": "256"}, {"name": "memory", "nominalQuota": "2Ti"}, gpu]}],
                }
            ],
        },
    }
    if cohort:
        cq["spec"]["cohortName"] = "research"
    api.put("kueue.x-k8s.io", "clusterqueues", cq)


def test_check_capacity_refuses_more_than_the_clusterqueue_holds(fake_k8s, crd_registry):
    _queues(fake_k8s, gpu_quota="16")
    b = backend()
    b.check_capacity(spec(pods=2))  # 2 x 8 GPUs = 16: fits
    with pytest.raises(GangCapacityError) as exc:
        b.check_capacity(spec(pods=4))  # 32 GPUs
    assert "needs 32 nvidia.com/gpu (4 pods x 8) but ClusterQueue gpu-cluster-queue can hold at most 16" in str(exc.value)


def test_check_capacity_counts_borrowing(fake_k8s):
    _queues(fake_k8s, gpu_quota="16", cohort=True, borrowing="16")
    backend().check_capacity(spec(pods=4))
    with pytest.raises(GangCapacityError, match="including borrowing"):
        backend().check_capacity(spec(pods=5))
    _queues(fake_k8s, gpu_quota="16", cohort=True)  # unlimited borrowing in the cohort: may fit
    backend().check_capacity(spec(pods=64))


def test_check_capacity_missing_localqueue_and_forbidden_clusterqueue(fake_k8s):
    with pytest.raises(GangConfigError, match="Kueue LocalQueue ml/gangflow not found"):
        backend().check_capacity(spec())
    _queues(fake_k8s, gpu_quota="8")
    fake_k8s.fail("GET", "/clusterqueues/", 403, "clusterqueues.kueue.x-k8s.io is forbidden", times=2)
    logs = []
    backend(log=logs.append).check_capacity(spec(pods=4))  # cannot read: skipped, logged
    assert any("capacity check skipped" in line and "403" in line for line in logs)


def test_check_capacity_rejects_uncovered_resources(fake_k8s):
    _queues(fake_k8s, gpu_quota="16")
    cq = fake_k8s.get("kueue.x-k8s.io", "clusterqueues", None, "gpu-cluster-queue")
    cq["spec"]["resourceGroups"][0]["coveredResources"] = ["cpu", "memory"]
    with pytest.raises(GangCapacityError, match="covers no nvidia.com/gpu"):
        backend().check_capacity(spec(pods=1))


# --- Volcano ------------------------------------------------------------------------------------------


def test_volcano_flow_logs_podgroup_reason_then_succeeds(fake_k8s):
    api = fake_k8s
    b = backend(runtime={"scheduler": "volcano"})
    handle = b.submit(spec())
    assert handle["kind"] == "VolcanoJob" and api.count("POST", "/apis/batch.volcano.sh/v1alpha1/namespaces/ml/jobs") == 1
    fx = fixtures_for(handle)

    def pending(a):
        a.set_status(*VJ, NAMESPACE, fx.name, fx.volcano_status("pending"))
        a.put("scheduling.volcano.sh", "podgroups", fx.podgroup("unschedulable"))
        for rank in range(4):
            pod = fx.pod("unschedulable", rank)
            pod["metadata"]["labels"].pop("batch.kubernetes.io/job-completion-index")
            pod["metadata"]["annotations"] = {"volcano.sh/task-index": str(rank), "scheduling.k8s.io/group-name": f"{fx.name}-{fx.uid}"}
            a.put("", "pods", pod)

    def running(a):
        a.set_status(*VJ, NAMESPACE, fx.name, fx.volcano_status("running"))
        for rank in range(4):
            a.put("", "pods", fx.pod("running", rank))

    def done(a):
        status = fx.volcano_status("running")
        status["state"] = {"phase": "Completed", "lastTransitionTime": "2026-11-29T11:40:03Z"}
        a.set_status(*VJ, NAMESPACE, fx.name, status)

    api.steps = [pending, running, nothing, done]
    trigger = b.trigger(handle)
    event = run_trigger(trigger)
    assert event["status"] == "success"
    assert any("4/4 tasks in gang unschedulable: pod group is not ready, 4 Pending, 4 minAvailable" in w["reason"] for w in event["waiting"])
    assert b.collect(handle, event).succeeded
    assert api.get(*VJ, NAMESPACE, handle["name"]) is None


# --- Kubeflow Trainer TrainJob ------------------------------------------------------------------------


def test_trainjob_submit_validates_and_completes(fake_k8s):
    api = fake_k8s
    b = backend(runtime={"api": "trainjob"})
    handle = b.submit(spec())  # the double validates the body against the TrainJob CRD (strict)
    assert handle["kind"] == "TrainJob" and handle["container"] == "node"
    body = api.get("trainer.kubeflow.org", "trainjobs", NAMESPACE, handle["name"])
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gangflow" and body["spec"]["trainer"]["numNodes"] == 4
    fx = fixtures_for(handle)

    def admitted(a):
        workload = fx.workload("admitted")
        for cond in workload["status"]["conditions"]:
            cond["lastTransitionTime"] = timestamp()
        a.put(*KQ, workload)
        a.set_status("trainer.kubeflow.org", "trainjobs", NAMESPACE, fx.name, {"conditions": []}, suspend=False)
        for rank in range(4):
            a.put("", "pods", fx.pod("running", rank))

    def complete(a):
        a.set_status(
            "trainer.kubeflow.org",
            "trainjobs",
            NAMESPACE,
            fx.name,
            {"conditions": [{"type": "Complete", "status": "True", "reason": "JobsCompleted", "message": "jobset completed successfully", "lastTransitionTime": timestamp()}]},
        )

    api.steps = [admitted, nothing, complete]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "success" and "TrainJob ml/train-demo-t1 succeeded" in event["message"]
    assert b.collect(handle, event).succeeded
    assert api.get("trainer.kubeflow.org", "trainjobs", NAMESPACE, handle["name"]) is None


def test_large_gang_keeps_every_failed_rank_and_logs_the_root_cause(fake_k8s):
    api = fake_k8s
    b = backend()
    handle = b.submit(spec(pods=16))
    fx = fixtures_for(handle)

    def many_fail(a):
        for rank in range(16):
            pod = fx.pod("oomkilled" if rank == 13 else "peer_nccl_error", rank)
            a.put("", "pods", pod)
            a.logs[(NAMESPACE, pod["metadata"]["name"])] = f"rank {rank} last words\n"

    api.steps = [kueue_admit(fx, "running", ranks=range(16)), many_fail]
    result = b.collect(handle, run_trigger(b.trigger(handle)))
    ev = result.evidence
    assert len(ev["ranks"]) == 16
    assert ev["rank"] == 13 and ev["termination_reason"] == "OOMKilled" and ev["log_tail"] == "rank 13 last words"
    assert sum(1 for r in ev["ranks"] if "log_tail" in r) >= 8


# --- pause and resume (operators/cli/gang.py) -------------------------------------------------------


def _gang_cli(api, tmp_path, *args: str) -> tuple[int, dict]:
    import contextlib
    import io

    from operators.cli import gang

    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(json.dumps(api.kubeconfig(NAMESPACE)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gang.main([*args, "--namespace", NAMESPACE, "--kubeconfig", str(kubeconfig)])
    return code, json.loads(out.getvalue().strip().splitlines()[-1])


def test_pause_deactivates_the_kueue_workload_and_marks_the_gang_resume_undoes_both(fake_k8s, tmp_path):
    from operators.kubernetes.builders import PAUSED_ANNOTATION

    api = fake_k8s
    handle = backend().submit(spec())
    fx = fixtures_for(handle)
    kueue_admit(fx, "running")(api)
    code, out = _gang_cli(api, tmp_path, "pause", GANG, "--reason", "maintenance of node-7")
    assert code == 0 and out["paused"] is True and out["name"] == handle["name"] and out["workloads"] == ["jobset-train-demo-t1-4f0d2"]
    gang_obj, workload = api.get(*JS, NAMESPACE, handle["name"]), api.get(*KQ, NAMESPACE, "jobset-train-demo-t1-4f0d2")
    assert "maintenance of node-7" in gang_obj["metadata"]["annotations"][PAUSED_ANNOTATION]
    assert workload["spec"]["active"] is False
    assert gang_obj["spec"].get("suspend") is not True  # Kueue owns suspend for the gangs it manages
    code, out = _gang_cli(api, tmp_path, "pause", GANG)
    assert code == 1 and "is already paused (paused at " in out["error"]
    code, out = _gang_cli(api, tmp_path, "resume", GANG)
    gang_obj, workload = api.get(*JS, NAMESPACE, handle["name"]), api.get(*KQ, NAMESPACE, "jobset-train-demo-t1-4f0d2")
    assert code == 0 and out["paused"] is False
    assert PAUSED_ANNOTATION not in (gang_obj["metadata"].get("annotations") or {}) and workload["spec"]["active"] is True
    assert gang_obj["metadata"]["annotations"]["gangflow.io/pauses"] == "1"  # kept: the watch counts pauses it never saw
    code, out = _gang_cli(api, tmp_path, "resume", GANG)
    assert code == 1 and "is not paused" in out["error"]


def test_resume_waits_for_the_paused_pods_to_be_gone_before_the_gang_stops_being_paused(fake_k8s):
    import asyncio
    import threading

    from operators.cli.gang import set_paused
    from operators.hooks.kubernetes import open_api
    from operators.kubernetes.builders import PAUSED_ANNOTATION

    api = fake_k8s
    handle = backend().submit(spec())
    fx = fixtures_for(handle)
    kueue_admit(fx, "running")(api)

    async def control(paused: bool):
        async with open_api(CONN_ID, NAMESPACE) as gang_api:
            return await set_paused(gang_api, GANG, paused, poll=0.05)

    asyncio.run(control(True))
    for rank in range(4):  # the Job controller deleted them: terminating
        api.get("", "pods", NAMESPACE, fx.pod_name(rank))["metadata"]["deletionTimestamp"] = timestamp()
    gone = threading.Timer(0.5, lambda: [api.remove("", "pods", NAMESPACE, fx.pod_name(rank)) for rank in range(4)])
    gone.start()
    asyncio.run(control(False))
    assert api.get("", "pods", NAMESPACE, fx.pod_name(0)) is None  # resume returned only after they were gone
    assert PAUSED_ANNOTATION not in api.get(*JS, NAMESPACE, handle["name"])["metadata"]["annotations"]


def test_pause_without_kueue_suspends_the_gang_and_an_unknown_gang_is_named(fake_k8s, tmp_path):
    api = fake_k8s
    handle = backend().submit(spec())
    api.set_status(*JS, NAMESPACE, handle["name"], Fixtures(name=handle["name"]).jobset_status("running"), suspend=False)
    assert _gang_cli(api, tmp_path, "pause", GANG)[0] == 0
    assert api.get(*JS, NAMESPACE, handle["name"])["spec"]["suspend"] is True
    assert _gang_cli(api, tmp_path, "resume", GANG)[0] == 0
    assert api.get(*JS, NAMESPACE, handle["name"])["spec"]["suspend"] is False
    code, out = _gang_cli(api, tmp_path, "pause", "no-such-gang")
    assert code == 1 and "no running JobSet, TrainJob, RayJob or MPIJob labelled gangflow.io/gang=no-such-gang in namespace ml" in out["error"]
    jobset_status(Fixtures(name=handle["name"]), "completed")(api)  # a finished gang is not paused
    code, out = _gang_cli(api, tmp_path, "pause", GANG)
    assert code == 1 and out["error"].endswith("(1 finished)")


def test_a_paused_gang_waits_and_a_resumed_one_runs_again_without_a_failure(fake_k8s):
    """The watch through a pause: Kueue's InactiveWorkload eviction and the ranks stopped by it are
    not a failure nor a preemption; after the resume, admission and start-up again, then success."""
    from operators.kubernetes.builders import PAUSED_ANNOTATION, PAUSES_ANNOTATION

    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)

    def pause(a):
        obj = a.get(*JS, NAMESPACE, handle["name"])
        obj["metadata"].setdefault("annotations", {}).update({PAUSED_ANNOTATION: "paused at 2026-12-03T10:00:00Z: test", PAUSES_ANNOTATION: "1"})
        workload = fx.workload("admitted")
        workload["spec"]["active"] = False
        workload["status"]["conditions"] = [
            {"type": "QuotaReserved", "status": "False", "reason": "InactiveWorkload", "message": "The workload is deactivated", "lastTransitionTime": timestamp()},
            {"type": "Admitted", "status": "False", "reason": "InactiveWorkload", "message": "The workload is deactivated", "lastTransitionTime": timestamp()},
            {"type": "Evicted", "status": "True", "reason": "InactiveWorkload", "message": "The workload is deactivated", "lastTransitionTime": timestamp()}]
        a.put(*KQ, workload)
        for rank in range(4):  # the ranks took their final checkpoint and exited 75
            pod = fx.pod("user_error", rank)
            pod["metadata"]["creationTimestamp"] = "2026-12-03T09:00:00Z"
            pod["metadata"]["deletionTimestamp"] = timestamp()
            a.put("", "pods", pod)

    def resumed_still_evicted(a):
        obj = a.get(*JS, NAMESPACE, handle["name"])
        obj["metadata"]["annotations"].pop(PAUSED_ANNOTATION)
        a.get(*KQ, NAMESPACE, "jobset-train-demo-t1-4f0d2")["spec"]["active"] = True

    def old_pods_gone(a):
        for rank in range(4):
            a.remove("", "pods", NAMESPACE, fx.pod_name(rank))

    def admitted_again(a):
        kueue_admit(fx, "running")(a)
        for rank in range(4):  # the JobSet's new pods
            a.get("", "pods", NAMESPACE, fx.pod_name(rank))["metadata"]["creationTimestamp"] = timestamp()

    api.steps = [kueue_admit(fx, "running"), nothing, pause, nothing, nothing, old_pods_gone, resumed_still_evicted,
                 admitted_again, nothing, jobset_status(fx, "completed")]  # fmt: skip
    trigger = b.trigger(handle)
    event = run_trigger(trigger)
    assert event["status"] == "success", event
    assert event["pauses"] == 1
    assert any("paused (paused at 2026-12-03T10:00:00Z: test)" in r for r in trigger.reports)
    assert any("resumed after" in r for r in trigger.reports)
    assert any("running: 4/4 ranks Ready" in r for r in trigger.reports)  # the new pods, after the resume


def test_a_pause_no_poll_saw_is_counted_and_its_requeue_is_no_failure(fake_k8s):
    """Paused and resumed between two polls: the watch sees only the count and Kueue's requeue."""
    from operators.kubernetes.builders import PAUSES_ANNOTATION

    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)

    def paused_and_resumed_unseen(a):
        a.get(*JS, NAMESPACE, handle["name"])["metadata"].setdefault("annotations", {})[PAUSES_ANNOTATION] = "1"
        workload = fx.workload("admitted")
        workload["status"]["conditions"] = [
            {"type": "QuotaReserved", "status": "False", "reason": "InactiveWorkload", "message": "The workload is deactivated", "lastTransitionTime": timestamp()},
            {"type": "Evicted", "status": "True", "reason": "InactiveWorkload", "message": "The workload is deactivated", "lastTransitionTime": timestamp()}]
        a.put(*KQ, workload)
        for rank in range(4):
            a.remove("", "pods", NAMESPACE, fx.pod_name(rank))

    api.steps = [kueue_admit(fx, "running"), nothing, paused_and_resumed_unseen, nothing, kueue_admit(fx, "running"), jobset_status(fx, "completed")]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "success" and event["pauses"] == 1, event


# --- MultiKueue: the gang runs on a worker cluster (docs/kubernetes.md, MultiKueue) --------------------


def _dispatched(fx: Fixtures, cluster: str):
    """The manager's Kueue: the MultiKueue check Ready, the Workload admitted (30 s ago),
    status.clusterName set; the manager's JobSet unsuspended. No pod is created here: they run on
    the worker."""
    def step(api):
        workload = fx.workload("admitted")
        for cond in workload["status"]["conditions"]:
            cond["lastTransitionTime"] = timestamp(time.time() - 30)
        workload["status"]["admissionChecks"] = [{"name": "gangflow-multikueue", "state": "Ready", "lastTransitionTime": timestamp(),
                                                  "message": f'The workload got reservation on "{cluster}"'}]  # fmt: skip
        workload["status"]["clusterName"] = cluster
        api.put(*KQ, workload)
        api.set_status(*JS, NAMESPACE, fx.name, fx.jobset_status("running"), suspend=False)

    return step


def _worker_lost(fx: Fixtures):
    """Kueue after workerLostTimeout: the MultiKueue check back to Retry, status.clusterName cleared,
    the manager's Workload evicted (reason AdmissionCheck), the JobSet suspended."""
    def step(api):
        workload = api.get(*KQ, NAMESPACE, fx.workload("admitted")["metadata"]["name"])
        workload["status"]["admissionChecks"] = [{"name": "gangflow-multikueue", "state": "Retry", "lastTransitionTime": timestamp(),
                                                  "message": "Reserving remote lost"}]  # fmt: skip
        workload["status"].pop("clusterName")
        workload["status"]["conditions"] = [
            {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "At least one admission check is false", "lastTransitionTime": timestamp()},
            {"type": "Admitted", "status": "False", "reason": "AdmissionCheck", "message": "At least one admission check is false", "lastTransitionTime": timestamp()},
            {"type": "Evicted", "status": "True", "reason": "AdmissionCheck", "message": "At least one admission check is false", "lastTransitionTime": timestamp()}]
        api.get(*JS, NAMESPACE, fx.name)["spec"]["suspend"] = True

    return step


def test_a_gang_multikueue_dispatched_runs_without_pods_here_and_names_its_worker(fake_k8s):
    api = fake_k8s
    b = backend(runtime={"startupTimeoutSeconds": 1})
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    api.steps = [_dispatched(fx, "worker-2"), *[nothing] * 200, jobset_status(fx, "completed")]  # 2 s and more of polls
    trigger = b.trigger(handle)
    event = run_trigger(trigger)
    # without MultiKueue in the watch: 0/4 ranks Ready here, and the start-up timeout ends the gang
    assert event["status"] == "success", event
    assert event["dispatched_to"] == "worker-2"
    assert any("dispatched by MultiKueue to worker cluster 'worker-2'" in r for r in trigger.reports)
    assert any("running on worker cluster 'worker-2' (MultiKueue)" in r for r in trigger.reports)


def test_a_lost_worker_cluster_is_an_infra_failure_naming_the_worker_not_a_preemption(fake_k8s):
    from operators.failures import classify
    from operators.failures.preemption import preemption_reason

    api = fake_k8s
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    api.steps = [_dispatched(fx, "worker-1"), nothing, _worker_lost(fx)]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "failed" and event["dispatched_to"] == "worker-1", event
    assert "Kueue evicted Workload" in event["message"] and "(AdmissionCheck)" in event["message"]
    result = b.collect(handle, event)
    assert result.evidence["dispatched_to"] == "worker-1"
    verdict = classify(result.evidence)
    assert verdict.kind == "infra" and verdict.rule == "worker-cluster-lost" and verdict.retryable, verdict
    assert preemption_reason(result.evidence) is None  # a lost cluster spends a retry; a preemption would not


def test_a_worker_lost_before_any_poll_saw_the_dispatch_is_still_infra_without_naming_a_worker(fake_k8s):
    """Kueue clears status.clusterName when it evicts: a gang dispatched and lost between two polls
    leaves no worker name to read, and the verdict does not need one."""
    from operators.failures import classify

    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    dispatched, lost = _dispatched(fx, "worker-1"), _worker_lost(fx)
    fake_k8s.steps = [lambda api: (dispatched(api), lost(api))]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "failed" and event["dispatched_to"] is None, event
    result = b.collect(handle, event)
    assert "dispatched_to" not in result.evidence
    verdict = classify(result.evidence)
    assert verdict.kind == "infra" and verdict.rule == "worker-cluster-lost", verdict


def test_a_dispatched_gang_that_ends_before_a_poll_sees_it_running_still_names_its_worker(fake_k8s):
    """The first poll that reads the Workload admitted on a worker also reads the JobSet completed:
    the worker is named from the finished Workload (Kueue keeps status.clusterName)."""
    b = backend()
    handle = b.submit(spec())
    fx = fixtures_for(handle)
    dispatched, completed = _dispatched(fx, "worker-2"), jobset_status(fx, "completed")
    fake_k8s.steps = [lambda api: (dispatched(api), completed(api))]
    event = run_trigger(b.trigger(handle))
    assert event["status"] == "success" and event["dispatched_to"] == "worker-2", event
