"""The few Kubernetes API calls the gang backend and its trigger make, on the async client.

Calls return the API server's JSON as dicts. Transient failures (5xx, 429, timeouts, connection
errors) raise `KubernetesApiError` (infra), other 4xx `KubernetesRequestError` (user); the status
classes are trainer.failure_catalogue's. The RBAC they need: docs/kubernetes.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

from operators.exceptions import KubernetesApiError, KubernetesRequestError

T = TypeVar("T")

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
VOLCANO_SCHEDULING = ("scheduling.volcano.sh", "v1beta1", "podgroups")
REQUEST_TIMEOUT = 30  # seconds per API call


def run_sync(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine from synchronous code (a worker's execute); in a thread if a loop runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


@contextlib.asynccontextmanager
async def open_api(kubernetes_conn_id: str | None, namespace: str) -> AsyncIterator[GangApi]:
    """A `GangApi` on the client the Airflow connection describes (in-cluster, kubeconfig, ...)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

    hook = AsyncKubernetesHook(conn_id=kubernetes_conn_id)
    try:
        async with hook.get_conn() as api_client:
            yield GangApi(api_client, namespace)
    except (KubernetesApiError, KubernetesRequestError):
        raise
    except Exception as exc:
        if type(exc).__name__ in ("ConfigException", "AirflowNotFoundException"):
            raise KubernetesRequestError(f"Kubernetes connection {kubernetes_conn_id!r}: {exc}") from exc
        raise


def _api_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if body:
        try:
            data = json.loads(body)
            if isinstance(data, dict) and data.get("message"):
                return str(data["message"])
        except ValueError:
            return str(body)[:500]
    return str(getattr(exc, "reason", "") or exc)


class GangApi:
    """Namespaced JSON calls, each wrapped with what/where in its error message."""

    def __init__(self, api_client: Any, namespace: str):
        self.client = api_client
        self.namespace = namespace

    async def _call(
        self,
        action: str,
        what: str,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: Any = None,
        response: str = "object",
        missing_ok: bool = False,
        content_type: str = "application/json",
    ) -> Any:
        from kubernetes_asyncio.client.exceptions import ApiException

        headers = {"Accept": "application/json" if response == "object" else "*/*"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            return await self.client.call_api(
                path,
                method,
                query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
                header_params=headers,
                body=body,
                response_types_map={200: response, 201: response, 202: response},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=True,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            status = exc.status or 0
            if status == 404 and missing_ok:
                return None
            message = f"{action} {what}: HTTP {status} {exc.reason or ''}: {_api_message(exc)}".replace("  ", " ")
            from trainer.failure_catalogue import http_status_kind

            if status == 0 or http_status_kind(status) == "infra":
                raise KubernetesApiError(message) from None
            err = KubernetesRequestError(message)
            err.status = status  # type: ignore[attr-defined]
            raise err from None
        except (asyncio.TimeoutError, OSError) as exc:
            raise KubernetesApiError(f"{action} {what}: {type(exc).__name__}: {exc or 'timed out'}") from None
        except Exception as exc:  # aiohttp.ClientError and friends
            if type(exc).__module__.startswith("aiohttp"):
                raise KubernetesApiError(f"{action} {what}: {type(exc).__name__}: {exc}") from None
            raise

    # --- custom resources -------------------------------------------------------------------------

    def _custom_path(self, group: str, version: str, plural: str, name: str | None = None) -> str:
        path = f"/apis/{group}/{version}/namespaces/{quote(self.namespace)}/{plural}"
        return f"{path}/{quote(name)}" if name else path

    async def get_custom(self, group: str, version: str, plural: str, kind: str, name: str) -> dict[str, Any] | None:
        return await self._call(
            "get", f"{kind} {self.namespace}/{name}", "GET", self._custom_path(group, version, plural, name), missing_ok=True
        )

    async def list_custom(self, group: str, version: str, plural: str, kind: str, selector: str | None = None) -> list[dict[str, Any]]:
        data = await self._call(
            "list", f"{kind} in {self.namespace} ({selector or 'all'})", "GET", self._custom_path(group, version, plural), query={"labelSelector": selector}
        )
        return list((data or {}).get("items") or [])

    async def create_custom(self, group: str, version: str, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("metadata", {}).get("name")
        return await self._call(
            "create",
            f"{body.get('kind')} {self.namespace}/{name}",
            "POST",
            self._custom_path(group, version, plural),
            query={"fieldValidation": "Strict"},
            body=body,
        )

    async def patch_custom(self, group: str, version: str, plural: str, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (null removes a key)."""
        return await self._call(
            "patch", f"{kind} {self.namespace}/{name}", "PATCH", self._custom_path(group, version, plural, name), body=patch,
            content_type="application/merge-patch+json",
        )

    async def delete_custom(self, group: str, version: str, plural: str, kind: str, name: str, propagation: str = "Foreground") -> bool:
        """Delete; False when it was already gone."""
        result = await self._call(
            "delete",
            f"{kind} {self.namespace}/{name}",
            "DELETE",
            self._custom_path(group, version, plural, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation},
            missing_ok=True,
        )
        return result is not None

    # --- core -------------------------------------------------------------------------------------

    async def get_configmap(self, name: str) -> dict[str, Any] | None:
        return await self._call(
            "get", f"ConfigMap {self.namespace}/{name}", "GET", f"/api/v1/namespaces/{quote(self.namespace)}/configmaps/{quote(name)}", missing_ok=True
        )

    async def list_pods(self, selector: str) -> list[dict[str, Any]]:
        data = await self._call(
            "list", f"pods in {self.namespace} ({selector})", "GET", f"/api/v1/namespaces/{quote(self.namespace)}/pods", query={"labelSelector": selector}
        )
        return list((data or {}).get("items") or [])

    async def list_events(self, name: str, kind: str | None = None) -> list[dict[str, Any]]:
        selector = f"involvedObject.name={name}" + (f",involvedObject.kind={kind}" if kind else "")
        data = await self._call(
            "list", f"events of {self.namespace}/{name}", "GET", f"/api/v1/namespaces/{quote(self.namespace)}/events", query={"fieldSelector": selector}
        )
        return list((data or {}).get("items") or [])

    async def read_log(self, pod: str, container: str | None = None, tail_lines: int = 50) -> str | None:
        """Log tail of a pod's container; None when the pod or its log is gone."""
        try:
            return await self._call(
                "read log of",
                f"pod {self.namespace}/{pod}",
                "GET",
                f"/api/v1/namespaces/{quote(self.namespace)}/pods/{quote(pod)}/log",
                query={"container": container, "tailLines": tail_lines, "limitBytes": 64 * 1024},
                response="str",
                missing_ok=True,
            )
        except KubernetesRequestError as exc:
            if getattr(exc, "status", None) == 400:  # container not started yet / log rotated
                return None
            raise

    # --- Kueue / Volcano --------------------------------------------------------------------------

    async def list_workloads(self, owner_uid: str) -> list[dict[str, Any]]:
        """Kueue Workloads of a job (label kueue.x-k8s.io/job-uid); [] when Kueue's API is absent."""
        for version in KUEUE_VERSIONS:
            try:
                return await self.list_custom(KUEUE_GROUP, version, "workloads", "Workload", f"kueue.x-k8s.io/job-uid={owner_uid}")
            except KubernetesRequestError as exc:
                if getattr(exc, "status", None) != 404:
                    raise
        return []

    async def get_kueue(self, plural: str, kind: str, name: str, *, cluster_scoped: bool = False) -> dict[str, Any] | None:
        for version in KUEUE_VERSIONS:
            path = (
                f"/apis/{KUEUE_GROUP}/{version}/{plural}/{quote(name)}"
                if cluster_scoped
                else f"/apis/{KUEUE_GROUP}/{version}/namespaces/{quote(self.namespace)}/{plural}/{quote(name)}"
            )
            where = name if cluster_scoped else f"{self.namespace}/{name}"
            found = await self._call("get", f"{kind} {where}", "GET", path, missing_ok=True)
            if found is not None:
                return found
        return None

    async def list_podgroups(self, owner_uid: str) -> list[dict[str, Any]]:
        group, version, plural = VOLCANO_SCHEDULING
        items = await self.list_custom(group, version, plural, "PodGroup")
        return [pg for pg in items if any(ref.get("uid") == owner_uid for ref in (pg.get("metadata") or {}).get("ownerReferences") or [])]
