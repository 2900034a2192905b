"""`platform_baseline`: the platform's own figures, kept and re-measured after every runtime change
(docs/observability.md, "Baselines"): all-reduce bus bandwidth by message size (gloo on CPU, NCCL on
GPU) for 1 rank and N ranks, the DVC remote's read throughput, and the step time of every pipeline's
example model per topology. Each run is recorded in MLflow (experiment `gangflow-baseline`) with the
runtime, image, driver and torch versions, compared with the last accepted baseline, and fails
naming each figure that regressed beyond the threshold.

Runs on demand and whenever the runtime or image changes: an event on the Asset `gangflow-runtime`
(the deployment publishes it when it rolls out a new image). On this machine N ranks share one
host; N pods are measured only on Kubernetes.
"""

from __future__ import annotations

from airflow.sdk import Asset, Param, dag, get_current_context, task

from operators.callbacks import record_failure
from operators.config.pipelines import NOT_NAN

RUNTIME_ASSET = Asset("gangflow-runtime", uri="gangflow://runtime/image")


@dag(
    dag_id="platform_baseline",
    schedule=[RUNTIME_ASSET],
    catchup=False,
    tags=["gangflow", "baseline"],
    doc_md=__doc__,
    default_args={"retries": 0, "on_failure_callback": record_failure},
    params={
        "world_size": Param(2, type="integer", minimum=2, maximum=64, title="N ranks",
                            description="The multi-rank topology measured beside 1 rank (one host here)."),
        "threshold": Param(0.25, type="number", exclusiveMinimum=0, maximum=10, title="Regression threshold", **NOT_NAN,
                           description="A figure regressed when worse than the accepted baseline by more than this fraction."),
        "step_time_steps": Param(30, type="integer", minimum=10, maximum=100_000, title="Steps per step-time run"),
        "pipelines": Param([], type="array", items={"type": "string"}, title="Pipelines",
                           description="Whose example model's step time to measure (empty: every pipeline)."),
    },
)
def platform_baseline():
    @task
    def collectives() -> dict:
        from operators.baseline import measure_collectives

        return measure_collectives(int(get_current_context()["params"]["world_size"]))

    @task
    def storage() -> dict:
        from operators.baseline import measure_storage

        return measure_storage()

    @task
    def step_time() -> dict:
        from operators.baseline import measure_step_time

        params = get_current_context()["params"]
        return measure_step_time(int(params["world_size"]), steps=int(params["step_time_steps"]),
                                 pipelines=list(params["pipelines"]) or None)

    @task
    def record(collective: dict, read: dict, steps: dict) -> dict:
        from operators.baseline import record as record_baseline

        context = get_current_context()
        figures = {**collective, **read, **steps}
        return record_baseline(figures, threshold=float(context["params"]["threshold"]),
                               dag_id=context["dag"].dag_id, dag_run_id=context["run_id"])

    @task
    def check(summary: dict) -> None:
        from operators.baseline import BaselineRegressed, regression_message

        if summary["regressions"]:
            raise BaselineRegressed(regression_message(summary))

    measured = [collectives(), storage(), step_time()]
    measured[0] >> measured[1] >> measured[2]  # one at a time: a measurement must not share the machine
    check(record(*measured))


platform_baseline()
