"""`python -m operators.cli.render render`: every object validates against the upstream schemas
(strict, unknown fields rejected) and every training pod is hardened."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from operators.backends.base import GangSpec
from operators.cli.render import main, render_documents
from operators.kubernetes.builders import build_gang, gang_object_name
from operators.kubernetes.runtime import RuntimeDefaults, example_runtime_mapping, merge_runtime
from operators.kubernetes.validation import SchemaValidationError, validate_object

VERSION = "5d41402abc4b2a76b9719d911017c592"  # a pinned dataset version (DVC md5)


def render(**kwargs) -> list[dict]:
    """render_documents for the pinned VERSION (a gang with no dataset is refused)."""
    kwargs.setdefault("dataset_version", VERSION)
    return render_documents(**kwargs)


def _pod_templates(obj: dict) -> list[dict]:
    """(pod template metadata, pod spec) of a rendered gang object."""
    if obj["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"] for rj in obj["spec"]["replicatedJobs"]]
    if obj["kind"] == "Job":  # Volcano
        return [task["template"] for task in obj["spec"]["tasks"]]
    raise AssertionError(obj["kind"])


def assert_hardened(template: dict, *, shm: str = "2Gi") -> None:
    spec = template["spec"]
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "gangflow"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "training"
    assert template["metadata"]["labels"]["gangflow.io/gang"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["serviceAccountName"]
    assert spec["terminationGracePeriodSeconds"] >= 60
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["runAsUser"] > 0 and psc["runAsGroup"] > 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
    assert "emptyDir" in volumes["tmp"]
    (container,) = spec["containers"]
    csc = container["securityContext"]
    assert csc["runAsNonRoot"] is True
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["privileged"] is False
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/tmp"] == "tmp"
    assert "@sha256:" in container["image"] and ":latest" not in container["image"]
    res = container["resources"]
    assert res["requests"] == res["limits"]
    assert {"cpu", "memory"} <= set(res["limits"])
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = {e["name"]: e for e in container["env"]}
    assert env["GANGFLOW_TERMINATION_LOG"]["value"] == "/dev/termination-log"
    assert container["command"] == ["torchrun"]


@pytest.mark.parametrize("scheduler", ["kueue", "volcano"])
def test_render_world_size_4_validates_and_is_hardened(scheduler, crd_registry):
    docs = render(world_size=4, scheduler=scheduler, queue="team-a")
    assert len(docs) == 1
    for doc in docs:
        validate_object(doc, crd_registry)  # strict CRD schema + embedded Job/PodTemplate as core kinds
    (gang,) = docs
    (template,) = _pod_templates(gang)
    assert_hardened(template)
    container = template["spec"]["containers"][0]
    args = container["args"]
    assert "--nnodes=4" in args and "--nproc-per-node=1" in args and "--max-restarts=0" in args
    assert "--rdzv-backend=c10d" in args
    assert args[args.index("-m") + 1] == "trainer"
    assert args[args.index("--run-dir") + 1] == "/checkpoints/example-gang"
    assert template["spec"]["volumes"][-1]["persistentVolumeClaim"] == {"claimName": "gangflow-checkpoints"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_DEBUG"] == "WARN" and env["MLFLOW_TRACKING_URI"].startswith("http://")
    if scheduler == "kueue":
        assert gang["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
        assert gang["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert gang["spec"]["suspend"] is True
        assert gang["spec"]["failurePolicy"] == {"maxRestarts": 0}
        assert gang["spec"]["successPolicy"] == {"operator": "All"}
        assert gang["spec"]["network"]["enableDNSHostnames"] is True
        job = gang["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert job["completions"] == job["parallelism"] == 4
        assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
        rules = job["podFailurePolicy"]["rules"]
        assert rules[0]["onExitCodes"] == {"containerName": "trainer", "operator": "In", "values": [1, 2]}
        assert rules[1]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
        assert "--node-rank=$(JOB_COMPLETION_INDEX)" in args
        assert "--rdzv-endpoint=example-gang-t1-rank-0-0.example-gang-t1:29500" in args
    else:
        assert gang["apiVersion"] == "batch.volcano.sh/v1alpha1"
        assert gang["spec"]["minAvailable"] == 4 and gang["spec"]["tasks"][0]["replicas"] == 4
        assert gang["spec"]["schedulerName"] == "volcano" and gang["spec"]["queue"] == "team-a"
        assert gang["spec"]["plugins"] == {"svc": [], "env": []}
        assert gang["spec"]["policies"] == [{"action": "TerminateJob", "events": ["PodFailed", "PodEvicted"]}]
        assert "--node-rank=$(VC_TASK_INDEX)" in args
        assert "--rdzv-endpoint=example-gang-t1-rank-0.example-gang-t1:29500" in args
        assert "kueue.x-k8s.io/queue-name" not in gang["metadata"]["labels"]


def test_render_trainjob_validates(crd_registry):
    docs = render(world_size=4, api="trainjob", runtime=merge_runtime(example_runtime_mapping(), {"topology": {"level": "cloud.google.com/gke-nodepool"}}))
    (tj,) = docs
    validate_object(tj, crd_registry)
    assert tj["spec"]["trainer"]["numNodes"] == 4
    assert tj["spec"]["runtimeRef"] == {"name": "torch-distributed", "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"}
    patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert patch["metadata"]["annotations"] == {"kueue.x-k8s.io/podset-required-topology": "cloud.google.com/gke-nodepool",
                                                "gangflow.io/metrics-port": "9400"}
    assert patch["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert patch["spec"]["securityContext"]["runAsNonRoot"] is True


def test_kueue_topology_priority_and_exclusive_placement(crd_registry):
    runtime = merge_runtime(
        example_runtime_mapping(),
        {
            "topology": {"level": "cloud.google.com/gke-nodepool", "mode": "preferred"},
            "exclusivePlacement": {"topologyKey": "cloud.google.com/gke-nodepool"},
            "workloadPriorityClass": "training-high",
            "priorityClassName": "gangflow-training",
            "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "mlflowSecretRef": {"name": "mlflow-token", "key": "token"},
        },
    )
    (js,) = render(world_size=4, runtime=runtime)
    validate_object(js, crd_registry)
    assert js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "training-high"
    template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"]["annotations"] == {"kueue.x-k8s.io/podset-preferred-topology": "cloud.google.com/gke-nodepool",
                                                   "gangflow.io/metrics-port": "9400"}
    spec = template["spec"]
    assert spec["priorityClassName"] == "gangflow-training"
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    token = [e for e in spec["containers"][0]["env"] if e["name"] == "MLFLOW_TRACKING_TOKEN"][0]
    assert token["valueFrom"] == {"secretKeyRef": {"name": "mlflow-token", "key": "token"}}


def test_volcano_topology_uses_pod_affinity(crd_registry):
    runtime = merge_runtime(example_runtime_mapping(), {"scheduler": "volcano", "topology": {"level": "kubernetes.io/hostname"}})
    (job,) = render(world_size=2, runtime=runtime)
    validate_object(job, crd_registry)
    affinity = job["spec"]["tasks"][0]["template"]["spec"]["affinity"]
    term = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {"gangflow.io/gang": "example-gang", "gangflow.io/attempt": "1"}


def test_object_storage_checkpoint_and_overrides(crd_registry):
    runtime = merge_runtime(example_runtime_mapping(), {"checkpoint": {"pvc": None, "uri": "s3://ml-ckpt/gangflow"}})
    (js,) = render(world_size=2, runtime=runtime, overrides=("train.max_steps=50",), name="nightly-7")
    validate_object(js, crd_registry)
    spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert args[args.index("--run-dir") + 1] == "s3://ml-ckpt/gangflow/nightly-7"
    assert args[args.index("--config") + 2 :] == ["--set", "train.max_steps=50", "--set", "data.remote=s3://gangflow-data/dvc", "--set", f"data.version={VERSION}"]
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "tmp"]


def test_validator_rejects_unknown_fields(crd_registry):
    (js,) = render(world_size=2)
    js["spec"]["network"]["enableDnsHostnames"] = True  # wrong capitalisation: the API server refuses it
    with pytest.raises(SchemaValidationError, match="enableDnsHostnames"):
        validate_object(js, crd_registry)
    (js,) = render(world_size=2)
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFS"] = True
    with pytest.raises(SchemaValidationError, match="readOnlyRootFS"):
        validate_object(js, crd_registry)


@pytest.mark.parametrize("kind,world_size", [("JobSet", 4), ("JobSet", 1024), ("VolcanoJob", 64), ("TrainJob", 8)])
def test_long_gang_names_keep_pod_names_within_63(kind, world_size):
    gang = "nightly-finetune-llama-70b-with-a-very-long-dag-run-identifier-x"[:63]
    name = gang_object_name(gang, 12, kind, world_size)
    digits = len(str(world_size - 1))
    if kind == "VolcanoJob":
        pod = f"{name}-rank-{'9' * digits}"
    else:
        pod = f"{name}-{'node' if kind == 'TrainJob' else 'rank'}-0-{'9' * digits}-abcde"
    assert len(pod) <= 63, pod
    assert name.endswith("-t12") and name[0].isalpha()
    assert gang_object_name(gang, 12, kind, world_size) == name  # deterministic
    assert gang_object_name("7-digits-first", 1) == "g7-digits-first-t1"  # DNS-1035: starts with a letter


def test_cli_render_prints_multidocument_yaml(crd_registry, crds_dir, capsys):
    assert main(["render", "--dataset-version", VERSION, "--world-size", "4", "--scheduler", "volcano", "--queue", "q1", "--validate", "--crds", str(crds_dir)]) == 0
    out = capsys.readouterr().out
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert out.startswith("# gangflow:") and "\n---\n" in out
    assert docs[0]["kind"] == "Job" and docs[0]["spec"]["queue"] == "q1"


def test_cli_render_with_runtime_configmap_file(tmp_path, capsys, runtime_mapping):
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gangflow-runtime"}, "data": {"runtime.yaml": yaml.safe_dump(runtime_mapping)}}
    path = tmp_path / "cm.yaml"
    path.write_text(yaml.safe_dump(cm))
    assert main(["render", "--dataset-version", VERSION, "--runtime", str(path), "--world-size", "16", "--name", "n1"]) == 0
    (doc,) = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert doc["metadata"]["namespace"] == "ml"
    assert doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["image"] == runtime_mapping["image"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--scheduler", "slurm"], "argument --scheduler: invalid choice: 'slurm' (choose from 'kueue', 'volcano')"),
        (["--api", "pytorchjob"], "argument --api: invalid choice: 'pytorchjob' (choose from 'jobset', 'trainjob', 'rayjob', 'mpijob')"),
        (["--world-size", "0"], "argument --world-size: must be an integer >= 1, got '0'"),
        (["--world-size", "four"], "argument --world-size: must be an integer >= 1, got 'four'"),
        (["--api", "trainjob", "--scheduler", "volcano"], "api=trainjob needs scheduler=kueue"),
        (["--name", "Bad_Name"], "name='Bad_Name': must be a DNS-1123 label"),
        (["--queue", "Team A"], "runtime queue='Team A'"),
    ],
)
def test_cli_bad_flags_name_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["render", "--dataset-version", VERSION, *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_module_entry_point(project_root):
    proc = subprocess.run(
        [sys.executable, "-m", "operators.cli.render", "render", "--dataset-version", VERSION, "--world-size", "2", "--api", "trainjob"],
        cwd=project_root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kind: TrainJob" in proc.stdout


def test_build_gang_uses_spec_attempt_env_and_config(crd_registry):
    runtime = RuntimeDefaults.from_mapping(example_runtime_mapping())
    spec = GangSpec(
        name="run-1", run_dir="/local/ignored", world_size=3, config_path="configs/big.yaml",
        overrides=(f"data.version={VERSION}",), env={"GANGFLOW_FAULT": "kill@step=3,rank=1", "GANGFLOW_ALLOW_FAULTS": "1", "MLFLOW_RUN_ID": "abc123"}, attempt=2,
    )
    plan = build_gang(spec, runtime)
    validate_object(plan.body, crd_registry)
    assert plan.name == "run-1-t2" and plan.pod_selector == "gangflow.io/gang=run-1,gangflow.io/attempt=2"
    container = plan.body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--config") + 1] == "/app/configs/big.yaml"
    names = {e["name"] for e in container["env"]}
    assert "GANGFLOW_FAULT" not in names and "GANGFLOW_ALLOW_FAULTS" not in names  # faults are for drills, never a cluster
    assert {"name": "MLFLOW_RUN_ID", "value": "abc123"} in container["env"]
    assert plan.body["metadata"]["annotations"]["gangflow.io/mlflow-run-id"] == "abc123"
    assert "--rdzv-id=run-1-t2" in container["args"]


def test_cli_validate(tmp_path, crds_dir, capsys):
    docs = render(world_size=4)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump_all(docs))
    assert main(["validate", str(good), "--crds", str(crds_dir)]) == 0
    assert "1 object(s) valid" in capsys.readouterr().out
    docs[0]["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimitt"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(bad), "--crds", str(crds_dir)])
    assert exc.value.code == 1
    assert "'backoffLimitt' was unexpected" in capsys.readouterr().err


@pytest.mark.parametrize("scheduler,api", [("kueue", "jobset"), ("kueue", "trainjob"), ("volcano", "jobset")])
def test_a_retry_keeps_off_the_nodes_an_earlier_verdict_named(scheduler, api, crd_registry):
    """Issue 28.7: `GangSpec.avoid_nodes` becomes a required node affinity on every rank's pod
    (matchFields metadata.name NotIn), beside Volcano's topology affinity, schema-valid."""
    mapping = {"scheduler": scheduler, "api": api}
    if scheduler == "volcano":
        mapping["topology"] = {"level": "kubernetes.io/hostname"}
    runtime = RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), mapping))
    spec = GangSpec(name="run-1", run_dir="/local/ignored", world_size=2, overrides=(f"data.version={VERSION}",),
                    attempt=2, avoid_nodes=("gpu-node-7", "gpu-node-9"))
    plan = build_gang(spec, runtime)
    validate_object(plan.body, crd_registry)
    body = plan.body
    if body["kind"] == "JobSet":
        pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    elif body["kind"] == "TrainJob":
        pod = body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    else:
        pod = body["spec"]["tasks"][0]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-node-7", "gpu-node-9"]}]}]
    assert ("podAffinity" in pod["affinity"]) == (scheduler == "volcano")
    # a first try places anywhere
    first = build_gang(GangSpec(name="run-1", run_dir="/x", world_size=2, overrides=(f"data.version={VERSION}",)), runtime).body
    assert "nodeAffinity" not in json.dumps(first)


def test_avoid_nodes_takes_node_names_only():
    with pytest.raises(ValueError, match="avoid_nodes item '../etc': must be a node name"):
        GangSpec(name="run-1", run_dir="/x", world_size=1, avoid_nodes=("../etc",))


@pytest.mark.parametrize("scheduler,api", [("kueue", "jobset"), ("kueue", "trainjob"), ("volcano", "jobset")])
def test_the_run_time_limit_is_the_gangs_active_deadline(scheduler, api, crd_registry):
    """Issue 25.3: `GangSpec.max_run_time_s` is every rank pod's activeDeadlineSeconds (the kubelet
    stops the containers with SIGTERM: the ranks commit a final checkpoint; the pod's reason is
    DeadlineExceeded), on a TrainJob its own activeDeadlineSeconds; schema-valid, absent by default."""
    mapping = {"scheduler": scheduler, "api": api}
    if scheduler == "volcano":
        mapping["topology"] = {"level": "kubernetes.io/hostname"}
    runtime = RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), mapping))
    spec = GangSpec(name="run-1", run_dir="/x", world_size=2, overrides=(f"data.version={VERSION}",), max_run_time_s=5400)
    body = build_gang(spec, runtime).body
    validate_object(body, crd_registry)
    if body["kind"] == "TrainJob":
        assert body["spec"]["activeDeadlineSeconds"] == 5400
    else:
        templates = _pod_templates(body)
        assert templates and all(t["spec"]["activeDeadlineSeconds"] == 5400 for t in templates)
    unlimited = build_gang(GangSpec(name="run-1", run_dir="/x", world_size=2, overrides=(f"data.version={VERSION}",)), runtime).body
    assert "activeDeadlineSeconds" not in json.dumps(unlimited)


@pytest.mark.parametrize("value", [0, -1, 2.5, "1h", True])
def test_the_run_time_limit_is_a_positive_integer(value):
    with pytest.raises(ValueError, match=r"max_run_time_s=.*must be an integer >= 1"):
        GangSpec(name="run-1", run_dir="/x", world_size=1, max_run_time_s=value)
