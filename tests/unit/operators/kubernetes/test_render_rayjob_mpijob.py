"""api=rayjob (KubeRay RayJob ray.io/v1) and api=mpijob (Kubeflow MPIJob kubeflow.org/v2beta1):
each built object validates against the vendored upstream CRD (strict) and its pod templates as
core PodTemplates; Ray's and MPI's own retries are off; the pods are hardened; a combination that
cannot work is refused before admission, naming both values; the watch reads their status."""

from __future__ import annotations

import shlex

import pytest

from operators.backends.base import GangSpec
from operators.exceptions import UnsupportedCombination
from operators.kubernetes.builders import build_gang, gang_object_name
from operators.kubernetes.runtime import RuntimeConfigError, RuntimeDefaults, example_runtime_mapping, merge_runtime
from operators.kubernetes.status import gang_state
from operators.kubernetes.validation import validate_object

VERSION = "5d41402abc4b2a76b9719d911017c592"
LAUNCHER = {"rayjob": "torchrun", "mpijob": "mpirun"}


def runtime(api: str, **changes) -> RuntimeDefaults:
    base = {"api": api, "resources": {"cpu": "2", "memory": "8Gi", "gpu": 0}, "procsPerPod": 2,
            "mlflowSecretRef": {"name": "mlflow-token", "key": "token"}}
    return RuntimeDefaults.from_mapping(merge_runtime(merge_runtime(example_runtime_mapping(), base), changes))


def spec(api: str, world_size: int = 4, **kw) -> GangSpec:
    kw.setdefault("launcher", LAUNCHER[api])
    return GangSpec(name="example-gang", run_dir="/tmp/worker-run", world_size=world_size, config_path="params.yaml",
                    dataset_version=VERSION, overrides=("train.max_steps=5",), **kw)


def assert_hardened(template: dict) -> None:
    pod = template["spec"]
    assert template["metadata"]["labels"]["gangflow.io/gang"] == "example-gang"
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {v["name"] for v in pod["volumes"]} >= {"dshm", "tmp", "checkpoints"}
    (container,) = pod["containers"]
    csc = container["securityContext"]
    assert csc["readOnlyRootFilesystem"] is True and csc["runAsNonRoot"] is True
    assert csc["allowPrivilegeEscalation"] is False and csc["privileged"] is False and csc["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/tmp"] == "tmp"  # Ray's and ssh's writable dir
    assert container["resources"]["requests"] == container["resources"]["limits"]
    for env in container.get("env") or []:  # secrets only by Secret reference, never as values
        if env["name"] in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN"):
            assert "value" not in env and "secretKeyRef" in env["valueFrom"]


def _ray_templates(body: dict) -> list[dict]:
    cluster = body["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"]),
            body["spec"]["submitterPodTemplate"]]


# --- RayJob -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, pods", [(2, 1), (8, 4)])
def test_rayjob_validates_and_sizes_its_worker_group(world_size, pods, crd_registry):
    plan = build_gang(spec("rayjob", world_size), runtime("rayjob"))
    body = plan.body
    validate_object(body, crd_registry)  # the vendored KubeRay CRD, strict; pod templates as core PodTemplates
    assert (body["apiVersion"], body["kind"], plan.plural) == ("ray.io/v1", "RayJob", "rayjobs")
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gangflow"
    assert body["metadata"]["labels"]["gangflow.io/gang"] == "example-gang"
    s = body["spec"]
    assert s["backoffLimit"] == 0 and s["shutdownAfterJobFinishes"] is True and s["suspend"] is True
    assert s["submissionMode"] == "K8sJobMode"
    cluster = s["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is False
    assert cluster["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}  # the head hosts no training worker
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pods == plan.pods
    assert group["rayStartParams"] == {"num-cpus": "2"}  # processes per pod: one Ray Train worker each
    for template in _ray_templates(body):
        assert_hardened(template)
    for template in _ray_templates(body):  # KubeRay writes `ray start` / `ray job submit` into an empty command
        assert "command" not in template["spec"]["containers"][0] and "args" not in template["spec"]["containers"][0]


def test_rayjob_entrypoint_is_the_ray_backends_driver_with_the_trainer_args():
    plan = build_gang(spec("rayjob", 4), runtime("rayjob"))
    argv = shlex.split(plan.body["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "operators.backends.ray"]
    assert argv[argv.index("--world-size") + 1] == "4" and argv[argv.index("--address") + 1] == "auto"
    assert argv[argv.index("--run-dir") + 1] == "/checkpoints/example-gang"  # the PVC, not the worker's run dir
    trainer = argv[argv.index("--") + 1:]
    assert trainer[:2] == ["--run-dir", "/checkpoints/example-gang"] and "/app/params.yaml" in trainer
    assert "train.max_steps=5" in trainer and f"data.version={VERSION}" in trainer
    text = plan.body["spec"]["entrypoint"]
    assert "/tmp/worker-run" not in text and "token" not in text and "AWS_" not in text  # no worker path, no secret


def test_a_hostile_override_stays_one_argument_of_the_shell_run_entrypoint(tmp_path):
    """KubeRay runs the entrypoint through a shell: every value is quoted, so text from a Param
    (an override) reaches the trainer as one argument and runs nothing."""
    import dataclasses
    import subprocess

    hostile = "train.max_steps=5; touch " + str(tmp_path / "pwned") + " $(touch " + str(tmp_path / "pwned2") + ") `id`"
    entrypoint = build_gang(dataclasses.replace(spec("rayjob", 4), overrides=(hostile,)), runtime("rayjob")).body["spec"]["entrypoint"]
    out = subprocess.run(["sh", "-c", "printf '%s\\n' " + entrypoint.split(" ", 1)[1]], capture_output=True, text=True, check=True)
    assert hostile in out.stdout.splitlines()  # one argument, verbatim, after a real shell parsed it
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


def test_rayjob_entrypoint_matches_the_local_ray_backends_argv(monkeypatch):
    """One argv, two places: the RayJob's entrypoint is the local backend's driver command."""
    from operators.backends.ray import RayBackend

    local = RayBackend(address="auto", dataset_remote="s3://gangflow-data/dvc").command(spec("rayjob", 4))
    remote = shlex.split(build_gang(spec("rayjob", 4), runtime("rayjob")).body["spec"]["entrypoint"])
    strip = lambda argv: [a for i, a in enumerate(argv) if a != "--export" and (i == 0 or argv[i - 1] != "--export")]
    assert strip(local)[1:local.index("--run-dir")] == remote[1:remote.index("--run-dir")]
    assert strip(local)[strip(local).index("--name"):strip(local).index("--")] == remote[remote.index("--name"):remote.index("--")]


# --- MPIJob -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, pods", [(2, 1), (8, 4)])
def test_mpijob_validates_and_runs_mpirun_across_its_workers(world_size, pods, crd_registry):
    plan = build_gang(spec("mpijob", world_size), runtime("mpijob"))
    body = plan.body
    validate_object(body, crd_registry)
    assert (body["apiVersion"], body["kind"], plan.plural) == ("kubeflow.org/v2beta1", "MPIJob", "mpijobs")
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gangflow"
    s = body["spec"]
    assert s["slotsPerWorker"] == 2 and s["mpiImplementation"] == "OpenMPI"
    assert s["runPolicy"]["backoffLimit"] == 0 and s["runPolicy"]["suspend"] is True
    assert s["runPolicy"]["cleanPodPolicy"] == "Running"
    launcher, worker = s["mpiReplicaSpecs"]["Launcher"], s["mpiReplicaSpecs"]["Worker"]
    assert launcher["replicas"] == 1 and worker["replicas"] == pods == plan.pods
    assert launcher["restartPolicy"] == worker["restartPolicy"] == "Never"
    for template in (launcher["template"], worker["template"]):
        assert_hardened(template)
    (container,) = launcher["template"]["spec"]["containers"]
    argv = container["command"]
    assert argv[:3] == ["mpirun", "-np", str(world_size)] and "--tag-output" in argv
    assert argv[argv.index("python"):][:3] == ["python", "-m", "trainer"]
    assert "train.max_steps=5" in argv and "/tmp/worker-run" not in argv
    name = plan.name
    env = {e["name"]: e for e in container["env"]}
    assert env["MASTER_ADDR"]["value"] == f"{name}-worker-0.{name}" == plan.rank0_host  # rank 0: worker 0's first slot
    assert env["MASTER_PORT"]["value"] == "29500"
    exported = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert {"MASTER_ADDR", "MASTER_PORT", "PATH", "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_TOKEN"} <= exported
    assert not any("=" in argv[i + 1] for i, a in enumerate(argv) if a == "-x")  # by name: values never in argv
    assert worker["template"]["spec"]["containers"][0]["command"] == ["/usr/sbin/sshd", "-De"]


def test_mpijob_launcher_options_are_the_local_backends(tmp_path, monkeypatch):
    from operators.backends import local

    monkeypatch.setattr(local, "mpirun_path", lambda: "mpirun")
    here = local.LocalBackend(dataset_remote="s3://x").mpirun_command(spec("mpijob", 4), {"PATH": "/bin"})
    there = build_gang(spec("mpijob", 4), runtime("mpijob")).body["spec"]["mpiReplicaSpecs"]["Launcher"]
    argv = there["template"]["spec"]["containers"][0]["command"]
    assert here[:here.index("-x")] == argv[:argv.index("-x")]


def test_long_names_fit_kuberays_and_mpi_operators_limits():
    long = "g" * 80
    assert len(gang_object_name(long, 3, "RayJob", 4)) <= 47
    name = gang_object_name(long, 3, "MPIJob", 100)
    assert len(f"{name}-worker-99") <= 63 and len(f"{name}-launcher") <= 63


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["rayjob", "mpijob"])
def test_rayjob_and_mpijob_with_volcano_are_refused_naming_both(api):
    with pytest.raises(RuntimeConfigError, match=f"api={api} with scheduler=volcano cannot run"):
        runtime(api, scheduler="volcano")


@pytest.mark.parametrize("api, launcher", [("mpijob", "torchrun"), ("rayjob", "mpirun"), ("jobset", "mpirun"), ("trainjob", "mpirun")])
def test_a_launcher_the_api_cannot_run_is_refused_naming_both(api, launcher):
    rt = runtime(api) if api in ("rayjob", "mpijob") else RuntimeDefaults.from_mapping(
        merge_runtime(example_runtime_mapping(), {"api": api}))
    with pytest.raises(UnsupportedCombination, match=f"launcher='{launcher}' with api='{api}' cannot run"):
        build_gang(spec("mpijob" if launcher == "mpirun" else "rayjob", launcher=launcher), rt)


def test_the_kubernetes_backend_refuses_the_pair_when_it_plans_the_gang(monkeypatch):
    from operators.backends.kubernetes import KubernetesBackend

    backend = KubernetesBackend(namespace="ml")
    monkeypatch.setattr(backend, "runtime", lambda: runtime("mpijob"))
    with pytest.raises(UnsupportedCombination, match="launcher='torchrun' with api='mpijob'"):
        backend.plan(spec("rayjob"))


@pytest.mark.parametrize("api", ["rayjob", "mpijob"])
def test_exclusive_placement_is_refused_naming_the_api(api):
    with pytest.raises(RuntimeConfigError, match=f"exclusivePlacement.*needs api=jobset, not api={api}"):
        runtime(api, exclusivePlacement={"topologyKey": "kubernetes.io/hostname"})


def test_rayjob_refuses_gpus_and_object_storage_checkpoints_naming_both():
    with pytest.raises(RuntimeConfigError, match="api=rayjob with resources.gpu=1 cannot run"):
        runtime("rayjob", resources={"gpu": 1}, procsPerPod=None)
    with pytest.raises(RuntimeConfigError, match="api=rayjob with checkpoint.uri='s3://ckpt/x' cannot run"):
        runtime("rayjob", checkpoint={"pvc": None, "uri": "s3://ckpt/x"})


def test_rayjob_refuses_training_code_of_ones_own():
    with pytest.raises(UnsupportedCombination, match="with api='rayjob' cannot run"):
        build_gang(spec("rayjob", user_code=("--entrypoint", "examples.mine:train")), runtime("rayjob"))


# --- status -----------------------------------------------------------------------------------------

# Shaped like KubeRay's RayJobStatus (ray-operator/apis/ray/v1/rayjob_types.go) and the MPIJob's
# kubeflow common JobStatus (conditions Created/Running/Restarting/Succeeded/Suspended/Failed).
RAYJOB = {
    "succeeded": {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "jobId": "example-gang-t1-abcde"},
    "failed": {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
               "message": "Job entrypoint command failed with exit code 1"},
    "deadline": {"jobDeploymentStatus": "Failed", "jobStatus": "RUNNING", "reason": "DeadlineExceeded",
                 "message": "The RayJob has passed the activeDeadlineSeconds"},
    "running": {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
    "initializing": {"jobDeploymentStatus": "Initializing"},
    "suspended": {"jobDeploymentStatus": "Suspended"},
}


@pytest.mark.parametrize("case, state, reason, message", [
    ("succeeded", "succeeded", "SUCCEEDED", ""),
    ("failed", "failed", "AppFailed", "Job entrypoint command failed with exit code 1"),
    ("deadline", "failed", "DeadlineExceeded", "The RayJob has passed the activeDeadlineSeconds"),
    ("running", "running", "Running", ""),
    ("initializing", "running", "Initializing", ""),
    ("suspended", "suspended", "Suspended", ""),
])
def test_rayjob_gang_state(case, state, reason, message):
    got = gang_state("RayJob", {"spec": {"suspend": False}, "status": RAYJOB[case]})
    assert (got.state, got.reason, got.message) == (state, reason, message)


def test_rayjob_gang_state_before_any_status():
    assert gang_state("RayJob", {"spec": {"suspend": True}}).state == "suspended"  # waiting for Kueue
    assert gang_state("RayJob", {"spec": {}}).state == "pending"
    assert gang_state("RayJob", {"status": {"jobDeploymentStatus": "Complete", "jobStatus": "STOPPED"}}).state == "failed"


def _cond(type_, status="True", reason="", message=""):
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": "2025-01-01T00:00:00Z"}


@pytest.mark.parametrize("conditions, state, reason, message", [
    ([_cond("Created", reason="MPIJobCreated"), _cond("Running", "False"), _cond("Succeeded", reason="MPIJobSucceeded",
      message="MPIJob ml/example-gang-t1 successfully completed.")], "succeeded", "MPIJobSucceeded",
     "MPIJob ml/example-gang-t1 successfully completed."),
    ([_cond("Created"), _cond("Running", "False"), _cond("Failed", reason="BackoffLimitExceeded", message="Job has reached the specified backoff limit")],
     "failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
    ([_cond("Created"), _cond("Running", reason="MPIJobRunning", message="MPIJob ml/example-gang-t1 is running.")],
     "running", "MPIJobRunning", "MPIJob ml/example-gang-t1 is running."),
    ([_cond("Created"), _cond("Suspended", reason="MPIJobSuspended", message="MPIJob suspended")],
     "suspended", "MPIJobSuspended", "MPIJob suspended"),
])
def test_mpijob_gang_state(conditions, state, reason, message, crd_registry):
    obj = {"spec": {"runPolicy": {"suspend": state == "suspended"}}, "status": {"conditions": conditions}}
    got = gang_state("MPIJob", obj)
    assert (got.state, got.reason, got.message) == (state, reason, message)


def test_mpijob_gang_state_before_any_status():
    assert gang_state("MPIJob", {"spec": {"runPolicy": {"suspend": True}}}).state == "suspended"
    assert gang_state("MPIJob", {"spec": {"runPolicy": {}}}).state == "pending"


def test_status_shapes_match_the_vendored_crds(crd_registry):
    """The status dicts above are accepted by the CRDs' status schemas (no invented fields)."""
    plan = build_gang(spec("rayjob"), runtime("rayjob"))
    for status in RAYJOB.values():
        validate_object({**plan.body, "status": status}, crd_registry)
    plan = build_gang(spec("mpijob"), runtime("mpijob"))
    validate_object({**plan.body, "status": {"conditions": [_cond("Created"), _cond("Failed", reason="x", message="y")]}}, crd_registry)
