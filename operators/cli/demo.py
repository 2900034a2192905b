"""`make demo [PIPELINE=name] [BACKEND=local|ray] [LAUNCHER=torchrun|mpirun]`: run one pipeline's DAG
once on the embedded defaults, print a short account of the run (validated, trained, evaluated,
promoted or why not) and a JSON summary as the last line (contract 5, docs/contracts.md); on
failure `state` is "failed" and the exit code non-zero. Airflow's own lines go to a log file it
names. Ctrl-C or SIGTERM stops it at any moment, ending a running gang. Honours GANGFLOW_HOME and
GANGFLOW_FAULT.

    python -m operators.cli.demo [--pipeline diabetes] [--backend ray] [--launcher mpirun]
        [--conf '{"world_size": 1, "max_steps": 300}']
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from operators.config import embedded

from operators.config import settings
from trainer.urls import redact_url

DAG_ID = "train_pipeline"  # the digits pipeline's


class _OncePerChange(logging.Filter):
    """Drops a "No tasks to run" record that repeats the previous one: `dag.test()` logs it once a
    second while a task waits for its retry."""

    def __init__(self) -> None:
        super().__init__()
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("No tasks to run"):
            return True
        message = record.getMessage()
        repeated, self.last = message == self.last, message
        return not repeated


@contextlib.contextmanager
def quiet_waits():
    """`dag.test()`'s "No tasks to run" once per change of the waiting tasks, not once a second."""
    logger, once = logging.getLogger("airflow.sdk.definitions.dag"), _OncePerChange()
    logger.addFilter(once)
    try:
        yield
    finally:
        logger.removeFilter(once)


def run_dag(conf: dict, dag_id: str = DAG_ID, dag_file: str = "train_pipeline.py", *, dags: Path | None = None):
    """`dag.test()` of DAG `dag_id` from `<dags>/<dag_file>` (default: the project's `dags/`;
    after `embedded.apply()`)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str((dags or settings.PROJECT_ROOT / "dags") / dag_file))
    if dag_id not in bag.dags:
        raise SystemExit(f"DAG {dag_id!r} did not load: {bag.import_errors}")
    with quiet_waits():
        return bag.dags[dag_id].test(run_conf=conf or None)


def _validated_version(session, dag_id: str, run_id: str) -> str | None:
    """The version validate_dataset was given, as rendered (an Asset event's, or the run's Param)."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields

    row = session.query(RenderedTaskInstanceFields).filter_by(dag_id=dag_id, run_id=run_id, task_id="validate_dataset").first()
    version = (getattr(row, "rendered_fields", None) or {}).get("dataset_version") if row else None
    return str(version) if version not in (None, "", "pinned") else None


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
        validated = _validated_version(session, dag_id, dag_run.run_id)
    manifest, metrics, decision = (xcoms.get((task_id, "return_value")) or {} for task_id in ("validate_dataset", "evaluate", "promote"))
    train_tries = [tries for task_id, (state, tries) in tis.items() if task_id.startswith("train_") and state not in ("skipped", None)]
    training = xcoms.get(("training_result", "backend")) and {
        key: xcoms.get(("training_result", key)) for key in ("backend", "launcher", "resumed_from_step", "dispatched_to")
    }
    # preemptions re-launched without a retry (issue 25.1): the training task's own XComs, kept
    # while it ran, so a run that failed afterwards still shows them
    reasons = next((v for (task_id, key), v in xcoms.items() if task_id.startswith("train_") and key == "preemption_reasons"
                    and isinstance(v, list)), [])
    params = {**{"backend": config.default_backend, "launcher": config.launcher}, **(dag_run.conf or {})}
    state = str(getattr(dag_run.state, "value", dag_run.state))
    summary = {
        "state": "success" if state == "success" else "failed",
        "pipeline": config.name,
        "dag_run_id": dag_run.run_id,
        # A failed validation has no manifest: the version it was given, else the pinned one (the Param's default).
        "dataset_version": manifest.get("version") or validated or (dag_run.conf or {}).get("dataset_version")
        or config.dataset_version or None,
        "metric": {**config.metric.as_dict(), "value": metrics.get(config.metric.name)},
        "accuracy": metrics.get("accuracy"),
        "tracking_uri": redact_url(settings.tracking_uri()),
        "model_name": decision.get("model_name"),
        "model_version": decision.get("model_version"),
        "promoted": bool(decision.get("promoted", False)),
        "promotion_reason": decision.get("reason"),
        "train_attempts": max(train_tries, default=0),
        # what ran (the training task's result), else what was asked
        "backend": (training or params)["backend"],
        "launcher": (training or params)["launcher"],
        "resumed_from_step": (training or {}).get("resumed_from_step"),
        # MultiKueue: the worker cluster the gang ran on, read back through the manager (else None)
        "dispatched_to": (training or {}).get("dispatched_to"),
        **checkpoint_interval(settings.run_dir(dag_id, dag_run.run_id), params.get("checkpoint_every_steps", config.checkpoint_every_steps)),
        "preemptions": len(reasons),
        "preemption_reasons": reasons,
        # pauses then resumes of the gang (`python -m operators.cli.gang`): no retry spent either
        "pauses": next((v.get("pauses", 0) for (task_id, key), v in xcoms.items()
                        if task_id.startswith("train_") and key == "return_value" and isinstance(v, dict)), 0),
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


def checkpoint_interval(run_dir, asked) -> dict:
    """`checkpoint_every_steps` (what the last try used: auto's choice, else what was asked) and
    `checkpoint_interval_inputs` (auto's C, MTBF, step time and where each came from; else null)."""
    from operators.checkpoint_history import chosen_interval

    chosen = chosen_interval(run_dir) if str(asked) == "auto" else None
    if chosen is None:
        return {"checkpoint_every_steps": asked, "checkpoint_interval_inputs": None}
    keys = ("cost_s", "cost_source", "mtbf_s", "mtbf_source", "step_s", "seconds", "bound", "attempt")
    return {"checkpoint_every_steps": chosen["every_steps"], "checkpoint_interval_inputs": {k: chosen.get(k) for k in keys}}


def parse_with_conf(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """`parser` with a `--conf` option (the DAG run's Params as JSON): (args, conf)."""
    parser.add_argument("--conf", default="{}", help="DAG run conf (Params) as JSON, e.g. '{\"world_size\": 1}'")
    args = parser.parse_args(argv)
    try:
        conf = json.loads(args.conf)
    except ValueError as exc:
        parser.error(f"--conf: not valid JSON ({exc})")
    if not isinstance(conf, dict):  # the run's Params by name; a list or a string would fail later, unexplained
        parser.error(f"--conf: must be a JSON object of Params, e.g. '{{\"world_size\": 2}}' (got {args.conf!r})")
    return args, conf


STAGES = ("validate_dataset", "admit_gang", "train", "evaluate", "promote")


def account(summary: dict) -> list[str]:
    """The run in a few lines a person reads: validated, trained, evaluated, promoted, or why not."""
    failure = summary.get("failure") or {}
    if failure.get("kind") == "interrupted":
        return [f"stopped: {failure.get('reason')}"]
    task = str(failure.get("task_id") or "")
    failed_at = STAGES.index("train" if task.startswith("train_") else task) if failure and (
        task.startswith("train_") or task in STAGES) else (0 if failure and not task else len(STAGES))
    why = f"{failure.get('kind')}: {failure.get('reason')}" if failure else ""
    version = summary.get("dataset_version") or "?"
    lines = [f"validated: yes, dataset version {version}" if failed_at > 0 else f"validated: no, dataset version {version}: {why}"]
    attempts = summary.get("train_attempts") or 0
    preempted = f" and {summary['preemptions']} preemption(s) (no retry spent)" if summary.get("preemptions") else ""
    if failed_at > STAGES.index("train"):
        lines.append(f"trained: yes, {attempts} attempt(s){preempted}")
    elif failed_at == STAGES.index("train"):
        lines.append(f"trained: no, after {attempts} attempt(s){preempted}: {why}")
    else:
        lines.append("not trained" + (f": admission refused the gang: {why}" if failed_at == 1 else ""))
    metric = summary.get("metric") or {}
    if failed_at > STAGES.index("evaluate"):
        value = metric.get("value")
        shown = f"{value:.4f}" if isinstance(value, float) else value
        lines.append(f"evaluated: {metric.get('name')} {shown} ({metric.get('direction')} is better)")
    elif failed_at == STAGES.index("evaluate"):
        lines.append(f"evaluated: no: {why}")
    if summary.get("promoted"):
        lines.append(f"promoted: {summary.get('model_name')} v{summary.get('model_version')} is the champion "
                     f"({summary.get('promotion_reason')})")
    elif failed_at > STAGES.index("promote"):
        lines.append(f"not promoted: {summary.get('promotion_reason')}")
    elif failed_at == STAGES.index("promote"):
        lines.append(f"not promoted: {why}")
    return lines


def failed_summary(config, kind: str, reason: str, conf: dict | None = None) -> dict:
    """The summary of a run that ended before the DAG's own outcome could be read (contract 5's keys)."""
    conf = conf or {}
    return {"state": "failed", "pipeline": config.name, "dag_run_id": None, "dataset_version": config.dataset_version or None,
            "backend": conf.get("backend", config.default_backend), "launcher": conf.get("launcher", config.launcher),
            "resumed_from_step": None,
            "checkpoint_every_steps": conf.get("checkpoint_every_steps", config.checkpoint_every_steps),
            "checkpoint_interval_inputs": None,
            "metric": {**config.metric.as_dict(), "value": None}, "accuracy": None, "tracking_uri": redact_url(settings.tracking_uri()),
            "model_name": config.model_name, "model_version": None, "promoted": False, "promotion_reason": None,
            "train_attempts": 0, "failure": {"kind": kind, "reason": reason, "task_id": None}}  # fmt: skip


def _stop_signal(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _run_here(name: str, conf: dict, summary_file: Path) -> int:
    """The run itself (in the child the supervisor started): the DAG via `dag.test()`, its summary to `summary_file`."""
    embedded.apply()  # before anything imports Airflow: it binds its config at import
    from operators.config.pipelines import pipeline

    config = pipeline(name)
    os.environ.setdefault("GANGFLOW_ALLOW_FAULTS", "1")  # a drill: GANGFLOW_FAULT is honoured here (docs/trainer.md)
    from airflow.sdk.exceptions import ParamValidationError

    try:
        dag_run = run_dag(conf, config.dag_id)
    except ParamValidationError as exc:  # refused before any task ran
        summary, code = failed_summary(config, "user", str(exc), conf), 2
    else:
        summary = summarize(dag_run, config.dag_id)
        code = 0 if summary["state"] == "success" else 1
    from trainer.storage import write_json

    write_json(summary_file, json.loads(json.dumps(summary, default=str)))
    print(json.dumps(summary, default=str), flush=True)
    return code


def _child_env(roots: list[str]) -> dict[str, str]:
    """This environment, with the pipeline's package roots and the project root on PYTHONPATH:
    the DAG file, the tasks and the ranks import the user's packages."""
    paths = [*roots, str(settings.PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="digits", help="the pipeline to run: a file pipelines/<name>.yaml (default digits)")
    parser.add_argument("--backend", help="the backend Param (local, ray, ...; default: the pipeline file's)")
    parser.add_argument("--launcher", help="the launcher Param (torchrun, mpirun; default: the pipeline file's)")
    parser.add_argument("--airflow-log", type=Path, default=None,
                        help="where Airflow's own lines go (default: <state dir>/logs/demo-<pipeline>-<time>.log)")
    parser.add_argument("--summary-file", type=Path, help=argparse.SUPPRESS)  # set: run here (the supervisor's child)
    args, conf = parse_with_conf(parser, argv)
    conf |= {key: value for key, value in (("backend", args.backend), ("launcher", args.launcher)) if value}
    if args.summary_file:
        return _run_here(args.pipeline, conf, args.summary_file)
    embedded.apply()
    from operators.config.pipelines import PipelineConfigError, pipeline
    from operators.utils.processes import stop_tree, tagged_env

    try:
        config = pipeline(args.pipeline)
    except PipelineConfigError as exc:
        parser.error(str(exc))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    log_path = (args.airflow_log or settings.state_dir() / "logs" / f"demo-{config.name}-{stamp}.log").resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    summary_file = log_path.with_suffix(".summary.json")
    summary_file.unlink(missing_ok=True)
    print(f"gangflow demo: pipeline {config.name}, DAG {config.dag_id}; Airflow's log: {log_path}", flush=True)
    # The run goes on in a child of its own session: a signal here stops it and every gang it started
    # (Airflow's task runner would otherwise take SIGTERM for the task's and go on retrying).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop_signal)
    command = [sys.executable, "-m", "operators.cli.demo", "--pipeline", config.name, "--conf", json.dumps(conf),
               "--summary-file", str(summary_file)]
    env = tagged_env(_child_env(list(config.package_roots)))  # stop_tree finds every process of the run by it
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=settings.PROJECT_ROOT, env=env)  # fmt: skip
    try:
        code = proc.wait()
    except KeyboardInterrupt as stop:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not orphan the run
            signal.signal(signum, signal.SIG_IGN)
        print(f"gangflow demo: {stop} received, stopping the run ...", file=sys.stderr, flush=True)
        stop_tree(proc, grace=5, env=env)
        summary = failed_summary(config, "interrupted", f"stopped by {stop} (the run and its gang were ended)", conf)
        code = 128 + (signal.SIGTERM if str(stop) == "SIGTERM" else signal.SIGINT)
    else:
        try:
            summary = json.loads(summary_file.read_text())
        except (OSError, ValueError):
            summary = failed_summary(config, "unknown", f"the run ended (exit code {code}) without a summary; see {log_path}", conf)
            code = code or 1
    for line in account(summary):
        print(line, flush=True)
    print(json.dumps(summary, default=str), flush=True)
    return code


if __name__ == "__main__":
    from operators.utils.processes import exit_without_teardown

    exit_without_teardown(main())
