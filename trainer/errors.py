"""Error types and the structured error record every failing rank leaves (torch-free).

The record (`exc_type`, `message`, `rank`, `step`, `traceback`, `source`, `time`) goes to
TorchElastic's error file, `DIR/errors/rank-<R>.json` and the Kubernetes termination message;
`source` says whose fault it is: "user", "config" or null (docs/trainer.md, "Error records").
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

TERMINATION_LOG_ENV = "GANGFLOW_TERMINATION_LOG"
K8S_TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_LIMIT = 4000  # Kubernetes keeps at most 4096 bytes of it

_SOURCE_ATTR = "__gangflow_source__"


class TrainerError(Exception):
    """Base of the trainer's own errors; `source` goes into the error record."""

    source: str | None = None


class ConfigError(TrainerError, ValueError):
    """A rejected option, params file, override or GANGFLOW_FAULT (exit code 2)."""

    source = "config"


class UserError(TrainerError):
    """The user's data or code is wrong; retrying will not help. The rank side's: the rank exits 1
    (`EXIT_USER_ERROR`) with `source: "user"` in its error record, the classifier reads a `user`
    verdict from that, and the training task fails with `operators.exceptions.UserFailure`
    (`operators.exceptions.UserError` is the Airflow side's, raised in a task itself)."""

    source = "user"


class DataError(UserError):
    """The dataset is missing, unreadable, has the wrong schema or the wrong md5."""


class CheckpointError(TrainerError):
    """A checkpoint could not be read or written."""


class _UserCode:
    """`with user_code():` tags exceptions raised inside as coming from user code (`source: "user"`).

    A class rather than a generator-based context manager: it wraps every training step."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and getattr(exc, _SOURCE_ATTR, None) is None and not _is_infrastructure(exc):
            with contextlib.suppress(Exception):
                setattr(exc, _SOURCE_ATTR, "user")
        return False


_USER_CODE = _UserCode()


def user_code() -> _UserCode:
    return _USER_CODE


def _is_infrastructure(exc: BaseException) -> bool:
    """Collective/network/storage failures surface inside backward() but are not the user's fault.

    The failure catalogue decides (type first, message second: a ValueError the user raised
    stays the user's whatever its message says)."""
    from trainer.failure_catalogue import transient_exception

    return transient_exception(exc) is not None


def source_of(exc: BaseException) -> str | None:
    if isinstance(exc, TrainerError):
        return exc.source
    return getattr(exc, _SOURCE_ATTR, None)


def error_record(exc: BaseException, *, rank: int | None, step: int | None, tb: str | None = None) -> dict[str, Any]:
    if tb is None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "source": source_of(exc),
        "rank": rank,
        "step": step,
        "time": round(time.time(), 3),
        "traceback": tb,
    }


def _fit(record: dict[str, Any], limit: int) -> str:
    text = json.dumps(record)
    if len(text.encode()) <= limit:
        return text
    record = dict(record, message=record["message"][:1000])
    overflow = len(json.dumps(record).encode()) - limit
    if overflow > 0:
        tb = record["traceback"]
        record["traceback"] = "...\n" + tb[min(len(tb), overflow + 8) :]
    text = json.dumps(record)
    while len(text.encode()) > limit and record["traceback"]:
        record["traceback"] = record["traceback"][len(record["traceback"]) // 4 :]
        text = json.dumps(record)
    return text


def termination_log_path() -> Path | None:
    """Where Kubernetes reads the termination message from, if this process has one."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if path:
        return Path(path) if Path(path).parent.is_dir() else None
    default = Path(K8S_TERMINATION_LOG)
    return default if default.is_file() else None


def write_termination_log(record: dict[str, Any]) -> None:
    path = termination_log_path()
    if path is None:
        return
    with contextlib.suppress(OSError):
        if path.exists() and path.stat().st_size > 0:
            return  # the first failure is the root cause; keep it
        path.write_text(_fit(record, TERMINATION_LOG_LIMIT))


def write_records(exc: BaseException, *, rank: int | None, step: int | None, run_dir: str | Path | None) -> dict[str, Any]:
    """Write DIR/errors/rank-R.json and the termination log; never raises."""
    record = error_record(exc, rank=rank, step=step)
    if run_dir is not None:
        with contextlib.suppress(Exception):  # a record must never hide the error it records
            from trainer.storage import Storage  # any storage: local dir or fsspec URL

            Storage(run_dir).write_bytes(f"errors/rank-{rank or 0}.json", (json.dumps(record, indent=2) + "\n").encode())
    write_termination_log(record)
    return record


class _Context:
    """What the TorchElastic error handler adds to the error file (set by the loop)."""

    rank: int | None = None
    step: int | None = None


context = _Context()


def _elastic_handler_base():
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler as _Base

    return _Base


def make_error_handler():
    """TorchElastic's ErrorHandler, adding gangflow's fields to `message.extraInfo`."""
    base = _elastic_handler_base()
    from trainer.storage import write_json

    class ErrorHandler(base):  # type: ignore[misc, valid-type]
        def record_exception(self, e: BaseException) -> None:
            file = self._get_error_file_path()
            if not file:
                return
            record = error_record(e, rank=context.rank, step=context.step, tb=traceback.format_exc())
            extra = {"py_callstack": record["traceback"], "timestamp": str(int(time.time()))}
            extra.update({k: record[k] for k in ("exc_type", "source", "rank", "step")})
            data = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": extra}}
            write_json(file, data)

    return ErrorHandler()
