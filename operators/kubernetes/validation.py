"""Offline validation of the objects gangflow submits, against the upstream schemas: core kinds with
kubernetes_validate, custom resources with the vendored CRDs' schemas, tightened to refuse unknown
fields as the API server's strict field validation does.

Command line: `python -m operators.cli.render validate FILE... --crds DIR`.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from operators.kubernetes.runtime import LABEL_VALUE_RULE, QUALIFIED_NAME_RULE, is_label_value, is_qualified_name

KUBERNETES_VERSION = "1.33"


class SchemaValidationError(ValueError):
    """An object does not match its upstream schema; the message names the path and the problem."""


def drop_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


_LEADING_FLAGS = re.compile(r"^\^\(\?([a-zA-Z]+)\)")


def python_pattern(pattern: str) -> str:
    """A CRD's Go (RE2) `pattern` in a form Python's `re` compiles. RE2 accepts inline flags right
    after the anchor (`^(?i)[a-z]...`, Kueue's AdmissionCheck parameters.kind); `re` only at the very
    start, and moving them in front of `^` keeps the meaning."""
    match = _LEADING_FLAGS.match(pattern)
    return f"(?{match.group(1)})^{pattern[match.end():]}" if match else pattern


def strict_schema(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema that rejects unknown fields like the API server does."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if isinstance(out.get("pattern"), str):
        out["pattern"] = python_pattern(out["pattern"])
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and "type" in out and isinstance(out["type"], str):
        out["type"] = [out["type"], "null"]
    return out


class CrdRegistry:
    """Strict JSON schemas of the CRDs in a folder, keyed by (apiVersion, kind)."""

    def __init__(self, crds_dir: str | Path):
        self.crds_dir = Path(crds_dir)
        if not self.crds_dir.is_dir():
            raise FileNotFoundError(f"CRD folder {self.crds_dir} not found")
        self._loaded: set[Path] = set()
        self._schemas: dict[tuple[str, str], Any] = {}

    def _load(self, path: Path) -> None:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        for doc in yaml.load_all(path.read_text(), Loader=loader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group = doc["spec"]["group"]
            kind = doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                self._schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]

    def _scan(self, group: str | None = None) -> dict[tuple[str, str], Any]:
        """Load the manifests of `group` (files are named <group>_<plural>.yaml), or all of them."""
        for path in sorted(self.crds_dir.glob("*.yaml")):
            if path in self._loaded or (group is not None and not path.name.startswith(f"{group}_")):
                continue
            self._load(path)
            self._loaded.add(path)
        return self._schemas

    def kinds(self) -> list[tuple[str, str]]:
        return sorted(self._scan())

    @functools.lru_cache(maxsize=64)  # noqa: B019 - registry objects live for the process
    def validator(self, api_version: str, kind: str):
        import jsonschema

        key = (api_version, kind)
        if key not in self._schemas:
            self._scan(api_version.split("/")[0])
        if key not in self._schemas:
            self._scan()
        if key not in self._schemas:
            known = ", ".join(f"{a} {k}" for a, k in self.kinds())
            raise SchemaValidationError(f"no CRD schema for {api_version} {kind} in {self.crds_dir}; known: {known}")
        schema = strict_schema(self._schemas[key])
        # CRDs leave `metadata` open; the API server checks it as ObjectMeta, and so do we.
        defs_id, registry = _object_meta_registry()
        schema = {**schema, "properties": {**schema.get("properties", {}), "metadata": {"$ref": f"{defs_id}#/$defs/{OBJECT_META}"}}}
        return jsonschema.Draft7Validator(schema, registry=registry)


OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


@functools.cache
def _object_meta_registry(version: str = KUBERNETES_VERSION):
    """kubernetes-validate's strict core definitions, as a `referencing` registry."""
    import json

    import importlib_resources
    from referencing import Registry, Resource

    path = f"kubernetes-json-schema/v{version}.0-local-strict/_definitions.json"
    defs = json.loads(importlib_resources.files("kubernetes_validate").joinpath(path).read_text())
    return defs["$id"], Resource.from_contents(defs) @ Registry()


def _format_path(path: Iterable[Any]) -> str:
    out = ""
    for item in path:
        out += f"[{item}]" if isinstance(item, int) else f".{item}"
    return out or "."


def validate_custom(obj: Mapping[str, Any], registry: CrdRegistry) -> None:
    validator = registry.validator(obj["apiVersion"], obj["kind"])
    errors = sorted(validator.iter_errors(drop_nulls(obj)), key=lambda e: list(e.absolute_path))
    if errors:
        name = (obj.get("metadata") or {}).get("name", "?")
        lines = [f"{_format_path(e.absolute_path)}: {e.message}" for e in errors[:20]]
        raise SchemaValidationError(f"{obj['kind']} {name} does not match the {obj['apiVersion']} CRD schema:\n  " + "\n  ".join(lines))


def validate_core(obj: Mapping[str, Any], version: str = KUBERNETES_VERSION) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(drop_nulls(copy.deepcopy(dict(obj))), version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        name = (obj.get("metadata") or {}).get("name", "?")
        raise SchemaValidationError(
            f"{obj.get('kind')} {name} does not match the Kubernetes {version} schema at "
            f"{_format_path(exc.path)}: {exc.message}"
        ) from None


def _embedded_core_objects(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Core objects embedded in a custom resource, for a second, core-schema check."""
    out: list[dict[str, Any]] = []
    name = (obj.get("metadata") or {}).get("name", "embedded")
    spec = obj.get("spec") or {}
    if obj.get("kind") == "JobSet":
        for rjob in spec.get("replicatedJobs") or []:
            template = rjob.get("template") or {}
            out.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {**(template.get("metadata") or {}), "name": f"{name}-{rjob.get('name')}-0"},
                    "spec": template.get("spec") or {},
                }
            )
    if obj.get("kind") == "Job" and str(obj.get("apiVersion", "")).startswith("batch.volcano.sh/"):
        for task in spec.get("tasks") or []:
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{name}-{task.get('name')}"},
                    "template": task.get("template") or {},
                }
            )
    if obj.get("kind") == "RayJob":
        cluster = spec.get("rayClusterSpec") or {}
        templates = [("head", (cluster.get("headGroupSpec") or {}).get("template"))]
        templates += [(g.get("groupName", "worker"), g.get("template")) for g in cluster.get("workerGroupSpecs") or []]
        templates.append(("submitter", spec.get("submitterPodTemplate")))
    elif obj.get("kind") == "MPIJob":
        templates = [(role.lower(), (replica or {}).get("template")) for role, replica in (spec.get("mpiReplicaSpecs") or {}).items()]
    else:
        templates = []
    for role, template in templates:
        if template:
            out.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-{role}"}, "template": template})
    return out


def _labelled_metadata(value: Any, path: str = "") -> Iterable[tuple[str, Mapping[str, Any]]]:
    """(path, labels) of every `metadata.labels` in an object: its own and its embedded templates'."""
    if isinstance(value, Mapping):
        meta = value.get("metadata")
        if isinstance(meta, Mapping) and isinstance(meta.get("labels"), Mapping):
            yield f"{path}.metadata.labels", meta["labels"]
        for key, item in value.items():
            yield from _labelled_metadata(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _labelled_metadata(item, f"{path}[{index}]")


def validate_labels(obj: Mapping[str, Any]) -> None:
    """Label keys and values by apimachinery's rules (the API server's; OpenAPI schemas carry none)."""
    problems = []
    for path, labels in _labelled_metadata(obj):
        for key, value in labels.items():
            if not is_qualified_name(key):
                problems.append(f"{path}.{key}: the key must be {QUALIFIED_NAME_RULE}")
            if value is not None and not is_label_value(value):
                problems.append(f"{path}.{key}={value!r}: the value must be {LABEL_VALUE_RULE}")
    if problems:
        name = (obj.get("metadata") or {}).get("name", "?")
        raise SchemaValidationError(f"{obj.get('kind')} {name} has labels the API server refuses:\n  " + "\n  ".join(problems[:20]))


TRAINING_RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"


def validate_object(obj: Mapping[str, Any], crds: CrdRegistry | None = None, version: str = KUBERNETES_VERSION) -> None:
    """Validate one object: core kinds with kubernetes-validate, custom kinds against `crds`
    (strict), plus their embedded Job / pod templates as core kinds; every `metadata.labels` by
    apimachinery's rules."""
    api_version = str(obj.get("apiVersion", ""))
    group = api_version.split("/")[0] if "/" in api_version else ""
    core_groups = {"", "batch", "apps", "policy", "rbac.authorization.k8s.io", "networking.k8s.io", "scheduling.k8s.io", "autoscaling", "coordination.k8s.io"}
    validate_labels(obj)
    if group in core_groups:
        validate_core(obj, version)
        return
    if crds is None:
        raise SchemaValidationError(f"{obj.get('kind')} ({api_version}) is a custom resource: pass the CRD folder (--crds)")
    validate_custom(obj, crds)
    if obj.get("kind") == "ClusterTrainingRuntime" and "namespace" in (obj.get("metadata") or {}):
        raise SchemaValidationError(f"ClusterTrainingRuntime {obj['metadata'].get('name', '?')}: metadata.namespace: "
                                    "a ClusterTrainingRuntime is cluster-scoped")  # fmt: skip
    if obj.get("kind") in TRAINING_RUNTIME_KINDS:  # its template is a JobSet's spec: checked as one
        template = (obj.get("spec") or {}).get("template") or {}
        jobset = {"apiVersion": JOBSET_API_VERSION, "kind": "JobSet",
                  "metadata": {"name": (obj.get("metadata") or {}).get("name", "runtime")}, "spec": template.get("spec") or {}}
        try:
            validate_object(jobset, crds, version)
        except SchemaValidationError as exc:
            raise SchemaValidationError(f"{obj['kind']} {jobset['metadata']['name']}: spec.template (a JobSet's spec, "
                                        f"checked against the vendored JobSet CRD): {exc}") from None  # fmt: skip
    for embedded in _embedded_core_objects(obj):
        validate_core(embedded, version)


def validate_documents(docs: Iterable[Mapping[str, Any]], crds: CrdRegistry | None = None, version: str = KUBERNETES_VERSION) -> int:
    count = 0
    for doc in docs:
        if doc:
            validate_object(doc, crds, version)
            count += 1
    return count
