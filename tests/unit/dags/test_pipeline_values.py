"""A pipeline file's values against the trigger form it becomes (security review, items 1 and 3): a
value the form's Param schema or the admission check would refuse is refused when the DAG is built,
naming the file, the key and what is accepted; one such file becomes an error DAG and the others
load. Fast: no DAG run; the DagBag is built in a fresh interpreter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from operators.config.pipelines import PipelineConfigError, load_pipelines, parse_pipeline

from pipeline_runs import PROJECT_ROOT, pipeline_env

DIGITS = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())
TRAINER = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())


def trainer_config(folder: Path, section: str, key: str, value) -> Path:
    """params.yaml with one value changed (one the trainer itself accepts)."""
    raw = yaml.safe_load(yaml.safe_dump(TRAINER))
    raw[section][key] = value
    path = folder / f"params-{section}-{key}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def refused_by_the_form(dag_module, raw: dict) -> str:
    config = parse_pipeline(raw, source="pipelines/x.yaml")  # the file parser lets it through
    with pytest.raises(PipelineConfigError) as caught:
        dag_module.build_pipeline_dag(config)
    return str(caught.value)


@pytest.mark.parametrize(
    ("section", "key", "value", "accepted"),
    [
        ("train", "lr", 20, "<= 10"),
        ("train", "max_steps", 20_000_000, "<= 10000000"),
        ("train", "batch_size", 131072, "<= 65536"),
        ("checkpoint", "every_steps", 20_000_000, "<= 10000000"),
    ],
)
def test_a_trainer_config_value_the_form_refuses_names_the_trainer_config_and_its_key(
    dag_module, tmp_path, section, key, value, accepted
):
    path = trainer_config(tmp_path, section, key, value)
    message = refused_by_the_form(dag_module, DIGITS | {"trainer_config": str(path)})
    assert str(path) in message and "pipelines/x.yaml" in message
    assert f"{section}.{key}={value}" in message and accepted in message


@pytest.mark.parametrize(
    ("change", "needle", "accepted"),
    [
        ({"world_size": 0}, "world_size=0", ">= 1 and <= 256"),
        ({"world_size": 512}, "world_size=512", ">= 1 and <= 256"),
        ({"training": {"max_queue_wait_seconds": 9_999_999}}, "training.max_queue_wait_seconds=9999999", "<= 2592000"),
        # each rank takes batch_size / world_size: every run would be refused at admission
        ({"world_size": 3}, "world_size=3", "train.batch_size"),
    ],
)
def test_a_pipeline_value_the_form_or_admission_refuses_names_the_file_and_its_key(dag_module, change, needle, accepted):
    message = refused_by_the_form(dag_module, DIGITS | change)
    assert message.startswith("pipelines/x.yaml") and needle in message and accepted in message


def test_the_shipped_pipelines_defaults_pass_their_forms(dag_module):
    for config in load_pipelines(str(PROJECT_ROOT / "pipelines")).values():
        dag_module.build_pipeline_dag(config)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"local_world_sizes": [0, 2]}, "local_world_sizes[0]=0"),
        ({"local_world_sizes": [1, -2]}, "local_world_sizes[1]=-2"),
        ({"retry_base_delay_seconds": -5}, "retry_base_delay_seconds=-5"),
        ({"dag_id": ".."}, "dag_id='..'"),
        ({"dag_id": "."}, "dag_id='.'"),
        ({"dag_id": "..."}, "dag_id='...'"),
        ({"dag_id": "train_x\n"}, "dag_id='train_x\\n'"),
        ({"publish_dag_id": ".."}, "publish_dag_id='..'"),
        # the fourth trust pass: each was accepted, then failed the DAG build naming no key (duplicate task
        # id, OverflowError), promote (MLflow refuses '/' and ':'), or silently retried nothing (-1)
        ({"local_world_sizes": [1, 2, 1]}, "local_world_sizes=[1, 2, 1]: each size at most once"),
        ({"retry_base_delay_seconds": 1e300}, "retry_base_delay_seconds=1e+300"),
        ({"training": {"max_run_time_seconds": 10**14}}, "training.max_run_time_seconds=100000000000000"),
        ({"training": {"max_queue_wait_seconds": 10**14}}, "training.max_queue_wait_seconds=100000000000000"),
        ({"retries": -1}, "retries=-1: accepted values: integers from 0 to 100"),
        ({"retries": 10**12}, "retries=1000000000000"),
        ({"model_name": "team/digits"}, "model_name='team/digits': must be a registered model name"),
        ({"model_name": "digits:v2"}, "model_name='digits:v2'"),
        ({"model_name": "digits\n"}, "model_name='digits\\n'"),
    ],
)
def test_a_value_no_pipeline_can_run_with_is_refused_when_the_file_is_read(change, needle):
    with pytest.raises(PipelineConfigError) as caught:
        parse_pipeline(DIGITS | change, source="pipelines/x.yaml")
    assert str(caught.value).startswith("pipelines/x.yaml") and needle in str(caught.value)


def test_the_retry_delay_of_the_file_is_checked_even_where_the_environment_overrides_it(monkeypatch):
    monkeypatch.setenv("GANGFLOW_RETRY_BASE_DELAY", "1")
    with pytest.raises(PipelineConfigError, match="retry_base_delay_seconds=-5"):
        parse_pipeline(DIGITS | {"retry_base_delay_seconds": -5}, source="pipelines/x.yaml")


def test_a_dag_id_with_dots_and_letters_is_still_accepted():
    assert parse_pipeline(DIGITS | {"dag_id": "team.train-1"}, source="x.yaml").dag_id == "team.train-1"


def test_pipelines_the_form_refuses_become_error_dags_and_the_others_load(tmp_path):
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    for name in ("digits.yaml", "diabetes.yaml"):
        shutil.copy(PROJECT_ROOT / "pipelines" / name, pipelines / name)
    pkg = tmp_path / "outside" / "boompkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text("raise RuntimeError('boom at import')\n")  # neither ImportError nor PipelineConfigError
    lr20 = trainer_config(tmp_path, "train", "lr", 20)
    bad = {
        "lr": {"trainer_config": str(lr20)},
        "ws": {"world_size": 0},
        "boom": {"package_roots": [str(tmp_path / "outside")], "operators": {"promote": "boompkg.ops:Promote"}},
    }
    for name, change in bad.items():
        (pipelines / f"{name}.yaml").write_text(yaml.safe_dump(DIGITS | change | {
            "name": name, "dag_id": f"train_{name}", "publish_dag_id": f"publish_{name}", "model_name": f"gangflow-{name}"}))  # fmt: skip
    code = textwrap.dedent(f"""
        import json
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(PROJECT_ROOT / 'dags')!r})
        print(json.dumps({{'dags': sorted(bag.dags), 'errors': {{k: str(v) for k, v in bag.import_errors.items()}},
                          'docs': {{n: bag.dags[f'train_{{n}}'].doc_md for n in {sorted(bad)!r} if f'train_{{n}}' in bag.dags}},
                          'tags': {{n: sorted(bag.dags[f'train_{{n}}'].tags) for n in {sorted(bad)!r} if f'train_{{n}}' in bag.dags}}}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180,
                          env=pipeline_env(tmp_path / "home", GANGFLOW_PIPELINES=str(pipelines)))  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    shape = json.loads(done.stdout.strip().splitlines()[-1])
    assert shape["errors"] == {}
    assert {"train_pipeline", "publish_dataset", "train_diabetes", "publish_diabetes"} <= set(shape["dags"])
    assert all("gangflow:pipeline-error" in shape["tags"][n] for n in bad), shape["tags"]
    assert str(lr20) in shape["docs"]["lr"] and "train.lr=20" in shape["docs"]["lr"]
    assert str(pipelines / "ws.yaml") in shape["docs"]["ws"] and "world_size=0" in shape["docs"]["ws"]
    assert str(pipelines / "boom.yaml") in shape["docs"]["boom"] and "RuntimeError: boom at import" in shape["docs"]["boom"]
