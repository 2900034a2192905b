"""Publish a new dataset version, one DAG per pipeline (pipelines/*.yaml): `dvc repro` the
pipeline's prepare stage, push its output to the DVC remote, and emit the pipeline's dataset
Asset so that its training DAG runs on the new version. The digits pipeline's DAG keeps the id
`publish_dataset`; another pipeline's is `publish_<name>` unless its file says otherwise.

Manual trigger only (a data engineer runs it after changing the prepare code or params.yaml's
`prepare` section); `dvc repro && dvc push` outside Airflow does the same minus the Asset event.
"""

from __future__ import annotations

from airflow.sdk import Asset, dag, task

from operators.callbacks import record_failure
from operators.config.pipelines import ASSET_VERSION_KEY, PipelineConfig, pipeline_files, pipeline_tag
from operators.retry import ClassifiedRetryPolicy


def build_publish_dag(p: PipelineConfig):
    asset = Asset(p.dataset_asset, uri=p.dataset_asset_uri)

    @dag(
        dag_id=p.publish_dag_id,
        schedule=None,
        catchup=False,
        tags=["gangflow", "data", pipeline_tag(p.name)],
        doc_md=__doc__,
        default_args={"retries": 2, "retry_policy": ClassifiedRetryPolicy(), "on_failure_callback": record_failure},
    )
    def publish_dataset():
        @task(outlets=[asset])
        def publish(outlet_events=None) -> str:
            from operators.hooks import dvc as dataset

            version = dataset.publish(stage=p.dataset_stage, out=p.dataset_out)
            # The training DAG's Asset-triggered run trains exactly this version (dataset_version_of_run).
            outlet_events[asset].extra = {ASSET_VERSION_KEY: version}
            return version

        publish()

    return publish_dataset()


for _config in pipeline_files().configs.values():  # a broken file: train_pipeline.py reports it
    globals()[_config.publish_dag_id] = build_publish_dag(_config)
