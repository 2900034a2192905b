"""gangflow's training pipeline: validate -> gang train -> evaluate -> promote.

Parsed often by Airflow: imports only airflow.sdk and gangflow's light operator modules (no
torch, mlflow, great_expectations, dvc or pandas at module level).
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

from operators.callbacks import record_failure
from operators.evaluation import EvaluateModelOperator
from operators.pipeline import (
    DATASET_ASSET_NAME, DATASET_ASSET_URI, NOT_NAN, POOL, check_params, dataset_version_of_run, defaults,
)  # fmt: skip
from operators.promotion import PromoteModelOperator
from operators.retry import ClassifiedRetryPolicy
from operators.training import GangTrainingOperator, gang_task_id
from operators.validation import DatasetValidationOperator

DEFAULTS = defaults()
DATASET = Asset(DATASET_ASSET_NAME, uri=DATASET_ASSET_URI)
MANIFEST = "ti.xcom_pull(task_ids='validate_dataset')"

DOC = """
### gangflow training pipeline

1. **validate_dataset**: resolve the DVC-pinned dataset version, check its bytes against the
   pinned hash, run the Great Expectations suite (Data Docs under the state dir).
2. **admit_gang**: pick the training task for the requested world size and backend, or refuse
   a gang that can never be admitted.
3. **train_local_N** / **train_kubernetes**: a gang of ranks that start together or not at all
   (local: Airflow pool `gangflow_training` with `pool_slots = N`; Kubernetes: Kueue/Volcano).
   Infrastructure failures are retried and resume from the last committed checkpoint; user
   failures fail at once with the reason in the log.
4. **evaluate**: the final weights on the same version's test split, logged to MLflow.
5. **promote**: register the model version and move the `champion` alias only when the
   candidate passes the floor and beats the champion by the minimum improvement.

Runs on a schedule and whenever a new dataset version is published (Asset `gangflow-dataset-digits`).
"""

SCHEDULE = (
    AssetOrTimeSchedule(timetable=CronTriggerTimetable(DEFAULTS.schedule, timezone="UTC"), assets=DATASET)
    if DEFAULTS.schedule
    else DATASET
)


PARAMS = {
    "dataset_version": Param(
        DEFAULTS.dataset_version, type="string", pattern="^[0-9a-f]{32}$",
        title="Dataset version", description="DVC md5 of the dataset (default: the version pinned in dvc.lock).",
    ),
    "world_size": Param(
        DEFAULTS.world_size, type="integer", minimum=1, maximum=256,
        title="World size",
        description="Training processes (ranks); they start together or not at all. On Kubernetes a pod runs "
        "one per GPU (or the runtime's procsPerPod on CPU pods): pods = world size / processes per pod.",
    ),
    "backend": Param(
        "local", type="string", enum=["local", "kubernetes"],
        title="Backend", description="local: torchrun on this machine; kubernetes: a JobSet/Volcano gang.",
    ),
    "max_steps": Param(DEFAULTS.max_steps, type="integer", minimum=1, maximum=10_000_000, title="Max steps"),
    "learning_rate": Param(
        DEFAULTS.learning_rate, type="number", exclusiveMinimum=0, maximum=10, title="Learning rate", **NOT_NAN,
    ),
    "batch_size": Param(
        DEFAULTS.batch_size, type="integer", minimum=1, maximum=65536, title="Global batch size",
        description="Samples per step across all ranks; each rank takes batch_size / world_size.",
    ),
    "checkpoint_every_steps": Param(
        DEFAULTS.checkpoint_every_steps, type="integer", minimum=1, maximum=10_000_000,
        title="Checkpoint every N steps", description="A retry resumes from the last checkpoint: at most this many steps are lost.",
    ),
    "promotion_floor": Param(
        DEFAULTS.promotion_floor, type="number", minimum=0, maximum=1, **NOT_NAN,
        title="Promotion floor", description="Test accuracy a candidate needs at least to be promoted.",
    ),
    "min_improvement": Param(
        DEFAULTS.min_improvement, type="number", minimum=0, exclusiveMaximum=1, **NOT_NAN,
        title="Minimum improvement", description="A candidate must beat the champion's accuracy by more than this.",
    ),
}  # fmt: skip
SCHEMAS = {name: param.schema for name, param in PARAMS.items()}


@dag(
    dag_id="train_pipeline",
    schedule=SCHEDULE,
    catchup=False,
    max_active_runs=1,
    doc_md=DOC,
    tags=["gangflow", "training", "mlops"],
    # Templates render to strings: native rendering would re-parse them as Python literals and
    # turn the valid version 12345678901234567890123456e78901 into inf (and all-digit md5s into
    # ints). Operators convert and check their numeric fields themselves.
    render_template_as_native_obj=False,
    user_defined_macros={"dataset_version_of_run": dataset_version_of_run},
    default_args={
        "retries": DEFAULTS.retries,
        "retry_policy": ClassifiedRetryPolicy(base_delay=timedelta(seconds=DEFAULTS.retry_base_delay_s)),
        "on_failure_callback": record_failure,
    },
    params=PARAMS,
)
def train_pipeline():
    # An Asset-triggered run trains the version its event carries, any other run its Param.
    validate = DatasetValidationOperator(
        task_id="validate_dataset", dataset_version="{{ dataset_version_of_run(params, dag_run) }}"
    )

    @task.branch(task_id="admit_gang")
    def admit_gang(params=None) -> str:
        # What the form's JSON Schema cannot refuse (NaN, 2.0, batch_size vs world_size), before
        # any slot or cluster quota is taken.
        check_params(params, SCHEMAS)
        return gang_task_id(
            backend=params["backend"], world_size=params["world_size"], local_world_sizes=DEFAULTS.local_world_sizes
        )

    overrides = {
        "train.max_steps": "{{ params.max_steps }}",
        "train.lr": "{{ params.learning_rate }}",
        "train.batch_size": "{{ params.batch_size }}",
        "checkpoint.every_steps": "{{ params.checkpoint_every_steps }}",
    }
    gangs = [
        GangTrainingOperator(
            task_id=f"train_local_{n}", world_size=n, backend="local", pool=POOL, pool_slots=n,
            dataset=validate.output, overrides=overrides,
        )
        for n in DEFAULTS.local_world_sizes
    ]  # fmt: skip
    gangs.append(
        GangTrainingOperator(
            task_id="train_kubernetes", world_size="{{ params.world_size }}", backend="kubernetes",
            dataset=validate.output, overrides=overrides,
        )
    )  # fmt: skip

    @task(task_id="training_result", multiple_outputs=True, trigger_rule="none_failed_min_one_success")
    def training_result(ti=None) -> dict:
        """The result of whichever gang task ran (the others were skipped by admit_gang)."""
        results = [r for r in ti.xcom_pull(task_ids=[g.task_id for g in gangs]) or [] if r]
        return results[0]

    training = training_result()
    # The weights travel through MLflow (`model_uri`), the test split by content address.
    evaluate = EvaluateModelOperator(
        task_id="evaluate",
        model_uri=training["model_uri"],
        dataset=validate.output,
        mlflow_run_id=training["mlflow_run_id"],
    )
    promote = PromoteModelOperator(
        task_id="promote",
        model_name=DEFAULTS.model_name,
        model_uri=training["model_uri"],
        dataset=validate.output,
        mlflow_run_id=training["mlflow_run_id"],
        candidate_metrics=evaluate.output,
        floor="{{ params.promotion_floor }}",
        min_improvement="{{ params.min_improvement }}",
        lineage={
            "dataset_version": "{{ " + MANIFEST + "['version'] }}",
            "dataset_md5": "{{ " + MANIFEST + "['train_md5'] }}",
            "train_try_number": training["attempt"],
        },
    )
    admission = admit_gang()
    validate >> admission >> gangs
    gangs >> training
    evaluate >> promote


train_pipeline()
