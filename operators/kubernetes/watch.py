"""Watch one gang until it ends: admission, startup, run. Used by `GangTrigger` (in the
triggerer) and, for evidence and teardown, by `KubernetesBackend.collect` (in the worker).

`GangWatcher.poll()` returns None (keep waiting) or the trigger's final event; a failure's
evidence (contract 4) is snapshotted as soon as the first rank fails, before the Job controller
removes the other pods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from operators.failures.evidence import job_message_evidence, mpirun_launcher_evidence
from operators.kubernetes import status as st
from operators.hooks.kubernetes import GangApi

MAX_EVIDENCE_PODS = 8
MAX_WAITING_NOTES = 10


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


async def gather_evidence(
    api: GangApi,
    handle: Mapping[str, Any],
    *,
    obj: Mapping[str, Any] | None = None,
    pods: list[dict[str, Any]] | None = None,
    workload: Mapping[str, Any] | None = None,
    stuck: set[str] | None = None,
    max_pods: int = MAX_EVIDENCE_PODS,
) -> dict[str, Any]:
    """Evidence of a failed gang: every failed (or stuck) pod with its events and log tail,
    plus gang-level facts (the gang's Failed condition, a Kueue eviction, the gang's events)."""
    kind, name = handle["kind"], handle["name"]
    if pods is None:
        pods = await api.list_pods(handle["pod_selector"])
    stuck = stuck or set()
    chosen = [p for p in pods if st.pod_view(p).failed or (p.get("metadata") or {}).get("name") in stuck]
    if not chosen:  # e.g. Kueue evicted the gang: pods are terminating, none failed yet
        chosen = [p for p in pods if st.pod_view(p).deleting or st.pod_view(p).waiting_reason in st.IMAGE_PULL_REASONS]
    # every failed pod is in the evidence; the likeliest root causes also get events and logs
    by_name = {p["metadata"]["name"]: p for p in chosen}
    ranks = [st.pod_evidence(p, container=handle.get("container")) for p in chosen]
    others: list[dict[str, Any]] = []
    for ev in st.root_cause_order(ranks)[:max_pods]:
        pod = by_name[ev["pod"]]
        events = await api.list_events(ev["pod"], "Pod")
        launcher = st.is_mpi_launcher(pod)  # its log holds every rank's lines: more of it, then the failed rank's own
        log = await api.read_log(ev["pod"], handle.get("container"), tail_lines=st.LOG_TAIL_LINES * (8 if launcher else 1))
        ev.update(st.pod_evidence(pod, events=events, log=log, container=handle.get("container")))
        if launcher and log and (first := mpirun_launcher_evidence(log, st.LOG_TAIL_LINES)):
            record = ev.get("error_file")
            if isinstance(record, dict) and record.get("rank") not in (None, first["rank"]):
                # a record another rank wrote (e.g. the peer that lost it) is that rank's evidence; that
                # rank ran on a worker, not in this pod
                del ev["error_file"]
                others.append({"rank": record["rank"], "error_file": record})
            ev.update(first)
    ranks += others
    extra: dict[str, Any] = {}
    gang_conditions = []
    state = st.gang_state(kind, obj) if obj is not None else None
    if state is not None:
        if state.state == "failed":
            gang_conditions.append({"type": f"{kind}Failed", "reason": state.reason, "message": state.message})
    if workload is not None:
        wl = st.workload_state(workload)
        if wl.evicted:
            gang_conditions.append(dict(wl.evicted))
            extra.setdefault("pod_reason", wl.evicted.get("reason"))
            extra.setdefault("pod_message", f"Kueue evicted Workload {wl.name}: {wl.evicted.get('message')}")
    if gang_conditions:
        extra["pod_conditions"] = gang_conditions
    gang_events = st.event_list(await api.list_events(name))
    if gang_events:
        extra["events"] = gang_events
    if not ranks and state is not None and "pod_reason" not in extra:
        extra["pod_reason"] = state.reason or f"{kind}Failed"
        extra["pod_message"] = state.message or f"{kind} {handle['namespace']}/{name} failed without a failed pod"
    if state is not None and state.state == "failed" and state.reason == "DeadlineExceeded":
        # the gang's own run-time limit (a TrainJob's or RayJob's activeDeadlineSeconds): its controller
        # deleted the pods, so the ranks' SIGTERM exits (75 after the final checkpoint) are not a preemption
        return {**st.gang_evidence(ranks, extra=extra), "pod_reason": state.reason, "pod_message": state.message}
    if kind == "RayJob" and state is not None:
        # KubeRay's AppFailed message is Ray's, ending with the driver's output: the Ray Train ranks'
        # failures are judged there, as the local ray backend judges them (the pods, being shut
        # down with the RayCluster, and the message's first KiB say little)
        if (driver := job_message_evidence(state.message)) is not None:
            return {**extra, **driver}
    return st.gang_evidence(ranks, extra=extra)


class GangWatcher:
    """Polls one gang; `poll()` returns the final event or None."""

    def __init__(
        self,
        api: GangApi,
        handle: Mapping[str, Any],
        *,
        image_pull_grace_seconds: float = 300,
        log_interval: float = 60,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.api = api
        self.handle = dict(handle)
        self.kind = handle["kind"]
        self.name = handle["name"]
        self.namespace = handle["namespace"]
        self.world_size = int(handle.get("pods") or handle["world_size"])  # pods to watch (world size / processes per pod)
        self.admission_timeout = float(handle["admission_timeout_seconds"])
        self.admission_timeout_field = str(handle.get("admission_timeout_field") or "admissionTimeoutSeconds")
        self.startup_timeout = float(handle["startup_timeout_seconds"])
        self.image_pull_grace = float(image_pull_grace_seconds)
        self.log_interval = float(log_interval)
        self.log = log or (lambda message: None)
        self.clock = clock
        self.first_seen = clock()
        self.created_at: float | None = None
        self.admitted_at: float | None = None
        self.started_at: float | None = None
        self.phase = "admission"
        self.waiting: list[dict[str, Any]] = []  # distinct reasons, in order: {phase, reason, since_s}
        self._last_reason: str | None = None
        self._last_logged = 0.0
        self._pull_since: dict[str, float] = {}
        self.pauses = 0  # times the gang was paused (`python -m operators.cli.gang pause`) and resumed
        self.paused_at: float | None = None
        self.dispatched_to: str | None = None  # MultiKueue: the worker cluster that runs the gang

    # --- helpers ----------------------------------------------------------------------------------

    @property
    def where(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"

    def _note(self, reason: str, now: float, since: float) -> None:
        """Log why we wait, in the cluster's words: when the reason changes, then every log_interval."""
        waited = now - since
        if reason != self._last_reason:
            self.waiting.append({"phase": self.phase, "reason": reason, "after_seconds": round(waited, 1)})
            self.waiting = self.waiting[-MAX_WAITING_NOTES:]
        if reason != self._last_reason or now - self._last_logged >= self.log_interval:
            self.log(f"{self.where} waiting for {self.phase} for {format_duration(waited)}: {reason}")
            self._last_logged = now
        self._last_reason = reason

    def _wait_or_time_out(self, reason: str, now: float, since: float, limit: float, what: str) -> dict[str, Any] | None:
        """The timeout event once `limit` seconds have passed since `since`; until then, note why we wait."""
        waited = now - since
        if waited >= limit:
            return self._event("timeout", f"{self.where} {what} (waited {format_duration(waited)}); last reason: {reason}", now)
        self._note(reason, now, since)
        return None

    def _event(self, status: str, message: str, now: float, **extra: Any) -> dict[str, Any]:
        event = {
            "status": status,
            "phase": self.phase,
            "kind": self.kind,
            "name": self.name,
            "namespace": self.namespace,
            "message": message,
            "waited_seconds": round(now - (self.created_at or self.first_seen), 1),
            "waiting": list(self.waiting),
            "pauses": self.pauses,
            "dispatched_to": self.dispatched_to,
        }
        event.update(extra)
        return event

    async def _failed(self, message: str, now: float, **kwargs: Any) -> dict[str, Any]:
        evidence = await gather_evidence(self.api, self.handle, **kwargs)
        if self.dispatched_to:  # its pods ran on that worker cluster, out of this cluster's sight
            evidence["dispatched_to"] = self.dispatched_to
        return self._event("failed", message, now, evidence=evidence)

    async def _last_pod_event(self, pod: str, keep: Callable[[dict[str, Any]], bool]) -> dict[str, str] | None:
        """The newest of a pod's events that `keep` accepts ({reason, message}), or None."""
        events = [e for e in await self.api.list_events(pod, "Pod") if keep(e)]
        return st.event_list(events)[-1] if events else None

    async def _pod_reasons(self, pods: list[dict[str, Any]], views: list[st.PodView]) -> list[str]:
        """Why pods are not running yet: PodScheduled=False messages, FailedScheduling events,
        container waiting reasons (ImagePullBackOff with the kubelet's message), a running pod's
        failed readiness probe (the kubelet's Unhealthy event)."""
        reasons: list[str] = []
        looked_up = 0
        for pod, view in zip(pods, views):
            if view.ready or view.failed:
                continue
            rank = f"rank {view.rank}" if view.rank is not None else view.name
            if not view.scheduled:
                message = view.unschedulable
                if looked_up < 2:
                    looked_up += 1
                    last = await self._last_pod_event(view.name, lambda e: e.get("reason") in ("FailedScheduling", "FailedCreate", "FailedMount"))
                    if last:
                        message = f"{last['reason']}: {last['message']}"
                reasons.append(f"{rank} unscheduled: {message or 'waiting for the scheduler'}")
            elif view.waiting_reason:
                reasons.append(f"{rank} {view.waiting_reason}" + (f": {view.waiting_message}" if view.waiting_message else ""))
            else:
                message = ""
                if view.phase == "Running" and looked_up < 2:  # the kubelet's word on its readiness probe
                    looked_up += 1
                    last = await self._last_pod_event(
                        view.name, lambda e: e.get("reason") == "Unhealthy" and (e.get("message") or "").startswith("Readiness probe"))
                    if last:
                        message = f": {last['message']}"
                reasons.append(f"{rank} {view.phase}, not Ready{message}")
        # one line per distinct reason, with how many ranks share it
        counted: dict[str, int] = {}
        for reason in reasons:
            key = reason.split(" ", 2)[-1] if reason.startswith("rank ") else reason
            counted[key] = counted.get(key, 0) + 1
        return [f"{n} rank(s) {key}" if n > 1 else key for key, n in counted.items()]

    # --- one poll ---------------------------------------------------------------------------------

    async def poll(self) -> dict[str, Any] | None:
        now = self.clock()
        h = self.handle
        obj = await self.api.get_custom(h["group"], h["version"], h["plural"], self.kind, self.name)
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            gone = "was deleted" if obj is None else "is being deleted"
            message = f"{self.where} {gone} outside gangflow before it finished"
            return self._event(
                "failed", message, now, evidence={"pod_reason": "GangDeleted", "pod_message": message, "ranks": []}
            )
        if self.created_at is None:
            created = st.parse_time((obj.get("metadata") or {}).get("creationTimestamp"))
            self.created_at = min(created, now) if created else self.first_seen
        if self._paused(obj, now):
            return None
        state = st.gang_state(self.kind, obj)
        pods = await self.api.list_pods(h["pod_selector"])
        views = [st.pod_view(p) for p in pods]

        workload = wl = None
        if h.get("scheduler") == "kueue" and h.get("uid"):
            workloads = await self.api.list_workloads(h["uid"])
            workload = workloads[0] if workloads else None
            wl = st.workload_state(workload) if workload is not None else None
            # before the end is read: a gang MultiKueue dispatched that ran and ended between two
            # polls is still named (Kueue keeps status.clusterName on a finished Workload)
            if wl is not None and wl.cluster and wl.cluster != self.dispatched_to:
                self.log(f"{self.where} dispatched by MultiKueue to worker cluster {wl.cluster!r}: its pods run there")
                self.dispatched_to = wl.cluster

        if state.state == "succeeded":
            return self._event("success", f"{self.where} succeeded: {state.message or state.reason or 'all ranks completed'}", now)

        # --- failure: any failed rank dooms the gang (max-restarts 0, backoffLimit 0) -------------
        stuck: set[str] = set()
        for view in views:
            if view.waiting_reason in st.FATAL_WAITING_REASONS:
                stuck.add(view.name)
            elif view.waiting_reason in st.IMAGE_PULL_REASONS:
                since = self._pull_since.setdefault(view.name, now)
                if now - since >= self.image_pull_grace:
                    stuck.add(view.name)
            else:
                self._pull_since.pop(view.name, None)
        failed = [v for v in views if v.failed]
        if state.state == "failed" or failed or stuck:
            if failed:
                first = sorted(failed, key=lambda v: v.rank if v.rank is not None else 1 << 30)[0]
                what = f"{len(failed)} of {self.world_size} rank(s) failed (first: {first.name})"
            elif stuck:
                names = sorted(stuck)
                what = f"rank pod(s) cannot start: {', '.join(names)}"
            else:
                what = f"{state.reason}: {state.message}".strip(": ")
            return await self._failed(f"{self.where} failed: {what}", now, obj=obj, pods=pods, workload=workload, stuck=stuck)
        if wl is not None and wl.evicted and not self._requeued_after_resume(wl):
            return await self._failed(
                f"{self.where} failed: Kueue evicted Workload {wl.name} ({wl.evicted['reason']}): {wl.evicted['message']}",
                now,
                obj=obj,
                pods=pods,
                workload=workload,
            )

        # --- admission ------------------------------------------------------------------------------
        if self.admitted_at is None:
            admitted, reason = await self._admission(obj, state, workload, pods, views)
            if not admitted:
                return self._wait_or_time_out(reason, now, self.created_at, self.admission_timeout,
                                              f"was not admitted within {self.admission_timeout_field}={int(self.admission_timeout)}")
            admitted_at = st.parse_time(wl.admitted_at) if wl is not None else None
            self.admitted_at = max(self.created_at, min(admitted_at, now)) if admitted_at else now
            self.phase = "startup"
            self.log(f"{self.where} admitted after {format_duration(self.admitted_at - self.created_at)}")

        # --- startup: every rank Ready ---------------------------------------------------------------
        if self.started_at is None and self.dispatched_to:
            # MultiKueue: the pods are on the worker cluster; the worker's own Kueue and kubelet bound
            # their start, and the gang's status comes back through this cluster's copy
            self.started_at = now
            self.phase = "running"
            self.log(f"{self.where} running on worker cluster {self.dispatched_to!r} (MultiKueue)")
            return None
        rank_pods = [(p, v) for p, v in zip(pods, views) if st.hosts_ranks(self.kind, p)]
        if self.started_at is None:
            ready = sum(1 for _, v in rank_pods if v.ready)
            if ready >= self.world_size:
                self.started_at = now
                self.phase = "running"
                self.log(f"{self.where} running: {ready}/{self.world_size} ranks Ready after {format_duration(now - self.admitted_at)}")
                return None
            reasons = await self._pod_reasons(pods, views)  # every pod's: a head or launcher may hold the ranks up
            if len(rank_pods) < self.world_size:
                reasons.insert(0, f"{len(rank_pods)}/{self.world_size} rank pods created")
            reason = f"{ready}/{self.world_size} ranks Ready; " + "; ".join(reasons)
            return self._wait_or_time_out(reason, now, self.admitted_at, self.startup_timeout,
                                          f"was admitted but not all ranks became Ready within startupTimeoutSeconds={int(self.startup_timeout)}")

        # --- running ---------------------------------------------------------------------------------
        if self.dispatched_to:
            if now - self._last_logged >= self.log_interval:
                self.log(f"{self.where} running on worker cluster {self.dispatched_to!r} for {format_duration(now - self.started_at)}")
                self._last_logged = now
            return None
        if now - self._last_logged >= self.log_interval:
            ready = sum(1 for _, v in rank_pods if v.ready)
            self.log(f"{self.where} running for {format_duration(now - self.started_at)}: {ready}/{self.world_size} ranks Ready")
            self._last_logged = now
        return None

    def _paused(self, obj: Mapping[str, Any], now: float) -> bool:
        """While the gang carries the pause annotation: say so, no timeout runs. Once it is gone (its
        paused pods are gone too: `resume` waits for them), admission and start-up again, their
        timeouts counted from the resume. The pause count is the gang's own annotation."""
        from operators.kubernetes.builders import PAUSED_ANNOTATION, pause_count

        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        self.pauses = max(self.pauses, pause_count(annotations))  # a pause between two polls counts too
        paused = annotations.get(PAUSED_ANNOTATION)
        if paused is not None:
            if self.paused_at is None:
                self.paused_at = now
                self.log(f"{self.where} paused ({paused}): its ranks take a final checkpoint and stop; "
                         f"it waits for `python -m operators.cli.gang resume {self.handle.get('gang') or self.name}`")  # fmt: skip
            self.phase = "paused"
            self._note("paused", now, self.paused_at)
            return True
        if self.paused_at is not None:
            self.log(f"{self.where} resumed after {format_duration(now - self.paused_at)} paused")
            self.paused_at = None
            self.created_at, self.admitted_at, self.started_at, self.phase = now, None, None, "admission"
        return False

    def _requeued_after_resume(self, wl: st.WorkloadState) -> bool:
        """Kueue's eviction of a paused Workload (InactiveWorkload) lasts until it admits it again."""
        return self.pauses > 0 and (wl.evicted or {}).get("reason") == "InactiveWorkload" and not wl.admitted

    async def _admission(self, obj, state, workload, pods, views) -> tuple[bool, str]:
        if self.handle.get("scheduler") == "kueue":
            if workload is None:
                if state.state != "suspended" and pods:
                    return True, ""  # not managed by Kueue (its webhook off?): the pods are there
                return False, (
                    f"{self.kind} is suspended and Kueue has not created a Workload for it yet "
                    f"(is Kueue running, does it manage this kind, does LocalQueue {self.handle.get('queue')!r} exist?)"
                )
            wl = st.workload_state(workload)
            if wl.admitted:
                return True, ""
            return False, f"Kueue Workload {wl.name}: {wl.waiting}"
        # Volcano: admitted once every rank is bound to a node (gang: all or none)
        scheduled = sum(1 for v in views if v.scheduled)
        if len(views) >= self.world_size and scheduled >= self.world_size:
            return True, ""
        reasons = []
        if self.handle.get("uid"):
            for pg in await self.api.list_podgroups(self.handle["uid"]):
                waiting = st.podgroup_waiting(pg)
                if waiting:
                    reasons.append(waiting)
        reasons += await self._pod_reasons(pods, views)
        if not pods:
            reasons.append(f"Volcano Job phase {state.reason or 'Pending'}, no rank pods yet")
        return False, f"{scheduled}/{self.world_size} ranks scheduled; " + "; ".join(reasons)
