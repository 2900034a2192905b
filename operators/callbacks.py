"""Task callbacks shared by gangflow DAGs."""

from __future__ import annotations

import json
import logging
from typing import Any

from operators.config import settings

log = logging.getLogger("gangflow.callbacks")


def failure_record_path(dag_id: str, run_id: str):
    return settings.state_dir() / "failures" / settings.dag_id_folder(dag_id) / f"{settings.run_key(dag_id, run_id)}.json"


def read_failure(dag_id: str, run_id: str) -> dict[str, Any]:
    """What `record_failure` kept for a DAG run's last failed task; {} when none."""
    path = failure_record_path(dag_id, run_id)
    return json.loads(path.read_text()) if path.exists() else {}


def record_failure(context) -> None:
    """Keep `{kind, reason, task_id, try_number}` of a failed task where `make demo` reports it."""
    exc = context.get("exception")
    ti = context["ti"]
    verdict = getattr(exc, "verdict", None)
    record = {
        "task_id": ti.task_id,
        "try_number": ti.try_number,
        "kind": verdict.kind if verdict else getattr(exc, "kind", "unknown"),
        "reason": verdict.reason if verdict else (str(exc) or type(exc).__name__),
    }
    from trainer.storage import write_json  # not at DAG parse time

    write_json(failure_record_path(ti.dag_id, context["run_id"]), record)
    _end_mlflow_run(context)


def _end_mlflow_run(context) -> None:
    """The DAG run's MLflow run (if training created one) ends FAILED, not RUNNING forever."""
    ti = context["ti"]
    try:
        from operators.hooks import mlflow as tracking

        client = tracking.get_client()
        run_id = getattr(context.get("task"), "mlflow_run_id", None)
        if not (isinstance(run_id, str) and run_id and "{{" not in run_id):
            experiment = client.get_experiment_by_name(getattr(context.get("task"), "experiment", None) or "gangflow")
            run_id = experiment and tracking.find_run(client, experiment.experiment_id, dag_id=ti.dag_id, dag_run_id=context["run_id"])
        if run_id:
            tracking.end_run(client, run_id, succeeded=False)
    except Exception as exc:  # noqa: BLE001 - a callback reports; it must not fail the failure handling
        log.warning("gangflow: cannot mark the MLflow run of %s/%s FAILED: %s", ti.dag_id, context.get("run_id"), exc)
