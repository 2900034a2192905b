"""Runtime defaults of the Kubernetes backend: the `runtime.yaml` key of the `gangflow-runtime`
ConfigMap (written by the Helm chart), overridable per task.

`runtime.yaml` uses camelCase keys; `RuntimeDefaults.from_mapping` maps them onto the snake_case
fields below and `__post_init__` rejects bad values, naming the key and what it accepts. Unknown
keys are refused too: a typo such as `shmsize` must not silently fall back to a default.
"""

from __future__ import annotations

import copy
import dataclasses
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from trainer.urls import has_credentials, redact_url

RUNTIME_CONFIGMAP = "gangflow-runtime"
RUNTIME_CONFIGMAP_KEY = "runtime.yaml"

SCHEDULERS = ("kueue", "volcano")
APIS = ("jobset", "trainjob", "rayjob", "mpijob")
# the launcher each api's pods run (GangSpec.launcher; checked with the spec in builders.build_gang)
API_LAUNCHERS = {"jobset": "torchrun", "trainjob": "torchrun", "rayjob": "torchrun", "mpijob": "mpirun"}
TOPOLOGY_MODES = ("required", "preferred")

# An example digest for `render` without a runtime file; never pulled by the tests.
EXAMPLE_IMAGE = "ghcr.io/gangflow/trainer@sha256:" + "0" * 63 + "1"

_DIGEST_IMAGE = re.compile(r"^[a-z0-9]+(?:[._\-/:][a-z0-9]+)*@sha256:[0-9a-f]{64}$")
# Names and labels by apimachinery's rules (k8s.io/apimachinery/pkg/util/validation), the one copy the
# runtime checks and the offline validator (validation.py) share; match with fullmatch ('$' lets a
# trailing newline through).
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]")  # IsQualifiedName's name part
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?")  # IsValidLabelValue
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")  # IsConfigMapKey
_ENDPOINT_URL = re.compile(r"https?://[^\s@]+")
LABEL_VALUE_RULE = "a label value: empty, or at most 63 characters of [A-Za-z0-9-_.] that begin and end alphanumeric"
QUALIFIED_NAME_RULE = (
    "a label key: an optional DNS-1123 subdomain prefix (at most 253 characters) and '/', then a name of at most "
    "63 characters of [A-Za-z0-9-_.] that begins and ends alphanumeric, such as kubernetes.io/hostname"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_URI = re.compile(r"^[a-z][a-z0-9+.-]*://[^\s]+$")
# ncclEnv is for the collective libraries only, by name and value: a name outside this list
# (GANGFLOW_FAULT, LD_PRELOAD, PYTHONPATH, MLFLOW_*, and NCCL's own NCCL_NET_PLUGIN,
# NCCL_TUNER_PLUGIN, NCCL_*_FILE, which load a library or read or write a path) would change what
# the ranks run or touch, not how they talk. No value may hold a '/': never a path.
_INT = r"^[0-9]{1,12}$"
_FLAG = r"^[01]$"
_IFACES = r"^[=^]?[A-Za-z0-9_.:,-]{1,256}$"  # interface / HCA lists, '^' excludes, '=' exact
_LIST = r"^\^?[A-Za-z0-9_,;:]{1,128}$"
NCCL_ENV: dict[str, str] = {
    "NCCL_DEBUG": r"^(VERSION|WARN|INFO|TRACE)$", "NCCL_DEBUG_SUBSYS": r"^\^?[A-Z_,]{1,128}$",
    "NCCL_SOCKET_IFNAME": _IFACES, "NCCL_SOCKET_FAMILY": r"^AF_INET6?$", "NCCL_SOCKET_NTHREADS": _INT,
    "NCCL_NSOCKS_PERTHREAD": _INT, "NCCL_IB_DISABLE": _FLAG, "NCCL_IB_HCA": _IFACES, "NCCL_IB_GID_INDEX": _INT,
    "NCCL_IB_TIMEOUT": _INT, "NCCL_IB_RETRY_CNT": _INT, "NCCL_IB_TC": _INT, "NCCL_IB_SL": _INT,
    "NCCL_IB_QPS_PER_CONNECTION": _INT, "NCCL_IB_PCI_RELAXED_ORDERING": r"^[012]$", "NCCL_IB_ADAPTIVE_ROUTING": _FLAG,
    "NCCL_NET_GDR_LEVEL": r"^(LOC|PIX|PXB|PHB|SYS|[0-9])$", "NCCL_NET_GDR_READ": _FLAG, "NCCL_P2P_DISABLE": _FLAG,
    "NCCL_P2P_LEVEL": r"^(LOC|NVL|PIX|PXB|PHB|SYS|[0-9])$", "NCCL_SHM_DISABLE": _FLAG, "NCCL_BUFFSIZE": _INT,
    "NCCL_NTHREADS": _INT, "NCCL_MIN_NCHANNELS": _INT, "NCCL_MAX_NCHANNELS": _INT, "NCCL_ALGO": _LIST, "NCCL_PROTO": _LIST,
    "NCCL_CROSS_NIC": r"^[012]$", "NCCL_NVLS_ENABLE": _FLAG, "NCCL_CUMEM_ENABLE": _FLAG,
    "NCCL_LAUNCH_MODE": r"^(PARALLEL|GROUP)$", "NCCL_ASYNC_ERROR_HANDLING": r"^[0-3]$", "NCCL_BLOCKING_WAIT": _FLAG,
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": r"^[0-3]$", "TORCH_NCCL_BLOCKING_WAIT": _FLAG, "TORCH_NCCL_ENABLE_MONITORING": _FLAG,
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": _INT, "TORCH_NCCL_TRACE_BUFFER_SIZE": _INT, "TORCH_NCCL_DUMP_ON_TIMEOUT": _FLAG,
    "TORCH_NCCL_DESYNC_DEBUG": _FLAG, "TORCH_NCCL_ENABLE_TIMING": _FLAG,
    "GLOO_SOCKET_IFNAME": r"^[A-Za-z0-9_.:-]{1,64}(,[A-Za-z0-9_.:-]{1,64}){0,15}$",
    "TORCH_DISTRIBUTED_DEBUG": r"^(OFF|INFO|DETAIL)$",
}  # fmt: skip
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|e[0-9]+)?$")


def is_label_value(value: Any) -> bool:
    """apimachinery's IsValidLabelValue: what a label, a nodeSelector entry or a toleration may hold."""
    return isinstance(value, str) and _LABEL_VALUE.fullmatch(value) is not None


def is_qualified_name(value: Any) -> bool:
    """apimachinery's IsQualifiedName: a label key, nodeSelector key, toleration key or topology key."""
    if not isinstance(value, str):
        return False
    parts = value.split("/")
    if len(parts) == 2 and not (parts[0] and _DNS_SUBDOMAIN.fullmatch(parts[0])):
        return False
    return len(parts) <= 2 and _QUALIFIED_NAME.fullmatch(parts[-1]) is not None


# Fixed paths of every pod (builders.py): the image's code (WORKDIR /app, docker/training.Dockerfile)
# and venv with the gangflow package (/opt/venv), the writable /tmp (HOME, mpi-operator's ssh keys),
# /dev (/dev/shm, the termination log), /etc (mpi-operator's hostfile /etc/mpi) and the system
# directories. A checkpoint mount on, below or above one of them hides it, or is hidden by it.
APP_DIR = "/app"
POD_FIXED_PATHS = (APP_DIR, "/opt/venv", "/tmp", "/dev", "/etc", "/proc", "/sys", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/run", "/var/run")


def _overlaps(path: str, root: str) -> bool:
    """`path` (normalised, absolute) is `root`, lies under it, or holds it."""
    return path == root or path.startswith(root + "/") or root.startswith(path.rstrip("/") + "/")


class RuntimeConfigError(ValueError):
    """A runtime default has a value the backend cannot use."""


def _fail(key: str, value: Any, accepted: str) -> None:
    raise RuntimeConfigError(f"runtime {key}={value!r}: {accepted}")


def parse_quantity(key: str, value: Any):
    """Parse a Kubernetes quantity ('4', '500m', '16Gi'); `key` names the field in the error."""
    from decimal import Decimal

    from kubernetes.utils.quantity import parse_quantity as _parse

    text = str(value).strip()
    if isinstance(value, bool) or not _QUANTITY.fullmatch(text):
        _fail(key, value, "must be a Kubernetes quantity such as '4', '500m', '16Gi'")
    try:
        quantity = _parse(text)
    except ValueError:
        _fail(key, value, "must be a Kubernetes quantity such as '4', '500m', '16Gi'")
    if quantity <= Decimal(0):
        _fail(key, value, "must be greater than zero")
    return quantity


def _check_int(key: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        _fail(key, value, f"must be an integer {bound}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(key, value, f"accepted values: {', '.join(choices)}")



def _check_name(key: str, value: Any, pattern: re.Pattern[str], rule: str, *, optional: bool = False,
                label_value: bool = False) -> None:
    """A Kubernetes object name (`optional`: or None); `label_value`: it is also written as a label's value."""
    if optional and value is None:
        return
    if not (isinstance(value, str) and pattern.fullmatch(value) and (not label_value or is_label_value(value))):
        _fail(key, value, rule)

@dataclass(frozen=True)
class Topology:
    """Keep all ranks inside one topology domain (`level` is a node label key)."""

    level: str
    mode: str = "required"

    def __post_init__(self):
        if not is_qualified_name(self.level):  # Kueue's level and Volcano's pod-affinity topologyKey
            _fail("topology.level", self.level, f"must be a node label key such as cloud.google.com/gke-nodepool or kubernetes.io/hostname ({QUALIFIED_NAME_RULE})")
        _check_choice("topology.mode", self.mode, TOPOLOGY_MODES)


@dataclass(frozen=True)
class ExclusivePlacement:
    """One gang per topology domain (JobSet's exclusive-topology annotation)."""

    topology_key: str

    def __post_init__(self):
        if not is_qualified_name(self.topology_key):  # JobSet's pod-affinity topologyKey
            _fail("exclusivePlacement.topologyKey", self.topology_key, f"must be a node label key such as kubernetes.io/hostname ({QUALIFIED_NAME_RULE})")


@dataclass(frozen=True)
class Resources:
    """Per-pod resources; requests = limits (Guaranteed QoS)."""

    cpu: str = "4"
    memory: str = "16Gi"
    gpu: int = 0  # nvidia.com/gpu per pod (one process per GPU)

    def __post_init__(self):
        parse_quantity("resources.cpu", self.cpu)
        parse_quantity("resources.memory", self.memory)
        _check_int("resources.gpu", self.gpu, 0, 64)
        object.__setattr__(self, "cpu", str(self.cpu))
        object.__setattr__(self, "memory", str(self.memory))

    def as_resource_list(self) -> dict[str, str]:
        out = {"cpu": self.cpu, "memory": self.memory}
        if self.gpu:
            out["nvidia.com/gpu"] = str(self.gpu)
        return out


@dataclass(frozen=True)
class Checkpoint:
    """Where ranks read and commit checkpoints: a shared PVC or an object-storage URI (fsspec)."""

    pvc: str | None = None
    mount_path: str = "/checkpoints"
    uri: str | None = None

    def __post_init__(self):
        _check_name("checkpoint.pvc", self.pvc, _DNS_SUBDOMAIN, "must be a PersistentVolumeClaim name (DNS-1123 subdomain)",
                    optional=True)
        # normalised first: '/tmp/', '/./tmp' or '/ckpt/../app' is the directory it names
        mount_path = posixpath.normpath(self.mount_path) if isinstance(self.mount_path, str) and self.mount_path.startswith("/") else ""
        if (not mount_path or self.mount_path.startswith("//") or "\n" in mount_path
                or any(_overlaps(mount_path, root) for root in POD_FIXED_PATHS)):
            _fail("checkpoint.mountPath", self.mount_path,
                  f"must be an absolute path such as /checkpoints or /mnt/checkpoints, not / and not on, under or "
                  f"above {', '.join(POD_FIXED_PATHS)} (the image's code and venv, the pod's /tmp and /dev/shm, system directories)")
        object.__setattr__(self, "mount_path", mount_path)
        if self.uri is not None and not (isinstance(self.uri, str) and re.match(r"^[a-z][a-z0-9+.-]*://.+", self.uri)):
            _fail("checkpoint.uri", redact_url(self.uri), "must be an object-storage URI such as s3://bucket/prefix or gs://bucket/prefix")
        if has_credentials(self.uri):  # it reaches pod args and an MLflow tag
            _fail("checkpoint.uri", redact_url(self.uri), "must not carry credentials; put them in dataset.credentialsSecret (AWS_* keys)")
        if (self.pvc is None) == (self.uri is None):
            _fail(
                "checkpoint",
                {"pvc": self.pvc, "uri": self.uri},
                "set exactly one of checkpoint.pvc (a ReadWriteMany claim every rank mounts) or checkpoint.uri "
                "(object storage): ranks on different nodes must share the run dir so a retry resumes",
            )

    def run_dir(self, gang: str) -> str:
        if self.uri:
            return f"{self.uri.rstrip('/')}/{gang}"
        return f"{self.mount_path.rstrip('/')}/{gang}"


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str

    def __post_init__(self):
        _check_name("mlflowSecretRef.name", self.name, _DNS_SUBDOMAIN, "must be a Secret name (DNS-1123 subdomain)")
        _check_name("mlflowSecretRef.key", self.key, _SECRET_KEY, "must be a key of that Secret (letters, digits, '-', '_', '.')")


@dataclass(frozen=True)
class Dataset:
    """Where ranks fetch the pinned dataset: the DVC remote (content-addressed objects, fsspec URL).

    The trainer gets `--set data.remote=<remote> --set data.version=<md5>` and fetches and
    verifies the files itself; `credentialsSecret` (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    ...) becomes the pods' env through `envFrom`, `endpointUrl` is AWS_ENDPOINT_URL (MinIO, ...).
    The same credentials serve an object-storage `checkpoint.uri`. `imageCarriesData: true` says
    the image holds its data, so a gang may be rendered without a dataset version.
    """

    remote: str | None = None
    credentials_secret: str | None = None
    endpoint_url: str | None = None
    image_carries_data: bool = False

    def __post_init__(self):
        if self.remote is not None:
            if not isinstance(self.remote, str) or not _URI.fullmatch(self.remote) or self.remote.startswith("file:"):
                _fail("dataset.remote", redact_url(self.remote), "must be the DVC remote as an fsspec URL such as s3://bucket/dvc or gs://bucket/dvc (never a path on the Airflow worker)")
            if has_credentials(self.remote):
                _fail("dataset.remote", redact_url(self.remote), "must not carry credentials; put them in dataset.credentialsSecret")
        _check_name("dataset.credentialsSecret", self.credentials_secret, _DNS_SUBDOMAIN,
                    "must be a Secret name (DNS-1123 subdomain) whose keys are AWS_* variables", optional=True)
        if self.endpoint_url is not None and not (isinstance(self.endpoint_url, str) and _ENDPOINT_URL.fullmatch(self.endpoint_url)):
            _fail("dataset.endpointUrl", redact_url(self.endpoint_url), "must be an http(s) URL without credentials, such as https://minio.storage:9000")
        if not isinstance(self.image_carries_data, bool):
            _fail("dataset.imageCarriesData", self.image_carries_data, "must be true or false")


# camelCase key in runtime.yaml -> (field name, nested type or None)
_KEYS: dict[str, tuple[str, Any]] = {
    "image": ("image", None),
    "namespace": ("namespace", None),
    "serviceAccountName": ("service_account_name", None),
    "scheduler": ("scheduler", None),
    "api": ("api", None),
    "queue": ("queue", None),
    "priorityClassName": ("priority_class_name", None),
    "workloadPriorityClass": ("workload_priority_class", None),
    "topology": ("topology", Topology),
    "exclusivePlacement": ("exclusive_placement", ExclusivePlacement),
    "resources": ("resources", Resources),
    "shmSize": ("shm_size", None),
    "ncclEnv": ("nccl_env", None),
    "checkpoint": ("checkpoint", Checkpoint),
    "nodeSelector": ("node_selector", None),
    "tolerations": ("tolerations", None),
    "terminationGracePeriodSeconds": ("termination_grace_period_seconds", None),
    "mlflowTrackingUri": ("mlflow_tracking_uri", None),
    "mlflowSecretRef": ("mlflow_secret_ref", SecretRef),
    "dataset": ("dataset", Dataset),
    "procsPerPod": ("procs_per_pod", None),
    "rendezvousPort": ("rendezvous_port", None),
    "metricsPort": ("metrics_port", None),
    "admissionTimeoutSeconds": ("admission_timeout_seconds", None),
    "startupTimeoutSeconds": ("startup_timeout_seconds", None),
    # gangflow additions beyond the chart's first cut (documented in docs/kubernetes.md)
    "trainingRuntime": ("training_runtime", None),
    "runAsUser": ("run_as_user", None),
    "runAsGroup": ("run_as_group", None),
    "fsGroup": ("fs_group", None),
}
_NESTED_KEYS = {
    Topology: {"level": "level", "mode": "mode"},
    ExclusivePlacement: {"topologyKey": "topology_key"},
    Resources: {"cpu": "cpu", "memory": "memory", "gpu": "gpu"},
    Checkpoint: {"pvc": "pvc", "mountPath": "mount_path", "uri": "uri"},
    SecretRef: {"name": "name", "key": "key"},
    Dataset: {"remote": "remote", "credentialsSecret": "credentials_secret", "endpointUrl": "endpoint_url", "imageCarriesData": "image_carries_data"},
}


@dataclass(frozen=True)
class RuntimeDefaults:
    """Everything about the cluster the backend needs; one field per `runtime.yaml` key."""

    image: str
    checkpoint: Checkpoint
    namespace: str | None = None
    service_account_name: str = "default"
    scheduler: str = "kueue"
    api: str = "jobset"
    queue: str = "gangflow"
    priority_class_name: str | None = None
    workload_priority_class: str | None = None
    topology: Topology | None = None
    exclusive_placement: ExclusivePlacement | None = None
    resources: Resources = field(default_factory=Resources)
    shm_size: str = "2Gi"
    procs_per_pod: int | None = None  # CPU pods only; with GPUs it is resources.gpu
    # NCCL's warnings reach the pod log, where the failure classifier reads them
    nccl_env: Mapping[str, str] = field(default_factory=lambda: {"NCCL_DEBUG": "WARN"})
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    termination_grace_period_seconds: int = 120
    mlflow_tracking_uri: str | None = None
    mlflow_secret_ref: SecretRef | None = None
    dataset: Dataset = field(default_factory=Dataset)
    rendezvous_port: int = 29500
    # rank 0 serves Prometheus metrics here (GANGFLOW_METRICS_PORT; 0: off); the chart's scrape
    # configuration finds the pods by their gangflow.io/metrics-port annotation
    metrics_port: int = 9400
    admission_timeout_seconds: int = 3600
    startup_timeout_seconds: int = 900
    training_runtime: str = "torch-distributed"
    run_as_user: int = 10001  # the user of docker/training.Dockerfile
    run_as_group: int = 10001
    fs_group: int = 10001

    def __post_init__(self):
        if not isinstance(self.image, str) or not _DIGEST_IMAGE.fullmatch(self.image):
            _fail(
                "image",
                self.image,
                "must be pinned by digest (repo@sha256:<64 hex digits>); tags such as ':latest' or ':v1' are refused "
                "because a retry must run exactly the bytes the first try ran",
            )
        _check_name("namespace", self.namespace, _DNS_LABEL, "must be a namespace name (DNS-1123 label)", optional=True)
        _check_name("serviceAccountName", self.service_account_name, _DNS_SUBDOMAIN,
                    "must be a ServiceAccount name (DNS-1123 subdomain)")
        _check_choice("scheduler", self.scheduler, SCHEDULERS)
        _check_choice("api", self.api, APIS)
        # the queue and the workload priority class are label values (kueue.x-k8s.io/queue-name, .../priority-class)
        _check_name("queue", self.queue, _DNS_SUBDOMAIN, "must be a Kueue LocalQueue or Volcano queue name (DNS-1123 "
                    "subdomain of at most 63 characters: it is the value of the label kueue.x-k8s.io/queue-name)",
                    label_value=True)
        _check_name("priorityClassName", self.priority_class_name, _DNS_SUBDOMAIN,
                    "must be a class name (DNS-1123 subdomain) or unset", optional=True)
        _check_name("workloadPriorityClass", self.workload_priority_class, _DNS_SUBDOMAIN, "must be a "
                    "WorkloadPriorityClass name (DNS-1123 subdomain of at most 63 characters: it is the value of the "
                    "label kueue.x-k8s.io/priority-class) or unset", optional=True, label_value=True)
        if self.api == "trainjob" and self.scheduler != "kueue":
            _fail(
                "api",
                self.api,
                "api=trainjob needs scheduler=kueue (a TrainJob's gang scheduling under Volcano is set by the "
                "ClusterTrainingRuntime's podGroupPolicy, not by gangflow); with scheduler=volcano the accepted api "
                "is jobset, which submits a Volcano Job",
            )
        if self.api in ("rayjob", "mpijob") and self.scheduler != "kueue":
            kind = "RayJob" if self.api == "rayjob" else "MPIJob"
            _fail(
                "api",
                self.api,
                f"api={self.api} with scheduler={self.scheduler} cannot run: gangflow renders a {kind} for Kueue only "
                f"(Kueue admits it whole through its {kind} integration); with scheduler={self.scheduler} the accepted "
                "api is jobset, which submits a Volcano Job",
            )
        if self.api == "rayjob" and self.resources.gpu:
            _fail(
                "api",
                self.api,
                f"api=rayjob with resources.gpu={self.resources.gpu} cannot run: the Ray driver (operators.backends.ray) "
                "runs Ray Train's workers on CPU (use_gpu=False), so the GPUs would be held and unused; use "
                "api=jobset or api=trainjob for GPU gangs, or resources.gpu=0 with procsPerPod",
            )
        if self.api == "rayjob" and self.checkpoint.uri:
            _fail(
                "api",
                self.api,
                f"api=rayjob with checkpoint.uri={redact_url(self.checkpoint.uri)!r} cannot run: the Ray driver keeps "
                "Ray Train's storage under the run dir as a file path, which every Ray node must mount; set "
                "checkpoint.pvc (a ReadWriteMany claim) instead",
            )
        if self.exclusive_placement is not None and self.api != "jobset":
            _fail("exclusivePlacement", dataclasses.asdict(self.exclusive_placement),
                  f"is a JobSet feature: needs api=jobset, not api={self.api}")
        if self.exclusive_placement is not None and self.scheduler == "volcano":
            _fail("exclusivePlacement", dataclasses.asdict(self.exclusive_placement), "is applied by JobSet's webhook with scheduler=kueue; with Volcano use topology instead")
        parse_quantity("shmSize", self.shm_size)
        object.__setattr__(self, "shm_size", str(self.shm_size))
        for mapping_key, mapping, value_check in (("ncclEnv", self.nccl_env, "env"), ("nodeSelector", self.node_selector, "label")):
            if not isinstance(mapping, Mapping):
                _fail(mapping_key, mapping, "must be a mapping of NAME: value")
            for name, value in mapping.items():
                if value_check == "env" and not (isinstance(name, str) and _ENV_NAME.fullmatch(name)):
                    _fail(f"{mapping_key}.{name}", value, "names must be environment variable names ([A-Za-z_][A-Za-z0-9_]*)")
                if value_check == "env" and name not in NCCL_ENV:
                    _fail(
                        f"{mapping_key}.{name}",
                        value,
                        f"ncclEnv takes collective-library settings only: one of {', '.join(sorted(NCCL_ENV))} "
                        "(settings that load a plugin or name a file, such as NCCL_NET_PLUGIN or NCCL_DEBUG_FILE, are refused)",
                    )
                if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                    _fail(f"{mapping_key}.{name}", value, "values must be strings (quote numbers and booleans)")
                if value_check == "env" and not re.fullmatch(NCCL_ENV[name], str(value)):
                    _fail(f"{mapping_key}.{name}", value, f"accepted values match {NCCL_ENV[name]}")
                if value_check == "label" and not is_qualified_name(name):
                    _fail(f"{mapping_key}.{name}", value, f"keys must be {QUALIFIED_NAME_RULE}")
                if value_check == "label" and not is_label_value(str(value)):
                    _fail(f"{mapping_key}.{name}", value, f"values must be {LABEL_VALUE_RULE}")
            object.__setattr__(self, _KEYS[mapping_key][0], {str(k): str(v) for k, v in mapping.items()})
        if isinstance(self.tolerations, Mapping) or not isinstance(self.tolerations, (list, tuple)):
            _fail("tolerations", self.tolerations, "must be a list of Kubernetes tolerations")
        allowed_toleration = {"key", "operator", "value", "effect", "tolerationSeconds"}
        for item in self.tolerations:
            if not isinstance(item, Mapping) or set(item) - allowed_toleration:
                _fail("tolerations", item, f"each toleration is a mapping with keys among {', '.join(sorted(allowed_toleration))}")
            # apimachinery's ValidateTolerations: what the API server would refuse
            operator = item.get("operator") or "Equal"
            if operator not in ("Equal", "Exists"):
                _fail("tolerations[].operator", item.get("operator"), "accepted values: Equal, Exists")
            key = item.get("key")
            if key not in (None, "") and not is_qualified_name(key):
                _fail("tolerations[].key", key, f"must be empty or {QUALIFIED_NAME_RULE}")
            if key in (None, "") and operator != "Exists":
                _fail("tolerations[].operator", item.get("operator"), "must be Exists when the key is empty (tolerate every taint)")
            if operator == "Exists" and item.get("value") not in (None, ""):
                _fail("tolerations[].value", item.get("value"), "must be empty with operator Exists")
            if operator == "Equal" and not is_label_value("" if item.get("value") is None else item.get("value")):
                _fail("tolerations[].value", item.get("value"), f"with operator Equal must be {LABEL_VALUE_RULE}")
            if item.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
                _fail("tolerations[].effect", item.get("effect"), "accepted values: NoSchedule, PreferNoSchedule, NoExecute")
            seconds = item.get("tolerationSeconds")
            if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int) or item.get("effect") != "NoExecute"):
                _fail("tolerations[].tolerationSeconds", seconds, "must be an integer, with effect NoExecute")
        object.__setattr__(self, "tolerations", tuple(dict(t) for t in self.tolerations))
        _check_int("terminationGracePeriodSeconds", self.termination_grace_period_seconds, 30, 24 * 3600)
        if self.mlflow_tracking_uri is not None:
            uri = self.mlflow_tracking_uri
            if not (isinstance(uri, str) and re.match(r"^https?://[^\s/]+", uri)):
                _fail("mlflowTrackingUri", redact_url(uri), "must be the tracking server's http(s) URL such as http://mlflow.mlflow:5000 (pods log weights through its artifact proxy), or unset")
            if has_credentials(uri):
                _fail(
                    "mlflowTrackingUri",
                    redact_url(uri),
                    "must not carry credentials (they would be a plain value in every pod spec); "
                    "put the token in a Secret and name it in mlflowSecretRef",
                )
        if self.procs_per_pod is not None:
            _check_int("procsPerPod", self.procs_per_pod, 1, 256)
            if self.resources.gpu and self.procs_per_pod != self.resources.gpu:
                _fail("procsPerPod", self.procs_per_pod, f"with resources.gpu={self.resources.gpu} the pod runs one process per GPU; leave procsPerPod unset (it is for CPU pods)")
        _check_int("rendezvousPort", self.rendezvous_port, 1024, 65535)
        if self.metrics_port != 0:
            _check_int("metricsPort", self.metrics_port, 1024, 65535)
            if self.metrics_port == self.rendezvous_port:
                _fail("metricsPort", self.metrics_port, "must differ from rendezvousPort (or be 0: no metrics)")
        _check_int("admissionTimeoutSeconds", self.admission_timeout_seconds, 1)
        _check_int("startupTimeoutSeconds", self.startup_timeout_seconds, 1)
        _check_name("trainingRuntime", self.training_runtime, _DNS_SUBDOMAIN,
                    "must be a ClusterTrainingRuntime name (DNS-1123 subdomain)")
        for key, value in (("runAsUser", self.run_as_user), ("runAsGroup", self.run_as_group), ("fsGroup", self.fs_group)):
            _check_int(key, value, 1, 2**31 - 1)

    @property
    def processes_per_pod(self) -> int:
        """torchrun's --nproc-per-node: one process per GPU, else procsPerPod (default 1)."""
        return self.resources.gpu or self.procs_per_pod or 1

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RuntimeDefaults:
        """Build from `runtime.yaml`'s camelCase mapping (unknown keys are errors)."""
        if not isinstance(data, Mapping):
            raise RuntimeConfigError(f"runtime defaults must be a mapping of keys, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise RuntimeConfigError(f"unknown runtime key(s) {', '.join(unknown)}; accepted keys: {', '.join(_KEYS)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            name, nested = _KEYS[key]
            if value is None:
                continue
            if nested is not None:
                if not isinstance(value, Mapping):
                    raise RuntimeConfigError(f"runtime {key}={value!r}: must be a mapping with keys {', '.join(_NESTED_KEYS[nested])}")
                sub_unknown = sorted(set(value) - set(_NESTED_KEYS[nested]))
                if sub_unknown:
                    raise RuntimeConfigError(
                        f"unknown runtime key(s) {', '.join(f'{key}.{k}' for k in sub_unknown)}; "
                        f"accepted: {', '.join(f'{key}.{k}' for k in _NESTED_KEYS[nested])}"
                    )
                value = nested(**{_NESTED_KEYS[nested][k]: v for k, v in value.items() if v is not None})
            kwargs[name] = value
        if "image" not in kwargs:
            raise RuntimeConfigError("runtime image is required: the trainer image pinned by digest (repo@sha256:...)")
        if "checkpoint" not in kwargs:
            raise RuntimeConfigError("runtime checkpoint is required: set checkpoint.pvc or checkpoint.uri")
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, text: str) -> RuntimeDefaults:
        return cls.from_mapping(yaml.safe_load(text) or {})

    def to_mapping(self) -> dict[str, Any]:
        """The camelCase mapping `from_mapping` reads (round-trips)."""
        out: dict[str, Any] = {}
        for key, (name, nested) in _KEYS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if nested is not None:
                value = {k: getattr(value, attr) for k, attr in _NESTED_KEYS[nested].items() if getattr(value, attr) is not None}
            elif isinstance(value, tuple):
                value = [dict(v) for v in value]
            elif isinstance(value, Mapping):
                value = dict(value)
            out[key] = value
        return out


def merge_runtime(base: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Deep-merge per-task overrides onto the ConfigMap's mapping (mappings merge, the rest replaces;
    an override of None removes the key)."""
    out = copy.deepcopy(dict(base or {}))
    for key, value in (overrides or {}).items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping) and key not in ("ncclEnv", "nodeSelector"):
            out[key] = merge_runtime(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def default_runtime_mapping() -> dict[str, Any]:
    """The camelCase defaults of every optional key (the dataclass defaults above): the one source
    the chart's `training` values are checked against (tests/unit/helm/test_runtime_defaults_sync.py)."""
    out: dict[str, Any] = {}
    for key, (name, nested) in _KEYS.items():
        f = RuntimeDefaults.__dataclass_fields__[name]
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            continue  # required: image, checkpoint
        if value is None:
            continue
        if nested is not None:
            value = {k: getattr(value, attr) for k, attr in _NESTED_KEYS[nested].items() if getattr(value, attr) is not None}
        elif isinstance(value, (Mapping, tuple)):
            value = copy.deepcopy(dict(value) if isinstance(value, Mapping) else list(value))
        out[key] = value
    return out


def example_runtime_mapping() -> dict[str, Any]:
    """Built-in example for `render` without a runtime file: the defaults plus an example digest,
    a one-GPU pod, a checkpoint PVC, the chart's MLflow Service and an S3 DVC remote."""
    return merge_runtime(
        default_runtime_mapping(),
        {
            "image": EXAMPLE_IMAGE,
            "namespace": "gangflow",
            "serviceAccountName": "gangflow-training",
            "resources": {"cpu": "4", "memory": "16Gi", "gpu": 1},
            "ncclEnv": {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "eth0"},
            "checkpoint": {"pvc": "gangflow-checkpoints", "mountPath": "/checkpoints"},
            "mlflowTrackingUri": "http://mlflow.gangflow.svc:5000",
            "dataset": {"remote": "s3://gangflow-data/dvc", "credentialsSecret": "gangflow-object-storage"},
        },
    )
