"""The inputs of `checkpoint.every_steps: auto` from this pipeline's history, for its gang's ranks.

C: the median `checkpoint_blocked_s` (the loop time a save held, logged by rank 0) of the latest
saves of this DAG's MLflow runs. MTBF: their training time (`attempt_run_s`, per try) over their
tries that ended in an infrastructure failure (the training task's try records, `failures/try-N.json`
in each run dir) plus the preemptions it re-launched (`preemptions.json`). `trainer.checkpoint_interval` applies them (docs/trainer.md).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from operators.config import settings
from operators.failures.preemption import recorded_preemptions
from trainer.checkpoint_interval import HISTORY_ENV, IntervalInputs
from trainer.config import AUTO
from trainer.storage import read_json_record
from trainer.urls import redact_url

MAX_RUNS = 20  # the latest runs of the DAG that are read
MAX_SAVES = 200  # the latest saves whose median is C
#: Verdicts that count as failures of the platform (a user failure says nothing about the MTBF);
#: preemptions re-launched within the task leave no try record and are counted from PREEMPTIONS_FILE.
PLATFORM_FAILURES = ("infra",)


def history_inputs(client: Any, experiment_id: str, *, dag_id: str, max_runs: int = MAX_RUNS) -> IntervalInputs:
    """C and MTBF from the latest `max_runs` MLflow runs of DAG `dag_id` (its retries included)."""
    from operators.hooks.mlflow import TAG_DAG_ID, TAG_DAG_RUN_ID

    runs = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_DAG_ID}` = '{dag_id}'", max_results=max_runs,
                              order_by=["attributes.start_time DESC"])
    costs: list[float] = []
    cost_runs = exposed_runs = failures = 0
    exposure = 0.0
    for run in runs:
        run_id = run.info.run_id
        saves = sorted(client.get_metric_history(run_id, "checkpoint_blocked_s"), key=lambda m: (m.timestamp, m.step))
        if saves and len(costs) < MAX_SAVES:
            cost_runs += 1
            costs += [m.value for m in saves][-(MAX_SAVES - len(costs)):]
        per_try: dict[int, float] = {}
        for m in client.get_metric_history(run_id, "attempt_run_s"):  # repeated by progress lines: the last is the largest
            per_try[m.step] = max(per_try.get(m.step, 0.0), m.value)
        if per_try:
            exposed_runs += 1
            exposure += sum(per_try.values())
        dag_run_id = run.data.tags.get(TAG_DAG_RUN_ID)
        if dag_run_id:
            failures += platform_failures(settings.run_dir(dag_id, dag_run_id))
    inputs: dict[str, Any] = {}
    if costs:
        inputs |= {"cost_s": statistics.median(costs),
                   "cost_source": f"mlflow: median checkpoint_blocked_s of {len(costs)} saves in {cost_runs} runs of DAG {dag_id}"}
    if failures and exposure > 0:
        inputs |= {"mtbf_s": exposure / failures,
                   "mtbf_source": f"history: {exposure:.0f} s of training (attempt_run_s) in {exposed_runs} runs of DAG {dag_id} "
                                  f"over {failures} failure{'s' if failures != 1 else ''} (infra tries, failures/try-N.json, and preemptions, preemptions.json)"}
    return IntervalInputs(**inputs)


def platform_failures(run_dir: Path) -> int:
    """One DAG run's infra failures and preemptions: its tries whose verdict was infra (the training
    task's try records) and the preemptions it re-launched without a retry (PREEMPTIONS_FILE)."""
    count = len(recorded_preemptions(run_dir))
    for path in sorted((run_dir / "failures").glob("try-*.json")):
        verdict = read_json_record(path).get("verdict")
        count += isinstance(verdict, dict) and verdict.get("kind") in PLATFORM_FAILURES
    return count


def wants_auto_interval(config_path: str, overrides: Mapping[str, Any]) -> bool:
    """Whether the gang's trainer config (its file, then the overrides) says `every_steps: auto`."""
    value = overrides.get("checkpoint.every_steps")
    if value is None:
        try:
            raw = yaml.safe_load(settings.trainer_config_path(config_path).read_text()) or {}
            value = (raw.get("checkpoint") or {}).get("every_steps")
        except (OSError, yaml.YAMLError, AttributeError):
            return False  # the ranks' own loader reports a bad file
    return str(value).strip() == AUTO


def gang_env(*, config_path: str, overrides: Mapping[str, Any], dag_id: str, experiment: str,
             log: Callable[[str], None]) -> dict[str, str]:
    """`{GANGFLOW_CHECKPOINT_HISTORY: ...}` for a gang with `every_steps: auto` and history; else {}."""
    if not wants_auto_interval(config_path, overrides):
        return {}
    from operators.hooks import mlflow as tracking

    fallback = "the ranks time a probe save and use checkpoint.mtbf_prior_s"
    try:
        client = tracking.get_client()
        found = client.get_experiment_by_name(experiment)
        inputs = history_inputs(client, found.experiment_id, dag_id=dag_id) if found is not None else IntervalInputs()
    except Exception as exc:  # noqa: BLE001 - history is an aid: the ranks choose without it
        log(redact_url(f"gangflow: no checkpoint history for checkpoint.every_steps=auto ({type(exc).__name__}: {exc}); {fallback}"))
        return {}
    if inputs == IntervalInputs():
        log(f"gangflow: no checkpoint history for checkpoint.every_steps=auto (no earlier saves of DAG {dag_id}); {fallback}")
        return {}
    cost = f"C = {inputs.cost_s:.4f} s from {inputs.cost_source}" if inputs.cost_s is not None else "C from a probe save"
    mtbf = (f"MTBF = {inputs.mtbf_s:.0f} s from {inputs.mtbf_source}" if inputs.mtbf_s is not None
            else "MTBF from checkpoint.mtbf_prior_s (no infra failure or preemption in the history)")
    log(f"gangflow: checkpoint.every_steps=auto: {cost}; {mtbf}")
    return {HISTORY_ENV: inputs.to_env()}


def chosen_interval(run_dir: str | Path) -> dict[str, Any] | None:
    """The last interval `auto` chose in a run dir (its `checkpoint_interval` event), or None."""
    from trainer.tracking import METRICS

    chosen = None
    try:
        with open(Path(run_dir) / METRICS) as fh:
            for line in fh:
                if '"checkpoint_interval"' in line:
                    try:
                        record = json.loads(line)
                    except ValueError:  # a line a killed rank left half-written
                        continue
                    if record.get("event") == "checkpoint_interval":
                        chosen = record
    except OSError:
        return None
    return chosen
