"""The runtime-defaults ConfigMap (contract with the Kubernetes backend) and the training
NetworkPolicy."""

from __future__ import annotations

import re

import pytest
import yaml

# Keys of the runtime contract, and the ones the chart leaves out while they are off.
CONTRACT_KEYS = {
    "image", "namespace", "serviceAccountName", "scheduler", "api", "queue", "priorityClassName",
    "workloadPriorityClass", "topology", "exclusivePlacement", "resources", "shmSize", "ncclEnv",
    "checkpoint", "nodeSelector", "tolerations", "terminationGracePeriodSeconds", "mlflowTrackingUri",
    "mlflowSecretRef", "rendezvousPort", "admissionTimeoutSeconds", "startupTimeoutSeconds",
}
OFF_BY_DEFAULT = {"topology", "exclusivePlacement", "mlflowSecretRef"}
# Keys the backend reads beyond the contract (operators/kubernetes/runtime.py): pod identity of the ranks.
BACKEND_EXTRAS = {"trainingRuntime", "runAsUser", "runAsGroup", "fsGroup", "metricsPort"}
TRAINING_LABELS = {"app.kubernetes.io/name": "gangflow", "app.kubernetes.io/component": "training"}


def runtime_of(objects, namespace=None):
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gangflow-runtime"
            and (namespace is None or o["metadata"]["namespace"] == namespace)]
    assert len(maps) == 1, maps
    assert set(maps[0]["data"]) == {"runtime.yaml"}
    return yaml.safe_load(maps[0]["data"]["runtime.yaml"])


def test_runtime_yaml_has_the_contract_keys_and_defaults(render):
    runtime = runtime_of(render())
    assert set(runtime) == (CONTRACT_KEYS - OFF_BY_DEFAULT) | BACKEND_EXTRAS
    assert re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", runtime["image"])
    assert runtime["namespace"] == "gangflow-team"  # issue 28.5: apart from the release namespace's Secrets
    assert runtime["serviceAccountName"] == "gangflow-training"
    assert (runtime["scheduler"], runtime["api"], runtime["queue"]) == ("kueue", "jobset", "gangflow")
    assert runtime["priorityClassName"] == "gangflow-training"
    assert runtime["workloadPriorityClass"] == "gangflow-normal"
    assert runtime["resources"] == {"cpu": "4", "memory": "16Gi", "gpu": 0}
    assert isinstance(runtime["resources"]["gpu"], int)
    assert runtime["checkpoint"] == {"pvc": "gangflow-checkpoints", "mountPath": "/checkpoints"}
    assert (runtime["runAsUser"], runtime["runAsGroup"], runtime["fsGroup"]) == (10001, 10001, 10001)
    assert runtime["mlflowTrackingUri"] == "http://gangflow-mlflow.gangflow-system.svc.cluster.local:5000"
    assert runtime["rendezvousPort"] == 29500
    for key in ("terminationGracePeriodSeconds", "admissionTimeoutSeconds", "startupTimeoutSeconds"):
        assert isinstance(runtime[key], int) and runtime[key] > 0
    assert runtime["ncclEnv"]["NCCL_DEBUG"] == "WARN"


def test_runtime_follows_values(render):
    values = {
        "kueue": {"enabled": False, "teams": [{"name": "vision", "namespace": "team-vision"}]},
        "volcano": {"enabled": True, "queue": {"name": "gpu"}},
        "mlflow": {"enabled": False},
        "runtime": {"configMapName": "gangflow-runtime"},
        "training": {
            "resources": {"cpu": "8", "memory": "64Gi", "gpu": 4}, "maxWorldSize": 4,
            "mlflowTrackingUri": "https://mlflow.example.com",
            "mlflowSecretRef": {"name": "mlflow-token", "key": "token"},
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "checkpoint": {"pvc": "", "uri": "s3://ckpt/runs", "createPvc": False},
        },
    }
    values["volcano"]["queue"]["capability"] = {"cpu": "64", "memory": "512Gi", "gpu": 16}
    runtime = runtime_of(render(values), "team-vision")
    assert set(runtime) == (CONTRACT_KEYS - {"workloadPriorityClass", "topology", "exclusivePlacement"}) | BACKEND_EXTRAS
    assert (runtime["scheduler"], runtime["api"], runtime["queue"]) == ("volcano", "jobset", "gpu")
    assert runtime["namespace"] == "team-vision"
    assert runtime["resources"] == {"cpu": "8", "memory": "64Gi", "gpu": 4}
    assert runtime["mlflowTrackingUri"] == "https://mlflow.example.com"
    assert runtime["mlflowSecretRef"] == {"name": "mlflow-token", "key": "token"}
    assert runtime["nodeSelector"] == {"pool": "gpu"}
    assert runtime["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert runtime["checkpoint"] == {"mountPath": "/checkpoints", "uri": "s3://ckpt/runs"}


def test_topology_and_exclusive_placement_when_set(render):
    values = {"kueue": {"topology": {"enabled": True, "levels": ["cloud.example.com/block", "kubernetes.io/hostname"]},
                        "resourceFlavors": [{"name": "gpu", "nodeLabels": {"pool": "gpu"},
                                             "quota": {"cpu": "64", "memory": "512Gi", "gpu": 8}}]},
              "trainjob": {"enabled": True},
              "training": {"api": "jobset", "topology": {"level": "cloud.example.com/block", "mode": "required"},
                           "exclusivePlacement": {"topologyKey": "kubernetes.io/hostname"}}}
    runtime = runtime_of(render(values))
    assert runtime["topology"] == {"level": "cloud.example.com/block", "mode": "required"}
    assert runtime["exclusivePlacement"] == {"topologyKey": "kubernetes.io/hostname"}


RUNTIME_SCENARIOS = {
    "defaults": {},
    "volcano": {"kueue": {"enabled": False}, "volcano": {"enabled": True}},
    "trainjob": {"trainjob": {"enabled": True}, "training": {"api": "trainjob"}},
    "object-storage-external-mlflow": {
        "mlflow": {"enabled": False},
        "priorityClasses": {"enabled": False},
        "training": {"checkpoint": {"pvc": "", "uri": "s3://ckpt/runs", "createPvc": False},
                     "mlflowTrackingUri": "https://mlflow.example.com", "priorityClassName": "",
                     "workloadPriorityClass": "", "mlflowSecretRef": {"name": "mlflow-token", "key": "token"}}},
}


@pytest.mark.parametrize("values", list(RUNTIME_SCENARIOS.values()), ids=list(RUNTIME_SCENARIOS))
def test_the_backend_accepts_the_rendered_runtime(render, values):
    """The Kubernetes backend's own parser (strict: unknown keys and bad values are errors) reads
    what the chart writes."""
    runtime_module = pytest.importorskip("operators.kubernetes.runtime")
    runtime = runtime_module.RuntimeDefaults.from_mapping(runtime_of(render(values)))
    assert runtime.image.endswith("@sha256:" + "0" * 64)
    assert runtime.run_as_user == 10001


def test_one_runtime_per_team_with_its_own_queue(render):
    teams = [{"name": "vision", "namespace": "team-vision"}, {"name": "nlp", "namespace": "team-nlp"}]
    objects = render({"kueue": {"teams": teams}})
    for team in teams:
        runtime = runtime_of(objects, team["namespace"])
        assert runtime["queue"] == team["name"] and runtime["namespace"] == team["namespace"]


def netpol(objects):
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-training")]
    return policy["spec"]


def test_training_ingress_only_from_other_ranks_and_prometheus(render):
    spec = netpol(render())
    assert spec["podSelector"] == {"matchLabels": TRAINING_LABELS}
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    (rule, prometheus) = spec["ingress"]
    # Prometheus, on the metrics port only (tests/unit/helm/test_metrics.py)
    assert prometheus == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
                          "ports": [{"protocol": "TCP", "port": 9400}]}
    assert rule["from"] == [{"podSelector": {"matchLabels": TRAINING_LABELS}}]  # same namespace only
    assert rule["ports"] == [{"protocol": "TCP", "port": 1024, "endPort": 65535}]
    assert 1024 <= 29500 <= 65535  # rendezvous port inside the collective range


def test_training_egress_is_ranks_dns_mlflow_only_by_default(render):
    egress = netpol(render())["egress"]
    assert len(egress) == 3
    ranks, dns, mlflow = egress
    assert ranks["to"] == [{"podSelector": {"matchLabels": TRAINING_LABELS}}]
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert sorted(p["protocol"] for p in dns["ports"]) == ["TCP", "UDP"]
    (peer,) = mlflow["to"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "gangflow-system"}
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "mlflow"
    assert mlflow["ports"] == [{"protocol": "TCP", "port": 5000}]
    # Nothing open to the world: no ipBlock without values.
    assert all("ipBlock" not in peer for rule in egress for peer in rule["to"])


def test_object_storage_and_external_mlflow_egress_come_from_values(render):
    values = {"mlflow": {"enabled": False},
              "networkPolicy": {"objectStorage": {"cidrs": ["10.20.0.0/16"], "ports": [443, 9000]},
                                "externalMlflow": {"cidrs": ["203.0.113.0/24"], "port": 8443}}}
    egress = netpol(render(values))["egress"]
    blocks = {peer["ipBlock"]["cidr"]: rule["ports"] for rule in egress for peer in rule["to"] if "ipBlock" in peer}
    assert blocks == {
        "203.0.113.0/24": [{"protocol": "TCP", "port": 8443}],
        "10.20.0.0/16": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 9000}],
    }


def test_rendezvous_port_is_opened_when_outside_the_collective_range(render):
    spec = netpol(render({"networkPolicy": {"collectivePorts": {"start": 40000, "end": 50000}}}))
    expected = [{"protocol": "TCP", "port": 29500}, {"protocol": "TCP", "port": 40000, "endPort": 50000}]
    assert spec["ingress"][0]["ports"] == expected
    assert spec["egress"][0]["ports"] == expected
