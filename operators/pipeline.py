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


def pinned_dataset_version(lock: dict | None = None, out: str = "data/digits") -> str:
    """The dataset version pinned in dvc.lock: the out's DVC md5, without `.dir`."""
    lock = _load_yaml(settings.PROJECT_ROOT / "dvc.lock") if lock is None else lock
    for stage in lock.get("stages", {}).values():
        for item in stage.get("outs", []):
            if item.get("path") == out:
                return str(item["md5"]).removesuffix(".dir")
    return ""


@functools.cache
def defaults() -> PipelineDefaults:
    params = _load_yaml(settings.params_file())
    pipeline, train = params.get("pipeline", {}), params.get("train", {})
    schedule = os.environ.get("GANGFLOW_SCHEDULE", pipeline.get("schedule"))
    return PipelineDefaults(
        schedule=None if schedule in (None, "", "none", "None") else schedule,
        dataset_version=pinned_dataset_version(),
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
