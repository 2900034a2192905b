"""The inputs of `checkpoint.every_steps: auto` a training task reads from this pipeline's history
(issue 25.5): the save cost from MLflow, the MTBF from the runs' training time and their failed
tries; against a real MLflow store (SQLite) and real try records."""

from __future__ import annotations

import json

import pytest

from operators import checkpoint_history as ch
from operators.config import settings
from operators.failures.preemption import PREEMPTIONS_FILE
from operators.hooks import mlflow as tracking
from trainer.checkpoint_interval import HISTORY_ENV, IntervalInputs
from trainer.storage import write_json

DAG = "train_hist"


def _run(client, experiment_id, dag_run_id, *, blocked=(), attempts=(), failures=(), preemptions=(), dag_id=DAG):
    """One DAG run's MLflow run (its checkpoint_blocked_s and attempt_run_s series) and its try records."""
    run_id = tracking.ensure_run(client, experiment_id, dag_id=dag_id, dag_run_id=dag_run_id)
    for i, value in enumerate(blocked):
        client.log_metric(run_id, "checkpoint_blocked_s", value, step=10 * (i + 1))
    for attempt, values in enumerate(attempts, start=1):
        for value in values:  # progress lines repeat attempt_run_s; the last (largest) counts
            client.log_metric(run_id, "attempt_run_s", value, step=attempt)
    for attempt, kind in failures:
        write_json(settings.run_dir(dag_id, dag_run_id) / "failures" / f"try-{attempt}.json",
                   {"attempt": attempt, "verdict": {"kind": kind, "reason": "x"}})
    if preemptions:  # re-launched in the task, no try spent: the run dir's record (operators/training.py)
        write_json(settings.run_dir(dag_id, dag_run_id) / PREEMPTIONS_FILE, {"reasons": list(preemptions)})
    return run_id


@pytest.fixture(scope="module")
def experiment(client):
    experiment_id = tracking.ensure_experiment(client, "ckpt-history")
    # r1: two tries, the first ended by an infra failure; r2: a preemption then success, and a user failure
    _run(client, experiment_id, "r1", blocked=(0.1, 0.2, 0.3), attempts=((100.0, 400.0), (300.0,)), failures=((1, "infra"),))
    _run(client, experiment_id, "r2", blocked=(0.4, 0.5), attempts=((500.0,), (50.0,), (50.0,)),
         failures=((2, "user"),), preemptions=("Kueue evicted the Workload (Preempted)",))
    # another pipeline's run: neither its saves nor its failures count here
    _run(client, experiment_id, "o1", blocked=(9.0,), attempts=((10.0,),), failures=((1, "infra"),), dag_id="train_other")
    return experiment_id


def test_the_save_cost_is_the_median_of_this_pipelines_measured_saves(client, experiment):
    inputs = ch.history_inputs(client, experiment, dag_id=DAG)
    assert inputs.cost_s == pytest.approx(0.3)  # median of 0.1 0.2 0.3 0.4 0.5; the other DAG's 9.0 is not there
    assert "checkpoint_blocked_s" in inputs.cost_source and "5 saves" in inputs.cost_source and "2 runs" in inputs.cost_source


def test_the_mtbf_is_training_time_over_infra_failures_and_preemptions(client, experiment):
    inputs = ch.history_inputs(client, experiment, dag_id=DAG)
    # 400 + 300 + 500 + 50 + 50 = 1300 s of training over 2 failures (infra, preempted); the user failure is not the platform's
    assert inputs.mtbf_s == pytest.approx(650.0)
    assert "2 failures" in inputs.mtbf_source and "1300" in inputs.mtbf_source and "2 runs" in inputs.mtbf_source


def test_no_history_gives_no_inputs_and_no_failure_gives_no_mtbf(client, experiment):
    assert ch.history_inputs(client, experiment, dag_id="train_never_ran") == IntervalInputs()
    _run(client, experiment, "q1", blocked=(0.2,), attempts=((60.0,),), dag_id="train_quiet")
    quiet = ch.history_inputs(client, experiment, dag_id="train_quiet")
    assert quiet.cost_s == pytest.approx(0.2) and quiet.mtbf_s is None and quiet.mtbf_source == ""


def test_only_an_auto_interval_asks_for_history(tmp_path):
    auto = tmp_path / "auto.yaml"
    auto.write_text("checkpoint: {every_steps: auto}\n")
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text("checkpoint: {every_steps: 100}\n")
    assert ch.wants_auto_interval(str(auto), {}) and not ch.wants_auto_interval(str(fixed), {})
    assert ch.wants_auto_interval(str(fixed), {"checkpoint.every_steps": "auto"})  # the form's value wins
    assert not ch.wants_auto_interval(str(auto), {"checkpoint.every_steps": "50"})
    assert not ch.wants_auto_interval(str(tmp_path / "missing.yaml"), {})


def test_the_gang_gets_the_history_as_one_environment_value(client, experiment, tmp_path, monkeypatch):
    lines: list[str] = []
    env = ch.gang_env(config_path=str(tmp_path / "x.yaml"), overrides={"checkpoint.every_steps": "auto"}, dag_id=DAG,
                      experiment="ckpt-history", log=lines.append)
    inputs = IntervalInputs.from_env(env)
    assert inputs.cost_s == pytest.approx(0.3) and inputs.mtbf_s == pytest.approx(650.0)
    assert any("650" in line for line in lines), lines
    assert ch.gang_env(config_path=str(tmp_path / "x.yaml"), overrides={"checkpoint.every_steps": "100"}, dag_id=DAG,
                       experiment="ckpt-history", log=lines.append) == {}
    # MLflow out of reach: no history, the ranks probe and use the prior; the task goes on
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    lines.clear()
    assert ch.gang_env(config_path=str(tmp_path / "x.yaml"), overrides={"checkpoint.every_steps": "auto"}, dag_id=DAG,
                       experiment="ckpt-history", log=lines.append) == {}
    assert any("no checkpoint history" in line for line in lines), lines
    assert HISTORY_ENV not in env or json.loads(env[HISTORY_ENV])


def test_the_training_task_hands_the_history_to_its_gang(client, experiment):
    from types import SimpleNamespace

    from operators.training import GangTrainingOperator

    context = {"ti": SimpleNamespace(dag_id=DAG, try_number=2), "run_id": "r3"}
    auto = GangTrainingOperator(task_id="t", world_size=2, experiment="ckpt-history", overrides={"checkpoint.every_steps": "auto"})
    inputs = IntervalInputs.from_env(auto.build_spec(context, mlflow_run_id=None).env)
    assert inputs.cost_s == pytest.approx(0.3) and inputs.mtbf_s == pytest.approx(650.0)
    fixed = GangTrainingOperator(task_id="t", world_size=2, experiment="ckpt-history", overrides={"checkpoint.every_steps": 100})
    assert HISTORY_ENV not in fixed.build_spec(context, mlflow_run_id=None).env


def test_kubernetes_pods_get_the_history_too():
    from types import SimpleNamespace

    from operators.kubernetes.builders import forwarded_env

    value = IntervalInputs(cost_s=0.3, cost_source="mlflow: x", mtbf_s=650.0, mtbf_source="history: y").to_env()
    assert forwarded_env(SimpleNamespace(env={HISTORY_ENV: value, "GANGFLOW_FAULT": "kill@step=1"}), None) == {HISTORY_ENV: value}
