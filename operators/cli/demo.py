"""`make demo [PIPELINE=name]`: run one pipeline's DAG once on the embedded defaults and print a
JSON summary as the last line (contract 5, docs/contracts.md); on failure `state` is "failed" and
the exit code non-zero. Honours GANGFLOW_HOME and GANGFLOW_FAULT.

    python -m operators.cli.demo [--pipeline diabetes] [--conf '{"world_size": 1, "max_steps": 300}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from operators.config import embedded

from operators.config import settings

DAG_ID = "train_pipeline"  # the digits pipeline's


def run_dag(conf: dict, dag_id: str = DAG_ID, dag_file: str = "train_pipeline.py"):
    """`dag.test()` of DAG `dag_id` from `dags/<dag_file>` (after `embedded.apply()`)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(settings.PROJECT_ROOT / "dags" / dag_file))
    if dag_id not in bag.dags:
        raise SystemExit(f"DAG {dag_id!r} did not load: {bag.import_errors}")
    return bag.dags[dag_id].test(run_conf=conf or None)


def summarize(dag_run, dag_id: str = DAG_ID) -> dict:
    """Read the run's outcome back from the Airflow metadata DB."""
    from airflow.models.dag import DagTag
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from operators.callbacks import read_failure
    from operators.config.pipelines import PipelineConfigError, pipeline, pipeline_tag, tagged_pipeline

    with create_session() as session:
        name = tagged_pipeline(tag.name for tag in session.query(DagTag).filter_by(dag_id=dag_id))
        if name is None:
            raise PipelineConfigError(f"DAG {dag_id!r} names no pipeline (it has no {pipeline_tag('<name>')} tag)")
        config = pipeline(name)  # the DAG names its pipeline
        tis = {ti.task_id: (ti.state, ti.try_number) for ti in session.query(TaskInstance).filter_by(dag_id=dag_id, run_id=dag_run.run_id)}
        xcoms = {
            (x.task_id, x.key): x.value
            for x in session.query(XComModel).filter_by(dag_id=dag_id, run_id=dag_run.run_id)
        }
    manifest, metrics, decision = (xcoms.get((task_id, "return_value")) or {} for task_id in ("validate_dataset", "evaluate", "promote"))
    train_tries = [tries for task_id, (state, tries) in tis.items() if task_id.startswith("train_") and state not in ("skipped", None)]
    state = str(getattr(dag_run.state, "value", dag_run.state))
    summary = {
        "state": "success" if state == "success" else "failed",
        "pipeline": config.name,
        "dag_run_id": dag_run.run_id,
        "dataset_version": manifest.get("version") or (dag_run.conf or {}).get("dataset_version"),
        "metric": {**config.metric.as_dict(), "value": metrics.get(config.metric.name)},
        "accuracy": metrics.get("accuracy"),
        "tracking_uri": settings.tracking_uri(),
        "model_name": decision.get("model_name"),
        "model_version": decision.get("model_version"),
        "promoted": bool(decision.get("promoted", False)),
        "promotion_reason": decision.get("reason"),
        "train_attempts": max(train_tries, default=0),
    }
    if summary["state"] == "failed":
        record = read_failure(dag_id, dag_run.run_id)
        failed = [t for t, (s, _) in tis.items() if s == "failed"]
        summary["failure"] = {
            "kind": record.get("kind", "unknown"),
            "reason": record.get("reason", f"task(s) {', '.join(failed) or '?'} failed; see the task logs"),
            "task_id": record.get("task_id", failed[0] if failed else None),
        }
    return summary


def parse_with_conf(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """`parser` with a `--conf` option (the DAG run's Params as JSON): (args, conf)."""
    parser.add_argument("--conf", default="{}", help="DAG run conf (Params) as JSON, e.g. '{\"world_size\": 1}'")
    args = parser.parse_args(argv)
    try:
        conf = json.loads(args.conf)
    except ValueError as exc:
        parser.error(f"--conf: not valid JSON ({exc})")
    return args, conf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="digits", help="the pipeline to run: a file pipelines/<name>.yaml (default digits)")
    args, conf = parse_with_conf(parser, argv)
    embedded.apply()  # before anything imports Airflow: it binds its config at import
    from operators.config.pipelines import PipelineConfigError, pipeline

    try:
        config = pipeline(args.pipeline)
    except PipelineConfigError as exc:
        parser.error(str(exc))
    os.environ.setdefault("GANGFLOW_ALLOW_FAULTS", "1")  # a drill: GANGFLOW_FAULT is honoured here (docs/trainer.md)
    from airflow.sdk.exceptions import ParamValidationError

    try:
        dag_run = run_dag(conf, config.dag_id)
    except ParamValidationError as exc:  # refused before any task ran
        summary = {"state": "failed", "pipeline": config.name, "tracking_uri": settings.tracking_uri(),
                   "train_attempts": 0, "promoted": False, "failure": {"kind": "user", "reason": str(exc)}}  # fmt: skip
        print(json.dumps(summary), flush=True)
        return 2
    summary = summarize(dag_run, config.dag_id)
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["state"] == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
