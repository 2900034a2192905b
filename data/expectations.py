"""The Great Expectations suites every dataset version must pass before it is trained on.

`DatasetValidationOperator` calls `digits_suite(split)` (or `diabetes_suite`, `corpus_suite`) once per split
("train", "test"); every threshold is a constant below, tabled in docs/data.md, "The expectations".
`python data/expectations.py [train|test] [digits|diabetes|corpus]` prints a suite as JSON.
"""

from __future__ import annotations

import json
import sys

import great_expectations as gx
import great_expectations.expectations as gxe

from operators.expectations.columns import ExpectColumnsTypesToBe, ExpectColumnsValuesToBeBetween, ExpectColumnsValuesToNotBeNull

FEATURES: list[str] = [f"pixel_{i:02d}" for i in range(64)]
LABEL = "label"
COLUMNS: list[str] = [*FEATURES, LABEL]

FEATURE_DTYPE = "float32"
LABEL_DTYPE = "int64"

# The 8x8 digits images hold ink counts 0..16 per pixel.
PIXEL_MIN = 0.0
PIXEL_MAX = 16.0

CLASSES: list[int] = list(range(10))

# Rows per split. The default dataset has 1797 images split 75/25 (params.yaml
# prepare.test_fraction): 1347 train, 450 test. The bands catch truncated, duplicated or
# wrongly split files while leaving room for a few rows more or less.
ROW_COUNT: dict[str, tuple[int, int]] = {
    "train": (1200, 1500),
    "test": (400, 500),
}

# Largest accepted KL divergence of the observed label distribution from the uniform one.
MAX_CLASS_KL = 0.01


def digits_suite(split: str, *, row_count: tuple[int, int] | None = None) -> gx.ExpectationSuite:
    """The expectation suite for one split ("train" or "test") of the digits dataset.

    `row_count` replaces the split's ROW_COUNT band (benchmarks on synthetic data of other sizes).
    """
    if split not in ROW_COUNT:
        raise ValueError(f"split={split!r}: the digits suite knows the splits {sorted(ROW_COUNT)}")
    min_rows, max_rows = row_count or ROW_COUNT[split]
    expectations: list[gxe.Expectation] = []

    # Schema: exactly these columns, with these dtypes.
    expectations.append(gxe.ExpectTableColumnsToMatchSet(
        column_set=COLUMNS, exact_match=True,
        description="Exactly the columns pixel_00..pixel_63 and label.",
    ))
    expectations.append(gxe.ExpectTableRowCountToBeBetween(
        min_value=min_rows, max_value=max_rows,
        description=f"The {split} split holds {min_rows}..{max_rows} rows.",
    ))
    expectations.append(ExpectColumnsTypesToBe(
        columns=FEATURES, type_=FEATURE_DTYPE, description=f"Every pixel_NN column is {FEATURE_DTYPE}.",
    ))
    expectations.append(ExpectColumnsTypesToBe(
        columns=[LABEL], type_=LABEL_DTYPE, description=f"The label column is {LABEL_DTYPE}.",
    ))

    # Values: complete, in range, known classes.
    expectations.append(ExpectColumnsValuesToNotBeNull(
        columns=COLUMNS, description="No column holds a null.",
    ))
    expectations.append(ExpectColumnsValuesToBeBetween(
        columns=FEATURES, min_value=PIXEL_MIN, max_value=PIXEL_MAX,
        description=f"Every pixel value lies in [{PIXEL_MIN:g}, {PIXEL_MAX:g}].",
    ))
    expectations.append(gxe.ExpectColumnValuesToBeInSet(
        column=LABEL, value_set=CLASSES,
        description="Labels are the digits 0..9.",
    ))

    # Class balance: the label distribution stays close to uniform.
    expectations.append(gxe.ExpectColumnKLDivergenceToBeLessThan(
        column=LABEL,
        partition_object={"values": CLASSES, "weights": [1.0 / len(CLASSES)] * len(CLASSES)},
        threshold=MAX_CLASS_KL,
        description=f"Class shares stay near uniform: KL(observed || uniform) < {MAX_CLASS_KL}.",
    ))

    # Passing the list to the constructor: add_expectation() compares each new expectation
    # with every one already added (quadratic).
    return gx.ExpectationSuite(
        name=f"digits.{split}", expectations=expectations, meta={"gangflow": {"split": split}}
    )




# --------------------------------------------------------------------------------------------
# The diabetes pipeline (regression): scikit-learn's diabetes data, unscaled.

DIABETES_FEATURES: list[str] = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]
DIABETES_COLUMNS: list[str] = [*DIABETES_FEATURES, LABEL]
DIABETES_DTYPE = "float32"  # every column, the target included (a regression target is a float)
# 442 patients split 75/25: 332 train, 110 test; bands as for digits.
DIABETES_ROW_COUNT: dict[str, tuple[int, int]] = {"train": (300, 360), "test": (95, 125)}
# Physiological ranges, wider than the data's (age 19..79, bmi 18..42.2, bp 62..133, s1..s6,
# progression 25..346), narrow enough to catch a scaled or shifted file (the scaled variant of
# the data is centred on 0 and would fail every band that excludes 0).
DIABETES_RANGES: dict[str, tuple[float, float]] = {
    "age": (18, 90), "sex": (1, 2), "bmi": (15, 50), "bp": (50, 150), "s1": (90, 320), "s2": (40, 260),
    "s3": (20, 100), "s4": (2, 10), "s5": (3, 7), "s6": (55, 130), LABEL: (20, 350),
}  # fmt: skip


def diabetes_suite(split: str) -> gx.ExpectationSuite:
    """The expectation suite for one split ("train" or "test") of the diabetes dataset."""
    if split not in DIABETES_ROW_COUNT:
        raise ValueError(f"split={split!r}: the diabetes suite knows the splits {sorted(DIABETES_ROW_COUNT)}")
    min_rows, max_rows = DIABETES_ROW_COUNT[split]
    expectations: list[gxe.Expectation] = [
        gxe.ExpectTableColumnsToMatchSet(
            column_set=DIABETES_COLUMNS, exact_match=True,
            description=f"Exactly the columns {', '.join(DIABETES_FEATURES)} and label.",
        ),
        gxe.ExpectTableRowCountToBeBetween(
            min_value=min_rows, max_value=max_rows, description=f"The {split} split holds {min_rows}..{max_rows} rows.",
        ),
        ExpectColumnsTypesToBe(
            columns=DIABETES_COLUMNS, type_=DIABETES_DTYPE, description=f"Every column is {DIABETES_DTYPE}.",
        ),
        ExpectColumnsValuesToNotBeNull(columns=DIABETES_COLUMNS, description="No column holds a null."),
    ]  # fmt: skip
    for column, (low, high) in DIABETES_RANGES.items():
        expectations.append(ExpectColumnsValuesToBeBetween(
            columns=[column], min_value=low, max_value=high, description=f"{column} lies in [{low:g}, {high:g}].",
        ))  # fmt: skip
    return gx.ExpectationSuite(
        name=f"diabetes.{split}", expectations=expectations, meta={"gangflow": {"split": split}}
    )


# --------------------------------------------------------------------------------------------
# The charlm pipeline (causal language model): standard-library source files, one row per file
# (data/prepare_corpus.py). 22 train files (about 430k characters), 3 test files (about 47k).

CORPUS_COLUMNS: list[str] = ["path", "text"]
CORPUS_ROW_COUNT: dict[str, tuple[int, int]] = {"train": (15, 40), "test": (2, 10)}
# One file's text: more than a stub, less than a generated or concatenated blob.
CORPUS_TEXT_CHARS: tuple[int, int] = (1_000, 200_000)


def corpus_suite(split: str) -> gx.ExpectationSuite:
    """The expectation suite for one split ("train" or "test") of the charlm text corpus."""
    if split not in CORPUS_ROW_COUNT:
        raise ValueError(f"split={split!r}: the corpus suite knows the splits {sorted(CORPUS_ROW_COUNT)}")
    min_rows, max_rows = CORPUS_ROW_COUNT[split]
    low, high = CORPUS_TEXT_CHARS
    expectations: list[gxe.Expectation] = [
        gxe.ExpectTableColumnsToMatchSet(column_set=CORPUS_COLUMNS, exact_match=True,
                                         description="Exactly the columns path and text."),
        gxe.ExpectTableRowCountToBeBetween(min_value=min_rows, max_value=max_rows,
                                           description=f"The {split} split holds {min_rows}..{max_rows} files."),
        ExpectColumnsValuesToNotBeNull(columns=CORPUS_COLUMNS, description="No column holds a null."),
        gxe.ExpectColumnValuesToBeUnique(column="path", description="Each file appears once."),
        gxe.ExpectColumnValuesToMatchRegex(column="path", regex=r"^[a-z_][a-z0-9_]*\.py$",
                                           description="Each path is a module file name (name.py)."),
        gxe.ExpectColumnValueLengthsToBeBetween(column="text", min_value=low, max_value=high,
                                                description=f"Each file holds {low}..{high} characters."),
    ]  # fmt: skip
    return gx.ExpectationSuite(name=f"corpus.{split}", expectations=expectations, meta={"gangflow": {"split": split}})


if __name__ == "__main__":
    split = sys.argv[1] if len(sys.argv) > 1 else "train"
    suite = {"diabetes": diabetes_suite, "corpus": corpus_suite}.get(sys.argv[2] if len(sys.argv) > 2 else "digits", digits_suite)
    print(json.dumps(suite(split).to_json_dict(), indent=2, default=str))
