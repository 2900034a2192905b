"""Task callbacks shared by gangflow DAGs."""

from __future__ import annotations

import json
from typing import Any

from operators.config import settings


def failure_record_path(dag_id: str, run_id: str):
    return settings.state_dir() / "failures" / dag_id / f"{settings.run_key(dag_id, run_id)}.json"


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
