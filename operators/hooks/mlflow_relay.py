"""The training task's MLflow relay (`TrackingRelay`): ranks of a local gang never import MLflow.

The task tails `<run_dir>/metrics.jsonl` while the gang trains, logs what it finds to the DAG run's
MLflow run (`trainer.tracking.mlflow_items`), then logs `final/` (as the model `log_final` logs, once). It never hangs or stops the task;
only a run that cannot be opened or final weights that cannot be logged (`RelayFinalUploadError`) fail it.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from operators.exceptions import InfraError, RegistryUnavailable, UserError
from trainer.tracking import FINAL_ARTIFACT_PATH, METRICS, FinalUploadError, log_records  # light: no torch
from trainer.storage import NotRegularFile, UnsafePath, check_regular_tree, regular_fd
from trainer.urls import redact_url

OpenRun = Callable[[], tuple[Any, str]]  # -> (MlflowClient, run id)
# The relay's thread runs this much nicer than the task (Linux: per thread): opening the run (mlflow import,
# store init: seconds of CPU) then takes idle CPU first instead of slowing the gang's start-up,
# which on a machine with a core per rank has none to spare (benchmarks/README.md, pipeline.py).
RELAY_NICE = 10


class RelayFinalUploadError(InfraError, FinalUploadError):
    """The trainer's `FinalUploadError` when the task logs `final/`: an `InfraError`, so the retry
    policy retries it (the retry resumes from the last checkpoint and logs the weights again)."""


def _regular_size(path: Path) -> int:
    """The size of `path` when it is a regular file (not through a link), else 0."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


class TrackingRelay:
    """Tail `run_dir/metrics.jsonl` from where it ends now into the MLflow run `open_run` returns.

    :param open_run: called once, in the relay's thread: returns (client, run id).
    :param flush_every_s: how often new lines are sent while the gang runs.
    :param log: where the one warning and the final-weights line go (the task log).
    :param log_final: `(client, run id, final dir) -> model id`: logs `final/` as the run's one MLflow
        LoggedModel (the training task passes `operators.registry.versions.log_final_model`); without
        it `final/` is logged as run artifacts under `final`.
    :param observers: called with each batch of records read, before MLflow gets them (the
        Prometheus exporter, `operators.hooks.prometheus`); their errors are logged once, never raised.
    """

    def __init__(self, run_dir: str | Path, *, open_run: OpenRun, flush_every_s: float = 2.0,
                 log: Callable[[str], None] = print, join_timeout_s: float = 120.0,
                 on_fatal: Callable[[BaseException], None] | None = None, max_backoff_s: float = 30.0,
                 log_final: Callable[[Any, str, Path], str] | None = None,
                 observers: tuple[Callable[[list[dict]], None], ...] = ()):
        self.path = Path(run_dir) / METRICS
        self.log_final = log_final
        self.model_uri: str | None = None  # where finish() logged the final weights
        self.open_run = open_run
        self.flush_every_s = flush_every_s
        self.join_timeout_s = join_timeout_s
        self.log = log
        self.on_fatal = on_fatal
        self.max_backoff_s = max_backoff_s
        self.observers = tuple(observers)
        self.fatal: BaseException | None = None  # an error opening the run that retrying cannot heal
        # Lines of earlier tries are not sent again: the relay starts at the file's current end.
        self.offset = _regular_size(self.path)
        self.client: Any = None
        self.run_id: str | None = None
        self.error: BaseException | None = None
        self.sent = 0  # lines relayed
        self._warned = False
        self._not_regular_said = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one pump at a time (thread or finish)
        self._thread = threading.Thread(target=self._main, name="gangflow-relay", daemon=True)

    def start(self) -> TrackingRelay:
        self._thread.start()
        return self

    def _main(self) -> None:
        if sys.platform.startswith("linux"):
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + RELAY_NICE))
            except OSError:  # not permitted here: run at the task's priority
                pass
        if not self._open():
            return
        while not self._stop.wait(self.flush_every_s):
            self.pump()

    def _open(self) -> bool:
        """Open the run: retry while MLflow is unreachable, give up at once on anything else."""
        delay = min(1.0, self.max_backoff_s)
        while True:
            try:
                self.client, self.run_id = self.open_run()
            except InfraError as exc:  # unreachable: it may come back before the gang ends
                if self.error is None:
                    self.log(f"gangflow: MLflow run could not be opened ({type(exc).__name__}: {exc}); the gang "
                             "trains on and the relay retries (this try fails at its end if MLflow stays down)")
                self.error = exc
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, self.max_backoff_s)
                continue
            except BaseException as exc:  # noqa: BLE001 - cannot heal: the task stops the gang and reports it
                self.error = self.fatal = exc
                self.log(f"gangflow: MLflow run could not be opened ({type(exc).__name__}: {exc}); retrying "
                         "cannot help, stopping the gang")
                if self.on_fatal is not None:
                    self.on_fatal(exc)
                return False
            if self.error is not None:
                self.log(f"gangflow: MLflow run {self.run_id} opened after all; relaying")
                self.error = None
            return True

    def pump(self) -> int:
        """Send the complete lines appended since the last pump; returns how many were read."""
        if self.run_id is None:
            return 0
        with self._lock:
            try:
                with regular_fd(self.path) as (fd, _size), os.fdopen(os.dup(fd), "rb") as fh:
                    fh.seek(self.offset)
                    chunk = fh.read()
            except FileNotFoundError:
                return 0
            except NotRegularFile:  # a link or a FIFO planted in the run dir is never followed
                if not self._not_regular_said:
                    self._not_regular_said = True
                    self.log(f"gangflow: warning: {self.path} is not a regular file (a link, a FIFO?); nothing relayed")
                return 0
            end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next pump
            if end == 0:
                return 0
            self.offset += end
            lines = chunk[:end].decode(errors="replace").splitlines()
            self._send(lines)
            self.sent += len(lines)
            return len(lines)

    def _send(self, lines: list[str]) -> None:
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn line after a crash: skip it, as a reader of the file would
            if isinstance(record, dict):
                records.append(record)
        if not records:
            return
        for observe in self.observers:
            try:
                observe(records)
            except Exception as exc:  # noqa: BLE001 - an observer must never fail the task
                if not self._warned:
                    self._warned = True
                    self.log(f"gangflow: warning: {observe!r} failed on metrics records ({type(exc).__name__}: {exc})")
        try:
            log_records(self.client, self.run_id, records)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail the task
            if not self._warned:
                self._warned = True
                self.log(f"gangflow: warning: relaying metrics to MLflow run {self.run_id} failed "
                         f"({type(exc).__name__}: {exc}); continuing")

    def stop(self, timeout_s: float = 0.0) -> bool:
        """Stop the thread (at its next wake; `on_kill` does not wait). True once it has ended."""
        self._stop.set()
        if self._thread.is_alive() and timeout_s > 0:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def finish(self, *, succeeded: bool, final_dir: str | Path | None = None) -> str | None:
        """After the gang: flush what metrics.jsonl has; when it `succeeded`, log `final_dir` (with
        `log_final`, else as artifacts under `final`; the URI in `model_uri`). Returns the run id (None when the run never opened and the gang
        failed: the gang's own failure is what the task reports)."""
        started = time.monotonic()
        if not self.stop(self.join_timeout_s):
            if not succeeded:
                return None
            raise RegistryUnavailable(f"MLflow did not answer within {self.join_timeout_s:.0f}s while the relay "
                                      f"opened or logged to the run (after {time.monotonic() - started:.0f}s)")
        if self.run_id is None:
            if self.fatal is not None:
                raise self.fatal  # the request's own error: the gang was stopped for it
            if not succeeded:
                return None  # the gang's own failure is what the task reports
            try:  # MLflow may be back by now: one last try before failing a finished gang
                self.client, self.run_id = self.open_run()
            except BaseException as exc:  # noqa: BLE001 - as before the relay: RegistryUnavailable (retried)
                raise exc from self.error
            self.log(f"gangflow: MLflow run {self.run_id} opened after the gang ended; relaying")
        self.pump()
        if succeeded and final_dir is not None:
            from operators.hooks.mlflow import client_uri

            if Path(final_dir).is_dir():
                try:  # a run dir is data: its links are never followed (here: never uploaded through)
                    check_regular_tree(final_dir, "final weights")
                except UnsafePath as exc:
                    raise UserError(str(exc)) from None

            try:
                if not any(Path(final_dir).glob("*")):
                    raise FileNotFoundError(f"{final_dir} is missing or empty")
                if self.log_final is not None:
                    self.model_uri = f"models:/{self.log_final(self.client, self.run_id, Path(final_dir))}"
                else:
                    self.client.log_artifacts(self.run_id, str(final_dir), artifact_path=FINAL_ARTIFACT_PATH)
                    self.model_uri = f"runs:/{self.run_id}/{FINAL_ARTIFACT_PATH}"
            except UserError:
                raise  # the model itself is wrong (a file missing): retrying cannot help
            except Exception as exc:  # noqa: BLE001 - reported with what failed
                raise RelayFinalUploadError(f"logging the final weights ({final_dir}) to MLflow run {self.run_id} at "
                                            f"{redact_url(client_uri(self.client))} failed ({type(exc).__name__}: {exc})") from exc
            self.log(f"gangflow: final weights logged to MLflow as {self.model_uri}")
        return self.run_id
