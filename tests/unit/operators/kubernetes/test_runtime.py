"""RuntimeDefaults: the chart's runtime.yaml contract; bad values are refused with the key named."""

from __future__ import annotations

import pytest

from operators.kubernetes.runtime import RuntimeConfigError, RuntimeDefaults, example_runtime_mapping, merge_runtime


def _with(**changes):
    return merge_runtime(example_runtime_mapping(), changes)


def test_example_defaults_round_trip():
    runtime = RuntimeDefaults.from_mapping(example_runtime_mapping())
    assert runtime.scheduler == "kueue" and runtime.api == "jobset"
    assert runtime.resources.as_resource_list() == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    assert RuntimeDefaults.from_mapping(runtime.to_mapping()) == runtime


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"image": "ghcr.io/gangflow/trainer:latest"}, "runtime image='ghcr.io/gangflow/trainer:latest': must be pinned by digest"),
        ({"image": "ghcr.io/gangflow/trainer:v1@sha256:abc"}, "must be pinned by digest"),
        ({"scheduler": "slurm"}, "runtime scheduler='slurm': accepted values: kueue, volcano"),
        ({"api": "pytorchjob"}, "runtime api='pytorchjob': accepted values: jobset, trainjob"),
        ({"topology": {"level": "kubernetes.io/hostname", "mode": "strict"}}, "runtime topology.mode='strict': accepted values: required, preferred"),
        ({"resources": {"cpu": "four"}}, "runtime resources.cpu='four': must be a Kubernetes quantity"),
        ({"resources": {"gpu": -1}}, "runtime resources.gpu=-1: must be an integer between 0 and 64"),
        ({"shmSize": "lots"}, "runtime shmSize='lots'"),
        ({"rendezvousPort": 80}, "runtime rendezvousPort=80: must be an integer between 1024 and 65535"),
        ({"terminationGracePeriodSeconds": 5}, "terminationGracePeriodSeconds=5"),
        ({"checkpoint": {"uri": "s3://bucket/x"}}, "set exactly one of checkpoint.pvc"),
        ({"checkpoint": {"pvc": None}}, "set exactly one of checkpoint.pvc"),
        ({"ncclEnv": {"NCCL DEBUG": "INFO"}}, "names must be environment variable names"),
        ({"tolerations": [{"key": "a", "operator": "Sometimes"}]}, "accepted values: Equal, Exists"),
        ({"shmsize": "1Gi"}, "unknown runtime key(s) shmsize; accepted keys: image,"),
        ({"resources": {"gpus": 8}}, "unknown runtime key(s) resources.gpus"),
        ({"exclusivePlacement": {"topologyKey": "kubernetes.io/hostname"}, "api": "trainjob"}, "needs api=jobset"),
        ({"runAsUser": 0}, "runtime runAsUser=0: must be an integer between 1"),
    ],
)
def test_bad_values_name_the_key_and_accepted_values(changes, needle):
    with pytest.raises(RuntimeConfigError) as exc:
        RuntimeDefaults.from_mapping(_with(**changes))
    assert needle in str(exc.value)


def test_required_keys():
    with pytest.raises(RuntimeConfigError, match="runtime image is required"):
        RuntimeDefaults.from_mapping({"checkpoint": {"pvc": "x"}})
    with pytest.raises(RuntimeConfigError, match="runtime checkpoint is required"):
        RuntimeDefaults.from_mapping({"image": example_runtime_mapping()["image"]})


def test_merge_is_deep_for_sections_and_replaces_maps_of_values():
    merged = merge_runtime(
        {"resources": {"cpu": "4", "memory": "8Gi"}, "ncclEnv": {"A": "1", "B": "2"}, "queue": "a"},
        {"resources": {"gpu": 2}, "ncclEnv": {"C": "3"}, "queue": None},
    )
    assert merged == {"resources": {"cpu": "4", "memory": "8Gi", "gpu": 2}, "ncclEnv": {"C": "3"}}
