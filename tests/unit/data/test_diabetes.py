"""The diabetes dataset (data/prepare.py --dataset diabetes), its expectation suite run by real
Great Expectations, and the DVC stages' interpreter check (a real `dvc repro` in a clone is
tests/system/data/test_diabetes.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from operators.validation import load_suite_factory, run_expectations

PROJECT_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def prepare_module():
    spec = importlib.util.spec_from_file_location("gangflow_test_prepare_d", PROJECT_ROOT / "data" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def frames(tmp_path_factory, prepare_module) -> dict[str, pd.DataFrame]:
    out = tmp_path_factory.mktemp("diabetes")
    prepare_module.prepare(out, seed=20261129, test_fraction=0.25, dataset="diabetes")
    return {split: pd.read_parquet(out / f"{split}.parquet") for split in ("train", "test")}


def _failed(frames) -> dict[str, list[str]]:
    report = run_expectations(frames, load_suite_factory("data.expectations:diabetes_suite", PROJECT_ROOT))
    failed: dict[str, set[str]] = {}
    for f in report.failures:
        failed.setdefault(f.split, set()).add(f.expectation)
    return {split: sorted(names) for split, names in failed.items()}


def test_the_prepared_data_is_a_regression_dataset(frames):
    train, test = frames["train"], frames["test"]
    assert (len(train), len(test)) == (332, 110)
    assert list(train.columns) == ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6", "label"]
    assert train["label"].dtype == np.float32 and train["label"].nunique() > 150  # continuous, not classes


def test_the_suite_passes_the_real_splits(frames):
    assert _failed(frames) == {}


def test_the_suite_refuses_the_scaled_variant(frames):
    """sklearn's default (scaled) diabetes features are centred on 0: every range band fails."""
    scaled = {s: f.assign(**{c: (f[c] - f[c].mean()) / 100 for c in ("age", "bmi", "bp")}) for s, f in frames.items()}
    failed = _failed(scaled)
    assert set(failed) == {"train", "test"}
    assert failed["train"] == ["expect_columns_values_to_be_between"]


def test_the_suite_refuses_class_labels(frames):
    ints = {s: f.assign(label=(f["label"] > 150).astype("int64")) for s, f in frames.items()}
    assert "expect_columns_types_to_be" in _failed(ints)["train"]


def test_another_datasets_schema_is_said_first_and_once(frames):
    """The digits suite on the diabetes data: 'expected columns ..., got ...' leads, instead of a
    line per pixel column and expectation ('column pixel_NN does not exist')."""
    report = run_expectations(frames, load_suite_factory("data.expectations:digits_suite", PROJECT_ROOT))
    text = report.describe("e4861a59328b8e7963f3dc14b26344f4", dataset="data/diabetes")
    lines = text.splitlines()
    assert lines[0].startswith("dataset data/diabetes version e4861a59328b8e7963f3dc14b26344f4 failed")
    assert lines[1].startswith("[train] expected columns [pixel_00, pixel_01, pixel_02, ... (65 items)], got [age, sex, bmi")
    assert "missing [pixel_00" in lines[1] and "unexpected [age, sex" in lines[1]
    assert lines[2].startswith("[test] expected columns")
    assert len(lines) < 20 and "does not exist" not in text, text


def test_another_interpreter_is_refused_with_advice(tmp_path):
    """A Python without the project's packages (the system one, as `dvc repro` may find first)."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    done = subprocess.run([str(bare / "bin" / "python"), "data/prepare.py", "--out", str(tmp_path / "o")],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "make data" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "o").exists()
