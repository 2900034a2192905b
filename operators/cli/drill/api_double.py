"""TEST DOUBLE of the Kubernetes API server: `InMemoryKubernetesApi`, for the Kubernetes backend
tests and `make cluster-drill`. Never use it as an API server for anything else.

An in-memory object store behind an HTTP server on 127.0.0.1 that serves the REST paths the gang
backend uses, so the real async clients run end to end. No controllers run: tests script what
they would do with `steps`, applied one per poll of the gang object.
"""

from __future__ import annotations

import copy
import json
import random
import re
import string
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from operators.kubernetes.status import timestamp as now  # objects are stamped with the moment they change

GANG_PLURALS = {("jobset.x-k8s.io", "jobsets"), ("batch.volcano.sh", "jobs"), ("trainer.kubeflow.org", "trainjobs")}
CLUSTER_SCOPED = {"clusterqueues"}


def name_suffix() -> str:
    """The five random characters the API server appends to a `generateName`."""
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


def _matches(labels: dict[str, str], selector: str | None) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        term = term.strip()
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            key = key.rstrip("=")
            if labels.get(key) != value:
                return False
        elif labels.get(term) is None:
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.split("."):
        value = (value or {}).get(part) if isinstance(value, dict) else None
    return value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = target if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class InMemoryKubernetesApi:
    """Test double of the Kubernetes API (see module doc). Use as a context manager."""

    def __init__(self, *, validator: Callable[[dict[str, Any]], None] | None = None):
        self.objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}  # (group, plural, ns, name)
        self.logs: dict[tuple[str, str], str] = {}  # (ns, pod) -> log text
        self.requests: list[tuple[str, str]] = []  # (method, path?query)
        self.steps: list[Callable[[InMemoryKubernetesApi], None]] = []
        self.polls = 0
        self.validator = validator
        self._faults: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> InMemoryKubernetesApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # one response = one round trip, no 40 ms delayed-ACK stalls

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                return json.loads(raw) if raw else None

            def _send(self, status: int, payload: Any, content_type: str = "application/json") -> None:
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                body = self._body() if method in ("POST", "DELETE", "PUT", "PATCH") else None
                status, payload, ctype = api.handle(method, self.path, body)
                self._send(status, payload, ctype)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_DELETE(self):
                self._handle("DELETE")

            def do_PATCH(self):
                self._handle("PATCH")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="InMemoryKubernetesApi", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> InMemoryKubernetesApi:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        """A kubeconfig pointing at this test double (for an Airflow kubernetes connection)."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "in-memory", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-double-token"}}],
            "contexts": [{"name": "in-memory", "context": {"cluster": "in-memory", "user": "test", "namespace": namespace}}],
            "current-context": "in-memory",
        }

    # --- store helpers for tests ------------------------------------------------------------------

    @staticmethod
    def _key(group: str, plural: str, namespace: str | None, name: str) -> tuple[str, str, str | None, str]:
        return (group, plural, None if plural in CLUSTER_SCOPED else namespace, name)

    def put(self, group: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Insert or replace an object as a controller would (no validation)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now())
        meta["resourceVersion"] = str(len(self.requests) + 1000)
        with self._lock:
            self.objects[self._key(group, plural, meta.get("namespace"), meta["name"])] = obj
        return obj

    def get(self, group: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self.objects.get(self._key(group, plural, namespace, name))

    def items(self, group: str, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [o for (g, p, ns, _), o in self.objects.items() if g == group and p == plural and (namespace is None or ns == namespace)]

    def remove(self, group: str, plural: str, namespace: str | None, name: str) -> None:
        with self._lock:
            self.objects.pop(self._key(group, plural, namespace, name), None)

    def delete(self, group: str, plural: str, namespace: str | None, name: str) -> None:
        """Delete an object as a client would: its pods and Workload go with it (`_collect_garbage`)."""
        obj = self.get(group, plural, namespace, name)
        if obj is not None:
            self.remove(group, plural, namespace, name)
            self._collect_garbage(obj, namespace)

    def set_status(self, group: str, plural: str, namespace: str, name: str, status: dict[str, Any], **spec_changes: Any) -> None:
        with self._lock:
            obj = self.objects[self._key(group, plural, namespace, name)]
            obj["status"] = copy.deepcopy(status)
            obj.setdefault("spec", {}).update(spec_changes)

    def update_status(self, group: str, plural: str, namespace: str | None, name: str, status: dict[str, Any] | None = None,
                      **spec_changes: Any) -> bool:
        """A controller's write: `status` (default: the object's own) and `spec_changes`, unless the
        object is gone meanwhile (False then)."""
        with self._lock:
            current = self.get(group, plural, namespace, name)
            if current is None:
                return False
            self.set_status(group, plural, namespace, name, current.get("status") or {} if status is None else status, **spec_changes)
            return True

    def fail(self, method: str, path_contains: str, status: int, message: str = "", times: int = 1) -> None:
        """Answer the next `times` matching requests with an error Status."""
        self._faults.append({"method": method, "path": path_contains, "status": status, "message": message, "times": times})

    def count(self, method: str, path_contains: str) -> int:
        return sum(1 for m, p in self.requests if m == method and path_contains in p)

    # --- request handling -------------------------------------------------------------------------

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}

    def handle(self, method: str, raw_path: str, body: Any) -> tuple[int, Any, str]:
        parsed = urlparse(raw_path)
        path = unquote(parsed.path)
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        with self._lock:
            self.requests.append((method, raw_path))
            for fault in self._faults:
                if fault["times"] > 0 and fault["method"] == method and fault["path"] in path:
                    fault["times"] -= 1
                    reason = {403: "Forbidden", 404: "NotFound", 409: "AlreadyExists", 422: "Invalid", 500: "InternalError", 503: "ServiceUnavailable"}.get(fault["status"], "Error")
                    return fault["status"], self._status(fault["status"], reason, fault["message"] or reason), "application/json"
            try:
                return self._route(method, path, query, body)
            except Exception as exc:  # a bug in the double must be visible, not a hang
                return 500, self._status(500, "InternalError", f"test double error: {type(exc).__name__}: {exc}"), "application/json"

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any, str]:
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log", path)
        if m:
            ns, name = m.groups()
            if self.get("", "pods", ns, name) is None:
                return 404, self._status(404, "NotFound", f'pods "{name}" not found'), "application/json"
            text = self.logs.get((ns, name), "")
            if "tailLines" in query:
                text = "\n".join(text.splitlines()[-int(query["tailLines"]) :])
            return 200, text, "text/plain"
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?", path)
        if m:
            ns, plural, name = m.groups()
            return self._resource(method, "", "v1", plural, ns, name, query, body)
        m = re.fullmatch(r"/apis/([^/]+)/([^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?", path)
        if m:
            group, version, ns, plural, name = m.groups()
            if method == "GET" and name and (group, plural) in GANG_PLURALS:
                self._advance()
            return self._resource(method, group, version, plural, ns, name, query, body)
        m = re.fullmatch(r"/apis/([^/]+)/([^/]+)/([^/]+)(?:/([^/]+))?", path)
        if m:
            group, version, plural, name = m.groups()
            return self._resource(method, group, version, plural, None, name, query, body)
        return 404, self._status(404, "NotFound", f"the server could not find the requested resource ({path})"), "application/json"

    def _advance(self) -> None:
        self.polls += 1
        if self.steps:
            step = self.steps.pop(0)
            step(self)

    def _resource(self, method, group, version, plural, ns, name, query, body) -> tuple[int, Any, str]:
        resource = f"{plural}.{group}" if group else plural
        if method == "GET" and name:
            obj = self.get(group, plural, ns, name)
            if obj is None:
                return 404, self._status(404, "NotFound", f'{resource} "{name}" not found'), "application/json"
            return 200, obj, "application/json"
        if method == "GET":
            items = self.items(group, plural, None if plural in CLUSTER_SCOPED else ns)
            items = [o for o in items if _matches((o.get("metadata") or {}).get("labels") or {}, query.get("labelSelector"))]
            for term in filter(None, (query.get("fieldSelector") or "").split(",")):
                key, value = term.split("=", 1)
                items = [o for o in items if str(_field(o, key)) == value]
            kind = (items[0].get("kind") if items else "Object") + "List"
            return 200, {"apiVersion": f"{group}/{version}" if group else "v1", "kind": kind, "metadata": {}, "items": items}, "application/json"
        if method == "POST" and not name:
            meta = (body or {}).get("metadata") or {}
            if self.get(group, plural, ns, meta.get("name", "")) is not None:
                return 409, self._status(409, "AlreadyExists", f'{resource} "{meta.get("name")}" already exists'), "application/json"
            if self.validator is not None:
                try:
                    self.validator(body)
                except Exception as exc:
                    return 422, self._status(422, "Invalid", f'{body.get("kind")} "{meta.get("name")}" is invalid: {exc}'), "application/json"
            body.setdefault("metadata", {})["namespace"] = ns
            body["metadata"]["generation"] = 1
            return 201, self.put(group, plural, body), "application/json"
        if method == "DELETE" and name:
            obj = self.get(group, plural, ns, name)
            if obj is None:
                return 404, self._status(404, "NotFound", f'{resource} "{name}" not found'), "application/json"
            self.remove(group, plural, ns, name)
            self._collect_garbage(obj, ns)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name, "kind": plural}}, "application/json"
        if method == "PATCH" and name:  # a JSON merge patch (RFC 7386), validated as the API server would
            obj = self.get(group, plural, ns, name)
            if obj is None:
                return 404, self._status(404, "NotFound", f'{resource} "{name}" not found'), "application/json"
            patched = merge_patch(copy.deepcopy(obj), body or {})
            if self.validator is not None and group and self._valid(obj):  # a patch may not make a valid object invalid
                try:
                    self.validator(patched)
                except Exception as exc:
                    return 422, self._status(422, "Invalid", f'{obj.get("kind")} "{name}" is invalid: {exc}'), "application/json"
            with self._lock:
                obj.clear()
                obj.update(patched)
            return 200, obj, "application/json"
        return 405, self._status(405, "MethodNotAllowed", f"{method} not supported by the test double"), "application/json"

    def _valid(self, obj: dict[str, Any]) -> bool:
        try:
            self.validator(obj)
        except Exception:  # a controller's object the double keeps simplified (e.g. a Workload)
            return False
        return True

    def _collect_garbage(self, owner: dict[str, Any], ns: str | None) -> None:
        """What the garbage collector does after a gang object is deleted: its pods and Workload go."""
        labels = (owner.get("metadata") or {}).get("labels") or {}
        uid = (owner.get("metadata") or {}).get("uid")
        gang, attempt = labels.get("gangflow.io/gang"), labels.get("gangflow.io/attempt")
        with self._lock:
            for key, obj in list(self.objects.items()):
                obj_labels = (obj.get("metadata") or {}).get("labels") or {}
                if key[1] == "pods" and key[2] == ns and gang and obj_labels.get("gangflow.io/gang") == gang and obj_labels.get("gangflow.io/attempt") == attempt:
                    del self.objects[key]
                elif key[1] == "workloads" and obj_labels.get("kueue.x-k8s.io/job-uid") == uid:
                    del self.objects[key]
