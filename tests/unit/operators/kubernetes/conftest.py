"""Fixtures of the Kubernetes backend tests: upstream schemas, the API test double
(operators/cli/drill/api_double.py, shared with `make cluster-drill`) and realistic object
fixtures (support.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from operators.cli.drill.api_double import InMemoryKubernetesApi

HERE = Path(__file__).resolve().parent


def _load_module(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# test files import these by module name (pytest runs with --import-mode=importlib: no packages)
support = _load_module("gangflow_tests_k8s_support", HERE / "support.py")
NAMESPACE, CONN_ID, RUNTIME = support.NAMESPACE, support.CONN_ID, support.RUNTIME


@pytest.fixture
def fx():
    return support.Fixtures()


@pytest.fixture(scope="session")
def crd_registry(crds_dir):
    from operators.kubernetes.validation import CrdRegistry

    return CrdRegistry(crds_dir)


@pytest.fixture
def runtime_mapping() -> dict[str, Any]:
    return copy.deepcopy(RUNTIME)


@pytest.fixture
def fake_k8s(monkeypatch, crd_registry):
    """The API test double on 127.0.0.1, an Airflow connection pointing at it, and the runtime
    ConfigMap the Helm chart would install."""
    from operators.kubernetes.validation import validate_object

    api = InMemoryKubernetesApi(validator=lambda obj: validate_object(obj, crd_registry))
    with api:
        monkeypatch.setenv(
            f"AIRFLOW_CONN_{CONN_ID.upper()}",
            json.dumps({"conn_type": "kubernetes", "extra": {"kube_config": api.kubeconfig(NAMESPACE), "namespace": NAMESPACE}}),
        )
        api.put(
            "",
            "configmaps",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "gangflow-runtime", "namespace": NAMESPACE},
                "data": {"runtime.yaml": yaml.safe_dump(RUNTIME)},
            },
        )
        yield api
