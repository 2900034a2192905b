"""Build the objects the Kubernetes backend submits for one gang, from a `GangSpec` and the
`RuntimeDefaults`: a JobSet, a Kubeflow TrainJob, a KubeRay RayJob or a Kubeflow MPIJob (Kueue),
or a Volcano Job.

Every pod runs one hardened template with `torchrun ... -m trainer ...` as argv; pods = world size /
processes per pod. Only what a pod can use reaches it (contract 6, docs/contracts.md): anything
that names a path on the Airflow worker is refused (`WorkerPathError`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s

from operators.backends.base import GangSpec
from operators.exceptions import UnsupportedCombination
from operators.kubernetes import models as m
from operators.kubernetes.runtime import API_LAUNCHERS, APP_DIR, RuntimeDefaults
from trainer.urls import redact_url
from trainer import EXIT_CONFIG_ERROR, EXIT_USER_ERROR
from trainer.checkpoint_interval import HISTORY_ENV

# Labels every training pod carries; the Helm chart's NetworkPolicy selects on COMPONENT_LABEL.
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
GANG_LABEL = "gangflow.io/gang"
ATTEMPT_LABEL = "gangflow.io/attempt"
DATASET_VERSION_LABEL = "gangflow.io/dataset-version"
DATASET_REMOTE_ANNOTATION = "gangflow.io/dataset-remote"
MLFLOW_RUN_ANNOTATION = "gangflow.io/mlflow-run-id"
PROCS_ANNOTATION = "gangflow.io/processes-per-pod"
WORLD_SIZE_ANNOTATION = "gangflow.io/world-size"

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUEUE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
JOBSET_EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"

CONTAINER = "trainer"  # container name for JobSet / Volcano pods
RANK_JOB = "rank"  # JobSet replicated job / Volcano task name
TRAINJOB_NODE = "node"  # replicated job and container name of Kubeflow's torch runtimes
RAY_WORKER_GROUP = "rank"  # the RayJob's one worker group
MPI_LAUNCHER_SUFFIX = "-launcher"
# The Ray job submitter's and the MPI launcher's pod: neither runs a rank (requests = limits).
CONTROL_POD_RESOURCES = {"cpu": "1", "memory": "1Gi"}
# Where mpi-operator mounts the job's SSH key pair: the home of the image's non-root user (HOME=/tmp,
# the writable emptyDir), not the default /root/.ssh.
MPI_SSH_AUTH_PATH = "/tmp/.ssh"
MPI_HOSTFILE = "/etc/mpi/hostfile"  # where mpi-operator mounts the launcher's hostfile (its ConfigMap <job>-config)
# APP_DIR (runtime.py, /app): the image's working directory; relative config paths resolve against it
TERMINATION_LOG = "/dev/termination-log"
PATCH_MANAGER = "gangflow.io/kubernetes-backend"
# set on a gang object by `python -m operators.cli.gang pause` (its value: when and why), removed by
# `resume`: the watch then waits without a timeout instead of judging the eviction a preemption
PAUSED_ANNOTATION = "gangflow.io/paused"
PAUSES_ANNOTATION = "gangflow.io/pauses"  # how many times the gang was paused: counted even when no poll saw one


def pause_count(annotations: Mapping[str, Any]) -> int:
    """The gang's `gangflow.io/pauses` (0 when absent or not a count)."""
    count = str(annotations.get(PAUSES_ANNOTATION) or "0")
    return int(count) if count.isdigit() else 0

# Trainer exit codes (contract) that fail the Job at once: a user exception, a config error.
USER_EXIT_CODES = (EXIT_USER_ERROR, EXIT_CONFIG_ERROR)

# The spec's env that reaches a pod. Everything else is the worker's business: MLFLOW_TRACKING_URI
# (the runtime's wins; the worker's may be a sqlite path or carry credentials), GANGFLOW_FAULT /
# GANGFLOW_ALLOW_FAULTS (fault injection is for drills, never a real cluster), paths.
FORWARDED_ENV = ("GANGFLOW_DAG_ID", "GANGFLOW_DAG_RUN_ID", "GANGFLOW_TRY_NUMBER", "GANGFLOW_TRY_STARTED_AT", "MLFLOW_RUN_ID",
                 "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "GANGFLOW_PIPELINE", "GANGFLOW_LOG_FORMAT",
                 HISTORY_ENV)  # checkpoint.every_steps: auto
# Where rank 0 serves Prometheus metrics: the chart's scrape configuration keeps pods with it.
METRICS_PORT_ANNOTATION = "gangflow.io/metrics-port"
# Overrides that name the worker's copy of the data: dropped when the rank fetches a version.
WORKER_DATA_KEYS = ("data.train_path", "data.test_path")
OBJECT_STORE_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
DATA_VERSION_KEY = "data.version"
DATA_REMOTE_KEY = "data.remote"
_MD5 = __import__("re").compile(r"^[0-9a-f]{32}(\.dir)?$")


class WorkerPathError(ValueError):
    """A gang would hand a pod a path that exists only on the Airflow worker."""


class DatasetRequiredError(ValueError):
    """A gang has no dataset version to fetch (and the image does not carry its data)."""


class GangSizeError(ValueError):
    """world_size does not split into whole pods."""


def processes_per_pod(runtime: RuntimeDefaults) -> int:
    return runtime.processes_per_pod


def pod_count(spec: GangSpec, runtime: RuntimeDefaults) -> int:
    """Pods of the gang: world_size / processes per pod (refused when it does not divide)."""
    procs = runtime.processes_per_pod
    if spec.world_size % procs:
        source = f"resources.gpu={runtime.resources.gpu} (one process per GPU)" if runtime.resources.gpu else f"procsPerPod={procs}"
        raise GangSizeError(
            f"world_size={spec.world_size} is not a multiple of the processes per pod, {procs} from runtime {source}: "
            f"use a world_size of {procs}, {2 * procs}, {3 * procs}, ... (world size = pods x processes per pod)"
        )
    return spec.world_size // procs


@dataclass(frozen=True)
class GangPlan:
    """What `submit` creates for one gang, plus how to find its pods again."""

    kind: str  # JobSet | VolcanoJob | TrainJob | RayJob | MPIJob
    group: str
    version: str
    plural: str
    name: str
    namespace: str
    body: dict[str, Any]
    pod_selector: str
    rank0_host: str | None
    run_dir: str
    gang: str
    attempt: int
    world_size: int  # training processes (ranks)
    scheduler: str
    api: str
    pods: int = 0  # world_size / processes_per_pod
    processes_per_pod: int = 1
    max_queue_wait_s: int | None = None  # GangSpec's: bounds the wait for admission instead of the runtime's

    def objects(self) -> list[dict[str, Any]]:
        """Every object the backend submits for this gang, in creation order."""
        return [self.body]


def _name_budget(kind: str, world_size: int) -> int:
    """Longest object name whose generated pod names stay DNS-1035 labels (<= 63 chars)."""
    digits = len(str(max(world_size - 1, 0)))
    if kind == "VolcanoJob":  # pods: <job>-rank-<index>
        return 63 - len(f"-{RANK_JOB}-") - digits
    if kind == "RayJob":  # KubeRay refuses longer RayJob names (utils.MaxRayJobNameLength: its RayCluster adds 6)
        return 47
    if kind == "MPIJob":  # pod hostnames <job>-launcher and <job>-worker-<index>
        return 63 - max(len(MPI_LAUNCHER_SUFFIX), len("-worker-") + digits)
    rjob = TRAINJOB_NODE if kind == "TrainJob" else RANK_JOB
    # JobSet's webhook checks <jobset>-<rjob>-<jobIndex>-<podIndex>-<5 random chars> <= 63
    return 63 - len(f"-{rjob}-0-") - digits - len("-abcde")


def gang_object_name(gang: str, attempt: int, kind: str = "JobSet", world_size: int = 1) -> str:
    """Deterministic object name for one Airflow try of a gang: `<gang>-t<attempt>`, shortened
    when the generated pod names would exceed 63 characters: the readable stem is cut, never the
    64 bits that tell runs apart (16 hex digits of the gang name's hash)."""
    if attempt < 1:
        raise ValueError(f"attempt={attempt!r}: must be >= 1")
    base = gang if gang[:1].isalpha() else f"g{gang}"
    suffix = f"-t{attempt}"
    budget = _name_budget(kind, world_size)
    if len(base) + len(suffix) <= budget:
        return base + suffix
    digest = hashlib.sha256(gang.encode()).hexdigest()[:16]
    keep = max(budget - len(suffix) - len(digest) - 1, 1)
    return f"{base[:keep].rstrip('-') or 'g'}-{digest}{suffix}"


def _pod_paths(runtime: RuntimeDefaults) -> tuple[str, ...]:
    """Absolute paths a pod can read input from: the image's /app and the checkpoint mount. Not
    /tmp or /dev/shm: they start empty in a pod, so a value there names the worker's own /tmp."""
    return (APP_DIR, runtime.checkpoint.mount_path)


def _inside_pod(path: str, runtime: RuntimeDefaults) -> bool:
    norm = posixpath.normpath(path)
    return any(norm == root or norm.startswith(root.rstrip("/") + "/") for root in _pod_paths(runtime))


def _config_path(spec: GangSpec, runtime: RuntimeDefaults) -> str:
    """The config inside the image: a relative path resolves against /app; the worker's own
    params.yaml (an absolute path outside the pod) becomes the image's /app/params.yaml, which the
    image build copies from the same repository; any other worker path is refused."""
    path = spec.config_path
    if not path.startswith("/"):
        return posixpath.join(APP_DIR, path)
    if posixpath.normpath(path).startswith(APP_DIR + "/"):
        return path
    if posixpath.basename(path) == "params.yaml":
        return posixpath.join(APP_DIR, "params.yaml")
    raise WorkerPathError(
        f"config_path={path!r} is a file on the Airflow worker, which no pod can read: pass changes as "
        f"overrides, or build the file into the image and name it relative to {APP_DIR}"
    )


def dataset_version(spec: GangSpec) -> str | None:
    """The pinned dataset version of the gang: `GangSpec.dataset_version`, else a `data.version` override."""
    version = getattr(spec, "dataset_version", None)
    from_override = next((item.split("=", 1)[1] for item in spec.overrides if item.split("=", 1)[0] == DATA_VERSION_KEY), None)
    if version and from_override and str(version) != from_override:
        raise ValueError(f"dataset_version={version!r} and override {DATA_VERSION_KEY}={from_override!r} disagree")
    return str(version) if version else from_override


def pod_overrides(spec: GangSpec, runtime: RuntimeDefaults) -> list[str]:
    """The trainer's `--set` items as a pod gets them: `data.remote`/`data.version` when the gang
    fetches a pinned version, the worker's data paths dropped, no other worker path."""
    version = dataset_version(spec)
    if version is None and not runtime.dataset.image_carries_data:
        raise DatasetRequiredError(
            f"gang {spec.name}: no dataset version; a gang with no dataset cannot train. Pass the pinned version "
            "(render --dataset-version MD5; the operator passes the validated one), or set runtime "
            "dataset.imageCarriesData: true when the image holds its data"
        )
    if version is not None and not _MD5.fullmatch(version):
        raise ValueError(f"dataset version {version!r}: must be the DVC md5 of the dataset (32 hex digits, optionally '.dir')")
    if version is not None and not runtime.dataset.remote:
        raise DatasetRequiredError(
            f"gang {spec.name}: dataset version {version} but runtime dataset.remote is unset: set it to the DVC "
            "remote the ranks fetch from (e.g. s3://bucket/dvc), with dataset.credentialsSecret for its keys"
        )
    out: list[str] = []
    for item in spec.overrides:
        key, _, value = item.partition("=")
        if key in (DATA_VERSION_KEY, DATA_REMOTE_KEY):
            continue  # set below, once
        if version is not None and key in WORKER_DATA_KEYS:
            continue  # the rank fetches the version itself
        if value.startswith("/") and not _inside_pod(value, runtime):
            raise WorkerPathError(
                f"override {key}={value!r} is a path on the Airflow worker, which no pod can read"
                + (f"; the rank fetches dataset version {version} from {runtime.dataset.remote}" if version else "")
            )
        out.append(item)
    if version is not None:
        out += [f"{DATA_REMOTE_KEY}={runtime.dataset.remote}", f"{DATA_VERSION_KEY}={version}"]
    return out


def trainer_args(spec: GangSpec, runtime: RuntimeDefaults) -> list[str]:
    """`-m trainer ...` arguments inside the container: the run dir lives on the shared checkpoint
    storage, keyed by the gang name (stable across tries, so a retry resumes)."""
    return ["-m", spec.entry_module, *_in_cluster(spec, runtime).trainer_args(), *spec.user_code]


def _in_cluster(spec: GangSpec, runtime: RuntimeDefaults) -> GangSpec:
    return dataclasses.replace(spec, run_dir=runtime.checkpoint.run_dir(spec.name), config_path=_config_path(spec, runtime),
                               overrides=tuple(pod_overrides(spec, runtime)))


def torchrun_args(spec: GangSpec, runtime: RuntimeDefaults, *, name: str, rank0_host: str, node_rank_env: str) -> list[str]:
    """Multi-node torchrun flags; Kubernetes expands `$(VAR)` in args from the container env
    (JOB_COMPLETION_INDEX is injected by the Job controller, VC_TASK_INDEX by Volcano's env plugin).
    `--nnodes` counts pods, `--nproc-per-node` processes in each: world size is their product."""
    return [
        f"--nnodes={pod_count(spec, runtime)}",
        f"--nproc-per-node={runtime.processes_per_pod}",
        f"--node-rank=$({node_rank_env})",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rank0_host}:{runtime.rendezvous_port}",
        f"--rdzv-id={name}",
        f"--rdzv-conf=join_timeout={runtime.startup_timeout_seconds}",
        "--max-restarts=0",
        *trainer_args(spec, runtime),
    ]


def pod_labels(spec: GangSpec) -> dict[str, str]:
    labels = {
        NAME_LABEL: "gangflow",
        COMPONENT_LABEL: "training",
        GANG_LABEL: spec.name,
        ATTEMPT_LABEL: str(spec.attempt),
    }
    version = dataset_version(spec)
    if version:
        labels[DATASET_VERSION_LABEL] = version  # select a version's gangs: -l gangflow.io/dataset-version=<md5>
    return labels


def pod_selector(spec: GangSpec) -> str:
    return f"{GANG_LABEL}={spec.name},{ATTEMPT_LABEL}={spec.attempt}"


def forwarded_env(spec: GangSpec, runtime: RuntimeDefaults) -> dict[str, str]:
    """The part of the spec's env a pod gets (FORWARDED_ENV): identities and settings, never paths, so
    a value starting with `/` (a run id a deployment's `allowed_run_id_pattern` lets through) is kept."""
    return {name: str(spec.env[name]) for name in FORWARDED_ENV if name in spec.env}


def _env(spec: GangSpec, runtime: RuntimeDefaults) -> list[k8s.V1EnvVar]:
    values: dict[str, str] = {
        "PYTHONUNBUFFERED": "1",
        "HOME": "/tmp",  # read-only root filesystem: caches go to the writable /tmp
        "TMPDIR": "/tmp",
        "GANGFLOW_GANG": spec.name,
        "GANGFLOW_ATTEMPT": str(spec.attempt),
    }
    if spec.package_roots:  # the user's packages, in the image below /app (docs/kubernetes.md, "Your own code")
        values["PYTHONPATH"] = ":".join(f"{APP_DIR}/{root}" for root in spec.package_roots)
    values.update(sorted(runtime.nccl_env.items()))
    values.update(forwarded_env(spec, runtime))
    if runtime.mlflow_tracking_uri:  # the runtime's URI, never the worker's (which the spec may carry)
        values["MLFLOW_TRACKING_URI"] = runtime.mlflow_tracking_uri
    if runtime.dataset.endpoint_url:  # fsspec/s3fs, boto3 and DVC read the standard variable
        values["AWS_ENDPOINT_URL"] = runtime.dataset.endpoint_url
    if runtime.metrics_port:  # rank 0 serves its metrics (trainer.prometheus)
        values["GANGFLOW_METRICS_PORT"] = str(runtime.metrics_port)
    values["GANGFLOW_TERMINATION_LOG"] = TERMINATION_LOG  # the trainer's error record -> terminationMessagePath
    env = [k8s.V1EnvVar(name=k, value=v) for k, v in values.items()]
    if runtime.dataset.credentials_secret:
        # object-storage keys for the DVC remote and an object-storage checkpoint.uri; by Secret
        # reference (a TrainJob has no envFrom), never as values in the spec
        for key in OBJECT_STORE_SECRET_KEYS:
            env.append(
                k8s.V1EnvVar(
                    name=key,
                    value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=runtime.dataset.credentials_secret, key=key)),
                )
            )
    if runtime.mlflow_secret_ref:
        env.append(
            k8s.V1EnvVar(
                name="MLFLOW_TRACKING_TOKEN",
                value_from=k8s.V1EnvVarSource(
                    secret_key_ref=k8s.V1SecretKeySelector(name=runtime.mlflow_secret_ref.name, key=runtime.mlflow_secret_ref.key)
                ),
            )
        )
    return env


def _resources(runtime: RuntimeDefaults) -> k8s.V1ResourceRequirements:
    per_rank = runtime.resources.as_resource_list()
    return k8s.V1ResourceRequirements(requests=dict(per_rank), limits=dict(per_rank))


def container_security_context() -> k8s.V1SecurityContext:
    return k8s.V1SecurityContext(
        run_as_non_root=True,
        allow_privilege_escalation=False,
        privileged=False,
        read_only_root_filesystem=True,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def pod_security_context(runtime: RuntimeDefaults) -> k8s.V1PodSecurityContext:
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=runtime.run_as_user,
        run_as_group=runtime.run_as_group,
        fs_group=runtime.fs_group,
        fs_group_change_policy="OnRootMismatch",
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def _volumes(runtime: RuntimeDefaults) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    volumes = [
        # NCCL and the data loader's workers share memory through /dev/shm; the container
        # runtime's default (64Mi) is far too small. Memory-backed: counts against the memory limit.
        k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=runtime.shm_size)),
        k8s.V1Volume(name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource()),
    ]
    mounts = [
        k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
        k8s.V1VolumeMount(name="tmp", mount_path="/tmp"),
    ]
    if runtime.checkpoint.pvc:
        volumes.append(
            k8s.V1Volume(
                name="checkpoints",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=runtime.checkpoint.pvc),
            )
        )
        mounts.append(k8s.V1VolumeMount(name="checkpoints", mount_path=runtime.checkpoint.mount_path))
    return volumes, mounts


def _tolerations(runtime: RuntimeDefaults) -> list[k8s.V1Toleration]:
    return [
        k8s.V1Toleration(
            key=t.get("key"),
            operator=t.get("operator"),
            value=t.get("value"),
            effect=t.get("effect"),
            toleration_seconds=t.get("tolerationSeconds"),
        )
        for t in runtime.tolerations
    ]


def _pod_annotations(runtime: RuntimeDefaults) -> dict[str, str]:
    out = {}
    if runtime.metrics_port:  # only rank 0's process serves it: other pods' scrapes fail, which says nothing
        out[METRICS_PORT_ANNOTATION] = str(runtime.metrics_port)
    if runtime.scheduler != "kueue" or runtime.topology is None:
        return out
    key = KUEUE_REQUIRED_TOPOLOGY if runtime.topology.mode == "required" else KUEUE_PREFERRED_TOPOLOGY
    return {**out, key: runtime.topology.level}


def _affinity(spec: GangSpec, runtime: RuntimeDefaults) -> k8s.V1Affinity | None:
    """Off the nodes an earlier try's verdict named suspect (`spec.avoid_nodes`) and, on the
    Volcano path, the ranks in one topology domain (plain pod affinity)."""
    node_affinity = None
    if spec.avoid_nodes:
        away = k8s.V1NodeSelectorTerm(match_fields=[
            k8s.V1NodeSelectorRequirement(key="metadata.name", operator="NotIn", values=list(spec.avoid_nodes))])
        node_affinity = k8s.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(node_selector_terms=[away]))
    pod_affinity = None
    if runtime.scheduler == "volcano" and runtime.topology is not None:
        term = k8s.V1PodAffinityTerm(
            label_selector=k8s.V1LabelSelector(match_labels={GANG_LABEL: spec.name, ATTEMPT_LABEL: str(spec.attempt)}),
            topology_key=runtime.topology.level,
        )
        if runtime.topology.mode == "required":
            pod_affinity = k8s.V1PodAffinity(required_during_scheduling_ignored_during_execution=[term])
        else:
            pod_affinity = k8s.V1PodAffinity(preferred_during_scheduling_ignored_during_execution=[
                k8s.V1WeightedPodAffinityTerm(weight=100, pod_affinity_term=term)])
    if node_affinity is None and pod_affinity is None:
        return None
    return k8s.V1Affinity(node_affinity=node_affinity, pod_affinity=pod_affinity)


def build_container(spec: GangSpec, runtime: RuntimeDefaults, *, args: list[str] | None, name: str = CONTAINER,
                    command: list[str] | None = None, env: list[k8s.V1EnvVar] | None = None,
                    resources: Mapping[str, str] | None = None) -> k8s.V1Container:
    """The hardened container; `command` defaults to torchrun (None: the image's or the controller's)."""
    _, mounts = _volumes(runtime)
    return k8s.V1Container(
        name=name,
        image=runtime.image,
        image_pull_policy="IfNotPresent",
        command=["torchrun"] if command is None and args is not None else command,
        args=args,
        env=_env(spec, runtime) if env is None else env,
        resources=_resources(runtime) if resources is None else k8s.V1ResourceRequirements(requests=dict(resources), limits=dict(resources)),
        ports=[k8s.V1ContainerPort(name="c10d", container_port=runtime.rendezvous_port, protocol="TCP")]
        + ([k8s.V1ContainerPort(name="metrics", container_port=runtime.metrics_port, protocol="TCP")] if runtime.metrics_port else []),
        volume_mounts=mounts,
        security_context=container_security_context(),
        termination_message_path=TERMINATION_LOG,
        termination_message_policy="FallbackToLogsOnError",
    )


def build_pod_template(spec: GangSpec, runtime: RuntimeDefaults, *, args: list[str] | None,
                       container: k8s.V1Container | None = None) -> k8s.V1PodTemplateSpec:
    """The hardened pod every rank runs (JobSet and Volcano paths; RayJob and MPIJob pods pass
    their own `container`, built by build_container)."""
    volumes, _ = _volumes(runtime)
    annotations = _pod_annotations(runtime)
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=pod_labels(spec), annotations=annotations or None),
        spec=k8s.V1PodSpec(
            restart_policy="Never",  # the cluster never restarts a rank; Airflow owns the retry budget
            service_account_name=runtime.service_account_name,
            automount_service_account_token=False,  # training code needs no Kubernetes API access
            enable_service_links=False,
            security_context=pod_security_context(runtime),
            termination_grace_period_seconds=runtime.termination_grace_period_seconds,
            # the kubelet stops the ranks (SIGTERM: a final checkpoint) and marks the pod DeadlineExceeded
            active_deadline_seconds=spec.max_run_time_s,
            priority_class_name=runtime.priority_class_name,
            node_selector=dict(runtime.node_selector) or None,
            tolerations=_tolerations(runtime) or None,
            affinity=_affinity(spec, runtime),
            containers=[container or build_container(spec, runtime, args=args)],
            volumes=volumes,
        ),
    )


def gang_annotations(spec: GangSpec, runtime: RuntimeDefaults) -> dict[str, str]:
    """What the gang object says about itself: sizes, dataset, the MLflow run (lineage)."""
    out = {
        WORLD_SIZE_ANNOTATION: str(spec.world_size),
        PROCS_ANNOTATION: str(runtime.processes_per_pod),
    }
    version = dataset_version(spec)
    if version:
        out[DATASET_VERSION_LABEL] = version
        out[DATASET_REMOTE_ANNOTATION] = redact_url(runtime.dataset.remote or "")
    run_id = spec.env.get("MLFLOW_RUN_ID")
    if run_id:
        out[MLFLOW_RUN_ANNOTATION] = str(run_id)
    return out


def _object_meta(name: str, namespace: str, spec: GangSpec, runtime: RuntimeDefaults, *, annotations: dict[str, str] | None = None) -> k8s.V1ObjectMeta:
    labels = pod_labels(spec)
    annotations = {**gang_annotations(spec, runtime), **(annotations or {})}
    if runtime.scheduler == "kueue":
        labels[KUEUE_QUEUE_LABEL] = runtime.queue
        if runtime.workload_priority_class:
            labels[KUEUE_PRIORITY_LABEL] = runtime.workload_priority_class
    return k8s.V1ObjectMeta(name=name, namespace=namespace, labels=labels, annotations=annotations or None)


def build_jobset(spec: GangSpec, runtime: RuntimeDefaults, namespace: str) -> GangPlan:
    pods = pod_count(spec, runtime)
    name = gang_object_name(spec.name, spec.attempt, "JobSet", pods)
    rank0_host = f"{name}-{RANK_JOB}-0-0.{name}"  # JobSet headless Service (subdomain = JobSet name)
    args = torchrun_args(spec, runtime, name=name, rank0_host=rank0_host, node_rank_env="JOB_COMPLETION_INDEX")
    template = build_pod_template(spec, runtime, args=args)
    job_spec = k8s.V1JobSpec(
        completions=pods,
        parallelism=pods,
        completion_mode="Indexed",
        backoff_limit=0,
        pod_failure_policy=k8s.V1PodFailurePolicy(
            rules=[
                # user errors: fail now, with the exit code named in the Job's Failed condition
                k8s.V1PodFailurePolicyRule(
                    action="FailJob",
                    on_exit_codes=k8s.V1PodFailurePolicyOnExitCodesRequirement(
                        container_name=CONTAINER, operator="In", values=list(USER_EXIT_CODES)
                    ),
                ),
                # preemption/eviction: fail the gang too (not Ignore: a lone replacement pod cannot
                # rejoin a torchrun rendezvous that max-restarts=0 already tore down). Airflow's
                # classifier reads DisruptionTarget and retries, resuming from the checkpoint.
                k8s.V1PodFailurePolicyRule(
                    action="FailJob",
                    on_pod_conditions=[k8s.V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")],
                ),
            ]
        ),
        template=template,
    )
    annotations = {}
    if runtime.exclusive_placement is not None:
        annotations[JOBSET_EXCLUSIVE_TOPOLOGY] = runtime.exclusive_placement.topology_key
    body = m.JobSet(
        metadata=_object_meta(name, namespace, spec, runtime, annotations=annotations),
        spec=m.JobSetSpec(
            replicated_jobs=[
                m.ReplicatedJob(
                    name=RANK_JOB,
                    replicas=1,
                    template=k8s.V1JobTemplateSpec(metadata=k8s.V1ObjectMeta(labels=pod_labels(spec)), spec=job_spec),
                )
            ],
            network=m.JobSetNetwork(enable_dns_hostnames=True, subdomain=name, publish_not_ready_addresses=True),
            failure_policy=m.JobSetFailurePolicy(max_restarts=0),
            success_policy=m.JobSetSuccessPolicy(operator="All"),
            # Kueue unsuspends it on admission (its webhook would suspend it anyway)
            suspend=True if runtime.scheduler == "kueue" else None,
        ),
    )
    return _plan("JobSet", body, name, namespace, spec, runtime, rank0_host)


def build_volcano_job(spec: GangSpec, runtime: RuntimeDefaults, namespace: str) -> GangPlan:
    pods = pod_count(spec, runtime)
    name = gang_object_name(spec.name, spec.attempt, "VolcanoJob", pods)
    rank0_host = f"{name}-{RANK_JOB}-0.{name}"  # svc plugin: hostname <job>-<task>-<index>, subdomain <job>
    args = torchrun_args(spec, runtime, name=name, rank0_host=rank0_host, node_rank_env="VC_TASK_INDEX")
    template = build_pod_template(spec, runtime, args=args)
    body = m.VolcanoJob(
        metadata=_object_meta(name, namespace, spec, runtime),
        spec=m.VolcanoJobSpec(
            tasks=[m.VolcanoTask(name=RANK_JOB, replicas=pods, template=template)],
            min_available=pods,  # gang: all pods bind together or none does
            scheduler_name="volcano",
            queue=runtime.queue,
            priority_class_name=runtime.priority_class_name,
            plugins={"svc": [], "env": []},  # headless Service + VC_TASK_INDEX
            # any failed or evicted rank ends the whole job; Volcano never restarts it on its own
            policies=[m.VolcanoLifecyclePolicy(action="TerminateJob", events=["PodFailed", "PodEvicted"])],
        ),
    )
    return _plan("VolcanoJob", body, name, namespace, spec, runtime, rank0_host)


def build_trainjob(spec: GangSpec, runtime: RuntimeDefaults, namespace: str) -> GangPlan:
    pods = pod_count(spec, runtime)
    name = gang_object_name(spec.name, spec.attempt, "TrainJob", pods)
    volumes, mounts = _volumes(runtime)
    annotations = _pod_annotations(runtime)
    resources = _resources(runtime)
    body = m.TrainJob(
        metadata=_object_meta(name, namespace, spec, runtime),
        spec=m.TrainJobSpec(
            runtime_ref=m.RuntimeRef(name=runtime.training_runtime),
            trainer=m.Trainer(
                image=runtime.image,
                num_nodes=pods,
                num_proc_per_node=runtime.processes_per_pod,
                # the torch runtime sets PET_NNODES/PET_NODE_RANK/PET_MASTER_ADDR/PET_MASTER_PORT,
                # which torchrun reads as its multi-node flags
                command=["torchrun"],
                args=[f"--nproc-per-node={runtime.processes_per_pod}", "--max-restarts=0", *trainer_args(spec, runtime)],
                env=_env(spec, runtime),
                resources_per_node=resources,
            ),
            runtime_patches=[
                m.RuntimePatch(
                    manager=PATCH_MANAGER,
                    training_runtime_spec=m.TrainingRuntimeSpecPatch(
                        template=m.JobSetTemplatePatch(
                            spec=m.JobSetSpecPatch(
                                replicated_jobs=[
                                    m.ReplicatedJobPatch(
                                        name=TRAINJOB_NODE,
                                        template=m.JobTemplatePatch(
                                            spec=m.JobSpecPatch(
                                                template=m.PodTemplatePatch(
                                                    metadata=m.MetadataPatch(labels=pod_labels(spec), annotations=annotations),
                                                    spec=m.PodSpecPatch(
                                                        containers=[
                                                            m.ContainerPatch(
                                                                name=TRAINJOB_NODE,
                                                                security_context=container_security_context(),
                                                                volume_mounts=mounts,
                                                            )
                                                        ],
                                                        security_context=pod_security_context(runtime),
                                                        service_account_name=runtime.service_account_name,
                                                        node_selector=dict(runtime.node_selector),
                                                        tolerations=_tolerations(runtime),
                                                        volumes=volumes,
                                                        termination_grace_period_seconds=runtime.termination_grace_period_seconds,
                                                        affinity=_affinity(spec, runtime),
                                                    ),
                                                )
                                            )
                                        ),
                                    )
                                ]
                            )
                        )
                    ),
                )
            ],
            suspend=True,  # Kueue unsuspends on admission
            active_deadline_seconds=spec.max_run_time_s,  # from the TrainJob's start (Trainer stops it)
        ),
    )
    return _plan("TrainJob", body, name, namespace, spec, runtime, None)


def _control_pod(spec: GangSpec, runtime: RuntimeDefaults, *, name: str, command: list[str] | None,
                 env: list[k8s.V1EnvVar]) -> k8s.V1PodTemplateSpec:
    """A hardened pod that runs no rank (the RayJob's submitter, the MPIJob's launcher): small,
    the same security contexts, volumes and labels as the ranks' pods."""
    container = build_container(spec, runtime, args=None, name=name, command=command, env=env, resources=CONTROL_POD_RESOURCES)
    return build_pod_template(spec, runtime, args=None, container=container)


def build_rayjob(spec: GangSpec, runtime: RuntimeDefaults, namespace: str) -> GangPlan:
    """A KubeRay RayJob: a head pod that hosts no training worker (`num-cpus: 0`; the Ray job's
    driver, `python -m operators.backends.ray --address auto ...`, runs there) and one worker group
    of `pods` Ray nodes, each offering `num-cpus` = processes per pod, so the world size's Ray
    Train workers (one CPU each) fill exactly the worker pods. Ray's retries are off on both
    levels (the driver's FailureConfig(max_failures=0), `backoffLimit: 0`); Kueue admits it whole."""
    from operators.backends.base import driver_argv  # the local Ray backend's argv, not a copy

    pods = pod_count(spec, runtime)
    name = gang_object_name(spec.name, spec.attempt, "RayJob", pods)
    in_cluster = _in_cluster(spec, runtime)
    entrypoint = driver_argv("python", spec, run_dir=in_cluster.run_dir, cpus_per_worker=1, exports=(),
                             # every Ray node's container has the gang's env: nothing to pass through Ray
                             address="auto",  # the Ray job's own cluster (RAY_ADDRESS, set by Ray's job supervisor)
                             trainer_args=[*in_cluster.trainer_args(), *spec.user_code])
    ray_container = build_container(spec, runtime, args=None, command=None)  # KubeRay writes `ray start ...`
    head = build_pod_template(spec, runtime, args=None, container=ray_container)
    worker = build_pod_template(spec, runtime, args=None, container=build_container(spec, runtime, args=None, command=None))
    # The submitter (K8sJobMode) runs `ray job submit`, which KubeRay writes when the command is empty
    submitter = _control_pod(spec, runtime, name="ray-job-submitter", command=None,
                             env=[k8s.V1EnvVar(name="HOME", value="/tmp"), k8s.V1EnvVar(name="TMPDIR", value="/tmp")])
    body = m.RayJob(
        metadata=_object_meta(name, namespace, spec, runtime),
        spec=m.RayJobSpec(
            entrypoint=shlex.join(entrypoint),  # KubeRay runs it through a shell
            ray_cluster_spec=m.RayClusterSpec(
                head_group_spec=m.HeadGroupSpec(template=head, ray_start_params={"num-cpus": "0"}),
                worker_group_specs=[
                    m.WorkerGroupSpec(
                        group_name=RAY_WORKER_GROUP, replicas=pods, min_replicas=pods, max_replicas=pods, template=worker,
                        ray_start_params={"num-cpus": str(runtime.processes_per_pod)},
                    )
                ],
                enable_in_tree_autoscaling=False,  # a gang has a fixed size (Kueue refuses autoscaling RayJobs)
            ),
            backoff_limit=0,  # Airflow's classified retry is the one budget
            shutdown_after_job_finishes=True,  # the RayCluster goes with the job (Kueue requires it)
            submission_mode="K8sJobMode",
            submitter_pod_template=submitter,
            suspend=True,  # Kueue unsuspends on admission
            active_deadline_seconds=spec.max_run_time_s,
        ),
    )
    return _plan("RayJob", body, name, namespace, spec, runtime, None)


def build_mpijob(spec: GangSpec, runtime: RuntimeDefaults, namespace: str) -> GangPlan:
    """A Kubeflow MPIJob (v2beta1): `pods` workers with `slotsPerWorker` = processes per pod, and a
    launcher that runs `mpirun -np WORLD_SIZE ... python -m trainer ...` (the local backend's option
    list). Rank 0 is worker 0's first slot, so gloo meets at MASTER_ADDR=<job>-worker-0.<job> (the
    MPIJob's headless Service), MASTER_PORT=rendezvousPort; both reach the ranks by `-x NAME`."""
    from operators.backends.base import mpirun_argv  # the local backend's option list, not a copy

    pods = pod_count(spec, runtime)
    name = gang_object_name(spec.name, spec.attempt, "MPIJob", pods)
    rank0_host = f"{name}-worker-0.{name}"
    env = [*_env(spec, runtime), k8s.V1EnvVar(name="MASTER_ADDR", value=rank0_host),
           k8s.V1EnvVar(name="MASTER_PORT", value=str(runtime.rendezvous_port))]
    # every variable the launcher has reaches the ranks by name (secrets stay Secret references)
    exported = ["PATH", *sorted({e.name for e in env})]
    argv = mpirun_argv("mpirun", spec.world_size, exported, ["python", *trainer_args(spec, runtime)])
    # mpi-operator (v0.8.2) names the hostfile it mounts at /etc/mpi/hostfile only as ORTE's
    # OMPI_MCA_orte_default_hostfile, which Open MPI 5 (PRRTE) ignores: mpirun would then start every
    # rank on the launcher (kubeflow/mpi-operator#842). PRRTE's own name for it, for the launcher only.
    launcher_env = [*env, k8s.V1EnvVar(name="PRTE_MCA_prte_default_hostfile", value=MPI_HOSTFILE)]
    launcher = _control_pod(spec, runtime, name=CONTAINER, command=argv, env=launcher_env)
    # the workers run the image's sshd (mpi-operator's default worker command); the ranks are its children
    worker = build_pod_template(spec, runtime, args=None,
                                container=build_container(spec, runtime, args=None, command=["/usr/sbin/sshd", "-De"]))
    body = m.MPIJob(
        metadata=_object_meta(name, namespace, spec, runtime),
        spec=m.MPIJobSpec(
            mpi_replica_specs={
                "Launcher": m.MPIReplicaSpec(replicas=1, template=launcher, restart_policy="Never"),
                "Worker": m.MPIReplicaSpec(replicas=pods, template=worker, restart_policy="Never"),
            },
            slots_per_worker=runtime.processes_per_pod,
            run_policy=m.MPIRunPolicy(
                backoff_limit=0,  # Airflow's classified retry is the one budget
                clean_pod_policy="Running",  # stop the workers at the end; failed pods stay for the evidence
                suspend=True,  # Kueue unsuspends on admission
                active_deadline_seconds=spec.max_run_time_s,
            ),
            mpi_implementation="OpenMPI",
            ssh_auth_mount_path=MPI_SSH_AUTH_PATH,
            launcher_creation_policy="WaitForWorkersReady",  # mpirun starts once every worker's sshd runs
        ),
    )
    return _plan("MPIJob", body, name, namespace, spec, runtime, rank0_host)


def _plan(kind: str, body: m.CustomObject, name: str, namespace: str, spec: GangSpec, runtime: RuntimeDefaults, rank0_host: str | None) -> GangPlan:
    return GangPlan(
        kind=kind,
        group=body.group,
        version=body.version,
        plural=body.plural,
        name=name,
        namespace=namespace,
        body=body.to_dict(),
        pod_selector=pod_selector(spec),
        rank0_host=rank0_host,
        run_dir=runtime.checkpoint.run_dir(spec.name),
        gang=spec.name,
        attempt=spec.attempt,
        world_size=spec.world_size,
        scheduler=runtime.scheduler,
        api=runtime.api,
        pods=pod_count(spec, runtime),
        processes_per_pod=runtime.processes_per_pod,
        max_queue_wait_s=spec.max_queue_wait_s,
    )


def trainer_arg_value(body: dict[str, Any], key: str) -> str | None:
    """The value of trainer `--set KEY=...` in a rendered gang object (None when absent)."""
    def args_of(obj: Any):
        if isinstance(obj, dict):
            if isinstance(obj.get("args"), list):
                yield obj["args"]
            for value in obj.values():
                yield from args_of(value)
        elif isinstance(obj, list):
            for value in obj:
                yield from args_of(value)

    for args in args_of(body):
        for flag, item in zip(args, args[1:]):
            if flag == "--set" and item.split("=", 1)[0] == key:
                return item.split("=", 1)[1]
    return None


def build_gang(spec: GangSpec, runtime: RuntimeDefaults, namespace: str | None = None) -> GangPlan:
    """The gang object for `spec` under `runtime` (scheduler and api pick the kind)."""
    ns = namespace or runtime.namespace or "default"
    if runtime.scheduler == "volcano":
        return build_volcano_job(spec, runtime, ns)
    check_launcher(spec, runtime)
    if runtime.api == "trainjob":
        return build_trainjob(spec, runtime, ns)
    if runtime.api == "rayjob":
        return build_rayjob(spec, runtime, ns)
    if runtime.api == "mpijob":
        return build_mpijob(spec, runtime, ns)
    return build_jobset(spec, runtime, ns)


def check_launcher(spec: GangSpec, runtime: RuntimeDefaults) -> None:
    """Refuse, before admission, a launcher the runtime's api cannot run (`UnsupportedCombination`,
    naming both): api=mpijob runs launcher mpirun and only it; every other api runs torchrun's
    ranks (a RayJob: Ray Train's TorchTrainer). A RayJob runs gangflow's own loop only."""
    wanted = API_LAUNCHERS[runtime.api]
    if spec.launcher != wanted:
        apis = ", ".join(a for a, launcher in API_LAUNCHERS.items() if launcher == spec.launcher) or "none"
        raise UnsupportedCombination(
            f"launcher={spec.launcher!r} with api={runtime.api!r} cannot run: api {runtime.api!r} runs launcher "
            f"{wanted!r} only; choose launcher={wanted!r}, or a runtime api that runs {spec.launcher!r} ({apis})"
        )
    if runtime.api == "rayjob" and spec.user_code:
        raise UnsupportedCombination(
            "training code of one's own (training.entrypoint / training.command) with api='rayjob' cannot run: "
            "the Ray workers run gangflow's loop (trainer.ray_worker); use api='jobset' or api='trainjob'"
        )
