"""The watch's evidence of a failed MPIJob: its launcher pod's log holds every rank's lines (mpirun
--tag-output) and Open MPI's summary of the rank that failed first; the evidence is that rank's,
as the local backend's mpirun evidence is, not whichever rank's words the log tail ends with. And
the start-up gate of the kinds whose pods do not all host ranks (a RayJob's head, an MPIJob's launcher)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from operators.failures import classify
from operators.kubernetes import status as st
from operators.kubernetes.watch import gather_evidence

from gangflow_tests_k8s_support import CONN_ID, NAMESPACE, Fixtures, merged_again  # loaded by conftest.py

# real mpirun output of 2-rank gangs: rank 1 SIGKILLed at an unsynchronised time (rank 0 then lost
# its peer: "Connection reset by peer"), and rank 1 raising in the training code
MPIRUN = Path(__file__).resolve().parents[1] / "backends" / "fixtures"


def _launcher_pod(fx, exit_code: int, message: str = "") -> dict:
    pod = fx.pod("user_error", rank=0)
    meta = pod["metadata"]
    meta["name"] = f"{fx.name}-launcher-x7k2q"
    meta["labels"] = {"gangflow.io/gang": fx.gang, "gangflow.io/attempt": "1", st.MPI_ROLE_LABEL: "launcher",
                      "training.kubeflow.org/job-name": fx.name, "training.kubeflow.org/operator-name": "mpi-operator"}  # fmt: skip
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    terminated.update(exitCode=exit_code, message=message)
    return pod


def _evidence(api, fx, fixture: str, exit_code: int, message: str = "") -> dict:
    from operators.hooks.kubernetes import open_api

    pod = api.put("", "pods", _launcher_pod(fx, exit_code, message))
    api.logs[(NAMESPACE, pod["metadata"]["name"])] = (MPIRUN / f"{fixture}.out").read_text()
    handle = {"kind": "MPIJob", "name": fx.name, "namespace": NAMESPACE, "pod_selector": f"gangflow.io/gang={fx.gang}",
              "container": pod["spec"]["containers"][0]["name"]}  # fmt: skip

    async def gather():
        async with open_api(CONN_ID, NAMESPACE) as gang_api:
            return await gather_evidence(gang_api, handle)

    return asyncio.run(gather())


@pytest.mark.parametrize(("fixture", "exit_code", "kind", "words"), [
    ("mpirun_kill_time_rank_1", 137, "infra", "SIGKILL"),
    ("mpirun_raise_rank_1", 1, "user", "ValueError"),
])  # fmt: skip
def test_a_failed_mpijob_is_judged_on_the_rank_mpirun_names(fake_k8s, fixture, exit_code, kind, words):
    evidence = _evidence(fake_k8s, Fixtures(), fixture, exit_code)
    assert evidence["rank"] == 1 and evidence["pod"].endswith("-launcher-x7k2q")
    assert "Connection reset by peer" not in evidence["log_tail"]  # rank 0's words after rank 1 died
    verdict = classify(evidence)
    assert verdict.kind == kind and words in verdict.reason and "rank 1" in verdict.reason, verdict.reason


def test_another_ranks_record_in_the_launchers_termination_message_stays_that_ranks(fake_k8s):
    """The cluster drill found it: rank 0's error record (its lost peer) as the launcher's
    termination message was read as the killed rank's, and "peer lost" won over the SIGKILL."""
    record = (MPIRUN / "mpirun_kill_time_rank_1.rank-0.json").read_text()
    evidence = _evidence(fake_k8s, Fixtures(), "mpirun_kill_time_rank_1", 137, message=record)
    assert evidence["rank"] == 1 and "error_file" not in evidence
    assert [(r["rank"], "error_file" in r) for r in evidence["ranks"]] == [(0, True), (1, False)]
    verdict = classify(evidence)
    assert (verdict.kind, verdict.rule) == ("infra", "killed-from-outside") and "rank 1" in verdict.reason, verdict.reason


def test_the_killed_ranks_verdict_survives_the_merge_of_the_triggers_snapshot_with_fresh_evidence(fake_k8s):
    """The training task merges the trigger's snapshot with what it gathers again (per pod): the other
    rank's record must stay an entry of its own there too (the drill found the merge undoing it)."""
    record = (MPIRUN / "mpirun_kill_time_rank_1.rank-0.json").read_text()
    snapshot = _evidence(fake_k8s, Fixtures(), "mpirun_kill_time_rank_1", 137, message=record)

    merged = merged_again(snapshot, "MPIJob")
    assert merged["rank"] == 1 and "error_file" not in merged
    verdict = classify(merged)
    assert (verdict.kind, verdict.rule) == ("infra", "killed-from-outside") and "rank 1" in verdict.reason, verdict.reason


class _StartupApi:
    """The reads GangWatcher.poll makes, answered from lists (a double of the API server for one poll)."""

    def __init__(self, obj: dict, pods: list[dict]):
        self.obj, self.pods = obj, pods

    async def get_custom(self, *args):
        return self.obj

    async def list_pods(self, selector):
        return self.pods

    async def list_workloads(self, uid):
        return [Fixtures().workload("admitted")]

    async def list_events(self, *args):
        return []


def _role_pod(fx, name: str, ready: bool, labels: dict) -> dict:
    pod = fx.pod("running" if ready else "container_creating", rank=0)
    pod["metadata"]["name"] = name
    pod["metadata"]["labels"] = {"gangflow.io/gang": fx.gang, **labels}
    return pod


@pytest.mark.parametrize(("kind", "helpers", "worker_labels"), [
    ("RayJob", [{"ray.io/node-type": "head"}, {"batch.kubernetes.io/job-name": "submitter"}], {"ray.io/node-type": "worker"}),
    ("MPIJob", [{st.MPI_ROLE_LABEL: "launcher"}], {st.MPI_ROLE_LABEL: "worker"}),
])  # fmt: skip
def test_start_up_counts_the_pods_that_host_ranks_not_a_head_submitter_or_launcher(kind, helpers, worker_labels):
    """A RayJob's head and submitter, an MPIJob's launcher, are Ready before the ranks' pods: the
    gang is running only once every rank pod is (the drill said "4/2 ranks Ready")."""
    from operators.kubernetes.watch import GangWatcher

    fx = Fixtures()
    handle = {"kind": kind, "name": fx.name, "namespace": NAMESPACE, "group": "g", "version": "v1", "plural": "p",
              "pod_selector": f"gangflow.io/gang={fx.gang}", "pods": 2, "world_size": 2, "scheduler": "kueue", "uid": fx.uid,
              "admission_timeout_seconds": 10**9, "startup_timeout_seconds": 10**9}  # fmt: skip
    helper_pods = [_role_pod(fx, f"helper-{i}", True, labels) for i, labels in enumerate(helpers)]
    workers = [_role_pod(fx, "worker-0", True, worker_labels), _role_pod(fx, "worker-1", False, worker_labels)]
    obj = {"kind": kind, "metadata": {"name": fx.name, "creationTimestamp": "2026-11-29T10:02:00Z"}, "spec": {},
           "status": {"jobDeploymentStatus": "Running"} if kind == "RayJob" else {}}
    lines: list[str] = []
    watcher = GangWatcher(_StartupApi(obj, helper_pods + workers), handle, log=lines.append)

    assert asyncio.run(watcher.poll()) is None
    assert watcher.phase == "startup" and watcher.started_at is None, lines
    assert "1/2 ranks Ready; ContainerCreating" in lines[-1], lines

    workers[1] = _role_pod(fx, "worker-1", True, worker_labels)
    watcher.api = _StartupApi(obj, helper_pods + workers)
    assert asyncio.run(watcher.poll()) is None
    assert watcher.phase == "running" and "running: 2/2 ranks Ready" in lines[-1], lines


def _gang_past_its_deadline(fx, kind: str) -> dict:
    """A TrainJob as Trainer v2.2 leaves it past `spec.activeDeadlineSeconds` (reconcileDeadline: the
    Failed condition DeadlineExceeded, its JobSet deleted), or a RayJob as KubeRay does (Failed,
    DeadlineExceeded, its RayCluster deleted): either way the pods are going."""
    meta = {"name": fx.name, "namespace": NAMESPACE, "uid": fx.uid}
    if kind == "RayJob":
        return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": {"activeDeadlineSeconds": 12},
                "status": {"jobDeploymentStatus": "Failed", "jobStatus": "RUNNING", "reason": "DeadlineExceeded",
                           "message": "The RayJob has passed the activeDeadlineSeconds. StartTime: 2026-11-29T10:04:48Z. ActiveDeadlineSeconds: 12"}}  # fmt: skip
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta,
            "spec": {"activeDeadlineSeconds": 12, "runtimeRef": {"name": "gangflow-torch"}},
            "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                                       "message": "TrainJob exceeded its active deadline",
                                       "lastTransitionTime": "2026-11-29T10:05:00Z"}]}}  # fmt: skip


@pytest.mark.parametrize("kind", ["TrainJob", "RayJob"])
@pytest.mark.parametrize("rank_exit", [None, 75])  # the ranks still stopping, or rank 0 done with its final checkpoint
def test_a_gang_past_its_own_deadline_is_the_users_run_time_limit_not_a_preemption(fake_k8s, kind, rank_exit):
    """Trainer (KubeRay) ends a TrainJob (RayJob) past its activeDeadlineSeconds by deleting its JobSet
    (RayCluster): the ranks get SIGTERM, commit a final checkpoint and exit 75, which alone reads as a
    preemption. The gang's own reason decides: the run-time limit, the user's, not re-launched."""
    from operators.failures.preemption import preemption_reason
    from operators.hooks.kubernetes import open_api

    fx = Fixtures()
    for rank in (0, 1):
        pod = fx.pod("running", rank=rank)
        pod["metadata"]["deletionTimestamp"] = "2026-11-29T10:05:01Z"
        if rank == 0 and rank_exit is not None:
            pod["status"]["containerStatuses"][0]["state"] = {"terminated": {
                "exitCode": rank_exit, "reason": "Error", "message": "gangflow: preempted (SIGTERM): final checkpoint step 180 committed"}}  # fmt: skip
        fake_k8s.put("", "pods", pod)
    handle = {"kind": kind, "name": fx.name, "namespace": NAMESPACE, "pod_selector": f"gangflow.io/gang={fx.gang}"}

    async def gather():
        async with open_api(CONN_ID, NAMESPACE) as gang_api:
            return await gather_evidence(gang_api, handle, obj=_gang_past_its_deadline(fx, kind))

    evidence = asyncio.run(gather())
    for judged in (evidence, merged_again(evidence, kind)):  # the trigger's snapshot, then the task's merge
        verdict = classify(judged)
        assert (verdict.kind, verdict.rule) == ("user", "deadline-exceeded"), verdict
        assert preemption_reason(judged) is None, judged
