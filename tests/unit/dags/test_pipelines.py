"""Pipelines as configuration: the pipeline files' format and the DAG factory (fast: no DAG run)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from operators.config.pipelines import Metric, PipelineConfigError, load_pipelines, parse_pipeline

from pipeline_runs import PROJECT_ROOT, pipeline_env

DIGITS = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())


def test_the_digits_pipeline_keeps_its_dag_id_and_gate():
    digits = load_pipelines(str(PROJECT_ROOT / "pipelines"))["digits"]
    assert digits.dag_id == "train_pipeline" and digits.publish_dag_id == "publish_dataset"
    assert digits.metric == Metric("accuracy", "higher", 0.0, 1.0)
    assert (digits.promotion_floor, digits.model_name, digits.dataset_out) == (0.9, "gangflow-digits", "data/digits")
    assert digits.dataset_asset == "gangflow-dataset-digits" and digits.dataset_asset_uri == "dvc://gangflow/data/digits"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"modle_name": "x"}, "unknown key(s) modle_name; accepted keys:"),
        ({"metric": {"name": "rmse", "direction": "down"}}, "metric.direction='down': accepted values are higher, lower"),
        ({"dataset": {"stage": "prepare", "out": "data/digits"}}, "dataset.suite is required"),
        ({"backends": {"local": "x:Y"}}, "'local' is built in"),
        ({"backends": {"slurm": "not a path"}}, "backends.slurm='not a path': must be 'module:Class'"),
        ({"default_backend": "slurm"}, "default_backend='slurm': accepted values are local, kubernetes, ray"),
        ({"trainer_config": "nowhere.yaml"}, "trainer_config="),
        ({"gate": {"floor": "high"}}, "gate.floor='high': must be a finite number"),
    ],
)
def test_a_bad_pipeline_file_is_refused_naming_the_key(change, needle):
    with pytest.raises(PipelineConfigError) as caught:
        parse_pipeline(DIGITS | change, source="pipelines/x.yaml")
    assert needle in str(caught.value) and "pipelines/x.yaml" in str(caught.value)


def test_a_pipeline_section_in_a_trainer_config_is_refused_not_ignored(tmp_path):
    trainer = tmp_path / "params.yaml"
    trainer.write_text("train: {max_steps: 5}\npipeline: {model_name: mine}\n")
    with pytest.raises(PipelineConfigError, match="`pipeline` section is not read any more"):
        parse_pipeline(DIGITS | {"trainer_config": str(trainer)}, source="pipelines/x.yaml")


def test_the_trainer_config_is_read_by_the_trainers_own_loader(tmp_path):
    """Its defaults and its checks, not a copy of them."""
    from trainer.config import TrainConfig

    trainer = tmp_path / "params.yaml"
    trainer.write_text("train: {max_steps: 5}\n")
    config = parse_pipeline(DIGITS | {"trainer_config": str(trainer)}, source="pipelines/x.yaml")
    assert (config.max_steps, config.learning_rate, config.task) == (5, TrainConfig().lr, "classification")
    trainer.write_text("train: {task: ranking}\n")
    with pytest.raises(PipelineConfigError, match=r"params.yaml \(trainer_config of pipelines/x.yaml\): train.task='ranking'"):
        parse_pipeline(DIGITS | {"trainer_config": str(trainer)}, source="pipelines/x.yaml")


def test_two_pipelines_may_not_share_a_dag_id(tmp_path):
    shutil.copy(PROJECT_ROOT / "pipelines" / "digits.yaml", tmp_path / "digits.yaml")
    other = DIGITS | {"name": "other", "model_name": "m", "dataset": DIGITS["dataset"] | {"out": "data/o", "asset": "a"},
                      "publish_dag_id": "publish_other"}  # fmt: skip
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    with pytest.raises(PipelineConfigError, match="share dag_id='train_pipeline'"):
        load_pipelines.__wrapped__(str(tmp_path))


def test_a_new_pipeline_file_is_a_new_dag_with_its_own_backend_and_gate(tmp_path):
    """Adding a pipeline needs no edit to dags/, operators/ or trainer/: a file is enough."""
    for name in ("digits.yaml",):
        shutil.copy(PROJECT_ROOT / "pipelines" / name, tmp_path / name)
    # The backend's package lives outside the project (its module is found when the file is read).
    (tmp_path / "pkgs" / "mypkg").mkdir(parents=True)
    (tmp_path / "pkgs" / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "pkgs" / "mypkg" / "slurm.py").write_text("class SlurmBackend:\n    pass\n")
    third = {
        "name": "third", "description": "a third one",
        "dataset": {"stage": "prepare", "out": "data/third", "suite": "data.expectations:digits_suite"},
        # mae: a regression metric, so a regression trainer config (a classifier's evaluation reports no mae)
        "trainer_config": "pipelines/trainer/diabetes.yaml",
        "metric": {"name": "mae", "direction": "lower", "minimum": 0},
        "gate": {"floor": 50.0, "min_improvement": 0.5}, "schedule": "none",
        "backends": {"slurm": "mypkg.slurm:SlurmBackend"}, "package_roots": [str(tmp_path / "pkgs")],
        "training": {"max_run_time_seconds": 1800, "max_queue_wait_seconds": 900},
    }  # fmt: skip
    (tmp_path / "third.yaml").write_text(yaml.safe_dump(third))
    code = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "from operators.config.pipelines import tagged_pipeline\n"
        "bag = DagBag(dag_folder='dags')\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "dag = bag.dags['train_third']\n"
        "p = {k: dag.params.get_param(k).schema for k in ('backend', 'promotion_floor', 'min_improvement', 'max_run_time_seconds', 'max_queue_wait_seconds')}\n"
        "defaults = {k: dag.params[k] for k in ('max_run_time_seconds', 'max_queue_wait_seconds')}\n"
        "print(json.dumps({'dags': sorted(bag.dags), 'tasks': sorted(t.task_id for t in dag.tasks), 'params': p, 'defaults': defaults,\n"
        "  'floor': dag.params['promotion_floor'], 'task': __import__('operators.config.pipelines', fromlist=['pipeline']).pipeline('third').task, 'suite': dag.get_task('validate_dataset').suite,\n"
        "  'out': dag.get_task('validate_dataset').dvc_out, 'model': dag.get_task('promote').model_name,\n"
        "  'pipelines': {d: tagged_pipeline(bag.dags[d].tags) for d in bag.dags},\n"
        "  'limits': {t.task_id: [t.max_run_time_seconds, t.execution_timeout and t.execution_timeout.total_seconds(), t.max_queue_wait_seconds]\n"
        "             for t in dag.tasks if t.task_id.startswith('train_')}}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180,
                          env=pipeline_env(tmp_path / "home", GANGFLOW_PIPELINES=str(tmp_path)))  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    shape = json.loads(done.stdout.strip().splitlines()[-1])
    assert shape["dags"] == ["platform_baseline", "publish_dataset", "publish_third", "train_pipeline", "train_third"]
    assert shape["task"] == "regression"  # from the trainer config it names
    assert "train_slurm" in shape["tasks"] and "train_kubernetes" in shape["tasks"]
    assert shape["params"]["backend"]["enum"] == ["local", "kubernetes", "ray", "slurm"]
    assert shape["params"]["promotion_floor"]["minimum"] == 0 and "maximum" not in shape["params"]["promotion_floor"]
    assert "exclusiveMaximum" not in shape["params"]["min_improvement"]
    assert (shape["floor"], shape["out"], shape["model"]) == (50.0, "data/third", "gangflow-third")
    # Each DAG names its pipeline (a tag): `make demo` reads it from there, not back from the dag_id.
    assert shape["pipelines"] == {"publish_dataset": "digits", "publish_third": "third", "train_pipeline": "digits",
                                  "train_third": "third", "platform_baseline": None}  # the platform's, no pipeline's
    # training.max_run_time_seconds and max_queue_wait_seconds reach every gang task; Airflow's own timeout comes after it where
    # the gang runs beside the task (local, Ray), never before gangflow's checkpointed stop
    # through the trigger form's Params, whose defaults are the file's; the run-time limit's ceiling is
    # the file's (the local/Ray tasks' execution_timeout is built from it when the file is parsed)
    assert shape["defaults"] == {"max_run_time_seconds": 1800, "max_queue_wait_seconds": 900}
    assert shape["params"]["max_run_time_seconds"] | {"description": ""} == {
        "type": "integer", "minimum": 1, "maximum": 1800, "title": "Max run time (seconds)", "description": ""}
    assert shape["params"]["max_queue_wait_seconds"]["maximum"] == 30 * 24 * 3600
    limits = shape["limits"]
    form = ("{{ params.max_run_time_seconds or '' }}", "{{ params.max_queue_wait_seconds or '' }}")
    assert {task: (limit, wait) for task, (limit, _, wait) in limits.items()} == dict.fromkeys(limits, form)
    assert {task for task, (_, timeout, _) in limits.items() if timeout} == {t for t in limits if t.startswith(("train_local_", "train_ray"))}
    assert {timeout for _, timeout, _ in limits.values() if timeout} == {1800 + 600}


def test_admission_picks_a_registered_backends_task(monkeypatch):
    from operators import backends
    from operators.exceptions import GangCapacityError
    from operators.training import gang_task_id

    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    with pytest.raises(GangCapacityError, match="backend='slurm': accepted values are kubernetes, local"):
        gang_task_id(backend="slurm", world_size=4, local_world_sizes=(1, 2))
    backends.register_backend("slurm", "mypkg.slurm:SlurmBackend")
    assert gang_task_id(backend="slurm", world_size=4, local_world_sizes=(1, 2)) == "train_slurm"
    assert gang_task_id(backend="kubernetes", world_size=4, local_world_sizes=(1, 2)) == "train_kubernetes"


def test_kubernetes_gangs_name_a_trainer_config_the_training_image_holds(tmp_path):
    """Pods read the trainer config from their image, not the worker's disk: every pipeline's
    train_kubernetes task names it relative to the project, and docker/training.Dockerfile's
    runtime stage copies that file to where the pod looks (/app/<path>)."""
    import posixpath
    from types import SimpleNamespace

    from operators.kubernetes.builders import _config_path
    from operators.cli.drill.image import parse_runtime_stage

    code = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "bag = DagBag(dag_folder='dags')\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "print(json.dumps({d: bag.dags[d].get_task('train_kubernetes').config_path for d in bag.dags if d.startswith('train_')}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180,
                          env=pipeline_env(tmp_path / "home"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    configs = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"train_pipeline", "train_diabetes"} <= set(configs)
    _, copies, workdir = parse_runtime_stage((PROJECT_ROOT / "docker" / "training.Dockerfile").read_text())
    in_image = {posixpath.join(workdir, target): src for target, src in copies.items()}
    for dag_id, config in configs.items():
        assert not config.startswith("/"), f"{dag_id}: {config} is a worker path"
        pod_path = _config_path(SimpleNamespace(config_path=config), None)  # refuses worker paths
        held = [t for t, src in in_image.items() if pod_path == t or (src.endswith("/") and pod_path.startswith(t.rstrip("/") + "/"))]
        assert held, f"{dag_id}: the pod reads {pod_path}, which docker/training.Dockerfile does not copy ({sorted(in_image)})"
        assert (PROJECT_ROOT / config).is_file()
