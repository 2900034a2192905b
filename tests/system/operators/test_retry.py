"""ClassifiedRetryPolicy end to end: `dag.test()` of a DAG whose tasks fail by kind, in a migrated,
isolated Airflow (tests/unit/operators/test_retry.py has the policy's unit tests)."""

from __future__ import annotations

import pytest
from airflow_env import migrated_airflow  # noqa: F401 - the session fixture, visible to this module


RETRY_DAG = '''
from datetime import timedelta

from airflow.sdk import DAG, get_current_context, task

from operators.exceptions import InfraError, UnknownFailure, UserError
from operators.failures import classify
from operators.retry import ClassifiedRetryPolicy

POLICY = ClassifiedRetryPolicy(base_delay=timedelta(0))

with DAG("gangflow_retry_policy_e2e", schedule=None, catchup=False):

    @task(retries=3, retry_delay=timedelta(0), retry_policy=POLICY)
    def user_error():
        raise UserError("bad config: train.lr=-1")

    @task(retries=3, retry_delay=timedelta(0), retry_policy=POLICY)
    def infra_then_ok():
        if get_current_context()["ti"].try_number == 1:
            raise InfraError("object store unreachable")
        return "ok"

    @task(retries=3, retry_delay=timedelta(0), retry_policy=POLICY)
    def unknown_every_time():
        raise UnknownFailure(classify({"exit_code": 1}))

    @task(retries=3, retry_delay=timedelta(0), retry_policy=POLICY)
    def infra_then_unknown():
        if get_current_context()["ti"].try_number == 1:
            raise InfraError("node lost")
        raise UnknownFailure(classify({"exit_code": 1}))

    user_error()
    infra_then_ok()
    unknown_every_time()
    infra_then_unknown()
'''


@pytest.mark.slow
def test_dag_test_honours_the_policy(migrated_airflow):
    dag_file = migrated_airflow.write_dag("gangflow_retry_policy_e2e.py", RETRY_DAG)
    result = migrated_airflow.dag_test(dag_file, "gangflow_retry_policy_e2e")
    tail = result.output[-3000:]
    assert result.tasks, tail
    user, infra, unknown = (result.tasks[t] for t in ("user_error", "infra_then_ok", "unknown_every_time"))
    assert (user.state, user.try_number) == ("failed", 1), tail  # retries=3, but a user error fails at once
    assert (infra.state, infra.try_number) == ("success", 2), tail  # retried once, then succeeded
    assert (unknown.state, unknown.try_number) == ("failed", 2), tail  # retried once, then treated as user
    late = result.tasks["infra_then_unknown"]
    assert (late.state, late.try_number) == ("failed", 3), tail  # infra retried, then its unknown once
    assert "gangflow: user failure, not retrying: UserError: bad config: train.lr=-1" in result.output
    assert "gangflow: infra failure, retrying in 0s (try 1 of 4): InfraError: object store unreachable" in result.output
    assert "treated as user, not retrying" in result.output
