"""The drill's MPI Operator (v2) controller, with Kueue's MPIJob integration: what a cluster running
kubeflow/mpi-operator does with the MPIJob gangflow submits (api=mpijob), played against the API
test double. Its pods are then run by the drill's kubelet (cluster.py), and the launcher's `mpirun`
really starts the ranks on the worker "hosts" through the drill's ssh (mpi_ssh.py).

Modelled on kubeflow/mpi-operator v2 (pkg/controller/mpi_job_controller.go: `newConfigMap`,
`newWorker`, `newLauncherPodTemplate`, `updateMPIJobStatus`, `updateMPIJobFailedStatus`) and on
Kueue's MPIJob integration (the Workload belongs to the MPIJob; Kueue clears `runPolicy.suspend`):

- admitted, it creates the ConfigMap `<job>-config` (`hostfile`: one line
  `<job>-worker-<i>.<job>.<ns>.svc slots=<slotsPerWorker>` a worker, and `discover_hosts.sh`), the
  worker pods `<job>-worker-<i>` (hostname `<job>-worker-<i>`, subdomain `<job>`,
  `K_MPI_JOB_ROLE=worker`, the template's command: the image's `/usr/sbin/sshd -De`), and, once
  every worker runs (`launcherCreationPolicy: WaitForWorkersReady`), the launcher (its Job's pod
  `<job>-launcher-<suffix>`, hostname `<job>-launcher`) with the ConfigMap mounted at `/etc/mpi`
  and mpi-operator's Open MPI variables (`OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile`,
  `OMPI_MCA_orte_keep_fqdn_hostnames`, `OMPI_MCA_plm_rsh_args`, `OMPI_MCA_orte_set_default_slots`,
  `K_MPI_JOB_ROLE=launcher`, the NVIDIA variables emptied);
- status: `Created`, `Suspended`, `Running` (the launcher's pod and every worker running),
  `Succeeded` (the launcher succeeded) or `Failed` (the launcher failed: its Job's reason and
  message as mpi-operator concatenates them, `BackoffLimitExceeded/<pod reason>`), then the running
  workers are deleted (`cleanPodPolicy: Running`).

Where the drill differs from mpi-operator (stated, not hidden):

- no sshd: the workers' `/usr/sbin/sshd` is the drill image's stand-in (a process that stays up
  until stopped; `mpi_ssh.install`), and the launcher reaches a worker "host" through the drill's
  `ssh` (PRRTE's `PRTE_MCA_plm_ssh_agent`, added to the launcher's environment by this controller:
  an emulation detail, like `OMPI_ALLOW_RUN_AS_ROOT*` while the drill runs as root). That ssh runs
  the remote command (PRRTE's `prted`, which starts the ranks) as a process of the worker pod
  (its `GANGFLOW_DRILL_POD` marker, its environment, its `/tmp` as HOME), so stopping a worker pod
  stops its ranks. No ssh keys: the `-ssh` Secret and its volume are not created.
- the launcher's Job is not an object here: its pod is created directly (backoffLimit 0: one pod),
  with `runPolicy.activeDeadlineSeconds` as the pod's deadline. No Services are created (the
  drill maps the gang's names to 127.0.0.1 itself, cluster.py `_hosts`).
- Kueue's Workload is admitted at once (no quota is modelled); pausing an MPIJob (Workload
  `spec.active`) and the drill's preempt event are not emulated for MPIJobs.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

from operators.cli.drill.api_double import InMemoryKubernetesApi, name_suffix, now
from operators.cli.drill.cluster import admit, kueue_workload

MPIJOBS = ("kubeflow.org", "mpijobs")
WORKLOADS = ("kueue.x-k8s.io", "workloads")
MPI_API = "kubeflow.org/v2beta1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
CONFIG_MOUNT = "/etc/mpi"  # mpi-operator configMountPath
CONFIG_VOLUME = "mpi-job-config"
HOSTFILE = "hostfile"
DISCOVER_HOSTS = "discover_hosts.sh"
# mpi-operator's labels (kubeflow common: training.kubeflow.org/*)
OPERATOR_LABEL, JOB_LABEL, ROLE_LABEL, INDEX_LABEL = (
    "training.kubeflow.org/operator-name", "training.kubeflow.org/job-name", "training.kubeflow.org/job-role",
    "training.kubeflow.org/replica-index")  # fmt: skip
# what mpi-operator v2 adds to an Open MPI launcher (ompiEnvVars, openMPISlotsEnv, nvidiaDisableEnvVars)
OMPI_ENV = (("OMPI_MCA_orte_keep_fqdn_hostnames", "true"), ("OMPI_MCA_orte_default_hostfile", f"{CONFIG_MOUNT}/{HOSTFILE}"),
            ("OMPI_MCA_plm_rsh_args", "-o ConnectionAttempts=10"))  # fmt: skip
SLOTS_ENV = "OMPI_MCA_orte_set_default_slots"
SSH_AGENT_ENV = "PRTE_MCA_plm_ssh_agent"  # Open MPI 5 (PRRTE): the command that reaches a remote host

Note = Callable[[str], None]


def hostfile(name: str, namespace: str, workers: int, slots: int) -> str:
    """mpi-operator's `newConfigMap` hostfile for Open MPI: one worker a line, by its Service DNS name."""
    return "".join(f"{name}-worker-{i}.{name}.{namespace}.svc slots={slots}\n" for i in range(workers))


def set_condition(conditions: list[dict[str, Any]], kind: str, status: str, reason: str, message: str) -> bool:
    """kubeflow common `updateMPIJobConditions`: replace the condition of that type (the transition
    time moves only when the status changes); Succeeded or Failed True sets Running False. True
    when something changed."""
    old = next((c for c in conditions if c["type"] == kind), None)
    if old is not None and (old["status"], old.get("reason"), old.get("message")) == (status, reason, message):
        return False
    stamp = now()
    new = {"type": kind, "status": status, "reason": reason, "message": message, "lastUpdateTime": stamp,
           "lastTransitionTime": old["lastTransitionTime"] if old is not None and old["status"] == status else stamp}  # fmt: skip
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new
    if status == "True" and kind in ("Succeeded", "Failed"):
        running = next((c for c in conditions if c["type"] == "Running"), None)
        if running is not None and running["status"] == "True":
            running.update(status="False", lastTransitionTime=stamp, lastUpdateTime=stamp)
    return True


def _finished(mpijob: dict[str, Any]) -> bool:
    return any(c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True" for c in (mpijob.get("status") or {}).get("conditions") or [])


class MPIController:
    """Kueue's MPIJob integration + mpi-operator v2's MPIJob controller, one `reconcile` a period.

    `launcher_env`: what the drill adds to each launcher's container (its ssh agent, Open MPI's
    consent to run as root): emulation details, listed in `report.json` with the pod's env."""

    def __init__(self, api: InMemoryKubernetesApi, *, launcher_env: dict[str, str] | None = None):
        self.api = api
        self.launcher_env = dict(launcher_env or {})
        self._admitted: set[str] = set()
        self._workers: set[str] = set()  # uids whose ConfigMap and workers were created
        self._launched: dict[str, str] = {}  # uid -> launcher pod name
        self._cleaned: set[str] = set()

    def reconcile(self, note: Note) -> None:
        live = set()
        for mpijob in self.api.items(*MPIJOBS):
            live.add(mpijob["metadata"]["uid"])
            self._kueue(mpijob, note)
            self._controller(mpijob, note)
        self._collect_garbage(live, note)

    # --- Kueue ---------------------------------------------------------------------------------

    def _kueue(self, mpijob: dict[str, Any], note: Note) -> None:
        """Kueue admits a suspended, queued MPIJob as one Workload (pod sets launcher and worker;
        scripted: no quota is modelled) and clears `runPolicy.suspend`."""
        meta, spec = mpijob["metadata"], mpijob.get("spec") or {}
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
        policy = spec.get("runPolicy") or {}
        if not queue or uid in self._admitted or not policy.get("suspend"):
            return
        self._admitted.add(uid)
        stamp = now()
        replicas = spec.get("mpiReplicaSpecs") or {}
        pod_sets = [{"name": role.lower(), "count": int((replicas.get(role) or {}).get("replicas", 1))} for role in ("Launcher", "Worker")]
        workload = kueue_workload(mpijob, prefix="mpijob", queue=queue, pod_sets=pod_sets, stamp=stamp)
        if admit(self.api, MPIJOBS, workload, runPolicy={**policy, "suspend": False}):
            sets = " + ".join(f"{p['count']} {p['name']}" for p in pod_sets)
            note(f"Kueue admitted MPIJob {ns}/{name} ({sets})")

    # --- mpi-operator --------------------------------------------------------------------------

    def _pods(self, ns: str, name: str) -> list[dict[str, Any]]:
        return [p for p in self.api.items("", "pods", ns) if (p["metadata"].get("labels") or {}).get(JOB_LABEL) == name]

    def _controller(self, mpijob: dict[str, Any], note: Note) -> None:
        meta, spec = mpijob["metadata"], mpijob.get("spec") or {}
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        if _finished(mpijob):
            self._clean(mpijob, note)
            return
        status = copy.deepcopy(mpijob.get("status") or {})
        conditions = status.setdefault("conditions", [])
        changed = set_condition(conditions, "Created", "True", "MPIJobCreated", f"MPIJob {ns}/{name} is created.")
        suspended = bool((spec.get("runPolicy") or {}).get("suspend"))
        if suspended:
            changed |= set_condition(conditions, "Suspended", "True", "MPIJobSuspended", f"MPIJob {ns}/{name} is suspended.")
            changed |= set_condition(conditions, "Running", "False", "MPIJobSuspended", f"MPIJob {ns}/{name} is suspended.")
            if changed:
                self._write_status(ns, name, status)
            return
        if any(c["type"] == "Suspended" and c["status"] == "True" for c in conditions):
            changed |= set_condition(conditions, "Suspended", "False", "MPIJobResumed", f"MPIJob {ns}/{name} is resumed.")
        replicas = spec["mpiReplicaSpecs"]
        workers = int(replicas["Worker"].get("replicas", 0))
        if uid not in self._workers:
            self._workers.add(uid)
            slots = int(spec.get("slotsPerWorker") or 1)
            self.api.put("", "configmaps", self._config_map(mpijob, workers, slots))
            for index in range(workers):
                self.api.put("", "pods", self._worker(mpijob, index))
            note(f"MPI Operator created ConfigMap {ns}/{name}-config (hostfile: {workers} workers, slots={slots}) and {workers} worker pods of MPIJob {ns}/{name}")
        pods = self._pods(ns, name)
        worker_pods = [p for p in pods if p["metadata"]["labels"].get(ROLE_LABEL) == "worker"]
        running = [p for p in worker_pods if (p.get("status") or {}).get("phase") == "Running"]
        if uid not in self._launched and len(running) == workers:  # WaitForWorkersReady
            pod = self._launcher(mpijob)
            self._launched[uid] = pod["metadata"]["name"]
            self.api.put("", "pods", pod)
            note(f"MPI Operator created the launcher pod {pod['metadata']['name']} of MPIJob {ns}/{name}: its {workers} workers run")
        launcher = next((p for p in pods if p["metadata"]["name"] == self._launched.get(uid)), None)
        phase = ((launcher or {}).get("status") or {}).get("phase")
        if phase == "Succeeded":
            changed |= set_condition(conditions, "Succeeded", "True", "MPIJobSucceeded", f"MPIJob {ns}/{name} successfully completed.")
            status["completionTime"] = now()
        elif phase == "Failed":
            pod_status = launcher.get("status") or {}
            if pod_status.get("reason") == "DeadlineExceeded":  # the launcher Job's activeDeadlineSeconds
                reason, message = "DeadlineExceeded", "Job was active longer than specified deadline"
            else:  # backoffLimit 0: the Job fails BackoffLimitExceeded, with its last failed pod's reason and message
                reason = "BackoffLimitExceeded/" + (pod_status.get("reason") or "")
                message = "Job has reached the specified backoff limit: " + (pod_status.get("message") or "")
            changed |= set_condition(conditions, "Failed", "True", reason, message[:1024])
            status["completionTime"] = now()
        elif phase == "Running" and len(running) == workers:
            changed |= set_condition(conditions, "Running", "True", "MPIJobRunning", f"MPIJob {ns}/{name} is running.")
        status["replicaStatuses"] = {
            "Launcher": {"active": int(phase == "Running"), "succeeded": int(phase == "Succeeded"), "failed": int(phase == "Failed")},
            "Worker": {"active": len(running)},
        }
        if changed or status != (mpijob.get("status") or {}):
            self._write_status(ns, name, status)
            if phase in ("Succeeded", "Failed"):
                done = next(c for c in conditions if c["type"] in ("Succeeded", "Failed") and c["status"] == "True")
                note(f"MPI Operator: MPIJob {ns}/{name} {done['type']} ({done['reason']}: {done['message']}), from its launcher pod")

    def _clean(self, mpijob: dict[str, Any], note: Note) -> None:
        """cleanPodPolicy Running: the workers still running are deleted once the MPIJob finished."""
        meta = mpijob["metadata"]
        if meta["uid"] in self._cleaned or ((mpijob["spec"].get("runPolicy") or {}).get("cleanPodPolicy") or "None") == "None":
            return
        self._cleaned.add(meta["uid"])
        everything = mpijob["spec"]["runPolicy"]["cleanPodPolicy"] == "All"
        deleted = []
        with self.api._lock:
            for pod in self._pods(meta["namespace"], meta["name"]):
                if everything or (pod.get("status") or {}).get("phase") in ("Running", "Pending"):
                    pod["metadata"].setdefault("deletionTimestamp", now())
                    deleted.append(pod["metadata"]["name"])
        if deleted:
            note(f"MPI Operator deleted the running pods of finished MPIJob {meta['namespace']}/{meta['name']} (cleanPodPolicy): {', '.join(sorted(deleted))}")

    def _write_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        self.api.update_status(*MPIJOBS, ns, name, status)

    # --- the objects it creates ----------------------------------------------------------------

    @staticmethod
    def _owner(mpijob: dict[str, Any]) -> list[dict[str, Any]]:
        meta = mpijob["metadata"]
        return [{"apiVersion": MPI_API, "kind": "MPIJob", "name": meta["name"], "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]

    def _config_map(self, mpijob: dict[str, Any], workers: int, slots: int) -> dict[str, Any]:
        meta = mpijob["metadata"]
        name, ns = meta["name"], meta["namespace"]
        discover = "#!/bin/sh\n" + "".join(f"echo {name}-worker-{i}.{name}.{ns}.svc\n" for i in range(workers))
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": f"{name}-config", "namespace": ns, "labels": {"app": name}, "ownerReferences": self._owner(mpijob)},
                "data": {HOSTFILE: hostfile(name, ns, workers, slots), DISCOVER_HOSTS: discover}}  # fmt: skip

    def _pod(self, mpijob: dict[str, Any], role: str, pod_name: str, hostname: str, extra_labels: dict[str, str]) -> dict[str, Any]:
        meta = mpijob["metadata"]
        name, ns = meta["name"], meta["namespace"]
        replica = mpijob["spec"]["mpiReplicaSpecs"]["Launcher" if role == "launcher" else "Worker"]
        template = copy.deepcopy(replica["template"])
        tmeta = template.get("metadata") or {}
        labels = {**(tmeta.get("labels") or {}), OPERATOR_LABEL: "mpi-operator", JOB_LABEL: name, ROLE_LABEL: role, **extra_labels}
        spec = template["spec"]
        spec["hostname"], spec["subdomain"] = hostname, name  # Matches the job's Service name
        spec["restartPolicy"] = "Never" if replica.get("restartPolicy") in (None, "ExitCode") else replica["restartPolicy"]
        container = spec["containers"][0]
        if not container.get("command") and not container.get("args"):
            container["command"] = ["/usr/sbin/sshd", "-De"]
        container.setdefault("env", []).append({"name": "K_MPI_JOB_ROLE", "value": role})
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": ns, "labels": labels, "annotations": dict(tmeta.get("annotations") or {}),
                         "ownerReferences": self._owner(mpijob)},
            "spec": spec,
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "", "lastTransitionTime": now()}]},
        }  # fmt: skip

    def _worker(self, mpijob: dict[str, Any], index: int) -> dict[str, Any]:
        name = f"{mpijob['metadata']['name']}-worker-{index}"
        return self._pod(mpijob, "worker", name, name, {INDEX_LABEL: str(index)})

    def _launcher(self, mpijob: dict[str, Any]) -> dict[str, Any]:
        name, spec = mpijob["metadata"]["name"], mpijob["spec"]
        job = f"{name}-launcher"
        pod = self._pod(mpijob, "launcher", f"{job}-{name_suffix()}", job, {"batch.kubernetes.io/job-name": job, "job-name": job})
        container = pod["spec"]["containers"][0]
        env = container["env"]
        env += [{"name": k, "value": v} for k, v in OMPI_ENV]
        env.append({"name": SLOTS_ENV, "value": str(int(spec.get("slotsPerWorker") or 1))})
        env += [{"name": "NVIDIA_VISIBLE_DEVICES"}, {"name": "NVIDIA_DRIVER_CAPABILITIES"}]
        env += [{"name": k, "value": v} for k, v in self.launcher_env.items()]  # the drill's own (see the module doc)
        pod["spec"].setdefault("volumes", []).append({"name": CONFIG_VOLUME, "configMap": {"name": f"{name}-config", "items": [
            {"key": HOSTFILE, "path": HOSTFILE, "mode": 0o444}, {"key": DISCOVER_HOSTS, "path": DISCOVER_HOSTS, "mode": 0o555}]}})  # fmt: skip
        container.setdefault("volumeMounts", []).append({"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT})
        deadline = (spec.get("runPolicy") or {}).get("activeDeadlineSeconds")
        if deadline:  # the launcher Job's activeDeadlineSeconds, as the pod's
            pod["spec"]["activeDeadlineSeconds"] = int(deadline)
        return pod

    def _collect_garbage(self, live: set[str], note: Note) -> None:
        """The garbage collector: what an MPIJob that is gone owned (its ConfigMap, its pods) goes."""
        for plural in ("configmaps", "pods"):
            for obj in self.api.items("", plural):
                owners = [o for o in obj["metadata"].get("ownerReferences") or [] if o.get("kind") == "MPIJob"]
                if not owners or owners[0].get("uid") in live:
                    continue
                ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
                with self.api._lock:
                    if plural == "configmaps":
                        self.api.remove("", plural, ns, name)
                    elif self.api.get("", plural, ns, name) is not None:
                        self.api.get("", plural, ns, name)["metadata"].setdefault("deletionTimestamp", now())
                if plural == "configmaps":
                    note(f"garbage collector: ConfigMap {ns}/{name} deleted with its MPIJob")


def drill_launcher_env(agent: str) -> dict[str, str]:
    """What the drill adds to a launcher: its ssh (mpi_ssh.py) as PRRTE's ssh agent and, while the drill
    runs as root, Open MPI's consent to run as root (a cluster's hardened pods run as a user)."""
    env = {SSH_AGENT_ENV: str(agent)}
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return env
