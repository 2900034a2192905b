"""Lines for the task log, each written whole; and, with `GANGFLOW_LOG_FORMAT=json`, every line of
the rank as one JSON object (docs/observability.md, "Logs by job and rank").

torchrun's `--tee` forwards a rank's output as it finds it, partial lines included, and `print()`
writes the text and the newline in two writes when output is unbuffered, so a read between them
splits the line: `say` writes the line and its newline at once.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import TextIO

__all__ = ["say", "log_format", "install_log_format", "JsonLines", "LOG_FORMAT_ENV", "LOG_FORMATS"]

LOG_FORMAT_ENV = "GANGFLOW_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
#: Fields of a JSON line and where a rank finds them (the training operator's spec sets them;
#: locally the run id comes as GANGFLOW_MLFLOW_RUN_ID: the ranks there get no MLflow settings).
_FIELD_ENV = {"gang": ("GANGFLOW_GANG",), "dag_id": ("GANGFLOW_DAG_ID",), "dag_run_id": ("GANGFLOW_DAG_RUN_ID",),
              "pipeline": ("GANGFLOW_PIPELINE",), "mlflow_run_id": ("MLFLOW_RUN_ID", "GANGFLOW_MLFLOW_RUN_ID"),
              "attempt": ("GANGFLOW_TRY_NUMBER",)}


def say(message: str, *, stream: TextIO | None = None) -> None:
    """Write `message` and a newline to `stream` (default stdout) in one write, then flush."""
    out = sys.stdout if stream is None else stream
    out.write(message + "\n")
    out.flush()


def log_format(environ: Mapping[str, str] | None = None) -> str:
    """`GANGFLOW_LOG_FORMAT`: `text` (default, for a person) or `json` (for a log collector)."""
    env = os.environ if environ is None else environ
    value = env.get(LOG_FORMAT_ENV, "").strip() or "text"
    if value not in LOG_FORMATS:
        raise ValueError(f"{LOG_FORMAT_ENV}={value!r}: accepted values are {', '.join(LOG_FORMATS)}")
    return value


def log_fields(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The job and rank fields every JSON line carries (null when unknown)."""
    env = os.environ if environ is None else environ
    fields: dict[str, object] = {}
    for key in ("RANK", "LOCAL_RANK"):
        value = env.get(key) or env.get(f"OMPI_COMM_WORLD_{key}")
        fields[key.lower()] = int(value) if value and value.isdigit() else None
    for field, names in _FIELD_ENV.items():
        fields[field] = next((env[n] for n in names if env.get(n)), None)
    return fields


class JsonLines(io.TextIOBase):
    """A text stream that writes each complete line to `stream` as a JSON object:
    `{"time", "rank", "local_rank", "gang", "dag_id", "dag_run_id", "pipeline", "mlflow_run_id",
    "attempt", "stream", "message"}`. A partial line waits for its newline (or `flush`)."""

    def __init__(self, stream: TextIO, *, name: str, fields: Mapping[str, object]):
        super().__init__()
        self.stream, self.name, self.fields = stream, name, dict(fields)
        self._buffer = ""
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def buffer(self) -> _JsonBytes:
        """Bytes written here (`sys.stdout.buffer.write`) become lines like text."""
        return _JsonBytes(self)

    def reconfigure(self, **options: object) -> None:
        """Accepted and ignored (`line_buffering`, `write_through`, `errors`...): every complete line is
        written at once already; code that reconfigures sys.stdout keeps working."""

    def isatty(self) -> bool:
        return False

    def _emit(self, line: str) -> str:
        record = {"time": round(time.time(), 3), **self.fields, "stream": self.name, "message": line.rstrip("\r")}
        return json.dumps(record, ensure_ascii=False) + "\n"

    def write(self, text: str) -> int:
        with self._lock:
            self._buffer += text
            if "\n" not in self._buffer:
                return len(text)
            *lines, self._buffer = self._buffer.split("\n")
            self.stream.write("".join(self._emit(line) for line in lines))  # whole lines in one write
        self.stream.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._buffer:
                self.stream.write(self._emit(self._buffer))
                self._buffer = ""
        self.stream.flush()


class _JsonBytes(io.RawIOBase):
    """`JsonLines.buffer`: bytes decoded (UTF-8, bad bytes replaced) and written as text."""

    def __init__(self, text: JsonLines):
        super().__init__()
        self.text = text

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        data = bytes(data)
        self.text.write(data.decode(self.text.encoding or "utf-8", errors="replace"))
        return len(data)

    def flush(self) -> None:
        self.text.flush()


def install_log_format(environ: Mapping[str, str] | None = None) -> str:
    """With `GANGFLOW_LOG_FORMAT=json`, replace sys.stdout and sys.stderr by `JsonLines` (every line
    this rank prints: the trainer's, user code's, tracebacks). Returns the format; ValueError names
    the variable and the accepted values."""
    fmt = log_format(environ)
    if fmt == "json" and not isinstance(sys.stdout, JsonLines):
        fields = log_fields(environ)
        sys.stdout = JsonLines(sys.stdout, name="stdout", fields=fields)
        sys.stderr = JsonLines(sys.stderr, name="stderr", fields=fields)
    return fmt
