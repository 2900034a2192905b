"""A regression task through the real trainer: the diabetes pipeline's config, MSE loss, float
targets, the preprocessing statistics filled in from the training split and recorded in the
model card, and test metrics from trainer.metrics (the function the evaluate task uses too)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer import metrics

ROOT = Path(__file__).resolve().parents[3]


# A rank's variables an in-process test (Lightning's DDP setup) may have left in this worker's
# environment: a trainer started with them waits, silently, for peers that never come.
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
             "OMPI_", "TORCHELASTIC_")


def trainer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW", "MLFLOW", "AWS_")) and not k.startswith(RANK_VARS)}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GANGFLOW_ALLOWED_MODELS": "trainer.models:regressor"}


@pytest.fixture(scope="module")
def diabetes(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("gangflow_prepare_r", ROOT / "data" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("diabetes")
    module.prepare(out, seed=20261129, test_fraction=0.25, dataset="diabetes")
    return out


def test_score_per_task():
    logits = np.array([[2.0, 0.1], [0.0, 1.0], [3.0, 0.0]])
    assert metrics.score("classification", logits, [0, 1, 1]) == {"accuracy": pytest.approx(2 / 3)}
    got = metrics.score("regression", np.array([[1.0], [3.0]]), [2.0, 2.0])
    assert got["rmse"] == pytest.approx(1.0) and got["mae"] == pytest.approx(1.0) and got["r2"] == 0.0
    with pytest.raises(ValueError, match="train.task='ranking': accepted values are classification, regression"):
        metrics.score("ranking", logits, [0, 1, 1])
    with pytest.raises(ValueError, match=r"a classifier returns \[batch, classes\]"):
        metrics.score("classification", np.zeros(3), [0, 1, 1])


def test_the_trainer_fits_a_regression_and_records_its_preprocessing(diabetes, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--config", str(ROOT / "pipelines/trainer/diabetes.yaml"),
           "--set", f"data.train_path={diabetes / 'train.parquet'}", "--set", f"data.test_path={diabetes / 'test.parquet'}",
           "--set", "train.max_steps=200", "--set", "checkpoint.every_steps=100"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    card = json.loads((run_dir / "final" / "model_card.json").read_text())
    kwargs, scores = card["model"]["kwargs"], card["metrics"]
    assert card["config"]["train"]["task"] == "regression" and "classes" not in card  # one `prediction` column
    assert len(kwargs["feature_mean"]) == len(kwargs["feature_std"]) == kwargs["input_dim"] == 10
    assert kwargs["feature_mean"][0] == pytest.approx(48.76, abs=0.01)  # age in years, from the train split
    assert kwargs["target_mean"] == pytest.approx(152.15, abs=0.01)
    # A constant guess (the train mean) scores RMSE ~ 79 on the test split: the model learnt.
    assert 40 < scores["test_rmse"] < 65 and scores["test_r2"] > 0.35, scores
    assert "test rmse" in done.stdout and "test_accuracy" not in scores


def test_the_loop_resumes_past_a_checkpoint_of_other_tensors(diabetes, tmp_path):
    """The newest checkpoint verifies and carries the run's identity, but its tensors are not the model's
    (a writer of the store other than this code): it used to end every retry in load_state_dict's
    RuntimeError inside the loop; it is set aside and the loop resumes from the one before."""
    import hashlib

    from safetensors.torch import load, save

    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--config", str(ROOT / "pipelines/trainer/diabetes.yaml"),
            "--set", f"data.train_path={diabetes / 'train.parquet'}", "--set", f"data.test_path={diabetes / 'test.parquet'}",
            "--set", "checkpoint.every_steps=20", "--set", "checkpoint.async_save=false"]  # fmt: skip
    first = subprocess.run(base + ["--set", "train.max_steps=40"], cwd=ROOT, env=trainer_env(), capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    newest = run_dir / "checkpoints" / "step-40"
    tensors = load((newest / "model.safetensors").read_bytes())
    name = sorted(tensors)[0]
    tensors["renamed." + name] = tensors.pop(name)
    data = save(tensors)
    (newest / "model.safetensors").write_bytes(data)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    again = subprocess.run(base + ["--set", "train.max_steps=40"], cwd=ROOT, env=trainer_env(), capture_output=True, text=True,
                           timeout=300)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"checkpoint step-40 is corrupt (model.safetensors: not this model's tensors (missing: {name}" in out
    assert "resuming from checkpoint step-20" in out
