"""Extra links of the training task (the buttons on its page in the Airflow UI): the DAG run's MLflow
run, its Grafana dashboard, the gang's Kubernetes object. The task pushes each URL to XCom under the
link's key as soon as it is known, so the buttons work while the gang runs; at the end of the try the
task runner stores `get_link`'s value under the same key (docs/observability.md)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink


class _PushedLink(BaseOperatorLink):
    """A link whose URL the task learnt while it ran (kept on the operator, pushed to XCom)."""

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        # The URLs this try learnt; no XCom read (a key never pushed is logged as an error).
        return (getattr(operator, "link_urls", None) or {}).get(self.xcom_key, "")

    def push(self, operator: Any, ti: Any, url: str | None) -> None:
        """Keep `url` for the button; a link is never worth failing the task over."""
        if not url:
            return
        urls = getattr(operator, "link_urls", None)
        if isinstance(urls, dict):
            urls[self.xcom_key] = url
        push = getattr(ti, "xcom_push", None)
        if push is not None:
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
