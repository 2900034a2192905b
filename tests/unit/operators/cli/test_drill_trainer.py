"""The drill's emulation of Kubeflow Trainer v2's controller: the JobSet it builds from gangflow's
TrainJob and the chart's ClusterTrainingRuntime (PET_* variables, numNodes, runtime patches), the
TrainJob status it mirrors, and a TrainJob run on the emulated cluster with tiny containers."""

from __future__ import annotations

import contextlib
import sys
import time

import pytest

from operators.cli.drill.api_double import InMemoryKubernetesApi
from operators.cli.drill.cluster import JS, KQ, EmulatedCluster, processes_with_marker
from operators.cli.drill.image import Image
from operators.cli.drill.trainer_controller import TRAINER_PORT, TRAINJOBS, RUNTIMES, TrainerController, chart_training_runtime, mirrored_status, trainer_jobset
from operators.cli.render import render_documents
from operators.kubernetes import status as st
from operators.kubernetes.runtime import example_runtime_mapping, merge_runtime
from operators.kubernetes.validation import CrdRegistry, validate_object

VERSION = "5d41402abc4b2a76b9719d911017c592"
IMAGE = "registry.example.com/gangflow/training@sha256:" + "ab" * 32
INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@pytest.fixture(scope="module")
def registry(crds_dir) -> CrdRegistry:
    return CrdRegistry(crds_dir)


@pytest.fixture(scope="module")
def runtime() -> dict:
    return chart_training_runtime({"training": {"image": {"repository": IMAGE.split("@")[0], "digest": IMAGE.split("@")[1]}}})


def gangflow_trainjob(world_size: int = 2) -> dict:
    """What gangflow's backend submits with api=trainjob: CPU pods, one process each."""
    mapping = merge_runtime(example_runtime_mapping(), {"api": "trainjob", "image": IMAGE, "resources": {"cpu": "1", "memory": "2Gi", "gpu": 0},
                                                           "checkpoint": {"pvc": None, "uri": "s3://bucket/checkpoints"}})
    (trainjob,) = render_documents(world_size=world_size, runtime=mapping, dataset_version=VERSION)
    assert trainjob["kind"] == "TrainJob"
    trainjob["metadata"]["uid"] = "4b1d6a35-0c5e-4f0e-9a57-5b7d1f0c2e11"
    return trainjob


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_jobset_is_what_trainer_v2_builds_from_the_runtime_and_the_trainjob(runtime, registry):
    trainjob = gangflow_trainjob()
    name, ns = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"]
    jobset = trainer_jobset(trainjob, runtime)
    validate_object(jobset, registry)  # the vendored JobSet CRD, strict, and its Job as a core Job
    assert (jobset["kind"], jobset["metadata"]["name"], jobset["metadata"]["namespace"]) == ("JobSet", name, ns)
    assert jobset["metadata"]["ownerReferences"] == [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": name,
                                                      "uid": trainjob["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    assert "kueue.x-k8s.io/queue-name" not in (jobset["metadata"].get("labels") or {})  # Kueue manages the TrainJob, not its JobSet
    assert jobset["spec"]["suspend"] is True  # as the TrainJob until Kueue admits it
    (node,) = jobset["spec"]["replicatedJobs"]
    job = node["template"]["spec"]
    assert node["name"] == "node" and node["replicas"] == 1
    assert job["parallelism"] == job["completions"] == 2  # spec.trainer.numNodes
    assert job["backoffLimit"] == 0  # from the runtime
    pod = job["template"]
    (container,) = pod["spec"]["containers"]
    trainer = trainjob["spec"]["trainer"]
    assert container["name"] == "node"
    assert (container["image"], container["command"], container["args"]) == (trainer["image"], trainer["command"], trainer["args"])
    assert container["resources"] == trainer["resourcesPerNode"]
    env = env_of(container)
    for item in trainer["env"]:
        assert env[item["name"]] == item.get("value", item.get("valueFrom"))
    assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "1"
    assert env["PET_NODE_RANK"] == {"fieldRef": {"fieldPath": INDEX}}
    assert env["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}" and env["PET_MASTER_PORT"] == str(TRAINER_PORT)
    assert {"containerPort": TRAINER_PORT} in [{"containerPort": p["containerPort"]} for p in container["ports"]]
    # the TrainJob's runtime patch: gang labels, hardened pod, its volumes and mounts
    assert pod["metadata"]["labels"]["gangflow.io/gang"] == trainjob["metadata"]["labels"]["gangflow.io/gang"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "training"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp", "/dev/shm"}
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"tmp", "dshm"}
    assert pod["spec"]["automountServiceAccountToken"] is False and pod["spec"]["restartPolicy"] == "Never"


def test_torchrun_takes_its_multi_node_flags_from_the_pet_variables(runtime, monkeypatch):
    """torch.distributed.run reads PET_<FLAG> as each flag's default: with no rendezvous flag in
    the TrainJob's args, the static rendezvous is at PET_MASTER_ADDR:PET_MASTER_PORT."""
    from torch.distributed import run

    jobset = trainer_jobset(gangflow_trainjob(), runtime)
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    env = env_of(container)
    for key in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setenv("PET_NODE_RANK", "1")  # what the kubelet resolves from the index annotation
    args = run.get_args_parser().parse_args(container["args"])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "1", 1)
    assert run.get_rdzv_endpoint(args) == f"{env['PET_MASTER_ADDR']}:{TRAINER_PORT}"


@pytest.mark.parametrize("state,reason,gang", [("Completed", "AllJobsCompleted", "succeeded"), ("Failed", "FailedJobs", "failed")])
def test_trainjob_status_mirrors_the_jobset(runtime, registry, state, reason, gang):
    trainjob = gangflow_trainjob()
    trainjob["spec"]["suspend"] = False
    jobset = trainer_jobset(trainjob, runtime)
    jobset["status"] = {
        "conditions": [{"type": state, "status": "True", "reason": reason, "message": "jobset finished", "lastTransitionTime": "2026-12-03T10:00:00Z"}],
        "replicatedJobsStatus": [{"name": "node", "ready": 0, "succeeded": int(gang == "succeeded"), "failed": int(gang == "failed"), "active": 0, "suspended": 0}],
    }
    status = mirrored_status(trainjob, jobset)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Created"]["status"] == "True" and conditions["Created"]["reason"] == "JobsCreationSucceeded"
    mirrored = conditions["Complete" if state == "Completed" else "Failed"]
    assert (mirrored["status"], mirrored["reason"], mirrored["message"]) == ("True", reason, "jobset finished")
    assert status["jobsStatus"] == jobset["status"]["replicatedJobsStatus"]
    validate_object({**trainjob, "status": status}, registry)  # the TrainJob CRD's status schema
    assert st.gang_state("TrainJob", {**trainjob, "status": status}).state == gang  # what gangflow's watcher reads


SCRIPT = "import os; print('PET', os.environ['PET_NODE_RANK'], os.environ['PET_MASTER_ADDR'], os.environ['PET_NNODES'], flush=True)"


@contextlib.contextmanager
def trainjob_running(tmp_path, runtime, registry, drill_id: str, script: str, mounts: dict[str, str] | None = None,
                     env: list[dict] = (), active_deadline_s: int | None = None):
    """(api, emulated cluster, the TrainJob) with gangflow's TrainJob running `python -c script` on
    the emulated cluster under the drill's Trainer controller; every pod process is gone after."""
    api = InMemoryKubernetesApi().start()
    image = Image(env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"}, mounts=dict(mounts or {}))
    controller = TrainerController(api, validator=lambda obj: validate_object(obj, registry))
    emu = EmulatedCluster(api, workdir=tmp_path / "pods", image=image, audit_dir=tmp_path / "audit", drill_id=drill_id,
                          period=0.05, controllers=[controller]).start()  # fmt: skip
    try:
        api.put(*RUNTIMES, runtime)
        trainjob = gangflow_trainjob()
        trainer = trainjob["spec"]["trainer"]
        trainer |= {"command": ["python", "-c", script], "args": []}
        trainer["env"] = [e for e in trainer["env"] if "valueFrom" not in e] + list(env)  # no Secrets in this API
        del trainjob["metadata"]["uid"]
        if active_deadline_s is not None:
            trainjob["spec"]["activeDeadlineSeconds"] = active_deadline_s
        yield api, emu, api.put(*TRAINJOBS, trainjob)
    finally:
        emu.stop(grace=1)
        api.stop()
    assert processes_with_marker(f"{drill_id}/") == []


def test_a_trainjob_runs_on_the_emulated_cluster(tmp_path, runtime, registry):
    with trainjob_running(tmp_path, runtime, registry, "test-trainer", SCRIPT) as (api, emu, trainjob):
        name, ns, uid = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"], trainjob["metadata"]["uid"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and st.gang_state("TrainJob", api.get(*TRAINJOBS, ns, name)).state != "succeeded":
            time.sleep(0.05)
        assert st.gang_state("TrainJob", api.get(*TRAINJOBS, ns, name)).state == "succeeded", emu.events
        (workload,) = api.items(*KQ)
        assert workload["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] == uid  # gangflow's watcher finds it by the TrainJob's uid
        assert workload["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
        assert api.get(*TRAINJOBS, ns, name)["spec"]["suspend"] is False
        logs = sorted(text.strip() for text in api.logs.values())
        assert logs == ["PET 0 127.0.0.1 2", "PET 1 127.0.0.1 2"]  # the rank-0 host reached this machine
        assert any("Trainer" in e and "JobSet" in e for e in emu.events)
        # deleting the TrainJob takes its JobSet (ownerReferences: the garbage collector)
        api.handle("DELETE", f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{name}", None)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and api.get(*JS, ns, name) is not None:
            time.sleep(0.05)
        assert api.get(*JS, ns, name) is None


def test_a_jobset_the_schema_refuses_fails_the_trainjob_with_the_reason(tmp_path, runtime, registry):
    api = InMemoryKubernetesApi().start()
    controller = TrainerController(api, validator=lambda obj: validate_object(obj, registry))
    try:
        broken = {**runtime, "spec": {**runtime["spec"], "template": {"spec": {**runtime["spec"]["template"]["spec"], "network": {"enableDNSHostname": True}}}}}
        api.put(*RUNTIMES, broken)
        trainjob = api.put(*TRAINJOBS, {**gangflow_trainjob(), "spec": {**gangflow_trainjob()["spec"], "suspend": False}})
        notes: list[str] = []
        controller.reconcile(notes.append)
        obj = api.get(*TRAINJOBS, trainjob["metadata"]["namespace"], trainjob["metadata"]["name"])
        state = st.gang_state("TrainJob", obj)
        assert state.state == "failed" and state.reason == "JobsCreationFailed" and "enableDNSHostname" in state.message
        assert api.items(*JS) == [] and any("enableDNSHostname" in n for n in notes)
    finally:
        api.stop()


# A rank that runs until SIGTERM, "commits" and exits 75; launched again after that, it ends at once.
PAUSABLE = """
import os, signal, sys, time
rank, marks = os.environ['PET_NODE_RANK'], os.environ['MARKS']
if os.path.exists(os.path.join(marks, 'stopped-' + rank)):
    sys.exit(0)
def term(*_):
    open(os.path.join(marks, 'stopped-' + rank), 'w').close()
    sys.exit(75)
signal.signal(signal.SIGTERM, term)
open(os.path.join(marks, 'started-' + rank), 'w').close()
while True:
    time.sleep(0.05)
"""


def _wait(condition, what: str, emu, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {emu.events[-8:]}"
        time.sleep(0.05)


def test_a_deactivated_trainjob_workload_suspends_it_its_pods_go_and_activated_it_runs_again(tmp_path, runtime, registry):
    """Issue 25.2 for a TrainJob: Kueue evicts a deactivated Workload (InactiveWorkload) by suspending the
    TrainJob; Trainer suspends its JobSet, whose pods get SIGTERM; activated again once they are gone,
    the TrainJob is admitted and unsuspended and its pods are created anew."""
    marks = tmp_path / "marks"
    marks.mkdir()
    with trainjob_running(tmp_path, runtime, registry, "test-trainer-pause", PAUSABLE, mounts={"/marks": str(marks)},
                          env=[{"name": "MARKS", "value": "/marks"}]) as (api, emu, trainjob):  # fmt: skip
        name, ns = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"]
        _wait(lambda: {p.name for p in marks.iterdir()} == {"started-0", "started-1"}, "both ranks", emu)
        (workload,) = api.items(*KQ)
        with api._lock:
            workload["spec"]["active"] = False  # what `python -m operators.cli.gang pause` patches
        _wait(lambda: (marks / "stopped-0").exists() and (marks / "stopped-1").exists(), "SIGTERM to both ranks", emu)
        _wait(lambda: not [p for p in api.items("", "pods", ns) if p["metadata"]["name"].startswith(name)], "the pods to go", emu)
        assert api.get(*TRAINJOBS, ns, name)["spec"]["suspend"] is True and api.get(*JS, ns, name)["spec"]["suspend"] is True
        assert st.gang_state("TrainJob", api.get(*TRAINJOBS, ns, name)).state not in ("failed", "succeeded")
        assert any("InactiveWorkload" in c.get("reason", "") for c in api.items(*KQ)[0]["status"]["conditions"])
        with api._lock:
            api.items(*KQ)[0]["spec"]["active"] = True
        _wait(lambda: st.gang_state("TrainJob", api.get(*TRAINJOBS, ns, name)).state == "succeeded", "the resumed TrainJob to succeed", emu)
        assert api.get(*TRAINJOBS, ns, name)["spec"]["suspend"] is False
        order = [next(i for i, e in enumerate(emu.events) if needle in e) for needle in (
            "(InactiveWorkload: spec.active is false); the TrainJob is suspended", "suspended: the Job controller deletes its pods",
            "again (spec.active is true)")]  # fmt: skip
        assert order == sorted(order), emu.events


def test_a_trainjob_past_its_active_deadline_fails_and_its_ranks_get_sigterm(tmp_path, runtime, registry):
    """Issue 25.3 for a TrainJob (Trainer v2.2's reconcileDeadline): past `spec.activeDeadlineSeconds`
    from its start, Trainer marks it Failed (DeadlineExceeded) and deletes its JobSet, whose pods get
    SIGTERM: the ranks commit a final checkpoint (here: a mark) before they go."""
    marks = tmp_path / "marks"
    marks.mkdir()
    with trainjob_running(tmp_path, runtime, registry, "test-trainer-deadline", PAUSABLE, mounts={"/marks": str(marks)},
                          env=[{"name": "MARKS", "value": "/marks"}], active_deadline_s=2) as (api, emu, trainjob):  # fmt: skip
        name, ns = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"]
        _wait(lambda: {p.name for p in marks.iterdir()} >= {"started-0", "started-1"}, "both ranks", emu)
        _wait(lambda: st.gang_state("TrainJob", api.get(*TRAINJOBS, ns, name)).state == "failed", "the deadline", emu)
        state = st.gang_state("TrainJob", api.get(*TRAINJOBS, ns, name))
        assert (state.reason, state.message) == ("DeadlineExceeded", "TrainJob exceeded its active deadline")
        assert api.get(*JS, ns, name) is None  # deleted, not left to finish
        _wait(lambda: (marks / "stopped-0").exists() and (marks / "stopped-1").exists(), "SIGTERM to both ranks", emu)
        _wait(lambda: not [p for p in api.items("", "pods", ns) if p["metadata"]["name"].startswith(name)], "the pods to go", emu)
        assert any("past its activeDeadlineSeconds=2" in e for e in emu.events), emu.events


def test_no_one_sees_a_failed_rank_before_its_trainjob_failed(tmp_path, runtime, registry):
    """Watch-driven controllers mark the JobSet and then the TrainJob Failed within milliseconds of a
    rank's end; the drill's reconcile period must not leave gangflow a window in which the pod has
    failed and the TrainJob not yet (CI once saw gangflow fail and delete the TrainJob in it, so the
    mirrored condition never came)."""
    script = "import os, sys, time; time.sleep(0.3); sys.exit(3 if os.environ['PET_NODE_RANK'] == '1' else 0)"
    with trainjob_running(tmp_path, runtime, registry, "test-trainer-failed", script) as (api, emu, trainjob):
        name, ns = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"]
        seen, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline:
            with api._lock:  # one observation: what one list of pods and one GET of the TrainJob could return together
                failed_pod = any((p.get("status") or {}).get("phase") == "Failed" for p in api.items("", "pods", ns))
                state = st.gang_state("TrainJob", api.get(*TRAINJOBS, ns, name)).state
            if failed_pod:
                seen.append(state)
            if state == "failed":
                break
            time.sleep(0.001)
        assert seen and set(seen) == {"failed"}, (seen[:5], emu.events)
        assert any(f"TrainJob {ns}/{name} Failed" in e for e in emu.events), emu.events
