"""The drill's KubeRay (v1) RayJob controller, with Kueue's RayJob integration: what a cluster running
ray-project/kuberay does with the RayJob gangflow submits (api=rayjob), played against the API test
double. Its pods are run by the drill's kubelet (cluster.py): a real Ray cluster (head and worker
nodes as separate `ray start --block` processes), a real `ray job submit` to the head's dashboard.

Modelled on kuberay ray-operator (controllers/ray/rayjob_controller.go, common/pod.go
`setMissingRayStartParams` / `generateRayStartCommand` / `setContainerEnvVars`, common/job.go
`BuildJobSubmitCommand`) and on Kueue's RayJob integration (Kueue clears `spec.suspend`):

- jobDeploymentStatus: a suspended RayJob is `Suspended`; admitted, `Initializing` (jobId and the
  RayCluster's name `<job>-<5 random>`, startTime): the head pod `<cluster>-head-<suffix>`, the
  worker group's pods and the head Service `<cluster>-head-svc`; the container runs KubeRay's
  generated `ulimit -n 65536; ray start --head ... --block` (workers: `--address=<svc>:<port>`).
  The worker pods start once the head is ready (KubeRay injects a `wait-gcs-ready` init container
  into them, which waits for the GCS only; the drill's kubelet runs no init containers, so the
  controller holds the pods until the head pod is Ready). KubeRay injects a readinessProbe into
  each Ray container (for Ray >= 2.53 an HTTP GET of the node's agent `/api/healthz`: its raylet,
  and on the head its GCS), which the drill's kubelet runs; once every Ray pod is Ready the submitter Job's pod runs `ray job
  status || ray job submit --no-wait --submission-id <jobId> -- <entrypoint>; ray job logs
  --follow` through `/bin/bash -ce` (the entrypoint is shell text, as in KubeRay): `Running`;
- jobStatus: the Ray job's own, read from the dashboard (`GET /api/jobs/<jobId>`) as KubeRay's
  dashboard client does; SUCCEEDED -> `Complete`, FAILED or STOPPED -> `Failed` (reason
  `AppFailed`, message Ray's), a submitter Job that failed past its backoffLimit (default 2) ->
  `Failed` (`SubmissionFailed`), past `activeDeadlineSeconds` -> `Failed` (`DeadlineExceeded`);
  endTime, `succeeded` / `failed` counts; `backoffLimit` n: n new RayClusters (`Retrying`) before
  the RayJob stays Failed; `shutdownAfterJobFinishes`: the cluster's pods go when it ended.

Where the drill differs from KubeRay (stated, not hidden):

- one machine for every pod: each Ray node gets free ports of its own (`port`, `dashboard-port`,
  `ray-client-server-port`, `metrics-export-port`, `dashboard-agent-listen-port`), its own
  `temp-dir=/tmp/ray`, the dashboard on 127.0.0.1 and no usage stats: the `node_params` the drill
  adds to rayStartParams (report.json lists the argv); the kubelet gives each pod's /tmp a short name (Unix socket paths: run.py);
- the RayCluster is not an API object (its CRD is not vendored): the controller keeps it; the
  Services are, so that the kubelet maps their names to 127.0.0.1 (cluster.py `_hosts`);
- the drill's probes start at once and run every second (`DRILL_PROBE_TIMING`; KubeRay: after 10 s,
  every 5 s), so that a short drill does not wait on them; no liveness probe is injected (the
  drill's kubelet restarts no container);
- Kueue admits at once (no quota); suspending a running RayJob is not emulated.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from operators.cli.drill.api_double import InMemoryKubernetesApi, name_suffix, now
from operators.cli.drill.cluster import admit, http_get, kueue_workload, seconds_since
from operators.kubernetes.status import condition, is_true

RAYJOBS = ("ray.io", "rayjobs")
WORKLOADS = ("kueue.x-k8s.io", "workloads")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
HEAD_PORT, DASHBOARD_PORT = "6379", "8265"  # KubeRay's defaults (utils.DefaultGcsServerPort, DefaultDashboardPort)
SUBMITTER_BACKOFF = 2  # submitterConfig.backoffLimit's default
CLUSTER_LABEL, NODE_TYPE_LABEL, GROUP_LABEL = "ray.io/cluster", "ray.io/node-type", "ray.io/group"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")

Note = Callable[[str], None]
NodeParams = Callable[[str, str], dict[str, str]]  # (node type head|worker, pod name) -> rayStartParams to add


def start_params(params: dict[str, str], node_type: str, *, address: str = "") -> dict[str, str]:
    """KubeRay's `setMissingRayStartParams`: the worker's `address`, the head's `dashboard-host`,
    `metrics-export-port`, `block` and `dashboard-agent-listen-port`, where the spec has none."""
    out = dict(params)
    if node_type == "worker":
        out.setdefault("address", address)
    else:
        out.setdefault("dashboard-host", "0.0.0.0")
    out.setdefault("metrics-export-port", "8080")
    out["block"] = "true"
    out.setdefault("dashboard-agent-listen-port", "52365")
    return out


def ray_start_command(node_type: str, params: dict[str, str], limits: dict[str, Any]) -> str:
    """KubeRay's `generateRayStartCommand`: num-cpus and memory from the container's limits where
    rayStartParams has none; `true` values are bare flags (`--block`). Flags sorted (Go's map order
    is random)."""
    params = dict(params)
    if "num-cpus" not in params and str(limits.get("cpu", "")).isdigit():
        params["num-cpus"] = str(limits["cpu"])
    if "memory" not in params and limits.get("memory"):
        from operators.kubernetes.runtime import parse_quantity

        params["memory"] = str(int(parse_quantity("memory", str(limits["memory"]))))
    flags = " ".join(f"--{k}" if str(v).lower() == "true" else f"--{k}={v}" for k, v in sorted(params.items()))
    return f"ray start {'--head ' if node_type == 'head' else ''}{flags}"


# KubeRay's initLivenessAndReadinessProbe for Ray >= 2.53: one HTTP check of the node's dashboard
# agent (its raylet; on the head, its GCS too), with KubeRay's default timings
KUBERAY_PROBE_TIMING = {"initialDelaySeconds": 10, "periodSeconds": 5, "successThreshold": 1, "failureThreshold": 10}
DRILL_PROBE_TIMING = {"initialDelaySeconds": 0, "periodSeconds": 1, "successThreshold": 1, "failureThreshold": 10}


def readiness_probe(node_type: str, agent_port: int, timing: dict[str, int] = KUBERAY_PROBE_TIMING) -> dict[str, Any]:
    """The readinessProbe KubeRay injects into a Ray node's container (common/pod.go)."""
    return {"httpGet": {"path": "/api/healthz", "port": agent_port}, "timeoutSeconds": 5 if node_type == "head" else 2, **timing}


def submit_script(address: str, job_id: str, entrypoint: str) -> str:
    """KubeRay's K8sJobMode submitter (common/job.go `BuildJobSubmitCommand`, kuberay#2154): submit
    once (`ray job status` first, the Job may retry), then follow the job's logs."""
    url = address if address.startswith("http://") else f"http://{address}"
    return (f"if ! ray job status --address {url} {job_id} >/dev/null 2>&1 ; then ray job submit --address {url} --no-wait "
            f"--submission-id {job_id} -- {entrypoint.strip()} ; fi ; ray job logs --address {url} --follow {job_id}")  # fmt: skip


class Dashboard:
    """What the operator asks a Ray head over HTTP: its dashboard client's `GetJobInfo`. The
    drill's Services are this machine: the host is 127.0.0.1."""

    timeout = 2.0

    def job(self, port: int, job_id: str) -> dict[str, Any] | None:
        code, body, _ = http_get(f"http://127.0.0.1:{port}/api/jobs/{job_id}", self.timeout)
        return json.loads(body) if code == 200 and body else None


@dataclass
class RayCluster:
    """The RayCluster of one RayJob try (KubeRay's object, kept here: see the module doc)."""

    name: str
    job_uid: str
    dashboard_port: int  # the head's
    pods: list[str] = field(default_factory=list)
    waiting: list[dict[str, Any]] = field(default_factory=list)  # worker pods held for the head's GCS (wait-gcs-ready)
    submitters: list[str] = field(default_factory=list)
    next_poll: float = 0.0
    deleted: bool = False


class RayController:
    """Kueue's RayJob integration + KubeRay's RayJob controller, one `reconcile` a period.

    `node_params`: what the drill adds to each node's rayStartParams (see the module doc);
    `dashboard`: the HTTP client (a fake in unit tests); `probe_timing`: the injected readiness
    probe's timings."""

    poll_s = 1.0  # how often the Ray job's status is read (KubeRay requeues every few seconds)

    def __init__(self, api: InMemoryKubernetesApi, *, node_params: NodeParams | None = None, dashboard: Dashboard | None = None,
                 probe_timing: dict[str, int] = KUBERAY_PROBE_TIMING):  # fmt: skip
        self.api = api
        self.node_params = node_params or (lambda node_type, pod: {})
        self.probe_timing = probe_timing
        self.dashboard = dashboard or Dashboard()
        self._admitted: set[str] = set()
        self.clusters: dict[str, RayCluster] = {}  # RayJob uid -> its current RayCluster

    def reconcile(self, note: Note) -> None:
        live = set()
        for rayjob in self.api.items(*RAYJOBS):
            live.add(rayjob["metadata"]["uid"])
            self._kueue(rayjob, note)
            self._controller(rayjob, note)
        for uid in [u for u in self.clusters if u not in live]:  # the garbage collector: a deleted RayJob's cluster goes
            cluster = self.clusters.pop(uid)
            if not cluster.deleted:
                self._delete_cluster(cluster, note, why="its RayJob was deleted", submitters=True)

    # --- Kueue ---------------------------------------------------------------------------------

    def _kueue(self, rayjob: dict[str, Any], note: Note) -> None:
        meta, spec = rayjob["metadata"], rayjob.get("spec") or {}
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
        if not queue or uid in self._admitted or not spec.get("suspend"):
            return
        self._admitted.add(uid)
        cluster = spec.get("rayClusterSpec") or {}
        workers = sum(int(g.get("replicas") or 0) for g in cluster.get("workerGroupSpecs") or [])
        pod_sets = [{"name": "head", "count": 1}, {"name": "workers", "count": workers}, {"name": "submitter", "count": 1}]
        workload = kueue_workload(rayjob, prefix="rayjob", queue=queue, pod_sets=pod_sets, stamp=now())
        if admit(self.api, RAYJOBS, workload, suspend=False):
            note(f"Kueue admitted RayJob {ns}/{name} (1 head + {workers} workers + the submitter)")

    # --- KubeRay -------------------------------------------------------------------------------

    def _controller(self, rayjob: dict[str, Any], note: Note) -> None:
        meta, spec = rayjob["metadata"], rayjob.get("spec") or {}
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        old = rayjob.get("status") or {}
        status = copy.deepcopy(old)
        deployment = status.get("jobDeploymentStatus") or ""
        if deployment in ("", "New", "Suspended"):
            if spec.get("suspend"):
                status.update(jobDeploymentStatus="Suspended")
            else:  # initRayJobStatusIfNeed
                cluster = f"{name}-{name_suffix()}"
                status.update(jobId=spec.get("jobId") or f"{name}-{name_suffix()}", rayClusterName=cluster, jobStatus="",
                              jobDeploymentStatus="Initializing", startTime=now(), reason="", message="")  # fmt: skip
                status.pop("endTime", None)
                status.pop("dashboardURL", None)
        elif deployment in ("Initializing", "Running") and self._past_deadline(spec, status):
            self._fail(status, "DeadlineExceeded", f"The RayJob has passed the activeDeadlineSeconds. StartTime: {status['startTime']}. "
                       f"ActiveDeadlineSeconds: {spec['activeDeadlineSeconds']}")  # fmt: skip
        elif deployment == "Initializing":
            cluster = self.clusters.get(uid)
            if cluster is None or cluster.name != status["rayClusterName"]:
                cluster = self.clusters[uid] = self._create_cluster(rayjob, status["rayClusterName"], note)
            status["dashboardURL"] = f"{cluster.name}-head-svc.{ns}.svc.cluster.local:{cluster.dashboard_port}"
            if cluster.waiting and self._ready(cluster, ns, cluster.pods[:1]):
                # KubeRay's wait-gcs-ready init container waits for the GCS only; the drill waits for
                # the whole head (its readiness probe): on one loaded machine a head still starting its
                # dashboard left a joining raylet's GCS calls past their deadline (the node gave up)
                for pod in cluster.waiting:
                    self.api.put("", "pods", pod)
                note(f"KubeRay: the head of RayCluster {cluster.name} answers: its {len(cluster.waiting)} worker pods start")
                cluster.waiting = []
            elif self._ready(cluster, ns):
                self._submit(rayjob, cluster, status, note)
                status["jobDeploymentStatus"] = "Running"
        elif deployment == "Running":
            self._running(rayjob, status, note)
        elif deployment in ("Complete", "Failed"):
            cluster = self.clusters.get(uid)
            if cluster is not None and not cluster.deleted and spec.get("shutdownAfterJobFinishes"):
                self._delete_cluster(cluster, note, why=f"RayJob {ns}/{name} is {deployment} (shutdownAfterJobFinishes)")
        elif deployment == "Retrying":  # a new RayCluster once the old one's pods are gone
            cluster = self.clusters.get(uid)
            if cluster is not None and not cluster.deleted:  # the submitter Job goes too
                self._delete_cluster(cluster, note, why=f"RayJob {ns}/{name} is retrying", submitters=True)
            if cluster is None or not any(self.api.get("", "pods", ns, p) for p in cluster.pods + cluster.submitters):
                status["jobDeploymentStatus"] = "New"
        if status != old:
            self._write_status(ns, name, status)
            if status.get("jobDeploymentStatus") != deployment:
                why = f" ({status.get('reason')}: {status.get('message', '')[:300]})" if status.get("reason") else ""
                note(f"KubeRay: RayJob {ns}/{name} {deployment or 'New'} -> {status['jobDeploymentStatus']}, jobStatus "
                     f"{status.get('jobStatus') or '-'}{why}")  # fmt: skip

    @staticmethod
    def _past_deadline(spec: dict[str, Any], status: dict[str, Any]) -> bool:
        deadline = spec.get("activeDeadlineSeconds")
        if not deadline or not status.get("startTime"):
            return False
        return seconds_since(status["startTime"]) >= int(deadline)

    def _fail(self, status: dict[str, Any], reason: str, message: str, backoff_limit: int | None = None) -> None:
        """Failed, or `Retrying` while the RayJob's backoffLimit allows another RayCluster."""
        failed = int(status.get("failed") or 0) + 1
        status.update(failed=failed, reason=reason, message=message, endTime=now())
        status["jobDeploymentStatus"] = "Retrying" if backoff_limit is not None and failed <= backoff_limit else "Failed"

    def _running(self, rayjob: dict[str, Any], status: dict[str, Any], note: Note) -> None:
        spec, ns = rayjob["spec"], rayjob["metadata"]["namespace"]
        cluster = self.clusters.get(rayjob["metadata"]["uid"])
        if cluster is None or time.monotonic() < cluster.next_poll:
            return
        cluster.next_poll = time.monotonic() + self.poll_s
        info = self.dashboard.job(cluster.dashboard_port, status["jobId"])
        backoff = int(spec.get("backoffLimit") or 0)
        if info is not None:
            status["jobStatus"] = info.get("status") or status.get("jobStatus") or ""
            if status["jobStatus"] == "SUCCEEDED":
                status.update(jobDeploymentStatus="Complete", succeeded=int(status.get("succeeded") or 0) + 1, endTime=now(),
                              message=info.get("message") or "")  # fmt: skip
            elif status["jobStatus"] in TERMINAL:
                self._fail(status, "AppFailed", info.get("message") or f"Ray job {status['jobId']} {status['jobStatus']}", backoff)
            return
        # no Ray job (yet): the submitter Job retries its pod up to its backoffLimit, then the RayJob fails
        pods = [self.api.get("", "pods", ns, p) for p in cluster.submitters]
        phases = [((p or {}).get("status") or {}).get("phase") for p in pods]
        if phases and phases[-1] == "Failed":
            if len(phases) <= SUBMITTER_BACKOFF:
                self._submit(rayjob, cluster, status, note)
            else:
                self._fail(status, "SubmissionFailed", "Job submission has failed. Reason: BackoffLimitExceeded. Message: Job has reached "
                           "the specified backoff limit", backoff)  # fmt: skip

    # --- the objects it creates ----------------------------------------------------------------

    def _create_cluster(self, rayjob: dict[str, Any], name: str, note: Note) -> RayCluster:
        """The RayCluster's head Service, head pod and worker pods (KubeRay's RayCluster controller)."""
        ns, spec = rayjob["metadata"]["namespace"], rayjob["spec"]["rayClusterSpec"]
        head_name = f"{name}-head-{name_suffix()}"
        head_params = start_params({**spec["headGroupSpec"].get("rayStartParams", {}), **self.node_params("head", head_name)}, "head")
        port, dashboard = head_params.get("port", HEAD_PORT), head_params.get("dashboard-port", DASHBOARD_PORT)
        svc = f"{name}-head-svc"
        fqdn = f"{svc}.{ns}.svc.cluster.local"
        cluster = RayCluster(name=name, job_uid=rayjob["metadata"]["uid"], dashboard_port=int(dashboard))
        self.api.put("", "services", {"apiVersion": "v1", "kind": "Service", "metadata": {
            "name": svc, "namespace": ns, "labels": {CLUSTER_LABEL: name, NODE_TYPE_LABEL: "head"}},
            "spec": {"selector": {CLUSTER_LABEL: name, NODE_TYPE_LABEL: "head"}, "clusterIP": "None", "ports": [
                {"name": "gcs-server", "port": int(port)}, {"name": "dashboard", "port": int(dashboard)}]}})  # fmt: skip
        nodes = [("head", "headgroup", head_name, spec["headGroupSpec"]["template"], head_params)]
        for group in spec.get("workerGroupSpecs") or []:
            for _ in range(int(group.get("replicas") or 0)):
                pod = f"{name}-{group['groupName']}-worker-{name_suffix()}"
                params = start_params({**group.get("rayStartParams", {}), **self.node_params("worker", pod)}, "worker", address=f"{fqdn}:{port}")
                nodes.append(("worker", group["groupName"], pod, group["template"], params))
        for node_type, group, pod_name, template, params in nodes:
            pod = self._node_pod(rayjob, name, node_type, group, pod_name, template, params, f"{fqdn}:{port}", port)
            if node_type == "head":
                self.api.put("", "pods", pod)
            else:
                cluster.waiting.append(pod)
            cluster.pods.append(pod_name)
        note(f"KubeRay created RayCluster {ns}/{name} of RayJob {ns}/{rayjob['metadata']['name']}: Service {svc}, "
             f"head pod {head_name}, {len(nodes) - 1} worker pods")  # fmt: skip
        return cluster

    def _node_pod(self, rayjob, cluster: str, node_type: str, group: str, pod_name: str, template: dict[str, Any],
                  params: dict[str, str], address: str, port: str) -> dict[str, Any]:  # fmt: skip
        """KubeRay's `BuildPod`: labels, `/bin/bash -c -- "ulimit -n 65536; ray start ..."`, its env."""
        template = copy.deepcopy(template)
        tmeta = template.get("metadata") or {}
        labels = {"ray.io/is-ray-node": "yes", "ray.io/identifier": f"{cluster}-{node_type}", "app.kubernetes.io/created-by": "kuberay-operator",
                  **(tmeta.get("labels") or {}), CLUSTER_LABEL: cluster, NODE_TYPE_LABEL: node_type, GROUP_LABEL: group}  # fmt: skip
        container = template["spec"]["containers"][0]
        command = ray_start_command(node_type, params, (container.get("resources") or {}).get("limits") or {})
        if not container.get("command"):
            container["command"], container["args"] = ["/bin/bash", "-c", "--"], [f"ulimit -n 65536; {command}"]
        ref = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
        env = container.setdefault("env", [])
        if node_type == "worker":
            host = address.rsplit(":", 1)[0]
            env += [{"name": "FQ_RAY_IP", "value": host}, {"name": "RAY_IP", "value": host.split(".", 1)[0]}]
        env += [{"name": "RAY_CLUSTER_NAME", **ref(f"metadata.labels['{CLUSTER_LABEL}']")},
                {"name": "RAY_CLUSTER_NAMESPACE", **ref("metadata.namespace")},
                {"name": "RAY_CLOUD_INSTANCE_ID", **ref("metadata.name")},
                {"name": "RAY_NODE_TYPE_NAME", **ref(f"metadata.labels['{GROUP_LABEL}']")},
                {"name": "KUBERAY_GEN_RAY_START_CMD", "value": command}, {"name": "RAY_PORT", "value": port},
                {"name": "RAY_ADDRESS", "value": f"127.0.0.1:{port}" if node_type == "head" else address},
                {"name": "RAY_USAGE_STATS_KUBERAY_IN_USE", "value": "1"}, {"name": "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "value": "1"}]  # fmt: skip
        container.setdefault("readinessProbe", readiness_probe(node_type, int(params["dashboard-agent-listen-port"]), self.probe_timing))
        return self._pod(rayjob, pod_name, labels, template, owner={"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": cluster})

    def _submit(self, rayjob: dict[str, Any], cluster: RayCluster, status: dict[str, Any], note: Note) -> None:
        """The submitter Job's pod (K8sJobMode): the template's container, KubeRay's command and env."""
        name, ns = rayjob["metadata"]["name"], rayjob["metadata"]["namespace"]
        template = copy.deepcopy(rayjob["spec"].get("submitterPodTemplate") or rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"])
        container = template["spec"]["containers"][0]
        if not container.get("command"):
            container["command"] = ["/bin/bash", "-ce", "--"]
            container["args"] = [submit_script(status["dashboardURL"], status["jobId"], rayjob["spec"]["entrypoint"])]
        container.setdefault("env", []).extend([{"name": "RAY_DASHBOARD_ADDRESS", "value": status["dashboardURL"]},
                                                {"name": "RAY_JOB_SUBMISSION_ID", "value": status["jobId"]}])  # fmt: skip
        template["spec"]["restartPolicy"] = "Never"
        labels = {**((template.get("metadata") or {}).get("labels") or {}), "batch.kubernetes.io/job-name": name, "job-name": name}
        pod_name = f"{name}-{name_suffix()}"
        self.api.put("", "pods", self._pod(rayjob, pod_name, labels, template, owner={"apiVersion": "batch/v1", "kind": "Job", "name": name}))
        cluster.submitters.append(pod_name)
        note(f"KubeRay created the submitter pod {pod_name} of RayJob {ns}/{name}: its RayCluster {cluster.name} is ready")

    @staticmethod
    def _pod(rayjob, pod_name: str, labels: dict[str, str], template: dict[str, Any], owner: dict[str, str]) -> dict[str, Any]:
        tmeta = template.get("metadata") or {}
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": rayjob["metadata"]["namespace"], "labels": labels,
                             "annotations": dict(tmeta.get("annotations") or {}), "ownerReferences": [{**owner, "controller": True}]},
                "spec": template["spec"],
                "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "", "lastTransitionTime": now()}]}}  # fmt: skip

    def _ready(self, cluster: RayCluster, ns: str, pods: list[str] | None = None) -> bool:
        """The RayCluster (or these of its pods) is ready: every pod runs and is Ready (its readiness
        probe, which the kubelet runs, passes)."""
        if cluster.waiting and pods is None:
            return False
        for pod_name in cluster.pods if pods is None else pods:
            pod = self.api.get("", "pods", ns, pod_name)
            if pod is None or (pod.get("status") or {}).get("phase") != "Running" or not is_true(condition(pod, "Ready")):
                return False
        return True

    def _delete_cluster(self, cluster: RayCluster, note: Note, *, why: str, submitters: bool = False) -> None:
        cluster.deleted = True
        names = set(cluster.pods) | (set(cluster.submitters) if submitters else set())
        deleted = []
        with self.api._lock:
            for svc in self.api.items("", "services"):
                if (svc["metadata"].get("labels") or {}).get(CLUSTER_LABEL) == cluster.name:
                    self.api.remove("", "services", svc["metadata"]["namespace"], svc["metadata"]["name"])
            for pod in self.api.items("", "pods"):
                if pod["metadata"]["name"] in names and not pod["metadata"].get("deletionTimestamp"):
                    pod["metadata"]["deletionTimestamp"] = now()
                    deleted.append(pod["metadata"]["name"])
        if deleted:
            note(f"KubeRay deleted RayCluster {cluster.name} ({why}): {', '.join(sorted(deleted))}")

    def _write_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        self.api.update_status(*RAYJOBS, ns, name, status)


def drill_node_params(free_port: Callable[[], int]) -> NodeParams:
    """What the drill adds to each Ray node's rayStartParams (see the module doc): free ports, the
    dashboard on loopback, no usage stats (nothing leaves this machine)."""

    def params(node_type: str, pod: str) -> dict[str, str]:
        # temp-dir: the pod's own /tmp/ray, Ray's default in a pod, stated because Ray 2.60's other
        # nodes take the head's from its GCS: on one machine, the head pod's folder (workers then
        # timed out joining)
        out = {"metrics-export-port": str(free_port()), "dashboard-agent-listen-port": str(free_port()), "disable-usage-stats": "true",
               "temp-dir": "/tmp/ray"}  # fmt: skip
        if node_type == "head":
            out |= {"port": str(free_port()), "dashboard-port": str(free_port()), "ray-client-server-port": str(free_port()),
                    "dashboard-host": "127.0.0.1"}  # fmt: skip
        return out

    return params

