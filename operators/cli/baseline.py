"""`make baseline`: run the `platform_baseline` DAG once on this machine (as `make demo` runs its
DAG) and print, as the last line, one JSON object: every figure, `compared_with` (the MLflow run id
of the accepted baseline it was compared with, null the first time), `regressions` (a list, empty
when none), `run_id`, `environment`, `state`. Exit 1 when a figure regressed or the run failed.

    python -m operators.cli.baseline [--conf '{"world_size": 2, "threshold": 0.25}']
"""

from __future__ import annotations

import argparse
import json

from operators.cli.demo import parse_with_conf, run_dag
from operators.config import embedded

DAG_ID = "platform_baseline"


def main(argv: list[str] | None = None) -> int:
    _, conf = parse_with_conf(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter), argv)
    embedded.apply()  # before anything imports Airflow: it binds its config at import
    from airflow.models.xcom import XComModel
    from airflow.sdk.exceptions import ParamValidationError
    from airflow.utils.session import create_session

    from operators.callbacks import read_failure

    try:
        dag_run = run_dag(conf, DAG_ID, "platform_baseline.py")
    except ParamValidationError as exc:
        print(json.dumps({"state": "failed", "failure": {"kind": "user", "reason": str(exc)}}), flush=True)
        return 2
    with create_session() as session:
        row = session.query(XComModel).filter_by(dag_id=DAG_ID, run_id=dag_run.run_id, task_id="record", key="return_value").one_or_none()
        recorded = row.value if row is not None else None
    state = str(getattr(dag_run.state, "value", dag_run.state))
    if not recorded:
        failure = read_failure(DAG_ID, dag_run.run_id)
        print(json.dumps({"state": "failed", "failure": {"kind": failure.get("kind", "unknown"),
                                                         "reason": failure.get("reason", "see the task logs")}}), flush=True)
        return 1
    summary = {**recorded["figures"], "compared_with": recorded["compared_with"], "regressions": recorded["regressions"],
               "run_id": recorded["run_id"], "environment": recorded["environment"], "threshold": recorded["threshold"],
               "state": "success" if state == "success" else "failed"}
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["state"] == "success" and not summary["regressions"] else 1


if __name__ == "__main__":
    from operators.utils.processes import exit_without_teardown

    exit_without_teardown(main())
