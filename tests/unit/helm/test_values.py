"""values.schema.json documents every key, matches values.yaml, and rejects unknown keys;
templates/check-values.yaml fails bad combinations with messages that name the values to change."""

from __future__ import annotations

import json

import helm_python
import pytest
import yaml

PINNED = "sha256:" + "a" * 64


@pytest.fixture(scope="module")
def schema(chart_dir):
    return json.loads((chart_dir / "values.schema.json").read_text())


@pytest.fixture(scope="module")
def values(chart_dir):
    return yaml.safe_load((chart_dir / "values.yaml").read_text())


def walk(schema, path="$"):
    """Yield (path, subschema) for every property schema, array item schema included."""
    for name, sub in schema.get("properties", {}).items():
        yield f"{path}.{name}", sub
        yield from walk(sub, f"{path}.{name}")
    items = schema.get("items")
    if isinstance(items, dict):
        yield f"{path}[]", items
        yield from walk(items, f"{path}[]")


def test_every_key_has_a_description_and_a_default(schema):
    keys = list(walk(schema))
    assert len(keys) > 100
    missing = [p for p, s in keys if not str(s.get("description", "")).strip() or "default" not in s]
    assert missing == []


def test_every_object_with_properties_rejects_unknown_keys(schema):
    open_objects = [p for p, s in [("$", schema), *walk(schema)]
                    if "properties" in s and s.get("additionalProperties") is not False]
    assert open_objects == []


def test_schema_defaults_equal_values_yaml(schema, values):
    def check(sch, value, path):
        assert sch.get("default") == value, f"{path}: schema default {sch.get('default')!r} != values.yaml {value!r}"
        if isinstance(value, dict) and "properties" in sch:
            assert set(value) == set(sch["properties"]), f"{path}: keys differ from the schema"
            for key, sub in value.items():
                check(sch["properties"][key], sub, f"{path}.{key}")

    for key, value in values.items():
        check(schema["properties"][key], value, key)
    assert set(values) == set(schema["properties"])


def test_default_values_pass_the_schema(chart):
    chart.validate_schema({})


@pytest.mark.parametrize("bad, where", [
    ({"kueue": {"enabled": True, "typo": 1}}, "/kueue"),
    ({"training": {"api": "pytorchjob"}}, "/training/api"),
    ({"training": {"topology": {"mode": "sometimes"}}}, "/training/topology/mode"),
    ({"training": {"resources": {"memory": "lots"}}}, "/training/resources/memory"),
    ({"training": {"maxWorldSize": 0}}, "/training/maxWorldSize"),
    ({"training": {"terminationGracePeriodSeconds": 5}}, "/training/terminationGracePeriodSeconds"),
    ({"training": {"checkpoint": {"mountPath": "/tmp"}}}, "/training/checkpoint/mountPath"),
    ({"training": {"ncclEnv": {"NCCL-DEBUG": "INFO"}}}, "invalid propertyName 'NCCL-DEBUG'"),
    ({"kueue": {"teams": [{"name": "Team_A"}]}}, "/kueue/teams/0/name"),
    ({"networkPolicy": {"objectStorage": {"cidrs": ["not-a-cidr"]}}}, "/networkPolicy/objectStorage/cidrs/0"),
])
def test_schema_rejects_bad_values(chart, bad, where):
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.validate_schema(bad)
    assert where in str(err.value)


CHECKS = [
    ({"volcano": {"enabled": True}},
     "kueue.enabled and volcano.enabled are both true"),
    ({"training": {"image": {"digest": "latest"}}},
     "training.image.digest must pin the training image by digest"),
    ({"training": {"image": {"repository": "registry.example.com/t@sha256:" + "a" * 64}}},
     "must not carry a digest"),
    ({"mlflow": {"image": {"digest": ""}}},
     "mlflow.image.digest must pin the MLflow image by digest"),
    ({"mlflow": {"backendStore": {"secretName": ""}}},
     "mlflow.enabled needs a backend store Secret"),
    ({"mlflow": {"artifacts": {"s3": {"destination": "gs://bucket"}}}},
     "mlflow.artifacts.s3.destination must be an s3:// URI"),
    ({"mlflow": {"artifacts": {"type": "pvc", "pvc": {"claimName": ""}}}},
     "mlflow.artifacts.type=pvc needs mlflow.artifacts.pvc.claimName"),
    ({"mlflow": {"replicas": 2, "artifacts": {"type": "pvc"}}},
     "mlflow.replicas=2 with a ReadWriteOnce artifact PVC"),
    ({"training": {"maxWorldSize": 16, "resources": {"gpu": 1}}},
     "ClusterQueue quota too small for the largest gang: training.maxWorldSize=16 pods x (cpu=4, memory=16Gi, "
     "nvidia.com/gpu=1) must fit in the nominalQuota of one ResourceFlavor (Kueue admits a gang on a single "
     "flavor), but gangflow-default lacks nvidia.com/gpu (quota 8)"),
    ({"training": {"resources": {"cpu": "9", "memory": "80Gi", "gpu": 1}}},
     "gangflow-default lacks cpu (quota 64), memory (quota 512Gi)"),
    ({"kueue": {"resourceFlavors": [{"name": "small", "quota": {"cpu": "8", "memory": "1Ti", "gpu": 64}},
                                    {"name": "big", "quota": {"cpu": "1000", "memory": "64Gi", "gpu": 64}}]}},
     "small lacks cpu (quota 8); big lacks memory (quota 64Gi)"),
    ({"kueue": {"enabled": False}, "volcano": {"enabled": True, "queue": {"capability": {"gpu": 4}}}, "training": {"resources": {"gpu": 1}}},
     "Volcano queue capability too small for the largest gang"),
    ({"training": {"resources": {"cpu": "-4"}}},
     "\"-4\" is not a non-negative Kubernetes quantity"),
    ({"training": {"api": "trainjob"}},
     "training.api=trainjob needs trainjob.enabled=true"),
    ({"training": {"checkpoint": {"pvc": "", "uri": ""}}},
     "training.checkpoint needs exactly one of pvc"),
    ({"training": {"checkpoint": {"uri": "s3://ckpt/runs"}}},
     "training.checkpoint needs exactly one of pvc"),
    ({"kueue": {"enabled": False}, "volcano": {"enabled": True}, "trainjob": {"enabled": True},
      "training": {"api": "trainjob"}},
     "training.api=trainjob needs Kueue"),
    ({"kueue": {"enabled": False}, "volcano": {"enabled": True},
      "training": {"exclusivePlacement": {"topologyKey": "kubernetes.io/hostname"}}},
     "training.exclusivePlacement is a JobSet feature"),
    ({"training": {"resources": {"cpu": "0"}}},
     "training.resources.cpu must be greater than zero"),
    ({"training": {"resources": {"gpu": 2}, "procsPerPod": 4}},
     "training.procsPerPod=4 with training.resources.gpu=2: a GPU pod runs one process per GPU"),
    ({"training": {"priorityClassName": "vip"}},
     "training.priorityClassName \"vip\" is not one of priorityClasses.items"),
    ({"training": {"workloadPriorityClass": "urgent"}},
     "training.workloadPriorityClass \"urgent\" is not one of kueue.workloadPriorityClasses"),
    ({"training": {"topology": {"level": "kubernetes.io/hostname"}}},
     "needs kueue.topology.enabled=true"),
    ({"kueue": {"topology": {"enabled": True}}},
     "kueue.topology.enabled needs nodeLabels on every ResourceFlavor"),
    ({"kueue": {"resourceFlavors": [{"name": "f", "quota": {"cpu": "64", "memory": "512Gi", "gpu": 8},
                                     "borrowingLimit": {"gpu": 4}}]}},
     "borrowingLimit needs kueue.clusterQueue.cohort"),
    ({"kueue": {"teams": [{"name": "a", "namespace": "ns"}, {"name": "b", "namespace": "ns"}]}},
     "kueue.teams lists namespace \"ns\" twice"),
    ({"kueue": {"teams": []}},
     "kueue.teams is empty"),
    ({"networkPolicy": {"collectivePorts": {"start": 5000, "end": 4000}}},
     "networkPolicy.collectivePorts.start must not be greater"),
    ({"training": {"mlflowSecretRef": {"name": "token", "key": ""}}},
     "training.mlflowSecretRef.key is empty"),
]


@pytest.mark.parametrize("bad, message", CHECKS, ids=[m[:40] for _, m in CHECKS])
def test_check_values_fails_with_a_clear_message(render, bad, message):
    with pytest.raises(helm_python.HelmRenderError) as err:
        render(bad)
    assert message in str(err.value)


@pytest.mark.parametrize("good", [
    {"training": {"maxWorldSize": 8, "resources": {"cpu": "8000m", "memory": "64Gi", "gpu": 1}}},
    {"training": {"maxWorldSize": 64, "resources": {"cpu": "500m", "memory": "4Gi", "gpu": 0}},
     "kueue": {"resourceFlavors": [{"name": "cpu", "quota": {"cpu": "32", "memory": "256Gi", "gpu": 0}}]}},
    {"training": {"maxWorldSize": 16},
     "kueue": {"resourceFlavors": [{"name": "small", "quota": {"cpu": "8", "memory": "64Gi", "gpu": 1}},
                                   {"name": "big", "quota": {"cpu": "64", "memory": "0.25Ti", "gpu": 16}}]}},
    {"training": {"image": {"digest": PINNED}}, "mlflow": {"image": {"digest": PINNED}}},
], ids=["exactly-full", "cpu-only", "second-flavor-fits", "real-digests"])
def test_check_values_accepts_gangs_that_fit(render, good):
    assert render(good)


@pytest.mark.parametrize("nccl", [{"NCCL_NET_PLUGIN": "/shared/libnccl-net.so"}, {"NCCL_TUNER_PLUGIN": "tuner"},
                                  {"NCCL_DEBUG_FILE": "/checkpoints/x"}, {"NCCL_SOCKET_IFNAME": "/lib/x.so"}])
def test_schema_refuses_nccl_plugins_and_paths(chart, nccl):
    """Issue 28.5: `ncclEnv` accepted NCCL_NET_PLUGIN=/path/lib.so (NCCL loads that library)."""
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema({"training": {"ncclEnv": nccl}})


def test_schema_nccl_allow_list_is_the_runtimes(schema):
    from operators.kubernetes.runtime import NCCL_ENV

    nccl = schema["properties"]["training"]["properties"]["ncclEnv"]
    assert sorted(nccl["propertyNames"]["enum"]) == sorted(NCCL_ENV)
