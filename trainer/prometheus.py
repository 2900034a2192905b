"""Prometheus metrics of one gang, read from its metrics.jsonl records (docs/observability.md).

`GangMetrics` holds the gang's series in a registry of its own and `observe(record)` maps one
metrics.jsonl line onto them: the one mapping for the training task's exporter (local gangs) and
rank 0's exporter in a pod (Kubernetes). `serve` exposes the registry over HTTP. prometheus_client
is imported only here, and only by whoever exports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: The labels every series carries (the Kubernetes scrape adds `job_uid` from the pod's labels).
GANG_LABELS = ("dag_id", "dag_run_id", "pipeline", "mlflow_run_id", "gang")
#: Rank 0's measurements (loss is the mean over ranks) carry `rank="0"`; an exit code its rank's.
RANK_LABELS = (*GANG_LABELS, "rank")
#: The environment a rank's exporter reads its labels from (set by the training operator's spec).
LABEL_ENV = {"dag_id": "GANGFLOW_DAG_ID", "dag_run_id": "GANGFLOW_DAG_RUN_ID", "pipeline": "GANGFLOW_PIPELINE",
             "mlflow_run_id": "MLFLOW_RUN_ID", "gang": "GANGFLOW_GANG"}
#: The port a rank 0 in a pod serves metrics on, when set (the chart's PodMonitor scrapes it).
PORT_ENV = "GANGFLOW_METRICS_PORT"

_SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GangMetrics:
    """The series of one gang. `labels` gives every key of `GANG_LABELS` (missing ones are "")."""

    def __init__(self, labels: Mapping[str, str]):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        unknown = set(labels) - set(GANG_LABELS)
        if unknown:
            raise ValueError(f"labels {sorted(unknown)}: accepted labels are {', '.join(GANG_LABELS)}")
        self.labels = {k: str(labels.get(k) or "") for k in GANG_LABELS}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def gauge(name, doc, labelnames=RANK_LABELS):
            return Gauge(name, doc, labelnames, registry=r)

        self.queue_wait = gauge("gangflow_queue_wait_seconds", "Try start to gang launch (admission, scheduling, start).", GANG_LABELS)
        self.startup = gauge("gangflow_startup_seconds", "Gang launch to the end of the first step of this attempt.")
        self.step = gauge("gangflow_step", "The last step logged.")
        self.total_steps = gauge("gangflow_total_steps", "train.max_steps.")
        self.step_time = gauge("gangflow_step_seconds", "Mean seconds per step over the last logging window.")
        self.samples = gauge("gangflow_samples_per_second", "Training samples per second over the last logging window.")
        self.loss = gauge("gangflow_loss", "Training loss, mean over ranks, at the last logged step.")
        self.eta = gauge("gangflow_eta_seconds", "Estimated seconds to train.max_steps.")
        self.save = Histogram("gangflow_checkpoint_save_seconds", "Checkpoint save, snapshot to commit.", RANK_LABELS,
                              buckets=_SAVE_BUCKETS, registry=r)
        self.blocked = Histogram("gangflow_checkpoint_blocked_seconds", "Training time a checkpoint save blocked.",
                                 RANK_LABELS, buckets=_SAVE_BUCKETS, registry=r)
        self.save_bytes = gauge("gangflow_checkpoint_bytes", "Size of the last committed checkpoint.")
        self.committed = gauge("gangflow_checkpoint_step", "Step of the last committed checkpoint.")
        self.restore = gauge("gangflow_restore_seconds", "Reading and loading the checkpoint this attempt resumed from.")
        self.restarts = gauge("gangflow_restarts", "Tries of this gang before the current one (Airflow retries).", GANG_LABELS)
        self.preemptions = Counter("gangflow_preemptions", "Attempts that stopped on SIGTERM (preemption) and checkpointed.",
                                   GANG_LABELS, registry=r)
        self.failure = Gauge("gangflow_failure", "1 when the gang failed, labelled with the classifier's kind.",
                             (*GANG_LABELS, "kind"), registry=r)
        self.exit_code = gauge("gangflow_rank_exit_code", "Exit code of each rank of a failed gang (negative: the signal).")
        self.up = gauge("gangflow_gang_running", "1 while the gang runs, 0 once it ended.", GANG_LABELS)
        self.model = Gauge("gangflow_model_version", "1 for the model version promote registered.",
                           (*GANG_LABELS, "model_name", "model_version", "promoted"), registry=r)

    def _of(self, metric, rank: int | str | None = 0, **extra: str):
        labels = dict(self.labels, **extra)
        if rank is not None:
            labels["rank"] = str(rank)
        return metric.labels(**labels)

    def set_labels(self, **labels: str) -> None:
        """Labels learnt late (the MLflow run id is known once the run is open); before any series exists."""
        self.labels.update({k: str(v) for k, v in labels.items() if k in GANG_LABELS})

    def observe(self, record: Mapping[str, Any]) -> None:
        """One metrics.jsonl line (trainer/tracking.py writes them)."""
        event, step = record.get("event"), record.get("step")
        if event is None:
            if _num(step):
                self._of(self.step).set(step)
            if _num(record.get("loss")):
                self._of(self.loss).set(record["loss"])
            if _num(record.get("samples_per_sec")):
                self._of(self.samples).set(record["samples_per_sec"])
            if _num(record.get("step_time_s")):
                self._of(self.step_time).set(record["step_time_s"])
        elif event == "first_step":
            if _num(record.get("startup_s")):
                self._of(self.startup).set(record["startup_s"])
            if _num(record.get("queue_wait_s")):
                self._of(self.queue_wait, None).set(record["queue_wait_s"])
        elif event == "progress":
            if _num(record.get("total_steps")):
                self._of(self.total_steps).set(record["total_steps"])
            if _num(record.get("eta_s")):
                self._of(self.eta).set(record["eta_s"])
        elif event == "checkpoint":
            if _num(record.get("duration_s")):
                self._of(self.save).observe(record["duration_s"])
            if _num(record.get("blocked_s")):
                self._of(self.blocked).observe(record["blocked_s"])
            if _num(record.get("bytes")):
                self._of(self.save_bytes).set(record["bytes"])
            if _num(step):
                self._of(self.committed).set(step)
        elif event == "resume":
            if _num(record.get("restore_s")):
                self._of(self.restore).set(record["restore_s"])
        elif event == "preempted":
            self._of(self.preemptions, None).inc()
        elif event == "attempt" and _num(record.get("attempt")):
            self._of(self.restarts, None).set(max(0, int(record["attempt"]) - 1))

    def started(self, attempt: int) -> None:
        self._of(self.up, None).set(1)
        self._of(self.restarts, None).set(max(0, attempt - 1))

    def ended(self, *, failure_kind: str | None = None, exit_codes: Mapping[int, int] | None = None) -> None:
        """The gang ended: its failure kind (None: it succeeded) and each failed rank's exit code."""
        self._of(self.up, None).set(0)
        if failure_kind:
            self._of(self.failure, None, kind=failure_kind).set(1)
        for rank, code in (exit_codes or {}).items():
            self._of(self.exit_code, rank).set(code)

    def promoted(self, *, model_name: str, model_version: str | int | None, promoted: bool) -> None:
        self._of(self.model, None, model_name=model_name, model_version=str(model_version or ""),
                 promoted="true" if promoted else "false").set(1)

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def labels_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {label: env.get(name, "") for label, name in LABEL_ENV.items()}


def serve(metrics: GangMetrics, host: str, port: int):
    """Serve `metrics` at http://host:port/metrics from a daemon thread: returns (server, (host, port));
    `server.shutdown()` stops it. Port 0 takes a free one."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server, server.server_address[:2]
