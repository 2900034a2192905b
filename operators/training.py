"""`GangTrainingOperator`: run one gang of training ranks through a backend.

Subclass it to change what a gang runs (override `build_spec`) or where (pass another backend,
or register your own with `operators.backends.register_backend`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

from trainer.console import LOG_FORMAT_ENV, log_format

from operators import checkpoint_history, failure_context
from operators.config import settings
from operators.config.pipelines import DEFAULT_MAX_PREEMPTIONS  # training.max_preemptions's default
from operators.backends import GangResult, GangSpec, check_combination, get_backend
from operators.backends.base import is_count, user_code_args
from operators.links import DashboardLink, KubernetesObjectLink, MlflowRunLink
from operators.failures.preemption import PREEMPTIONS_FILE, recorded_preemptions
from operators.exceptions import (
    GangCapacityError, GangConfigError, GangFailure, InfraFailure, InvalidParams, UnknownFailure, UserError, UserFailure,
)  # fmt: skip
from trainer.checks import is_integer

_FAILURES: dict[str, type[GangFailure]] = {"infra": InfraFailure, "user": UserFailure, "unknown": UnknownFailure}


def gang_name(dag_id: str, run_id: str) -> str:
    """A DNS-1123 label unique per DAG run (across deployments too) and stable across its tries:
    the DAG id for humans (at most 40 characters) plus 64 bits of the run's identity
    (`settings.run_identity`, as the local run dir's `settings.run_key`): at most 57 characters."""
    digest = settings.run_identity(dag_id, run_id)[:16]
    stem = re.sub(r"[^a-z0-9-]+", "-", dag_id.lower()).strip("-")[:40].strip("-") or "gang"
    return f"{stem}-{digest}"


def seconds_limit(field: str, value: Any, error: type[Exception] = InvalidParams) -> int | None:
    """A time limit in seconds as given, or as a Param template rendered it (`""`: no limit)."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,9}", value):
        value = int(value)
    if not is_count(value, 1):
        raise error(f"{field}={value!r}: accepted values: an integer >= 1 (seconds), or None for no limit")
    return value


def _is_template(value: Any) -> bool:
    return isinstance(value, str) and "{{" in value


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
    :param backend: `local`, `kubernetes` or `ray` (see `operators.backends`).
    :param launcher: how the ranks start: `torchrun` or `mpirun` (Open MPI; local backend). A
        launcher the backend cannot run is refused before the gang is created, naming both.
    :param backend_options: keyword arguments of the backend's constructor.
    :param config_path: the trainer's params file.
    :param experiment: MLflow experiment of the training run.
    :param run_dir: where checkpoints and final weights go (default: one folder per DAG run
        under the state dir).
    :param allowed_models: `module:function` model factories the pipeline allows (templated): the
        logged model's signature carries the card's factory when allowed, so it serves standalone.
    :param entrypoint: training code of one's own instead of gangflow's loop: `module:function`,
        called in every rank with `entrypoint_kwargs` (docs/extending.md, "Bring your own training script").
    :param command: or a command run under torchrun: `[python, -m, module, ARGS...]` or
        `[python, script.py, ARGS...]` (a script inside the project).
    :param package_roots: folders of the project put first on the ranks' PYTHONPATH (the pods':
        below the image's /app).
    :param max_preemptions: how many preemptions of this DAG run's gang (Kueue eviction,
        `DisruptionTarget`, node drain, SIGTERM then final checkpoint: `operators.failures.preemption`)
        the task re-launches itself, from the last committed checkpoint, without spending one of
        Airflow's retries; past it a preemption is judged as the `infra` failure it was before.
    :param max_run_time_seconds: the longest this try's gang may run, counted from its first launch
        (templated: the trigger form's Param, at most the pipeline file's `training.max_run_time_seconds`;
        None or "": no limit). Past it the gang is stopped with SIGTERM, so the ranks commit a final
        checkpoint, and the try fails as the user's (not retried), naming the limit; on Kubernetes
        the pods' `activeDeadlineSeconds` (a TrainJob's own).
    :param max_queue_wait_seconds: the longest the gang may wait for admission where it queues
        (templated: the trigger form's Param, by default the pipeline file's
        `training.max_queue_wait_seconds`; Kubernetes: instead of the runtime's
        `admissionTimeoutSeconds`). The local and Ray gangs do not queue: Airflow's pool does.
    :returns: (XCom) `model_uri` (`models:/<model_id>`: this task logs the run's `final/` once, after
        the gang, as the MLflow run's LoggedModel: a signed pyfunc with gangflow's installed loader,
        `operators.registry.versions.log_final_model`; evaluate scores it and promote registers
        that URI, never a worker path),
        `mlflow_run_id`, `dataset_version`, `world_size`, `backend`, `launcher`, `attempt`,
        `resumed_from_step`, `gang`, `preemptions` (how many, this DAG run) and `preemption_reasons`.
    """

    template_fields = (
        "world_size", "dataset", "overrides", "backend", "launcher", "backend_options", "config_path", "run_dir", "experiment",
        "allowed_models", "max_run_time_seconds", "max_queue_wait_seconds",
    )  # fmt: skip
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
        launcher: str = "torchrun",
        backend_options: Mapping[str, Any] | None = None,
        config_path: str | None = None,
        experiment: str = "gangflow",
        run_dir: str | None = None,
        allowed_models: list[str] | None = None,
        entrypoint: str | None = None,
        entrypoint_kwargs: Mapping[str, Any] | None = None,
        command: Sequence[str] | None = None,
        package_roots: Sequence[str] = (),
        max_preemptions: int = DEFAULT_MAX_PREEMPTIONS,
        max_run_time_seconds: int | str | None = None,
        max_queue_wait_seconds: int | str | None = None,
        **kwargs,
    ):
        kwargs.setdefault("multiple_outputs", True)  # `train.output["model_uri"]` in a DAG of one's own
        super().__init__(**kwargs)
        self.allowed_models = allowed_models
        # Checked here, when the DAG file is parsed: a bad value never reaches a gang.
        self.user_code = user_code_args(entrypoint=entrypoint, kwargs=entrypoint_kwargs, command=command,
                                        project_root=settings.PROJECT_ROOT)
        self.package_roots = tuple(package_roots)
        self.world_size = world_size
        self.dataset = dataset
        self.overrides = dict(overrides or {})
        self.backend = backend
        self.launcher = launcher
        self.backend_options = dict(backend_options or {})
        self.config_path = config_path
        self.experiment = experiment
        self.run_dir = run_dir
        self._backend = None
        self._relay = None
        self._exporter = None
        self.link_urls: dict[str, str] = {}  # the extra links' URLs, by link key (operators/links.py)
        if not is_count(max_preemptions, 0):
            raise ValueError(f"max_preemptions={max_preemptions!r}: accepted values: an integer >= 0 (preemptions "
                             "re-launched without spending a retry; 0: every preemption spends one)")
        self.max_preemptions = max_preemptions
        # a template (a trigger-form Param) is checked once rendered, in build_spec
        self.max_run_time_seconds = max_run_time_seconds if _is_template(max_run_time_seconds) else \
            seconds_limit("max_run_time_seconds", max_run_time_seconds, ValueError)
        self.max_queue_wait_seconds = max_queue_wait_seconds if _is_template(max_queue_wait_seconds) else \
            seconds_limit("max_queue_wait_seconds", max_queue_wait_seconds, ValueError)
        self._first_launch: float | None = None  # monotonic time of this try's first launch (the limit's start)
        self.preemptions: list[str] = []  # why each preemption of this DAG run's gang happened
        self.pauses = 0  # pauses and resumes of this DAG run's gang (`python -m operators.cli.gang`)
        self.dispatched_to: str | None = None  # MultiKueue: the worker cluster that ran the gang
        self._killed = False

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
        run_dir = self.run_dir or str(settings.run_dir(dag_id, run_id))
        config_path = self.config_path or str(settings.trainer_config_path())
        # checkpoint.every_steps: auto: the save cost and MTBF this pipeline saw, for the ranks
        env |= checkpoint_history.gang_env(config_path=config_path, overrides=overrides, dag_id=dag_id,
                                           experiment=self.experiment, log=self.log.info)
        return GangSpec(
            name=env["GANGFLOW_GANG"],
            run_dir=run_dir,
            world_size=int(self.world_size),
            config_path=config_path,
            overrides=tuple(format_override(k, v) for k, v in sorted(overrides.items())),
            env=env,
            attempt=ti.try_number,
            dataset_version=version,
            user_code=self.user_code,
            package_roots=self.package_roots,
            launcher=self.launcher,
            avoid_nodes=failure_context.nodes_to_avoid(run_dir, ti.try_number),
            max_run_time_s=seconds_limit("max_run_time_seconds", self.max_run_time_seconds),
            max_queue_wait_s=seconds_limit("max_queue_wait_seconds", self.max_queue_wait_seconds),
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

        tags = {"gangflow.gang": spec.name, "gangflow.backend": str(self.backend), "gangflow.launcher": spec.launcher,
                # the link to the run's Prometheus series (docs/observability.md)
                "gangflow.metrics_query": metrics_query(run_id)}
        if (dashboard := settings.dashboard_url(run_id)) is not None:
            tags["gangflow.dashboard_url"] = dashboard
        if spec.dataset_version:
            tags["gangflow.dataset_version"] = spec.dataset_version
        identity = _training_identity(spec)
        if identity:  # the failure context finds earlier runs of the same code+config+data by it
            tags[failure_context.IDENTITY_TAG] = identity
        client = client or tracking.get_client()
        with tracking.mlflow_errors(tracking.client_uri(client), f"tag MLflow run {run_id}"):
            for key, value in tags.items():
                client.set_tag(run_id, key, value)

    # -- running it ----------------------------------------------------------------------------

    def execute(self, context):
        self._airflow_context = context
        check_combination(self.backend, self.launcher, user_code=bool(self.user_code))
        self._backend = get_backend(self.backend, **self.backend_options)
        if getattr(self._backend, "relay_tracking", False):
            return self._execute_relayed(context)
        spec = self.build_spec(context, mlflow_run_id=self.mlflow_run(context))
        self._backend.check_capacity(spec)
        self.tag_lineage(spec)
        Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
        self.preemptions = recorded_preemptions(spec.run_dir)
        self.log.info("gang %s: %d ranks, run dir %s, try %d", spec.name, spec.world_size, spec.run_dir, spec.attempt)
        if self._backend.deferrable:
            handle = self._backend.submit(spec)
            KubernetesObjectLink().push(self, context["ti"], settings.kubernetes_object_url(
                str(handle.get("namespace", "")), str(handle.get("kind", "")), str(handle.get("name", ""))))
            self.defer(
                trigger=self._backend.trigger(handle),
                method_name="execute_complete",
                kwargs={"handle": handle, "spec": _spec_to_dict(spec), "links": dict(self.link_urls),
                        "preemptions": list(self.preemptions)},
            )
        note = ProgressNote(context["ti"], self.log.info)
        result = self.run_through_preemptions(spec, lambda: self._run_gang(spec, note))
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
        self.preemptions = recorded_preemptions(spec.run_dir)
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
                                    on_fatal=lambda exc: self._stop_gang(), log_final=self.log_final_model,
                                    observers=(exporter.observe,) if exporter is not None else ()).start()
        self.log.info("gang %s: %d ranks, run dir %s, try %d", spec.name, spec.world_size, spec.run_dir, spec.attempt)
        try:
            try:
                note = ProgressNote(context["ti"], self.log.info)
                result = self.run_through_preemptions(spec, lambda: self._run_gang(spec, note))
            except BaseException:
                self._relay.stop()
                raise
            run_id = self._relay.finish(succeeded=result.succeeded, final_dir=Path(spec.run_dir) / "final")
            return self._finish(spec, result, run_id, self._relay.model_uri)
        finally:
            if exporter is not None:
                exporter.close()

    def execute_complete(self, context, event: dict[str, Any], handle: dict[str, Any], spec: dict[str, Any],
                         links: dict[str, str] | None = None, preemptions: list[str] | None = None, pauses: int = 0):
        self._airflow_context = context
        self.link_urls.update(links or {})  # this process is new: the URLs learnt before the deferral
        self.preemptions = list(preemptions or [])
        self.pauses = pauses + int(event.get("pauses") or 0)  # `python -m operators.cli.gang pause`, then resume
        if self.pauses:
            self.log.info("gangflow: the gang was paused and resumed %d time(s) in this DAG run (no retry spent)", self.pauses)
        self.dispatched_to = event.get("dispatched_to")
        if self.dispatched_to:
            self.log.info("gangflow: MultiKueue dispatched the gang to worker cluster %r", self.dispatched_to)
        self._backend = backend = get_backend(self.backend, **self.backend_options)
        gang = GangSpec(**spec)
        result = backend.collect(handle, event)
        if not result.succeeded and self._preempted(gang, result):
            # The same try defers again on a new gang (the evicted one was deleted by collect):
            # Airflow's try number, and so the retry budget, does not move.
            handle = backend.resubmit(gang)
            self.defer(trigger=backend.trigger(handle), method_name="execute_complete",
                       kwargs={"handle": handle, "spec": spec, "links": dict(self.link_urls),
                               "preemptions": list(self.preemptions), "pauses": self.pauses})
        return self._finish(gang, result)

    def _run_gang(self, spec: GangSpec, note) -> GangResult:
        """`backend.run` of one gang (a process beside this task). Past `max_run_time_s`, counted from
        this try's first launch, the gang is stopped as on_kill stops it (SIGTERM: the ranks commit a
        final checkpoint) and its evidence says why, as a pod's DeadlineExceeded does on Kubernetes."""
        if spec.max_queue_wait_s and self._first_launch is None:
            self.log.info("gangflow: training.max_queue_wait_seconds=%d bounds the wait where a gang queues (Kubernetes); "
                          "a %s gang waits in Airflow's pool before this task starts, which it does not bound",
                          spec.max_queue_wait_s, self.backend)
        self._first_launch = self._first_launch or time.monotonic()
        limit = spec.max_run_time_s
        if limit is None:
            return self._counted(self._backend.run(spec, note))
        reached, ended = threading.Event(), threading.Event()

        def watch() -> None:  # paused time (`python -m operators.cli.gang pause --local`) does not count
            while not ended.wait(max(0.05, min(1.0, limit - self._run_time()))):
                if self._run_time() >= limit:
                    reached.set()
                    self.log.warning("gangflow: training.max_run_time_seconds=%d reached: stopping the gang (SIGTERM: "
                                     "the ranks commit a final checkpoint)", limit)
                    self._backend.kill()
                    return

        threading.Thread(target=watch, name="run-time-limit", daemon=True).start()
        try:
            result = self._counted(self._backend.run(spec, note))
        finally:
            ended.set()
        if result.succeeded or not reached.is_set():
            return result
        from trainer.checkpoint_commit import committed_steps

        steps = committed_steps(Path(spec.run_dir) / "checkpoints")
        saved = f"the newest committed checkpoint is step {steps[0]}" if steps else "no checkpoint was committed"
        # the verdict's reason keeps about 170 characters of this: what to do comes before the detail
        message = (f"training.max_run_time_seconds={limit} reached after {self._run_time():.0f}s; "
                   f"{saved}; not retried: raise the limit or clear the task to resume (the gang was stopped with "
                   "SIGTERM: each rank commits a final checkpoint)")
        return dataclasses.replace(result, evidence={**result.evidence, "termination_reason": "DeadlineExceeded",
                                                     "pod_message": message})

    def _run_time(self) -> float:
        """Seconds since this try's first launch, less the time the gang spent paused."""
        return time.monotonic() - self._first_launch - getattr(self._backend, "paused_s", 0.0)

    def _counted(self, result: GangResult) -> GangResult:
        """`result`, its pauses added to this DAG run's."""
        if result.pauses:
            self.pauses += result.pauses
            self.log.info("gangflow: the gang was paused and resumed %d time(s) in this DAG run (no retry spent)", self.pauses)
        return result

    # -- preemption: re-launched, no retry spent ---------------------------------------------

    def run_through_preemptions(self, spec: GangSpec, run) -> GangResult:
        """`run()` (one gang, to its end) again after each preemption within the budget; the last result."""
        while True:
            result = run()
            if result.succeeded or not self._preempted(spec, result):
                return result

    def _preempted(self, spec: GangSpec, result: GangResult) -> bool:
        """Whether the ended gang was preempted within the budget (then recorded): re-launch it."""
        from operators.failures.preemption import preemption_reason

        reason = preemption_reason(result.evidence)
        if reason is None or self._killed:  # the task itself was stopped: not the cluster's doing
            return False
        if len(self.preemptions) >= self.max_preemptions:
            self.log.warning("gangflow: preempted again (%s), past max_preemptions=%d (training.max_preemptions): "
                             "judged as a failure, which spends a retry", reason, self.max_preemptions)
            return False
        self.preemptions.append(reason)
        self.log.warning("gangflow: preempted (%d of at most %d): %s; re-launching the gang, which resumes from its "
                         "last committed checkpoint (no retry spent)", len(self.preemptions), self.max_preemptions, reason)
        from trainer.storage import write_json

        try:  # the next try counts them against the budget; the task goes on without it
            write_json(Path(spec.run_dir) / PREEMPTIONS_FILE, {"reasons": self.preemptions}, indent=2)
        except OSError as exc:
            self.log.warning("gangflow: preemptions not recorded in the run dir (%s: %s)", type(exc).__name__, exc)
        self._push_preemptions()
        return True

    def _push_preemptions(self) -> None:
        """The XComs `preemptions` and `preemption_reasons` while the task still runs."""
        ti = (getattr(self, "_airflow_context", None) or {}).get("ti")
        try:
            ti.xcom_push(key="preemptions", value=len(self.preemptions))
            ti.xcom_push(key="preemption_reasons", value=list(self.preemptions))
        except Exception as exc:  # noqa: BLE001 - the log and the result say it too
            self.log.info("gangflow: preemptions not kept in XCom (%s: %s)", type(exc).__name__, exc)

    def _tag_preemptions(self, run_id: str | None) -> None:
        """The MLflow run's tags `gangflow.preemptions` (how many) and `gangflow.preemption_reasons` (JSON)."""
        if not run_id or not self.preemptions:
            return
        try:
            from operators.hooks import mlflow as tracking

            client = tracking.get_client()
            client.set_tag(run_id, "gangflow.preemptions", str(len(self.preemptions)))
            client.set_tag(run_id, "gangflow.preemption_reasons", json.dumps(self.preemptions)[:5000])
        except Exception as exc:  # noqa: BLE001 - the task log and XCom carry them as well
            self.log.info("gangflow: cannot tag the preemptions on run %s: %s", run_id, exc)

    def log_final_model(self, client, run_id: str, final_dir: Path) -> str:
        """Log `final_dir` as the run's one LoggedModel (signed, installed loader); its model id."""
        from operators.registry.versions import input_schema, log_final_model

        manifest = json.loads(self.dataset) if isinstance(self.dataset, str) else (self.dataset or {})
        schema = manifest.get("schema") if isinstance(manifest, Mapping) else None
        return log_final_model(client, run_id, final_dir, allowed_models=self.allowed_models or None,
                               schema=input_schema(schema) if isinstance(schema, Mapping) and schema else None)

    def _log_remote_final(self, run_id: str) -> str:
        """A gang elsewhere (rank 0 put `final/` among the run's artifacts): log it as the run's model."""
        import tempfile

        from operators.hooks import mlflow as tracking
        from operators.registry.versions import download_model
        from trainer.tracking import FINAL_ARTIFACT_PATH

        client = tracking.get_client()
        with tempfile.TemporaryDirectory(prefix="gangflow-final-") as tmp:
            final_dir = download_model(client, f"runs:/{run_id}/{FINAL_ARTIFACT_PATH}", tmp)
            return f"models:/{self.log_final_model(client, run_id, final_dir)}"

    def _finish(self, spec: GangSpec, result: GangResult, run_id: str | None = None,
                model_uri: str | None = None) -> dict[str, Any]:
        if result.resumed_from_step is not None:
            self.log.info("gangflow: try %d resumed from checkpoint step %d", spec.attempt, result.resumed_from_step)
        elif spec.attempt > 1 and result.start_step_known:
            self.log.info("gangflow: try %d started from step 0 (no committed checkpoint)", spec.attempt)
        elif spec.attempt > 1:
            self.log.info("gangflow: try %d: rank 0's log says which checkpoint it resumed from ('resuming from checkpoint')",
                          spec.attempt)
        if self.preemptions:
            self.log.info("gangflow: %d preemption(s) in this DAG run: %s", len(self.preemptions), "; ".join(self.preemptions))
        if not result.succeeded:
            raise self._failure(spec, result, run_id)
        if self._exporter is not None:
            self._exporter.metrics.ended()
        run_id = run_id or spec.env.get("MLFLOW_RUN_ID")
        self._tag_preemptions(run_id)
        self._tag_reached_step(run_id, _final_steps(spec))
        if not run_id:
            raise UserError(f"gang {spec.name} finished without an MLflow run: its final weights are not in MLflow")
        return {
            "model_uri": model_uri or self._log_remote_final(run_id),
            "mlflow_run_id": run_id,
            "dataset_version": spec.dataset_version,
            "world_size": spec.world_size,
            "backend": self.backend,
            "launcher": spec.launcher,
            "attempt": spec.attempt,
            "resumed_from_step": result.resumed_from_step,
            "gang": spec.name,
            "preemptions": len(self.preemptions),
            "preemption_reasons": list(self.preemptions),
            "pauses": self.pauses,
            "dispatched_to": self.dispatched_to,
        }

    def _failure(self, spec: GangSpec, result: GangResult, run_id: str | None = None) -> GangFailure:
        from operators.failures import classify
        from trainer.storage import write_json

        run_id = run_id or spec.env.get("MLFLOW_RUN_ID")
        self._tag_preemptions(run_id)
        context = self._failure_context(spec, result, run_id)
        verdict = classify({**result.evidence, "context": context})
        if context.get("node"):
            failure_context.record_node_failure(context["node"], gang=spec.name, kind=verdict.kind)
        for node in verdict.exclude_nodes:
            if self.backend == "kubernetes":  # GangSpec.avoid_nodes of the next try
                self.log.warning("gangflow: node %s is suspect (%s); the retry's pods will not be placed on it",
                                 node, "; ".join(verdict.context))
            else:  # one machine: nothing to place elsewhere, the suspect node is named for the operator
                self.log.warning("gangflow: node %s is suspect (%s); backend %s cannot exclude it from the retry: noted",
                                 node, "; ".join(verdict.context), self.backend)
        failed_at = failure_context.failed_step(result.evidence)
        self._tag_reached_step(run_id, failed_at - 1 if failed_at else None)  # the steps before it passed
        if self._exporter is not None:
            codes = {r["rank"]: r["exit_code"] for r in result.evidence.get("ranks", ()) if isinstance(r.get("rank"), int) and "exit_code" in r}
            self._exporter.metrics.ended(failure_kind=verdict.kind, exit_codes=codes)
        record = {"attempt": spec.attempt, "exit_code": result.exit_code, "verdict": verdict.to_dict(),
                  "evidence": result.evidence, "context": context}  # fmt: skip
        write_json(Path(spec.run_dir) / "failures" / f"try-{spec.attempt}.json", record, indent=2, default=str)
        self.log.error("gangflow: %s failure (%s): %s", verdict.kind, "retryable" if verdict.retryable else "not retryable", verdict.reason)
        return _FAILURES[verdict.kind](verdict, evidence=result.evidence, attempt=spec.attempt)

    def _failure_context(self, spec: GangSpec, result: GangResult, run_id: str | None) -> dict[str, Any]:
        """Contract 4's `context` (`operators.failure_context`); what cannot be looked up is left out."""
        from operators.retry import evidence_signature, recurrences

        history = None
        identity = _training_identity(spec)
        if identity and run_id:
            try:
                from operators.hooks import mlflow as tracking

                client = tracking.get_client()
                experiment_id = client.get_run(run_id).info.experiment_id
                history = failure_context.passed_step(client, experiment_id, identity, exclude_run=run_id)
            except Exception as exc:  # noqa: BLE001 - history is an aid: without it nothing is claimed
                self.log.info("gangflow: no run history for the failure context: %s", exc)
        airflow_context = getattr(self, "_airflow_context", None)
        return failure_context.gather(
            result.evidence, gang=spec.name, node=str(result.evidence.get("node") or _local_node(self.backend)),
            resumed_from_step=result.resumed_from_step, history=history,
            recurrences=recurrences(airflow_context, spec.attempt, evidence_signature(result.evidence)),
            oom_kills=result.oom_kills,
        )  # fmt: skip

    def _tag_reached_step(self, run_id: str | None, step: int | None) -> None:
        """The furthest step this try passed, on its MLflow run: a later failure's history."""
        if not run_id or step is None or step <= 0:
            return
        try:
            from operators.hooks import mlflow as tracking

            client = tracking.get_client()
            current = client.get_run(run_id).data.tags.get(failure_context.REACHED_STEP_TAG, "")
            if not current.isdigit() or int(current) < step:
                client.set_tag(run_id, failure_context.REACHED_STEP_TAG, str(step))
        except Exception as exc:  # noqa: BLE001 - a missing tag only weakens a later judgement
            self.log.info("gangflow: cannot tag the reached step on run %s: %s", run_id, exc)

    def _stop_gang(self) -> None:
        """Stop the gang for good: its SIGTERM ending (exit 75) is then no preemption to re-launch."""
        self._killed = True
        self._backend.kill()

    def on_kill(self) -> None:
        self._killed = True  # the gang's SIGTERM ending is then no preemption to re-launch
        if self._relay is not None:
            self._relay.stop()  # no wait: the thread ends at its next wake (a daemon either way)
        if self._backend is not None:
            self._backend.kill()


def _training_identity(spec: GangSpec) -> str | None:
    """`failure_context.training_identity` of a spec: its trainer config file, overrides, data
    version and gangflow's version (the code); None when the config file cannot be read."""
    try:
        config = Path(spec.config_path).read_bytes()
    except OSError:
        return None
    from importlib import metadata

    try:
        code = metadata.version("gangflow")
    except metadata.PackageNotFoundError:
        code = ""
    return failure_context.training_identity(config_bytes=config, overrides=spec.overrides,
                                             dataset_version=spec.dataset_version, code=code)  # fmt: skip


def _local_node(backend: str) -> str:
    """The node a local gang ran on: this host. Other backends put the node in the evidence."""
    import platform

    return platform.node() if backend == "local" else ""


def _final_steps(spec: GangSpec) -> int | None:
    """The steps the finished gang made, from its model card."""
    from trainer.model_card import FINAL, read_card

    steps = read_card(Path(spec.run_dir) / FINAL).get("steps")
    return steps if is_integer(steps) else None


def _spec_to_dict(spec: GangSpec) -> dict[str, Any]:
    """The spec as the deferral's JSON kwargs (`GangSpec(**d)` rebuilds it): every field, tuples as lists."""
    out: dict[str, Any] = {}
    for item in dataclasses.fields(spec):
        value = getattr(spec, item.name)
        out[item.name] = list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, Mapping) else value
    return out


# Progress.tick's words: a total only when known, a rate in samples (gangflow's loop) or steps (a user loop)
_PROGRESS = re.compile(r"gangflow: progress: step (\d{1,12})(?:/(\d{1,12}) \((\d{1,4})%\))?, loss (\S{1,40}), "
                       r"(\d{1,15}) (samples|steps)/s, ETA (\S{1,40}), last checkpoint step (\S{1,40})")
_DONE = re.compile(r"gangflow: done: (\d{1,12}) steps on \d+ rank")
_RANK0 = "[rank 0] "  # the backends' prefix of rank 0's lines


class ProgressNote:
    """The gang's log function that also keeps rank 0's latest progress line as the XCom `progress`
    of the task (`{step, total, percent, loss, samples_per_sec | steps_per_sec, eta,
    last_checkpoint_step}`), at most every `every_s`, and `{step, total, percent: 100, done: true}` at
    rank 0's last line: the task's XCom tab in the UI shows it while the gang runs. Other ranks' lines,
    and lines it cannot read, are only logged."""

    def __init__(self, ti: Any, log, *, every_s: float = 5.0):
        self.ti, self.log, self.every_s = ti, log, every_s
        self._next = 0.0

    def __call__(self, line: str) -> None:
        self.log(line)
        if not line.startswith(_RANK0):
            return
        if "gangflow: done: " in line and (done := _DONE.search(line)):  # the last word, never throttled
            steps = int(done.group(1))
            self._push({"step": steps, "total": steps, "percent": 100, "done": True})
            return
        if "gangflow: progress: " not in line or not (m := _PROGRESS.search(line)):
            return
        now = time.monotonic()
        if now < self._next:
            return
        step, total, percent, loss, rate, unit, eta, ckpt = m.groups()
        loss, ckpt = loss.rstrip('",'), ckpt.rstrip('",}')
        try:
            value = {"step": int(step), "total": int(total) if total else None, "percent": int(percent) if percent else None,
                     "loss": None if loss == "-" else float(loss), f"{unit}_per_sec": int(rate), "eta": eta.rstrip('",'),
                     "last_checkpoint_step": None if ckpt == "none" else int(ckpt)}
        except ValueError:  # a line that only looks like one: not progress
            return
        self._next = now + self.every_s
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


def gang_task_id(*, backend: str, world_size: int, local_world_sizes, launcher: str | None = None) -> str:
    """The training task that runs a gang of this size (the DAG has one per local size)."""
    from operators.backends import available_backends

    if backend not in available_backends():
        raise GangCapacityError(f"backend={backend!r}: accepted values are {', '.join(available_backends())}")
    if launcher is not None:
        check_combination(backend, launcher)
    if backend != "local":  # one task per other backend, sized by the world_size Param
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
