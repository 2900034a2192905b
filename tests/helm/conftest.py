"""Fixtures for the chart tests: render helm/gangflow with Helm's own engine (helm-python-sdk, in
process, no cluster) and validate every rendered object against the Kubernetes and CRD schemas."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

KUBE_VERSION = "1.33"
RELEASE = "gangflow"
NAMESPACE = "gangflow-system"


def validate_object(obj: dict[str, Any], crds_dir: Path, kube_version: str = KUBE_VERSION,
                    _crd_cache: dict = {}) -> None:  # noqa: B006 - per-process cache of parsed CRDs
    """Validate one object the way the API server's schema and strict field validation would.

    Core kinds go to ``kubernetes_validate`` (strict: unknown fields rejected). Custom resources are
    validated against ``spec.versions[].schema.openAPIV3Schema`` of the CRD in ``crds_dir`` with
    unknown fields rejected (``additionalProperties: false`` wherever a schema lists ``properties``
    and does not say ``x-kubernetes-preserve-unknown-fields``) and ``metadata`` checked against
    ObjectMeta. Null fields are dropped first, as the API server does. CEL rules
    (``x-kubernetes-validations``) are not evaluated. Raises ``AssertionError`` naming the object.
    """
    import importlib_resources
    import jsonschema
    from referencing import Registry, Resource

    def drop_nulls(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: drop_nulls(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [drop_nulls(v) for v in value]
        return value

    def strict(schema: Any) -> Any:
        if isinstance(schema, dict):
            schema = {k: strict(v) for k, v in schema.items()}
            if ("properties" in schema and "additionalProperties" not in schema
                    and not schema.get("x-kubernetes-preserve-unknown-fields")):
                schema["additionalProperties"] = False
            return schema
        if isinstance(schema, list):
            return [strict(v) for v in schema]
        return schema

    obj = drop_nulls(obj)
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    name = f"{kind}/{obj.get('metadata', {}).get('name', '?')}"
    group, _, version = api_version.rpartition("/")

    crds_key = str(crds_dir)
    if crds_key not in _crd_cache:
        index = {}
        for path in sorted(Path(crds_dir).glob("*.yaml")):
            for doc in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    for ver in doc["spec"]["versions"]:
                        index[(doc["spec"]["group"], ver["name"], doc["spec"]["names"]["kind"])] = ver
        _crd_cache[crds_key] = index
    crd_version = _crd_cache[crds_key].get((group, version, kind))

    if crd_version is None:
        if "." in group and not group.endswith(".k8s.io"):
            raise AssertionError(f"{name}: no CRD for {api_version} {kind} in {crds_dir}")
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path)
            raise AssertionError(f"{name} ({api_version}): {exc.message} at /{path}") from None
        return

    assert crd_version.get("served", False), f"{name}: {api_version} is not served by its CRD"
    schema = strict(copy.deepcopy(crd_version["schema"]["openAPIV3Schema"]))
    defs_dir = f"kubernetes-json-schema/v{kube_version}.0-local-strict/_definitions.json"
    defs = json.loads(importlib_resources.files("kubernetes_validate").joinpath(defs_dir).read_text())
    registry = Resource.from_contents(defs) @ Registry()
    schema["properties"]["metadata"] = {
        "$ref": defs["$id"] + "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"/{'/'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in errors[:10]]
        raise AssertionError(f"{name} ({api_version}) does not match its CRD schema:\n" + "\n".join(lines))


@pytest.fixture(scope="session")
def chart_dir(project_root: Path) -> Path:
    return project_root / "helm" / "gangflow"


@pytest.fixture(scope="session")
def chart(chart_dir: Path):
    with helm_python.Chart.load(str(chart_dir)) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart) -> Callable[..., list[dict[str, Any]]]:
    """render(values) -> the rendered objects (NOTES.txt left out), each with its template path
    under the extra key ``__template__``."""

    def _render(values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        manifests = chart.render(values or {}, name=RELEASE, namespace=namespace)
        objects = []
        for template, text in sorted(manifests.items()):
            if template.endswith("NOTES.txt"):
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    doc["__template__"] = template
                    objects.append(doc)
        return objects

    return _render


@pytest.fixture(scope="session")
def notes(chart) -> Callable[..., str]:
    def _notes(values: dict[str, Any] | None = None) -> str:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
        return next(text for template, text in manifests.items() if template.endswith("NOTES.txt"))

    return _notes


@pytest.fixture(scope="session")
def validate(crds_dir: Path) -> Callable[[dict[str, Any]], None]:
    def _validate(obj: dict[str, Any]) -> None:
        validate_object({k: v for k, v in obj.items() if k != "__template__"}, crds_dir)

    return _validate


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


@pytest.fixture(scope="session")
def kinds() -> Callable[[list[dict[str, Any]], str], list[dict[str, Any]]]:
    return by_kind
