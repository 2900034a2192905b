"""Dataset validation cost: the digits suite run by Great Expectations, beside the same checks in
plain pandas. The last line printed is one JSON object:

* `digits_validation_seconds`: `operators.validation.run_expectations` on both splits of the
  real digits dataset (1797 rows), without Data Docs: the checks alone. Goal: well under 1 s.
  `digits_data_docs_seconds` is the same run with Data Docs built (what the DAG's task does);
  `digits_data_docs_first_seconds` is the first of those runs, the process's first Data Docs
  build: GX's HTML templates are compiled then and reused by later builds
  (operators/expectations/data_docs.py), and the DAG's task builds once per process, so it pays this one.
* `rows_per_second_1m`: rows validated per second on `--rows` (default 1M) synthetic rows
  (`data/prepare.py --synthetic ROWS`, split 75/25 as the real data), the same suite with the
  row-count band widened to the synthetic split sizes, no Data Docs.
* `gx_over_pandas_1m`: that run's time over the same checks written in plain pandas (columns,
  row count, dtypes, nulls, pixel range, label set, label KL divergence), median of the
  per-repetition ratio. Goal <= 10.

Repetitions interleave GX and pandas (G P G P ..., alternating which goes first); GX's import and
the first, discarded run (GX registers its metrics, pandas warms up) are excluded. Data loading
(parquet) is excluded from both sides.

    python benchmarks/validation.py [--reps 5] [--rows 1000000]     # about a minute
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, ROOT, note, summary  # noqa: E402


def pandas_checks(frames: dict, row_count: dict[str, tuple[int, int]]) -> list[str]:
    """The digits suite's checks in plain pandas/numpy; returns the failures (empty: valid)."""
    import numpy as np

    from data import expectations as e

    failed = []
    for split, df in frames.items():
        lo, hi = row_count[split]
        if set(df.columns) != set(e.COLUMNS):
            failed.append(f"{split}: columns")
        if not lo <= len(df) <= hi:
            failed.append(f"{split}: rows")
        failed += [f"{split}: dtype {c}" for c in e.FEATURES if str(df[c].dtype) != e.FEATURE_DTYPE]
        if str(df[e.LABEL].dtype) != e.LABEL_DTYPE:
            failed.append(f"{split}: dtype label")
        nulls = df[e.COLUMNS].isna().sum()
        failed += [f"{split}: nulls {c}" for c in e.COLUMNS if nulls[c]]
        pixels = df[e.FEATURES].to_numpy()
        bad = ((pixels < e.PIXEL_MIN) | (pixels > e.PIXEL_MAX)).sum(axis=0)
        failed += [f"{split}: range {e.FEATURES[i]}" for i in np.flatnonzero(bad)]
        labels = df[e.LABEL]
        if not labels.isin(e.CLASSES).all():
            failed.append(f"{split}: label set")
        shares = labels.value_counts(normalize=True)
        kl = sum(p * math.log(p * len(e.CLASSES)) for p in shares.to_numpy() if p > 0) if labels.isin(e.CLASSES).all() else math.inf
        if not kl < e.MAX_CLASS_KL:
            failed.append(f"{split}: balance")
    return failed


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="interleaved GX/pandas repetitions (default 5)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic rows (default 1000000)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    sys.path.insert(0, str(ROOT))
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    import pandas as pd

    from data import expectations as e
    from operators.validation import run_expectations

    if not (ROOT / "data" / "digits" / "train.parquet").is_file():
        subprocess.run([PY, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True, capture_output=True)
    digits = {s: pd.read_parquet(ROOT / "data" / "digits" / f"{s}.parquet") for s in ("train", "test")}
    t_import, _ = timed(lambda: run_expectations(digits, e.digits_suite))  # first run: GX import + registration
    note(f"first run (GX import, discarded): {t_import:.2f}s")

    with tempfile.TemporaryDirectory(prefix="gangflow-bench-validation-") as tmp:
        gx_s, docs_s, pd_s = [], [], []
        for i in range(args.reps):
            arms = ["gx", "pandas", "docs"] if i % 2 == 0 else ["pandas", "docs", "gx"]
            for arm in arms:
                if arm == "gx":
                    t, report = timed(lambda: run_expectations(digits, e.digits_suite))
                    assert report.success, report.describe()
                    gx_s.append(t)
                elif arm == "docs":
                    t, report = timed(lambda: run_expectations(digits, e.digits_suite, docs_dir=Path(tmp) / f"docs-{i}"))
                    docs_s.append(t)
                else:
                    t, failed = timed(lambda: pandas_checks(digits, e.ROW_COUNT))
                    assert not failed, failed
                    pd_s.append(t)
            note(f"digits rep {i + 1}: GX {gx_s[-1]:.3f}s, GX + Data Docs {docs_s[-1]:.3f}s, pandas {pd_s[-1] * 1e3:.1f} ms")

        out = Path(tmp) / "synthetic"
        note(f"generating {args.rows} synthetic rows")
        subprocess.run([PY, "data/prepare.py", "--synthetic", str(args.rows), "--out", str(out)], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        big = {s: pd.read_parquet(out / f"{s}.parquet") for s in ("train", "test")}
        rows = sum(len(f) for f in big.values())
        bands = {s: (len(f), len(f)) for s, f in big.items()}

        def suite(split: str):
            return e.digits_suite(split, row_count=bands[split])

        big_gx, big_pd = [], []
        for i in range(args.reps):
            for arm in (("gx", "pandas") if i % 2 == 0 else ("pandas", "gx")):
                if arm == "gx":
                    t, report = timed(lambda: run_expectations(big, suite))
                    assert report.success, report.describe()
                    big_gx.append(t)
                else:
                    t, failed = timed(lambda: pandas_checks(big, bands))
                    assert not failed, failed
                    big_pd.append(t)
            note(f"{rows} rows rep {i + 1}: GX {big_gx[-1]:.3f}s, pandas {big_pd[-1]:.3f}s")

    med = lambda xs: summary(xs)["median"]  # noqa: E731
    result = {
        "benchmark": "validation",
        "digits_validation_seconds": round(med(gx_s), 3),
        "digits_data_docs_seconds": round(med(docs_s), 3),
        "digits_data_docs_first_seconds": round(docs_s[0], 3),
        "digits_pandas_seconds": round(med(pd_s), 4),
        "digits_rows": sum(len(f) for f in digits.values()),
        "expectations": 2 * len(e.digits_suite("train").expectations),
        "rows_per_second_1m": round(rows / med(big_gx)),
        "gx_over_pandas_1m": round(summary([g / p for g, p in zip(big_gx, big_pd)])["median"], 2),
        "synthetic_rows": rows,
        "synthetic_gx_seconds": summary(big_gx, 3),
        "synthetic_pandas_seconds": summary(big_pd, 3),
        "digits_gx_seconds": summary(gx_s, 3),
        "goals": {"digits_validation_seconds": "well under 1 s", "gx_over_pandas_1m": "<= 10"},
        "reps": args.reps,
        "benchmark_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
