"""Metrics: `DIR/metrics.jsonl` always; MLflow too when a tracking URI is configured.

Only rank 0 tracks. Each line of metrics.jsonl is a training step or an event and says what MLflow
gets (`mlflow_items`, which the Airflow side's relay uses too). MLflow is imported lazily and fed
from a background thread; its errors never stop training, except a failed upload of `final/`.
"""

from __future__ import annotations

import json
import os
import posixpath
import queue
import re
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.checks import is_integer
from trainer.console import say
from trainer.errors import TrainerError
from trainer.model_card import FINAL
from trainer.storage import Storage
from trainer.urls import redact_url

_MAX_BATCH = 900  # MLflow accepts 1000 metrics per log_batch
RECORD = "tracking.json"
METRICS = "metrics.jsonl"
REMOTE_METRICS_LIMIT = 64 << 20  # bytes of earlier tries' metrics.jsonl kept on object storage
FINAL_ARTIFACT_PATH = FINAL  # the run dir's final/ is logged under its own name


class FinalUploadError(TrainerError):
    """The final weights could not be logged to the MLflow run (storage/network: retried). Rank 0
    raises it; the training task's relay raises its subclass `RelayFinalUploadError`."""


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            text = json.dumps(value) if isinstance(value, (list, bool)) or value is None else str(value)
            out[name] = redact_url(text)  # params are shown to anyone who can read the experiment
    return out


_MAX_PARAMS = 100  # and 100 params/tags per log_batch
_PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value
_NOT_METRICS = frozenset({"step", "time", "event", "mlflow", "attempt"})


def _number(value: Any) -> bool:
    """A number MLflow stores (a double): an int float() cannot take costs the whole batch it is in."""
    return isinstance(value, float) or (is_integer(value) and abs(value) < 2**1024)


MAX_STEP = 2**63 - 1  # MLflow's steps are 64-bit integers


# MLflow's rule for a metric name (mlflow.utils.validation): one name it refuses fails the whole
# log_batch it travels in, so the metrics beside it were lost too.
_METRIC_NAME = re.compile(r"[/\w.\- :]{1,250}")


def check_metrics(what: str, metrics: Mapping[str, Any]) -> None:
    """Refuse metrics MLflow would refuse or the metrics file would not keep: a name outside MLflow's
    rule or one of the record's own keys (ValueError), a value that is not a number (TypeError)."""
    for name in metrics:
        if name in _NOT_METRICS:
            raise ValueError(f"{what}: the metric name {name!r} is reserved (the record's own keys: "
                             f"{', '.join(sorted(_NOT_METRICS))}); name it otherwise")
        if not (isinstance(name, str) and _METRIC_NAME.fullmatch(name) and posixpath.normpath(name) == name
                and not name.startswith(("/", ".."))):
            raise ValueError(f"{what}: the metric name {name!r} is not one MLflow accepts: at most 250 letters, digits, "
                             "'_', '-', '.', ' ', ':' and '/', not a path that resolves elsewhere ('a//b', './a', '/a')")
    bad = [name for name, value in metrics.items() if not _number(value)]
    if bad:
        raise TypeError(f"{what}: {', '.join(bad)} must be numbers a double holds (call .item() on a tensor)")


def mlflow_items(record: dict[str, Any]) -> tuple[list[tuple[str, float, int, int]], list[tuple[str, str]], list[tuple[str, str]]]:
    """What one metrics.jsonl line sends to MLflow: (metrics as (key, value, timestamp ms, step),
    params, tags). A step line: its numbers at its step. An event line with an `mlflow` key: its
    numbers, prefixed, at `mlflow.step` (else its step). A `tracking` line: params and tags.
    Other lines: nothing. The one mapping for the rank's sink and the operator's relay."""
    ts = int(float(record.get("time") or time.time()) * 1000)
    event = record.get("event")
    if event == "tracking":
        params = [(str(k), str(v)[:_PARAM_VALUE_MAX]) for k, v in (record.get("params") or {}).items()]
        return [], params, [(str(k), str(v)) for k, v in (record.get("tags") or {}).items()]
    if event is None:
        prefix, step = "", record.get("step", 0)
    elif isinstance(record.get("mlflow"), dict):
        prefix, step = record["mlflow"].get("prefix", ""), record["mlflow"].get("step", record.get("step", 0))
    else:
        return [], [], []
    metrics = [(f"{prefix}{k}", float(v), ts, int(step)) for k, v in record.items() if k not in _NOT_METRICS and _number(v)]
    return metrics, [], []


def log_records(client: Any, run_id: str, records) -> None:
    """Send metrics.jsonl records (dicts) to run `run_id`: `mlflow_items` of each, then
    `log_batches` (which raises its first error). Used by the rank's sink and the relay."""
    metrics: list = []
    params: list = []
    tags: list = []
    for record in records:
        m, p, t = mlflow_items(record)
        metrics += m
        params += p
        tags += t
    if metrics or params or tags:
        log_batches(client, run_id, metrics, params, tags)


def log_batches(client: Any, run_id: str, metrics=(), params=(), tags=()) -> None:
    """Send `mlflow_items` output to run `run_id` in as few `log_batch` calls as MLflow accepts.
    Every call is tried; the first error is raised at the end (a param MLflow refuses, e.g. one
    a resumed attempt changed, does not cost the metrics beside it)."""
    from mlflow.entities import Metric, Param, RunTag  # noqa: PLC0415 - only where MLflow is used

    metrics, params, tags = list(metrics), list(params), list(tags)
    # Params and tags go first: a reader who sees a metric must also see the run's params (sent after
    # the metrics, a run polled between the two calls had metrics and no params).
    calls = [{"params": [Param(k, v) for k, v in params[i : i + _MAX_PARAMS]],
              "tags": [RunTag(k, v) for k, v in tags[i : i + _MAX_PARAMS]]}
             for i in range(0, max(len(params), len(tags)), _MAX_PARAMS)]
    calls += [{"metrics": [Metric(*m) for m in metrics[i : i + _MAX_BATCH]]} for i in range(0, len(metrics), _MAX_BATCH)]
    error: Exception | None = None
    for call in calls:
        try:
            client.log_batch(run_id, **call)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other calls
            error = error or exc
    if error is not None:
        raise error


def mlflow_client(uri: str) -> Any:
    """An `MlflowClient` whose tracking and registry are both at `uri`: every client gangflow uses
    is built here (the operators' `operators.hooks.mlflow.get_client` too)."""
    from mlflow import MlflowClient  # noqa: PLC0415 - lazy: only where MLflow is used

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


class MlflowSink:
    """Sends metrics.jsonl records (`mlflow_items`) to one MLflow run from a background thread."""

    def __init__(self, uri: str, experiment: str, run_dir: Storage, flush_every_s: float):
        self.client = mlflow_client(uri)  # lazy: only when configured
        self.uri = uri
        self.flush_every_s = flush_every_s
        self.owned = False
        self.run_id = self._run_id(experiment, run_dir)
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._warned = False
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
        run = self.client.create_run(exp_id, run_name=name or None, tags={"gangflow.run_dir": redact_url(run_dir.url)})
        self.owned = True
        run_dir.write_bytes(RECORD, json.dumps({"uri": self.uri, "run_id": run.info.run_id, "owned": True}).encode())
        return run.info.run_id

    def add(self, record: dict[str, Any]) -> None:
        self._queue.put(record)

    def _drain(self) -> None:
        records: list = []
        while True:
            try:
                records.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if not records:
            return
        try:
            log_records(self.client, self.run_id, records)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            if not self._warned:
                self._warned = True
                say(redact_url(f"gangflow: warning: MLflow logging to {self.uri} failed ({type(exc).__name__}: {exc}); continuing"), stream=sys.stderr)

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
        self.exporter = None
        self.uri = ""
        self._lock = threading.Lock()
        self._fh = None
        self._lines: list[str] | None = None  # object storage: the whole file, rewritten on events
        if not enabled:
            return
        self.store = Storage(run_dir)
        if self.store.local:
            fd = os.open(self.store.local_path(METRICS), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            self._fh = os.fdopen(fd, "a", buffering=1)  # never appended through a link
        else:
            try:
                self._lines = self._earlier_lines()
            except FileNotFoundError:
                self._lines = []
        self.exporter = _pod_exporter()
        self.uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if self.uri:
            try:
                self.mlflow = MlflowSink(self.uri, experiment, self.store, flush_every_s)
            except Exception as exc:  # noqa: BLE001 - tracking must never stop training
                say(redact_url(f"gangflow: warning: MLflow at {self.uri} unavailable ({type(exc).__name__}: {exc}); "
                               "metrics go to metrics.jsonl only"), stream=sys.stderr)
        if params or tags:  # the run's params and tags, for whoever sends this file to MLflow
            self.write({"event": "tracking", "step": 0, "params": _flatten(params or {}), "tags": {k: redact_url(v) for k, v in (tags or {}).items()}})

    def _earlier_lines(self) -> list[str]:
        """metrics.jsonl of earlier tries on object storage, rewritten whole at each event: its last
        REMOTE_METRICS_LIMIT bytes (whole lines), undecodable bytes replaced, so neither a huge file
        nor a planted byte fails the try."""
        path = self.store.path(METRICS)
        size = self.store.fs.size(path)
        start = max(0, size - REMOTE_METRICS_LIMIT)
        data = self.store.fs.cat_file(path, start=start, end=size)
        if start:
            data = data[data.find(b"\n") + 1 :]
            say(f"gangflow: warning: {METRICS} at {redact_url(self.store.url)} holds {size} bytes; keeping its last "
                f"{len(data)} (the earlier lines were relayed when they were written)", stream=sys.stderr)
        return data.decode("utf-8", errors="replace").splitlines(keepends=True)

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
        if self.mlflow is not None:
            self.mlflow.add(record)
        if self.exporter is not None:
            self.exporter.observe(record)

    def _sync(self) -> None:
        """Rewrite metrics.jsonl on object storage (under the lock)."""
        if self._lines is not None:
            self.store.write_bytes(METRICS, "".join(self._lines).encode())

    def step(self, step: int, **metrics: float) -> None:
        if not self.enabled:
            return
        self.write({"step": step, **metrics})

    def event(self, event: str, step: int, mlflow_prefix: str | None = None, sync: bool = True,
              mlflow_step: int | None = None, **fields: Any) -> None:
        """An event line; with `mlflow_prefix` its numeric fields also go to MLflow under that
        prefix, at `mlflow_step` (default: `step`)."""
        if not self.enabled:
            return
        record: dict[str, Any] = {"event": event, "step": step, **fields}
        if mlflow_prefix is not None:
            record["mlflow"] = {"prefix": mlflow_prefix} if mlflow_step is None else {"prefix": mlflow_prefix, "step": mlflow_step}
        self.write(record, sync=sync)

    def log_final(self, local_dir: Path) -> str | None:
        """Log `final/` (weights + card) as artifacts of the run MLFLOW_RUN_ID under `final`, when a
        tracking URI and MLFLOW_RUN_ID are set; returns `runs:/<id>/final`. Re-logging (a retry)
        overwrites the same files. A failure raises FinalUploadError: the weights are what the
        pipeline's next step loads from there."""
        run_id = os.environ.get("MLFLOW_RUN_ID", "")
        if not (self.enabled and self.uri and run_id):
            return None
        try:
            client = self.mlflow.client if self.mlflow is not None else mlflow_client(self.uri)
            client.log_artifacts(run_id, str(local_dir), artifact_path=FINAL_ARTIFACT_PATH)
        except Exception as exc:  # noqa: BLE001 - reported with what failed
            raise FinalUploadError(redact_url(f"logging the final weights to MLflow run {run_id} at {self.uri} failed "
                                              f"({type(exc).__name__}: {exc})")) from exc
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


def _pod_exporter():
    """Rank 0's Prometheus exporter when `GANGFLOW_METRICS_PORT` is set (a Kubernetes pod: the
    chart's PodMonitor scrapes the port; a local gang is exported by its training task instead)."""
    port = os.environ.get("GANGFLOW_METRICS_PORT", "")
    if not port:
        return None
    from trainer.prometheus import GangMetrics, labels_from_env, serve

    try:
        metrics = GangMetrics(labels_from_env())
        serve(metrics, "0.0.0.0", int(port))
    except (OSError, ValueError) as exc:  # metrics must never stop training
        say(f"gangflow: warning: no Prometheus metrics on port {port} ({type(exc).__name__}: {exc})", stream=sys.stderr)
        return None
    try:
        metrics.started(int(os.environ.get("GANGFLOW_TRY_NUMBER", "1")))
    except ValueError:
        pass
    return metrics


def _process_start(pid: int | str = "self") -> float | None:
    """Epoch seconds at which process `pid` started (/proc; 10 ms resolution), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        # The boot time from the clocks: /proc/stat's `btime` is whole seconds, which put a start
        # up to a second early (0.38 s here) and inflated attempt_startup_s by as much.
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def launch_time() -> tuple[float | None, str]:
    """When this attempt was launched: the launcher's start when it is our parent (torchrun's
    agent, or trainer.launch, which forks the ranks), else this process's start. Returns (epoch
    seconds or None, what it is)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            parent = fh.read().replace(b"\0", b" ")
    except OSError:
        parent = b""
    if b"torch.distributed.run" in parent or b"torchrun" in parent or b"trainer.launch" in parent:
        return _process_start(os.getppid()), "torchrun launch"
    return _process_start(), "process start"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Rank 0's progress line every `every_s` seconds of the loop (0: never), and the attempt's
    record (docs/trainer.md, "Progress"). `tick(step)` runs every step on every rank: a clock
    read, no collective (ranks need not agree on time). The loss shown is the last logged one
    (mean over ranks, every `train.log_every_steps`)."""

    def __init__(self, tracker: Tracker, *, log, every_s: float, total: int | None, global_batch: int | None, start_step: int,
                 committed_step: int | None) -> None:
        self.tracker, self.log, self.every_s, self.total, self.global_batch = tracker, log, every_s, total, global_batch
        self.enabled = tracker.enabled
        self.start_step = self.last_step = start_step
        self.committed_step = committed_step
        self.loss: float | None = None
        self.ckpt_s = 0.0
        self.ckpt_bytes = 0
        self.ckpts = 0
        self.t0 = self.last_t = time.monotonic()
        self.next_at = self.t0 + every_s
        self.startup_s: float | None = None
        try:
            self.attempt = int(os.environ.get("GANGFLOW_TRY_NUMBER", "1"))
        except ValueError:
            self.attempt = 1
        try:
            self.try_started_at: float | None = float(os.environ["GANGFLOW_TRY_STARTED_AT"])
        except (KeyError, ValueError):
            self.try_started_at = None
        self.queue_wait_s: float | None = None

    def restart(self) -> None:
        """The training loop starts now: rates, the ETA and the attempt's run time count from here."""
        self.t0 = self.last_t = time.monotonic()
        self.next_at = self.t0 + self.every_s

    def tick(self, step: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.startup_s is None:  # the end of this attempt's first step
            launched, what = launch_time()
            if launched is not None:
                self.startup_s = round(time.time() - launched, 3)
                if self.try_started_at is not None:  # clamped: the worker's and the node's clocks may differ
                    self.queue_wait_s = round(max(0.0, launched - self.try_started_at), 3)
                self.tracker.event("first_step", step, sync=False, attempt=self.attempt, since=what, startup_s=self.startup_s,
                                   queue_wait_s=self.queue_wait_s, **self._attempt)
            else:
                self.startup_s = -1.0
        if self.every_s <= 0 or now < self.next_at:
            return
        # Without a global batch (trainer.runtime's user loops) the rate is in steps, not samples.
        rate = (step - self.last_step) * (self.global_batch or 1) / max(now - self.last_t, 1e-9)
        unit = "samples" if self.global_batch else "steps"
        done = step - self.start_step
        eta = (self.total - step) * (now - self.t0) / done if done > 0 and self.total else float("nan")
        self.last_step, self.last_t, self.next_at = step, now, now + self.every_s
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        ckpt = "none" if self.committed_step is None else str(self.committed_step)
        of = f"/{self.total} ({100 * step / self.total:.0f}%)" if self.total else ""
        self.log(f"gangflow: progress: step {step}{of}, loss {loss}, "
                 f"{rate:.0f} {unit}/s, ETA {_duration(eta) if eta == eta else '-'}, last checkpoint step {ckpt}")
        fields = {"loss": self.loss, f"{unit}_per_sec": round(rate, 3), "eta_s": round(eta, 3) if eta == eta else None,
                  "last_checkpoint_step": self.committed_step}
        self.tracker.event("progress", step, mlflow_prefix="progress_", sync=False, total_steps=self.total, **fields)
        # attempt_run_s follows the progress lines, so a killed attempt keeps its last value
        self.tracker.event("attempt_run", step, sync=False, attempt=self.attempt, run_s=round(now - self.t0, 3), **self._attempt)

    def committed(self, info: dict[str, Any]) -> None:
        """A checkpoint was committed (any thread)."""
        self.committed_step = info["step"]
        self.ckpt_s += float(info.get("duration_s", 0.0))
        self.ckpt_bytes = int(info.get("bytes", 0))
        self.ckpts += 1

    def attempt_record(self, step: int) -> None:
        """The attempt's figures, at its end (finished or preempted): metrics.jsonl and MLflow
        metrics `attempt_*` at MLflow step = the attempt (Airflow try) number."""
        if not self.enabled:
            return
        fields = {"startup_s": self.startup_s if self.startup_s and self.startup_s >= 0 else None,
                  "queue_wait_s": self.queue_wait_s, "run_s": round(time.monotonic() - self.t0, 3),
                  "checkpoint_s": round(self.ckpt_s, 6), "checkpoint_bytes": self.ckpt_bytes, "checkpoints": self.ckpts,
                  "first_step": self.start_step, "last_step": step}
        self.tracker.event("attempt", step, attempt=self.attempt, **fields, **self._attempt)

    @property
    def _attempt(self) -> dict[str, Any]:
        """`Tracker.event` arguments of an `attempt_*` record: MLflow step = the attempt."""
        return {"mlflow_prefix": "attempt_", "mlflow_step": self.attempt}
