"""The drill's Kubeflow Trainer v2 controller, with Kueue's TrainJob integration: what a cluster
running Trainer does with the TrainJob gangflow submits (api=trainjob), played against the API test
double. The JobSet it creates is then run by the drill's JobSet machinery (cluster.py).

Modelled on kubeflow/trainer (pkg/runtime/framework/plugins/jobset/builder.go `Trainer`,
plugins/torch/torch.go `EnforceMLPolicy`, plugins/jobset/jobset.go `TerminalCondition`,
pkg/controller/trainjob_controller.go) and on Kueue's TrainJob integration (the Workload belongs to
the TrainJob; Kueue unsuspends the TrainJob, Trainer propagates `suspend` to its JobSet).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

from operators.cli.drill.api_double import InMemoryKubernetesApi, now
from operators.cli.drill.cluster import admit, jobset_pods, kueue_workload, seconds_since, set_admission

TRAINJOBS = ("trainer.kubeflow.org", "trainjobs")
RUNTIMES = ("trainer.kubeflow.org", "clustertrainingruntimes")
JOBSETS = ("jobset.x-k8s.io", "jobsets")
WORKLOADS = ("kueue.x-k8s.io", "workloads")
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # constants.LabelTrainJobAncestor
ANCESTOR_TRAINER = "trainer"
NODE = "node"  # constants.Node: the trainer's replicated Job and container
TRAINER_PORT = 29500  # constants.ContainerTrainerPort
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"  # constants.JobCompletionIndexFieldPath
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Trainer's condition messages (pkg/constants)
CREATED_MESSAGE = "Succeeded to create Jobs"
SUSPENDED_MESSAGE = "TrainJob is suspended"
RESUMED_MESSAGE = "TrainJob is resumed"
DEADLINE_EXCEEDED_MESSAGE = "TrainJob exceeded its active deadline"

Note = Callable[[str], None]


def chart_training_runtime(values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ClusterTrainingRuntime helm/gangflow renders with api=trainjob and `values` (Helm's own
    engine, in process: the object a cluster admin installs with the chart)."""
    import helm_python
    import yaml

    from operators.config import settings
    from operators.kubernetes.runtime import merge_runtime

    merged = merge_runtime({"trainjob": {"enabled": True, "runtime": {"create": True}}, "training": {"api": "trainjob"}}, values or {})
    with helm_python.Chart.load(str(settings.PROJECT_ROOT / "helm" / "gangflow")) as chart:
        manifests = chart.render(merged, name="gangflow", namespace="gangflow-system")
    texts = [text for template, text in manifests.items() if template.endswith(".yaml")]  # not NOTES.txt
    found = [doc for text in texts for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == "ClusterTrainingRuntime"]
    if len(found) != 1:
        raise ValueError(f"the chart rendered {len(found)} ClusterTrainingRuntime objects with these values, expected 1")
    return found[0]


# --- the JobSet Trainer builds -------------------------------------------------------------------


def _merge_key(items: list) -> str | None:
    """The strategic-merge key of a list of objects: mountPath for volume mounts, else name."""
    if not items or not all(isinstance(i, Mapping) for i in items):
        return None
    for key in ("mountPath", "name"):
        if all(key in i for i in items):
            return key
    return None


def strategic_merge(base: Any, patch: Any) -> Any:
    """A runtime patch over the runtime's JobSet template: objects merge, lists of named objects
    merge by name (volume mounts by mountPath), anything else is replaced."""
    if isinstance(base, Mapping) and isinstance(patch, Mapping):
        out = dict(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        key = _merge_key(patch)
        if key and _merge_key(base) == key:
            out = [copy.deepcopy(b) for b in base]
            index = {b[key]: i for i, b in enumerate(out)}
            for item in patch:
                if item[key] in index:
                    out[index[item[key]]] = strategic_merge(out[index[item[key]]], item)
                else:
                    out.append(copy.deepcopy(item))
            return out
    return copy.deepcopy(patch)


def _upsert(items: list[dict[str, Any]], new: list[dict[str, Any]], key: str) -> None:
    """apply.UpsertEnvVars / UpsertPort: replace the item with the same key, else append."""
    for item in new:
        at = next((i for i, old in enumerate(items) if old.get(key) == item.get(key)), None)
        if at is None:
            items.append(copy.deepcopy(item))
        else:
            items[at] = copy.deepcopy(item)


def _cpus(quantity: Any) -> int:
    text = str(quantity)
    return max(1, math.ceil(int(text[:-1]) / 1000) if text.endswith("m") else math.ceil(float(text)))


def num_proc_per_node(value: Any, resources: Mapping[str, Any] | None) -> str:
    """torch.go's numProcPerNode: an integer stays; `auto` on a pod without GPUs and `cpu` become
    its CPU count (limits, else requests); `auto` with GPUs stays `auto` (torchrun counts them)."""
    if not resources or str(value) not in ("auto", "cpu"):
        return str(value)
    for kind in ("limits", "requests"):
        found = resources.get(kind) or {}
        uses_gpu = any("gpu" in name.lower() for name in found)
        if found and "cpu" in found and not (str(value) == "auto" and uses_gpu):
            return str(_cpus(found["cpu"]))
    return "auto" if str(value) == "auto" else "1"


def trainer_jobset(trainjob: Mapping[str, Any], runtime: Mapping[str, Any], *, master_port: int = TRAINER_PORT) -> dict[str, Any]:
    """The JobSet Trainer v2 creates for `trainjob` from its ClusterTrainingRuntime `runtime`: the
    runtime's template with the TrainJob's runtime patches, the trainer Job sized to numNodes, the
    container `node` given the TrainJob's image, command, args, resources and env, then the torch
    plugin's PET_* variables, which torchrun reads as its flags' defaults
    (torch/distributed/argparse_util.py `env`)."""
    meta, spec = trainjob["metadata"], trainjob.get("spec") or {}
    name, namespace = meta["name"], meta["namespace"]
    template: dict[str, Any] = copy.deepcopy(dict(runtime["spec"]["template"]))
    for patch in spec.get("runtimePatches") or []:
        patch_template = (patch.get("trainingRuntimeSpec") or {}).get("template")
        if patch_template:
            template = strategic_merge(template, patch_template)
    trainer = spec.get("trainer") or {}
    policy = runtime["spec"].get("mlPolicy") or {}
    nodes = int(trainer.get("numNodes", policy.get("numNodes", 1)))
    procs = num_proc_per_node(trainer.get("numProcPerNode", (policy.get("torch") or {}).get("numProcPerNode", "auto")), trainer.get("resourcesPerNode"))
    for rjob in template["spec"]["replicatedJobs"]:
        if ((rjob["template"].get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL) != ANCESTOR_TRAINER:
            continue
        rjob["replicas"] = 1
        job = rjob["template"]["spec"]
        job["parallelism"] = job["completions"] = nodes
        for container in job["template"]["spec"]["containers"]:
            if container["name"] != NODE:
                continue
            for key in ("image", "command", "args"):
                if key in trainer:
                    container[key] = copy.deepcopy(trainer[key])
            if trainer.get("resourcesPerNode"):
                container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
            env = container.setdefault("env", [])
            _upsert(env, list(trainer.get("env") or []), "name")
            if "torch" in policy:
                _upsert(env, [
                    {"name": "PET_NNODES", "value": str(nodes)},
                    {"name": "PET_NPROC_PER_NODE", "value": procs},
                    {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": INDEX_FIELD}}},
                    {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{name}"},
                    {"name": "PET_MASTER_PORT", "value": str(master_port)},
                ], "name")  # fmt: skip
                _upsert(container.setdefault("ports", []), [{"containerPort": master_port}], "containerPort")
    template_meta = template.get("metadata") or {}
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            **({"labels": dict(template_meta["labels"])} if template_meta.get("labels") else {}),
            **({"annotations": dict(template_meta["annotations"])} if template_meta.get("annotations") else {}),
            "ownerReferences": [{"apiVersion": TRAINER_API, "kind": "TrainJob", "name": name, "uid": meta.get("uid"), "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {**template["spec"], "suspend": bool(spec.get("suspend"))},
    }


# --- the TrainJob's status -----------------------------------------------------------------------


def _set_condition(conditions: list[dict[str, Any]], new: dict[str, Any]) -> None:
    """meta.SetStatusCondition: the transition time moves only when the status changes."""
    old = next((c for c in conditions if c["type"] == new["type"]), None)
    if old is None:
        conditions.append({**new, "lastTransitionTime": new.get("lastTransitionTime") or now()})
        return
    if old["status"] != new["status"]:
        old["lastTransitionTime"] = new.get("lastTransitionTime") or now()
    old.update(status=new["status"], reason=new["reason"], message=new["message"])


def mirrored_status(trainjob: Mapping[str, Any], jobset: Mapping[str, Any] | None, *, created: bool = True) -> dict[str, Any]:
    """The TrainJob status Trainer writes: Created once its JobSet exists, Suspended from
    spec.suspend, Complete / Failed copied from the JobSet's Completed / Failed condition (type
    renamed, reason and message kept), jobsStatus from the JobSet's replicatedJobsStatus."""
    status = copy.deepcopy(dict(trainjob.get("status") or {}))
    conditions = status.setdefault("conditions", [])
    if created and jobset is not None:
        _set_condition(conditions, {"type": "Created", "status": "True", "reason": "JobsCreationSucceeded", "message": CREATED_MESSAGE})
    if (trainjob.get("spec") or {}).get("suspend"):
        _set_condition(conditions, {"type": "Suspended", "status": "True", "reason": "Suspended", "message": SUSPENDED_MESSAGE})
    elif any(c["type"] == "Suspended" and c["status"] == "True" for c in conditions):
        _set_condition(conditions, {"type": "Suspended", "status": "False", "reason": "Resumed", "message": RESUMED_MESSAGE})
    js_status = (jobset or {}).get("status") or {}
    for js_type, tj_type in (("Completed", "Complete"), ("Failed", "Failed")):
        cond = next((c for c in js_status.get("conditions") or [] if c.get("type") == js_type and c.get("status") == "True"), None)
        if cond is not None:
            _set_condition(conditions, {**cond, "type": tj_type})
            break
    if js_status.get("replicatedJobsStatus"):
        status["jobsStatus"] = copy.deepcopy(js_status["replicatedJobsStatus"])
    if not conditions:
        del status["conditions"]
    return status


def _finished(trainjob: Mapping[str, Any]) -> bool:
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in (trainjob.get("status") or {}).get("conditions") or [])


def past_deadline(trainjob: Mapping[str, Any]) -> bool:
    """Trainer's reconcileDeadline: a running TrainJob past `spec.activeDeadlineSeconds`, counted from
    its creation or from its last resume (the Suspended condition turned False)."""
    spec = trainjob.get("spec") or {}
    seconds = spec.get("activeDeadlineSeconds")
    if not seconds or spec.get("suspend") or _finished(trainjob):
        return False
    start = (trainjob.get("metadata") or {}).get("creationTimestamp")
    resumed = next((c for c in (trainjob.get("status") or {}).get("conditions") or [] if c.get("type") == "Suspended"), None)
    if resumed is not None and resumed.get("status") == "False":
        start = resumed.get("lastTransitionTime")
    if not start:
        return False
    return seconds_since(start) > int(seconds)


class TrainerController:
    """Kueue's TrainJob integration + Trainer v2's TrainJob controller, one `reconcile` a period."""

    def __init__(self, api: InMemoryKubernetesApi, *, validator: Callable[[dict[str, Any]], None] | None = None, master_port: int = TRAINER_PORT):
        self.api = api
        self.validator = validator  # the vendored JobSet CRD: a JobSet the API server would refuse is never run
        # Trainer's ContainerTrainerPort is a constant; every pod of the drill shares 127.0.0.1, so the
        # drill gives a free port here, as it does for the JobSet path's rendezvousPort
        self.master_port = master_port
        self._admitted: set[str] = set()
        self._created: set[str] = set()
        self._inactive: set[str] = set()  # TrainJob uids whose Workload was deactivated (paused)

    def reconcile(self, note: Note) -> None:
        live = set()
        for trainjob in self.api.items(*TRAINJOBS):
            live.add(trainjob["metadata"].get("uid"))
            self._kueue(trainjob, note)
            self._workload_active(trainjob, note)
            self._trainer(trainjob, note)
        self._collect_garbage(live, note)

    # --- Kueue ---------------------------------------------------------------------------------

    def _kueue(self, trainjob: dict[str, Any], note: Note) -> None:
        """Kueue admits a suspended, queued TrainJob as one Workload (scripted: no quota is
        modelled) and unsuspends it."""
        meta = trainjob["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
        if not queue or uid in self._admitted or not (trainjob.get("spec") or {}).get("suspend"):
            return
        self._admitted.add(uid)
        stamp = now()
        nodes = int(((trainjob.get("spec") or {}).get("trainer") or {}).get("numNodes", 1))
        workload = kueue_workload(trainjob, prefix="trainjob", queue=queue, pod_sets=[{"name": NODE, "count": nodes}], stamp=stamp)
        if admit(self.api, TRAINJOBS, workload, suspend=False):
            note(f"Kueue admitted TrainJob {ns}/{name} ({nodes} pods)")

    def _workload_active(self, trainjob: dict[str, Any], note: Note) -> None:
        """Kueue and `spec.active` (a pause): a deactivated Workload is evicted (InactiveWorkload) and
        its TrainJob suspended, which Trainer passes to the JobSet (whose pods then go); activated
        again, it is admitted once those pods are gone and the TrainJob unsuspended."""
        meta = trainjob["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        if uid not in self._admitted or _finished(trainjob):
            return
        workload = next((wl for wl in self.api.items(*WORKLOADS, ns) if (wl["metadata"].get("labels") or {}).get("kueue.x-k8s.io/job-uid") == uid), None)
        if workload is None:
            return
        active, stamp = (workload.get("spec") or {}).get("active", True) is not False, now()
        if not active and uid not in self._inactive:
            self._inactive.add(uid)
            suspend, words = True, (f"Kueue evicted Workload {workload['metadata']['name']} of TrainJob {ns}/{name} "
                                    "(InactiveWorkload: spec.active is false); the TrainJob is suspended")
            set_admission(workload, admitted=False, reason="InactiveWorkload", message="The workload is deactivated", stamp=stamp)
        elif active and uid in self._inactive:
            if jobset_pods(self.api, ns, name):
                return  # the paused ranks still hold the node
            self._inactive.discard(uid)
            suspend, words = False, f"Kueue admitted Workload {workload['metadata']['name']} of TrainJob {ns}/{name} again (spec.active is true)"
            set_admission(workload, admitted=True, reason="Admitted", message="The workload is admitted", stamp=stamp)
        else:
            return
        if self.api.update_status(*TRAINJOBS, ns, name, suspend=suspend):
            note(words)

    # --- Trainer -------------------------------------------------------------------------------

    def _trainer(self, trainjob: dict[str, Any], note: Note) -> None:
        meta, spec = trainjob["metadata"], trainjob.get("spec") or {}
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        if _finished(trainjob):
            return
        if past_deadline(trainjob):
            # the Failed condition first, then the JobSet goes (its pods get SIGTERM and their grace period)
            status = copy.deepcopy(dict(trainjob.get("status") or {}))
            _set_condition(status.setdefault("conditions", []),
                           {"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": DEADLINE_EXCEEDED_MESSAGE})
            self._write_status(ns, name, status)
            self._delete_jobset(ns, name)
            note(f"Trainer: TrainJob {ns}/{name} Failed (DeadlineExceeded: past its activeDeadlineSeconds="
                 f"{spec['activeDeadlineSeconds']}); its JobSet deleted")
            return
        jobset = self.api.get(*JOBSETS, ns, name)
        if jobset is None and uid not in self._created:
            runtime_name = (spec.get("runtimeRef") or {}).get("name")
            try:
                runtime = self.api.get(*RUNTIMES, None, runtime_name)
                if runtime is None:
                    raise LookupError(f'ClusterTrainingRuntime "{runtime_name}" not found')
                jobset = trainer_jobset(trainjob, runtime, master_port=self.master_port)
                if self.validator is not None:
                    self.validator(jobset)
            except Exception as exc:  # noqa: BLE001 - Trainer reports a build failure on the TrainJob
                self._created.add(uid)
                message = f"{type(exc).__name__}: {exc}"[:32768]
                status = mirrored_status(trainjob, None)
                for cond_type, value in (("Created", "False"), ("Failed", "True")):
                    _set_condition(status.setdefault("conditions", []), {"type": cond_type, "status": value, "reason": "JobsCreationFailed", "message": message})
                self._write_status(ns, name, status)
                note(f"Trainer could not create the JobSet of TrainJob {ns}/{name}: {message}")
                return
            self._created.add(uid)
            self.api.put(*JOBSETS, jobset)
            trainer = jobset["spec"]["replicatedJobs"]
            note(f"Trainer created JobSet {ns}/{name} from ClusterTrainingRuntime {runtime_name} "
                 f"({sum(int(r['template']['spec'].get('completions') or 1) for r in trainer)} nodes)")  # fmt: skip
        if jobset is None:
            return
        if bool((jobset.get("spec") or {}).get("suspend")) != bool(spec.get("suspend")):
            with self.api._lock:
                if self.api.get(*JOBSETS, ns, name) is not None:
                    self.api.set_status(*JOBSETS, ns, name, jobset.get("status") or {}, suspend=bool(spec.get("suspend")))
        status = mirrored_status(trainjob, jobset)
        if status != (trainjob.get("status") or {}):
            self._write_status(ns, name, status)
            finished = next((c for c in status.get("conditions") or [] if c["type"] in ("Complete", "Failed") and c["status"] == "True"), None)
            if finished is not None:
                note(f"Trainer: TrainJob {ns}/{name} {finished['type']} ({finished['reason']}: {finished['message']}), from its JobSet")

    def _write_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        self.api.update_status(*TRAINJOBS, ns, name, status)

    def _collect_garbage(self, live: set[str], note: Note) -> None:
        """The garbage collector: a JobSet whose TrainJob is gone goes, and its pods with it."""
        for jobset in self.api.items(*JOBSETS):
            owners = [o for o in jobset["metadata"].get("ownerReferences") or [] if o.get("kind") == "TrainJob"]
            if not owners or owners[0].get("uid") in live:
                continue
            ns, name = jobset["metadata"]["namespace"], jobset["metadata"]["name"]
            self._delete_jobset(ns, name)
            note(f"garbage collector: JobSet {ns}/{name} deleted with its TrainJob")

    def _delete_jobset(self, ns: str, name: str) -> None:
        """The JobSet goes, and its pods with it (the kubelet stops them: SIGTERM, then the grace period)."""
        with self.api._lock:
            self.api.remove(*JOBSETS, ns, name)
            for pod in jobset_pods(self.api, ns, name):
                pod["metadata"].setdefault("deletionTimestamp", now())
