"""Extending gangflow as a data engineer would (issue 23): user packages outside the project,
mistakes caught when the pipeline file is read, one bad pipeline file isolated, operator
classes by configuration. Fast: no DAG run; the DagBag is built in a fresh interpreter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from operators.config.pipelines import PipelineConfigError, parse_pipeline

from pipeline_runs import PROJECT_ROOT, pipeline_env

DIGITS = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())
DIABETES = yaml.safe_load((PROJECT_ROOT / "pipelines" / "diabetes.yaml").read_text())


def refused(raw: dict, source: str = "pipelines/x.yaml") -> str:
    with pytest.raises(PipelineConfigError) as caught:
        parse_pipeline(raw, source=source)
    assert source in str(caught.value)
    return str(caught.value)


def user_package(root: Path, name: str = "usrpkg") -> Path:
    """A package of the user's own, outside the project root: operator subclasses and a backend."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text(textwrap.dedent("""
        from operators.promotion import PromoteModelOperator
        from operators.evaluation import EvaluateModelOperator


        class PromoteOnF1(PromoteModelOperator):
            pass


        class EvaluateWithBrier(EvaluateModelOperator):
            extra_metrics = ("brier",)


        class NotAnOperator:
            pass
    """))
    (pkg / "backend.py").write_text("class SlurmBackend:\n    pass\n")
    return root


# -- item 2: mistakes surface when the file is read ------------------------------------------------


def test_a_gate_value_out_of_the_metrics_range_names_the_file_key_and_range():
    message = refused(DIGITS | {"gate": {"floor": 1.5}})
    assert "gate.floor=1.5" in message and "[0, 1]" in message
    message = refused(DIGITS | {"gate": {"threshold": -0.5}})
    assert "gate.threshold=-0.5" in message and "[0, 1]" in message
    message = refused(DIGITS | {"gate": {"min_improvement": 1.0}})
    assert "gate.min_improvement=1.0" in message


def test_threshold_is_the_direction_neutral_name_and_floor_stays_accepted():
    assert parse_pipeline(DIGITS | {"gate": {"threshold": 0.8}}, source="x.yaml").promotion_floor == 0.8
    assert parse_pipeline(DIGITS | {"gate": {"floor": 0.8}}, source="x.yaml").promotion_floor == 0.8
    assert "either gate.threshold or gate.floor" in refused(DIGITS | {"gate": {"threshold": 0.8, "floor": 0.7}})


def test_a_lower_is_better_metric_is_not_given_a_ceiling_of_zero():
    """Without a threshold the default used to be 0.0, which as a ceiling of RMSE refuses every
    candidate: a lower-is-better metric's default threshold is its maximum, and with no maximum
    the file must say it."""
    bounded = DIABETES | {"gate": {}, "metric": DIABETES["metric"] | {"maximum": 500}}
    config = parse_pipeline(bounded, source="x.yaml")
    assert config.promotion_floor == 500 and config.metric.reaches(60.0, config.promotion_floor)
    message = refused(DIABETES | {"gate": {}})
    assert "gate.threshold is required" in message and "ceiling" in message
    assert parse_pipeline(DIGITS | {"gate": {}}, source="x.yaml").promotion_floor == 0.0  # higher: its minimum


@pytest.mark.parametrize(("raw", "metric", "accepted"), [
    (DIGITS, "roc_auc", "accuracy, macro_f1"),
    (DIABETES, "accuracy", "mae, r2, rmse"),
])  # fmt: skip
def test_a_metric_the_evaluation_does_not_report_is_refused_before_any_training(raw, metric, accepted):
    message = refused(raw | {"metric": raw["metric"] | {"name": metric}})
    assert f"metric.name={metric!r}" in message and accepted in message
    assert parse_pipeline(DIGITS | {"metric": DIGITS["metric"] | {"name": "macro_f1"}}, source="x.yaml").metric.name == "macro_f1"


@pytest.mark.parametrize(("change", "field"), [
    ({"backends": {"slurm": "mypkg.slurmm:SlurmBackend"}}, "backends.slurm"),
    ({"allowed_models": ["trainer.modells:regressor"]}, "allowed_models[0]"),
    ({"dataset": DIGITS["dataset"] | {"suite": "data.expectationz:digits_suite"}}, "dataset.suite"),
])  # fmt: skip
def test_a_class_path_whose_module_is_not_found_is_refused_when_the_file_is_read(change, field):
    message = refused(DIGITS | change)
    assert field in message and "no module" in message


def test_a_trainer_configs_factory_whose_module_is_not_found_is_refused(tmp_path):
    trainer = tmp_path / "t.yaml"
    trainer.write_text("model: {factory: 'mymodelz.wine:mlp'}\n")
    message = refused(DIGITS | {"trainer_config": str(trainer)})
    assert "model.factory" in message and "mymodelz.wine" in message and "no module" in message


def test_checking_a_module_does_not_import_it(tmp_path):
    """find_spec finds the module without running it: a heavy or side-effecting module is not imported at parse."""
    pkg = user_package(tmp_path)
    (pkg / "usrpkg" / "loud.py").write_text("raise SystemExit('imported at parse time')\nclass B: pass\n")
    config = parse_pipeline(DIGITS | {"package_roots": [str(pkg)], "backends": {"slurm": "usrpkg.loud:B"}}, source="x.yaml")
    assert config.backends == {"slurm": "usrpkg.loud:B"} and "usrpkg.loud" not in sys.modules


# -- item 1: package roots ---------------------------------------------------------------------------


def test_package_roots_resolve_relative_to_the_project_and_must_exist(tmp_path):
    config = parse_pipeline(DIGITS | {"package_roots": ["pipelines", str(tmp_path)]}, source="x.yaml")
    assert config.package_roots == (str((PROJECT_ROOT / "pipelines").resolve()), str(tmp_path.resolve()))
    assert "package_roots[0]" in refused(DIGITS | {"package_roots": [str(tmp_path / "nowhere")]})
    assert "package_roots" in refused(DIGITS | {"package_roots": "src"})


def test_a_user_package_outside_the_project_is_found_through_package_roots(tmp_path):
    root = user_package(tmp_path / "outside", "outsidepkg")  # a name no other test imported in this process
    change = {"backends": {"slurm": "outsidepkg.backend:SlurmBackend"}}
    assert "no module" in refused(DIGITS | change)
    config = parse_pipeline(DIGITS | change | {"package_roots": [str(root)]}, source="x.yaml")
    assert config.backends["slurm"] == "outsidepkg.backend:SlurmBackend"


# -- item 4: operator classes by configuration -----------------------------------------------------


def test_an_unknown_stage_or_a_bad_class_path_under_operators_is_refused():
    assert "operators.tune" in refused(DIGITS | {"operators": {"tune": "a.b:C"}})
    assert "operators.promote" in refused(DIGITS | {"operators": {"promote": "not a path"}})
    assert "operators.promote" in refused(DIGITS | {"operators": {"promote": "nopkg.ops:PromoteOnF1"}})


def _dagbag(tmp_path: Path, pipelines: Path, code: str) -> dict:
    prelude = (
        "import json, logging\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(PROJECT_ROOT / 'dags')!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", prelude + code], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=180, env=pipeline_env(tmp_path / "home", GANGFLOW_PIPELINES=str(pipelines)))  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pipeline_file_names_each_stages_operator_class_and_keeps_the_factorys_wiring(tmp_path):
    root = user_package(tmp_path / "outside")
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    shutil.copy(PROJECT_ROOT / "pipelines" / "digits.yaml", pipelines / "digits.yaml")
    cancer = DIGITS | {
        "name": "cancer", "dag_id": "train_cancer", "publish_dag_id": "publish_cancer", "model_name": "gangflow-cancer",
        "dataset": DIGITS["dataset"] | {"out": "data/cancer", "asset": "gangflow-dataset-cancer"},
        "metric": {"name": "brier", "direction": "lower", "minimum": 0, "maximum": 1}, "gate": {"threshold": 0.3},
        "package_roots": [str(root)], "schedule": "none",
        "operators": {"promote": "usrpkg.ops:PromoteOnF1", "evaluate": "usrpkg.ops:EvaluateWithBrier"},
    }  # fmt: skip
    (pipelines / "cancer.yaml").write_text(yaml.safe_dump(cancer))
    shape = _dagbag(tmp_path, pipelines, (
        "dag = bag.dags['train_cancer']\n"
        "print(json.dumps({'errors': {k: str(v) for k, v in bag.import_errors.items()},\n"
        "  'promote': type(dag.get_task('promote')).__name__, 'evaluate': type(dag.get_task('evaluate')).__name__,\n"
        "  'validate': type(dag.get_task('validate_dataset')).__name__,\n"
        "  'params': sorted(dag.params.keys()), 'retry': type(dag.get_task('promote').retry_policy).__name__,\n"
        "  'tasks': sorted(t.task_id for t in dag.tasks), 'schedule': type(dag.timetable).__name__,\n"
        "  'metric': dag.get_task('promote').metric_name}))"
    ))  # fmt: skip
    assert shape["errors"] == {}
    assert (shape["promote"], shape["evaluate"], shape["validate"]) == ("PromoteOnF1", "EvaluateWithBrier", "DatasetValidationOperator")
    assert "promotion_floor" in shape["params"] and shape["retry"] == "ClassifiedRetryPolicy"
    assert "admit_gang" in shape["tasks"] and shape["schedule"] == "AssetTriggeredTimetable"
    assert shape["metric"] == "brier"  # declared by the evaluate class's extra_metrics


def test_an_operator_class_that_is_not_the_stages_operator_is_refused_naming_the_field(tmp_path):
    root = user_package(tmp_path / "outside")
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    shutil.copy(PROJECT_ROOT / "pipelines" / "digits.yaml", pipelines / "digits.yaml")
    (pipelines / "digits.yaml").write_text(yaml.safe_dump(DIGITS | {
        "package_roots": [str(root)], "operators": {"train": "usrpkg.ops:NotAnOperator"}}))  # fmt: skip
    shape = _dagbag(tmp_path, pipelines, (
        "dag = bag.dags['train_pipeline']\n"
        "print(json.dumps({'doc': dag.doc_md, 'tags': sorted(dag.tags), 'tasks': [t.task_id for t in dag.tasks]}))"
    ))  # fmt: skip
    assert "operators.train='usrpkg.ops:NotAnOperator'" in shape["doc"] and "GangTrainingOperator" in shape["doc"]
    assert "gangflow:pipeline-error" in shape["tags"]


# -- item 3: one bad pipeline file is isolated -----------------------------------------------------


def test_one_bad_pipeline_file_is_isolated_and_its_error_names_the_file_and_field(tmp_path):
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    for name in ("digits.yaml", "diabetes.yaml"):
        shutil.copy(PROJECT_ROOT / "pipelines" / name, pipelines / name)
    (pipelines / "broken.yaml").write_text(yaml.safe_dump(DIGITS | {
        "name": "broken", "dag_id": "train_broken", "publish_dag_id": "publish_broken", "model_name": "m",
        "dataset": DIGITS["dataset"] | {"out": "data/broken", "asset": "broken"}, "gate": {"floor": 1.5}}))  # fmt: skip
    (pipelines / "garbled.yaml").write_text("name: garbled\ngate: [unclosed\n")
    shape = _dagbag(tmp_path, pipelines, (
        "from operators.config.pipelines import pipeline\n"
        "err = bag.dags['train_broken']\n"
        "try:\n    pipeline('broken')\nexcept Exception as exc:\n    why = str(exc)\n"
        "print(json.dumps({'dags': sorted(bag.dags), 'errors': {k: str(v) for k, v in bag.import_errors.items()},\n"
        "  'doc': err.doc_md, 'tasks': [t.task_id for t in err.tasks], 'why': why,\n"
        "  'digits': pipeline('digits').dag_id, 'garbled': bag.dags['train_garbled'].doc_md}))"
    ))  # fmt: skip
    assert {"train_pipeline", "publish_dataset", "train_diabetes", "publish_diabetes"} <= set(shape["dags"])
    assert shape["digits"] == "train_pipeline"  # the good pipelines still resolve by name
    assert str(pipelines / "broken.yaml") in shape["doc"] and "gate.floor=1.5" in shape["doc"]
    assert shape["tasks"] == ["pipeline_file_error"] and "gate.floor=1.5" in shape["why"]
    assert str(pipelines / "garbled.yaml") in shape["garbled"] and "not valid YAML" in shape["garbled"]
