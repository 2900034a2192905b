"""Metrics: `DIR/metrics.jsonl` always; MLflow too when a tracking URI is configured.

Only rank 0 tracks. Every line of metrics.jsonl is one JSON object: training steps
(`step`, `loss`, `lr`, `samples_per_sec`, `epoch`, `time`) and events (`event`: `start`,
`checkpoint` with `duration_s`, `blocked_s` and `bytes`, `preempted`, `final`).

MLflow (`tracking.mlflow_uri` or env MLFLOW_TRACKING_URI) is imported lazily and only then. The
run is env MLFLOW_RUN_ID when set (the Airflow operator creates it; a retry logs into the same
run), else the run recorded in `DIR/tracking.json` by an earlier attempt, else a new run in
`tracking.experiment`. Nothing blocks the loop: metrics are queued and a background thread sends
them with `MlflowClient.log_batch` every `tracking.flush_every_s`. MLflow errors are reported
once on stderr and never stop training, except one: with MLFLOW_RUN_ID set, `log_final` logs
`final/` as the run's artifacts under `final` and a failure there fails the attempt (the
pipeline loads the weights from there). On object storage metrics.jsonl is rewritten at events.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError
from trainer.storage import Storage

_MAX_BATCH = 900  # MLflow accepts 1000 metrics per log_batch
RECORD = "tracking.json"
METRICS = "metrics.jsonl"
FINAL_ARTIFACT_PATH = "final"


class FinalUploadError(TrainerError):
    """The final weights could not be logged to the MLflow run (storage/network: retried)."""


def redact(uri: str) -> str:
    """A tracking URI without its user:password."""
    return re.sub(r"//[^/@]+@", "//***@", uri)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, bool)) or value is None else str(value)
    return out


class MlflowSink:
    """Batches metrics to one MLflow run from a background thread."""

    def __init__(self, uri: str, experiment: str, run_dir: Storage, flush_every_s: float, params: dict[str, Any], tags: dict[str, str]):
        from mlflow.tracking import MlflowClient  # lazy: only when configured

        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.flush_every_s = flush_every_s
        self.owned = False
        self.run_id = self._run_id(experiment, run_dir)
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._warned = False
        from mlflow.entities import Param, RunTag

        self._send(tags=[RunTag(k, v) for k, v in tags.items()])
        self._send(params=[Param(k, v[:6000]) for k, v in params.items()])  # fails (warned) if a resume changed them
        self._thread = threading.Thread(target=self._run, name="gangflow-mlflow", daemon=True)
        self._thread.start()

    def _run_id(self, experiment: str, run_dir: Storage) -> str:
        if os.environ.get("MLFLOW_RUN_ID"):
            return os.environ["MLFLOW_RUN_ID"]
        try:
            saved = json.loads(run_dir.read_bytes(RECORD))
            if isinstance(saved, dict) and saved.get("uri") == self.uri and saved.get("run_id"):
                self.owned = bool(saved.get("owned", True))
                return saved["run_id"]
        except (FileNotFoundError, ValueError):
            pass
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        name = run_dir.url.rstrip("/").rsplit("/", 1)[-1]
        run = self.client.create_run(exp_id, run_name=name or None, tags={"gangflow.run_dir": run_dir.url})
        self.owned = True
        run_dir.write_bytes(RECORD, json.dumps({"uri": self.uri, "run_id": run.info.run_id, "owned": True}).encode())
        return run.info.run_id

    def log(self, key: str, value: float, step: int) -> None:
        self._queue.put((key, float(value), int(time.time() * 1000), int(step)))

    def _send(self, metrics=(), params=(), tags=()) -> None:
        try:
            self.client.log_batch(self.run_id, metrics=list(metrics), params=list(params), tags=list(tags))
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            if not self._warned:
                self._warned = True
                print(f"gangflow: warning: MLflow logging to {redact(self.uri)} failed ({type(exc).__name__}: {exc}); continuing", file=sys.stderr, flush=True)

    def _drain(self) -> None:
        from mlflow.entities import Metric

        batch = []
        while True:
            try:
                key, value, ts, step = self._queue.get_nowait()
            except queue.Empty:
                break
            batch.append(Metric(key, value, ts, step))
            if len(batch) >= _MAX_BATCH:
                self._send(metrics=batch)
                batch = []
        if batch:
            self._send(metrics=batch)

    def _run(self) -> None:
        while not self._closed.wait(self.flush_every_s):
            self._drain()

    def close(self, status: str | None) -> None:
        self._closed.set()
        self._thread.join(timeout=30)
        self._drain()
        if self.owned and status is not None:
            try:
                self.client.set_terminated(self.run_id, status)
            except Exception:  # noqa: BLE001
                pass


class Tracker:
    """Rank 0's metrics sink. Safe to call from the checkpoint thread. No-op on other ranks.

    `metrics.jsonl` is appended to on local disk. Objects cannot be appended to, so on object
    storage the whole file is rewritten at every event (start, resume, checkpoint, preempted,
    final) and at close: a crash loses at most the step lines since the last event."""

    def __init__(self, run_dir: str | Path | Storage, *, enabled: bool, mlflow_uri: str = "", experiment: str = "gangflow",
                 flush_every_s: float = 5.0, params: dict[str, Any] | None = None, tags: dict[str, str] | None = None):
        self.enabled = enabled
        self.mlflow: MlflowSink | None = None
        self.uri = ""
        self._lock = threading.Lock()
        self._fh = None
        self._lines: list[str] | None = None  # object storage: the whole file, rewritten on events
        if not enabled:
            return
        self.store = Storage(run_dir)
        if self.store.local:
            self._fh = open(self.store.local_path(METRICS), "a", buffering=1)
        else:
            try:
                self._lines = self.store.read_bytes(METRICS).decode().splitlines(keepends=True)
            except FileNotFoundError:
                self._lines = []
        self.uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if self.uri:
            try:
                self.mlflow = MlflowSink(self.uri, experiment, self.store, flush_every_s, _flatten(params or {}), tags or {})
            except Exception as exc:  # noqa: BLE001 - tracking must never stop training
                print(f"gangflow: warning: MLflow at {redact(self.uri)} unavailable ({type(exc).__name__}: {exc}); "
                      "metrics go to metrics.jsonl only", file=sys.stderr, flush=True)

    @property
    def mlflow_run_id(self) -> str | None:
        return self.mlflow.run_id if self.mlflow else None

    def write(self, record: dict[str, Any], *, sync: bool = False) -> None:
        if not self.enabled:
            return
        record = {**record, "time": round(time.time(), 3)}
        with self._lock:
            line = json.dumps(record) + "\n"
            if self._fh is not None:
                self._fh.write(line)
            elif self._lines is not None:
                self._lines.append(line)
                if sync:
                    self._sync()

    def _sync(self) -> None:
        """Rewrite metrics.jsonl on object storage (under the lock)."""
        if self._lines is not None:
            self.store.write_bytes(METRICS, "".join(self._lines).encode())

    def step(self, step: int, **metrics: float) -> None:
        if not self.enabled:
            return
        self.write({"step": step, **metrics})
        if self.mlflow:
            for key, value in metrics.items():
                self.mlflow.log(key, value, step)

    def event(self, event: str, step: int, mlflow_prefix: str | None = None, **fields: Any) -> None:
        if not self.enabled:
            return
        self.write({"event": event, "step": step, **fields}, sync=True)
        if self.mlflow and mlflow_prefix is not None:
            for key, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.mlflow.log(f"{mlflow_prefix}{key}", value, step)

    def log_final(self, local_dir: Path) -> str | None:
        """Log `final/` (weights + card) as artifacts of the run MLFLOW_RUN_ID under `final`, when a
        tracking URI and MLFLOW_RUN_ID are set; returns `runs:/<id>/final`. Re-logging (a retry)
        overwrites the same files. A failure raises FinalUploadError: the weights are what the
        pipeline's next step loads from there."""
        run_id = os.environ.get("MLFLOW_RUN_ID", "")
        if not (self.enabled and self.uri and run_id):
            return None
        try:
            if self.mlflow is not None:
                client = self.mlflow.client
            else:
                from mlflow.tracking import MlflowClient  # noqa: PLC0415 - rank 0 only, when configured

                client = MlflowClient(tracking_uri=self.uri)
            client.log_artifacts(run_id, str(local_dir), artifact_path=FINAL_ARTIFACT_PATH)
        except Exception as exc:  # noqa: BLE001 - reported with what failed
            raise FinalUploadError(f"logging the final weights to MLflow run {run_id} at {redact(self.uri)} failed "
                                   f"({type(exc).__name__}: {exc})") from exc
        return f"runs:/{run_id}/{FINAL_ARTIFACT_PATH}"

    def close(self, status: str | None = None) -> None:
        if self.mlflow:
            self.mlflow.close(status)
            self.mlflow = None
        if self._fh:
            self._fh.close()
            self._fh = None
        if self._lines is not None:
            with self._lock:
                self._sync()
