"""The Great Expectations suite every digits dataset version must pass before it is trained on.

`DatasetValidationOperator` (operators/validation.py) calls `digits_suite(split)` once per
split ("train", "test") and validates the split's DataFrame against it. Bring your own suite
by writing a function with the same signature and passing `suite="my.module:my_suite"`.

What a valid split looks like, and why (every threshold is a constant below):

| expectation                                  | columns          | threshold                          |
|----------------------------------------------|------------------|------------------------------------|
| ExpectTableColumnsToMatchSet (exact)         | table            | pixel_00..pixel_63 + label, no more |
| ExpectTableRowCountToBeBetween               | table            | ROW_COUNT[split]                   |
| ExpectColumnsTypesToBe                       | all pixel_NN     | FEATURE_DTYPE ("float32")          |
| ExpectColumnsTypesToBe                       | label            | LABEL_DTYPE ("int64")              |
| ExpectColumnsValuesToNotBeNull               | every column     | no nulls at all                    |
| ExpectColumnsValuesToBeBetween               | all pixel_NN     | [PIXEL_MIN, PIXEL_MAX] = [0, 16]   |
| ExpectColumnValuesToBeInSet                  | label            | CLASSES = {0..9}                   |
| ExpectColumnKLDivergenceToBeLessThan         | label            | KL(observed || uniform) < MAX_CLASS_KL |

The `ExpectColumns*` checks (operators/expectations.py) are GX expectations over many columns in
one vectorised pass; a failure still names each failing column. 8 expectations per split instead
of 198 (one per pixel column and check), for the same meaning: 5 s -> well under 1 s.

Class balance is a distributional check: the observed class shares are compared with the uniform
partition (each class 1/10) by Kullback-Leibler divergence. MAX_CLASS_KL = 0.01 passes the real
split (KL ~ 0.0001: every class holds 9.6-10.3% of the rows) and refuses, for example, one class at
half its share (KL ~ 0.015) or a class missing altogether (KL ~ 0.105).

`python data/expectations.py [train|test]` prints the suite as JSON.
"""

from __future__ import annotations

import json
import sys

import great_expectations as gx
import great_expectations.expectations as gxe

from operators.expectations import ExpectColumnsTypesToBe, ExpectColumnsValuesToBeBetween, ExpectColumnsValuesToNotBeNull

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


if __name__ == "__main__":
    split = sys.argv[1] if len(sys.argv) > 1 else "train"
    print(json.dumps(digits_suite(split).to_json_dict(), indent=2, default=str))
