"""MultiKueue in the drill (`make cluster-drill MULTIKUEUE=2`): the API test double the Airflow worker
talks to is the manager cluster; each worker cluster is an API test double of its own with an
`EmulatedCluster` (Kueue, Job controller, kubelet) running its pods as local processes.

`MultiKueueDispatcher` plays Kueue's MultiKueue admission check between them, as the chart sets it
up (kueue.multiKueue): a JobSet submitted to the manager's queue gets a Workload whose check is
Pending, is copied whole to the first worker cluster that is up and runs no other gang, and its
manager Workload is admitted with `status.clusterName` naming that worker; the worker copy's status
is mirrored back to the manager's JobSet, and the copy is removed when the manager's JobSet is
deleted. With GANGFLOW_DRILL_EVENT="lose-worker@step=N" the worker running the gang is lost once
checkpoint step N is committed: its pods are SIGKILLed and it answers no more, and after
WORKER_LOST_SECONDS (Kueue's workerLostTimeout, 15 min by default) the check goes back to Retry and
Kueue evicts the manager's Workload (reason AdmissionCheck), as Kueue does.
"""

from __future__ import annotations

import copy
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from operators.cli.drill.api_double import InMemoryKubernetesApi
from operators.cli.drill.cluster import JS, KQ, DrillEvent, EmulatedCluster, ReconcileLoop, kill_marked, kueue_workload, now, set_admission

CHECK = "gangflow-multikueue"  # the AdmissionCheck the chart renders on the ClusterQueue (its name in the drill)
MANAGED_BY = "kueue.x-k8s.io/multikueue"
# Kueue's workerLostTimeout, shortened: still longer than two polls of the manager's watch
# (GangTrigger, every 10 s), as the 15 min default is, so the watch sees the Workload admitted on
# the worker (status.clusterName, cleared by the eviction) before the loss evicts it.
WORKER_LOST_SECONDS = 25.0


@dataclass
class WorkerCluster:
    name: str
    api: InMemoryKubernetesApi
    cluster: EmulatedCluster
    lost: bool = False
    dispatched: list[str] = field(default_factory=list)  # names of the JobSets it was given


class MultiKueueDispatcher(ReconcileLoop):
    """Kueue's MultiKueue between the manager (`manager`) and `workers`, reconciled every `period` s.
    Exposes what the drill reads of one cluster: `history`, `events`, `error`, `stop()`."""

    what = "MultiKueue emulation"

    def __init__(self, manager: InMemoryKubernetesApi, workers: list[WorkerCluster], *, event: DrillEvent | None = None,
                 committed_step=None, echo=None, period: float = 0.2):  # fmt: skip
        self.api = manager
        self.workers = workers
        self.event = event
        self.committed_step = committed_step
        self.echo = echo
        self.period = period
        self.own_events: list[str] = []
        self.dispatches: list[dict[str, str]] = []  # {jobset, worker}, in order
        self._placed: dict[str, WorkerCluster] = {}  # manager JobSet uid -> its worker
        self._lost_at: dict[str, float] = {}  # worker name -> when the drill lost it
        self._next_probe = 0.0

    # --- what the drill reads --------------------------------------------------------------------

    @property
    def history(self):
        return [run for w in self.workers for run in w.cluster.history]

    @property
    def events(self) -> list[str]:
        return self.own_events + [f"[{w.name}] {e}" for w in self.workers for e in w.cluster.events]

    def summary(self) -> dict[str, Any]:
        return {"workers": [w.name for w in self.workers], "dispatches": list(self.dispatches),
                "lost": [w.name for w in self.workers if w.lost]}  # fmt: skip

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> MultiKueueDispatcher:
        for worker in self.workers:
            worker.cluster.start()
        return super().start()

    def stop(self, grace: float = 5.0, *, keep_pod_grace: bool = True) -> None:
        """Stop dispatching, then every worker cluster (EmulatedCluster.stop) and its API."""
        self._halt()
        for worker in self.workers:
            worker.cluster.stop(grace, keep_pod_grace=keep_pod_grace)
            worker.api.stop()

    def _note(self, message: str) -> None:
        self.own_events.append(message)
        if self.echo:
            self.echo(f"[multikueue] {message}")

    # --- reconcile -------------------------------------------------------------------------------

    def reconcile(self) -> None:
        if self.error is None:  # a worker cluster's emulation error fails the drill too
            self.error = next((w.cluster.error for w in self.workers if w.cluster.error is not None), None)
        live = {js["metadata"]["uid"]: js for js in self.api.items(*JS)}
        for uid, jobset in live.items():
            if uid in self._placed:
                self._mirror(jobset, self._placed[uid])
            elif "kueue.x-k8s.io/queue-name" in (jobset["metadata"].get("labels") or {}) and jobset["spec"].get("suspend"):
                self._dispatch(jobset)
        for uid in [uid for uid in self._placed if uid not in live]:  # the manager's JobSet was deleted
            self._remove_copy(self._placed.pop(uid))
        self._lose_worker()
        for name, since in list(self._lost_at.items()):
            if time.monotonic() - since >= WORKER_LOST_SECONDS:
                del self._lost_at[name]
                self._evict_from(name)

    def _workload(self, jobset: dict[str, Any]) -> dict[str, Any] | None:
        uid = jobset["metadata"]["uid"]
        return next((wl for wl in self.api.items(*KQ, jobset["metadata"]["namespace"])
                     if (wl["metadata"].get("labels") or {}).get("kueue.x-k8s.io/job-uid") == uid), None)  # fmt: skip

    def _dispatch(self, jobset: dict[str, Any]) -> None:
        meta = jobset["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        stamp = now()
        workload = self._workload(jobset)
        if workload is None:  # the manager's Kueue: quota reserved, the MultiKueue check pending
            count = sum(int(rj.get("replicas", 1)) * int(rj["template"]["spec"].get("parallelism") or 1) for rj in jobset["spec"]["replicatedJobs"])
            workload = kueue_workload(jobset, prefix="jobset", queue=meta["labels"]["kueue.x-k8s.io/queue-name"],
                                      pod_sets=[{"name": "rank", "count": count}], stamp=stamp, admitted=False)
            workload["status"] = {
                "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "lastTransitionTime": stamp,
                                "message": "Quota reserved in ClusterQueue gangflow-drill"}],
                "admissionChecks": [{"name": CHECK, "state": "Pending", "message": "", "lastTransitionTime": stamp}],
                "nominatedClusterNames": [w.name for w in self.workers if not w.lost]}  # fmt: skip
            workload = self.api.put(*KQ, workload)
            with self.api._lock:  # Kueue's webhook: the manager's JobSet controller leaves it alone
                jobset["spec"]["managedBy"] = MANAGED_BY
        busy = {w.name for w in self._placed.values()}
        worker = next((w for w in self.workers if not w.lost and w.name not in busy), None)
        if worker is None:
            return  # no worker has room: the check stays Pending
        copied = copy.deepcopy(jobset)
        copied.pop("status", None)
        copied["spec"].pop("managedBy", None)
        copied["spec"]["suspend"] = True  # the worker's Kueue admits it
        for key in ("uid", "resourceVersion", "creationTimestamp", "generation"):
            copied["metadata"].pop(key, None)
        copied["metadata"].setdefault("labels", {})["kueue.x-k8s.io/multikueue-origin"] = "multikueue"
        worker.api.put(*JS, copied)
        worker.dispatched.append(name)
        self._placed[uid] = worker
        self.dispatches.append({"jobset": name, "worker": worker.name})
        with self.api._lock:
            set_admission(workload, admitted=True, reason="Admitted", message="The workload is admitted", stamp=stamp)
            workload["status"]["admissionChecks"] = [{"name": CHECK, "state": "Ready", "lastTransitionTime": stamp,
                                                      "message": f'The workload got reservation on "{worker.name}"'}]  # fmt: skip
            workload["status"]["clusterName"] = worker.name
            workload["status"].pop("nominatedClusterNames", None)
            jobset["spec"]["suspend"] = False
        self._note(f"MultiKueue dispatched JobSet {ns}/{name} whole to worker cluster {worker.name} (Workload {workload['metadata']['name']} admitted)")

    def _mirror(self, jobset: dict[str, Any], worker: WorkerCluster) -> None:
        """The worker copy's status on the manager's JobSet (nothing comes back from a lost worker)."""
        if worker.lost:
            return
        meta = jobset["metadata"]
        remote = worker.api.get(*JS, meta["namespace"], meta["name"])
        if remote is not None and remote.get("status") and remote["status"] != jobset.get("status"):
            with self.api._lock:
                jobset["status"] = copy.deepcopy(remote["status"])

    def _remove_copy(self, worker: WorkerCluster) -> None:
        if worker.lost:
            return
        for jobset in worker.api.items(*JS):
            if (jobset["metadata"].get("labels") or {}).get("kueue.x-k8s.io/multikueue-origin") and \
                    jobset["metadata"]["name"] not in {js["metadata"]["name"] for js in self.api.items(*JS)}:
                worker.api.delete(*JS, jobset["metadata"]["namespace"], jobset["metadata"]["name"])
                self._note(f"MultiKueue removed the copy of JobSet {jobset['metadata']['name']} from {worker.name} (the manager's is gone)")

    # --- the drill's event: a worker cluster lost ------------------------------------------------

    def _lose_worker(self) -> None:
        event = self.event
        if event is None or event.fired or self.committed_step is None or time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + 0.25
        step = self.committed_step()
        if step is None or step < event.step:
            return
        worker = next((w for w in self._placed.values() if not w.lost), None)
        if worker is None:
            return
        event.fired = True
        worker.lost = True
        self._lost_at[worker.name] = time.monotonic()
        killed = kill_marked(worker.cluster.drill_id + "/", signal.SIGKILL)  # no SIGTERM: the cluster is gone
        worker.cluster.stop(grace=0, keep_pod_grace=False)
        self._note(f"worker cluster {worker.name} lost (checkpoint step-{step} committed: drill event {event.spec}); "
                   f"{killed} pod process(es) killed; Kueue notices after workerLostTimeout ({WORKER_LOST_SECONDS:.0f} s here)")  # fmt: skip

    def _evict_from(self, name: str) -> None:
        """Kueue, workerLostTimeout after losing `name`: its check Retry, the manager's Workload evicted."""
        stamp = now()
        for uid, worker in list(self._placed.items()):
            if worker.name != name:
                continue
            jobset = next((js for js in self.api.items(*JS) if js["metadata"]["uid"] == uid), None)
            if jobset is None:
                continue
            workload = self._workload(jobset)
            with self.api._lock:
                if workload is not None:
                    set_admission(workload, admitted=False, reason="AdmissionCheck", message="At least one admission check is false", stamp=stamp)
                    workload["status"]["admissionChecks"] = [{"name": CHECK, "state": "Retry", "lastTransitionTime": stamp,
                                                              "message": "Reserving remote lost"}]  # Kueue's words
                    workload["status"].pop("clusterName", None)
                jobset["spec"]["suspend"] = True
            self._note(f"Kueue evicted Workload of JobSet {jobset['metadata']['name']} (AdmissionCheck: worker cluster {name} lost)")
