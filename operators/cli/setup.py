"""`make setup`: prepare the state dir for the embedded defaults (idempotent).

Creates the state dir, migrates Airflow's SQLite DB, creates the `gangflow_training` pool sized
to this machine, builds and publishes every pipeline's pinned dataset version (pipelines/*.yaml;
`--pipeline NAME`: that pipeline's only, as `make demo PIPELINE=NAME` does) to the local DVC
remote, and creates the MLflow experiment. Run again at any time; it changes only what is missing.
"""

from __future__ import annotations

import argparse
import sys
import time

from operators.config import embedded

from operators.config import settings
from trainer.urls import redact_url


def prepare_airflow_db(slots: int) -> None:
    """What `airflow db migrate` and `airflow pools set` do, in this process: each command would start
    an interpreter and import Airflow again (about 8 s each on these machines)."""
    from airflow.models.pool import Pool
    from airflow.utils import db

    db.upgradedb()
    Pool.create_or_update_pool(settings.TRAINING_POOL, slots, "gang admission: a training task takes world-size slots",
                               include_deferred=False)


def selected_pipelines(name: str | None) -> list:
    """The pipeline called `name`, or every readable pipeline when None (a broken file is left out:
    its DAG reports it)."""
    from operators.config.pipelines import pipeline, pipeline_files

    return [pipeline(name)] if name else list(pipeline_files().configs.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", help="publish this pipeline's dataset only (default: every pipeline's)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    embedded.apply()  # into os.environ before Airflow is imported: it binds its config at import
    for path in (settings.state_dir(), settings.airflow_home(), settings.runs_dir(), settings.artifact_root()):
        path.mkdir(parents=True, exist_ok=True)
    slots = settings.pool_slots()
    prepare_airflow_db(slots)

    from operators.hooks import dvc as dataset

    from operators.hooks import mlflow as tracking
    from operators.config.pipelines import PipelineConfigError

    try:
        chosen = selected_pipelines(args.pipeline)
    except PipelineConfigError as exc:
        parser.error(str(exc))
    version = ", ".join(f"{p.name} {dataset.publish(stage=p.dataset_stage, out=p.dataset_out)}" for p in chosen)
    tracking.ensure_experiment(tracking.get_client(), "gangflow")
    print(
        f"gangflow setup: state {settings.state_dir()}, pool {settings.TRAINING_POOL}={slots} slots, "
        f"dataset {version}, tracking {redact_url(settings.tracking_uri())} ({time.monotonic() - started:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
