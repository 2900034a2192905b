"""Evaluate reads the test split as the trainer does: through the pipeline's data factory, and
scores a regressor with trainer.metrics (the trainer's own function)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from operators import evaluation
from trainer import metrics
from trainer.models import regressor

DOUBLING = '''
from trainer.data import ArrayDataset, load_arrays


def doubled(path):
    x, y = load_arrays(path)
    return ArrayDataset(x * 2, y)
'''


@pytest.fixture
def split(tmp_path):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(20, 3)).astype(np.float32), columns=["a", "b", "c"])
    frame["label"] = (frame["a"] * 3 + 1).astype(np.float32)
    path = tmp_path / "test.parquet"
    frame.to_parquet(path)
    return path, frame


def test_the_pipelines_data_factory_reads_the_test_split(split, tmp_path, monkeypatch):
    path, frame = split
    (tmp_path / "userdata.py").write_text(DOUBLING)
    monkeypatch.syspath_prepend(str(tmp_path))
    x, y = evaluation.load_test_arrays(path, "userdata:doubled")
    np.testing.assert_allclose(x, frame[["a", "b", "c"]].to_numpy() * 2)
    assert y.dtype == np.float32  # a float label stays a regression target
    plain, _ = evaluation.load_test_arrays(path)
    np.testing.assert_allclose(plain, frame[["a", "b", "c"]].to_numpy())


def test_a_regressor_is_scored_with_the_trainers_metrics(split, tmp_path, monkeypatch):
    path, frame = split
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", "trainer.models:regressor")
    torch.manual_seed(0)
    kwargs = {"input_dim": 3, "hidden": 4, "target_mean": 1.0, "target_std": 3.0}
    model = regressor(**kwargs)
    final = tmp_path / "final"
    final.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(final / "model.safetensors"))
    card = {"format": "gangflow-model-card/1", "model": {"factory": "trainer.models:regressor", "kwargs": kwargs},
            "config": {"train": {"task": "regression"}}}
    (final / "model_card.json").write_text(json.dumps(card))
    got = evaluation.evaluate_final_dir(final, path)
    with torch.no_grad():
        outputs = model.eval()(torch.from_numpy(frame[["a", "b", "c"]].to_numpy()))
    expected = metrics.score("regression", outputs.numpy(), frame["label"].to_numpy())
    assert got["task"] == "regression" and "accuracy" not in got
    for key in ("rmse", "mae", "r2"):
        assert got[key] == pytest.approx(expected[key], rel=1e-12)
    assert set(evaluation.flat_metrics(got)) == {"test_rmse", "test_mae", "test_r2"}
