"""`ClassifiedRetryPolicy`: Airflow's retry decision, taken by the failure classifier.

    GangTrainingOperator(..., retries=3, retry_policy=ClassifiedRetryPolicy())

infra retries with exponential backoff, user fails at once, unknown (and an ambiguous crash the
classifier marked retryable) retries once per task, and an infra failure that recurs at the same
step fails as user (docs/failures.md, "The retry policy").
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import RetryDecision, RetryPolicy

from operators.config import settings
from operators.exceptions import GangFailure, GangflowError

if TYPE_CHECKING:
    from airflow.sdk.definitions.context import Context

__all__ = ["ClassifiedRetryPolicy", "evidence_signature", "failure_signature", "judge_exception", "recurrences"]

log = logging.getLogger("gangflow.retry")


def _ledger(context: Any) -> Path | None:
    """This task instance's record of its tries' kinds, or None without an Airflow context."""
    if not context:
        return None
    try:
        ti = context["ti"]
        run_id = context.get("run_id") or getattr(ti, "run_id", None)
    except (KeyError, TypeError, AttributeError):
        return None
    dag_id, task_id = getattr(ti, "dag_id", None), getattr(ti, "task_id", None)
    if not (isinstance(dag_id, str) and isinstance(task_id, str) and isinstance(run_id, str) and dag_id and run_id):
        return None
    try:  # a DAG id such as '..' would put the ledger outside retries/ (pipeline files refuse it)
        folder = settings.dag_id_folder(dag_id)
    except ValueError:
        return None
    map_index = getattr(ti, "map_index", -1)
    name = task_id if map_index in (None, -1) else f"{task_id}.{map_index}"
    # Task ids are Airflow keys ([\w.-]+), safe as file names; the run needs its identity.
    return settings.state_dir() / "retries" / folder / settings.run_key(dag_id, run_id) / f"{name}.json"


def _record_try(context: Any, try_number: int, kind: str, signature: str | None) -> tuple[int, int | None]:
    """Record this try's kind (and failure signature) for its task instance. Returns how many
    earlier tries failed `unknown`, and the earliest earlier try whose failure had the same
    signature (None if none).

    Without a context (a direct call) every earlier try is assumed unknown, none the same: the
    cautious reading for the count, and no recurrence claimed without a record of it.
    """
    path = _ledger(context)
    if path is None:
        return max(try_number - 1, 0), None
    try:
        tries = json.loads(path.read_text())
    except (OSError, ValueError):
        tries = {}
    tries = tries if isinstance(tries, dict) else {}
    earlier = {int(t): v if isinstance(v, dict) else {"kind": v} for t, v in tries.items() if str(t).isdigit() and int(t) < try_number}
    unknowns = sum(1 for v in earlier.values() if v.get("kind") == "unknown")
    same = min((t for t, v in earlier.items() if signature and v.get("signature") == signature), default=None)
    tries[str(try_number)] = {"kind": kind, "signature": signature} if signature else kind
    from trainer.storage import write_json  # not at DAG parse time

    try:
        write_json(path, tries, sort_keys=True)  # atomic: a reader never sees half a ledger
    except OSError as exc:
        log.warning("gangflow: cannot record try %d's failure kind in %s: %s", try_number, path, exc)
    return unknowns, same


def failure_signature(exception: BaseException) -> str | None:
    """`<exception type>@step=<N>` for a gang failure whose evidence names the exception and the
    training step it was raised at, else None. A deterministic failure (a bug the classifier took
    for infrastructure) is raised again at the same step after the retry resumes from an earlier
    checkpoint; a node, network or storage failure almost never lands on the same step twice."""
    if not isinstance(exception, GangFailure) or not exception.evidence:
        return None
    return evidence_signature(exception.evidence)


def evidence_signature(evidence: Any) -> str | None:
    """`failure_signature` of a gang's evidence (contract 4), before it is judged."""
    from operators.failures.evidence import Evidence  # not at DAG parse time

    try:
        ev = Evidence.parse(evidence)
    except Exception:  # noqa: BLE001 - evidence is data: no signature rather than no decision
        return None
    record = ev.record
    step = ev.step if ev.step is not None else (record.step if record is not None else None)
    exc = record.exc if record is not None and record.exc is not None else (ev.tracebacks[-1] if ev.tracebacks else None)
    if step is None or step <= 0 or exc is None or not exc.type:
        return None
    return f"{exc.type}@step={step}"


def recurrences(context: Any, try_number: int, signature: str | None) -> int:
    """How many earlier tries of this task failed with `signature` (the retry ledger's record)."""
    path = _ledger(context)
    if path is None or not signature:
        return 0
    try:
        tries = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(tries, dict):
        return 0
    return sum(1 for t, v in tries.items() if str(t).isdigit() and int(t) < try_number
               and isinstance(v, dict) and v.get("signature") == signature)  # fmt: skip


def _strip_kind(reason: str, kind: str) -> str:
    return reason[len(kind) + 2 :] if reason.startswith(f"{kind}: ") else reason


def judge_exception(exception: BaseException) -> tuple[str | None, str]:
    """(kind, why) for a task's exception: kind is "infra", "user", "unknown" or None (no opinion)."""
    if isinstance(exception, GangFailure):
        verdict = exception.verdict
        return verdict.kind, _strip_kind(verdict.reason, verdict.kind)
    if isinstance(exception, GangflowError):
        kind = getattr(exception, "kind", None)
        if kind not in ("infra", "user", "unknown"):
            kind = "infra" if exception.retryable else "user"
        return kind, f"{type(exception).__name__}: {exception}"
    if isinstance(exception, ImportError):  # user or configuration code that does not import: no retry fixes it
        return "user", f"{type(exception).__name__}: {_short(exception)}"
    from trainer.storage import LinkInPath, NotRegularFile, UnsafePath

    if isinstance(exception, (LinkInPath, NotRegularFile, UnsafePath)):  # a run dir gangflow never follows
        return "user", f"{type(exception).__name__}: {_short(exception)} (fix or remove that path; a retry meets it again)"
    from trainer.failure_catalogue import transient_exception  # not at DAG parse time

    why = transient_exception(exception)
    if why:
        return "infra", f"{why}: {_short(exception)}"
    return None, f"{type(exception).__name__}: {_short(exception)}"


def _short(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fmt_delay(delay: timedelta) -> str:
    seconds = delay.total_seconds()
    if seconds < 120:
        return f"{seconds:g}s"
    return f"{seconds / 60:g}min"


class ClassifiedRetryPolicy(RetryPolicy):
    """Retry infra failures with exponential backoff, fail user failures at once.

    :param base_delay: the delay before the first retry; doubled on each further try.
    :param max_delay: the cap on that delay.
    :param unknown_retries: how many unknown failures of a task are retried (default 1: the
        first is retried, whatever earlier tries failed of; the next is treated as user).
    """

    def __init__(
        self,
        *,
        base_delay: timedelta = timedelta(seconds=10),
        max_delay: timedelta = timedelta(minutes=10),
        unknown_retries: int = 1,
    ) -> None:
        if not isinstance(base_delay, timedelta) or base_delay < timedelta(0):
            raise ValueError(f"base_delay={base_delay!r}: must be a timedelta >= 0")
        if not isinstance(max_delay, timedelta) or max_delay < base_delay:
            raise ValueError(f"max_delay={max_delay!r}: must be a timedelta >= base_delay ({base_delay})")
        if isinstance(unknown_retries, bool) or not isinstance(unknown_retries, int) or unknown_retries < 0:
            raise ValueError(f"unknown_retries={unknown_retries!r}: must be an integer >= 0")
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.unknown_retries = unknown_retries

    # -- the decision -----------------------------------------------------------------------

    def backoff(self, try_number: int) -> timedelta:
        """`min(max_delay, base_delay * 2 ** (try_number - 1))`."""
        exponent = min(max(try_number, 1) - 1, 62)
        seconds = min(self.max_delay.total_seconds(), self.base_delay.total_seconds() * 2**exponent)
        return timedelta(seconds=seconds)

    def evaluate(
        self,
        exception: BaseException,
        try_number: int,
        max_tries: int,
        context: Context | None = None,
    ) -> RetryDecision:
        kind, why = judge_exception(exception)
        if kind is None:
            log.info("gangflow: not a classified failure, Airflow's default retry handling applies: %s", why)
            return RetryDecision.default()
        budget = f" (try {try_number} of {max_tries + 1})" if max_tries > 0 else f" (try {try_number})"
        exhausted = max_tries > 0 and try_number > max_tries
        signature = failure_signature(exception)
        # A user verdict the classifier marked retryable is an ambiguous crash that could be the
        # node's (segfault, illegal instruction, CUDA device error, ENOSPC, /dev/shm): it spends
        # the unknown budget (one retry per task), so a deterministic one fails on its second try.
        ambiguous = kind == "user" and isinstance(exception, GangFailure) and exception.verdict.retryable
        if ambiguous:
            kind = "unknown"
        unknowns_before, same_as = _record_try(context, try_number, kind, signature)
        if kind == "infra" and same_as is not None:
            reason = (f"gangflow: infra failure recurred as try {same_as}'s did ({signature}): a failure that repeats "
                      f"at the same step after a resume is deterministic, treated as user, not retrying: {why}")
            log.error("%s", reason)
            return RetryDecision.fail(reason)
        if kind == "user" or (kind == "unknown" and unknowns_before >= self.unknown_retries):
            if kind == "user":
                reason = f"gangflow: user failure, not retrying: {why}"
            elif ambiguous:
                reason = (f"gangflow: ambiguous crash{budget}, its one retry spent (unknown_retries={self.unknown_retries}): "
                          f"treated as user, not retrying: {why}")
            else:
                reason = (
                    f"gangflow: unknown failure{budget}, unknown_retries={self.unknown_retries} spent, "
                    f"treated as user, not retrying: {why}"
                )
            log.error("%s", reason)
            return RetryDecision.fail(reason)
        if exhausted:
            reason = f"gangflow: {kind} failure, but no retries left{budget}: {why}"
            log.error("%s", reason)
            return RetryDecision.fail(reason)
        delay = self.backoff(try_number)
        if ambiguous:
            reason = (f"gangflow: ambiguous crash (user by its evidence, but a node can cause it too), retrying once in "
                      f"{_fmt_delay(delay)} to see whether it recurs{budget}: {why}")
        elif kind == "unknown":
            reason = f"gangflow: unknown failure, retrying once in {_fmt_delay(delay)} to see whether it recurs{budget}: {why}"  # fmt: skip
        else:
            reason = f"gangflow: infra failure, retrying in {_fmt_delay(delay)}{budget}: {why}"
        log.warning("%s", reason)
        return RetryDecision.retry(delay=delay, reason=reason)

    # -- serialization ----------------------------------------------------------------------

    def serialize(self) -> dict[str, Any]:
        return {
            "__type": "ClassifiedRetryPolicy",
            "__classpath": f"{type(self).__module__}.{type(self).__qualname__}",
            "base_delay": self.base_delay.total_seconds(),
            "max_delay": self.max_delay.total_seconds(),
            "unknown_retries": self.unknown_retries,
        }

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> ClassifiedRetryPolicy:
        if data.get("__type", "ClassifiedRetryPolicy") != "ClassifiedRetryPolicy":
            raise ValueError(f"not a ClassifiedRetryPolicy: __type={data.get('__type')!r}")
        return cls(
            base_delay=timedelta(seconds=float(data.get("base_delay", 10))),
            max_delay=timedelta(seconds=float(data.get("max_delay", 600))),
            unknown_retries=int(data.get("unknown_retries", 1)),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClassifiedRetryPolicy):
            return NotImplemented
        return (self.base_delay, self.max_delay, self.unknown_retries) == (
            other.base_delay,
            other.max_delay,
            other.unknown_retries,
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.base_delay, self.max_delay, self.unknown_retries))

    def __repr__(self) -> str:
        return (
            f"ClassifiedRetryPolicy(base_delay={self.base_delay!r}, max_delay={self.max_delay!r}, "
            f"unknown_retries={self.unknown_retries})"
        )
