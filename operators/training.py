"""`GangTrainingOperator`: run one gang of training ranks through a backend.

Subclass it to change what a gang runs (override `build_spec`) or where (pass another backend,
or register your own with `operators.backends.register_backend`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

from trainer.console import LOG_FORMAT_ENV, log_format

from operators.config import settings
from operators.backends import GangResult, GangSpec, get_backend
from operators.links import DashboardLink, KubernetesObjectLink, MlflowRunLink
from operators.exceptions import GangCapacityError, GangConfigError, GangFailure, InfraFailure, UnknownFailure, UserError, UserFailure

_FAILURES: dict[str, type[GangFailure]] = {"infra": InfraFailure, "user": UserFailure, "unknown": UnknownFailure}


def gang_name(dag_id: str, run_id: str) -> str:
    """A DNS-1123 label unique per DAG run (across deployments too) and stable across its tries:
    the DAG id for humans plus the run's identity (`settings.run_identity`)."""
    digest = settings.run_identity(dag_id, run_id)[:10]
    stem = re.sub(r"[^a-z0-9-]+", "-", dag_id.lower()).strip("-")[:40].strip("-") or "gang"
    return f"{stem}-{digest}"


def format_override(key: str, value: Any) -> str:
    """`--set` item for the trainer, whose values are parsed as YAML scalars."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif value is None:
        value = "null"
    return f"{key}={value}"


class GangTrainingOperator(BaseOperator):
    """Train on a gang of `world_size` ranks that start together or not at all.

    The run dir is keyed by DAG run, so when Airflow retries this task after an infrastructure
    failure the trainer finds the last committed checkpoint and resumes from it. A failed gang
    is handed to the failure classifier (`operators.failures.classify`) and raised as
    `InfraFailure` (retried by `ClassifiedRetryPolicy`), `UserFailure` (failed at once) or
    `UnknownFailure` (retried once).

    :param world_size: number of ranks. With the local backend, give the task
        `pool="gangflow_training", pool_slots=world_size` so the pool admits the whole gang.
    :param dataset: the validated-dataset manifest from `DatasetValidationOperator`. Only its
        `version` reaches the ranks: `GangSpec.dataset_version`, which the backend turns into its
        data arguments (`--set data.version=... data.remote=...`), and each rank fetches the version by content
        address and checks every md5 itself. No path of this worker's DVC cache is passed.
    :param overrides: trainer parameters, dotted names to values (`{"train.max_steps": 600}`).
    :param backend: `local` or `kubernetes` (see `operators.backends`).
    :param backend_options: keyword arguments of the backend's constructor.
    :param config_path: the trainer's params file.
    :param experiment: MLflow experiment of the training run.
    :param run_dir: where checkpoints and final weights go (default: one folder per DAG run
        under the state dir).
    :returns: (XCom) `model_uri` (`runs:/<mlflow_run_id>/final`: the final weights are logged
        there, by this task's relay for a local gang (`operators.hooks.mlflow_relay`: the ranks import no
        MLflow) or by rank 0 on Kubernetes; evaluate and promote load them from MLflow, never
        from a worker path),
        `mlflow_run_id`, `dataset_version`, `world_size`, `backend`, `attempt`,
        `resumed_from_step`, `gang`.
    """

    template_fields = ("world_size", "dataset", "overrides", "backend", "backend_options", "config_path", "run_dir", "experiment")
    template_fields_renderers = {"overrides": "json", "dataset": "json", "backend_options": "json"}
    ui_color = "#f4a460"
    # buttons on the task's page, live while the gang runs (operators/links.py)
    operator_extra_links = (MlflowRunLink(), DashboardLink(), KubernetesObjectLink())

    def __init__(
        self,
        *,
        world_size: int | str,
        dataset: Mapping[str, Any] | str | None = None,
        overrides: Mapping[str, Any] | None = None,
        backend: str = "local",
        backend_options: Mapping[str, Any] | None = None,
        config_path: str | None = None,
        experiment: str = "gangflow",
        run_dir: str | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.world_size = world_size
        self.dataset = dataset
        self.overrides = dict(overrides or {})
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.config_path = config_path
        self.experiment = experiment
        self.run_dir = run_dir
        self._backend = None
        self._relay = None
        self._exporter = None
        self.link_urls: dict[str, str] = {}  # the extra links' URLs, by link key (operators/links.py)

    # -- building the gang -------------------------------------------------------------------

    def build_spec(self, context, *, mlflow_run_id: str | None) -> GangSpec:
        ti = context["ti"]
        dag_id, run_id = ti.dag_id, context["run_id"]
        overrides = dict(self.overrides)
        version = None
        if self.dataset:
            manifest = json.loads(self.dataset) if isinstance(self.dataset, str) else self.dataset
            version = str(manifest["version"])  # the backend hands it to the ranks (its data arguments)
        env = {"GANGFLOW_DAG_ID": dag_id, "GANGFLOW_DAG_RUN_ID": run_id, "GANGFLOW_TRY_NUMBER": str(ti.try_number),
               "GANGFLOW_GANG": gang_name(dag_id, run_id)}
        if pipeline := pipeline_of(context):  # a label of the gang's metrics and log lines
            env["GANGFLOW_PIPELINE"] = pipeline
        if os.environ.get(LOG_FORMAT_ENV):  # the worker's setting reaches every rank, pods included
            try:
                env[LOG_FORMAT_ENV] = log_format()
            except ValueError as exc:
                raise GangConfigError(str(exc)) from None
        if (started := try_started_at(ti)) is not None:
            # rank 0 records launch - this as attempt_queue_wait_s (local: the task's own work before
            # torchrun; Kubernetes: admission, scheduling, image pull, container start too)
            env["GANGFLOW_TRY_STARTED_AT"] = f"{started:.3f}"
        if mlflow_run_id:
            env |= {"MLFLOW_TRACKING_URI": settings.tracking_uri(), "MLFLOW_RUN_ID": mlflow_run_id}
        return GangSpec(
            name=env["GANGFLOW_GANG"],
            run_dir=self.run_dir or str(settings.run_dir(dag_id, run_id)),
            world_size=int(self.world_size),
            config_path=self.config_path or str(settings.trainer_config_path()),
            overrides=tuple(format_override(k, v) for k, v in sorted(overrides.items())),
            env=env,
            attempt=ti.try_number,
            dataset_version=version,
        )

    def mlflow_run(self, context) -> str | None:
        """The MLflow run of this DAG run: created on the first try, reused by retries."""
        return self._open_run(context)[1]

    def _open_run(self, context):
        """(client, run id) of this DAG run's MLflow run (`operators.hooks.mlflow.ensure_run`)."""
        from operators.hooks import mlflow as tracking

        client = tracking.get_client()
        experiment_id = tracking.ensure_experiment(client, self.experiment)
        ti = context["ti"]
        run_id = tracking.ensure_run(client, experiment_id, dag_id=ti.dag_id, dag_run_id=context["run_id"])
        MlflowRunLink().push(self, ti, settings.mlflow_run_url(experiment_id, run_id))
        DashboardLink().push(self, ti, settings.dashboard_url(run_id))
        return client, run_id

    def tag_lineage(self, spec: GangSpec, run_id: str | None = None, client=None) -> None:
        """Lineage on the MLflow run (the registry copies `gangflow.*` run tags onto the version)."""
        run_id = run_id or spec.env.get("MLFLOW_RUN_ID")
        if not run_id:
            return
        from operators.hooks import mlflow as tracking

        from operators.hooks.prometheus import metrics_query

        tags = {"gangflow.gang": spec.name, "gangflow.backend": str(self.backend),
                # the link to the run's Prometheus series (docs/observability.md)
                "gangflow.metrics_query": metrics_query(run_id)}
        if (dashboard := settings.dashboard_url(run_id)) is not None:
            tags["gangflow.dashboard_url"] = dashboard
        if spec.dataset_version:
            tags["gangflow.dataset_version"] = spec.dataset_version
        client = client or tracking.get_client()
        with tracking.mlflow_errors(tracking.client_uri(client), f"tag MLflow run {run_id}"):
            for key, value in tags.items():
                client.set_tag(run_id, key, value)

    # -- running it ----------------------------------------------------------------------------

    def execute(self, context):
        self._backend = get_backend(self.backend, **self.backend_options)
        if getattr(self._backend, "relay_tracking", False):
            return self._execute_relayed(context)
        spec = self.build_spec(context, mlflow_run_id=self.mlflow_run(context))
        self._backend.check_capacity(spec)
        self.tag_lineage(spec)
        Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
        self.log.info("gang %s: %d ranks, run dir %s, try %d", spec.name, spec.world_size, spec.run_dir, spec.attempt)
        if self._backend.deferrable:
            handle = self._backend.submit(spec)
            KubernetesObjectLink().push(self, context["ti"], settings.kubernetes_object_url(
                str(handle.get("namespace", "")), str(handle.get("kind", "")), str(handle.get("name", ""))))
            self.defer(
                trigger=self._backend.trigger(handle),
                method_name="execute_complete",
                kwargs={"handle": handle, "spec": _spec_to_dict(spec), "links": dict(self.link_urls)},
            )
        result = self._backend.run(spec, ProgressNote(context["ti"], self.log.info))
        return self._finish(spec, result)

    def _execute_relayed(self, context):
        """A gang beside this task (`relay_tracking`): the MLflow run is opened while torchrun
        starts, not before, and this process relays the ranks' metrics.jsonl into it and logs
        the final weights (`operators.hooks.mlflow_relay`); the ranks import no MLflow."""
        from operators.hooks.mlflow_relay import TrackingRelay
        from operators.hooks.prometheus import GangExporter

        spec = self.build_spec(context, mlflow_run_id=None)
        self._backend.check_capacity(spec)
        Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
        labels = {"dag_id": spec.env["GANGFLOW_DAG_ID"], "dag_run_id": spec.env["GANGFLOW_DAG_RUN_ID"],
                  "pipeline": spec.env.get("GANGFLOW_PIPELINE", ""), "gang": spec.name}
        try:
            self._exporter = exporter = GangExporter.from_settings(labels, log=self.log.info)
        except ValueError as exc:  # GANGFLOW_METRICS / _LINGER_S: a setting to fix, not to retry
            raise GangConfigError(str(exc)) from None
        except OSError as exc:  # the port is taken: metrics never stop a gang
            self.log.warning("gangflow: no Prometheus metrics for this gang (%s: %s)", type(exc).__name__, exc)
            self._exporter = exporter = None
        if exporter is not None:
            exporter.read_earlier_tries(spec.run_dir)
        opened: list[tuple[Any, str]] = []

        def open_run():
            if opened:
                return opened[0]
            client, run_id = self._open_run(context)
            self.tag_lineage(spec, run_id, client)
            if exporter is not None:  # its series carry the run id: they begin once it is known
                exporter.begin(mlflow_run_id=run_id, attempt=spec.attempt)
            opened.append((client, run_id))
            return client, run_id

        if spec.env.get(LOG_FORMAT_ENV) == "json":
            # each JSON line carries the run id: the run is opened before the gang starts (the
            # seconds the relay otherwise overlaps with start-up), as on Kubernetes
            spec = dataclasses.replace(spec, env={**spec.env, "GANGFLOW_MLFLOW_RUN_ID": open_run()[1]})

        # An error that retrying cannot heal stops the gang now (SIGTERM: the ranks commit a
        # checkpoint) rather than after a whole try of training that must fail.
        self._relay = TrackingRelay(spec.run_dir, open_run=open_run, log=self.log.info,
                                    on_fatal=lambda exc: self._backend.kill(),
                                    observers=(exporter.observe,) if exporter is not None else ()).start()
        self.log.info("gang %s: %d ranks, run dir %s, try %d", spec.name, spec.world_size, spec.run_dir, spec.attempt)
        try:
            try:
                result = self._backend.run(spec, ProgressNote(context["ti"], self.log.info))
            except BaseException:
                self._relay.stop()
                raise
            run_id = self._relay.finish(succeeded=result.succeeded, final_dir=Path(spec.run_dir) / "final")
            return self._finish(spec, result, run_id)
        finally:
            if exporter is not None:
                exporter.close()

    def execute_complete(self, context, event: dict[str, Any], handle: dict[str, Any], spec: dict[str, Any],
                         links: dict[str, str] | None = None):
        self.link_urls.update(links or {})  # this process is new: the URLs learnt before the deferral
        backend = get_backend(self.backend, **self.backend_options)
        return self._finish(GangSpec(**spec), backend.collect(handle, event))

    def _finish(self, spec: GangSpec, result: GangResult, run_id: str | None = None) -> dict[str, Any]:
        if result.resumed_from_step is not None:
            self.log.info("gangflow: try %d resumed from checkpoint step %d", spec.attempt, result.resumed_from_step)
        elif spec.attempt > 1:
            self.log.info("gangflow: try %d started from step 0 (no committed checkpoint)", spec.attempt)
        if not result.succeeded:
            raise self._failure(spec, result)
        if self._exporter is not None:
            self._exporter.metrics.ended()
        run_id = run_id or spec.env.get("MLFLOW_RUN_ID")
        if not run_id:
            raise UserError(f"gang {spec.name} finished without an MLflow run: its final weights are not in MLflow")
        from trainer.tracking import FINAL_ARTIFACT_PATH  # where rank 0 or the relay logs final/

        return {
            "model_uri": f"runs:/{run_id}/{FINAL_ARTIFACT_PATH}",
            "mlflow_run_id": run_id,
            "dataset_version": spec.dataset_version,
            "world_size": spec.world_size,
            "backend": self.backend,
            "attempt": spec.attempt,
            "resumed_from_step": result.resumed_from_step,
            "gang": spec.name,
        }

    def _failure(self, spec: GangSpec, result: GangResult) -> GangFailure:
        from operators.failures import classify
        from trainer.storage import write_json

        verdict = classify(result.evidence)
        if self._exporter is not None:
            codes = {r["rank"]: r["exit_code"] for r in result.evidence.get("ranks", ()) if isinstance(r.get("rank"), int) and "exit_code" in r}
            self._exporter.metrics.ended(failure_kind=verdict.kind, exit_codes=codes)
        record = {"attempt": spec.attempt, "exit_code": result.exit_code, "verdict": verdict.to_dict(), "evidence": result.evidence}
        write_json(Path(spec.run_dir) / "failures" / f"try-{spec.attempt}.json", record, indent=2, default=str)
        self.log.error("gangflow: %s failure (%s): %s", verdict.kind, "retryable" if verdict.retryable else "not retryable", verdict.reason)
        return _FAILURES[verdict.kind](verdict, evidence=result.evidence, attempt=spec.attempt)

    def on_kill(self) -> None:
        if self._relay is not None:
            self._relay.stop()  # no wait: the thread ends at its next wake (a daemon either way)
        if self._backend is not None:
            self._backend.kill()


def _spec_to_dict(spec: GangSpec) -> dict[str, Any]:
    return {
        "name": spec.name, "run_dir": spec.run_dir, "world_size": spec.world_size, "config_path": spec.config_path,
        "overrides": list(spec.overrides), "env": dict(spec.env), "attempt": spec.attempt,
        "dataset_version": spec.dataset_version,
    }  # fmt: skip


_PROGRESS = re.compile(r"gangflow: progress: step (\d+)/(\d+) \((\d+)%\), loss (\S+), (\d+) samples/s, ETA (\S+), "
                       r"last checkpoint step (\S+)")
_DONE = re.compile(r"gangflow: done: (\d+) steps on \d+ rank")


class ProgressNote:
    """The gang's log function that also keeps rank 0's latest progress line as the XCom `progress`
    of the task (`{step, total, percent, loss, samples_per_sec, eta, last_checkpoint_step}`), at most
    every `every_s`, and `{step, total, percent: 100, done: true}` at rank 0's last line: the task's
    XCom tab in the UI shows it while the gang runs."""

    def __init__(self, ti: Any, log, *, every_s: float = 5.0):
        self.ti, self.log, self.every_s = ti, log, every_s
        self._next = 0.0

    def __call__(self, line: str) -> None:
        self.log(line)
        if "gangflow: done: " in line and (done := _DONE.search(line)):  # the last word, never throttled
            steps = int(done.group(1))
            self._push({"step": steps, "total": steps, "percent": 100, "done": True})
            return
        if "gangflow: progress: " not in line or not (m := _PROGRESS.search(line)):
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        step, total, percent, loss, rate, eta, ckpt = m.groups()
        value = {"step": int(step), "total": int(total), "percent": int(percent),
                 "loss": None if loss == "-" else float(loss.rstrip('",')), "samples_per_sec": int(rate),
                 "eta": eta.rstrip('",'), "last_checkpoint_step": None if ckpt.rstrip('",}') == "none" else int(ckpt.rstrip('",}'))}
        self._push(value)

    def _push(self, value: dict) -> None:
        try:
            self.ti.xcom_push(key="progress", value=value)
        except Exception as exc:  # noqa: BLE001 - progress must never fail the gang
            self.log(f"gangflow: warning: progress not kept in XCom ({type(exc).__name__}: {exc})")
            self.every_s = float("inf")


def pipeline_of(context) -> str | None:
    """The pipeline the DAG names by its tag (`operators.config.pipelines.pipeline_tag`), or None."""
    from operators.config.pipelines import tagged_pipeline

    dag = context.get("dag")
    return tagged_pipeline(getattr(dag, "tags", None) or ()) if dag is not None else None


def try_started_at(ti) -> float | None:
    """Epoch seconds at which this try started, or None when unknown.

    Airflow 3.3's Task SDK gives the task no queued time (`RuntimeTaskInstance` has `start_date`,
    set when the worker started the try; `queued_dttm` stays in the metadata DB), so a gang's
    queue wait is counted from there: the scheduler's queue and pool wait before it is not in it."""
    start = getattr(ti, "start_date", None)
    if not isinstance(start, datetime):
        return None
    if start.tzinfo is None:
        start = start.replace(tzinfo=timezone.utc)
    return start.timestamp()


def gang_task_id(*, backend: str, world_size: int, local_world_sizes) -> str:
    """The training task that runs a gang of this size (the DAG has one per local size)."""
    from operators.backends import available_backends

    if backend != "local":  # one task per other backend, sized by the world_size Param
        if backend not in available_backends():
            raise GangCapacityError(f"backend={backend!r}: accepted values are {', '.join(available_backends())}")
        return f"train_{backend}"
    slots = settings.pool_slots()
    admissible = [n for n in local_world_sizes if n <= slots]
    if world_size not in admissible:
        raise GangCapacityError(
            f"world_size={world_size}: a local gang of {world_size} ranks can never be admitted here "
            f"(pool {settings.TRAINING_POOL} has {slots} slots; accepted values: {', '.join(map(str, admissible))}); "
            "choose one of those or backend 'kubernetes'"
        )
    return f"train_local_{world_size}"
