"""Kubernetes side of gangflow: typed builders for the gang objects (JobSet, Volcano Job, Kubeflow
TrainJob), the runtime defaults the Helm chart ships, offline schema validation, and the status
reading the trigger and backend share.

    python -m operators.cli.render render --world-size 4 --scheduler kueue   # what would be submitted (operators/cli/render.py)
    python -m operators.cli.render validate objects.yaml   # against the vendored upstream CRDs (crds/)

Importing this package does not import Airflow or the Kubernetes clients' network code.
"""

from __future__ import annotations

__all__ = ["build_gang", "RuntimeDefaults", "GangPlan"]


def __getattr__(name: str):
    if name in ("build_gang", "GangPlan"):
        from operators.kubernetes import builders

        return getattr(builders, name)
    if name == "RuntimeDefaults":
        from operators.kubernetes.runtime import RuntimeDefaults

        return RuntimeDefaults
    raise AttributeError(name)
