"""What the platform knows beside one failure's evidence (contract 4's `context` key), and how the
classifier weighs it: the same code+config+data passed this step before, the progress made since
the last resume, other gangs' failures on the same node, the same failure recurring, the kernel's
OOM kills while the gang ran.

The operator gathers it (MLflow history, the node ledger, the retry ledger) and passes it in as
data; this module only reads it. Each verdict it changes cites the facts it used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from operators.failures.evidence import Evidence, integer, text
from operators.failures.rules import DISK_FULL, KILLED_FROM_OUTSIDE, NATIVE_CRASH
from operators.failures.verdict import Verdict, clip

__all__ = ["AMBIGUOUS_NOTE", "AMBIGUOUS_RULES", "Context", "ambiguous_crash", "weigh"]

# Rules whose user verdict names a crash that bad hardware or a node's state causes as well:
# an illegal instruction or a driver/library mismatch (environment-mismatch), a CUDA illegal
# memory access, a /dev/shm too small for the DataLoader on a managed platform, a full disk, a
# bare segfault.
AMBIGUOUS_RULES = frozenset({"environment-mismatch", "illegal-memory-access", "shm-too-small", "disk-full", "native-crash"})
# Of those, the ones that are ambiguous by the rule alone, when its quoted line does not show the crash's words.
_CRASH_ONLY_RULES = frozenset({"illegal-memory-access", "shm-too-small", "disk-full"})
# The same crashes as printed, for verdicts no rule (or only a generic exception rule) gave.
_AMBIGUOUS = re.compile(
    "|".join((
        NATIVE_CRASH.pattern, r"signal 11\b", r"exitcode: -11\b",
        r"Illegal instruction", r"\bSIGILL\b", r"exitcode: -4\b",
        r"Bus error", r"\bSIGBUS\b",
        r"CUDA error: (?:an illegal memory access|unspecified launch failure|misaligned address|an illegal instruction"
        r"|uncorrectable ECC|the launch timed out|unknown error|initialization error)",
        r"CUDA driver version is insufficient", r"Driver/library version mismatch", r"Failed to initialize NVML",
        DISK_FULL.pattern, r"/dev/shm",
    )),
    re.IGNORECASE,
)
AMBIGUOUS_NOTE = "ambiguous crash that could be the node's"
# A SIGKILL that neither the pod status nor an OOM count explains: on the corpus's train split and
# two hold-outs it was the host's OOM killer 11 times in 12 (docs/design/classifier-evaluation.md).
_UNEXPLAINED_SIGKILL = "a SIGKILL the platform did not explain"
# A collective timeout with no rank's cause in view: on the spent splits the program's 12 times in
# 12 (one rank's extra work, unequal batches), but a hung network looks the same.
_UNEXPLAINED_TIMEOUT = "a collective timeout with no rank's cause in view"
_SEGFAULT_SIGNALS = {4, 7, 11}  # SIGILL, SIGBUS, SIGSEGV: a crash that a bad node causes too
_GENERIC_RULES = frozenset({"user-exception", "user-exception-line", "program-error", "bad-data"})


@dataclass(frozen=True)
class Context:
    """Contract 4's `context`: all keys optional, ill-typed values ignored."""

    passed_step: int | None = None  # the highest step an earlier run of the same code+config+data reached
    passed_run: str = ""  # that run (an MLflow run id)
    history_checked: bool = False  # the history was looked up (passed_step None then means: a fresh configuration)
    steps_since_resume: int | None = None  # steps this try made before failing
    node: str = ""
    node_failures: int = 0  # other gangs' failures on `node` in the last hour
    recurrences: int = 0  # earlier tries of this task that failed with the same signature
    oom_kills: int | None = None  # the kernel's OOM kills while the gang ran; None: not counted

    @classmethod
    def parse(cls, value: Any) -> Context | None:
        if not isinstance(value, Mapping) or not value:
            return None
        passed = integer(value.get("passed_step"))
        return cls(
            passed_step=passed if passed is not None and passed >= 0 else None,
            passed_run=text(value.get("passed_run"), 64).strip(),
            history_checked=value.get("history_checked") is True,
            steps_since_resume=_count(value.get("steps_since_resume")),
            node=text(value.get("node"), 253).strip(),
            node_failures=_count(value.get("node_failures")) or 0,
            recurrences=_count(value.get("recurrences")) or 0,
            oom_kills=_count(value.get("oom_kills")),
        )


def _count(value: Any) -> int | None:
    number = integer(value)
    return number if number is not None and number >= 0 else None


def ambiguous_crash(verdict: Verdict, facts: Evidence) -> str | None:
    """The words of a crash that could be the node's (segfault, illegal instruction, CUDA device
    error, driver/library mismatch, ENOSPC, /dev/shm), when the verdict rests on nothing clearer."""
    if verdict.kind == "infra":
        return None
    if verdict.rule == "killed-from-outside":
        return _UNEXPLAINED_SIGKILL
    if verdict.rule == "collective-timeout":
        return _UNEXPLAINED_TIMEOUT
    if verdict.rule in AMBIGUOUS_RULES | _GENERIC_RULES and verdict.rule:
        # The decisive line (quoted in the reason) must name the crash: "No module named x" is
        # environment-mismatch too, and a ValueError is a clear user error.
        found = _AMBIGUOUS.search(verdict.reason)
        if found:
            return found.group(0)
        return verdict.rule if verdict.rule in _CRASH_ONLY_RULES else None
    if verdict.kind == "user":
        return None  # a clear user error: OOM, bad config, an import error, a refused request...
    for rank in (facts, *facts.ranks):  # no rule decided: what did the ranks print?
        for piece in rank.log_texts:
            found = _AMBIGUOUS.search(piece)
            if found:
                return found.group(0)
    signals = {facts.signal, facts.launcher_signal, *(r.signal for r in facts.ranks), *(r.launcher_signal for r in facts.ranks)}
    crashed = sorted(s for s in signals if s in _SEGFAULT_SIGNALS)
    return {4: "SIGILL", 7: "SIGBUS", 11: "SIGSEGV"}[crashed[0]] if crashed else None


def _platform_explained(facts: Evidence) -> bool:
    """The pod status speaks for the kill (a termination or pod reason): no OOMKilled there means none."""
    return any(rank.termination_reason or rank.pod_reason for rank in (facts, *facts.ranks))


def _failed_at(facts: Evidence) -> int | None:
    steps = [s for s in (facts.step, *(r.step for r in facts.ranks)) if s is not None]
    return max(steps) if steps else None


def weigh(verdict: Verdict, facts: Evidence, context: Context | None) -> Verdict:
    """The rule table's verdict, weighed with the platform's context; it cites what it used.

    Without context an ambiguous crash keeps its kind but is retryable (the policy retries it
    once; the recurrence rule stops a deterministic one); a clear user error never is. A SIGKILL
    that neither the pod status nor an OOM count explains is such a crash, kind user; so is a
    collective timeout that no rank's own failure explains."""
    ctx = context or Context()
    if verdict.rule == "killed-from-outside" and ctx.oom_kills:
        # The host's OOM killer sends the same SIGKILL; on Kubernetes the pod says OOMKilled instead.
        return _decide(verdict, "user", False, f"the kernel's OOM killer ended {ctx.oom_kills} process(es) while the "
                       "gang ran: the host ran out of memory")
    if verdict.rule == "killed-from-outside" and ctx.oom_kills is None and not _platform_explained(facts):
        body = _body(verdict).replace(
            KILLED_FROM_OUTSIDE, " with no pod status or OOM count to explain it (most often the host's OOM killer)")
        verdict = replace(verdict, kind="user", reason=clip(f"user: {body}"))
    if verdict.rule == "collective-timeout" and verdict.kind == "unknown":
        verdict = replace(verdict, kind="user", reason=clip(f"user: {_body(verdict)}"))
    words = ambiguous_crash(verdict, facts)
    open_question = words is not None or verdict.kind == "unknown"
    step = _failed_at(facts)
    if open_question and ctx.recurrences > 0:
        return _decide(verdict, "user", False, f"the same failure recurred ({ctx.recurrences} earlier tr"
                       f"{'y' if ctx.recurrences == 1 else 'ies'} of this task): deterministic")
    if open_question and ctx.node_failures > 0 and ctx.node:
        return _decide(verdict, "infra", True, f"{ctx.node_failures} other gang failure(s) on node {ctx.node} in the "
                       "last hour: the node is suspect, excluded on retry where the backend can", exclude=(ctx.node,))
    if open_question and ctx.passed_step is not None and step is not None and 0 < step <= ctx.passed_step:
        run = f" (run {ctx.passed_run})" if ctx.passed_run else ""
        return _decide(verdict, "infra", True, f"the same code+config+data passed step {ctx.passed_step} before{run}")
    if open_question and ctx.history_checked and ctx.passed_step is None and (ctx.steps_since_resume == 0 or step == 0):
        return _decide(verdict, "user", False, "failed before any progress on a configuration that never ran before")
    if words is not None:
        # Kept on an unknown verdict too: a precedent that later calls it user keeps it retryable.
        note = f"ambiguous crash that could be the node's ({words}): retried once, a recurrence fails it"
        return replace(verdict, retryable=True, reason=clip(verdict.reason, f"[{note}]"), context=(note,))
    if verdict.kind == "infra" and ctx.node_failures > 0 and ctx.node:
        note = f"{ctx.node_failures} other gang failure(s) on node {ctx.node} in the last hour"
        return replace(verdict, reason=clip(verdict.reason, f"[context: {note}]"), context=(note,), exclude_nodes=(ctx.node,))
    return verdict


def _body(verdict: Verdict) -> str:
    """The reason without its leading "<kind>: "."""
    return verdict.reason.split(": ", 1)[-1]


def _decide(verdict: Verdict, kind: str, retryable: bool, why: str, exclude: tuple[str, ...] = ()) -> Verdict:
    reason = clip(f"{kind}: by context, {why}; the evidence alone: {verdict.kind}: {_body(verdict)}")
    return Verdict(kind, retryable, reason, rule=verdict.rule, context=(why,), exclude_nodes=exclude)
