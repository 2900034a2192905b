"""`ClassifiedRetryPolicy`: Airflow's retry decision, taken by the failure classifier.

Attach it to any gangflow task; the task's `retries` stays the one retry budget:

    GangTrainingOperator(..., retries=3, retry_policy=ClassifiedRetryPolicy())

On a failure Airflow calls `evaluate` in the worker with the exception itself:

* `GangFailure` (the gang's classified failure) decides by its `Verdict`;
* any other `GangflowError` by its `kind`/`retryable` (`InfraError` retries, `UserError` fails);
* other exceptions: common transient ones (ConnectionError, TimeoutError, OSError with EIO,
  ETIMEDOUT, ECONNRESET..., an MLflow/HTTP 5xx or connection failure, S3 throttling,
  SQLite "database is locked") count as infra; anything else gets Airflow's DEFAULT
  handling (the task's plain `retries`).

infra -> RETRY after `min(max_delay, base_delay * 2 ** (try_number - 1))`;
user -> FAIL now, whatever `retries` says;
unknown -> RETRY while `try_number <= unknown_retries` (by default: only a first-try unknown
failure is retried, once, to see whether it recurs), then FAIL "treated as user".

Every decision is logged on the `gangflow.retry` logger, so the task log says, e.g.,
"gangflow: user failure, not retrying: ValueError raised in training code at rank 1, step 5: ...".

DAG serialization: Airflow 3.3 stores only a `has_retry_policy` flag in the serialized DAG
(the policy object itself is recovered by the worker re-parsing the DAG file), so the policy
never enters the DAG hash. `serialize()`/`deserialize()` still round-trip the policy exactly,
for the RetryPolicy API contract and for anything that stores policies as JSON.
"""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import RetryDecision, RetryPolicy

from operators.exceptions import GangFailure, GangflowError

if TYPE_CHECKING:
    from airflow.sdk.definitions.context import Context

__all__ = ["ClassifiedRetryPolicy", "judge_exception"]

log = logging.getLogger("gangflow.retry")

_TRANSIENT_ERRNOS = {
    errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
    errno.ESTALE, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN,
}  # fmt: skip
_EAI_AGAIN = -3  # socket.gaierror: "Temporary failure in name resolution"
# Exception class names (anywhere in the MRO) of HTTP/storage clients that mean "could not reach it".
_TRANSIENT_CLASS_NAMES = {
    "ConnectionError", "Timeout", "ConnectTimeout", "ReadTimeout", "ReadTimeoutError", "ConnectTimeoutError",
    "NewConnectionError", "MaxRetryError", "ProtocolError", "RemoteDisconnected", "IncompleteRead",
    "EndpointConnectionError", "ConnectionClosedError", "ServerDisconnectedError", "ClientConnectorError",
    "ConnectError", "TimeoutException", "DistNetworkError",
}  # fmt: skip
_TRANSIENT_S3_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "ServiceUnavailable", "InternalError", "RequestLimitExceeded", "500", "502", "503", "504",
}  # fmt: skip
_TRANSIENT_HTTP = {429, 500, 502, 503, 504}
_TRANSIENT_MESSAGE = re.compile(
    r"Max retries exceeded|Connection (?:refused|reset|aborted)|Temporary failure in name resolution"
    r"|Read timed out|timed out|failed with error code (?:429|5\d\d)|\b(?:502|503|504) \w|database is locked"
    r"|TEMPORARILY_UNAVAILABLE|REQUEST_LIMIT_EXCEEDED",
    re.IGNORECASE,
)


def _mro_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _module(exc: BaseException) -> str:
    return type(exc).__module__ or ""


def _http_status(exc: BaseException) -> int | None:
    for attr in ("status_code", "status", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None) if response is not None else None
    return value if isinstance(value, int) else None


def _transient(exc: BaseException) -> str | None:
    """Why `exc` (alone, not its causes) is a transient infrastructure error, or None."""
    names = _mro_names(exc)
    name = type(exc).__name__
    if isinstance(exc, sqlite3.OperationalError) or (name == "OperationalError" and "sqlite" in str(exc).lower()):
        return "SQLite database is locked" if "database is locked" in str(exc) else None
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return f"{name} (a connection or timeout error)"
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _TRANSIENT_ERRNOS:
            return f"{name} errno {errno.errorcode.get(exc.errno, exc.errno)}"
        if exc.errno == _EAI_AGAIN and name == "gaierror":
            return "DNS lookup failed (EAI_AGAIN)"
    if "MlflowException" in names:
        status = getattr(exc, "get_http_status_code", lambda: None)()
        if ("RestException" in names and isinstance(status, int) and status >= 500) or _TRANSIENT_MESSAGE.search(str(exc)):  # fmt: skip
            return f"MLflow server unavailable ({name})"
        return None
    if "ClientError" in names and isinstance(getattr(exc, "response", None), dict):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return f"object storage throttled or unavailable ({code})" if code in _TRANSIENT_S3_CODES else None
    if "ApiException" in names and _module(exc).startswith("kubernetes"):
        status = getattr(exc, "status", None)
        return f"Kubernetes API {status}" if status in _TRANSIENT_HTTP else None
    if names & _TRANSIENT_CLASS_NAMES and not _module(exc).startswith("builtins"):
        return f"{name} (could not reach a remote service)"
    if "HTTPError" in names and _http_status(exc) in _TRANSIENT_HTTP:
        return f"HTTP {_http_status(exc)}"
    return None


def _chain(exc: BaseException, depth: int = 6) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < depth and all(current is not s for s in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


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
    for link in _chain(exception):
        why = _transient(link)
        if why:
            via = "" if link is exception else f" (cause of {type(exception).__name__})"
            return "infra", f"{why}{via}: {_short(link)}"
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
    :param unknown_retries: how many tries an unknown failure may be retried on (default 1:
        only a first-try unknown failure is retried; after that it is treated as user).
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
        if kind == "user" or (kind == "unknown" and try_number > self.unknown_retries):
            if kind == "user":
                reason = f"gangflow: user failure, not retrying: {why}"
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
        if kind == "unknown":
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
