"""Judgement with context (issue 28, item 7): real corpus cases plus what the platform knows.

The evidence of each scenario is a public case of the corpus, as harvested; the `context` beside
it is what the operator would gather (MLflow history of the same code+config+data, the progress
since the last resume, other gangs' failures on the node, the retry ledger's recurrence).
"""

from __future__ import annotations

import pytest

from operators.failures import classify
from operators.failures.cases import load_cases, load_split
from operators.failures.context import Context

CASES = {c.id: c for c in load_cases(load_split().files("train"))}


def case(case_id: str, **extra) -> dict:
    return {**CASES[case_id].evidence, **extra}


SEGFAULT_USER = "ZQPei__deep_sort_pytorch-69"  # segfault, the thread found a user-side cause
SEGFAULT_INFRA = "jladcr__Moses-for-Mere-Mortals-4"  # segfault, the thread found the machine's
ILLEGAL_INSTRUCTION = "zylon-ai__private-gpt-326"  # SIGILL: the CPU lacks AVX2 (user by the thread)
ILLEGAL_ACCESS_INFRA = "pytorch__examples-548"  # CUDA illegal memory access, infra by the thread
DISK_FULL_USER = "bghira__SimpleTuner-2353"  # ENOSPC: the run's own checkpoints filled the disk
DISK_FULL_INFRA = "OpenNeuroOrg__openneuro-117"  # ENOSPC: the machine's disk, not the job's data


def test_the_scenarios_are_real_corpus_cases_with_the_labels_they_test():
    cases = (SEGFAULT_USER, SEGFAULT_INFRA, ILLEGAL_INSTRUCTION, ILLEGAL_ACCESS_INFRA, DISK_FULL_USER, DISK_FULL_INFRA)
    assert [CASES[c].label for c in cases] == ["user", "infra", "user", "infra", "user", "infra"]


def test_a_failure_at_a_step_the_same_configuration_passed_before_leans_infra():
    evidence = case(SEGFAULT_INFRA, step=300, context={"passed_step": 500, "passed_run": "a1b2c3", "history_checked": True})
    verdict = classify(evidence, precedents=False)
    assert (verdict.kind, verdict.retryable) == ("infra", True), verdict.reason
    assert "passed step 500 before (run a1b2c3)" in verdict.reason and verdict.context
    alone = classify(case(SEGFAULT_INFRA), precedents=False)  # the evidence alone: a bare segfault, retried once
    assert (alone.kind, alone.retryable, alone.rule) == ("user", True, "native-crash")
    illegal = classify(case(ILLEGAL_ACCESS_INFRA, step=120, context={"passed_step": 4000}), precedents=False)
    assert illegal.kind == "infra" and "passed step 4000" in illegal.reason


def test_a_failure_before_any_progress_on_a_fresh_configuration_leans_user():
    fresh = {"history_checked": True, "passed_step": None, "steps_since_resume": 0}
    verdict = classify(case(SEGFAULT_USER, context=fresh), precedents=False)
    assert (verdict.kind, verdict.retryable) == ("user", False), verdict.reason
    assert "before any progress on a configuration that never ran before" in verdict.reason
    sigill = classify(case(ILLEGAL_INSTRUCTION, context=fresh), precedents=False)
    assert (sigill.kind, sigill.retryable) == ("user", False)
    # Progress made: not "before any progress", the crash stays open (retried once).
    moved = classify(case(SEGFAULT_USER, context={**fresh, "steps_since_resume": 40}, step=40), precedents=False)
    assert moved.kind == "user" and moved.retryable


def test_an_ambiguous_crash_without_context_is_retried_once_a_clear_user_error_never():
    sigill = classify(case(ILLEGAL_INSTRUCTION), precedents=False)
    assert (sigill.kind, sigill.retryable, sigill.rule) == ("user", True, "environment-mismatch")
    assert "ambiguous crash" in sigill.reason and "Illegal instruction" in sigill.context[0]
    clear = classify({"exit_code": 137, "termination_reason": "OOMKilled"})
    assert (clear.kind, clear.retryable, clear.context) == ("user", False, ())
    module = classify({"exit_code": 1, "log_tail": "ModuleNotFoundError: No module named 'flash_attn'"}, precedents=False)
    assert (module.kind, module.retryable) == ("user", False)  # environment-mismatch, but not a crash


def test_a_full_disk_is_retried_once_and_its_recurrence_is_not():
    # The base's ENOSPC cases: the job's own output 10 times in 15, a disk others filled 5 times.
    for case_id in (DISK_FULL_USER, DISK_FULL_INFRA):
        verdict = classify(case(case_id), precedents=False)
        assert (verdict.kind, verdict.retryable, verdict.rule) == ("user", True, "disk-full"), verdict.reason
        assert "ambiguous crash" in verdict.reason and any(w in verdict.context[0] for w in ("No space left", "Errno 28"))
    again = classify(case(DISK_FULL_USER, context={"recurrences": 1}), precedents=False)
    assert (again.kind, again.retryable) == ("user", False) and "recurred" in again.reason


def test_a_nextflow_task_its_executor_killed_is_an_unexplained_kill_retried_once():
    # Nextflow found no exit status: the scheduler killed the task (memory, preemption, a node lost).
    log = ("ERROR ~ Error executing process > 'ALIGN (sample_7)'\n\nCaused by:\n  Process `ALIGN (sample_7)` terminated for an "
           "unknown reason\n  -- Likely it has been terminated by the external system\n")  # fmt: skip
    verdict = classify({"log_tail": log}, precedents=False)
    assert (verdict.kind, verdict.retryable, verdict.rule) == ("user", True, "killed-from-outside"), verdict.reason
    again = classify({"log_tail": log, "context": {"recurrences": 1}}, precedents=False)
    assert (again.kind, again.retryable) == ("user", False)
    counted = classify({"log_tail": log, "context": {"oom_kills": 0}}, precedents=False)
    assert (counted.kind, counted.retryable) == ("infra", True)


def test_glibc_heap_corruption_is_a_native_crash_retried_once():
    # memory corrupted in compiled code, as a segfault is: a bug, or the node's memory or GPU
    for log in ("RuntimeError: Engine core initialization failed.\ndouble free or corruption (!prev)\nAborted (core dumped)",
                "free(): invalid pointer\nFatal Python error: Aborted", "malloc(): corrupted top size"):
        verdict = classify({"log_tail": log}, precedents=False)
        assert (verdict.kind, verdict.retryable, verdict.rule) == ("user", True, "native-crash"), verdict.reason
        assert "ambiguous crash" in verdict.reason
        again = classify({"log_tail": log, "context": {"recurrences": 1}}, precedents=False)
        assert (again.kind, again.retryable) == ("user", False)


def test_a_clear_user_error_stays_user_whatever_the_history():
    log = ('Traceback (most recent call last):\n  File "/app/train.py", line 7, in main\n    raise ValueError(msg)\n'
           "ValueError: label 11 out of range\n")  # fmt: skip
    verdict = classify({"exit_code": 1, "step": 3, "log_tail": log, "context": {"passed_step": 900}}, precedents=False)
    assert (verdict.kind, verdict.retryable) == ("user", False), verdict.reason


def test_a_node_with_recent_failures_is_excluded_and_cited():
    evidence = case(SEGFAULT_INFRA, context={"node": "gpu-node-07", "node_failures": 2})
    verdict = classify(evidence, precedents=False)
    assert verdict.kind == "infra" and verdict.exclude_nodes == ("gpu-node-07",)
    assert "2 other gang failure(s) on node gpu-node-07" in verdict.reason
    assert verdict.to_dict()["exclude_nodes"] == ["gpu-node-07"] and verdict.to_dict()["context"]
    counted = {"node": "gpu-node-07", "node_failures": 1, "oom_kills": 0}  # a kill from outside: infra, the node cited
    killed = classify({"exit_code": -9, "signal": 9, "context": counted})
    assert killed.kind == "infra" and killed.exclude_nodes == ("gpu-node-07",) and "context:" in killed.reason
    unexplained = classify({"exit_code": -9, "signal": 9, "context": {"node": "gpu-node-07", "node_failures": 1}})
    assert unexplained.kind == "infra" and unexplained.exclude_nodes == ("gpu-node-07",) and "suspect" in unexplained.reason


def test_a_recurring_crash_is_user_whatever_else_is_known():
    ctx = {"recurrences": 1, "passed_step": 500, "node": "n1", "node_failures": 3}
    verdict = classify(case(SEGFAULT_USER, step=100, context=ctx), precedents=False)
    assert (verdict.kind, verdict.retryable) == ("user", False) and "recurred" in verdict.reason


@pytest.mark.parametrize("value", [None, [], "x", {"passed_step": "lots", "node_failures": -3, "recurrences": 10**40}])
def test_odd_context_is_ignored(value):
    base = classify(case(SEGFAULT_USER), precedents=False)
    verdict = classify(case(SEGFAULT_USER, context=value), precedents=False)
    assert (verdict.kind, verdict.retryable) == (base.kind, base.retryable)
    assert Context.parse({"passed_step": "lots", "node_failures": -3}) == Context()


def test_a_segfault_the_precedents_call_user_is_still_retried_once():
    """No rule decides a bare segfault; when the nearest public cases lean user the verdict is
    user, but the crash could be the node's: retryable (the retry policy retries it once)."""
    verdict = classify({"exit_code": 139, "log_tail": "Training epoch 3\nSegmentation fault (core dumped)"})
    assert verdict.retryable, verdict.reason
    assert verdict.kind == "unknown" or "ambiguous crash" in verdict.reason, verdict.reason


HOST_OOM = "open-mpi__ompi-2661"  # ranks SIGKILLed (exit 137): each needs 98 GB on 64 GB nodes
SPOT_KILL = "argoproj__argo-workflows-3374"  # exit 137 that was a spot node drained under the pod


def test_a_sigkill_while_the_kernel_oom_killed_is_the_users_memory_and_not_retried():
    assert (CASES[HOST_OOM].label, CASES[SPOT_KILL].label) == ("user", "infra")
    alone = classify(case(HOST_OOM), precedents=False)  # the evidence alone cannot tell: retried once
    assert (alone.kind, alone.retryable, alone.rule) == ("user", True, "killed-from-outside"), alone.reason
    assert "most often the host's OOM killer" in alone.reason and "retried once" in alone.reason
    verdict = classify(case(HOST_OOM, context={"oom_kills": 2, "recurrences": 0}), precedents=False)
    assert (verdict.kind, verdict.retryable, verdict.rule) == ("user", False, "killed-from-outside"), verdict.reason
    assert "OOM killer ended 2 process(es) while the gang ran" in verdict.reason and verdict.context
    # No OOM kill counted: a kill from outside, infra; not counted (None, odd values): the evidence's verdict,
    # an unexplained SIGKILL retried once; a pod status that does not say OOMKilled explains it: infra.
    kept = classify(case(SPOT_KILL, context={"oom_kills": 0}), precedents=False)
    assert (kept.kind, kept.retryable) == ("infra", True), kept.reason
    for context in ({}, {"oom_kills": "many"}, {"oom_kills": -1}):
        guessed = classify(case(SPOT_KILL, context=context), precedents=False)
        assert (guessed.kind, guessed.retryable) == ("user", True), (context, guessed.reason)
    pod = classify({"exit_code": 137, "termination_reason": "Error"})
    assert (pod.kind, pod.retryable, pod.rule) == ("infra", True, "killed-from-outside"), pod.reason
    # A clear user error is the user's with or without the count.
    assert classify({"exit_code": 137, "termination_reason": "OOMKilled", "context": {"oom_kills": 0}}).kind == "user"
