"""Publish a new dataset version: `dvc repro` the prepare stage, push it to the DVC remote, and
emit the dataset Asset so that `train_pipeline` runs on the new version.

Manual trigger only (a data engineer runs it after changing data/prepare.py or params.yaml's
`prepare` section); `dvc repro && dvc push` outside Airflow does the same minus the Asset event.
"""

from __future__ import annotations

from airflow.sdk import Asset, dag, task

from operators.callbacks import record_failure
from operators.pipeline import ASSET_VERSION_KEY, DATASET_ASSET_NAME, DATASET_ASSET_URI
from operators.retry import ClassifiedRetryPolicy

DATASET = Asset(DATASET_ASSET_NAME, uri=DATASET_ASSET_URI)


@dag(
    dag_id="publish_dataset",
    schedule=None,
    catchup=False,
    tags=["gangflow", "data"],
    doc_md=__doc__,
    default_args={"retries": 2, "retry_policy": ClassifiedRetryPolicy(), "on_failure_callback": record_failure},
)
def publish_dataset():
    @task(outlets=[DATASET])
    def publish(outlet_events=None) -> str:
        from operators import dataset

        version = dataset.publish()
        # train_pipeline's Asset-triggered run trains exactly this version (dataset_version_of_run).
        outlet_events[DATASET].extra = {ASSET_VERSION_KEY: version}
        return version

    publish()


publish_dataset()
