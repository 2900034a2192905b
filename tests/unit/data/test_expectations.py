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

from operators.validation import describe_failures, load_suite_factory, run_expectations

PROJECT_ROOT = Path(__file__).resolve().parents[3]


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
        "expect_columns_types_to_be",
        "expect_columns_values_to_not_be_null",
        "expect_columns_values_to_be_between",
        "expect_column_values_to_be_in_set",
        "expect_column_kl_divergence_to_be_less_than",
    } == kinds
    # columns and rows; one dtype check over all features and one for the label; one null check
    # over every column; one range check over all features; set and balance for the label. Few
    # expectations is the point: each costs GX a fixed overhead (198 took 5 s for 1.8k rows).
    assert len(suite.expectations) == 8
    by_kind = {(e.expectation_type, tuple(getattr(e, "columns", ()) or ())) for e in suite.expectations}
    assert ("expect_columns_types_to_be", tuple(module.FEATURES)) in by_kind
    assert ("expect_columns_types_to_be", ("label",)) in by_kind
    assert ("expect_columns_values_to_not_be_null", tuple(module.COLUMNS)) in by_kind
    assert ("expect_columns_values_to_be_between", tuple(module.FEATURES)) in by_kind
    with pytest.raises(ValueError, match="split='validation'"):
        suite_factory("validation")


def test_real_data_passes_and_writes_data_docs(frames, suite_factory, tmp_path):
    report = run_expectations(frames, suite_factory, docs_dir=tmp_path / "docs", run_name="manual__2026-11-29T00:00:00+00:00")
    assert report.success, report.describe()
    assert report.failures == []
    assert report.evaluated == {"train": 8, "test": 8}
    assert report.data_docs == tmp_path / "docs" / "index.html"
    index = report.data_docs.read_text()
    assert "Data Docs created by Great Expectations" in index
    assert "validations/digits/train/" in index and "validations/digits/test/" in index
    pages = sorted(p.relative_to(tmp_path / "docs").as_posix() for p in (tmp_path / "docs").rglob("*.html"))
    assert any(p.startswith("validations/digits/train/") for p in pages), pages
    assert any(p.startswith("validations/digits/test/") for p in pages), pages
    assert "passed all 16 expectations" in report.describe("v1")


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


def _two_pixels_out_of_range(df):
    df.loc[df.index[0], "pixel_07"] = 16.5
    df.loc[df.index[1:3], "pixel_40"] = -1.0
    return df


# case: (breaker, failing (expectation, column) pairs, phrase in the message, failed expectations)
BAD = {
    "out-of-range pixel": (_out_of_range, {("expect_columns_values_to_be_between", "pixel_07")}, "16.5", 1),
    "two columns out of range": (
        _two_pixels_out_of_range,
        {("expect_columns_values_to_be_between", "pixel_07"), ("expect_columns_values_to_be_between", "pixel_40")},
        "column pixel_40: expect_columns_values_to_be_between(min_value=0, max_value=16) -> 2 of 1347 values unexpected (0.15%), e.g. [-1]",
        1,  # one expectation, two failing columns, each named on its own line
    ),
    "label 11": (
        _label_11,
        {("expect_column_values_to_be_in_set", "label"), ("expect_column_kl_divergence_to_be_less_than", "label")},
        "e.g. [11]",
        2,
    ),
    "null": (_null_pixel, {("expect_columns_values_to_not_be_null", "pixel_20")}, "1 of 1347 values unexpected", 1),
    "wrong dtype": (
        _wrong_dtypes,
        {("expect_columns_types_to_be", "pixel_00"), ("expect_columns_types_to_be", "label")},
        "observed int32",
        2,
    ),
    "too few rows": (_too_few_rows, {("expect_table_row_count_to_be_between", None)}, "observed 100", 1),
    "imbalanced classes": (_imbalanced, {("expect_column_kl_divergence_to_be_less_than", "label")}, "3: 0.02", 1),
    "schema drift": (
        _schema_drift,
        {
            ("expect_table_columns_to_match_set", None),
            ("expect_columns_types_to_be", "pixel_10"),
            ("expect_columns_values_to_not_be_null", "pixel_10"),
            ("expect_columns_values_to_be_between", "pixel_10"),
        },
        "unexpected [extra]; missing [pixel_10]",
        4,
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_fails_exactly_the_matching_expectations(case, frames, suite_factory):
    breaker, expected, phrase, n_failed = BAD[case]
    report = run_expectations({"train": breaker(frames["train"].copy())}, suite_factory)
    assert not report.success
    failed = {(f.expectation, f.column) for f in report.failures}
    assert failed == expected, report.describe()
    assert len(report.failures) == len(expected)
    message = report.describe("v-bad")
    assert message.startswith(f"dataset version v-bad failed {n_failed} of 8 expectations (train: {n_failed} failed of 8)")
    for kind, column in expected:  # one line per failed expectation and column, naming both
        line = next(line for line in message.splitlines() if kind in line and (column is None or f"column {column}:" in line))
        assert line.strip().startswith("- [train]")
    assert phrase in message, message


def test_a_missing_column_is_named_by_every_check_on_it(frames, suite_factory):
    report = run_expectations({"train": _schema_drift(frames["train"].copy())}, suite_factory)
    lines = [str(f) for f in report.failures if f.column == "pixel_10"]
    assert lines == [
        "[train] column pixel_10: expect_columns_types_to_be(type_=float32) -> column is missing",
        "[train] column pixel_10: expect_columns_values_to_not_be_null() -> column is missing",
        "[train] column pixel_10: expect_columns_values_to_be_between(min_value=0, max_value=16) -> column is missing",
    ]


def test_describe_failure_reads_expected_and_observed(frames, suite_factory):
    report = run_expectations({"train": _out_of_range(frames["train"].copy())}, suite_factory)
    (result,) = [r for r in report.results["train"].results if not r.success]
    (failure,) = describe_failures("train", result)
    assert str(failure) == (
        "[train] column pixel_07: expect_columns_values_to_be_between(min_value=0, max_value=16) "
        "-> 1 of 1347 values unexpected (0.07%), e.g. [16.5]"
    )
    # What Data Docs shows as the observed value names the column too.
    assert result.result["observed_value"] == "1 of 64 columns failed: pixel_07 (1 of 1347 rows)"
