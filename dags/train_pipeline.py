"""The DAG factory: one training DAG per pipeline file (pipelines/*.yaml, docs/extending.md),
validate -> gang train -> evaluate -> promote, with the file's `dag_id` (default `train_<name>`).

Parsed often by Airflow: imports only airflow.sdk and gangflow's light operator modules (no torch,
mlflow, great_expectations, dvc or pandas at module level). A pipeline is a file, not an edit here.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

from operators.backends import register_backend
from operators.callbacks import record_failure
from operators.config import settings
from operators.evaluation import EvaluateModelOperator
from operators.config.pipelines import (
    DEFAULT_PIPELINE, LAUNCHERS, NOT_NAN, BrokenPipeline, PipelineConfig, PipelineConfigError, add_package_roots,
    check_form_defaults, check_params, dataset_version_of_run, pipeline_files, pipeline_tag,
)  # fmt: skip
from operators.promotion import PromoteModelOperator
from operators.retry import ClassifiedRetryPolicy
from operators.training import GangTrainingOperator, gang_task_id
from operators.validation import DatasetValidationOperator

# training.max_run_time_seconds + this is the gang task's execution_timeout (local and Ray): the ranks'
# SIGTERM grace (60 s) and the task's own work before and after the gang.
RUN_TIME_LIMIT_MARGIN_S = 600
# The form's time limits where the pipeline file sets none (30 days)
LIMIT_CEILING_S = 30 * 24 * 3600

DOC = """
### gangflow pipeline `{name}`: {description}

1. **validate_dataset**: resolve the DVC-pinned version of `{out}`, check its bytes against the
   pinned hash, run the Great Expectations suite `{suite}` (Data Docs under the state dir).
2. **admit_gang**: pick the training task for the requested world size and backend, or refuse
   a gang that can never be admitted.
3. **train_local_N** / **train_<backend>**: a gang of ranks that start together or not at all
   (local: Airflow pool `gangflow_training` with `pool_slots = N`; Kubernetes: Kueue/Volcano).
   Infrastructure failures are retried and resume from the last committed checkpoint; user
   failures fail at once with the reason in the log.
4. **evaluate**: the final weights on the same version's test split ({task}), logged to MLflow.
5. **promote**: register `{model}` and move the `champion` alias only when the candidate's
   `{metric}` ({direction} is better) passes the gate and beats the champion's by the minimum
   improvement.

Runs on a schedule and whenever a new dataset version is published (Asset `{asset}`).
Declared in `{source}`.
"""


def build_params(p: PipelineConfig) -> dict[str, Param]:
    """The trigger form of one pipeline; the gate's bounds follow its metric."""
    metric, bounded = p.metric, {}
    if metric.minimum is not None:
        bounded["minimum"] = metric.minimum
    if metric.maximum is not None:
        bounded["maximum"] = metric.maximum
    span = None if metric.minimum is None or metric.maximum is None else metric.maximum - metric.minimum
    reach = "at least" if metric.higher_is_better else "at most"
    # Before its first `dvc repro` a pipeline has no pinned version: empty then means "pinned",
    # and validate_dataset says how to publish one (Airflow refuses a schedule whose defaults fail).
    version_pattern = "^[0-9a-f]{32}$" if p.dataset_version else "^([0-9a-f]{32})?$"
    return {
        "dataset_version": Param(
            p.dataset_version, type="string", pattern=version_pattern,
            title="Dataset version", description="DVC md5 of the dataset (default: the version pinned in dvc.lock).",
        ),
        "world_size": Param(
            p.world_size, type="integer", minimum=1, maximum=256,
            title="World size",
            description="Training processes (ranks); they start together or not at all. On Kubernetes a pod runs "
            "one per GPU (or the runtime's procsPerPod on CPU pods): pods = world size / processes per pod.",
        ),
        "backend": Param(
            p.default_backend, type="string", enum=p.backend_names,
            title="Backend", description="local: torchrun or mpirun on this machine; kubernetes: a JobSet/Volcano gang; "
            "ray: Ray Train's TorchTrainer on a Ray cluster (a local one, or RAY_ADDRESS)"
            + "".join(f"; {name}: {path}" for name, path in sorted(p.backends.items())) + ".",
        ),
        "launcher": Param(
            p.launcher, type="string", enum=list(LAUNCHERS),
            title="Launcher", description="How the ranks start: torchrun, or Open MPI's mpirun (backend local). "
            "A launcher the backend cannot run is refused before admission.",
        ),
        "max_steps": Param(p.max_steps, type="integer", minimum=1, maximum=10_000_000, title="Max steps"),
        "learning_rate": Param(
            p.learning_rate, type="number", exclusiveMinimum=0, maximum=10, title="Learning rate", **NOT_NAN,
        ),
        "batch_size": Param(
            p.batch_size, type="integer", minimum=1, maximum=65536, title="Global batch size",
            description="Samples per step across all ranks; each rank takes batch_size / world_size.",
        ),
        "checkpoint_every_steps": Param(
            p.checkpoint_every_steps, type="integer", minimum=1, maximum=10_000_000,
            title="Checkpoint every N steps", description="A retry resumes from the last checkpoint: at most this many steps are lost.",
        ) if p.checkpoint_every_steps != "auto" else Param(  # the pipeline's trainer config chooses it (Young/Daly)
            "auto", type="string", pattern=r"^(auto|[1-9][0-9]{0,7})$",
            title="Checkpoint every N steps",
            description="auto: chosen by Young/Daly from the measured save cost and this pipeline's failure rate "
            "(docs/pipeline.md); or an integer: at most this many steps are lost to a retry.",
        ),
        # Airflow fixes a task's execution_timeout when the DAG file is parsed, from the file's run-time
        # limit: the form may tighten that limit, not loosen it (then Airflow's timeout would come first).
        "max_run_time_seconds": _seconds_param(
            p.max_run_time_seconds, p.max_run_time_seconds or LIMIT_CEILING_S, title="Max run time (seconds)",
            description="The longest a try's gang may run; then the ranks commit a final checkpoint and the try fails "
            "naming the limit, not retried. "
            + (f"At most the pipeline file's training.max_run_time_seconds ({p.max_run_time_seconds}), which "
               "Airflow's execution_timeout is built from." if p.max_run_time_seconds else "Empty: no limit."),
        ),
        "max_queue_wait_seconds": _seconds_param(
            p.max_queue_wait_seconds, LIMIT_CEILING_S, title="Max queue wait (seconds)",
            description="Kubernetes: the longest a gang may wait for admission (Kueue, Volcano); then the try fails "
            "with the scheduler's reason and the time waited. Empty: the runtime's admissionTimeoutSeconds.",
        ),
        "promotion_floor": Param(
            p.promotion_floor, type="number", **bounded, **NOT_NAN,
            title="Promotion floor" if metric.higher_is_better else "Promotion ceiling",
            description=f"Test {metric.name} a candidate needs {reach} to be promoted ({metric.direction} is better).",
        ),
        "min_improvement": Param(
            p.min_improvement, type="number", minimum=0, **({"exclusiveMaximum": span} if span else {}), **NOT_NAN,
            title="Minimum improvement",
            description=f"A candidate must beat the champion's {metric.name} by more than this ({metric.direction} is better).",
        ),
    }  # fmt: skip


def _seconds_param(default: int | None, ceiling: int, **text: str) -> Param:
    """A time limit of the form: an integer of seconds, or empty (no limit) where the file sets none."""
    kind = "integer" if default is not None else ["null", "integer"]
    return Param(default, type=kind, minimum=1, maximum=ceiling, **text)


#: Each stage's gangflow operator: a class the pipeline file names (`operators:`) must subclass it.
STAGE_OPERATORS = {
    "validate": DatasetValidationOperator, "train": GangTrainingOperator, "evaluate": EvaluateModelOperator,
    "promote": PromoteModelOperator,
}  # fmt: skip


def operator_classes(p: PipelineConfig) -> dict[str, type]:
    """The operator class of each stage: gangflow's, or the subclass the pipeline file names."""
    import importlib

    classes = dict(STAGE_OPERATORS)
    for stage, path in p.operators.items():
        where = f"{p.source}: operators.{stage}={path!r}"
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as exc:
            raise PipelineConfigError(f"{where}: cannot import {module}: {type(exc).__name__}: {exc}") from None
        except AttributeError:
            raise PipelineConfigError(f"{where}: module {module} has no attribute {name}") from None
        base = STAGE_OPERATORS[stage]
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PipelineConfigError(f"{where}: must be a subclass of {base.__module__}.{base.__name__}")
        classes[stage] = cls
    evaluate = classes["evaluate"]
    # An evaluation entry point reports metrics of its own: promote checks the gated one is there.
    if not p.evaluation_entrypoint and p.metric.name not in evaluate.declared_metrics(p.task):
        raise PipelineConfigError(
            f"{p.source}: metric.name={p.metric.name!r}: {evaluate.__name__} reports "
            f"{', '.join(evaluate.declared_metrics(p.task))} for a {p.task} model (its extra_metrics add to the task's)")
    return classes


def build_error_dag(bad: BrokenPipeline):
    """A DAG standing for a pipeline file that could not be read: its doc and its one task say
    why (file and field); every other pipeline's DAGs load as usual."""
    message = str(bad.error)

    @dag(dag_id=bad.dag_id, schedule=None, catchup=False, tags=["gangflow", "gangflow:pipeline-error", pipeline_tag(bad.name)],
         doc_md=f"### Pipeline file {bad.source} could not be read\n\n```\n{message}\n```\n\nFix the file; "
                "the DAG factory reads it again at the next parse.")  # fmt: skip
    def pipeline_error():
        @task(task_id="pipeline_file_error", retries=0)
        def pipeline_file_error():
            raise PipelineConfigError(message)

        pipeline_file_error()

    return pipeline_error()


def build_pipeline_dag(p: PipelineConfig):
    """The training DAG of one pipeline."""
    classes = operator_classes(p)
    for name, path in p.backends.items():  # selectable by name; imported only when a gang runs
        register_backend(name, path)
    asset = Asset(p.dataset_asset, uri=p.dataset_asset_uri)
    schedule = (
        AssetOrTimeSchedule(timetable=CronTriggerTimetable(p.schedule, timezone="UTC"), assets=asset)
        if p.schedule
        else asset
    )
    params = build_params(p)
    check_form_defaults(p, params)  # before Airflow refuses the DAG, and with it the whole DAG file
    schemas = {name: param.schema for name, param in params.items()}
    doc = DOC.format(name=p.name, description=p.description, out=p.dataset_out, suite=p.suite, task=p.task,
                     model=p.model_name, metric=p.metric.name, direction=p.metric.direction, asset=p.dataset_asset,
                     source=p.source)  # fmt: skip
    allowed = list(p.allowed_models) or None

    @dag(
        dag_id=p.dag_id,
        schedule=schedule,
        catchup=False,
        max_active_runs=1,
        doc_md=doc,
        tags=["gangflow", "training", "mlops", pipeline_tag(p.name)],
        # Templates render to strings: native rendering would re-parse them as Python literals and
        # turn the valid version 12345678901234567890123456e78901 into inf (and all-digit md5s into
        # ints). Operators convert and check their numeric fields themselves.
        render_template_as_native_obj=False,
        user_defined_macros={"dataset_version_of_run": dataset_version_of_run},
        default_args={
            "retries": p.retries,
            "retry_policy": ClassifiedRetryPolicy(base_delay=timedelta(seconds=p.retry_base_delay_s)),
            "on_failure_callback": record_failure,
        },
        params=params,
    )
    def pipeline_dag():
        # An Asset-triggered run trains the version its event carries, any other run its Param.
        validate = classes["validate"](
            task_id="validate_dataset",
            dataset_version="{{ dataset_version_of_run(params, dag_run, %r) }}" % p.dataset_asset,
            suite=p.suite,
            dvc_out=p.dataset_out,
        )

        @task.branch(task_id="admit_gang")
        def admit_gang(params=None) -> str:
            # What the form's JSON Schema cannot refuse (NaN, 2.0, batch_size vs world_size), before
            # any slot or cluster quota is taken.
            check_params(params, schemas)
            return gang_task_id(
                backend=params["backend"], world_size=params["world_size"], local_world_sizes=p.local_world_sizes,
                launcher=params.get("launcher", "torchrun"),
            )

        overrides = {
            "train.max_steps": "{{ params.max_steps }}",
            "train.lr": "{{ params.learning_rate }}",
            "train.batch_size": "{{ params.batch_size }}",
            "checkpoint.every_steps": "{{ params.checkpoint_every_steps }}",
        }
        user_code = p.training_kwargs()  # the package roots and training code of one's own (`training:`), if any
        limits = {"max_preemptions": p.max_preemptions,  # `or ''`: an empty form field (None) renders ""
                  "max_run_time_seconds": "{{ params.max_run_time_seconds or '' }}",
                  "max_queue_wait_seconds": "{{ params.max_queue_wait_seconds or '' }}"}
        # A gang beside the task: Airflow's own timeout comes after gangflow's run-time limit and the
        # ranks' final checkpoint (SIGTERM grace), so the limit, with its reason, always ends it first.
        beside = {"execution_timeout": timedelta(seconds=p.max_run_time_seconds + RUN_TIME_LIMIT_MARGIN_S)} if p.max_run_time_seconds else {}
        gangs = [
            classes["train"](
                task_id=f"train_local_{n}", world_size=n, backend="local", pool=settings.TRAINING_POOL, pool_slots=n,
                launcher="{{ params.launcher }}", dataset=validate.output, overrides=overrides, config_path=p.trainer_config,
                allowed_models=allowed, **limits, **beside, **user_code,
            )
            for n in p.local_world_sizes
        ]  # fmt: skip
        # Pods read the trainer config from their image (/app), so it is named relative to the project.
        in_image = p.trainer_config_in_project or p.trainer_config
        for backend in p.backend_names[1:]:  # every non-local backend: one task, sized by the Param
            gangs.append(
                classes["train"](
                    task_id=f"train_{backend}", world_size="{{ params.world_size }}", backend=backend,
                    launcher="{{ params.launcher }}", dataset=validate.output, overrides=overrides,
                    # a local Ray cluster's workers read the config where this machine has it
                    config_path=p.trainer_config if backend == "ray" else in_image, allowed_models=allowed,
                    **limits, **(beside if backend == "ray" else {}), **user_code,
                )
            )  # fmt: skip

        @task(task_id="training_result", multiple_outputs=True, trigger_rule="none_failed_min_one_success")
        def training_result(ti=None) -> dict:
            """The result of whichever gang task ran (the others were skipped by admit_gang)."""
            results = [r for r in ti.xcom_pull(task_ids=[g.task_id for g in gangs]) or [] if r]
            return results[0]

        training = training_result()
        # The weights travel through MLflow (`model_uri`), the test split by content address.
        evaluate = classes["evaluate"](
            task_id="evaluate",
            model_uri=training["model_uri"],
            dataset=validate.output,
            mlflow_run_id=training["mlflow_run_id"],
            allowed_models=allowed,
            data_factory=p.data_factory,
            evaluation_entrypoint=p.evaluation_entrypoint,
        )
        promote = classes["promote"](
            task_id="promote",
            model_name=p.model_name,
            model_uri=training["model_uri"],
            dataset=validate.output,
            mlflow_run_id=training["mlflow_run_id"],
            candidate_metrics=evaluate.output,
            floor="{{ params.promotion_floor }}",
            min_improvement="{{ params.min_improvement }}",
            metric=p.metric.name,
            direction=p.metric.direction,
            metric_bounds=(p.metric.minimum, p.metric.maximum),
            allowed_models=allowed,
            data_factory=p.data_factory,
            evaluation_entrypoint=p.evaluation_entrypoint,
            lineage={"train_try_number": training["attempt"]},  # the dataset's lineage: from the manifest
        )
        admission = admit_gang()
        validate >> admission >> gangs
        gangs >> training
        evaluate >> promote

    return pipeline_dag(), params, schemas


FILES = pipeline_files()
PIPELINES = FILES.configs
for _config in PIPELINES.values():  # the user's packages import in this process (tasks included)
    add_package_roots(_config.package_roots)
for _bad in FILES.broken.values():
    globals()[_bad.dag_id] = build_error_dag(_bad)
for _config in PIPELINES.values():
    try:
        _dag, _params, _schemas = build_pipeline_dag(_config)
    except Exception as _exc:  # noqa: BLE001 - e.g. an operator class that is not the stage's: this pipeline only
        if not isinstance(_exc, PipelineConfigError):  # a user module failing at import, Airflow refusing the DAG
            _exc = PipelineConfigError(f"{_config.source}: {type(_exc).__name__}: {_exc}")
        _bad = BrokenPipeline(_config.name, _config.source, _config.dag_id, _exc)
        globals()[_bad.dag_id] = build_error_dag(_bad)
        continue
    globals()[_config.dag_id] = _dag
    if _config.name == DEFAULT_PIPELINE:  # the digits DAG's form, as tests and tools import it
        PARAMS, SCHEMAS = _params, _schemas
