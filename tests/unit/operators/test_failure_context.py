"""The failure context the training operator gathers (issue 28, item 7): MLflow history of the
same code+config+data, the node ledger, progress since resume; a real MLflow SQLite store."""

from __future__ import annotations

import pytest
from mlflow_store import client, home  # noqa: F401

from operators import failure_context as fc
from operators.failures import classify


def test_training_identity_changes_with_config_overrides_data_and_code():
    base = dict(config_bytes=b"train: {lr: 0.1}\n", overrides=["train.steps=10"], dataset_version="v1", code="0.1.0")
    same = fc.training_identity(**{**base, "overrides": ["train.steps=10"]})
    assert fc.training_identity(**base) == same
    for change in ({"config_bytes": b"train: {lr: 0.2}\n"}, {"overrides": ["train.steps=11"]},
                   {"dataset_version": "v2"}, {"code": "0.2.0"}):  # fmt: skip
        assert fc.training_identity(**{**base, **change}) != same


def test_passed_step_reads_earlier_runs_of_the_same_identity(client):  # noqa: F811
    from operators.hooks import mlflow as tracking

    exp = tracking.ensure_experiment(client, "failure-context")
    runs = {}
    for name, identity, reached in (("old", "aaa", "480"), ("older", "aaa", "120"), ("other", "bbb", "9000"), ("now", "aaa", None)):
        tags = {fc.IDENTITY_TAG: identity, **({fc.REACHED_STEP_TAG: reached} if reached else {})}
        runs[name] = client.create_run(exp, run_name=name, tags=tags).info.run_id
    assert fc.passed_step(client, exp, "aaa", exclude_run=runs["now"]) == (480, runs["old"])
    assert fc.passed_step(client, exp, "ccc") == (None, "")


def test_the_node_ledger_counts_other_gangs_in_the_last_hour(home):  # noqa: F811
    now = 1_800_000_000.0
    fc.record_node_failure("gpu-node-07", gang="a", kind="unknown", now=now - 4000)  # too old
    fc.record_node_failure("gpu-node-07", gang="b", kind="infra", now=now - 600)
    fc.record_node_failure("gpu-node-07", gang="c", kind="user", now=now - 60)
    assert fc.node_failures("gpu-node-07", gang="c", now=now) == 1  # b: c's own failure does not count
    assert fc.node_failures("gpu-node-08", gang="c", now=now) == 0
    fc.record_node_failure("../../etc", gang="x", kind="user", now=now)  # not a node name: no file
    assert not (home / "etc").exists() and fc.node_failures("../../etc", gang="y", now=now) == 0


def test_gather_then_classify_cites_the_context(home):  # noqa: F811
    now = 1_900_000_000.0
    fc.record_node_failure("gpu-node-09", gang="other-gang", kind="unknown", now=now - 100)
    evidence = {"exit_code": -11, "step": 310, "log_tail": "Segmentation fault (core dumped)"}
    context = fc.gather(evidence, gang="mine", node="gpu-node-09", resumed_from_step=300, history=(500, "r1"), now=now)
    assert context == {"recurrences": 0, "history_checked": True, "passed_step": 500, "passed_run": "r1",
                       "steps_since_resume": 10, "node": "gpu-node-09", "node_failures": 1}  # fmt: skip
    verdict = classify({**evidence, "context": context})
    assert verdict.kind == "infra" and verdict.exclude_nodes == ("gpu-node-09",), verdict.reason
    crash = {"exit_code": -11, "step": 0, "log_tail": "Segmentation fault (core dumped)"}
    fresh = fc.gather(crash, gang="g", history=(None, ""))
    assert fresh["steps_since_resume"] == 0
    verdict = classify({**crash, "context": fresh}, precedents=False)
    assert (verdict.kind, verdict.retryable) == ("user", False), verdict.reason
    unknown_progress = fc.gather({**crash, "step": None}, gang="g", history=(None, ""))
    open_crash = classify({**crash, "step": None, "context": unknown_progress}, precedents=False)
    assert (open_crash.kind, open_crash.retryable) == ("user", True)  # progress unknown: retried once


@pytest.mark.parametrize("evidence, step", [({}, None), ({"step": 5}, 5), ({"ranks": [{"step": 3}, {"step": 9}, {"step": True}]}, 9)])
def test_failed_step(evidence, step):
    assert fc.failed_step(evidence) == step
