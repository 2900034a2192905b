"""Extra links of the training task (the buttons on its page in the Airflow UI): the DAG run's MLflow
run, its Grafana dashboard, the gang's Kubernetes object. The task pushes each URL to XCom under the
link's key as soon as it is known, so the buttons work while the gang runs (docs/observability.md)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink


class _PushedLink(BaseOperatorLink):
    """A link whose URL the task pushed to XCom under `xcom_key` ("" until then: no button target)."""

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.providers.common.compat.sdk import XCom

        return XCom.get_value(ti_key=ti_key, key=self.xcom_key) or ""

    def push(self, ti: Any, url: str | None) -> None:
        """Keep `url` for the button; a link is never worth failing the task over."""
        push = getattr(ti, "xcom_push", None)
        if url and push is not None:
            try:
                push(key=self.xcom_key, value=url)
            except Exception:  # noqa: BLE001
                pass


class MlflowRunLink(_PushedLink):
    name = "MLflow run"


class DashboardLink(_PushedLink):
    name = "Dashboard"


class KubernetesObjectLink(_PushedLink):
    name = "Kubernetes object"
