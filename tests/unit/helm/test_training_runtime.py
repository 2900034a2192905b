"""The ClusterTrainingRuntime the chart ships for api=trainjob (Kubeflow Trainer v2's torch runtime),
valid against Trainer's vendored CRD, its JobSet template against the vendored JobSet CRD."""

from __future__ import annotations

import copy

import pytest

from operators.kubernetes.builders import USER_EXIT_CODES
from operators.kubernetes.validation import SchemaValidationError

TRAINJOB = {"trainjob": {"enabled": True}, "training": {"api": "trainjob"}}


def runtimes(render, kinds, values) -> list[dict]:
    return kinds(render(values), "ClusterTrainingRuntime")


def test_trainjob_chart_ships_the_torch_runtime_its_trainjobs_name(render, kinds, validate):
    values = copy.deepcopy(TRAINJOB)
    values["training"] |= {"trainingRuntime": "gangflow-torch", "procsPerPod": 3}
    (runtime,) = runtimes(render, kinds, values)
    validate(runtime)
    assert runtime["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert runtime["metadata"]["name"] == "gangflow-torch" and "namespace" not in runtime["metadata"]
    # the TrainJob sets spec.trainer.numProcPerNode; Trainer's runtime CRD has no such field in mlPolicy.torch
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}
    assert "podGroupPolicy" not in runtime["spec"]  # Kueue gangs the TrainJob
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"] == {"maxRestarts": 0}
    (node,) = jobset["replicatedJobs"]
    assert node["name"] == "node" and node["replicas"] == 1
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    job = node["template"]["spec"]
    assert job["backoffLimit"] == 0
    exit_rule = next(r for r in job["podFailurePolicy"]["rules"] if "onExitCodes" in r)
    assert exit_rule["onExitCodes"] == {"containerName": "node", "operator": "In", "values": list(USER_EXIT_CODES)}
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == "gangflow-training"
    (container,) = pod["containers"]
    assert container["name"] == "node"
    assert container["image"] == "registry.example.com/gangflow/training@sha256:" + "0" * 64


def test_gpu_pods_get_the_same_runtime_valid_against_trainers_crd(render, kinds, validate):
    values = copy.deepcopy(TRAINJOB)
    values["training"] |= {"resources": {"cpu": "8", "memory": "64Gi", "gpu": 4}, "maxWorldSize": 2}
    (runtime,) = runtimes(render, kinds, values)
    validate(runtime)
    assert runtime["spec"]["mlPolicy"]["torch"] == {}


def test_no_runtime_without_trainjob_or_when_the_admin_brings_one(render, kinds):
    assert runtimes(render, kinds, {}) == []
    assert runtimes(render, kinds, {**TRAINJOB, "trainjob": {"enabled": True, "runtime": {"create": False}}}) == []


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda r: r["spec"].update(podGroupPolicyy={}), "'podGroupPolicyy' was unexpected"),
        # what the chart rendered until Trainer's own CRD was vendored: at its commit mlPolicy.torch has no numProcPerNode
        (lambda r: r["spec"]["mlPolicy"]["torch"].update(numProcPerNode=3), ".spec.mlPolicy.torch: Additional properties are not allowed ('numProcPerNode' was unexpected)"),
        (lambda r: r["spec"]["mlPolicy"].update(numNodes="two"), ".spec.mlPolicy.numNodes: 'two' is not of type 'integer'"),
        (lambda r: r["spec"]["template"]["spec"]["replicatedJobs"][0].update(replica=1), "'replica' was unexpected"),
        (lambda r: r["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0].update(cmd=["x"]), "'cmd' was unexpected"),
        (lambda r: r["metadata"].update(namespace="x"), "cluster-scoped"),
    ],
)
def test_a_broken_runtime_is_refused_naming_the_field(render, kinds, validate, change, message):
    (runtime,) = runtimes(render, kinds, TRAINJOB)
    change(runtime)
    with pytest.raises(SchemaValidationError) as err:
        validate(runtime)
    assert message in str(err.value)


def test_render_validate_checks_the_runtime_file_an_admin_installs(render, kinds, tmp_path, crds_dir, capsys):
    import yaml

    from operators.cli.render import main

    (runtime,) = runtimes(render, kinds, TRAINJOB)
    runtime.pop("__template__")
    path = tmp_path / "runtime.yaml"
    path.write_text(yaml.safe_dump(runtime))
    assert main(["validate", str(path), "--crds", str(crds_dir)]) == 0
    runtime["spec"]["mlPolicy"]["numNodes"] = "two"
    path.write_text(yaml.safe_dump(runtime))
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(path), "--crds", str(crds_dir)])
    assert exc.value.code == 1
    assert ".spec.mlPolicy.numNodes: 'two' is not of type 'integer'" in capsys.readouterr().err
