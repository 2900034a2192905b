"""Fixtures for the chart tests: render helm/gangflow with Helm's own engine (helm-python-sdk, in
process, no cluster) and validate every rendered object against the Kubernetes and CRD schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import helm_python
import pytest
import yaml

from operators.kubernetes.validation import CrdRegistry, validate_object

RELEASE = "gangflow"
NAMESPACE = "gangflow-system"


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
    """validate(obj): the API server's schema + strict field validation, offline (the backend's validator)."""
    registry = CrdRegistry(crds_dir)

    def _validate(obj: dict[str, Any]) -> None:
        validate_object({k: v for k, v in obj.items() if k != "__template__"}, registry)

    return _validate


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


@pytest.fixture(scope="session")
def kinds() -> Callable[[list[dict[str, Any]], str], list[dict[str, Any]]]:
    return by_kind
