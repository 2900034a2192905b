"""What a kubelet does with a pod's container spec before it starts the process, as pure functions:
`$(VAR)` expansion (Kubernetes' rules: `$$` escapes, undefined names kept), env resolution
(`value`, `valueFrom` Secret / ConfigMap / field refs), and the drill's one documented rewrite
plus its filesystem mapping.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Lookup = Callable[[str, str, str], Mapping[str, Any] | None]  # (kind, namespace, name) -> object


class ContainerConfigError(Exception):
    """The kubelet cannot build the container's environment (reason `CreateContainerConfigError`)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion of one string against `env` (see module doc)."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    n = len(text)
    while cursor < n:
        if text[cursor] == "$" and cursor + 1 < n:
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1 :]
            if rest[0] == "$":  # escaped operator
                out.append("$")
                advance = 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close == -1:  # incomplete reference: kept as written
                    out.append("$(")
                    advance = 1
                else:
                    name = rest[1:close]
                    out.append(env[name] if name in env else f"$({name})")
                    advance = close + 1
            else:  # a lone operator: kept with the character after it
                out.append("$" + rest[0])
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """The downward API's `fieldRef.fieldPath` values a container env may name."""
    meta = pod.get("metadata") or {}
    m = _FIELD_KEY.fullmatch(path)
    if m:
        section, key = m.groups()
        return str((meta.get(section) or {}).get(key, ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName"),
        "status.hostIP": (pod.get("status") or {}).get("hostIP"),
        "status.podIP": (pod.get("status") or {}).get("podIP"),
    }
    if path not in simple:
        raise ContainerConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return "" if simple[path] is None else str(simple[path])


def _key_ref(kind: str, ref: Mapping[str, Any], namespace: str, lookup: Lookup) -> str | None:
    name, key, optional = ref.get("name"), ref.get("key"), bool(ref.get("optional"))
    obj = lookup(kind, namespace, name)
    if obj is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind.lower()} "{name}" not found')
    if kind == "Secret":
        data = obj.get("data") or {}
        if key in data:
            return base64.b64decode(data[key]).decode()
    else:
        data = obj.get("data") or {}
        if key in data:
            return str(data[key])
    if optional:
        return None
    raise ContainerConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")


def resolve_env(container: Mapping[str, Any], pod: Mapping[str, Any], lookup: Lookup) -> dict[str, str]:
    """The container's `envFrom` then `env` as the kubelet resolves them, in order, each `value`
    expanded against the variables defined before it.

    `secretKeyRef` / `configMapKeyRef` read the Secret / ConfigMap from `lookup` (a missing one
    raises `ContainerConfigError` unless `optional`); `fieldRef` reads the pod (downward API).
    The image's ENV is not an expansion source (the kubelet never sees it); the container runtime
    lays these variables over it (see `process_env`)."""
    namespace = (pod.get("metadata") or {}).get("namespace") or "default"
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:  # first, so that `env` overrides it
        kind, ref = ("Secret", source["secretRef"]) if "secretRef" in source else ("ConfigMap", source.get("configMapRef") or {})
        obj = lookup(kind, namespace, ref.get("name"))
        if obj is None:
            if ref.get("optional"):
                continue
            raise ContainerConfigError(f'{kind.lower()} "{ref.get("name")}" not found')
        for key, value in sorted((obj.get("data") or {}).items()):
            name = (source.get("prefix") or "") + key
            if _ENV_NAME.fullmatch(name):  # the kubelet skips keys that are not valid names
                env[name] = base64.b64decode(value).decode() if kind == "Secret" else str(value)
    for item in container.get("env") or []:
        name = item["name"]
        source = item.get("valueFrom")
        if source is None:
            value: str | None = expand(str(item.get("value") or ""), env)
        elif "secretKeyRef" in source:
            value = _key_ref("Secret", source["secretKeyRef"], namespace, lookup)
        elif "configMapKeyRef" in source:
            value = _key_ref("ConfigMap", source["configMapKeyRef"], namespace, lookup)
        elif "fieldRef" in source:
            value = field_ref(pod, source["fieldRef"]["fieldPath"])
        else:
            raise ContainerConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is None:  # optional reference that is absent: the variable is not set
            continue
        env[name] = value
    return env


def process_env(image_env: Mapping[str, str], container_env: Mapping[str, str]) -> dict[str, str]:
    """What the process sees: the image's ENV overlaid by the container's resolved env."""
    return {**image_env, **container_env}


def expand_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """`command + args` with `$(VAR)` expanded against the container's resolved environment."""
    return [expand(str(part), env) for part in [*(container.get("command") or []), *(container.get("args") or [])]]


@dataclass(frozen=True)
class Rewrites:
    """How the drill runs a container's strings on this machine, and nothing else.

    - `hosts`: names of the gang's pods (the rank-0 rendezvous host) -> 127.0.0.1: the only
      rewrite of what the container says;
    - `mounts`: container paths -> local folders, as the container runtime's mounts would
      provide them (the pod's `/tmp` emptyDir, the termination-message file, the image's `/app`, a
      PersistentVolumeClaim). A value that is a mounted path, or `--flag=` one, is mapped, and in
      shell text (a value with whitespace) each word that is; nothing else is touched.
    """

    hosts: Mapping[str, str] = field(default_factory=dict)
    mounts: Mapping[str, str] = field(default_factory=dict)

    def _path(self, value: str) -> str:
        for src in sorted(self.mounts, key=len, reverse=True):
            if value == src or value.startswith(src.rstrip("/") + "/"):
                return self.mounts[src] + value[len(src.rstrip("/")) :] if value != src else self.mounts[src]
        return value

    def _words(self, text: str) -> str:
        """Shell text (KubeRay's `bash -c` scripts): each word that is a mounted path, or starts one."""
        if not self.mounts:
            return text
        roots = "|".join(re.escape(src.rstrip("/")) for src in sorted(self.mounts, key=len, reverse=True))
        return re.sub(rf"(?<![^\s'\"=])({roots})(?=[/\s'\";]|$)", lambda m: self._path(m.group(1)), text)

    def apply(self, value: str) -> str:
        for host, target in self.hosts.items():
            value = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", target, value)
        if any(c.isspace() for c in value):
            return self._words(value)
        if value.startswith("-") and "=" in value:
            flag, _, rest = value.partition("=")
            return f"{flag}={self._path(rest)}"
        return self._path(value)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return [self.apply(a) for a in argv]

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {k: self.apply(v) for k, v in env.items()}


def differences(before: Sequence[str] | Mapping[str, str], after: Sequence[str] | Mapping[str, str]) -> list[tuple[str, str]]:
    """(rendered, run) pairs that differ: what a reader checks against `Rewrites`' doc."""
    if isinstance(before, Mapping):
        return [(f"{k}={before[k]}", f"{k}={after.get(k)}") for k in before if before[k] != after.get(k)]
    return [(b, a) for b, a in zip(before, after) if b != a]
