"""Small typed models of the custom resources gangflow submits (JobSet, Volcano Job, Kubeflow
TrainJob, KubeRay RayJob, Kubeflow MPIJob), in the style of the Kubernetes client's own `V1...` models.

Core parts (pod templates, job templates, object metadata) are the Kubernetes client's models;
`to_dict` serializes everything with `ApiClient().sanitize_for_serialization`, so nested `V1...`
objects come out exactly as the client would send them (camelCase, no None fields).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kubernetes import client as k8s


def _json_name(f: dataclasses.Field) -> str:
    if "json" in f.metadata:
        return f.metadata["json"]
    head, *rest = f.name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def serialize(value: Any) -> Any:
    """Serialize models, Kubernetes client models, lists and dicts to JSON-ready data (no Nones)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        if isinstance(value, CustomObject):
            out["apiVersion"] = value.api_version
            out["kind"] = value.kind
        for f in dataclasses.fields(value):
            item = serialize(getattr(value, f.name))
            if item is None or (f.metadata.get("omitempty") and item in ([], {})):
                continue
            out[_json_name(f)] = item
        return out
    if isinstance(value, (list, tuple)):
        return [serialize(v) for v in value]
    if isinstance(value, dict):
        return {k: serialize(v) for k, v in value.items() if v is not None}
    return k8s.ApiClient().sanitize_for_serialization(value)


@dataclass
class CustomObject:
    """Base of the custom resources: group/version/kind/plural plus metadata and spec."""

    group: ClassVar[str]
    version: ClassVar[str]
    kind: ClassVar[str]
    plural: ClassVar[str]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def to_dict(self) -> dict[str, Any]:
        return serialize(self)


# --- JobSet (jobset.x-k8s.io/v1alpha2) -------------------------------------------------------------


@dataclass
class ReplicatedJob:
    name: str
    template: k8s.V1JobTemplateSpec
    replicas: int = 1


@dataclass
class JobSetNetwork:
    # headless Service: pods resolve as <jobset>-<rjob>-<job>-<pod>.<subdomain> (JobSet spells DNS in capitals)
    enable_dns_hostnames: bool = field(default=True, metadata={"json": "enableDNSHostnames"})
    subdomain: str | None = None
    publish_not_ready_addresses: bool | None = True


@dataclass
class JobSetFailurePolicyRule:
    name: str
    action: str  # FailJobSet | RestartJobSet | RestartJobSetAndIgnoreMaxRestarts
    on_job_failure_reasons: list[str] = field(default_factory=list, metadata={"omitempty": True})
    target_replicated_jobs: list[str] = field(default_factory=list, metadata={"omitempty": True})


@dataclass
class JobSetFailurePolicy:
    max_restarts: int = 0
    rules: list[JobSetFailurePolicyRule] = field(default_factory=list, metadata={"omitempty": True})


@dataclass
class JobSetSuccessPolicy:
    operator: str = "All"  # All | Any
    target_replicated_jobs: list[str] = field(default_factory=list, metadata={"omitempty": True})


@dataclass
class JobSetSpec:
    replicated_jobs: list[ReplicatedJob]
    network: JobSetNetwork | None = None
    failure_policy: JobSetFailurePolicy | None = None
    success_policy: JobSetSuccessPolicy | None = None
    suspend: bool | None = None
    ttl_seconds_after_finished: int | None = None


@dataclass
class JobSet(CustomObject):
    metadata: k8s.V1ObjectMeta
    spec: JobSetSpec

    group: ClassVar[str] = "jobset.x-k8s.io"
    version: ClassVar[str] = "v1alpha2"
    kind: ClassVar[str] = "JobSet"
    plural: ClassVar[str] = "jobsets"


# --- Volcano Job (batch.volcano.sh/v1alpha1) -------------------------------------------------------


@dataclass
class VolcanoLifecyclePolicy:
    action: str  # AbortJob | RestartJob | RestartTask | TerminateJob | CompleteJob
    events: list[str] = field(default_factory=list, metadata={"omitempty": True})
    exit_code: int | None = None


@dataclass
class VolcanoTask:
    name: str
    replicas: int
    template: k8s.V1PodTemplateSpec
    min_available: int | None = None
    policies: list[VolcanoLifecyclePolicy] = field(default_factory=list, metadata={"omitempty": True})


@dataclass
class VolcanoJobSpec:
    tasks: list[VolcanoTask]
    min_available: int
    scheduler_name: str = "volcano"
    queue: str | None = None
    priority_class_name: str | None = None
    plugins: dict[str, list[str]] = field(default_factory=dict, metadata={"omitempty": True})
    policies: list[VolcanoLifecyclePolicy] = field(default_factory=list, metadata={"omitempty": True})
    max_retry: int | None = None
    ttl_seconds_after_finished: int | None = None


@dataclass
class VolcanoJob(CustomObject):
    metadata: k8s.V1ObjectMeta
    spec: VolcanoJobSpec

    group: ClassVar[str] = "batch.volcano.sh"
    version: ClassVar[str] = "v1alpha1"
    kind: ClassVar[str] = "Job"
    plural: ClassVar[str] = "jobs"


# --- Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) ----------------------------------


@dataclass
class RuntimeRef:
    name: str
    kind: str = "ClusterTrainingRuntime"
    api_group: str = "trainer.kubeflow.org"


@dataclass
class Trainer:
    image: str
    num_nodes: int
    num_proc_per_node: int | None = None
    command: list[str] = field(default_factory=list, metadata={"omitempty": True})
    args: list[str] = field(default_factory=list, metadata={"omitempty": True})
    env: list[k8s.V1EnvVar] = field(default_factory=list, metadata={"omitempty": True})
    resources_per_node: k8s.V1ResourceRequirements | None = None


@dataclass
class ContainerPatch:
    name: str
    env: list[k8s.V1EnvVar] = field(default_factory=list, metadata={"omitempty": True})
    security_context: k8s.V1SecurityContext | None = None
    volume_mounts: list[k8s.V1VolumeMount] = field(default_factory=list, metadata={"omitempty": True})


@dataclass
class PodSpecPatch:
    containers: list[ContainerPatch] = field(default_factory=list, metadata={"omitempty": True})
    security_context: k8s.V1PodSecurityContext | None = None
    service_account_name: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict, metadata={"omitempty": True})
    tolerations: list[k8s.V1Toleration] = field(default_factory=list, metadata={"omitempty": True})
    volumes: list[k8s.V1Volume] = field(default_factory=list, metadata={"omitempty": True})
    termination_grace_period_seconds: int | None = None
    affinity: k8s.V1Affinity | None = None


@dataclass
class MetadataPatch:
    labels: dict[str, str] = field(default_factory=dict, metadata={"omitempty": True})
    annotations: dict[str, str] = field(default_factory=dict, metadata={"omitempty": True})


@dataclass
class PodTemplatePatch:
    metadata: MetadataPatch | None = None
    spec: PodSpecPatch | None = None


@dataclass
class JobSpecPatch:
    template: PodTemplatePatch


@dataclass
class JobTemplatePatch:
    spec: JobSpecPatch


@dataclass
class ReplicatedJobPatch:
    name: str
    template: JobTemplatePatch


@dataclass
class JobSetSpecPatch:
    replicated_jobs: list[ReplicatedJobPatch]


@dataclass
class JobSetTemplatePatch:
    spec: JobSetSpecPatch
    metadata: MetadataPatch | None = None


@dataclass
class TrainingRuntimeSpecPatch:
    template: JobSetTemplatePatch


@dataclass
class RuntimePatch:
    manager: str
    training_runtime_spec: TrainingRuntimeSpecPatch


@dataclass
class TrainJobSpec:
    runtime_ref: RuntimeRef
    trainer: Trainer
    runtime_patches: list[RuntimePatch] = field(default_factory=list, metadata={"omitempty": True})
    suspend: bool | None = None
    active_deadline_seconds: int | None = None


@dataclass
class TrainJob(CustomObject):
    metadata: k8s.V1ObjectMeta
    spec: TrainJobSpec

    group: ClassVar[str] = "trainer.kubeflow.org"
    version: ClassVar[str] = "v1alpha1"
    kind: ClassVar[str] = "TrainJob"
    plural: ClassVar[str] = "trainjobs"


# --- KubeRay RayJob (ray.io/v1) ---------------------------------------------------------------------


@dataclass
class HeadGroupSpec:
    template: k8s.V1PodTemplateSpec
    ray_start_params: dict[str, str] = field(default_factory=dict, metadata={"omitempty": True})


@dataclass
class WorkerGroupSpec:
    group_name: str
    replicas: int
    min_replicas: int
    max_replicas: int
    template: k8s.V1PodTemplateSpec
    ray_start_params: dict[str, str] = field(default_factory=dict, metadata={"omitempty": True})


@dataclass
class RayClusterSpec:
    head_group_spec: HeadGroupSpec
    worker_group_specs: list[WorkerGroupSpec]
    enable_in_tree_autoscaling: bool | None = None


@dataclass
class RayJobSpec:
    entrypoint: str
    ray_cluster_spec: RayClusterSpec
    backoff_limit: int | None = None
    shutdown_after_job_finishes: bool | None = None
    submission_mode: str | None = None  # K8sJobMode | HTTPMode | InteractiveMode | SidecarMode
    submitter_pod_template: k8s.V1PodTemplateSpec | None = None
    suspend: bool | None = None
    active_deadline_seconds: int | None = None


@dataclass
class RayJob(CustomObject):
    metadata: k8s.V1ObjectMeta
    spec: RayJobSpec

    group: ClassVar[str] = "ray.io"
    version: ClassVar[str] = "v1"
    kind: ClassVar[str] = "RayJob"
    plural: ClassVar[str] = "rayjobs"


# --- Kubeflow MPIJob (kubeflow.org/v2beta1, mpi-operator) ------------------------------------------


@dataclass
class MPIRunPolicy:
    backoff_limit: int | None = None
    clean_pod_policy: str | None = None  # None | Running | All
    suspend: bool | None = None
    active_deadline_seconds: int | None = None


@dataclass
class MPIReplicaSpec:
    replicas: int
    template: k8s.V1PodTemplateSpec
    restart_policy: str | None = None  # Always | OnFailure | Never | ExitCode


@dataclass
class MPIJobSpec:
    mpi_replica_specs: dict[str, MPIReplicaSpec] = field(metadata={"json": "mpiReplicaSpecs"})
    slots_per_worker: int | None = None
    run_policy: MPIRunPolicy | None = None
    mpi_implementation: str | None = field(default=None, metadata={"json": "mpiImplementation"})
    ssh_auth_mount_path: str | None = None
    launcher_creation_policy: str | None = None  # AtStartup | WaitForWorkersReady


@dataclass
class MPIJob(CustomObject):
    metadata: k8s.V1ObjectMeta
    spec: MPIJobSpec

    group: ClassVar[str] = "kubeflow.org"
    version: ClassVar[str] = "v2beta1"
    kind: ClassVar[str] = "MPIJob"
    plural: ClassVar[str] = "mpijobs"


GANG_KINDS: dict[str, type[CustomObject]] = {"JobSet": JobSet, "VolcanoJob": VolcanoJob, "TrainJob": TrainJob,
                                             "RayJob": RayJob, "MPIJob": MPIJob}
