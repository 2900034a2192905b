"""ClassifiedRetryPolicy: Airflow's RETRY/FAIL decision taken by the failure classifier."""

from __future__ import annotations

import errno
import json
import logging
import socket
import sqlite3
import urllib.error
from datetime import datetime, timedelta

import pytest
from airflow.sdk import RetryAction

from trainer.storage import LinkInPath, NotRegularFile, UnsafePath

from operators.exceptions import (
    DataValidationFailed,
    GangAdmissionTimeout,
    GangCapacityError,
    GangflowError,
    InfraError,
    InfraFailure,
    KubernetesApiError,
    RegistryUnavailable,
    StorageUnavailable,
    UnknownFailure,
    UserError,
    UserFailure,
)
from operators.failures import classify
from operators.retry import ClassifiedRetryPolicy, judge_exception

POLICY = ClassifiedRetryPolicy()


def decide(exc: BaseException, try_number: int = 1, max_tries: int = 3, policy: ClassifiedRetryPolicy = POLICY):
    return policy.evaluate(exc, try_number=try_number, max_tries=max_tries, context=None)


# -- gangflow's own exceptions --------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        InfraError("node gone"),
        StorageUnavailable("DVC remote unreachable"),
        RegistryUnavailable("MLflow 503"),
        KubernetesApiError("apiserver 500"),
        GangAdmissionTimeout("not all ranks Ready in 600s"),
        InfraFailure(classify({"exit_code": 143})),
    ],
)
def test_infra_is_retried(exc):
    decision = decide(exc)
    assert decision.action is RetryAction.RETRY
    assert decision.retry_delay == timedelta(seconds=10)
    assert decision.reason.startswith("gangflow: infra failure, retrying in 10s (try 1 of 4): ")


@pytest.mark.parametrize(
    "exc",
    [
        UserError("bad learning rate"),
        DataValidationFailed("3 expectations failed"),
        GangCapacityError("world size 64 > pool 8"),
        UserFailure(classify({"exit_code": 137, "termination_reason": "OOMKilled"})),
        GangflowError("a bare gangflow error is a user error"),
        # a run dir holding a link or a FIFO where gangflow writes or reads: no retry changes it
        LinkInPath(errno.ELOOP, "/runs/x/ray is a link or not a folder; links in a run dir are never followed for writing"),
        NotRegularFile(errno.EINVAL, "not a regular file"),
        UnsafePath("manifest name '../x' leaves its folder"),
    ],
)
def test_user_fails_at_once(exc):
    decision = decide(exc, try_number=1, max_tries=10)
    assert decision.action is RetryAction.FAIL
    assert decision.reason.startswith("gangflow: user failure, not retrying: ")


def test_gang_failure_decides_by_its_verdict_not_its_class():
    verdict = classify({"pod_conditions": [{"type": "DisruptionTarget", "reason": "PreemptionByScheduler"}]})
    decision = decide(UserFailure(verdict))  # a mislabelled class: the verdict wins
    assert decision.action is RetryAction.RETRY
    assert "pod condition DisruptionTarget (PreemptionByScheduler)" in decision.reason
    assert "infra: infra:" not in decision.reason and ": infra: " not in decision.reason


def test_user_reason_carries_the_classifier_reason():
    verdict = classify({"error_file": {"message": "ValueError: boom", "rank": 1, "step": 5, "source": "user"}})
    decision = decide(UserFailure(verdict))
    assert decision.reason == "gangflow: user failure, not retrying: ValueError raised in training code at rank 1, step 5: boom"


def test_unknown_is_retried_once_then_treated_as_user():
    exc = UnknownFailure(classify({"exit_code": 1}))
    first = decide(exc, try_number=1)
    assert first.action is RetryAction.RETRY
    assert "unknown failure, retrying once" in first.reason
    second = decide(exc, try_number=2)
    assert second.action is RetryAction.FAIL
    assert "treated as user, not retrying" in second.reason


class _Ti:
    def __init__(self, try_number: int, task_id: str = "train", map_index: int = -1):
        self.dag_id, self.task_id, self.map_index, self.try_number = "dag", task_id, map_index, try_number


def _context(try_number: int, **kwargs) -> dict:
    return {"ti": _Ti(try_number, **kwargs), "run_id": "manual__2026-11-30T21:00:00+00:00"}


def test_unknown_is_retried_once_however_earlier_tries_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    unknown = UnknownFailure(classify({"exit_code": 1}))
    infra = InfraError("node lost")
    assert POLICY.evaluate(infra, try_number=1, max_tries=5, context=_context(1)).action is RetryAction.RETRY
    second = POLICY.evaluate(unknown, try_number=2, max_tries=5, context=_context(2))
    assert second.action is RetryAction.RETRY, second.reason  # the task's first unknown: retried once
    third = POLICY.evaluate(unknown, try_number=3, max_tries=5, context=_context(3))
    assert third.action is RetryAction.FAIL and "treated as user" in third.reason
    # Another task (or mapped instance) of the same run has its own count.
    other = POLICY.evaluate(unknown, try_number=1, max_tries=5, context=_context(1, task_id="train", map_index=1))
    assert other.action is RetryAction.RETRY
    # An infra failure between two unknowns does not reset the count.
    assert POLICY.evaluate(infra, try_number=2, max_tries=5, context=_context(2, map_index=1)).action is RetryAction.RETRY
    assert POLICY.evaluate(unknown, try_number=3, max_tries=5, context=_context(3, map_index=1)).action is RetryAction.FAIL


def test_a_reevaluated_try_is_counted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    unknown = UnknownFailure(classify({"exit_code": 1}))
    for _ in range(2):  # the same try judged twice (a re-run callback) is still the first unknown
        assert POLICY.evaluate(unknown, try_number=1, max_tries=5, context=_context(1)).action is RetryAction.RETRY


@pytest.mark.parametrize("dag_id", [".", ".."])
def test_a_dag_id_that_cannot_name_a_folder_keeps_no_ledger_outside_the_retries_folder(tmp_path, monkeypatch, dag_id):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    ti = _Ti(1)
    ti.dag_id = dag_id
    unknown = UnknownFailure(classify({"exit_code": 1}))
    assert POLICY.evaluate(unknown, try_number=1, max_tries=5, context={"ti": ti, "run_id": "manual__1"}).action is RetryAction.RETRY
    assert not [p for p in tmp_path.rglob("*.json") if not p.resolve().is_relative_to((tmp_path / "retries").resolve())]
    assert not (tmp_path / "retries").exists()


def test_unknown_retries_is_configurable():
    exc = UnknownFailure(classify({}))
    assert decide(exc, 1, policy=ClassifiedRetryPolicy(unknown_retries=0)).action is RetryAction.FAIL
    assert decide(exc, 2, policy=ClassifiedRetryPolicy(unknown_retries=2)).action is RetryAction.RETRY
    assert decide(exc, 3, policy=ClassifiedRetryPolicy(unknown_retries=2)).action is RetryAction.FAIL


def test_no_retries_left_fails_with_a_clear_reason():
    decision = decide(InfraError("x"), try_number=4, max_tries=3)
    assert decision.action is RetryAction.FAIL
    assert "infra failure, but no retries left (try 4 of 4)" in decision.reason


# -- exceptions from elsewhere ----------------------------------------------------------------------


class _FakeBotoClientError(Exception):
    """Shaped like botocore.exceptions.ClientError (botocore is not a gangflow dependency)."""

    def __init__(self, code: str):
        self.response = {"Error": {"Code": code, "Message": "Please reduce your request rate."}}
        super().__init__(f"An error occurred ({code}) when calling the PutObject operation")


_FakeBotoClientError.__name__ = "ClientError"


class _FakeApiException(Exception):
    """Shaped like kubernetes.client.exceptions.ApiException (importing kubernetes costs seconds)."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"({status})")


_FakeApiException.__name__ = "ApiException"
_FakeApiException.__module__ = "kubernetes.client.exceptions"


def _chained() -> Exception:
    try:
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        except ConnectionRefusedError as cause:
            raise RuntimeError("could not log metrics") from cause
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    "exc, expect",
    [
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "infra"),
        (TimeoutError("timed out"), "infra"),
        (OSError(errno.EIO, "Input/output error"), "infra"),
        (OSError(errno.ETIMEDOUT, "Connection timed out"), "infra"),
        (OSError(errno.ESTALE, "Stale file handle"), "infra"),
        (socket.gaierror(-3, "Temporary failure in name resolution"), "infra"),
        (sqlite3.OperationalError("database is locked"), "infra"),
        (urllib.error.HTTPError("http://mlflow:5000", 503, "Service Unavailable", {}, None), "infra"),
        (_FakeBotoClientError("SlowDown"), "infra"),
        (_FakeApiException(503), "infra"),
        (_chained(), "infra"),
        (FileNotFoundError(errno.ENOENT, "No such file"), None),
        (sqlite3.OperationalError("no such table: runs"), None),
        (urllib.error.HTTPError("http://mlflow:5000", 404, "Not Found", {}, None), None),
        (_FakeBotoClientError("AccessDenied"), None),
        (_FakeApiException(422), None),
        (ValueError("a bug"), None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_foreign_exceptions(exc, expect):
    kind, why = judge_exception(exc)
    assert kind == expect, why
    decision = decide(exc)
    assert decision.action is (RetryAction.RETRY if expect == "infra" else RetryAction.DEFAULT)


def test_requests_connection_error_is_infra():
    import requests

    exc = requests.exceptions.ConnectionError("HTTPConnectionPool(host='mlflow', port=5000): Max retries exceeded")
    assert judge_exception(exc)[0] == "infra"


def test_mlflow_exceptions():
    mlflow_exceptions = pytest.importorskip("mlflow.exceptions")
    unavailable = mlflow_exceptions.RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "try later"})
    assert judge_exception(unavailable)[0] == "infra"
    connection = mlflow_exceptions.MlflowException(
        "API request to http://mlflow:5000/api/2.0/mlflow/runs/create failed with exception "
        "HTTPConnectionPool(host='mlflow', port=5000): Max retries exceeded with url"
    )
    assert judge_exception(connection)[0] == "infra"
    missing = mlflow_exceptions.RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no model x"})
    assert judge_exception(missing)[0] is None
    # A client-side MlflowException defaults to INTERNAL_ERROR (500) without any server involved.
    assert judge_exception(mlflow_exceptions.MlflowException("Invalid metric name: 'a b'"))[0] is None


# -- backoff ---------------------------------------------------------------------------------------


def test_exponential_backoff_with_a_cap():
    policy = ClassifiedRetryPolicy(base_delay=timedelta(seconds=10), max_delay=timedelta(minutes=10))
    assert [policy.backoff(n).total_seconds() for n in range(1, 9)] == [10, 20, 40, 80, 160, 320, 600, 600]
    assert policy.backoff(10_000) == timedelta(minutes=10)
    assert decide(InfraError("x"), try_number=3, max_tries=5, policy=policy).retry_delay == timedelta(seconds=40)
    assert ClassifiedRetryPolicy(base_delay=timedelta(0)).backoff(5) == timedelta(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_delay": timedelta(seconds=-1)},
        {"base_delay": timedelta(minutes=20), "max_delay": timedelta(minutes=10)},
        {"base_delay": 10},
        {"unknown_retries": -1},
        {"unknown_retries": True},
    ],
)
def test_constructor_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        ClassifiedRetryPolicy(**kwargs)


# -- logging ---------------------------------------------------------------------------------------


def test_decisions_are_logged(caplog):
    logger = logging.getLogger("gangflow.retry")
    caplog.set_level(logging.INFO, logger="gangflow.retry")
    handler = caplog.handler
    logger.addHandler(handler)  # Airflow's logging setup may stop propagation to the root logger
    try:
        decide(UserError("bad config: train.lr=-1"))
        decide(InfraError("node lost"))
    finally:
        logger.removeHandler(handler)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gangflow.retry"]
    assert (logging.ERROR, "gangflow: user failure, not retrying: UserError: bad config: train.lr=-1") in messages
    assert any(level == logging.WARNING and m.startswith("gangflow: infra failure, retrying") for level, m in messages)


# -- serialization ---------------------------------------------------------------------------------


def test_policy_serialize_round_trip():
    policy = ClassifiedRetryPolicy(base_delay=timedelta(seconds=3), max_delay=timedelta(minutes=2), unknown_retries=2)
    data = json.loads(json.dumps(policy.serialize()))
    assert data["__type"] == "ClassifiedRetryPolicy"
    again = ClassifiedRetryPolicy.deserialize(data)
    assert again == policy and repr(again) == repr(policy) and hash(again) == hash(policy)
    assert ClassifiedRetryPolicy.deserialize({}) == ClassifiedRetryPolicy()
    with pytest.raises(ValueError):
        ClassifiedRetryPolicy.deserialize({"__type": "ExceptionRetryPolicy"})


def _dag_with_policies(policy: ClassifiedRetryPolicy):
    from airflow.providers.standard.operators.python import PythonOperator
    from airflow.sdk import DAG, task

    with DAG(
        "gangflow_policy_serialization",
        schedule=None,
        start_date=datetime(2025, 1, 1),
        default_args={"retries": 2, "retry_policy": ClassifiedRetryPolicy()},
    ) as dag:
        PythonOperator(task_id="classic", python_callable=print, retries=3, retry_policy=policy)

        @task(retries=3, retry_policy=policy)
        def mapped(x):
            return x

        @task
        def from_default_args():
            return None

        mapped.partial().expand(x=[1, 2])
        from_default_args()
    return dag


def test_policy_survives_dag_serialization():
    from airflow.serialization.serialized_objects import DagSerialization

    policy = ClassifiedRetryPolicy(base_delay=timedelta(seconds=5))
    dag = _dag_with_policies(policy)
    assert dag.task_dict["classic"].retry_policy is policy

    data = DagSerialization.to_dict(dag)
    DagSerialization.validate_schema(data)
    text = json.dumps(data)
    # Airflow 3.3 stores only a has_retry_policy flag, never the object: deterministic, no repr leaks.
    assert "ClassifiedRetryPolicy" not in text and " object at 0x" not in text
    assert DagSerialization.to_dict(_dag_with_policies(ClassifiedRetryPolicy(base_delay=timedelta(seconds=5)))) == data

    restored = DagSerialization.from_dict(json.loads(text))
    flags = {t.task_id: (t.has_retry_policy, t.retries) for t in restored.tasks}
    assert flags == {"classic": (True, 3), "mapped": (True, 3), "from_default_args": (True, 2)}


def _gang_failure_at(step: int | None, message: str = "NCCL communicator was aborted on rank 1"):
    """An InfraFailure as the training task raises it: the classifier's verdict on evidence whose
    error record (written by the trainer's error handler) names the exception and its step."""
    from operators.exceptions import InfraFailure
    from trainer.errors import error_record

    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        record = error_record(exc, rank=1, step=step)
    evidence = {"exit_code": 1, "rank": 1, "error_file": {"message": record}, "log_tail": ""}
    verdict = classify(evidence)
    assert verdict.kind == "infra", verdict  # the classifier reads it as infrastructure
    return InfraFailure(verdict, evidence=evidence)


def test_an_infra_failure_that_recurs_at_the_same_step_is_treated_as_user(tmp_path, monkeypatch):
    """Recurrence: try 2 resumed from an earlier checkpoint and failed with the same exception at
    the same step as try 1: deterministic, so the rest of the budget is not burnt on it. Before,
    every such try was retried until `retries` ran out."""
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    first = POLICY.evaluate(_gang_failure_at(57), try_number=1, max_tries=5, context=_context(1))
    assert first.action is RetryAction.RETRY
    second = POLICY.evaluate(_gang_failure_at(57), try_number=2, max_tries=5, context=_context(2))
    assert second.action is RetryAction.FAIL, second.reason
    assert "recurred as try 1's did (RuntimeError@step=57)" in second.reason and "treated as user" in second.reason


def test_infra_failures_at_other_steps_or_without_a_step_keep_being_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    for try_number, step in enumerate((57, 112, 131), start=1):  # a flaky fabric strikes wherever the loop is
        decision = POLICY.evaluate(_gang_failure_at(step), try_number=try_number, max_tries=5, context=_context(try_number))
        assert decision.action is RetryAction.RETRY, decision.reason
    counted = {"exit_code": -9, "signal": "SIGKILL", "context": {"oom_kills": 0}}  # the backend saw no OOM kill
    killed = InfraFailure(classify(counted), evidence=counted)
    for try_number in (1, 2):  # no step, no exception: nothing to compare, so no recurrence is claimed
        decision = POLICY.evaluate(killed, try_number=try_number, max_tries=5, context=_context(try_number, task_id="other"))
        assert decision.action is RetryAction.RETRY, decision.reason
    # the same kill with no count (most often the host's OOM killer): retried once, then the user's
    bare = {"exit_code": -9, "signal": "SIGKILL"}
    unexplained = InfraFailure(classify(bare), evidence=bare)
    decisions = [POLICY.evaluate(unexplained, try_number=n, max_tries=5, context=_context(n, task_id="bare")) for n in (1, 2)]
    assert [d.action for d in decisions] == [RetryAction.RETRY, RetryAction.FAIL], [d.reason for d in decisions]
    # without a context there is no record of earlier tries: no recurrence is claimed either
    assert POLICY.evaluate(_gang_failure_at(57), try_number=3, max_tries=5).action is RetryAction.RETRY


def test_the_ledger_of_the_old_format_is_still_read(tmp_path, monkeypatch):
    """Ledgers written before signatures existed ({"1": "unknown"}) keep counting unknowns."""
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    from operators.retry import _ledger

    path = _ledger(_context(2))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"1": "unknown"}))
    decision = POLICY.evaluate(UnknownFailure(classify({"exit_code": 1})), try_number=2, max_tries=5, context=_context(2))
    assert decision.action is RetryAction.FAIL and "treated as user" in decision.reason


def test_an_ambiguous_crash_is_retried_once_and_fails_when_it_recurs(tmp_path, monkeypatch):
    """Issue 28 item 7: a crash a bad node causes too (here SIGILL) is retried once; its second
    occurrence fails as user. A clear user error is never retried."""
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    evidence = {"exit_code": -4, "log_tail": "Using embedded DuckDB with persistence\nIllegal instruction (core dumped)"}
    verdict = classify(evidence)
    assert (verdict.kind, verdict.retryable) == ("user", True), verdict.reason
    first = POLICY.evaluate(UserFailure(verdict, evidence=evidence), try_number=1, max_tries=5, context=_context(1))
    assert first.action is RetryAction.RETRY and "ambiguous crash" in first.reason, first.reason
    second = POLICY.evaluate(UserFailure(verdict, evidence=evidence), try_number=2, max_tries=5, context=_context(2))
    assert second.action is RetryAction.FAIL and "treated as user" in second.reason, second.reason
    # a collective timeout no rank explains (one rank's extra work as often as a hung network): the same
    timeout = {"exit_code": -6, "log_tail": "[rank1]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
               "OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."}
    waited = classify(timeout)
    assert (waited.kind, waited.retryable, waited.rule) == ("user", True, "collective-timeout"), waited.reason
    tries = [POLICY.evaluate(UserFailure(waited, evidence=timeout), try_number=n, max_tries=5, context=_context(n, task_id="wait"))
             for n in (1, 2)]  # fmt: skip
    assert [d.action for d in tries] == [RetryAction.RETRY, RetryAction.FAIL], [d.reason for d in tries]
    clear = classify({"exit_code": 137, "termination_reason": "OOMKilled"})
    decision = POLICY.evaluate(UserFailure(clear), try_number=1, max_tries=5, context=_context(1, task_id="other"))
    assert decision.action is RetryAction.FAIL and decision.reason.startswith("gangflow: user failure, not retrying")


# -- an import error of user or configuration code -------------------------------------------------


def _import_error_from(module: str) -> ImportError:
    try:
        __import__(module)
    except ImportError as exc:
        return exc
    raise AssertionError(f"{module} imported")


@pytest.mark.parametrize("exc", [
    _import_error_from("mypkg.slurmm"),  # a typo in a pipeline file's class path (ModuleNotFoundError)
    ImportError("cannot import name 'SlurmBackend' from 'mypkg.slurm'"),
])  # fmt: skip
def test_an_import_error_fails_at_once_as_user_not_by_airflows_default_retries(exc):
    kind, why = judge_exception(exc)
    assert kind == "user" and type(exc).__name__ in why
    decision = decide(exc)
    assert decision.action is RetryAction.FAIL and "user failure" in decision.reason


def test_an_import_error_raised_while_handling_a_transient_one_is_still_user():
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        except ConnectionResetError:
            __import__("mypkg.nowhere")
    except ImportError as exc:
        assert judge_exception(exc)[0] == "user"
