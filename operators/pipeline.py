"""Pipeline defaults the DAG file reads at parse time: cheap (one small YAML file, no heavy
imports), so Airflow can parse the DAG often.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from operators import settings

DATASET_ASSET_NAME = "gangflow-dataset-digits"
DATASET_ASSET_URI = "dvc://gangflow/data/digits"
POOL = "gangflow_training"


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
