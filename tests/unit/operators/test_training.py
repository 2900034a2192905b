"""GangTrainingOperator's spec and result: the ranks get a dataset VERSION (fetched by content
address), never a path of the worker's DVC cache; the result names the model by MLflow URI."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from operators.config import settings
from operators.backends import GangResult
from operators.backends.local import LocalBackend
from operators.exceptions import UserError, UserFailure
from operators.training import GangTrainingOperator

VERSION = "d82dc74b3a3f4e8b3b51d13271f59bb3"


@pytest.fixture
def worker_manifest(tmp_path, monkeypatch):
    """A validate-task manifest whose files live in THIS worker's DVC cache."""
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("GANGFLOW_DVC_REMOTE", raising=False)
    cache = settings.dvc_cache() / "files" / "md5"
    return {"version": VERSION, "uri": f"{settings.dvc_remote().as_uri()}/files/md5/d8/2dc74b.dir",
            "train_path": str(cache / "aa" / "train"), "test_path": str(cache / "bb" / "test"),
            "train_md5": "a" * 32, "test_md5": "b" * 32}


def _context(try_number: int = 1):
    ti = SimpleNamespace(dag_id="train_pipeline", try_number=try_number)
    return {"ti": ti, "run_id": "manual__2026-11-30T21:00:00+00:00"}


def _spec(manifest, **kwargs):
    kwargs.setdefault("overrides", {"train.max_steps": 5})
    op = GangTrainingOperator(task_id="train_local_2", world_size=2, dataset=manifest, **kwargs)
    return op, op.build_spec(_context(), mlflow_run_id="0123456789abcdef")


def test_ranks_get_the_dataset_version_and_no_worker_path(worker_manifest, tmp_path):
    _, spec = _spec(worker_manifest)
    # One route: manifest -> GangSpec.dataset_version -> the backend's data arguments.
    assert spec.dataset_version == VERSION
    assert not [o for o in spec.overrides if o.startswith("data.")]
    argv = LocalBackend().command(spec, tmp_path / "logs")
    assert argv[argv.index(f"data.version={VERSION}") - 1] == "--set"
    # The local backend supplies its DVC remote, as a URL the rank fetches from (like a pod does).
    assert argv[argv.index(f"data.remote={settings.dvc_remote().as_uri()}") - 1] == "--set"
    text = json.dumps({"argv": argv, "env": dict(spec.env)})
    for key in ("train_path", "test_path"):
        assert worker_manifest[key] not in text and f"data.{key}" not in text
    assert str(settings.dvc_cache()) not in text
    assert "data.train_md5" not in text  # the version pins every md5 (the rank checks them itself)


def test_another_remote_for_the_local_backend(worker_manifest, tmp_path):
    _, spec = _spec(worker_manifest)
    argv = LocalBackend(dataset_remote="s3://bucket/dvc").command(spec, tmp_path / "logs")
    assert "data.remote=s3://bucket/dvc" in argv
    _, spec = _spec(worker_manifest, overrides={"data.remote": "gs://other/dvc"})
    argv = LocalBackend().command(spec, tmp_path / "logs")
    assert [a for a in argv if a.startswith("data.remote=")] == ["data.remote=gs://other/dvc"]


def test_result_names_the_model_by_mlflow_uri_not_by_worker_path(worker_manifest):
    op, spec = _spec(worker_manifest)
    # The model the task logged after the gang (the relay's `log_final`): its MLflow URI.
    result = op._finish(spec, GangResult(succeeded=True, exit_code=0, resumed_from_step=30), None,
                        "models:/m-0123456789abcdef")
    assert result["model_uri"] == "models:/m-0123456789abcdef"
    assert result["mlflow_run_id"] == "0123456789abcdef" and result["dataset_version"] == VERSION
    assert result["resumed_from_step"] == 30 and result["gang"] == spec.name and result["world_size"] == 2
    assert not {"run_dir", "final_dir"} & set(result)
    assert spec.run_dir not in json.dumps(result) and str(settings.state_dir()) not in json.dumps(result)


def test_a_gang_without_an_mlflow_run_leaves_no_loadable_model(worker_manifest):
    op = GangTrainingOperator(task_id="t", world_size=1, dataset=worker_manifest)
    spec = op.build_spec(_context(), mlflow_run_id=None)
    with pytest.raises(UserError, match="without an MLflow run"):
        op._finish(spec, GangResult(succeeded=True, exit_code=0))


def test_spec_round_trips_through_the_deferral_kwargs(worker_manifest):
    from operators.backends import GangSpec
    from operators.training import _spec_to_dict

    _, spec = _spec(worker_manifest)
    assert GangSpec(**json.loads(json.dumps(_spec_to_dict(spec)))) == spec


@pytest.mark.parametrize("world_size", [0, True, 2.0])
def test_a_spec_refuses_a_world_size_that_is_not_a_count(worker_manifest, world_size):
    import dataclasses

    from operators.backends import GangSpec
    from operators.training import _spec_to_dict

    _, spec = _spec(worker_manifest)
    with pytest.raises(ValueError, match=r"world_size=.*must be an integer >= 1"):
        GangSpec(**{**_spec_to_dict(spec), "world_size": world_size})
    assert dataclasses.replace(spec, world_size=3).world_size == 3


def test_manifest_as_rendered_json(worker_manifest):
    _, spec = _spec(json.dumps(worker_manifest))
    assert spec.dataset_version == VERSION
    assert Path(spec.run_dir).parent.name == "train_pipeline"


# --- issue 28.4: no credential in argv, logs, params or tags ------------------------------------------


SECRET = "wJalr-secret"


@pytest.mark.parametrize("kwargs, field", [
    ({"run_dir": f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs/r1"}, "run_dir"),
    ({"overrides": {"data.remote": f"s3://AKIAEXAMPLE:{SECRET}@bucket/dvc"}}, "overrides data.remote"),
])
def test_a_gang_whose_argv_would_carry_credentials_is_refused_naming_the_field(worker_manifest, kwargs, field):
    with pytest.raises(ValueError) as info:
        _spec(worker_manifest, **kwargs)
    assert str(info.value).startswith(f"{field}=") and "must not carry credentials" in str(info.value)
    assert SECRET not in str(info.value)


def test_a_local_dataset_remote_with_credentials_is_refused_naming_the_option():
    with pytest.raises(UserError) as info:
        LocalBackend(dataset_remote=f"s3://AKIAEXAMPLE:{SECRET}@bucket/dvc")
    assert "dataset_remote=" in str(info.value) and "must not carry credentials" in str(info.value)
    assert SECRET not in str(info.value)


def test_the_dvc_remote_with_a_password_never_reaches_argv_or_the_log(worker_manifest, tmp_path, monkeypatch):
    """Issue 28: the local backend printed a DVC remote URL with its password in the task log
    (its `launching gang ...` line) and the trainer logged it as an MLflow param."""
    monkeypatch.setenv("GANGFLOW_DVC_REMOTE", f"s3://AKIAEXAMPLE:{SECRET}@bucket/dvc")
    _, spec = _spec(worker_manifest)
    with pytest.raises(UserError) as info:
        LocalBackend().command(spec, tmp_path / "logs")
    assert "GANGFLOW_DVC_REMOTE" in str(info.value) and "must not carry credentials" in str(info.value)
    assert SECRET not in str(info.value)


def test_an_explicit_tracking_uri_with_credentials_is_refused():
    from operators.hooks.mlflow import get_client

    with pytest.raises(UserError) as info:
        get_client(f"https://bob:{SECRET}@mlflow.example.com")
    assert "tracking_uri=" in str(info.value) and "must not carry credentials" in str(info.value)
    assert SECRET not in str(info.value)


def test_a_node_the_verdict_names_suspect_is_avoided_by_the_kubernetes_retry(worker_manifest, tmp_path):
    """Issue 28.7: try 1 fails on a node where another gang failed in the last hour; its verdict
    names the node (failures/try-1.json) and try 2's spec carries it as `avoid_nodes` (the
    Kubernetes builders turn it into a node affinity: tests/unit/operators/kubernetes/test_render.py)."""
    from operators import failure_context
    from operators.backends import GangSpec
    from operators.training import _spec_to_dict

    failure_context.record_node_failure("gpu-node-3", gang="someone-else", kind="infra")
    op = GangTrainingOperator(task_id="train_k8s_2", world_size=2, dataset=worker_manifest, backend="kubernetes",
                              run_dir=str(tmp_path / "run"))
    first = op.build_spec(_context(1), mlflow_run_id=None)
    assert first.avoid_nodes == ()
    evidence = {"exit_code": -11, "step": 40, "node": "gpu-node-3", "log_tail": "Segmentation fault (core dumped)"}
    failure = op._failure(first, GangResult(succeeded=False, exit_code=-11, evidence=evidence))
    assert failure.verdict.exclude_nodes == ("gpu-node-3",), failure.verdict
    second = op.build_spec(_context(2), mlflow_run_id=None)
    assert second.avoid_nodes == ("gpu-node-3",)
    assert GangSpec(**json.loads(json.dumps(_spec_to_dict(second)))) == second  # through the deferral
    # a record that is not the operator's, or a link in its place, names nothing
    (tmp_path / "run" / "failures" / "try-2.json").symlink_to(tmp_path / "run" / "failures" / "try-1.json")
    assert op.build_spec(_context(3), mlflow_run_id=None).avoid_nodes == ("gpu-node-3",)
    (tmp_path / "run" / "failures" / "try-1.json").write_text("[not, a, record")
    assert op.build_spec(_context(2), mlflow_run_id=None).avoid_nodes == ()


# --- preemption: its own outcome, no retry spent (issue 25.1) -----------------------------------

PREEMPTED = GangResult(succeeded=False, exit_code=75, evidence={"exit_code": 75, "ranks": [{"rank": 0, "exit_code": 75}]})
KILLED = GangResult(succeeded=False, exit_code=137, evidence={"exit_code": 137, "signal": "SIGKILL"})


def _gang(results):
    """A gang that ends with each of `results` in turn (what `backend.run` returns)."""
    calls = []

    def run():
        calls.append(1)
        return results[len(calls) - 1]

    return run, calls


def test_a_preempted_gang_is_relaunched_without_spending_a_retry(worker_manifest):
    op, spec = _spec(worker_manifest)
    run, calls = _gang([PREEMPTED, PREEMPTED, GangResult(succeeded=True, exit_code=0, resumed_from_step=31)])
    result = op.run_through_preemptions(spec, run)
    assert result.succeeded and len(calls) == 3
    assert len(op.preemptions) == 2 and all("75" in reason for reason in op.preemptions)
    out = op._finish(spec, result, None, "models:/m-0123456789abcdef")
    assert out["preemptions"] == 2 and out["preemption_reasons"] == op.preemptions
    assert out["attempt"] == 1 and out["resumed_from_step"] == 31


def test_a_failure_is_not_relaunched(worker_manifest):
    op, spec = _spec(worker_manifest)
    run, calls = _gang([KILLED, GangResult(succeeded=True, exit_code=0)])
    result = op.run_through_preemptions(spec, run)
    assert not result.succeeded and len(calls) == 1 and op.preemptions == []


def test_preemptions_past_the_budget_spend_a_retry_as_before(worker_manifest):
    op, spec = _spec(worker_manifest, max_preemptions=1)
    run, calls = _gang([PREEMPTED, PREEMPTED, GangResult(succeeded=True, exit_code=0)])
    result = op.run_through_preemptions(spec, run)
    assert not result.succeeded and result.exit_code == 75 and len(calls) == 2
    assert len(op.preemptions) == 1


@pytest.mark.parametrize("value", [-1, "many", 2.5, True])
def test_the_preemption_budget_is_checked_naming_the_field(value):
    with pytest.raises(ValueError, match=r"max_preemptions=.*accepted values: an integer >= 0"):
        GangTrainingOperator(task_id="t", world_size=1, max_preemptions=value)


def test_a_gang_the_task_itself_stopped_is_not_relaunched(worker_manifest):
    # on_kill, or the MLflow relay giving up (`_stop_gang`): the ranks' exit 75 is no preemption
    op, spec = _spec(worker_manifest)
    op._killed = True
    run, calls = _gang([PREEMPTED, GangResult(succeeded=True, exit_code=0)])
    assert not op.run_through_preemptions(spec, run).succeeded and len(calls) == 1 and op.preemptions == []


# --- the run-time limit: stopped with a checkpoint, failed as the user's (issue 25.3) -----------


class _GangUntilStopped:
    """A local gang that trains until it is stopped: on SIGTERM its ranks commit and exit 75."""

    deferrable = False

    def __init__(self):
        self.stopped, self.kills = threading.Event(), 0

    def run(self, spec, log):
        self.stopped.wait(60)
        return PREEMPTED

    def kill(self):
        self.kills += 1
        self.stopped.set()


def test_a_gang_past_its_run_time_limit_is_stopped_and_fails_at_once_naming_the_limit(worker_manifest):
    op, spec = _spec(worker_manifest, max_run_time_seconds=1)
    assert spec.max_run_time_s == 1
    op._backend = gang = _GangUntilStopped()
    started = time.monotonic()
    result = op.run_through_preemptions(spec, lambda: op._run_gang(spec, print))
    assert time.monotonic() - started < 20 and gang.kills == 1
    # its SIGTERM ending (exit 75) is the limit's doing, not a preemption to re-launch
    assert not result.succeeded and op.preemptions == []
    assert result.evidence["termination_reason"] == "DeadlineExceeded"
    with pytest.raises(UserFailure) as failure:
        op._finish(spec, result)
    assert not failure.value.retryable
    assert "training.max_run_time_seconds=1" in str(failure.value) and "checkpoint" in str(failure.value)


def test_a_gang_within_its_run_time_limit_is_left_alone(worker_manifest):
    op, spec = _spec(worker_manifest, max_run_time_seconds=60)
    op._backend = gang = _GangUntilStopped()
    gang.stopped.set()  # it ends by itself at once
    result = op._run_gang(spec, print)
    assert gang.kills == 0 and "termination_reason" not in result.evidence


@pytest.mark.parametrize("field", ["max_run_time_seconds", "max_queue_wait_seconds"])
@pytest.mark.parametrize("value", [0, -1, 2.5, "1h", True])
def test_the_time_limits_are_checked_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"{field}=.*accepted values: an integer >= 1"):
        GangTrainingOperator(task_id="t", world_size=1, **{field: value})


def test_the_queue_wait_limit_reaches_the_spec(worker_manifest):
    assert _spec(worker_manifest, max_queue_wait_seconds=900)[1].max_queue_wait_s == 900
    assert _spec(worker_manifest)[1].max_queue_wait_s is None


FORM_LIMITS = {"max_run_time_seconds": "{{ params.max_run_time_seconds or '' }}",
               "max_queue_wait_seconds": "{{ params.max_queue_wait_seconds or '' }}"}  # as the pipeline DAG passes them


@pytest.mark.parametrize(("form", "expected"), [(45, 45), (None, None)])
def test_the_forms_time_limits_reach_the_spec_once_rendered(worker_manifest, form, expected):
    """Issue 25.3: the trigger form's Params, rendered by Airflow, bound this run's gang."""
    op = GangTrainingOperator(task_id="train_local_2", world_size=2, dataset=worker_manifest, **FORM_LIMITS)
    op.render_template_fields({"params": {"max_run_time_seconds": form, "max_queue_wait_seconds": form}})
    spec = op.build_spec(_context(), mlflow_run_id="0123456789abcdef")
    assert (spec.max_run_time_s, spec.max_queue_wait_s) == (expected, expected)


@pytest.mark.parametrize("field", ["max_run_time_seconds", "max_queue_wait_seconds"])
def test_a_rendered_limit_that_is_no_count_is_refused_naming_the_field(worker_manifest, field):
    op = GangTrainingOperator(task_id="train_local_2", world_size=2, dataset=worker_manifest, **FORM_LIMITS)
    op.render_template_fields({"params": {"max_run_time_seconds": 45, "max_queue_wait_seconds": 45, field: "1h"}})
    with pytest.raises(UserError, match=rf"{field}='1h': accepted values: an integer >= 1"):
        op.build_spec(_context(), mlflow_run_id="0123456789abcdef")


@pytest.mark.parametrize(("result", "said"), [
    (GangResult(succeeded=True, exit_code=0, resumed_from_step=30), "try 2 resumed from checkpoint step 30"),
    (GangResult(succeeded=True, exit_code=0), "try 2 started from step 0 (no committed checkpoint)"),
    # a Kubernetes gang: the ranks' logs stay in the cluster, so the task does not claim a fresh start
    (GangResult(succeeded=True, exit_code=0, start_step_known=False), "try 2: rank 0's log says which checkpoint"),
])  # fmt: skip
def test_a_retry_says_where_it_started_only_when_the_backend_read_it(worker_manifest, monkeypatch, result, said):
    op = GangTrainingOperator(task_id="train_local_2", world_size=2, dataset=worker_manifest, overrides={"train.max_steps": 5})
    spec = op.build_spec(_context(try_number=2), mlflow_run_id="0123456789abcdef")
    lines: list[str] = []
    task_log = SimpleNamespace(info=lambda message, *args: lines.append(message % args), warning=lambda *a: None)
    monkeypatch.setattr(GangTrainingOperator, "log", property(lambda self: task_log))
    op._finish(spec, result, None, "models:/m-0123456789abcdef")
    starts = [line for line in lines if "try 2" in line]
    assert len(starts) == 1 and said in starts[0], lines
