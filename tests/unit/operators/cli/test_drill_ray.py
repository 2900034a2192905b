"""The drill's emulation of KubeRay (operators/cli/drill/ray_controller.py) on gangflow's rendered
RayJob, against the API test double: no Ray runs here (a fake dashboard answers the job's status;
the pods' phases and Ready conditions, the kubelet's part, are set by hand). The real Ray cluster runs in
tests/system/drill/test_drill_rayjob.py."""

from __future__ import annotations

import shlex
import time

import pytest

from operators.backends.base import GangSpec
from operators.cli.drill.api_double import InMemoryKubernetesApi
from operators.cli.drill.cluster import KQ, EmulatedCluster
from operators.cli.drill.image import Image
from operators.cli.drill.pods import ContainerConfigError, Rewrites
from operators.cli.drill.ray_controller import RAYJOBS, RayController
from operators.config import settings
from operators.kubernetes import status as st
from operators.kubernetes.builders import build_gang
from operators.kubernetes.runtime import RuntimeDefaults, example_runtime_mapping, merge_runtime
from operators.kubernetes.validation import CrdRegistry, validate_object

NS = "gangflow"


class FakeDashboard:
    """The Ray head as the operator sees it: the Ray job's info."""

    def __init__(self):
        self.info: dict | None = None
        self.asked: list[tuple[int, str]] = []

    def job(self, port: int, job_id: str):
        self.asked.append((port, job_id))
        return self.info


def gangflow_rayjob(**spec) -> dict:
    mapping = merge_runtime(example_runtime_mapping(), {"api": "rayjob", "resources": {"cpu": "1", "memory": "2Gi", "gpu": 0}})
    gang = GangSpec(name="ray-gang", run_dir="/tmp/worker-run", world_size=2, dataset_version="5d41402abc4b2a76b9719d911017c592")
    body = build_gang(gang, RuntimeDefaults.from_mapping(mapping)).body
    body["metadata"]["uid"] = "uid-ray-1"
    body["spec"].update(spec)
    return body


@pytest.fixture
def cluster():
    api = InMemoryKubernetesApi()
    dashboard = FakeDashboard()
    controller = RayController(api, dashboard=dashboard)
    controller.poll_s = 0
    notes: list[str] = []
    return api, controller, dashboard, notes


def step(api, controller, notes, times: int = 1) -> dict:
    for _ in range(times):
        controller.reconcile(notes.append)
    return api.get(*RAYJOBS, NS, "ray-gang-t1")


def pods(api, node_type: str | None = None) -> list[dict]:
    return [p for p in api.items("", "pods", NS) if node_type is None or p["metadata"]["labels"].get("ray.io/node-type") == node_type]


def run_all(api, *, ready: bool) -> None:
    """The kubelet's part: every pod runs, Ready or not as its readiness probe says."""
    for pod in pods(api):
        pod["status"]["phase"] = "Running"
        pod["status"]["conditions"] = [{"type": "Ready", "status": str(ready)}]


def validate(rayjob: dict) -> None:
    validate_object(rayjob, CrdRegistry(settings.PROJECT_ROOT / "operators" / "kubernetes" / "crds"))


def test_kueue_admits_and_kuberay_starts_the_ray_nodes_with_its_generated_command(cluster):
    api, controller, dashboard, notes = cluster
    api.put(*RAYJOBS, gangflow_rayjob())
    rayjob = step(api, controller, notes)
    assert rayjob["spec"]["suspend"] is False and len(api.items(*KQ)) == 1
    rayjob = step(api, controller, notes, 2)
    status = rayjob["status"]
    assert status["jobDeploymentStatus"] == "Initializing" and status["jobStatus"] == "" and status["startTime"]
    assert status["rayClusterName"].startswith("ray-gang-t1-") and status["jobId"].startswith("ray-gang-t1-")
    validate(rayjob)
    svc = f"{status['rayClusterName']}-head-svc"
    assert api.get("", "services", NS, svc) is not None
    assert status["dashboardURL"] == f"{svc}.{NS}.svc.cluster.local:8265"
    (head,) = pods(api, "head")
    assert pods(api, "worker") == []  # KubeRay's wait-gcs-ready: the workers wait for the head
    run_all(api, ready=False)
    step(api, controller, notes)
    assert pods(api, "worker") == []  # the head runs, its probe does not pass yet
    run_all(api, ready=True)
    step(api, controller, notes)
    workers = pods(api, "worker")
    assert len(workers) == 2 and not pods(api, None)[3:]  # no submitter before the cluster is ready
    container = head["spec"]["containers"][0]
    assert container["command"] == ["/bin/bash", "-c", "--"]
    (script,) = container["args"]
    assert script.startswith("ulimit -n 65536; ray start --head ") and "--port" not in script  # Ray's default port
    assert {"--num-cpus=0", "--block", "--dashboard-host=0.0.0.0", "--metrics-export-port=8080", "--dashboard-agent-listen-port=52365",
            f"--memory={2 * 1024**3}"} <= set(script.split())  # fmt: skip
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RAY_ADDRESS"] == "127.0.0.1:6379" and env["KUBERAY_GEN_RAY_START_CMD"] == script.split("; ", 1)[1]
    # KubeRay's injected probe (Ray >= 2.53): the node's agent, which the kubelet asks
    assert container["readinessProbe"] == {"httpGet": {"path": "/api/healthz", "port": 52365}, "timeoutSeconds": 5, "initialDelaySeconds": 10,
                                           "periodSeconds": 5, "successThreshold": 1, "failureThreshold": 10}  # fmt: skip
    assert workers[0]["spec"]["containers"][0]["readinessProbe"]["timeoutSeconds"] == 2
    for worker in workers:
        (args,) = worker["spec"]["containers"][0]["args"]
        assert f"--address={svc}.{NS}.svc.cluster.local:6379" in args.split() and "--num-cpus=1" in args.split() and "--head" not in args
        assert worker["metadata"]["labels"]["gangflow.io/gang"] == "ray-gang" and worker["metadata"]["labels"]["ray.io/group"] == "rank"


def test_the_submitter_runs_ray_job_submit_once_the_cluster_is_ready(cluster):
    api, controller, dashboard, notes = cluster
    api.put(*RAYJOBS, gangflow_rayjob())
    step(api, controller, notes, 3)
    run_all(api, ready=True)
    step(api, controller, notes)  # the head is ready: the workers start
    run_all(api, ready=False)
    rayjob = step(api, controller, notes, 2)  # running, but the probes fail: not ready
    assert rayjob["status"]["jobDeploymentStatus"] == "Initializing" and len(pods(api)) == 3
    run_all(api, ready=True)
    rayjob = step(api, controller, notes)
    status = rayjob["status"]
    assert status["jobDeploymentStatus"] == "Running"
    (submitter,) = [p for p in pods(api) if "ray.io/node-type" not in p["metadata"]["labels"]]
    container = submitter["spec"]["containers"][0]
    assert container["command"] == ["/bin/bash", "-ce", "--"]
    (script,) = container["args"]
    url, job_id = f"http://{status['dashboardURL']}", status["jobId"]
    head, _, follow = script.partition(" ; fi ; ")
    assert head.startswith(f"if ! ray job status --address {url} {job_id} >/dev/null 2>&1 ; then ")
    assert follow == f"ray job logs --address {url} --follow {job_id}"
    submit, _, entrypoint = head.split(" ; then ", 1)[1].partition(" -- ")
    assert submit == f"ray job submit --address {url} --no-wait --submission-id {job_id}"
    assert shlex.split(entrypoint) == shlex.split(rayjob["spec"]["entrypoint"])  # the shell gets the product's words back
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RAY_DASHBOARD_ADDRESS"] == status["dashboardURL"] and env["RAY_JOB_SUBMISSION_ID"] == job_id


def ready_and_submitted(api, controller, dashboard, notes, **spec) -> dict:
    api.put(*RAYJOBS, gangflow_rayjob(**spec))
    step(api, controller, notes, 3)
    run_all(api, ready=True)
    step(api, controller, notes)  # the head is ready: the workers start
    run_all(api, ready=True)
    return step(api, controller, notes)


def test_a_succeeded_ray_job_completes_the_rayjob_and_its_cluster_goes(cluster):
    api, controller, dashboard, notes = cluster
    ready_and_submitted(api, controller, dashboard, notes)
    dashboard.info = {"status": "RUNNING", "message": "Job is currently running."}
    rayjob = step(api, controller, notes)
    assert (rayjob["status"]["jobDeploymentStatus"], rayjob["status"]["jobStatus"]) == ("Running", "RUNNING")
    assert st.gang_state("RayJob", rayjob).state == "running"
    dashboard.info = {"status": "SUCCEEDED", "message": "Job finished successfully."}
    rayjob = step(api, controller, notes, 2)
    status = rayjob["status"]
    assert (status["jobDeploymentStatus"], status["jobStatus"], status["succeeded"]) == ("Complete", "SUCCEEDED", 1) and status["endTime"]
    assert st.gang_state("RayJob", rayjob).state == "succeeded"
    validate(rayjob)
    ray_pods = pods(api, "head") + pods(api, "worker")
    assert len(ray_pods) == 3 and all(p["metadata"].get("deletionTimestamp") for p in ray_pods)  # shutdownAfterJobFinishes
    assert api.items("", "services", NS) == []


def test_a_failed_ray_job_fails_the_rayjob_once_with_backoff_limit_0(cluster):
    api, controller, dashboard, notes = cluster
    ready_and_submitted(api, controller, dashboard, notes)
    dashboard.info = {"status": "FAILED", "message": "Job entrypoint command failed with exit code 1, ... ActorDiedError ..."}
    rayjob = step(api, controller, notes, 4)
    status = rayjob["status"]
    assert (status["jobDeploymentStatus"], status["jobStatus"], status["reason"], status["failed"]) == ("Failed", "FAILED", "AppFailed", 1)
    assert "ActorDiedError" in status["message"]
    state = st.gang_state("RayJob", rayjob)
    assert (state.state, state.reason) == ("failed", "AppFailed")
    validate(rayjob)
    assert len(pods(api, "head")) == 1  # no new RayCluster: backoffLimit 0


def test_backoff_limit_1_retries_the_job_on_a_new_ray_cluster(cluster):
    api, controller, dashboard, notes = cluster
    first = ready_and_submitted(api, controller, dashboard, notes, backoffLimit=1)["status"]
    dashboard.info = {"status": "FAILED", "message": "boom"}
    rayjob = step(api, controller, notes, 2)
    assert rayjob["status"]["jobDeploymentStatus"] == "Retrying" and rayjob["status"]["failed"] == 1
    assert all(p["metadata"].get("deletionTimestamp") for p in pods(api))  # the cluster and the submitter go
    for pod in pods(api):  # the kubelet: gone once stopped
        api.remove("", "pods", NS, pod["metadata"]["name"])
    dashboard.info = None
    rayjob = step(api, controller, notes, 3)
    status = rayjob["status"]
    assert status["jobDeploymentStatus"] == "Initializing" and status["rayClusterName"] != first["rayClusterName"]
    assert status["jobId"] != first["jobId"] and len(pods(api, "head")) == 1


def test_past_active_deadline_seconds_the_rayjob_fails_deadline_exceeded(cluster):
    api, controller, dashboard, notes = cluster
    ready_and_submitted(api, controller, dashboard, notes, activeDeadlineSeconds=60, backoffLimit=3)
    rayjob = api.get(*RAYJOBS, NS, "ray-gang-t1")
    rayjob["status"]["startTime"] = st.timestamp(time.time() - 61)
    rayjob = step(api, controller, notes)
    status = rayjob["status"]
    assert (status["jobDeploymentStatus"], status["reason"]) == ("Failed", "DeadlineExceeded")  # no retry past the deadline
    assert status["message"].startswith("The RayJob has passed the activeDeadlineSeconds.")


def test_a_submitter_that_keeps_failing_fails_the_rayjob_submission_failed(cluster):
    api, controller, dashboard, notes = cluster
    ready_and_submitted(api, controller, dashboard, notes)
    for attempt in range(3):  # the submitter Job's backoffLimit 2: three pods
        submitters = [p for p in pods(api) if "ray.io/node-type" not in p["metadata"]["labels"]]
        assert len(submitters) == attempt + 1
        submitters[-1]["status"]["phase"] = "Failed"
        rayjob = step(api, controller, notes)
    assert (rayjob["status"]["jobDeploymentStatus"], rayjob["status"]["reason"]) == ("Failed", "SubmissionFailed")


def test_deleting_the_rayjob_deletes_its_ray_cluster(cluster):
    api, controller, dashboard, notes = cluster
    ready_and_submitted(api, controller, dashboard, notes)
    rayjob = api.get(*RAYJOBS, NS, "ray-gang-t1")
    api.remove(*RAYJOBS, NS, "ray-gang-t1")
    for pod in pods(api):  # owned by the RayCluster, not labelled for the API double's collector
        pod["metadata"]["labels"].pop("gangflow.io/attempt")
    step(api, controller, notes)
    assert pods(api) and all(p["metadata"].get("deletionTimestamp") for p in pods(api))
    assert api.items("", "services", NS) == [] and rayjob["metadata"]["uid"] not in controller.clusters


def test_the_kubelet_maps_mounted_paths_in_shell_text_and_a_claim_to_one_shared_folder(tmp_path):
    rw = Rewrites(hosts={"c-head-svc.ns.svc.cluster.local": "127.0.0.1"}, mounts={"/checkpoints": "/x/claim", "/app": "/x/app", "/tmp": "/x/tmp"})
    script = "ray job submit --address http://c-head-svc.ns.svc.cluster.local:8265 -- python -m m --run-dir /checkpoints/g --config '/app/p.yaml' /tmpx ; fi"
    assert rw.apply(script) == "ray job submit --address http://127.0.0.1:8265 -- python -m m --run-dir /x/claim/g --config '/x/app/p.yaml' /tmpx ; fi"
    assert rw.apply("/checkpoints/g") == "/x/claim/g" and rw.apply("/var/tmp/a") == "/var/tmp/a"
    api = InMemoryKubernetesApi()
    emu = EmulatedCluster(api, workdir=tmp_path / "pods", image=Image(env={}, mounts={}), audit_dir=tmp_path, drill_id="d")
    pod = {"metadata": {"namespace": NS}}
    volume = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}
    with pytest.raises(ContainerConfigError, match='persistentvolumeclaim "ckpt" not found'):
        emu._claim_volume(pod, volume)
    api.put("", "persistentvolumeclaims", {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt", "namespace": NS}})
    assert emu._claim_volume(pod, volume) == emu._claim_volume({"metadata": {"namespace": NS}}, volume) == tmp_path / "pods" / ".claims" / "ckpt"


def test_a_port_that_answers_other_than_http_is_not_ready():
    # a node's agent port answered by another server (a raylet's gRPC, on one machine): the probe
    # fails, as a kubelet's would, instead of raising inside the cluster's loop at every period
    import socket
    import threading

    from operators.cli.drill.cluster import ReadinessProbe
    from operators.cli.drill.ray_controller import Dashboard

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer_in_grpc_frames():
            for _ in range(2):
                conn, _ = server.accept()
                with conn:
                    conn.recv(4096)
                    conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage-not-http\r\n\r\n")

        threading.Thread(target=answer_in_grpc_frames, daemon=True).start()
        port = server.getsockname()[1]
        assert ReadinessProbe(port=port, path="/api/healthz").check().startswith(f"Get http://127.0.0.1:{port}/api/healthz: ")
        assert Dashboard().job(port, "raysubmit_1") is None
