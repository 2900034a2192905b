"""The pipeline DAG's parse-time contract: its file imports nothing heavy, its shape, schedule and pools
(fast: the DAG is parsed, not run; runs are tests/system/dags/test_train_pipeline.py)."""

from __future__ import annotations

import json

from pipeline_runs import last_line_of_python

HEAVY = ("torch", "mlflow", "great_expectations", "dvc", "pandas")


def test_dag_file_imports_nothing_heavy(tmp_path):
    code = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('train_pipeline', 'dags/train_pipeline.py')\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    assert json.loads(last_line_of_python(code, tmp_path)) == []


def test_dag_shape_schedule_and_pools(tmp_path):
    code = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "bag = DagBag(dag_folder='dags')\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "dag = bag.dags['train_pipeline']\n"
        "print(json.dumps({'tasks': {t.task_id: [t.pool, t.pool_slots] for t in dag.tasks}, 'tags': sorted(dag.tags),\n"
        "  'params': sorted(dag.params.keys()), 'schedule': type(dag.timetable).__name__, 'doc': bool(dag.doc_md),\n"
        "  'dags': sorted(bag.dags)}))"
    )
    shape = json.loads(last_line_of_python(code, tmp_path))
    assert {"publish_dataset", "publish_diabetes", "train_diabetes", "train_pipeline"} <= set(shape["dags"])
    # one pair per pipeline file, and the platform's baseline
    assert not [d for d in shape["dags"] if not d.startswith(("publish_", "train_")) and d != "platform_baseline"]
    for n in (1, 2, 4, 8):
        assert shape["tasks"][f"train_local_{n}"] == ["gangflow_training", n]
    assert {"validate_dataset", "admit_gang", "training_result", "evaluate", "promote", "train_kubernetes", "train_ray"} <= set(shape["tasks"])
    assert shape["params"] == sorted(
        ["dataset_version", "world_size", "backend", "launcher", "max_steps", "learning_rate", "batch_size",
         "checkpoint_every_steps", "max_run_time_seconds", "max_queue_wait_seconds", "promotion_floor", "min_improvement"]
    )  # fmt: skip
    assert shape["schedule"] == "AssetOrTimeSchedule" and shape["doc"] and "gangflow" in shape["tags"]


def test_platform_baseline_runs_on_the_runtime_asset_with_one_measurement_at_a_time(tmp_path):
    code = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "bag = DagBag(dag_folder='dags')\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "dag = bag.dags['platform_baseline']\n"
        "print(json.dumps({'up': {t.task_id: sorted(t.upstream_task_ids) for t in dag.tasks}, 'schedule': type(dag.timetable).__name__,\n"
        "  'assets': repr(dag.timetable.asset_condition),\n"
        "  'params': sorted(dag.params.keys())}))"
    )
    shape = json.loads(last_line_of_python(code, tmp_path))
    assert shape["up"] == {"collectives": [], "storage": ["collectives"], "step_time": ["storage"],
                           "record": ["collectives", "step_time", "storage"], "check": ["record"]}
    assert shape["schedule"] == "AssetTriggeredTimetable" and "gangflow-runtime" in shape["assets"]
    assert shape["params"] == ["pipelines", "step_time_steps", "threshold", "world_size"]
