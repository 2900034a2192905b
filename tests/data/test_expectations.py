"""The digits expectation suite (data/expectations.py), run by real Great Expectations.

The data is the real default dataset, built by data/prepare.py into a temp dir (the workspace's
data/digits is git-ignored and may not exist). Each bad-data case breaks one thing and checks
that exactly the expectations about that thing fail.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from operators.validation import describe_failure, load_suite_factory, run_expectations

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prepare_module():
    return _load("gangflow_test_prepare", PROJECT_ROOT / "data" / "prepare.py")


@pytest.fixture(scope="module")
def frames(tmp_path_factory, prepare_module) -> dict[str, pd.DataFrame]:
    out = tmp_path_factory.mktemp("digits")
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())["prepare"]
    prepare_module.prepare(out, seed=params["seed"], test_fraction=params["test_fraction"])
    return {split: pd.read_parquet(out / f"{split}.parquet") for split in ("train", "test")}


@pytest.fixture(scope="module")
def suite_factory():
    return load_suite_factory("data.expectations:digits_suite", PROJECT_ROOT)


def test_suite_describes_the_prepare_schema(suite_factory, prepare_module):
    module = _load("gangflow_test_expectations", PROJECT_ROOT / "data" / "expectations.py")
    assert module.FEATURES == prepare_module.FEATURES
    assert module.LABEL == prepare_module.LABEL
    suite = suite_factory("train")
    kinds = {e.expectation_type for e in suite.expectations}
    assert {
        "expect_table_columns_to_match_set",
        "expect_table_row_count_to_be_between",
        "expect_column_type_to_be",
        "expect_column_values_to_not_be_null",
        "expect_column_values_to_be_between",
        "expect_column_values_to_be_in_set",
        "expect_column_kl_divergence_to_be_less_than",
    } == kinds
    # one dtype, one null and one range check per feature; dtype, null, set and balance for the label
    assert len(suite.expectations) == 2 + 64 * 3 + 4
    with pytest.raises(ValueError, match="split='validation'"):
        suite_factory("validation")


def test_real_data_passes_and_writes_data_docs(frames, suite_factory, tmp_path):
    report = run_expectations(frames, suite_factory, docs_dir=tmp_path / "docs", run_name="manual__2026-11-29T00:00:00+00:00")
    assert report.success, report.describe()
    assert report.failures == []
    assert report.evaluated == {"train": 198, "test": 198}
    assert report.data_docs == tmp_path / "docs" / "index.html"
    index = report.data_docs.read_text()
    assert "Data Docs created by Great Expectations" in index
    assert "validations/digits/train/" in index and "validations/digits/test/" in index
    pages = sorted(p.relative_to(tmp_path / "docs").as_posix() for p in (tmp_path / "docs").rglob("*.html"))
    assert any(p.startswith("validations/digits/train/") for p in pages), pages
    assert any(p.startswith("validations/digits/test/") for p in pages), pages
    assert "passed all 396 expectations" in report.describe("v1")


def _out_of_range(df):
    df.loc[df.index[0], "pixel_07"] = 16.5
    return df


def _label_11(df):
    df.loc[df.index[0], "label"] = 11
    return df


def _null_pixel(df):
    df.loc[df.index[3], "pixel_20"] = np.nan
    return df


def _wrong_dtypes(df):
    df["pixel_00"] = df["pixel_00"].astype("float64")
    df["label"] = df["label"].astype("int32")
    return df


def _too_few_rows(df):
    return df.groupby("label").head(10)  # 100 rows, perfectly balanced


def _imbalanced(df):
    threes = df.index[df["label"] == 3]
    return df.drop(threes[: int(len(threes) * 0.8)])  # class 3 at ~1/5 of its share


def _schema_drift(df):
    return df.drop(columns=["pixel_10"]).assign(extra=1.0)


BAD = {
    "out-of-range pixel": (_out_of_range, {("expect_column_values_to_be_between", "pixel_07")}, "16.5"),
    "label 11": (
        _label_11,
        {("expect_column_values_to_be_in_set", "label"), ("expect_column_kl_divergence_to_be_less_than", "label")},
        "e.g. [11]",
    ),
    "null": (_null_pixel, {("expect_column_values_to_not_be_null", "pixel_20")}, "1 of 1347 values unexpected"),
    "wrong dtype": (
        _wrong_dtypes,
        {("expect_column_type_to_be", "pixel_00"), ("expect_column_type_to_be", "label")},
        "observed int32",
    ),
    "too few rows": (_too_few_rows, {("expect_table_row_count_to_be_between", None)}, "observed 100"),
    "imbalanced classes": (_imbalanced, {("expect_column_kl_divergence_to_be_less_than", "label")}, "3: 0.02"),
    "schema drift": (
        _schema_drift,
        {
            ("expect_table_columns_to_match_set", None),
            ("expect_column_type_to_be", "pixel_10"),
            ("expect_column_values_to_not_be_null", "pixel_10"),
            ("expect_column_values_to_be_between", "pixel_10"),
        },
        "unexpected [extra]; missing [pixel_10]",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_fails_exactly_the_matching_expectations(case, frames, suite_factory):
    breaker, expected, phrase = BAD[case]
    report = run_expectations({"train": breaker(frames["train"].copy())}, suite_factory)
    assert not report.success
    failed = {(f.expectation, f.column) for f in report.failures}
    assert failed == expected, report.describe()
    message = report.describe("v-bad")
    assert message.startswith(f"dataset version v-bad failed {len(expected)} of 198 expectations")
    for kind, column in expected:  # one line per failed expectation, naming it and its column
        line = next(line for line in message.splitlines() if kind in line and (column is None or f"column {column}:" in line))
        assert line.strip().startswith("- [train]")
    assert phrase in message, message


def test_describe_failure_reads_expected_and_observed(frames, suite_factory):
    report = run_expectations({"train": _out_of_range(frames["train"].copy())}, suite_factory)
    (result,) = [r for r in report.results["train"].results if not r.success]
    failure = describe_failure("train", result)
    assert str(failure) == (
        "[train] column pixel_07: expect_column_values_to_be_between(min_value=0, max_value=16) "
        "-> 1 of 1347 values unexpected (0.07%), e.g. [16.5]"
    )
