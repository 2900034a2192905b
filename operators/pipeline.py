"""Pipeline defaults the DAG file reads at parse time: cheap (one small YAML file, no heavy
imports), so Airflow can parse the DAG often.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from operators import settings
from operators.exceptions import InvalidParams

DATASET_ASSET_NAME = "gangflow-dataset-digits"
DATASET_ASSET_URI = "dvc://gangflow/data/digits"
# The key of the dataset Asset event's `extra` that names the published version
# (dags/publish_dataset.py writes it, `dataset_version_of_run` reads it).
ASSET_VERSION_KEY = "version"
POOL = "gangflow_training"

# JSON Schema has no "finite": NaN compares false with every bound, so it satisfies this empty
# range and `not` refuses it (+-inf are refused by each number Param's own bounds).
NOT_NAN = {"not": {"description": "NaN (not a number)", "minimum": 1, "maximum": 0}}


@dataclass(frozen=True)
class PipelineDefaults:
    schedule: str | None
    dataset_version: str
    world_size: int
    local_world_sizes: tuple[int, ...]
    max_steps: int
    learning_rate: float
    batch_size: int
    checkpoint_every_steps: int
    model_name: str
    promotion_floor: float
    min_improvement: float
    retries: int
    retry_base_delay_s: float


def _load_yaml(path):
    import yaml

    try:
        with open(path) as fh:
            return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except FileNotFoundError:
        return {}


def _pinned_version() -> str:
    from operators.dataset import pinned_version
    from operators.exceptions import DatasetVersionNotFound

    try:
        return pinned_version()
    except DatasetVersionNotFound:  # no dvc.lock yet: the form then asks for a version
        return ""


@functools.cache
def defaults() -> PipelineDefaults:
    params = _load_yaml(settings.params_file())
    pipeline, train = params.get("pipeline", {}), params.get("train", {})
    schedule = os.environ.get("GANGFLOW_SCHEDULE", pipeline.get("schedule"))
    return PipelineDefaults(
        schedule=None if schedule in (None, "", "none", "None") else schedule,
        dataset_version=_pinned_version(),
        world_size=int(pipeline.get("world_size", 2)),
        local_world_sizes=tuple(int(n) for n in pipeline.get("local_world_sizes", [1, 2, 4, 8])),
        max_steps=int(train.get("max_steps", 600)),
        learning_rate=float(train.get("lr", 0.05)),
        batch_size=int(train.get("batch_size", 64)),
        checkpoint_every_steps=int(params.get("checkpoint", {}).get("every_steps", 100)),
        model_name=str(pipeline.get("model_name", "gangflow-digits")),
        promotion_floor=float(pipeline.get("promotion_floor", 0.9)),
        min_improvement=float(pipeline.get("min_improvement", 0.0)),
        retries=int(pipeline.get("retries", 3)),
        retry_base_delay_s=float(os.environ.get("GANGFLOW_RETRY_BASE_DELAY") or pipeline.get("retry_base_delay_seconds", 5)),
    )


# --------------------------------------------------------------------------------------------
# Run-time checks of a run's Params (admit_gang), and the dataset version a run trains


def check_params(values: Mapping[str, Any], schemas: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse what the trigger form's JSON Schemas let through, before a gang is admitted.

    JSON Schema counts 2.0 as an integer and NaN passes every bound; and it cannot relate two
    fields. `schemas` are the DAG's Param schemas (`{name: param.schema}`), so the accepted
    ranges live in one place. Raises `InvalidParams` naming every offending field.
    """
    problems = []
    for name, schema in schemas.items():
        if name in values and (problem := _check_value(name, values[name], schema)):
            problems.append(problem)
    world_size, batch_size = values.get("world_size"), values.get("batch_size")
    if _is_int(world_size) and _is_int(batch_size) and world_size >= 1 and batch_size % world_size:
        lower, upper = batch_size // world_size * world_size, (batch_size // world_size + 1) * world_size
        hint = f"{lower} or {upper}" if lower else str(upper)
        problems.append(
            f"batch_size={batch_size} is not a multiple of world_size={world_size}: each rank takes "
            f"batch_size / world_size samples (e.g. batch_size {hint})"
        )
    if problems:
        raise InvalidParams("; ".join(problems))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_value(name: str, value: Any, schema: Mapping[str, Any]) -> str | None:
    kind = schema.get("type")
    if kind == "integer":
        if not _is_int(value):
            return f"{name}={value!r}: must be an integer, written without a decimal point ({_accepted(schema)})"
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name}={value!r}: must be a finite number ({_accepted(schema)})"
    else:
        return None
    low, high = schema.get("minimum"), schema.get("maximum")
    xlow, xhigh = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if (low is not None and value < low) or (high is not None and value > high) or (
        (xlow is not None and value <= xlow) or (xhigh is not None and value >= xhigh)
    ):
        return f"{name}={value!r}: out of range ({_accepted(schema)})"
    return None


def _accepted(schema: Mapping[str, Any]) -> str:
    bounds = []
    if schema.get("minimum") is not None:
        bounds.append(f">= {schema['minimum']}")
    if schema.get("exclusiveMinimum") is not None:
        bounds.append(f"> {schema['exclusiveMinimum']}")
    if schema.get("maximum") is not None:
        bounds.append(f"<= {schema['maximum']}")
    if schema.get("exclusiveMaximum") is not None:
        bounds.append(f"< {schema['exclusiveMaximum']}")
    what = "integers" if schema.get("type") == "integer" else "finite numbers"
    return f"accepted: {what} {' and '.join(bounds)}".rstrip()


def dataset_version_of_run(params: Mapping[str, Any], dag_run: Any) -> str:
    """The dataset version a DAG run trains (a template macro of `train_pipeline`).

    A run started by events on the dataset Asset trains the newest event's version
    (`extra["version"]`, as `publish_dataset` emits it), not the parse-time default of the
    `dataset_version` Param; any other run trains its Param. An event without a version (one
    posted by hand) falls back to the Param.
    """
    events = [
        event
        for event in (getattr(dag_run, "consumed_asset_events", None) or ())
        if getattr(event.asset, "name", None) == DATASET_ASSET_NAME
        and isinstance(event.extra, Mapping)
        and event.extra.get(ASSET_VERSION_KEY) not in (None, "")
    ]
    if events:
        return str(max(events, key=lambda event: event.timestamp).extra[ASSET_VERSION_KEY])
    return params["dataset_version"]
