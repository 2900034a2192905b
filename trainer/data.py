"""Datasets and the resumable distributed sampler.

A dataset factory is `fn(path: str) -> Dataset` of `(features, label)` tensors; the default,
`parquet_dataset`, reads any Parquet file. `train.batch_size` is the global batch and the sample
order one seeded permutation whatever the world size, so a resume at another size keeps the order.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer.datastore import file_md5
from trainer.errors import DataError

LABEL = "label"


def load_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(features float32 [N, F], labels [N]) from a Parquet file at any path: int64 class labels,
    or float32 targets when the label column holds floating-point values (regression)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    try:
        table = pq.ParquetFile(path).read()
    except Exception as exc:  # noqa: BLE001 - any reader failure means bad data
        raise DataError(f"data file {str(path)!r} is not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    if LABEL not in table.column_names:
        raise DataError(f"data file {str(path)!r} has no {LABEL!r} column (columns: {table.column_names[:8]}...)")
    features = [c for c in table.column_names if c != LABEL]
    if not features or table.num_rows == 0:
        raise DataError(f"data file {str(path)!r} has no feature columns or no rows")
    x = np.stack([_numpy(table.column(c)) for c in features], axis=1).astype(np.float32)
    y = _numpy(table.column(LABEL))
    y = y.astype(np.float32 if np.issubdtype(y.dtype, np.floating) else np.int64)
    return np.ascontiguousarray(x), y


def _numpy(column) -> np.ndarray:
    """A column as a numpy array. Plain numbers without nulls are read from the Arrow buffers:
    pyarrow's `to_numpy` imports pandas (1-2 s of a rank's start-up here) for any column."""
    import pyarrow as pa

    if (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)) and column.null_count == 0:
        name = str(column.type)
        dtype = np.dtype({"halffloat": "float16", "float": "float32", "double": "float64"}.get(name, name))
        parts = [np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk) + chunk.offset)[chunk.offset:]
                 for chunk in column.chunks if len(chunk)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    return column.to_numpy(zero_copy_only=False)


#: Model factory parameters the trainer fills from the training split when the model section
#: leaves them unset (recorded in the model card, so evaluation and serving preprocess the same).
PREPROCESSING_PARAMS = ("feature_mean", "feature_std", "target_mean", "target_std")


def preprocessing_stats(dataset: Dataset) -> dict[str, Any]:
    """Mean and standard deviation of every feature and of the target over a dataset."""
    x = np.stack([np.asarray(dataset[i][0], dtype=np.float64) for i in range(len(dataset))])
    y = np.asarray([float(dataset[i][1]) for i in range(len(dataset))], dtype=np.float64)
    return {"feature_mean": x.mean(axis=0).tolist(), "feature_std": x.std(axis=0).tolist(),
            "target_mean": float(y.mean()), "target_std": float(y.std())}


class ArrayDataset(Dataset):
    """In-memory (features, label) pairs."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = torch.from_numpy(x)
        self.y = torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def parquet_dataset(path: str) -> ArrayDataset:
    """The default dataset factory: `trainer.data:parquet_dataset`."""
    return ArrayDataset(*load_arrays(path))


def check_md5(path: str | Path, expected: str) -> str:
    """md5 of the file; raises DataError when `expected` is set and differs."""
    if not Path(path).is_file():
        raise DataError(f"data.train_path={str(path)!r}: file does not exist")
    actual = file_md5(path)
    if expected and actual != expected:
        raise DataError(
            f"data.train_md5 mismatch: {str(path)!r} has md5 {actual}, expected {expected} "
            "(the file changed since it was validated; refusing to train on it)"
        )
    return actual


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way (`set_start`), for exact resume."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip the first `start` of this rank's samples in the current epoch."""
        self.start = start

    def __iter__(self):
        if self.start == 0:
            return super().__iter__()
        return iter(list(super().__iter__())[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def make_loader(dataset: Dataset, *, batch_size: int, rank: int, world_size: int, seed: int, num_workers: int = 0):
    """(DataLoader, sampler) for one rank; `batch_size` is this rank's share of the global batch."""
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
    # A dedicated generator: creating an iterator must not consume the global torch RNG,
    # so that the RNG stream is the same in a resumed run as in an uninterrupted one.
    generator = torch.Generator().manual_seed(seed + rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                        num_workers=num_workers, generator=generator, persistent_workers=False)
    return loader, sampler


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return math.floor(num_samples / global_batch)


@dataclass(frozen=True)
class DataFiles:
    """The data this run trains and evaluates on, as resolved on this rank (local files + md5s)."""

    train_path: str
    test_path: str
    train_md5: str | None
    test_md5: str | None
    version: str = ""  # the dataset version (md5 of the DVC .dir object) when fetched by address
    remote: str = ""

    def identity(self) -> dict[str, str | None]:
        """What makes two runs' data the same (recorded in checkpoints): the md5s, or the
        train path where there is no file to hash (a custom factory's folder or URL)."""
        ident = {"version": self.version, "train_md5": self.train_md5, "test_md5": self.test_md5}
        if self.train_md5 is None:
            ident["train_path"] = self.train_path
        return ident

    def card(self) -> dict[str, str | None]:
        return {"version": self.version or None, "remote": self.remote or None, "train_path": self.train_path,
                "train_md5": self.train_md5, "test_path": self.test_path, "test_md5": self.test_md5}


def _private_dir(path: Path) -> Path:
    """`path` as a folder only this user can enter (made 0700 when missing); DataError when it is
    a link, someone else's, or open to others (planted before this run)."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise DataError(f"scratch folder {path}: cannot create it ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise DataError(f"scratch folder {path} is not a private folder of this user (a link, another user's, or "
                        f"mode {oct(stat.S_IMODE(st.st_mode))}); remove it or set TMPDIR elsewhere")
    return path


def scratch_dir(run_dir: str | os.PathLike = "") -> Path:
    """Scratch for fetched data, private to this user and this run: `$TMPDIR/gangflow-<uid>/<run>`,
    both 0700 (shared by the ranks of one run on one machine, never by users or runs)."""
    base = _private_dir(Path(tempfile.gettempdir()) / f"gangflow-{os.getuid()}")
    return _private_dir(base / hashlib.sha256(os.fspath(run_dir).encode()).hexdigest()[:16])


def resolve_data(cfg_data, run_dir: str | os.PathLike = "") -> DataFiles:
    """Local files for `cfg.data` on this rank: fetched by content address (data.version) into
    scratch and md5-verified, or the given paths (checked against data.train_md5 when set).
    Raises DataError (exit 1, source "user") before anything trains."""
    from trainer.datastore import DATASET_FILES, dir_listing, fetch_dataset

    if cfg_data.version:
        files = fetch_dataset(cfg_data.remote, cfg_data.version, scratch_dir(run_dir))
        md5s = {e["relpath"]: e["md5"] for e in dir_listing(cfg_data.remote, cfg_data.version)}
        train, test = DATASET_FILES
        return DataFiles(str(files[train]), str(files[test]), md5s[train], md5s[test],
                         version=cfg_data.version, remote=cfg_data.remote)
    if cfg_data.train_md5 or Path(cfg_data.train_path).is_file():
        train_md5 = check_md5(cfg_data.train_path, cfg_data.train_md5)
    else:  # a custom dataset factory may read a folder or a URL: its path stands for it
        train_md5 = None
    test_md5 = file_md5(cfg_data.test_path) if Path(cfg_data.test_path).is_file() else None
    return DataFiles(cfg_data.train_path, cfg_data.test_path, train_md5, test_md5)
