"""The run-time Param checks of `train_pipeline` (admit_gang) and the version a run trains, against
the DAG's own Param schemas and Airflow's own DagRun/asset-event models (fast: no DAG run)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from airflow.sdk.api.datamodels._generated import AssetEventDagRunReference

from operators.exceptions import InvalidParams
from operators.config.pipelines import DATASET_ASSET_NAME, DATASET_ASSET_URI, check_params, dataset_version_of_run


NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def schemas(dag_module) -> dict:
    return dag_module.SCHEMAS


GOOD = {"world_size": 2, "batch_size": 64, "max_steps": 60, "checkpoint_every_steps": 10, "learning_rate": 0.05,
        "promotion_floor": 0.8, "min_improvement": 0.0, "backend": "local"}  # fmt: skip


def test_good_params_pass(schemas):
    check_params(GOOD, schemas)


@pytest.mark.parametrize("limit", [None, 1, 600])
def test_the_time_limits_may_be_empty_where_the_pipeline_file_sets_none(schemas, limit):
    check_params(GOOD | {"max_run_time_seconds": limit, "max_queue_wait_seconds": limit}, schemas)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"learning_rate": NAN}, "learning_rate=nan: must be a finite number"),
        ({"promotion_floor": NAN}, "promotion_floor=nan: must be a finite number"),
        ({"min_improvement": NAN}, "min_improvement=nan: must be a finite number"),
        ({"learning_rate": INF}, "learning_rate=inf: must be a finite number"),
        ({"world_size": 2.0}, "world_size=2.0: must be an integer"),
        ({"max_steps": 60.0}, "max_steps=60.0: must be an integer"),
        ({"batch_size": True}, "batch_size=True: must be an integer"),
        ({"checkpoint_every_steps": 10.5}, "checkpoint_every_steps=10.5: must be an integer"),
        ({"batch_size": 63}, "batch_size=63 is not a multiple of world_size=2"),
        ({"world_size": 8, "batch_size": 100}, "e.g. batch_size 96 or 104"),
        ({"world_size": 4, "batch_size": 3}, "e.g. batch_size 4"),
        ({"world_size": 0}, "world_size=0: out of range (accepted: integers >= 1 and <= 256)"),
        ({"max_run_time_seconds": 0}, "max_run_time_seconds=0: out of range (accepted: integers >= 1 and <= 2592000, or empty)"),
        ({"max_queue_wait_seconds": 60.0}, "max_queue_wait_seconds=60.0: must be an integer"),
    ],
)
def test_what_the_schema_lets_through_is_refused_naming_the_field(schemas, change, needle):
    with pytest.raises(InvalidParams) as caught:
        check_params(GOOD | change, schemas)
    assert needle in str(caught.value)
    assert caught.value.kind == "user"


def test_every_problem_is_named_at_once(schemas):
    with pytest.raises(InvalidParams) as caught:
        check_params(GOOD | {"learning_rate": NAN, "max_steps": 60.0, "batch_size": 63}, schemas)
    message = str(caught.value)
    assert "learning_rate" in message and "max_steps" in message and "batch_size=63" in message


@pytest.mark.parametrize("field", ["learning_rate", "promotion_floor", "min_improvement"])
def test_the_form_schema_refuses_nan_before_the_run_exists(dag_module, field):
    from airflow.sdk import Param
    from airflow.sdk.exceptions import ParamValidationError

    param: Param = dag_module.PARAMS[field]
    with pytest.raises(ParamValidationError):
        Param(param.value, **param.schema).resolve(NAN)
    with pytest.raises(ParamValidationError):
        Param(param.value, **param.schema).resolve(INF)
    assert Param(param.value, **param.schema).resolve(0.5) == 0.5


class _Run:
    def __init__(self, events):
        self.consumed_asset_events = events


def _event(version, *, minutes=0, name=DATASET_ASSET_NAME, uri=DATASET_ASSET_URI):
    return AssetEventDagRunReference.model_validate({
        "asset": {"name": name, "uri": uri, "extra": {}},
        "extra": {} if version is None else {"version": version},
        "source_task_id": "publish", "source_dag_id": "publish_dataset", "source_run_id": "manual__1",
        "source_map_index": -1, "source_aliases": [],
        "timestamp": datetime(2026, 11, 30, tzinfo=timezone.utc) + timedelta(minutes=minutes),
    })  # fmt: skip


PINNED = {"dataset_version": "0" * 32}


def test_a_manual_or_scheduled_run_trains_its_param():
    assert dataset_version_of_run(PINNED, _Run([])) == "0" * 32


def test_an_asset_run_trains_the_newest_events_version():
    run = _Run([_event("a" * 32, minutes=1), _event("b" * 32, minutes=5), _event("c" * 32, minutes=3)])
    assert dataset_version_of_run(PINNED, run) == "b" * 32


def test_events_of_other_assets_or_without_a_version_fall_back_to_the_param():
    run = _Run([_event("d" * 32, minutes=9, name="other-asset", uri="s3://x/y"), _event(None, minutes=8)])
    assert dataset_version_of_run(PINNED, run) == "0" * 32
