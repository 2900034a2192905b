"""Training code of one's own (issue 22 items 1 and 5): the pipeline's `training:`/`evaluation:`/
`package_roots` keys, the operator's arguments, and what the local and Kubernetes backends launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from operators.backends.base import GangSpec, user_code_args
from operators.backends.local import LocalBackend
from operators.config import settings
from operators.config.pipelines import PipelineConfigError, _pipeline_files, load_pipelines, parse_pipeline

ROOT = Path(__file__).resolve().parents[3]
DIGITS = yaml.safe_load((ROOT / "pipelines" / "digits.yaml").read_text())
VERSION = "5d41402abc4b2a76b9719d911017c592"


def _parse(**changes):
    return parse_pipeline(DIGITS | changes, source="pipelines/x.yaml")


# --- the pipeline file ----------------------------------------------------------------------------


def test_the_digits_cnn_pipeline_brings_its_own_script_and_evaluation():
    p = load_pipelines.__wrapped__(str(ROOT / "pipelines"))["digits-cnn"]
    assert p.dag_id == "train_digits-cnn" and p.package_roots == (str(ROOT / "examples"),)
    assert p.training_kwargs()["package_roots"] == ("examples",)  # the ranks' (and pods') roots: relative
    assert p.training_code == ("--module", "digits_cnn.train", "--")
    assert p.evaluation_entrypoint == "digits_cnn.evaluate:score"
    assert (p.dataset_out, p.dataset_asset) == ("data/digits", "gangflow-dataset-digits")  # the digits pipeline's, shared


def test_an_entrypoint_and_a_command_become_trainer_user_targets():
    own = _parse(training={"entrypoint": "digits_cnn.train:main", "kwargs": {"epochs": 3}}, package_roots=["examples"])
    assert own.training_code == ("--entrypoint", "digits_cnn.train:main", "--kwargs", '{"epochs": 3}')
    assert _parse(training={"command": ["python3", "-m", "mypkg.train", "--epochs", "3"]}).training_code == (
        "--module", "mypkg.train", "--", "--epochs", "3")
    assert _parse(training={"command": ["python", "examples/digits_cnn/train.py", "-v"]}).training_code == (
        "--script", "examples/digits_cnn/train.py", "--", "-v")
    assert _parse().training_code == () and _parse().training_kwargs() == {}
    # gangflow's loop with a model factory in the user's package: the ranks (and pods) get its root too
    assert _parse(package_roots=["examples"]).training_kwargs() == {"package_roots": ("examples",)}


@pytest.mark.parametrize(("change", "needle"), [
    ({"training": {"entrypoint": "mypkg.train"}}, "training.entrypoint='mypkg.train': must be module:function"),
    ({"training": {"entrypoint": "a:b", "command": ["python", "-m", "a"]}}, "give exactly one of training.entrypoint"),
    ({"training": {}}, "give exactly one of training.entrypoint"),
    ({"training": {"command": "python -m a"}}, "training.command='python -m a': must be a list of strings"),
    ({"training": {"command": ["bash", "-c", "rm -rf /"]}}, "training.command=['bash', '-c', 'rm -rf /']: must be [python, -m, MODULE"),
    ({"training": {"command": ["python", "-m"]}}, "`-m` needs a module name"),
    ({"training": {"command": ["python", "../outside.py"]}}, "training.command[script]='../outside.py': must be a path relative"),
    ({"training": {"command": ["python", "nowhere.py"]}}, "no script 'nowhere.py'"),
    ({"training": {"command": ["python", "-m", "a"], "kwargs": {"x": 1}}}, "training.kwargs goes with training.entrypoint"),
    ({"training": {"entrypoint": "a:b", "kwargs": {"x": float("nan")}}}, "training.kwargs: values must be JSON"),
    ({"training": {"entypoint": "a:b"}}, "training: unknown key(s) entypoint"),
    ({"evaluation": {"entrypoint": "score"}}, "evaluation.entrypoint='score': must be module:function"),
    ({"evaluation": "x"}, "evaluation must be a mapping"),
    ({"package_roots": "examples"}, "package_roots='examples': must be a list"),
    ({"package_roots": ["/abs"]}, "package_roots[0]='/abs': no such folder"),
    ({"training": {"entrypoint": "mypkg.trian:main"}}, "training.entrypoint='mypkg.trian:main': no module 'mypkg.trian'"),
    ({"evaluation": {"entrypoint": "mypkg.evaluate:score"}}, "evaluation.entrypoint='mypkg.evaluate:score': no module"),
    ({"package_roots": ["missing_folder"]}, "package_roots[0]='missing_folder': no such folder"),
])  # fmt: skip
def test_a_bad_training_section_is_refused_naming_the_field(change, needle):
    with pytest.raises(PipelineConfigError) as caught:
        _parse(**change)
    assert needle in str(caught.value) and "pipelines/x.yaml" in str(caught.value)


def test_two_pipelines_share_a_dataset_only_when_they_declare_it_identically(tmp_path):
    (tmp_path / "digits.yaml").write_text(yaml.safe_dump(DIGITS))
    other = DIGITS | {"name": "other", "dag_id": "train_other", "publish_dag_id": "publish_other", "model_name": "m"}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert sorted(load_pipelines.__wrapped__(str(tmp_path))) == ["digits", "other"]
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other | {"dataset": DIGITS["dataset"] | {"suite": "data.expectations:diabetes_suite"}}))
    _pipeline_files.cache_clear()
    with pytest.raises(PipelineConfigError, match="share dataset_out='data/digits' .a shared dataset must be declared identically"):
        load_pipelines.__wrapped__(str(tmp_path))


def test_the_operator_checks_its_code_arguments_at_parse_time():
    from operators.training import GangTrainingOperator

    op = GangTrainingOperator(task_id="t", world_size=2, command=["python", "-m", "mypkg.train"], package_roots=["examples"])
    assert op.user_code == ("--module", "mypkg.train", "--") and op.package_roots == ("examples",)
    with pytest.raises(ValueError, match="entrypoint='nope': must be module:function"):
        GangTrainingOperator(task_id="u", world_size=2, entrypoint="nope")
    with pytest.raises(ValueError, match="package_roots item '../x'"):
        GangSpec(name="g", run_dir="/r", world_size=1, package_roots=("../x",))


# --- the local backend ------------------------------------------------------------------------------


def test_the_local_backend_launches_trainer_user_with_the_target_last(tmp_path, monkeypatch):
    spec = GangSpec(name="g", run_dir=str(tmp_path), world_size=2, config_path="c.yaml", overrides=("train.max_steps=5",),
                    dataset_version=VERSION, user_code=user_code_args(command=["python", "-m", "m.train", "--set", "x"]),
                    package_roots=("examples",))
    backend = LocalBackend(dataset_remote="/remote")
    cmd = backend.command(spec, tmp_path)
    assert cmd[1:5] == ["-m", "trainer.launch", "--standalone", "--nproc-per-node"]
    tail = cmd[cmd.index("-m", 3):]
    assert tail == ["-m", "trainer.user", "--run-dir", str(tmp_path), "--config", "c.yaml", "--set", "train.max_steps=5",
                    "--set", f"data.version={VERSION}", "--set", "data.remote=/remote",
                    "--module", "m.train", "--", "--set", "x"]  # the user's own --set stays the user's
    monkeypatch.setenv("PYTHONPATH", "/already")
    env = backend.environment(spec)
    assert env["PYTHONPATH"].split(os.pathsep) == [str((settings.PROJECT_ROOT / "examples").resolve()), "/already"]
    plain = GangSpec(name="g", run_dir=str(tmp_path), world_size=2)
    assert backend.command(plain, tmp_path)[-6:-4] == ["-m", "trainer"] and backend.environment(plain)["PYTHONPATH"] == "/already"


def test_trainer_user_parses_what_the_backends_pass(tmp_path):
    """The rendered argv is trainer.user's: --print-config shows the target it would run."""
    args = ["--run-dir", str(tmp_path), "--set", "train.max_steps=5", "--print-config", "--module", "m.train", "--", "--set", "x"]
    out = subprocess.run([sys.executable, "-m", "trainer.user", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["code"] == "-m m.train --set x"
    bad = subprocess.run([sys.executable, "-m", "trainer.user", "--run-dir", str(tmp_path), "--entrypoint", "x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--entrypoint 'x' is invalid: expected module:function" in bad.stderr


# --- the evaluation entrypoint ------------------------------------------------------------------------


def test_the_evaluation_entrypoint_is_called_with_the_model_folder_and_the_test_split(tmp_path, monkeypatch):
    from operators.evaluation import score_with_entrypoint
    from operators.exceptions import UserError

    (tmp_path / "myeval.py").write_text(
        "def score(model_dir, test_path):\n"
        "    return {'accuracy': len((model_dir / 'w').read_text()) / 10, 'test': test_path.name}\n"
        "def boom(model_dir, test_path):\n    raise KeyError('pixel_99')\n"
        "def wrong(model_dir, test_path):\n    return 0.5\n"
        "def nan(model_dir, test_path):\n    return {'accuracy': float('nan')}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w").write_text("12345")
    assert score_with_entrypoint("myeval:score", tmp_path / "model", tmp_path / "test.parquet") == {
        "accuracy": 0.5, "test": "test.parquet"}
    for entry, needle in [("myeval:boom", "raised KeyError: 'pixel_99'"), ("myeval:wrong", "returned float: it must return a mapping"),
                          ("myeval:nan", "returned non-finite accuracy"), ("myeval:missing", "cannot be imported here"),
                          ("nomodule_xyz:score", "is its package on the path")]:
        with pytest.raises(UserError, match=needle):
            score_with_entrypoint(entry, tmp_path / "model", tmp_path / "test.parquet")
