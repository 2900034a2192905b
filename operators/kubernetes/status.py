"""Read the cluster's own words: gang object status, Kueue Workload conditions, pod states.

Pure functions over the JSON the API server returns (no client calls), shared by the trigger
(which decides when the gang has ended) and by `collect` (which turns pods into the failure
classifier's evidence, contract 4, docs/contracts.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # the API server's: RFC 3339, whole seconds, UTC

EVIDENCE_KEYS = (
    "exit_code",
    "signal",
    "termination_reason",
    "pod_phase",
    "pod_reason",
    "pod_message",
    "pod_conditions",
    "events",
    "log_tail",
    "error_file",
)
# identification keys added beside the classifier's keys (the classifier ignores them)
IDENTITY_KEYS = ("pod", "rank", "node", "finished_at")


def timestamp(epoch: float | None = None) -> str:
    """A Kubernetes timestamp of `epoch` (default: now)."""
    return time.strftime(TIMESTAMP_FORMAT, time.gmtime(epoch))


def parse_time(value: str | None) -> float | None:
    """A Kubernetes timestamp -> epoch seconds; None when absent or unreadable."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


# Container waiting reasons that never clear on their own: fail at once.
FATAL_WAITING_REASONS = frozenset({"InvalidImageName", "CreateContainerConfigError", "ErrImageNeverPull", "CreateContainerError"})
# Waiting reasons that may clear (registry hiccup) but usually mean a wrong image: fail after a grace period.
IMAGE_PULL_REASONS = frozenset({"ImagePullBackOff", "ErrImagePull"})
# Pod-level reasons that mean the node or the cluster took the pod away.
DISRUPTION_POD_REASONS = frozenset({"Evicted", "Preempted", "NodeLost", "Shutdown", "Terminated", "NodeShutdown", "UnexpectedAdmissionError"})

RANK_KEYS = ("batch.kubernetes.io/job-completion-index", "volcano.sh/task-index")

LOG_TAIL_LINES = 50
LOG_TAIL_CHARS = 4000
MAX_EVENTS = 10
# mpi-operator v2's label on its pods: an MPIJob's `launcher` runs mpirun, whose output holds every rank's
MPI_ROLE_LABEL = "training.kubeflow.org/job-role"
# KubeRay's label on a RayCluster's pods: `head` or `worker` (a RayJob's submitter pod has none)
RAY_NODE_TYPE_LABEL = "ray.io/node-type"


def conditions(obj: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list(((obj or {}).get("status") or {}).get("conditions") or [])


def condition(obj: Mapping[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in conditions(obj):
        if cond.get("type") == type_:
            return cond
    return None


def is_true(cond: Mapping[str, Any] | None) -> bool:
    return bool(cond) and cond.get("status") == "True"


# --- gang objects --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GangState:
    state: str  # pending | suspended | running | succeeded | failed
    reason: str = ""
    message: str = ""


def gang_state(kind: str, obj: Mapping[str, Any]) -> GangState:
    """Where the JobSet / Volcano Job / TrainJob / RayJob / MPIJob says it is."""
    status = obj.get("status") or {}
    if kind in ("JobSet", "TrainJob"):
        done = condition(obj, "Completed" if kind == "JobSet" else "Complete")
        if is_true(done):
            return GangState("succeeded", done.get("reason", ""), done.get("message", ""))
        failed = condition(obj, "Failed")
        if is_true(failed):
            return GangState("failed", failed.get("reason", ""), failed.get("message", ""))
        if kind == "JobSet" and status.get("terminalState") in ("Completed", "Failed"):
            state = "succeeded" if status["terminalState"] == "Completed" else "failed"
            return GangState(state, status["terminalState"], "")
        suspended = condition(obj, "Suspended")
        if is_true(suspended) or (obj.get("spec") or {}).get("suspend"):
            return GangState("suspended", (suspended or {}).get("reason", ""), (suspended or {}).get("message", ""))
        return GangState("running" if status else "pending")
    if kind == "VolcanoJob":
        state = status.get("state") or {}
        phase = state.get("phase") or "Pending"
        reason, message = state.get("reason", "") or "", state.get("message", "") or ""
        if phase == "Completed":
            return GangState("succeeded", reason or phase, message)
        if phase in ("Failed", "Aborted", "Aborting", "Terminated", "Terminating"):
            return GangState("failed", reason or phase, message or f"Volcano Job phase {phase}")
        if phase in ("Running", "Completing", "Restarting"):
            return GangState("running", reason or phase, message)
        return GangState("pending", reason or phase, message)
    if kind == "RayJob":
        # KubeRay's RayJobStatus: jobDeploymentStatus (Initializing, Running, Complete, Failed, Suspending,
        # Suspended, Retrying, Waiting, ValidationFailed) says where the RayJob is; jobStatus (PENDING,
        # RUNNING, STOPPED, SUCCEEDED, FAILED) is the Ray job's own; reason/message say why it failed
        # (e.g. AppFailed, SubmissionFailed, DeadlineExceeded, ValidationFailed)
        deployment = status.get("jobDeploymentStatus") or ""
        job = status.get("jobStatus") or ""
        reason, message = status.get("reason", "") or "", status.get("message", "") or ""
        if job == "SUCCEEDED" and deployment in ("Complete", ""):
            return GangState("succeeded", reason or "SUCCEEDED", message)
        if deployment in ("Failed", "ValidationFailed") or job in ("FAILED", "STOPPED"):
            return GangState("failed", reason or job or deployment, message or f"RayJob {deployment or job}")
        if deployment == "Complete":  # complete without SUCCEEDED: not a success
            return GangState("failed", reason or deployment, message or f"RayJob Complete with jobStatus {job or 'unknown'}")
        if deployment in ("Suspended", "Suspending") or (not deployment and (obj.get("spec") or {}).get("suspend")):
            return GangState("suspended", reason or deployment or "Suspended", message)
        if deployment:
            return GangState("running", deployment, message)
        return GangState("pending")
    if kind == "MPIJob":
        # kubeflow common JobStatus: conditions Created, Running, Restarting, Succeeded, Suspended, Failed
        done = condition(obj, "Succeeded")
        if is_true(done):
            return GangState("succeeded", done.get("reason", ""), done.get("message", ""))
        failed = condition(obj, "Failed")
        if is_true(failed):
            return GangState("failed", failed.get("reason", ""), failed.get("message", ""))
        suspended = condition(obj, "Suspended")
        run_policy = (obj.get("spec") or {}).get("runPolicy") or {}
        if is_true(suspended) or (suspended is None and run_policy.get("suspend")):
            return GangState("suspended", (suspended or {}).get("reason", ""), (suspended or {}).get("message", ""))
        running = condition(obj, "Running")
        if is_true(running):
            return GangState("running", running.get("reason", ""), running.get("message", ""))
        return GangState("running" if status else "pending")
    raise ValueError(f"unknown gang kind {kind!r}")


# --- Kueue ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadState:
    name: str
    quota_reserved: bool
    admitted: bool
    admitted_at: str | None
    evicted: dict[str, str] | None  # {reason, message} once Kueue evicted (preempted, timeouts, ...)
    waiting: str | None  # why it is not admitted, in Kueue's words
    cluster: str | None = None  # MultiKueue: the worker cluster it was dispatched to (status.clusterName)


def workload_state(wl: Mapping[str, Any]) -> WorkloadState:
    name = (wl.get("metadata") or {}).get("name", "?")
    quota = condition(wl, "QuotaReserved")
    admitted = condition(wl, "Admitted")
    evicted = condition(wl, "Evicted")
    waiting = None
    if not is_true(quota):
        if quota and quota.get("message"):
            waiting = quota["message"]
        else:
            waiting = "waiting for Kueue to consider the Workload (no QuotaReserved condition yet)"
    elif not is_true(admitted):
        checks = [c for c in ((wl.get("status") or {}).get("admissionChecks") or []) if c.get("state") != "Ready"]
        if checks:
            waiting = "quota reserved; waiting for admission checks: " + "; ".join(
                f"{c.get('name')}={c.get('state')}" + (f" ({c['message']})" if c.get("message") else "") for c in checks
            )
        else:
            waiting = "quota reserved; waiting for admission" + (f": {admitted['message']}" if admitted and admitted.get("message") else "")
    ev = None
    if is_true(evicted):
        ev = {"type": "Evicted", "reason": evicted.get("reason", ""), "message": evicted.get("message", "")}
    return WorkloadState(
        name=name,
        quota_reserved=is_true(quota),
        admitted=is_true(admitted),
        admitted_at=admitted.get("lastTransitionTime") if is_true(admitted) else None,
        evicted=ev,
        waiting=waiting,
        cluster=(wl.get("status") or {}).get("clusterName") or None,
    )


# --- Volcano PodGroup ----------------------------------------------------------------------------


def podgroup_waiting(pg: Mapping[str, Any]) -> str | None:
    status = pg.get("status") or {}
    phase = status.get("phase")
    if phase == "Running":
        return None
    for cond in conditions(pg):
        if cond.get("type") == "Unschedulable" and is_true(cond):
            return f"Volcano PodGroup {pg.get('metadata', {}).get('name')} {cond.get('reason', 'Unschedulable')}: {cond.get('message', '')}".strip()
    return f"Volcano PodGroup phase {phase or 'Pending'}"


# --- pods ----------------------------------------------------------------------------------------


def pod_rank(pod: Mapping[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    for source in (meta.get("labels") or {}, meta.get("annotations") or {}):
        for key in RANK_KEYS:
            if key in source:
                try:
                    return int(source[key])
                except (TypeError, ValueError):
                    pass
    return None


def _container_status(pod: Mapping[str, Any], container: str | None = None) -> dict[str, Any]:
    statuses = list((pod.get("status") or {}).get("containerStatuses") or [])
    for cs in statuses:
        if container and cs.get("name") == container:
            return cs
    return statuses[0] if statuses else {}


def _terminated(cs: Mapping[str, Any]) -> dict[str, Any] | None:
    return ((cs.get("state") or {}).get("terminated")) or ((cs.get("lastState") or {}).get("terminated")) or None


def _waiting(cs: Mapping[str, Any]) -> dict[str, Any] | None:
    return (cs.get("state") or {}).get("waiting") or None


@dataclass(frozen=True)
class PodView:
    name: str
    rank: int | None
    phase: str
    scheduled: bool
    ready: bool
    failed: bool
    succeeded: bool
    waiting_reason: str | None
    waiting_message: str | None
    unschedulable: str | None  # PodScheduled=False message
    deleting: bool


def pod_view(pod: Mapping[str, Any]) -> PodView:
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    scheduled = condition(pod, "PodScheduled")
    cs = _container_status(pod)
    waiting = _waiting(cs) or {}
    unschedulable = None
    if scheduled and scheduled.get("status") == "False":
        unschedulable = scheduled.get("message") or scheduled.get("reason")
    return PodView(
        name=(pod.get("metadata") or {}).get("name", "?"),
        rank=pod_rank(pod),
        phase=phase,
        scheduled=is_true(scheduled) or bool((pod.get("spec") or {}).get("nodeName")),
        ready=phase == "Succeeded" or is_true(condition(pod, "Ready")),
        failed=phase == "Failed",
        succeeded=phase == "Succeeded",
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        unschedulable=unschedulable,
        deleting=bool((pod.get("metadata") or {}).get("deletionTimestamp")),
    )


def event_list(events: Iterable[Mapping[str, Any]], limit: int = MAX_EVENTS) -> list[dict[str, str]]:
    """[{reason, message}] of the newest events (deduplicated, oldest first)."""

    def stamp(e: Mapping[str, Any]) -> str:
        return e.get("lastTimestamp") or e.get("eventTime") or (e.get("metadata") or {}).get("creationTimestamp") or ""

    out: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for e in sorted(events, key=stamp):
        item = (e.get("reason") or "", e.get("message") or e.get("note") or "")
        if item in seen:
            continue
        seen.add(item)
        out.append({"reason": item[0], "message": item[1]})
    return out[-limit:]


def tail(text: str | None, lines: int = LOG_TAIL_LINES, chars: int = LOG_TAIL_CHARS) -> str | None:
    if not text:
        return None
    out = "\n".join(text.rstrip("\n").splitlines()[-lines:])
    return out[-chars:]


def _parse_error_record(message: str | None) -> dict[str, Any] | None:
    if not message:
        return None
    try:
        record = json.loads(message)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def pod_evidence(
    pod: Mapping[str, Any],
    *,
    events: Iterable[Mapping[str, Any]] = (),
    log: str | None = None,
    container: str | None = None,
) -> dict[str, Any]:
    """Evidence for one pod in the classifier's keys (contract 4), plus pod/rank/node."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    cs = _container_status(pod, container)
    term = _terminated(cs)
    waiting = _waiting(cs)
    ev: dict[str, Any] = {"pod": meta.get("name"), "rank": pod_rank(pod), "node": (pod.get("spec") or {}).get("nodeName")}
    if term:
        ev["finished_at"] = term.get("finishedAt")  # orders ranks to find the first failure
        ev["exit_code"] = term.get("exitCode")
        signal = term.get("signal")
        if not signal and isinstance(term.get("exitCode"), int) and term["exitCode"] > 128:
            signal = term["exitCode"] - 128
        if signal:
            ev["signal"] = signal
        if term.get("reason"):
            ev["termination_reason"] = term["reason"]
        record = _parse_error_record(term.get("message"))
        if record is not None:
            ev["error_file"] = record
        elif term.get("message") and not log:
            log = term["message"]  # FallbackToLogsOnError: the message is the log's last lines
    elif waiting:
        ev["termination_reason"] = waiting.get("reason")
        if waiting.get("message"):
            ev["pod_message"] = waiting["message"]
    ev["pod_phase"] = status.get("phase")
    if status.get("reason"):
        ev["pod_reason"] = status["reason"]
    if status.get("message"):
        ev["pod_message"] = status["message"]
    conds = [
        {"type": c.get("type"), "reason": c.get("reason", ""), "message": c.get("message", "")}
        for c in conditions(pod)
        if c.get("type") == "DisruptionTarget" or c.get("reason") or c.get("message")
    ]
    if conds:
        ev["pod_conditions"] = conds
    evs = event_list(events)
    if evs:
        ev["events"] = evs
    log_tail = tail(log)
    if log_tail:
        ev["log_tail"] = log_tail
    return {k: v for k, v in ev.items() if v is not None}


def is_mpi_launcher(pod: Mapping[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(MPI_ROLE_LABEL) == "launcher"


def hosts_ranks(kind: str, pod: Mapping[str, Any]) -> bool:
    """Whether `pod` runs training ranks: every pod of a JobSet, Volcano Job or TrainJob; an MPIJob's
    workers, not its launcher; a RayJob's worker nodes, not its head (`num-cpus: 0`) nor its submitter."""
    if kind == "MPIJob":
        return not is_mpi_launcher(pod)
    if kind == "RayJob":
        return ((pod.get("metadata") or {}).get("labels") or {}).get(RAY_NODE_TYPE_LABEL) == "worker"
    return True


def _finished_at(ev: Mapping[str, Any]) -> str:
    if ev.get("finished_at"):
        return ev["finished_at"]
    # taken away without a terminated container (evicted, never started): first in line
    return "" if _priority(ev) == 0 else "9999-12-31T23:59:59Z"


def _priority(ev: Mapping[str, Any]) -> int:
    """Lower is more likely the root cause when ranks failed within the same second."""
    conds = {c.get("type") for c in ev.get("pod_conditions") or []}
    if "DisruptionTarget" in conds or ev.get("pod_reason") in DISRUPTION_POD_REASONS or ev.get("termination_reason") == "OOMKilled":
        return 0
    if ev.get("termination_reason") in FATAL_WAITING_REASONS | IMAGE_PULL_REASONS:
        return 0
    if ev.get("error_file"):
        return 1
    return 2


def root_cause_order(ranks: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Failed ranks, most likely root cause first: the first to fail; within the same second a
    disruption/OOM before a rank's own error record before the rest; then by rank."""
    return sorted(ranks, key=lambda e: (_finished_at(e), _priority(e), e.get("rank") if e.get("rank") is not None else 1 << 30))


def gang_evidence(ranks: list[dict[str, Any]], *, extra: Mapping[str, Any] | None = None,
                  root_rank: int | None = None) -> dict[str, Any]:
    """Top level = the root-cause pod's evidence (the first to fail); `ranks` = every failed pod.

    `extra` adds gang-level facts (Kueue eviction, JobSet Failed condition) to pod_conditions/events.
    `root_rank`: the rank a launcher's own evidence already named first (a Ray job's), kept first.
    """
    clean = [dict(e) for e in root_cause_order(ranks)]
    if root_rank is not None:
        clean.sort(key=lambda e: e.get("rank") != root_rank or bool(e.get("pod")))  # stable: the rest keep their order
    evidence: dict[str, Any] = dict(clean[0]) if clean else {}
    extra = dict(extra or {})
    if extra.get("pod_conditions"):
        evidence["pod_conditions"] = list(evidence.get("pod_conditions") or []) + list(extra.pop("pod_conditions"))
    if extra.get("events"):
        evidence["events"] = (list(evidence.get("events") or []) + list(extra.pop("events")))[-2 * MAX_EVENTS :]
    for key, value in extra.items():
        evidence.setdefault(key, value)
    evidence["ranks"] = sorted(clean, key=lambda e: (e.get("rank") if e.get("rank") is not None else 1 << 30, e.get("pod") or ""))
    return evidence
