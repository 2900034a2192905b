"""The controllers and the kubelet of the drill: what a cluster would do with a submitted JobSet,
played against the API test double, with each pod's container run as a local process.

Scripted Kueue admission (and, with GANGFLOW_DRILL_EVENT, eviction: `DrillEvent`), the Job controller (one pod per completion index, backoffLimit 0) and a
kubelet (env, `$(VAR)` expansion, path rewrites, CPU pinning, the terminated state). Every process
of a pod carries `GANGFLOW_DRILL_POD=<drill id>/<pod>`: how the drill finds what it started.
"""

from __future__ import annotations

import collections
import copy
import functools
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from operators.cli.drill.api_double import InMemoryKubernetesApi, name_suffix, now
from operators.cli.drill.image import Image
from operators.cli.drill.pods import ContainerConfigError, Rewrites, differences, expand_argv, process_env, resolve_env
from operators.kubernetes.status import parse_time
from operators.utils.processes import pids_in_folder, pids_with_env

JS = ("jobset.x-k8s.io", "jobsets")
KQ = ("kueue.x-k8s.io", "workloads")
POD_MARKER = "GANGFLOW_DRILL_POD"
AUDIT_ENV = "GANGFLOW_DRILL_AUDIT"
TERMINATION_LOG = "/dev/termination-log"
NODE = "drill-node"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
FALLBACK_LINES, FALLBACK_BYTES, MESSAGE_BYTES = 80, 2048, 4096


EVENT_ENV = "GANGFLOW_DRILL_EVENT"
_EVENT = re.compile(r"^(?:(?P<action>preempt|pause|lose-worker)@step=(?P<step>\d+)|(?P<always>no-quota))$")
PAUSE_SECONDS = 3  # how long the drill's `pause` event keeps the gang paused before resuming it


@dataclass
class DrillEvent:
    """What the drill's cluster does to the running gang once its checkpoint `step` is committed:
    `preempt` (Kueue evicts the Workload, reason Preempted; a new gang is admitted again),
    `pause` (`python -m operators.cli.gang pause`, then `resume` PAUSE_SECONDS later), with
    MultiKueue `lose-worker` (the worker cluster running the gang is lost: multikueue.py), or, from
    the start, `no-quota` (Kueue never has quota for the gang: its Workload stays pending)."""

    action: str
    step: int
    fired: bool = False

    @property
    def spec(self) -> str:
        return f"{self.action}@step={self.step}"


def parse_drill_event(text: str | None) -> DrillEvent | None:
    """GANGFLOW_DRILL_EVENT (empty: none); ValueError naming the variable and what it accepts."""
    if not text or not text.strip():
        return None
    match = _EVENT.fullmatch(text.strip())
    if match and match["always"]:
        return DrillEvent(match["always"], 0)
    if not match or int(match["step"]) < 1:
        raise ValueError(f"{EVENT_ENV}={text!r}: accepted values: preempt@step=N, pause@step=N, lose-worker@step=N "
                         "(N >= 1, a checkpoint step; lose-worker with MultiKueue) or no-quota")
    return DrillEvent(match["action"], int(match["step"]))


JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # on each pod the JobSet controller creates


def jobset_pods(api: InMemoryKubernetesApi, ns: str, name: str) -> list[dict[str, Any]]:
    """The pods of JobSet ns/name (also those being deleted)."""
    return [p for p in api.items("", "pods", ns) if (p["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL) == name]


def set_admission(workload: dict[str, Any], *, admitted: bool, reason: str, message: str, stamp: str) -> None:
    """Kueue's QuotaReserved, Admitted and Evicted conditions for an admission (Evicted False) or an
    eviction (QuotaReserved and Admitted False), the others kept."""
    kept = [c for c in workload["status"]["conditions"] if c["type"] not in ("QuotaReserved", "Admitted", "Evicted")]
    held, evicted = ("True", "False") if admitted else ("False", "True")
    workload["status"]["conditions"] = kept + [
        {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": stamp}
        for kind, status in (("QuotaReserved", held), ("Admitted", held), ("Evicted", evicted))
    ]


def admit(api: InMemoryKubernetesApi, resource: tuple[str, str], workload: dict[str, Any], **unsuspend: Any) -> bool:
    """Kueue admits a job object whole: its Workload put and the object unsuspended (`unsuspend`:
    the spec fields that do it), unless the object is gone meanwhile (False then)."""
    meta = workload["metadata"]
    owner = meta["ownerReferences"][0]["name"]
    with api._lock:
        if api.get(*resource, meta["namespace"], owner) is None:
            return False
        api.put(*KQ, workload)
        return api.update_status(*resource, meta["namespace"], owner, **unsuspend)


def kueue_workload(owner: dict[str, Any], *, prefix: str, queue: str, pod_sets: list[dict[str, Any]], stamp: str,
                   admitted: bool = True) -> dict[str, Any]:  # fmt: skip
    """The Workload the drill's Kueue makes for `owner` (a JobSet, TrainJob or MPIJob; `prefix` its
    kind in lower case, as Kueue names Workloads): admitted (scripted: no quota is modelled), or
    without conditions, for the caller to set."""
    meta = owner["metadata"]
    name, uid = meta["name"], meta["uid"]
    conditions = [
        {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "lastTransitionTime": stamp,
         "message": "Quota reserved in the drill's ClusterQueue (scripted by the drill: no quota is modelled)"},
        {"type": "Admitted", "status": "True", "reason": "Admitted", "lastTransitionTime": stamp, "message": "The workload is admitted"},
    ] if admitted else []  # fmt: skip
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": f"{prefix}-{name}-{uid[:5]}", "namespace": meta["namespace"], "labels": {"kueue.x-k8s.io/job-uid": uid},
                     "ownerReferences": [{"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": name, "uid": uid, "controller": True}]},
        "spec": {"active": True, "queueName": queue, "podSets": pod_sets},
        "status": {"conditions": conditions},
    }  # fmt: skip


def ready_conditions(ready: bool, container: str, stamp: str) -> list[dict[str, str]]:
    """A running pod's Ready and ContainersReady conditions, in the kubelet's words."""
    if ready:
        return [{"type": "Ready", "status": "True", "lastTransitionTime": stamp},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": stamp}]  # fmt: skip
    message = f"containers with unready status: [{container}]"
    return [{"type": kind, "status": "False", "reason": "ContainersNotReady", "message": message, "lastTransitionTime": stamp}
            for kind in ("Ready", "ContainersReady")]  # fmt: skip


def http_get(url: str, timeout: float, context: ssl.SSLContext | None = None) -> tuple[int, bytes, str]:
    """GET a pod's port as a kubelet or an operator does: (status, body, ""), or (0, b"", why) when
    nothing answers or what answers is not HTTP."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:  # noqa: S310 (a pod's port on this machine)
            return resp.status, resp.read(), ""
    except urllib.error.HTTPError as exc:
        return exc.code, b"", ""
    except (OSError, ValueError, http.client.HTTPException) as exc:  # HTTPException: not an HTTP server there
        return 0, b"", str(exc)


def seconds_since(stamp: str) -> float:
    """Seconds from a Kubernetes timestamp (`now()`'s format) to now: how long an object has been active."""
    return time.time() - parse_time(stamp)


def processes_with_marker(marker: str) -> list[int]:
    """PIDs whose environment has `GANGFLOW_DRILL_POD=<marker>...`."""
    return pids_with_env(POD_MARKER, marker, prefix=True)


def kill_marked(marker: str, sig: int = signal.SIGKILL, folder: Path | None = None) -> int:
    """Signal the processes of a pod (or a drill: `marker` a prefix): those with its marker, and
    with `folder` those working below it (as a container's cgroup holds them all)."""
    pids = sorted(set(processes_with_marker(marker)) | set(pids_in_folder(str(folder)) if folder else ()))
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return len(pids)


@dataclass
class ReadinessProbe:
    """A container's readinessProbe as the kubelet runs it (pkg/probe/http, pkg/probe/tcp): an HTTP
    GET that answers 200-399, or a TCP port that accepts, every `period` s after `delay`; Ready after
    `success` passes in a row, not Ready after `failure` misses in a row. httpGet and tcpSocket
    only: nothing gangflow renders or the drill's KubeRay injects uses exec or grpc probes."""

    port: int
    path: str | None = None  # None: a tcpSocket probe
    scheme: str = "HTTP"
    host: str = "127.0.0.1"  # the pod's IP: this machine
    delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    success: int = 1
    failure: int = 3

    @classmethod
    def from_container(cls, container: dict[str, Any]) -> ReadinessProbe | None:
        probe = container.get("readinessProbe")
        if not probe:
            return None
        handler = probe.get("httpGet") or probe.get("tcpSocket")
        if handler is None:
            kind = next((k for k in ("exec", "grpc") if k in probe), "none")
            raise ContainerConfigError(f"readinessProbe: the drill's kubelet runs httpGet and tcpSocket probes, not {kind}")
        port = handler.get("port")
        if isinstance(port, str):  # a named container port
            port = next((p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port), None)
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ContainerConfigError(f"readinessProbe: port {handler.get('port')!r} is not a port number or a named port of the container")
        return cls(port=port, path=handler.get("path", "/") if "httpGet" in probe else None, scheme=handler.get("scheme", "HTTP"),
                   delay=float(probe.get("initialDelaySeconds", 0)), period=float(probe.get("periodSeconds", 10)),
                   timeout=float(probe.get("timeoutSeconds", 1)), success=int(probe.get("successThreshold", 1)),
                   failure=int(probe.get("failureThreshold", 3)))  # fmt: skip

    def check(self) -> str | None:
        """None when the probe passes, else why not (the kubelet's words)."""
        if self.path is None:
            try:
                socket.create_connection((self.host, self.port), timeout=self.timeout).close()
                return None
            except OSError as exc:
                return f"dial tcp {self.host}:{self.port}: {exc}"
        url = f"{self.scheme.lower()}://{self.host}:{self.port}{self.path}"
        context = ssl._create_unverified_context() if self.scheme == "HTTPS" else None  # noqa: S323 (the kubelet does not verify either)
        code, _, error = http_get(url, self.timeout, context)
        if error:
            return f"Get {url}: {error}"
        return None if 200 <= code < 400 else f"HTTP probe failed with statuscode: {code}"

    def watch(self, run: PodRun, stop: threading.Event, missed: Callable[[str], None]) -> None:
        """The prober worker of one container: updates `run.ready` until the container ends;
        `missed(why)` on each failed probe (the kubelet's Unhealthy event)."""
        if stop.wait(self.delay):
            return
        passes = misses = 0
        while not stop.is_set() and run.proc is not None and run.proc.poll() is None:
            why = self.check()
            passes, misses = (passes + 1, 0) if why is None else (0, misses + 1)
            if why is not None:
                missed(why)
            if not run.ready and passes >= self.success:
                run.ready = True
            elif run.ready and misses >= self.failure:
                run.ready = False
            stop.wait(self.period)


@dataclass
class PodRun:
    """One emulated container: the process and what it was started with."""

    namespace: str
    name: str
    dir: Path
    marker: str
    rendered_argv: list[str] = field(default_factory=list)
    rendered_env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started_at: str = ""
    finished_at: str = ""
    exit_code: int | None = None
    deleting_since: float | None = None
    grace: float = 30.0
    # spec.activeDeadlineSeconds: past it the kubelet stops the container and fails the pod DeadlineExceeded
    deadline_s: float | None = None
    running_since: float | None = None  # monotonic
    deadline_exceeded: bool = False
    log_lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2000))
    reader: threading.Thread | None = None
    gang: str = ""  # the pod's gangflow.io/gang label
    readiness: ReadinessProbe | None = None  # the container's readinessProbe: Ready only once it passes
    ready: bool = True  # what the probe last concluded (True: no probe)
    ready_reported: bool = True  # what the pod's status says

    @property
    def log_path(self) -> Path:
        return self.dir / "container.log"

    @property
    def audit_path(self) -> Path:
        return self.dir / "audit.paths"

    def record(self) -> dict[str, Any]:
        return {
            "pod": self.name, "namespace": self.namespace, "dir": str(self.dir),
            "rendered_argv": self.rendered_argv, "argv": self.argv,
            "rendered_env": self.rendered_env, "env": self.env,
            # what differs between the rendered container and the process: the host and the mounts
            "rewrites": differences(self.rendered_argv, self.argv) + differences(self.rendered_env, self.env),
            "exit_code": self.exit_code, "started_at": self.started_at, "finished_at": self.finished_at,
        }  # fmt: skip


class ReconcileLoop:
    """A controller of the drill: `reconcile()` every `period` s on a thread of its own; an error is
    kept in `error` (the drill fails on it) and noted. Subclasses set `what`, `period`, `_note`."""

    what = "emulation"
    period = 0.2
    error: BaseException | None = None

    def start(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"drill-{self.what.split()[0].lower()}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception as exc:  # visible in the drill's output, and the drill fails on it
                self.error = exc
                self._note(f"{self.what} error: {type(exc).__name__}: {exc}")
            self._stop.wait(self.period)

    def _halt(self) -> None:
        """Stop reconciling (the thread ends within one period)."""
        if getattr(self, "_thread", None) is not None:
            self._stop.set()
            self._thread.join(10)

    def reconcile(self) -> None:
        raise NotImplementedError

    def _note(self, message: str) -> None:
        raise NotImplementedError


class EmulatedCluster(ReconcileLoop):
    """Kueue + Job controller + one kubelet, reconciling the API test double every `period` s."""

    what = "cluster emulation"

    def __init__(
        self,
        api: InMemoryKubernetesApi,
        *,
        workdir: Path,
        image: Image,
        audit_dir: Path,
        drill_id: str,
        extra_env: dict[str, str] | None = None,
        period: float = 0.2,
        echo=None,
        controllers=(),
        event: DrillEvent | None = None,
        committed_step: Callable[[], int | None] | None = None,
        runtime=None,
        tmp_alias: Callable[[Path], Path] | None = None,
        pin: bool = True,
    ):
        self.api = api
        self.workdir = Path(workdir)
        self.image = image
        self.audit_dir = Path(audit_dir)
        self.drill_id = drill_id
        self.extra_env = dict(extra_env or {})
        self.period = period
        self.echo = echo
        self.controllers = list(controllers)  # reconciled before the JobSets (trainer_controller.TrainerController)
        self.runtime = runtime  # None: each pod's container as local processes; else a PodmanRuntime
        # a short name for a pod's /tmp folder (api=rayjob: Ray's Unix sockets live there, and a
        # socket path may not exceed 107 bytes); None: the folder's own path
        self.tmp_alias = tmp_alias
        self.pin = pin  # CPU-pin each container to as many CPUs as its limit (not for Ray pods: run.py)
        self.runs: dict[tuple[str, str], PodRun] = {}
        self.history: list[PodRun] = []
        self.events: list[str] = []
        self._started_gangs: set[str] = set()  # JobSet uids whose pods were created
        self._finished_gangs: set[str] = set()
        self._evicted_gangs: set[str] = set()  # JobSet uids Kueue evicted: never admitted again
        self._inactive_gangs: set[str] = set()  # JobSet uids whose Workload was deactivated (paused)
        self.event = event
        self.committed_step = committed_step  # the newest committed checkpoint step of the run, or None
        self._next_probe = 0.0
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._next_cpu = 0

    # --- lifecycle -----------------------------------------------------------------------------

    def stop(self, grace: float = 5.0, *, keep_pod_grace: bool = True) -> None:
        """Stop reconciling; SIGTERM every pod's first process, then SIGKILL every pod process
        after `grace` seconds. With `keep_pod_grace`, a pod already being deleted is not signalled
        again and keeps the rest of its own grace period, as a kubelet's would: a DAG run can end
        (a TrainJob failed past its deadline) while its ranks still commit their final checkpoint."""
        self._halt()
        deadline = time.monotonic() + grace
        for run in list(self.runs.values()):
            if run.proc is None or run.proc.poll() is not None:
                continue
            if keep_pod_grace and run.deleting_since is not None:
                deadline = max(deadline, run.deleting_since + run.grace)
                continue
            try:
                run.proc.send_signal(signal.SIGTERM)
            except OSError:
                pass
        while time.monotonic() < deadline and processes_with_marker(self.drill_id + "/"):
            time.sleep(0.2)
        kill_marked(self.drill_id + "/", folder=self.workdir)
        for run in list(self.runs.values()):
            if run.proc is not None:
                try:
                    run.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass

    def _note(self, message: str) -> None:
        self.events.append(message)
        if self.echo:
            self.echo(f"[cluster] {message}")

    # --- reconcile -----------------------------------------------------------------------------

    def reconcile(self) -> None:
        for controller in self.controllers:
            controller.reconcile(self._note)
        for jobset in self.api.items(*JS):
            self._workload_active(jobset)
            self._kueue(jobset)
            self._job_controller(jobset)
        self._kubelet()
        self._drill_event()

    def _drill_event(self) -> None:
        """Fire the drill's event at the running gang once checkpoint `event.step` is committed."""
        event = self.event
        if event is None or event.fired or event.step < 1 or self.committed_step is None or time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + 0.25  # a listing of the bucket: milliseconds
        step = self.committed_step()
        if step is None or step < event.step:
            return
        for jobset in self.api.items(*JS):
            uid = jobset["metadata"]["uid"]
            if uid in self._started_gangs and uid not in self._finished_gangs and not jobset["spec"].get("suspend"):
                event.fired = True
                if event.action == "pause":
                    threading.Thread(target=self._pause_and_resume, args=(jobset, step), name="drill-pause", daemon=True).start()
                else:
                    self._evict(jobset, f"checkpoint step-{step} committed: drill event {event.spec}")
                return

    def _pause_and_resume(self, jobset: dict[str, Any], step: int) -> None:
        """The drill's `pause` event through the documented command (`python -m operators.cli.gang`),
        run in this process: a new interpreter would take seconds, and the drill's gang is short."""
        from operators.cli import gang as gang_cli

        meta = jobset["metadata"]
        ns, owner = meta["namespace"], next(iter(meta.get("ownerReferences") or []), None)
        if owner is not None and owner.get("kind") == "TrainJob":  # Trainer's JobSet: the gang is its TrainJob
            meta = (self.api.get("trainer.kubeflow.org", "trainjobs", ns, owner["name"]) or {}).get("metadata") or {}
        gang = (meta.get("labels") or {}).get("gangflow.io/gang", "")
        kubeconfig = self.workdir / "gang-cli-kubeconfig.json"  # JSON is YAML
        kubeconfig.write_text(json.dumps(self.api.kubeconfig(ns)))
        for action, extra in (("pause", ["--reason", f"drill event pause@step={step}"]), ("resume", [])):
            if action == "resume":
                time.sleep(PAUSE_SECONDS)
            argv = [action, gang, "--namespace", ns, "--kubeconfig", str(kubeconfig), *extra]
            code, result = gang_cli.control(argv)
            self._note(f"python -m operators.cli.gang {action} {gang}: exit {code}: {json.dumps(result)}")
            if code != 0:
                self.error = RuntimeError(f"operators.cli.gang {action} failed: {result}")
                return

    def _evict(self, jobset: dict[str, Any], why: str) -> None:
        """Kueue preempts the gang's Workload: Evicted (Preempted), the JobSet suspended, its pods
        get DisruptionTarget and are deleted (the kubelet sends SIGTERM: the ranks commit a final
        checkpoint and exit 75). The evicted JobSet is not admitted again; a new one is."""
        meta = jobset["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        stamp = now()
        message = f"Preempted to accommodate a higher priority Workload ({why})"
        workload = "?"
        with self.api._lock:
            self._evicted_gangs.add(uid)
            for wl in self.api.items(*KQ, ns):
                if (wl["metadata"].get("labels") or {}).get("kueue.x-k8s.io/job-uid") == uid:
                    workload = wl["metadata"]["name"]
                    set_admission(wl, admitted=False, reason="Preempted", message=message, stamp=stamp)
            jobset["spec"]["suspend"] = True
            for pod in jobset_pods(self.api, ns, name):
                pod.setdefault("status", {}).setdefault("conditions", []).append(
                    {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByKueue", "message": message, "lastTransitionTime": stamp})
                pod["metadata"]["deletionTimestamp"] = stamp
        self._note(f"Kueue evicted Workload {workload} of JobSet {ns}/{name} (Preempted: {why}); its pods get DisruptionTarget and SIGTERM")

    def _workload_active(self, jobset: dict[str, Any]) -> None:
        """Kueue and `spec.active` (a pause): a deactivated admitted Workload is evicted (InactiveWorkload,
        quota released, the JobSet suspended, its pods deleted: SIGTERM, final checkpoint); activated
        again, it is admitted once those pods are gone and the JobSet's pods are created anew."""
        meta = jobset["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        if uid in self._finished_gangs or uid in self._evicted_gangs:
            return
        workload = next((wl for wl in self.api.items(*KQ, ns) if (wl["metadata"].get("labels") or {}).get("kueue.x-k8s.io/job-uid") == uid), None)
        if workload is None:
            return
        active = (workload.get("spec") or {}).get("active", True) is not False
        stamp = now()
        if not active and uid not in self._inactive_gangs:
            message = "The workload is deactivated"
            with self.api._lock:
                self._inactive_gangs.add(uid)
                set_admission(workload, admitted=False, reason="InactiveWorkload", message=message, stamp=stamp)
                jobset["spec"]["suspend"] = True
                for pod in jobset_pods(self.api, ns, name):
                    pod["metadata"]["deletionTimestamp"] = stamp
            self._note(f"Kueue evicted Workload {workload['metadata']['name']} of JobSet {ns}/{name} (InactiveWorkload: spec.active is false); "
                       "the JobSet is suspended, its pods get SIGTERM")  # fmt: skip
        elif active and uid in self._inactive_gangs:
            if jobset_pods(self.api, ns, name):
                return  # the paused ranks still hold the node
            with self.api._lock:
                self._inactive_gangs.discard(uid)
                self._started_gangs.discard(uid)  # the JobSet controller creates its Jobs (and pods) again
                set_admission(workload, admitted=True, reason="Admitted", message="The workload is admitted", stamp=stamp)
                jobset["spec"]["suspend"] = False
            self._note(f"Kueue admitted Workload {workload['metadata']['name']} of JobSet {ns}/{name} again (spec.active is true)")

    def _kueue(self, jobset: dict[str, Any]) -> None:
        meta = jobset["metadata"]
        if not (jobset.get("spec") or {}).get("suspend"):
            return
        if "kueue.x-k8s.io/queue-name" not in (meta.get("labels") or {}) or meta["uid"] in self._evicted_gangs | self._inactive_gangs:
            return
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        stamp = now()
        count = sum(int(rj.get("replicas", 1)) * int(rj["template"]["spec"].get("parallelism") or 1) for rj in jobset["spec"]["replicatedJobs"])
        no_quota = self.event is not None and self.event.action == "no-quota"
        if no_quota and any((wl["metadata"].get("labels") or {}).get("kueue.x-k8s.io/job-uid") == uid for wl in self.api.items(*KQ, ns)):
            return  # still pending: nothing frees quota in this cluster
        workload = kueue_workload(jobset, prefix="jobset", queue=meta["labels"]["kueue.x-k8s.io/queue-name"],
                                  pod_sets=[{"name": "rank", "count": count}], stamp=stamp)
        if no_quota:  # Kueue's own words for a ClusterQueue without room for the gang
            workload["status"]["conditions"] = [
                {"type": "QuotaReserved", "status": "False", "reason": "Pending", "lastTransitionTime": stamp,
                 "message": f"couldn't assign flavors to pod set rank: insufficient unused quota for cpu in flavor default-flavor, {count} more needed"}]  # fmt: skip
            with self.api._lock:
                if self.api.get(*JS, ns, name) is not None:
                    self.api.put(*KQ, workload)
            self._note(f"Kueue has no quota for JobSet {ns}/{name} ({count} pods): its Workload stays pending (drill event no-quota)")
            return
        with self.api._lock:
            if self.api.get(*JS, ns, name) is None:
                return
            self.api.put(*KQ, workload)
            self.api.set_status(*JS, ns, name, {"conditions": [{"type": "Suspended", "status": "False", "reason": "ResumeJobs", "message": "jobset is resumed", "lastTransitionTime": stamp}], "restarts": 0}, suspend=False)
        self._note(f"Kueue admitted JobSet {ns}/{name} ({count} pods)")

    def _job_controller(self, jobset: dict[str, Any]) -> None:
        meta, spec = jobset["metadata"], jobset.get("spec") or {}
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        if uid in self._finished_gangs:
            return
        if spec.get("suspend"):
            self._suspend_jobs(jobset)
            return
        if uid not in self._started_gangs:
            self._started_gangs.add(uid)
            subdomain = ((spec.get("network") or {}).get("subdomain")) or name
            for rj in spec["replicatedJobs"]:
                for job_index in range(int(rj.get("replicas", 1))):
                    job_spec = rj["template"]["spec"]
                    for index in range(int(job_spec.get("completions") or job_spec.get("parallelism") or 1)):
                        self.api.put("", "pods", self._pod(jobset, rj, job_index, index, subdomain))
            self._note(f"Job controller created the pods of JobSet {ns}/{name}")
            return
        pods = jobset_pods(self.api, ns, name)
        failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
        total = sum(int(rj.get("replicas", 1)) * int(rj["template"]["spec"].get("completions") or 1) for rj in spec["replicatedJobs"])
        succeeded = [p for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"]
        stamp = now()
        if failed:
            self._finished_gangs.add(uid)
            first = failed[0]["metadata"]["name"]
            for pod in pods:  # backoffLimit 0 / podFailurePolicy FailJob: the Job ends, active pods go
                if (pod.get("status") or {}).get("phase") not in ("Failed", "Succeeded"):
                    self._delete_pod(ns, pod["metadata"]["name"])
            self._set_terminal(ns, name, stamp, "Failed", "FailedJobs", "jobset failed due to one or more job failures")
            self._note(f"JobSet {ns}/{name} failed: pod {first} failed; the Job controller deletes the others")
        elif len(succeeded) == total:
            self._finished_gangs.add(uid)
            self._set_terminal(ns, name, stamp, "Completed", "AllJobsCompleted", "jobset completed successfully")
            self._note(f"JobSet {ns}/{name} completed")

    def _suspend_jobs(self, jobset: dict[str, Any]) -> None:
        """A started JobSet suspended (by Kueue, or by Trainer for its TrainJob): its Jobs are
        suspended, so their pods are deleted (SIGTERM: a final checkpoint); unsuspending creates
        them anew (Kueue admits it again only once the old ones are gone)."""
        meta = jobset["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        if uid not in self._started_gangs:
            return
        self._started_gangs.discard(uid)  # unsuspended, its Jobs create their pods anew
        stamp, stopping = now(), []
        with self.api._lock:
            for pod in jobset_pods(self.api, ns, name):
                if not pod["metadata"].get("deletionTimestamp"):
                    pod["metadata"]["deletionTimestamp"] = stamp
                    stopping.append(pod["metadata"]["name"])
        if stopping:
            self._note(f"JobSet {ns}/{name} suspended: the Job controller deletes its pods ({', '.join(stopping)})")

    def _set_terminal(self, ns: str, name: str, stamp: str, state: str, reason: str, message: str) -> None:
        """The JobSet controller's terminal status: `state` is "Failed" or "Completed"."""
        failed = state == "Failed"
        status = {
            "conditions": [
                {"type": "Suspended", "status": "False", "reason": "ResumeJobs", "message": "jobset is resumed", "lastTransitionTime": stamp},
                {"type": state, "status": "True", "reason": reason, "message": message, "lastTransitionTime": stamp},
            ],
            "replicatedJobsStatus": [{"name": "rank", "ready": 0, "succeeded": int(not failed), "failed": int(failed), "active": 0, "suspended": 0}],
            "restarts": 0,
            "terminalState": state,
        }  # fmt: skip
        self.api.update_status(*JS, ns, name, status)

    def _pod(self, jobset: dict[str, Any], rj: dict[str, Any], job_index: int, index: int, subdomain: str) -> dict[str, Any]:
        js_name, ns = jobset["metadata"]["name"], jobset["metadata"]["namespace"]
        job_name = f"{js_name}-{rj['name']}-{job_index}"
        template = copy.deepcopy(rj["template"]["spec"]["template"])
        meta = template.get("metadata") or {}
        labels = {
            **(rj["template"].get("metadata") or {}).get("labels", {}),
            **(meta.get("labels") or {}),
            INDEX_KEY: str(index),
            "batch.kubernetes.io/job-name": job_name,
            "job-name": job_name,
            JOBSET_NAME_LABEL: js_name,
            "jobset.sigs.k8s.io/replicatedjob-name": rj["name"],
            "jobset.sigs.k8s.io/job-index": str(job_index),
            "kueue.x-k8s.io/podset": rj["name"],
        }
        annotations = {**(meta.get("annotations") or {}), INDEX_KEY: str(index), JOBSET_NAME_LABEL: js_name}
        spec = template["spec"]
        spec["hostname"] = f"{job_name}-{index}"
        spec["subdomain"] = subdomain
        for container in spec.get("containers") or []:  # what the Job controller adds to Indexed Jobs
            env = container.setdefault("env", [])
            if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in env):
                env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}})
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{job_name}-{index}-{name_suffix()}", "generateName": f"{job_name}-{index}-", "namespace": ns, "labels": labels, "annotations": annotations},
            "spec": spec,
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "", "lastTransitionTime": now()}]},
        }

    def _delete_pod(self, ns: str, name: str) -> None:
        with self.api._lock:
            pod = self.api.get("", "pods", ns, name)
            if pod is not None and not pod["metadata"].get("deletionTimestamp"):
                pod["metadata"]["deletionTimestamp"] = now()

    # --- kubelet -------------------------------------------------------------------------------

    def _lookup(self, kind: str, namespace: str, name: str):
        plural = {"Secret": "secrets", "ConfigMap": "configmaps"}[kind]
        return self.api.get("", plural, namespace, name)

    def _kubelet(self) -> None:
        live = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in self.api.items("", "pods")}
        # a gang's terminating containers still hold the node's resources (CPUs, accelerators): a
        # re-launched gang's pods stay Pending until they stopped (after a preemption: their final checkpoint)
        holding = {run.gang for run in self.runs.values() if run.gang and run.proc is not None and run.proc.poll() is None
                   and (live.get((run.namespace, run.name)) is None or live[(run.namespace, run.name)]["metadata"].get("deletionTimestamp"))}
        for key, pod in live.items():
            if key not in self.runs and (pod.get("status") or {}).get("phase") == "Pending" and not pod["metadata"].get("deletionTimestamp"):
                if (pod["metadata"].get("labels") or {}).get("gangflow.io/gang") in holding:
                    continue
                self._start(pod)
        for key, run in list(self.runs.items()):
            pod = live.get(key)
            alive = run.proc is not None and run.proc.poll() is None
            if alive and not run.deadline_exceeded and run.deadline_s is not None and run.running_since is not None \
                    and time.monotonic() - run.running_since >= run.deadline_s:
                run.deadline_exceeded = True
                self._note(f"pod {run.name} active longer than its activeDeadlineSeconds={run.deadline_s:.0f}")
            if alive and (pod is None or pod["metadata"].get("deletionTimestamp") or run.deadline_exceeded):
                self._terminate(run)
            if run.proc is not None and run.proc.poll() is not None and run.exit_code is None:
                self._finished(run)
            if run.exit_code is not None or run.proc is None:
                if pod is not None and pod["metadata"].get("deletionTimestamp"):
                    self.api.remove("", "pods", *key)  # a deleted pod is gone once its container ended
                if pod is None or pod["metadata"].get("deletionTimestamp"):
                    if run.reader is None or not run.reader.is_alive():
                        del self.runs[key]
            elif pod is not None:
                self.api.logs[key] = "".join(run.log_lines)
                if alive and run.ready != run.ready_reported and not pod["metadata"].get("deletionTimestamp"):
                    self._report_readiness(run)

    def _hosts(self, pod: dict[str, Any]) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        hosts = {}
        subdomain = pod["spec"].get("subdomain")
        for other in self.api.items("", "pods", ns):  # the gang's DNS names -> this machine
            spec = other.get("spec") or {}
            if spec.get("subdomain") == subdomain and spec.get("hostname"):
                for suffix in ("", f".{ns}.svc.cluster.local", f".{ns}.svc", f".{ns}"):
                    hosts[f"{spec['hostname']}.{subdomain}{suffix}"] = "127.0.0.1"
        for service in self.api.items("", "services", ns):  # a Service's DNS names (the Ray head's): this machine too
            for suffix in ("", f".{ns}.svc.cluster.local", f".{ns}.svc", f".{ns}"):
                hosts[f"{service['metadata']['name']}{suffix}"] = "127.0.0.1"
        return dict(sorted(hosts.items(), key=lambda kv: -len(kv[0])))

    def _rewrites(self, pod: dict[str, Any], run: PodRun) -> Rewrites:
        hosts = self._hosts(pod)
        tmp = run.dir / "tmp"
        mounts = {**self.image.mounts}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for volume_mount in pod["spec"]["containers"][0].get("volumeMounts") or []:
            if volume_mount["mountPath"] == "/tmp":
                mounts["/tmp"] = str(self.tmp_alias(tmp) if self.tmp_alias else tmp)
            elif volume_mount["mountPath"] == "/dev/shm":
                pass  # the host's /dev/shm (Memory emptyDir); nothing in the drill names it
            elif (volumes.get(volume_mount["name"]) or {}).get("configMap"):
                mounts[volume_mount["mountPath"]] = str(self._config_map_volume(pod, run, volumes[volume_mount["name"]]))
            elif (volumes.get(volume_mount["name"]) or {}).get("persistentVolumeClaim"):
                mounts[volume_mount["mountPath"]] = str(self._claim_volume(pod, volumes[volume_mount["name"]]))
            else:
                raise ContainerConfigError(f"volume mount {volume_mount['mountPath']}: the drill provides /tmp, /dev/shm, "
                                           "configMap and persistentVolumeClaim volumes only")  # fmt: skip
        mounts[pod["spec"]["containers"][0].get("terminationMessagePath") or TERMINATION_LOG] = str(run.dir / "termination-log")
        return Rewrites(hosts=hosts, mounts=mounts)

    def _claim_volume(self, pod: dict[str, Any], volume: dict[str, Any]) -> Path:
        """A PersistentVolumeClaim's volume: one folder a claim, shared by every pod that mounts it (a
        ReadWriteMany claim; the checkpoint PVC of api=rayjob). Pod names cannot start with '.'."""
        claim = volume["persistentVolumeClaim"]["claimName"]
        if self.api.get("", "persistentvolumeclaims", pod["metadata"]["namespace"], claim) is None:  # the kubelet's FailedMount
            raise ContainerConfigError(f'MountVolume.SetUp failed for volume "{volume["name"]}": persistentvolumeclaim "{claim}" not found')
        folder = self.workdir / ".claims" / claim
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _config_map_volume(self, pod: dict[str, Any], run: PodRun, volume: dict[str, Any]) -> Path:
        """A configMap volume's files (its `items`, or every key), read-only, in the pod's folder."""
        source = volume["configMap"]
        config_map = self._lookup("ConfigMap", pod["metadata"]["namespace"], source["name"])
        if config_map is None:  # the kubelet's FailedMount
            raise ContainerConfigError(f'MountVolume.SetUp failed for volume "{volume["name"]}": configmap "{source["name"]}" not found')
        data = config_map.get("data") or {}
        items = source.get("items") or [{"key": key, "path": key} for key in data]
        folder = run.dir / "volumes" / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for item in items:
            path = folder / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(data[item["key"]])
            path.chmod(int(item.get("mode") or source.get("defaultMode") or 0o644) & 0o555)
        return folder

    def _set_pod(self, key: tuple[str, str], status: dict[str, Any], **spec: Any) -> None:
        with self.api._lock:
            pod = self.api.get("", "pods", *key)
            if pod is not None:
                pod["status"] = status
                pod["spec"].update(spec)

    def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        container = pod["spec"]["containers"][0]
        run = PodRun(namespace=key[0], name=key[1], dir=self.workdir / key[1], marker=f"{self.drill_id}/{key[1]}",
                     gang=(meta.get("labels") or {}).get("gangflow.io/gang", ""))
        run.grace = float(pod["spec"].get("terminationGracePeriodSeconds") or 30)
        if pod["spec"].get("activeDeadlineSeconds"):
            run.deadline_s = float(pod["spec"]["activeDeadlineSeconds"])
        self.runs[key] = run
        self.history.append(run)
        (run.dir / "tmp").mkdir(parents=True)
        (run.dir / "termination-log").touch()
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}
        status: dict[str, Any] = {"phase": "Pending", "hostIP": "127.0.0.1", "podIP": "127.0.0.1", "conditions": [scheduled], "qosClass": "Guaranteed"}
        try:
            run.readiness = ReadinessProbe.from_container(container)
            container_env = resolve_env(container, {**pod, "spec": {**pod["spec"], "nodeName": NODE}, "status": status}, self._lookup)
            run.rendered_argv = expand_argv(container, container_env)
            run.rendered_env = container_env
            if self.runtime is not None:
                self._container(pod, container, run, container_env)
            else:
                rewrites = self._rewrites(pod, run)
        except ContainerConfigError as exc:
            status["containerStatuses"] = [{"name": container["name"], "ready": False, "restartCount": 0, "image": container.get("image"),
                                            "state": {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}}]  # fmt: skip
            self._set_pod(key, status, nodeName=NODE)
            run.exit_code = -1
            self._note(f"pod {key[1]}: CreateContainerConfigError: {exc}")
            return
        if self.runtime is None and not self._process(run, container, rewrites, container_env, key, status):
            return
        run.started_at, run.running_since = now(), time.monotonic()
        run.reader = threading.Thread(target=self._read, args=(run,), name=f"log-{key[1]}", daemon=True)
        run.reader.start()
        run.ready = run.ready_reported = run.readiness is None
        status.update(
            phase="Running", startTime=run.started_at,
            conditions=[scheduled, {"type": "Initialized", "status": "True", "lastTransitionTime": run.started_at},
                        *ready_conditions(run.ready, container["name"], run.started_at)],
            containerStatuses=[{"name": container["name"], "image": container.get("image"), "imageID": self.runtime.reference if self.runtime else container.get("image"),
                                "ready": run.ready, "started": True, "restartCount": 0, "state": {"running": {"startedAt": run.started_at}}, "lastState": {}}],
        )  # fmt: skip
        self._set_pod(key, status, nodeName=NODE)
        self._note(f"pod {key[1]} started (pid {run.proc.pid}): {' '.join(run.argv)}")
        if run.readiness is not None:
            missed = functools.partial(self._probe_missed, run)
            threading.Thread(target=run.readiness.watch, args=(run, getattr(self, "_stop", threading.Event()), missed), name=f"probe-{key[1]}", daemon=True).start()

    def _probe_missed(self, run: PodRun, why: str) -> None:
        """The kubelet's Warning event for a failed readiness probe, counted as its recorder does."""
        name, stamp = f"{run.name}.readiness", now()
        with self.api._lock:
            event = self.api.get("", "events", run.namespace, name)
            if event is None:
                event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": run.namespace},
                         "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": run.name, "namespace": run.namespace},
                         "reason": "Unhealthy", "type": "Warning", "source": {"component": "kubelet", "host": NODE},
                         "firstTimestamp": stamp, "count": 0}  # fmt: skip
            event.update(message=f"Readiness probe failed: {why}", lastTimestamp=stamp, count=event["count"] + 1)
            self.api.put("", "events", event)

    def _report_readiness(self, run: PodRun) -> None:
        """What the prober concluded, into the pod's Ready and ContainersReady conditions."""
        ready, stamp = run.ready, now()
        with self.api._lock:
            pod = self.api.get("", "pods", run.namespace, run.name)
            if pod is None or (pod.get("status") or {}).get("phase") != "Running":
                return
            status = pod["status"]
            name = pod["spec"]["containers"][0]["name"]
            kept = [c for c in status.get("conditions") or [] if c["type"] not in ("Ready", "ContainersReady")]
            status["conditions"] = [*kept, *ready_conditions(ready, name, stamp)]
            for container_status in status.get("containerStatuses") or []:
                container_status["ready"] = ready
            run.ready_reported = ready
        event = self.api.get("", "events", run.namespace, f"{run.name}.readiness")
        why = f": {event['message']}" if event is not None and not ready else ""
        self._note(f"pod {run.name} {'Ready' if ready else 'not Ready'} (readiness probe){why}")

    def _container(self, pod: dict[str, Any], container: dict[str, Any], run: PodRun, container_env: dict[str, str]) -> None:
        """Start the pod's container with podman (operators/cli/drill/podman.py); the container
        gets the process marker and the fault too, so that `kill_marked` finds its processes."""
        from operators.cli.drill.podman import container_argv, container_name

        hosts = Rewrites(hosts=self._hosts(pod))
        subdomain = pod["spec"].get("subdomain")
        peers = [o["spec"]["hostname"] for o in self.api.items("", "pods", run.namespace)
                 if (o.get("spec") or {}).get("subdomain") == subdomain and o["spec"].get("hostname")]  # fmt: skip
        env = {**hosts.env(container_env), POD_MARKER: run.marker, **self.extra_env}
        run.argv = container_argv(pod, container, env, name=container_name(run.marker), image=self.runtime.reference,
                                  image_user=self.runtime.image_user, pod_dir=run.dir, termination_log=run.dir / "termination-log",
                                  hosts=hosts, lookup=self._lookup, peers=peers)  # fmt: skip
        run.env = env
        (run.dir / "pod.json").write_text(json.dumps(run.record(), indent=1))
        run.proc = self.runtime.run(run.argv, self.runtime.client_env(env, {POD_MARKER: run.marker}), self.runtime.executable)

    def _process(self, run: PodRun, container: dict[str, Any], rewrites: Rewrites, container_env: dict[str, str],
                 key: tuple[str, str], status: dict[str, Any]) -> bool:  # fmt: skip
        """Start the pod's container as local processes in the emulated image; False when it cannot."""
        # the image's PATH already names this machine's folders (build_image mapped it): rewriting
        # it again would map a venv that happens to live under /tmp into the pod's /tmp
        image_env = {k: v if k == "PATH" else rewrites.apply(v) for k, v in self.image.env.items()}
        env = process_env(image_env, rewrites.env(container_env))
        argv = rewrites.argv(run.rendered_argv)
        # the drill's own additions, beside the container's (documented): the audit hook, the
        # process marker, and (only when the drill was given one) the fault to inject
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.audit_dir), env.get("PYTHONPATH")]))
        env[AUDIT_ENV] = str(run.audit_path)
        env[POD_MARKER] = run.marker
        env.update(self.extra_env)
        if "/tmp" in rewrites.mounts:  # tempfile's folder is then the pod's /tmp emptyDir, as in its container
            env.setdefault("TMPDIR", rewrites.mounts["/tmp"])
        run.argv, run.env = argv, env
        executable = shutil.which(argv[0], path=env.get("PATH")) if "/" not in argv[0] else argv[0]
        if not executable:
            status["containerStatuses"] = [{"name": container["name"], "ready": False, "restartCount": 0,
                                            "state": {"waiting": {"reason": "CreateContainerError", "message": f'exec: "{argv[0]}": executable file not found in $PATH'}}}]  # fmt: skip
            self._set_pod(key, status, nodeName=NODE)
            run.exit_code = -1
            return False
        (run.dir / "pod.json").write_text(json.dumps(run.record(), indent=1))
        run.proc = subprocess.Popen(
            [executable, *argv[1:]], env=env, cwd=run.dir / "tmp", stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._pin(run, container)
        return True

    def _pin(self, run: PodRun, container: dict[str, Any]) -> None:
        cpu = str(((container.get("resources") or {}).get("limits") or {}).get("cpu", ""))
        if not self.pin or not cpu.isdigit() or not self._cpus or not hasattr(os, "sched_setaffinity"):
            return
        want = min(int(cpu), len(self._cpus))
        cpus = {self._cpus[(self._next_cpu + i) % len(self._cpus)] for i in range(want)}
        self._next_cpu = (self._next_cpu + want) % len(self._cpus)
        try:
            os.sched_setaffinity(run.proc.pid, cpus)
        except OSError:
            pass

    def _read(self, run: PodRun) -> None:
        assert run.proc is not None and run.proc.stdout is not None
        with open(run.log_path, "ab") as log:
            for raw in run.proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace")
                run.log_lines.append(line)
                if self.echo:
                    self.echo(f"[{run.name}] {line.rstrip()}")

    def _terminate(self, run: PodRun) -> None:
        assert run.proc is not None
        if run.deleting_since is None:
            run.deleting_since = time.monotonic()
            why = "past its deadline" if run.deadline_exceeded else "deleted"
            self._note(f"pod {run.name} {why}: SIGTERM, SIGKILL after {run.grace:.0f}s")
            try:
                run.proc.send_signal(signal.SIGTERM)  # like the container runtime: to the container's first process
            except OSError:
                pass
        elif time.monotonic() - run.deleting_since > run.grace:
            kill_marked(run.marker, folder=run.dir)

    def _finished(self, run: PodRun) -> None:
        assert run.proc is not None
        if run.reader is not None:
            run.reader.join(5)
        kill_marked(run.marker, folder=run.dir)  # the container's cgroup goes with it: no worker outlives the pod
        code = run.proc.returncode
        run.exit_code = code if code >= 0 else 128 - code
        run.finished_at = now()
        message = (run.dir / "termination-log").read_bytes()[:MESSAGE_BYTES].decode("utf-8", "replace")
        if not message.strip() and run.exit_code != 0:  # FallbackToLogsOnError
            message = "".join(list(run.log_lines)[-FALLBACK_LINES:]).encode()[-FALLBACK_BYTES:].decode("utf-8", "replace")
        (run.dir / "pod.json").write_text(json.dumps(run.record(), indent=1))
        key = (run.namespace, run.name)
        self.api.logs[key] = "".join(run.log_lines)
        phase = "Succeeded" if run.exit_code == 0 and not run.deadline_exceeded else "Failed"
        with self.api._lock:
            pod = self.api.get("", "pods", *key)
            if pod is None:
                return
            container = pod["spec"]["containers"][0]
            terminated = {"exitCode": run.exit_code, "reason": "Completed" if run.exit_code == 0 else "Error", "startedAt": run.started_at, "finishedAt": run.finished_at}
            if message.strip():
                terminated["message"] = message
            pod["status"] = {
                **(pod.get("status") or {}),
                "phase": phase,
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": run.started_at},
                    {"type": "Ready", "status": "False", "reason": "PodCompleted" if phase == "Succeeded" else "PodFailed", "lastTransitionTime": run.finished_at},
                ],
                "containerStatuses": [{"name": container["name"], "image": container.get("image"), "ready": False, "started": False,
                                       "restartCount": 0, "state": {"terminated": terminated}, "lastState": {}}],
            }  # fmt: skip
            if run.deadline_exceeded:  # the kubelet's words (pkg/kubelet/active_deadline.go)
                pod["status"].update(reason="DeadlineExceeded", message="Pod was active on the node longer than the specified deadline")
            self._note(f"pod {run.name} {phase} (exit code {run.exit_code})")
            self._settle(pod)

    def _settle(self, pod: dict[str, Any]) -> None:
        """The pod's JobSet and the gang object owning it (TrainJob, MPIJob, RayJob) see its end now,
        under the API's lock: watch-driven controllers react within milliseconds, and the drill's
        reconcile period would otherwise show gangflow a failed rank whose gang has not failed yet."""
        name = (pod["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL)
        jobset = self.api.get(*JS, pod["metadata"]["namespace"], name) if name else None
        if jobset is not None:
            self._job_controller(jobset)
        for controller in self.controllers:
            controller.reconcile(self._note)
