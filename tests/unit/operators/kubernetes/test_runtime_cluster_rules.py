"""Runtime values the API server would refuse are refused when the runtime loads, naming the key and
what it accepts (apimachinery's label-value and qualified-name rules), and the offline validator
checks every rendered `metadata.labels`. `checkpoint.mountPath` is normalised before it is checked:
no spelling of /, /tmp, /dev/shm or /app (or another fixed path of the pod) gets through."""

from __future__ import annotations

import copy

import pytest

from operators.backends.base import GangSpec
from operators.kubernetes.builders import WorkerPathError, build_gang
from operators.kubernetes import runtime as rt
from operators.kubernetes.runtime import RuntimeConfigError, RuntimeDefaults, example_runtime_mapping, merge_runtime
from operators.kubernetes.validation import SchemaValidationError, validate_object

VERSION = "0123456789abcdef0123456789abcdef"


def _with(**changes):
    return merge_runtime(example_runtime_mapping(), changes)


def _refused(changes, needle):
    with pytest.raises(RuntimeConfigError) as exc:
        RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), changes))
    assert needle in str(exc.value)


# --- the two apimachinery rules, in one place ------------------------------------------------------


@pytest.mark.parametrize("value", ["", "a", "gangflow", "A.b_c-9", "x" * 63, "0123456789abcdef0123456789abcdef.dir"])
def test_label_values_apimachinery_accepts(value):
    assert rt.is_label_value(value)


@pytest.mark.parametrize("value", ["x" * 64, "-a", "a-", "a b", "a\nb", "a/b", "_a", 3, None])
def test_label_values_apimachinery_refuses(value):
    assert not rt.is_label_value(value)


@pytest.mark.parametrize("key", ["kubernetes.io/hostname", "gpu", "cloud.google.com/gke-nodepool", "a.b/C_d.e-f", "n" * 63,
                                 "p" * 253 + "/n"])
def test_qualified_names_apimachinery_accepts(key):
    assert rt.is_qualified_name(key)


@pytest.mark.parametrize("key", ["", "gpu type", "a\nb", "/name", "prefix/", "Upper.Case/x", "a/b/c", "n" * 64,
                                 "p" * 254 + "/n", "-x", "x.", "not a key!", None])
def test_qualified_names_apimachinery_refuses(key):
    assert not rt.is_qualified_name(key)


# --- runtime keys that end up in labels, selectors and topology keys -------------------------------


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"queue": "q" * 70}, "runtime queue='" + "q" * 70 + "': must be a Kueue LocalQueue or Volcano queue name"),
        ({"queue": "q" * 70}, "at most 63 characters"),
        ({"queue": "gangflow\n"}, "runtime queue='gangflow\\n'"),
        ({"workloadPriorityClass": "w" * 70}, "runtime workloadPriorityClass='" + "w" * 70 + "'"),
        ({"nodeSelector": {"gpu type": "a100"}}, "runtime nodeSelector.gpu type='a100': keys must be a label key: an optional DNS-1123 subdomain prefix"),
        ({"nodeSelector": {"gpu": "a100\nx"}}, "runtime nodeSelector.gpu='a100\\nx': values must be a label value: empty, or at most 63 characters"),
        ({"nodeSelector": {"gpu": "x" * 64}}, "values must be a label value: empty, or at most 63 characters"),
        ({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}, "runtime tolerations[].value='v': must be empty with operator Exists"),
        ({"tolerations": [{"key": "bad key", "operator": "Exists"}]}, "runtime tolerations[].key='bad key': must be empty or a label key"),
        ({"tolerations": [{"key": "k", "value": "a b"}]}, "runtime tolerations[].value='a b': with operator Equal must be a label value"),
        ({"tolerations": [{"operator": "Equal", "value": "v"}]}, "runtime tolerations[].operator='Equal': must be Exists when the key is empty"),
        ({"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}]},
         "runtime tolerations[].tolerationSeconds=60: must be an integer, with effect NoExecute"),
        ({"tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "Sometimes"}]},
         "accepted values: NoSchedule, PreferNoSchedule, NoExecute"),
        ({"scheduler": "volcano", "topology": {"level": "not a key!"}}, "runtime topology.level='not a key!': must be a node label key"),
        ({"topology": {"level": "kubernetes.io/" + "h" * 64}}, "topology.level"),
        ({"exclusivePlacement": {"topologyKey": "two words"}}, "runtime exclusivePlacement.topologyKey='two words'"),
        # '$' let a trailing newline through these three (they were matched with match, not fullmatch)
        ({"mlflowSecretRef": {"name": "gangflow-mlflow", "key": "token\n"}}, "runtime mlflowSecretRef.key='token\\n': must be a key"),
        ({"dataset": {"remote": "s3://gangflow-data/dvc", "endpointUrl": "https://minio.storage:9000\n"}},
         "runtime dataset.endpointUrl='https://minio.storage:9000\\n': must be an http(s) URL"),
        ({"dataset": {"remote": "s3://gangflow-data/dvc\n"}}, "runtime dataset.remote='s3://gangflow-data/dvc\\n'"),
        ({"trainingRuntime": "Torch Distributed"}, "runtime trainingRuntime='Torch Distributed': must be a ClusterTrainingRuntime name"),
        ({"priorityClassName": "high\n"}, "runtime priorityClassName='high\\n': must be a class name"),
    ],
)
def test_values_the_api_server_refuses_are_refused_at_load(changes, needle):
    _refused(changes, needle)


def test_valid_label_shaped_values_still_load():
    runtime = RuntimeDefaults.from_mapping(_with(
        queue="team-a.gpu", workloadPriorityClass="high",
        nodeSelector={"cloud.google.com/gke-nodepool": "a100-pool", "gpu": ""},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                     {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute", "tolerationSeconds": 60},
                     {"operator": "Exists"}],
        topology={"level": "cloud.google.com/gke-nodepool"},
    ))
    assert runtime.queue == "team-a.gpu" and runtime.node_selector["gpu"] == ""


# --- the offline validator checks every rendered metadata.labels ----------------------------------


def _jobset():
    runtime = RuntimeDefaults.from_mapping(example_runtime_mapping())
    spec = GangSpec(name="train-demo", run_dir="/x", world_size=1, attempt=1, dataset_version=VERSION)
    return copy.deepcopy(build_gang(spec, runtime).body)


def test_rendered_objects_pass_the_label_check(crd_registry):
    validate_object(_jobset(), crd_registry)


@pytest.mark.parametrize(
    "where,key,value,needle",
    [
        ("object", "kueue.x-k8s.io/queue-name", "q" * 70, "metadata.labels.kueue.x-k8s.io/queue-name"),
        ("object", "gpu type", "a", "metadata.labels.gpu type"),
        ("pod", "gangflow.io/gang", "a\nb", "metadata.labels.gangflow.io/gang"),
    ],
)
def test_bad_labels_fail_validation(crd_registry, where, key, value, needle):
    body = _jobset()
    meta = body["metadata"] if where == "object" else body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]
    meta["labels"][key] = value
    with pytest.raises(SchemaValidationError) as exc:
        validate_object(body, crd_registry)
    assert needle in str(exc.value)


def test_bad_labels_of_a_core_object_fail_validation():
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {"a": "v" * 64}}}
    with pytest.raises(SchemaValidationError, match="metadata.labels.a"):
        validate_object(cm)


# --- checkpoint.mountPath -------------------------------------------------------------------------


@pytest.mark.parametrize("mount", ["/", "//", "///", "/tmp", "/tmp/", "/tmp/x", "/tmp/.ssh", "/dev/shm", "/dev/shm/", "/dev/shm/x",
                                   "/app", "/app/", "/app/ckpt", "/./tmp", "/checkpoints/../tmp", "/dev", "/etc/mpi", "/etc",
                                   "checkpoints", "", "//checkpoints"])
def test_mount_paths_over_the_pods_fixed_paths_are_refused(mount):
    _refused({"checkpoint": {"pvc": "ckpt", "mountPath": mount}}, "runtime checkpoint.mountPath=")


def test_mount_path_refusal_names_the_accepted_values():
    _refused({"checkpoint": {"pvc": "ckpt", "mountPath": "/tmp/"}},
             "runtime checkpoint.mountPath='/tmp/': must be an absolute path such as /checkpoints or /mnt/checkpoints, "
             "not / and not on, under or above /app, /opt/venv, /tmp, /dev, /etc")


@pytest.mark.parametrize("api", ["jobset", "mpijob", "rayjob"])
def test_every_fixed_mount_of_the_pod_is_a_refused_mount_path(api):
    """The builders' own mounts (/tmp, /dev/shm, mpi-operator's /tmp/.ssh and /etc/mpi) and the
    image's /app all lie under POD_FIXED_PATHS, so no checkpoint mount can shadow them."""
    import json

    from operators.kubernetes import builders

    runtime = RuntimeDefaults.from_mapping(_with(api=api, resources={"gpu": 0}, procsPerPod=1))
    spec = GangSpec(name="train-demo", run_dir="/x", world_size=2, attempt=1, dataset_version=VERSION,
                    launcher=rt.API_LAUNCHERS[api])
    text = json.dumps(build_gang(spec, runtime).body)
    paths = {builders.APP_DIR, builders.MPI_SSH_AUTH_PATH, builders.MPI_HOSTFILE, builders.TERMINATION_LOG}
    paths |= {part.split('"')[0] for part in text.split('"mountPath": "')[1:]} - {runtime.checkpoint.mount_path}
    for path in paths:
        assert any(path == root or path.startswith(root + "/") for root in rt.POD_FIXED_PATHS), path
        with pytest.raises(RuntimeConfigError, match="checkpoint.mountPath"):
            RuntimeDefaults.from_mapping(_with(checkpoint={"pvc": "ckpt", "mountPath": path}))


@pytest.mark.parametrize("mount,run_dir", [("/checkpoints", "/checkpoints/g"), ("/checkpoints/", "/checkpoints/g"),
                                           ("/mnt/ckpt", "/mnt/ckpt/g"), ("/data//ckpt/.", "/data/ckpt/g")])
def test_good_mount_paths_are_normalised(mount, run_dir):
    runtime = RuntimeDefaults.from_mapping(_with(checkpoint={"pvc": "ckpt", "mountPath": mount}))
    assert runtime.checkpoint.run_dir("g") == run_dir


def test_a_worker_tmp_path_never_reaches_the_pod():
    """The old exact-string check let '/tmp/' through; the mount then made /tmp/... look readable."""
    with pytest.raises((RuntimeConfigError, WorkerPathError)):
        runtime = RuntimeDefaults.from_mapping(_with(checkpoint={"pvc": "ckpt", "mountPath": "/tmp/"}))
        spec = GangSpec(name="train-demo", run_dir="/x", world_size=1, attempt=1, dataset_version=VERSION,
                        overrides=("model.init_from=/tmp/airflow-worker/weights.safetensors",))
        build_gang(spec, runtime)
