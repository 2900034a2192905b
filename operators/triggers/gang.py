"""`GangTrigger`: waits, in the triggerer, for a Kubernetes training gang to end.

It polls the gang through `GangWatcher`, logs why it waits in the cluster's words (Kueue's
messages, scheduling events, image pull errors) and yields ONE event whose `status` is success,
failed (with the classifier's `evidence`), timeout or error (docs/kubernetes.md, "Lifecycle").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.exceptions import GangflowError, KubernetesApiError


class GangTrigger(BaseTrigger):
    """Watch the gang named by `handle` (see `KubernetesBackend.submit`) until it ends."""

    def __init__(
        self,
        *,
        handle: dict[str, Any],
        kubernetes_conn_id: str | None = "kubernetes_default",
        poll_interval: float = 10.0,
        log_interval: float = 60.0,
        image_pull_grace_seconds: float = 300.0,
        max_api_errors: int = 6,
    ):
        super().__init__()
        self.handle = dict(handle)
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval = float(poll_interval)
        self.log_interval = float(log_interval)
        self.image_pull_grace_seconds = float(image_pull_grace_seconds)
        self.max_api_errors = int(max_api_errors)
        self.reports: list[str] = []  # what was logged, also kept for tests and the final event

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "operators.triggers.gang.GangTrigger",
            {
                "handle": self.handle,
                "kubernetes_conn_id": self.kubernetes_conn_id,
                "poll_interval": self.poll_interval,
                "log_interval": self.log_interval,
                "image_pull_grace_seconds": self.image_pull_grace_seconds,
                "max_api_errors": self.max_api_errors,
            },
        )

    def _report(self, message: str) -> None:
        self.reports.append(message)
        self.reports = self.reports[-50:]
        self.log.info(message)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from operators.hooks.kubernetes import open_api
        from operators.kubernetes.watch import GangWatcher

        h = self.handle
        where = f"{h['kind']} {h['namespace']}/{h['name']}"
        event: dict[str, Any] | None = None
        errors = 0
        watcher = None
        while event is None:
            try:
                async with open_api(self.kubernetes_conn_id, h["namespace"]) as api:
                    if watcher is None:
                        watcher = GangWatcher(
                            api,
                            h,
                            image_pull_grace_seconds=self.image_pull_grace_seconds,
                            log_interval=self.log_interval,
                            log=self._report,
                        )
                    watcher.api = api
                    while event is None:
                        event = await watcher.poll()
                        errors = 0
                        if event is None:
                            await asyncio.sleep(self.poll_interval)
            except KubernetesApiError as exc:  # transient: keep watching a few polls
                errors += 1
                self._report(f"{where}: Kubernetes API error {errors}/{self.max_api_errors}: {exc}")
                if errors >= self.max_api_errors:
                    event = {"status": "error", "phase": getattr(watcher, "phase", "admission"), "message": str(exc)}
                else:
                    await asyncio.sleep(self.poll_interval)
            except GangflowError as exc:  # 4xx: RBAC, missing CRD... no point in waiting
                event = {"status": "error", "phase": getattr(watcher, "phase", "admission"), "message": str(exc)}
        event.setdefault("kind", h["kind"])
        event.setdefault("name", h["name"])
        event.setdefault("namespace", h["namespace"])
        event.setdefault("waiting", list(watcher.waiting) if watcher else [])
        self._report(f"{where}: {event['status']}: {event.get('message', '')}")
        yield TriggerEvent(event)

    async def on_kill(self) -> None:
        """The user killed the deferred task (mark failed/success, clear): delete the gang."""
        from operators.hooks.kubernetes import open_api

        h = self.handle
        async with open_api(self.kubernetes_conn_id, h["namespace"]) as api:
            deleted = await api.delete_custom(h["group"], h["version"], h["plural"], h["kind"], h["name"], propagation="Foreground")
        self.log.info("%s %s/%s %s on kill", h["kind"], h["namespace"], h["name"], "deleted" if deleted else "already gone")
