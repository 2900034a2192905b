"""Build the example datasets (DVC stages) and synthetic datasets of any size (for benchmarks).

The data ships in the scikit-learn wheel; the output is the same bytes (the same DVC hash) on every
machine for a seed. Run it with the project's interpreter (`make data`, or `.venv/bin/python`).

    python data/prepare.py --out data/digits                        # stage `prepare` in dvc.yaml
    python data/prepare.py --dataset diabetes --out data/diabetes   # stage `prepare_diabetes`
    python data/prepare.py --synthetic 100000 --out data/synthetic  # seeded synthetic data
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
except ImportError as exc:  # e.g. `dvc repro` found the system python first on PATH
    sys.exit(f"data/prepare.py: {exc} in {sys.executable}; run it with the project's interpreter: "
             "`make data`, or `PATH=$PWD/.venv/bin:$PATH dvc repro`")

FEATURES = [f"pixel_{i:02d}" for i in range(64)]
LABEL = "label"


DIABETES_FEATURES = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


def _table(x: np.ndarray, y: np.ndarray, features: list[str] = FEATURES) -> pa.Table:
    columns = {name: pa.array(x[:, i].astype(np.float32)) for i, name in enumerate(features)}
    # Class ids stay int64; a regression target is float32 (the trainer reads it as such).
    columns[LABEL] = pa.array(y.astype(np.float32 if np.issubdtype(y.dtype, np.floating) else np.int64))
    return pa.table(columns)


def _write(table: pa.Table, path: Path) -> None:
    # No dictionary encoding or statistics timestamps vary between runs; pin the writer options
    # so that identical data gives identical bytes.
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp, compression="zstd", use_dictionary=False, write_statistics=True)
    tmp.replace(path)


def split(x: np.ndarray, y: np.ndarray, *, seed: int, test_fraction: float):
    """Stratified, seeded split: every class keeps the same share in train and test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"prepare.test_fraction={test_fraction!r}: must be between 0 and 1 (exclusive)")
    rng = np.random.default_rng(seed)
    test_idx = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(len(idx) * test_fraction))].tolist())
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[test_idx] = True
    return (x[~test_mask], y[~test_mask]), (x[test_mask], y[test_mask])


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data.astype(np.float32), bunch.target.astype(np.int64)


def diabetes() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's diabetes data, unscaled (age in years, bmi, blood pressure, six serum
    measurements) and the disease progression one year later (25..346) as the target."""
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes(scaled=False)
    assert list(bunch.feature_names) == DIABETES_FEATURES, bunch.feature_names
    return bunch.data.astype(np.float32), bunch.target.astype(np.float32)


def random_split(x: np.ndarray, y: np.ndarray, *, seed: int, test_fraction: float):
    """Seeded split for a continuous target (no classes to stratify on)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"prepare.test_fraction={test_fraction!r}: must be between 0 and 1 (exclusive)")
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    return (x[train], y[train]), (x[test], y[test])


def synthetic(rows: int, *, seed: int, classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian class blobs with the digits schema (64 features in [0, 16]), any size."""
    if rows < classes:
        raise ValueError(f"--synthetic={rows}: need at least {classes} rows (one per class)")
    rng = np.random.default_rng(seed)
    centers = rng.uniform(2.0, 14.0, size=(classes, len(FEATURES)))
    y = np.arange(rows) % classes
    rng.shuffle(y)
    x = centers[y] + rng.normal(0.0, 2.0, size=(rows, len(FEATURES)))
    return np.clip(x, 0.0, 16.0).astype(np.float32), y.astype(np.int64)


DATASETS = ("digits", "diabetes")


def prepare(out: Path, *, seed: int, test_fraction: float, rows: int | None = None, dataset: str = "digits") -> dict:
    if dataset not in DATASETS:
        raise ValueError(f"--dataset={dataset!r}: accepted values are {', '.join(DATASETS)}")
    features = FEATURES
    if dataset == "diabetes":
        x, y = diabetes()
        features = DIABETES_FEATURES
        (x_train, y_train), (x_test, y_test) = random_split(x, y, seed=seed, test_fraction=test_fraction)
    else:
        x, y = digits() if rows is None else synthetic(rows, seed=seed)
        (x_train, y_train), (x_test, y_test) = split(x, y, seed=seed, test_fraction=test_fraction)
    # Both files are written aside and renamed in (a failure leaves the previous version whole;
    # the stages' outputs are `persist: true`, so DVC does not delete them before running).
    out.mkdir(parents=True, exist_ok=True)
    _write(_table(x_train, y_train, features), out / "train.parquet")
    _write(_table(x_test, y_test, features), out / "test.parquet")
    return {"train_rows": len(y_train), "test_rows": len(y_test), "out": str(out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder for train.parquet and test.parquet")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="parameters file (section `prepare`)")
    parser.add_argument("--dataset", choices=DATASETS, default="digits", help="which example dataset (default digits)")
    parser.add_argument("--synthetic", type=int, metavar="ROWS", help="generate ROWS seeded synthetic rows instead of digits")
    parser.add_argument("--seed", type=int, help="override prepare.seed")
    args = parser.parse_args(argv)
    params = yaml.safe_load(args.params.read_text())["prepare"] if args.params.exists() else {}
    seed = args.seed if args.seed is not None else int(params.get("seed", 0))
    result = prepare(args.out, seed=seed, test_fraction=float(params.get("test_fraction", 0.25)), rows=args.synthetic,
                     dataset=args.dataset)
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
