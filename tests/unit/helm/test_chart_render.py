"""The chart lints, and every object it renders (defaults and each toggle) passes the Kubernetes
schema (kubernetes-validate, strict) or its CRD's openAPIV3Schema with unknown fields rejected."""

from __future__ import annotations

from collections import Counter

import helm_python
import pytest

from operators.kubernetes.validation import SchemaValidationError

ALL_OFF = {
    "rbac": {"enabled": False},
    "kueue": {"enabled": False},
    "priorityClasses": {"enabled": False},
    "networkPolicy": {"enabled": False},
    "mlflow": {"enabled": False},
    "runtime": {"enabled": False},
    "metrics": {"scrapeConfig": {"enabled": False}, "dashboard": {"enabled": False}},
    "training": {"serviceAccount": {"create": False}, "checkpoint": {"createPvc": False}},
}
METRICS_OFF = ALL_OFF["metrics"]

TWO_TEAMS = [{"name": "vision", "namespace": "team-vision"}, {"name": "nlp", "namespace": "team-nlp"}]

SCENARIOS = {
    "defaults": {},
    "volcano": {"kueue": {"enabled": False}, "volcano": {"enabled": True}},
    "trainjob": {"trainjob": {"enabled": True}, "training": {"api": "trainjob"}},
    "kueue-topology-cohort-two-teams": {
        "kueue": {
            "teams": TWO_TEAMS,
            "clusterQueue": {"cohort": "research"},
            "topology": {"enabled": True, "levels": ["cloud.example.com/block", "kubernetes.io/hostname"]},
            "resourceFlavors": [
                {"name": "h100", "nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                 "quota": {"cpu": "256", "memory": "2Ti", "gpu": 16}, "borrowingLimit": {"gpu": 8}},
                {"name": "a100", "nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
                 "quota": {"cpu": "128", "memory": "1Ti", "gpu": 8}},
            ],
        },
        "training": {"topology": {"level": "cloud.example.com/block", "mode": "required"},
                     "exclusivePlacement": {"topologyKey": "cloud.example.com/block"}},
    },
    "mlflow-pvc-artifacts": {"mlflow": {"artifacts": {"type": "pvc"}}},
    "mlflow-s3-minio-workload-identity": {
        "mlflow": {"artifacts": {"s3": {"endpointUrl": "http://minio.storage.svc:9000", "region": "us-east-1",
                                        "credentialsSecretName": ""}},
                   "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/mlflow"}},
                   "allowedHosts": ["mlflow.example.com"], "extraArgs": ["--workers=2"],
                   "extraEnv": [{"name": "MLFLOW_LOGGING_LEVEL", "value": "INFO"}]},
        "networkPolicy": {"objectStorage": {"cidrs": ["10.20.0.0/16"], "ports": [443, 9000]}},
    },
    "external-mlflow": {
        "mlflow": {"enabled": False},
        "training": {"mlflowTrackingUri": "https://mlflow.example.com",
                     "mlflowSecretRef": {"name": "mlflow-token", "key": "token"}},
        "networkPolicy": {"externalMlflow": {"cidrs": ["203.0.113.0/24"], "port": 443}},
    },
    "rendezvous-outside-collective-range": {
        "networkPolicy": {"collectivePorts": {"start": 40000, "end": 50000}},
    },
    "checkpoints-in-object-storage": {
        "training": {"checkpoint": {"pvc": "", "uri": "s3://ckpt/gangflow", "createPvc": False}},
    },
    "multikueue-two-workers": {
        "kueue": {"multiKueue": {"enabled": True, "clusters": [{"name": "worker1", "kubeconfigSecret": "worker1-kubeconfig"},
                                                              {"name": "worker2", "kubeconfigSecret": "worker2-kubeconfig"}]}},
    },
    "all-off": ALL_OFF,
}


def test_lint_has_no_warnings_or_errors(chart_dir):
    report = helm_python.lint(str(chart_dir), strict=True)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


@pytest.mark.parametrize("values", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_every_rendered_object_is_valid(render, validate, values):
    objects = render(values)
    for obj in objects:
        validate(obj)
    names = Counter((o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects)
    assert [key for key, count in names.items() if count > 1] == []


def test_defaults_render_the_expected_objects(render):
    counts = Counter(o["kind"] for o in render())
    assert counts == {
        "Role": 1, "RoleBinding": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "ServiceAccount": 2,
        "ResourceFlavor": 1, "ClusterQueue": 1, "LocalQueue": 1, "WorkloadPriorityClass": 3,
        "PriorityClass": 2, "NetworkPolicy": 2, "Deployment": 1, "Service": 1,
        "ConfigMap": 3, "PersistentVolumeClaim": 1,  # runtime, scrape configuration, dashboard
    }


def test_all_toggles_off_render_nothing(render):
    assert render(ALL_OFF) == []


@pytest.mark.parametrize("toggle, kinds", [
    ({"rbac": {"enabled": False}}, {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}),
    ({"rbac": {"clusterQueueReader": {"enabled": False}}}, {"ClusterRole", "ClusterRoleBinding"}),
    ({"kueue": {"enabled": False}}, {"ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass",
                                     "ClusterRole", "ClusterRoleBinding"}),
    ({"priorityClasses": {"enabled": False}, "training": {"priorityClassName": ""}}, {"PriorityClass"}),
    ({"networkPolicy": {"enabled": False}}, {"NetworkPolicy"}),
    ({"mlflow": {"enabled": False}}, {"Deployment", "Service"}),
    ({"runtime": {"enabled": False}, "metrics": METRICS_OFF}, {"ConfigMap"}),
])
def test_each_toggle_removes_its_objects(render, toggle, kinds):
    before = {o["kind"] for o in render()}
    after = {o["kind"] for o in render(toggle)}
    assert kinds <= before
    assert not (kinds & after)


def test_volcano_replaces_kueue(render, kinds):
    objects = render(SCENARIOS["volcano"])
    assert not [o for o in objects if o["apiVersion"].startswith("kueue.x-k8s.io")]
    (queue,) = kinds(objects, "Queue")
    assert queue["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert queue["spec"]["capability"] == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"}


def test_kueue_objects_follow_values(render, kinds):
    objects = render(SCENARIOS["kueue-topology-cohort-two-teams"])
    (cq,) = kinds(objects, "ClusterQueue")
    assert cq["spec"]["cohortName"] == "research"
    assert cq["spec"]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-vision", "team-nlp"]}]
    (group,) = cq["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu"]
    h100 = next(f for f in group["flavors"] if f["name"] == "h100")
    assert h100["resources"] == [
        {"name": "cpu", "nominalQuota": "256"},
        {"name": "memory", "nominalQuota": "2Ti"},
        {"name": "nvidia.com/gpu", "nominalQuota": "16", "borrowingLimit": "8"},
    ]
    local_queues = {(q["metadata"]["namespace"], q["metadata"]["name"], q["spec"]["clusterQueue"])
                    for q in kinds(objects, "LocalQueue")}
    assert local_queues == {("team-vision", "vision", "gangflow"), ("team-nlp", "nlp", "gangflow")}
    (topology,) = kinds(objects, "Topology")
    assert [level["nodeLabel"] for level in topology["spec"]["levels"]] == [
        "cloud.example.com/block", "kubernetes.io/hostname"]
    assert {f["spec"]["topologyName"] for f in kinds(objects, "ResourceFlavor")} == {"gangflow"}
    # Per-team objects land in every team namespace (MLflow's and the metrics ConfigMaps: the release's).
    for kind in ("Role", "RoleBinding", "ConfigMap", "NetworkPolicy", "PersistentVolumeClaim"):
        per_team = [o for o in kinds(objects, kind) if o["metadata"]["labels"].get("app.kubernetes.io/component") not in ("mlflow", "metrics")]
        assert {o["metadata"]["namespace"] for o in per_team} == {"team-vision", "team-nlp"}, kind
    training_sas = [o for o in kinds(objects, "ServiceAccount") if o["metadata"]["name"] == "gangflow-training"]
    assert {o["metadata"]["namespace"] for o in training_sas} == {"team-vision", "team-nlp"}


def test_priority_classes(render, kinds):
    classes = {p["metadata"]["name"]: p for p in kinds(render(), "PriorityClass")}
    assert set(classes) == {"gangflow-training", "gangflow-training-high"}
    assert all(p["globalDefault"] is False for p in classes.values())
    assert classes["gangflow-training-high"]["value"] > classes["gangflow-training"]["value"]
    wpcs = {w["metadata"]["name"]: w["value"] for w in kinds(render(), "WorkloadPriorityClass")}
    assert wpcs == {"gangflow-high": 1000, "gangflow-normal": 100, "gangflow-low": 10}


def test_notes_warn_about_placeholder_digests(notes):
    text = notes()
    assert "training.image.digest is the all-zero placeholder" in text
    pinned = notes({"training": {"image": {"digest": "sha256:" + "a" * 64}},
                    "mlflow": {"image": {"digest": "sha256:" + "b" * 64}}})
    assert "placeholder" not in pinned


@pytest.mark.parametrize("kind, mutate, error", [
    ("ClusterQueue", lambda o: o["spec"].update(unknownField=1), "'unknownField' was unexpected"),
    ("ClusterQueue", lambda o: o["spec"].update(queueingStrategy="Random"), "is not one of"),
    ("LocalQueue", lambda o: o["metadata"].update(unknownField=1), "'unknownField' was unexpected"),
    ("Role", lambda o: o["rules"][0].update(unknownField=1), "'unknownField' was unexpected"),
    ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(unknownField=1),
     "'unknownField' was unexpected"),
])
def test_the_validator_rejects_what_the_api_server_would(render, validate, kind, mutate, error):
    obj = next(o for o in render() if o["kind"] == kind)
    validate(obj)
    mutate(obj)
    with pytest.raises(SchemaValidationError, match=error):
        validate(obj)
