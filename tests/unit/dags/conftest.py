"""The training DAG file loaded as a module, once per test module (its pipelines, forms and schemas)."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline_runs import PROJECT_ROOT


@pytest.fixture(scope="module")
def dag_module(request):
    name = f"train_pipeline_dag_{request.module.__name__.rpartition('.')[2]}"  # one module object per test module
    spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "dags" / "train_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
