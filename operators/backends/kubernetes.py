"""`KubernetesBackend`: run a training gang as a JobSet (Kueue), a Kubeflow TrainJob (Kueue) or a
Volcano Job, deferrably: `check_capacity`, `submit`, `trigger` (a `GangTrigger`), `collect`.

The cluster never retries on its own: the one retry budget is Airflow's, spent by the failure
classifier. Object names are deterministic per try, so a restarted worker re-attaches to its gang;
after submit the DAG run's MLflow run is tagged with the gang's lineage (docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import yaml

from operators.backends.base import GangBackend, GangResult, GangSpec, LogFn
from operators.exceptions import (
    GangAdmissionTimeout,
    GangCapacityError,
    GangConfigError,
    KubernetesApiError,
    KubernetesRequestError,
)
from operators.kubernetes import status as st
from operators.kubernetes.builders import ATTEMPT_LABEL, CONTAINER, GANG_LABEL, TRAINJOB_NODE, GangPlan, build_gang, dataset_version, pod_selector
from operators.hooks.kubernetes import GangApi, open_api, run_sync
from operators.kubernetes.runtime import (
    RUNTIME_CONFIGMAP,
    RUNTIME_CONFIGMAP_KEY,
    RuntimeConfigError,
    RuntimeDefaults,
    merge_runtime,
    parse_quantity,
)
from trainer.urls import redact_url

# MLflow run tags the backend sets (the registry copies gangflow.* tags onto the model version).
TAG_GANG = "gangflow.gang"
TAG_JOB_UID = "gangflow.job_uid"
TAG_JOB_KIND = "gangflow.job_kind"
TAG_IMAGE_DIGEST = "gangflow.image_digest"
TAG_DATASET_VERSION = "gangflow.dataset_version"


def image_digest(image: str) -> tuple[str, str | None]:
    """(what identifies the image's bytes, a warning or None): the `sha256:...` digest of a
    reference pinned by digest, else the reference itself (a tag can move) and a warning."""
    if "@sha256:" in image:
        return image.split("@", 1)[1], None
    return image, f"image {image} is not pinned by digest: the lineage tag records the tag, which can move"

logger = logging.getLogger("gangflow.kubernetes")


class KubernetesBackend(GangBackend):
    """Deferrable gang backend on Kubernetes (JobSet/TrainJob/RayJob/MPIJob under Kueue, or Volcano)."""

    name = "kubernetes"
    deferrable = True
    # mpirun only with the runtime's api=mpijob, torchrun with every other api: the runtime is read
    # from the cluster, so builders.check_launcher refuses the pair when the gang is planned (before admission)
    launchers = ("torchrun", "mpirun")

    def __init__(
        self,
        *,
        kubernetes_conn_id: str | None = "kubernetes_default",
        namespace: str | None = None,
        runtime: Mapping[str, Any] | None = None,
        runtime_configmap: str | None = RUNTIME_CONFIGMAP,
        delete_on_success: bool = True,
        poll_interval: float = 10.0,
        log_interval: float = 60.0,
        image_pull_grace_seconds: float = 300.0,
        adopt_running_gangs: bool = True,
        log: LogFn | None = None,
    ):
        if poll_interval <= 0:
            raise ValueError(f"poll_interval={poll_interval!r}: must be > 0 seconds")
        self.kubernetes_conn_id = kubernetes_conn_id
        self.namespace = namespace
        self.runtime_overrides = dict(runtime or {})
        self.runtime_configmap = runtime_configmap
        self.delete_on_success = delete_on_success
        self.poll_interval = float(poll_interval)
        self.log_interval = float(log_interval)
        self.image_pull_grace_seconds = float(image_pull_grace_seconds)
        self.adopt_running_gangs = adopt_running_gangs
        self._log_fn = log
        self._runtime: RuntimeDefaults | None = None
        self._handle: dict[str, Any] | None = None

    # --- plumbing ---------------------------------------------------------------------------------

    def _log(self, message: str) -> None:
        logger.info(message)
        if self._log_fn:
            self._log_fn(message)

    def _home_namespace(self) -> str:
        """Where the runtime ConfigMap lives: the explicit namespace, the connection's, or default."""
        if self.namespace:
            return self.namespace
        try:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            return KubernetesHook(conn_id=self.kubernetes_conn_id).get_namespace() or "default"
        except Exception:  # no connection configured: in-cluster defaults
            return "default"

    def _api(self, namespace: str):
        return open_api(self.kubernetes_conn_id, namespace)

    # --- runtime defaults -------------------------------------------------------------------------

    async def _load_runtime(self, api: GangApi) -> RuntimeDefaults:
        base: dict[str, Any] = {}
        where = f"ConfigMap {api.namespace}/{self.runtime_configmap} key {RUNTIME_CONFIGMAP_KEY}"
        if self.runtime_configmap:
            cm = await api.get_configmap(self.runtime_configmap)
            if cm is None:
                if not {"image", "checkpoint"} <= set(self.runtime_overrides):
                    raise GangConfigError(
                        f"{where} not found: install the gangflow Helm chart in namespace {api.namespace}, "
                        f"or pass runtime={{...}} with at least image and checkpoint"
                    )
            else:
                text = (cm.get("data") or {}).get(RUNTIME_CONFIGMAP_KEY)
                if text is None:
                    raise GangConfigError(f"{where}: the ConfigMap has no {RUNTIME_CONFIGMAP_KEY} key")
                try:
                    base = yaml.safe_load(text) or {}
                except yaml.YAMLError as exc:
                    raise GangConfigError(f"{where}: not valid YAML: {exc}") from None
        try:
            return RuntimeDefaults.from_mapping(merge_runtime(base, self.runtime_overrides))
        except RuntimeConfigError as exc:
            source = f"{where} + task overrides" if self.runtime_configmap else "task runtime overrides"
            raise GangConfigError(f"{exc} (from {source})") from None

    def runtime(self) -> RuntimeDefaults:
        """The effective runtime defaults (ConfigMap merged with this task's overrides)."""
        if self._runtime is None:
            ns = self._home_namespace()

            async def load():
                async with self._api(ns) as api:
                    return await self._load_runtime(api)

            self._runtime = run_sync(load)
        return self._runtime

    def plan(self, spec: GangSpec) -> GangPlan:
        runtime = self.runtime()
        try:
            return build_gang(spec, runtime, namespace=self.namespace or runtime.namespace or self._home_namespace())
        except (ValueError, RuntimeConfigError) as exc:
            raise GangConfigError(f"gang {spec.name}: {redact_url(str(exc))}") from None

    def _handle_for(self, plan: GangPlan, obj: Mapping[str, Any], runtime: RuntimeDefaults, *, reattached: bool) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        attempt = int(labels.get(ATTEMPT_LABEL, plan.attempt))
        return {
            "kind": plan.kind,
            "group": plan.group,
            "version": plan.version,
            "plural": plan.plural,
            "name": meta.get("name", plan.name),
            "namespace": plan.namespace,
            "uid": meta.get("uid"),
            "gang": plan.gang,
            "attempt": attempt,
            "world_size": plan.world_size,
            "pods": plan.pods,
            "processes_per_pod": plan.processes_per_pod,
            "scheduler": plan.scheduler,
            "api": plan.api,
            "queue": runtime.queue,
            "container": TRAINJOB_NODE if plan.kind == "TrainJob" else CONTAINER,
            "pod_selector": f"{GANG_LABEL}={plan.gang},{ATTEMPT_LABEL}={attempt}",
            "run_dir": plan.run_dir,
            # the pipeline's bound on the queue wait, else the runtime's (the timeout names which)
            "admission_timeout_seconds": plan.max_queue_wait_s or runtime.admission_timeout_seconds,
            "admission_timeout_field": "training.max_queue_wait_seconds" if plan.max_queue_wait_s else "admissionTimeoutSeconds",
            "startup_timeout_seconds": runtime.startup_timeout_seconds,
            "reattached": reattached,
        }

    # --- GangBackend ------------------------------------------------------------------------------

    def check_capacity(self, spec: GangSpec) -> None:
        """Refuse gangs that can never be admitted: bad sizes, unparseable requests, more than the
        ClusterQueue behind the LocalQueue can ever hold (when Kueue's queues are readable)."""
        if not isinstance(spec.world_size, int) or spec.world_size < 1:
            raise GangCapacityError(f"gang {spec.name}: world_size={spec.world_size!r} must be an integer >= 1")
        runtime = self.runtime()
        plan = self.plan(spec)
        per_rank: dict[str, Decimal] = {}
        for resource, value in runtime.resources.as_resource_list().items():
            try:
                per_rank[resource] = parse_quantity(f"resources.{resource}", value)
            except RuntimeConfigError as exc:
                raise GangCapacityError(f"gang {spec.name}: {exc}") from None
        if runtime.scheduler != "kueue":
            return

        async def quota() -> None:
            async with self._api(plan.namespace) as api:
                await self._check_kueue_quota(api, spec, runtime, per_rank)

        run_sync(quota)

    async def _check_kueue_quota(self, api: GangApi, spec: GangSpec, runtime: RuntimeDefaults, per_rank: dict[str, Decimal]) -> None:
        try:
            lq = await api.get_kueue("localqueues", "LocalQueue", runtime.queue)
        except KubernetesRequestError as exc:
            self._log(f"capacity check skipped: cannot read LocalQueue {api.namespace}/{runtime.queue} ({exc})")
            return
        if lq is None:
            raise GangConfigError(
                f"Kueue LocalQueue {api.namespace}/{runtime.queue} not found: create it (pointing at a ClusterQueue) "
                f"or set runtime queue to an existing LocalQueue; without it the gang would wait forever"
            )
        cq_name = (lq.get("spec") or {}).get("clusterQueue")
        try:
            cq = await api.get_kueue("clusterqueues", "ClusterQueue", cq_name, cluster_scoped=True) if cq_name else None
        except KubernetesRequestError as exc:
            self._log(f"capacity check skipped: cannot read ClusterQueue {cq_name} ({exc})")
            return
        if cq is None:
            return
        cq_spec = cq.get("spec") or {}
        has_cohort = bool(cq_spec.get("cohortName") or cq_spec.get("cohort"))
        pods = self.plan(spec).pods
        for resource, amount in per_rank.items():
            need = amount * pods
            best: Decimal | None = None
            unlimited = False
            covered = False
            for group in cq_spec.get("resourceGroups") or []:
                if resource not in (group.get("coveredResources") or []):
                    continue
                covered = True
                for flavor in group.get("flavors") or []:
                    for res in flavor.get("resources") or []:
                        if res.get("name") != resource:
                            continue
                        cap = parse_quantity("nominalQuota", res.get("nominalQuota", "0")) if str(res.get("nominalQuota", "0")) not in ("0", "") else Decimal(0)
                        if has_cohort:
                            if res.get("borrowingLimit") is None:
                                unlimited = True
                            elif str(res["borrowingLimit"]) not in ("0", ""):
                                cap += parse_quantity("borrowingLimit", res["borrowingLimit"])
                        best = cap if best is None else max(best, cap)
            if not covered:
                raise GangCapacityError(
                    f"gang {spec.name}: ClusterQueue {cq_name} (behind LocalQueue {api.namespace}/{runtime.queue}) "
                    f"covers no {resource}; the gang requests {need} {resource} and can never be admitted"
                )
            if not unlimited and best is not None and need > best:
                raise GangCapacityError(
                    f"gang {spec.name}: needs {need} {resource} ({pods} pods x {amount}) but ClusterQueue "
                    f"{cq_name} can hold at most {best} {resource} in one flavor"
                    + (" including borrowing" if has_cohort else " (nominal quota, no cohort to borrow from)")
                    + "; lower world_size or resources, or raise the quota"
                )

    def submit(self, spec: GangSpec) -> dict[str, Any]:
        runtime = self.runtime()
        plan = self.plan(spec)

        async def go() -> dict[str, Any]:
            async with self._api(plan.namespace) as api:
                return await self._submit(api, plan, runtime)

        self._handle = run_sync(go)
        self._log(f"rank logs: kubectl logs -n {self._handle.get('namespace', plan.namespace)} --prefix --tail=-1 "
                  f"-l {pod_selector(spec)} (one JSON object a line with GANGFLOW_LOG_FORMAT=json; "
                  "Loki and other collectors: filter on gang and rank)")
        self.tag_lineage(spec, self._handle, runtime)
        return self._handle

    def lineage_tags(self, spec: GangSpec, handle: Mapping[str, Any], runtime: RuntimeDefaults) -> dict[str, str]:
        digest, warning = image_digest(runtime.image)
        if warning:
            self._log(f"warning: {warning}")
        tags = {TAG_GANG: spec.name, TAG_JOB_KIND: str(handle.get("kind")), TAG_IMAGE_DIGEST: digest}
        if handle.get("uid"):
            tags[TAG_JOB_UID] = str(handle["uid"])
        version = dataset_version(spec)
        if version:
            tags[TAG_DATASET_VERSION] = version
        return tags

    def tag_lineage(self, spec: GangSpec, handle: Mapping[str, Any], runtime: RuntimeDefaults) -> dict[str, str]:
        """Tag the DAG run's MLflow run with what ran (gang, object uid, image digest, data)."""
        run_id = spec.env.get("MLFLOW_RUN_ID")
        if not run_id:
            return {}
        tags = self.lineage_tags(spec, handle, runtime)
        try:
            from operators.hooks import mlflow as tracking

            client = tracking.get_client()  # the worker's view of the same tracking server
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
        except Exception as exc:  # noqa: BLE001 - the gang runs already; lineage is retried by a re-attach
            self._log(f"warning: could not tag MLflow run {run_id} with the gang's lineage: {redact_url(str(exc))}")
            return {}
        self._log(f"MLflow run {run_id} tagged: " + ", ".join(f"{k}={v}" for k, v in tags.items()))
        return tags

    async def _submit(self, api: GangApi, plan: GangPlan, runtime: RuntimeDefaults) -> dict[str, Any]:
        where = f"{plan.kind} {plan.namespace}/{plan.name}"
        existing = await api.get_custom(plan.group, plan.version, plan.plural, plan.kind, plan.name)
        if existing is not None:
            if (existing.get("metadata") or {}).get("deletionTimestamp"):
                raise KubernetesApiError(f"{where} from this try is still being deleted; retry once it is gone")
            self._log(f"{where} already exists (uid {existing['metadata'].get('uid')}): re-attaching, not creating a second gang")
            return self._handle_for(plan, existing, runtime, reattached=True)
        # gangs of earlier tries of the same gang: adopt a running one, delete finished ones
        for other in await api.list_custom(plan.group, plan.version, plan.plural, plan.kind, f"{GANG_LABEL}={plan.gang}"):
            meta = other.get("metadata") or {}
            try:
                other_attempt = int((meta.get("labels") or {}).get(ATTEMPT_LABEL, "0"))
            except ValueError:
                continue
            if other_attempt >= plan.attempt or meta.get("deletionTimestamp"):
                continue
            state = st.gang_state(plan.kind, other)
            other_where = f"{plan.kind} {plan.namespace}/{meta.get('name')}"
            if state.state in ("succeeded", "failed") or not self.adopt_running_gangs:
                self._log(f"deleting {other_where} left over from try {other_attempt} ({state.state})")
                await api.delete_custom(plan.group, plan.version, plan.plural, plan.kind, meta["name"], propagation="Foreground")
                continue
            self._log(f"{other_where} from try {other_attempt} is still {state.state}: adopting it instead of starting a second gang")
            return self._handle_for(plan, other, runtime, reattached=True)
        try:
            created = await api.create_custom(plan.group, plan.version, plan.plural, plan.body)
        except KubernetesRequestError as exc:
            if getattr(exc, "status", None) != 409:
                raise
            existing = await api.get_custom(plan.group, plan.version, plan.plural, plan.kind, plan.name)
            if existing is None:
                raise KubernetesApiError(f"create {where}: conflict, but the object is gone; retry") from None
            self._log(f"{where} was created concurrently: re-attaching")
            return self._handle_for(plan, existing, runtime, reattached=True)
        self._log(f"created {where} ({plan.world_size} ranks, scheduler {plan.scheduler}, queue {runtime.queue})")
        return self._handle_for(plan, created, runtime, reattached=False)

    def resubmit(self, spec: GangSpec, *, timeout_s: float = 300.0) -> dict[str, Any]:
        """Submit the gang again after a preemption, once the evicted object (deleted by `collect`)
        and its pods are gone: the same try, the same object name."""
        plan = self.plan(spec)
        where = f"{plan.kind} {plan.namespace}/{plan.name}"

        async def gone() -> None:
            deadline = time.monotonic() + timeout_s
            async with self._api(plan.namespace) as api:
                while (await api.get_custom(plan.group, plan.version, plan.plural, plan.kind, plan.name) is not None
                       or await api.list_pods(pod_selector(spec))):
                    if time.monotonic() > deadline:
                        raise KubernetesApiError(f"{where}: the preempted gang is still not gone after {timeout_s:.0f} s")
                    await asyncio.sleep(min(self.poll_interval, 2.0))

        run_sync(gone)
        self._log(f"re-submitting {where} after a preemption")
        return self.submit(spec)

    def trigger(self, handle: dict[str, Any]):
        from operators.triggers.gang import GangTrigger

        return GangTrigger(
            handle=handle,
            kubernetes_conn_id=self.kubernetes_conn_id,
            poll_interval=self.poll_interval,
            log_interval=self.log_interval,
            image_pull_grace_seconds=self.image_pull_grace_seconds,
        )

    def collect(self, handle: dict[str, Any], event: dict[str, Any]) -> GangResult:
        self._handle = handle
        return run_sync(lambda: self._collect(handle, event))

    async def _collect(self, handle: dict[str, Any], event: dict[str, Any]) -> GangResult:
        from operators.kubernetes.watch import gather_evidence

        where = f"{handle['kind']} {handle['namespace']}/{handle['name']}"
        status = event.get("status")
        message = event.get("message", "")
        async with self._api(handle["namespace"]) as api:
            if status == "success":
                if self.delete_on_success:
                    await self._teardown(api, handle)
                return GangResult(succeeded=True, exit_code=0, start_step_known=False, detail=message or f"{where} succeeded")
            if status == "failed":
                evidence = await self._merge_evidence(api, handle, event.get("evidence") or {}, gather_evidence)
                teardown = await self._teardown(api, handle)
                detail = message + (f"; {teardown}" if teardown else "")
                return GangResult(succeeded=False, exit_code=evidence.get("exit_code"), evidence=evidence, start_step_known=False,
                                  detail=detail)
            teardown = await self._teardown(api, handle)
        suffix = f" ({teardown})" if teardown else ""
        if status == "timeout":
            raise GangAdmissionTimeout(f"{message}{suffix}; the gang was deleted so it holds no quota or accelerators")
        raise KubernetesApiError(f"watching {where}: {message or event}{suffix}")

    async def _merge_evidence(self, api: GangApi, handle, snapshot: dict[str, Any], gather) -> dict[str, Any]:
        """The trigger's snapshot (taken at the first failure) merged with what the pods say now
        (pods gone since keep their snapshot; pods still there get fresh events and logs)."""
        try:
            obj = await api.get_custom(handle["group"], handle["version"], handle["plural"], handle["kind"], handle["name"])
            workloads = await api.list_workloads(handle["uid"]) if handle.get("scheduler") == "kueue" and handle.get("uid") else []
            fresh = await gather(api, handle, obj=obj, workload=workloads[0] if workloads else None)
        except KubernetesApiError as exc:
            self._log(f"could not refresh evidence ({exc}); using the trigger's snapshot")
            return snapshot or {"pod_message": str(exc), "ranks": []}
        by_pod: dict[str, dict[str, Any]] = {}
        for rank in list(snapshot.get("ranks") or []) + list(fresh.get("ranks") or []):
            key = rank.get("pod") or f"rank-{rank.get('rank')}"
            merged = dict(by_pod.get(key) or {})
            merged.update({k: v for k, v in rank.items() if v not in (None, [], {}, "")})
            by_pod[key] = merged
        if not by_pod:  # no pod failed: gang-level evidence (Kueue eviction, deleted gang, gang condition)
            base = {k: v for k, v in snapshot.items() if k != "ranks"}
            for key, value in fresh.items():
                if key != "ranks":
                    base.setdefault(key, value)
            base["ranks"] = []
            return base
        extra: dict[str, Any] = {}
        for source in (snapshot, fresh):  # gang-level reason (e.g. Kueue eviction) the root pod lacks
            root = next((r for r in source.get("ranks") or [] if r.get("pod") == source.get("pod")), {})
            for key in ("pod_reason", "pod_message"):
                if source.get(key) and root.get(key) != source[key]:
                    extra.setdefault(key, source[key])
        gang_conditions: list[dict[str, Any]] = []
        for source in (snapshot, fresh):
            for cond in source.get("pod_conditions") or []:
                gang_level = cond.get("type") == "Evicted" or str(cond.get("type", "")).endswith("Failed")
                if gang_level and cond not in gang_conditions:
                    gang_conditions.append(cond)
        if gang_conditions:
            extra["pod_conditions"] = gang_conditions
        # evidence not from pods (a Ray job's message: ray_evidence) already put its root cause first
        root = next((s["rank"] for s in (snapshot, fresh) if s.get("ranks") and not s.get("pod") and s.get("rank") is not None), None)
        return st.gang_evidence(list(by_pod.values()), extra=extra, root_rank=root)

    async def _teardown(self, api: GangApi, handle: Mapping[str, Any]) -> str:
        """Delete the gang (foreground: its Jobs and pods go first, freeing the accelerators)."""
        where = f"{handle['kind']} {handle['namespace']}/{handle['name']}"
        try:
            deleted = await api.delete_custom(handle["group"], handle["version"], handle["plural"], handle["kind"], handle["name"], propagation="Foreground")
        except (KubernetesApiError, KubernetesRequestError) as exc:
            self._log(f"could not delete {where}: {exc}")
            return f"could not delete {where}: {exc}; the next try deletes it"
        self._log(f"{'deleted' if deleted else 'already gone:'} {where}")
        return ""

    def kill(self, handle: dict[str, Any] | None = None) -> None:
        """Delete the gang (task killed). Uses `handle`, else the one this backend submitted."""
        handle = handle or self._handle
        if not handle:
            self._log("kill: no gang submitted by this backend instance; nothing to delete")
            return

        async def go() -> None:
            async with self._api(handle["namespace"]) as api:
                await self._teardown(api, handle)

        run_sync(go)
