"""A dataset version fetched by content address from a DVC 3 remote, verified by md5.

`fetch_dataset(remote, version, dest_dir)` checks that the `.dir` listing hashes to `version`,
then downloads every file into `dest_dir/<version>/`, hashing while it writes; a file whose md5
differs is refused (`DataError`). Torch-free and Airflow-free: both sides import it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.errors import DataError
from trainer.storage import UnsafePath, inside, plain_name, replacing

DATASET_FILES = ("train.parquet", "test.parquet")
_MD5 = re.compile(r"[0-9a-f]{32}")  # fullmatch: `$` would let a final newline through
_CHUNK = 1 << 20
_COPY_CHUNK = 32 << 20  # copied in the kernel while the chunk before it is hashed
_NO_KERNEL_COPY = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSOCK}  # sendfile cannot copy between these files


class DatasetNotFound(DataError):
    """The remote has no object for this version, or the listing lacks a required file."""


class ChecksumMismatch(DataError):
    """A listing or a file does not hash to the md5 it is addressed by."""

    def __init__(self, message: str, *, expected: str, actual: str) -> None:
        super().__init__(message)
        self.expected, self.actual = expected, actual


def _check_version(version: str) -> str:
    if not isinstance(version, str) or not _MD5.fullmatch(version):
        raise DataError(f"data.version={version!r} is invalid: must be 32 lowercase hex digits "
                        "(the md5 of the DVC directory object, as in dvc.lock without '.dir')")
    return version


def _fs(remote: str):
    import fsspec  # noqa: PLC0415 - keeps `import trainer.datastore` light

    if not remote:
        raise DataError("data.remote is empty: a dataset version needs the DVC remote's URL "
                        "(e.g. s3://bucket/dvc or file:///abs/dvc-remote)")
    fs, root = fsspec.core.url_to_fs(remote)
    return fs, root.rstrip("/")


def object_path(root: str, md5: str, suffix: str = "") -> str:
    """Where DVC 3 stores the object `md5` under a remote's root."""
    return f"{root}/files/md5/{md5[:2]}/{md5[2:]}{suffix}"


def listing_digest(entries: Iterable[dict[str, Any]]) -> str:
    """The version a listing hashes to (dvc_data.hashfile.tree.Tree.digest without meta)."""
    rows = sorted(({"md5": e["md5"], "relpath": e["relpath"]} for e in entries), key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(rows, sort_keys=True).encode("utf-8")).hexdigest()


def dir_listing(remote: str, version: str) -> list[dict[str, str]]:
    """The verified listing [{"md5", "relpath"}] of dataset `version` on `remote`."""
    _check_version(version)
    fs, root = _fs(remote)
    path = object_path(root, version, ".dir")
    try:
        with _open_object(fs, path) as fh:
            raw = fh.read(MAX_LISTING_BYTES + 1)
    except FileNotFoundError:
        raise DatasetNotFound(f"dataset version {version} is not on the remote {remote} (no object {path}); "
                              "was it pushed (dvc push)?") from None
    if len(raw) > MAX_LISTING_BYTES:
        raise DataError(f"dataset version {version}: {path} is larger than {MAX_LISTING_BYTES} bytes: not a DVC "
                        "directory listing")
    try:
        entries = json.loads(raw)
    except ValueError as exc:
        raise DataError(f"dataset version {version}: {path} is not a DVC directory listing ({exc})") from None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("relpath"), str) and isinstance(e.get("md5"), str) and _MD5.fullmatch(e["md5"])
        for e in entries
    ):
        raise DataError(f"dataset version {version}: {path} is not a DVC directory listing "
                        "(expected a JSON list of {md5, relpath} objects)")
    actual = listing_digest(entries)
    if actual != version:
        raise ChecksumMismatch(f"dataset version {version}: the listing {path} has md5 {actual}, expected {version} "
                               "(the remote's object was changed; refusing it)", expected=version, actual=actual)
    for e in entries:  # names are data: each becomes a path under dest_dir/<version>/
        try:
            plain_name(e["relpath"], f"dataset version {version}: the listing {path}")
        except UnsafePath as exc:
            raise DataError(str(exc)) from None
    return [{"md5": e["md5"], "relpath": e["relpath"]} for e in entries]


def file_md5(path: str | os.PathLike) -> str:
    """The md5 of a local file's bytes, as DVC 3 computes it (`hash: md5`): the one md5 helper."""
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _copy_in_kernel(source: int, out: int, size: int) -> str:
    """Copy the first `size` bytes of `source` to the empty file `out` with sendfile (no copy
    through this process), a chunk at a time in a thread while this one hashes the chunk before
    from `out` (mapped: the page cache's pages); returns the md5 of what `out` holds."""
    def copy(start: int) -> None:
        count = min(_COPY_CHUNK, size - start)
        while count:
            done = os.sendfile(out, source, start, count)  # at `out`'s position: the chunks go in order
            if not done:
                return  # the object is shorter than it was: the md5 of what `out` holds says so
            start, count = start + done, count - done

    os.ftruncate(out, size)  # the length to map; the copy fills it
    digest = hashlib.md5()
    with mmap.mmap(out, size, access=mmap.ACCESS_READ) as copied, memoryview(copied) as view, \
         ThreadPoolExecutor(1) as copier:
        copying = copier.submit(copy, 0)
        for start in range(0, size, _COPY_CHUNK):
            copying.result()
            if start + _COPY_CHUNK < size:
                copying = copier.submit(copy, start + _COPY_CHUNK)
            digest.update(view[start:start + _COPY_CHUNK])
    return digest.hexdigest()


def _copy_through(source: Any, out: Any) -> str:
    """Copy the open file `source` to `out` through this process; returns the md5 of the bytes."""
    digest = hashlib.md5()
    # One thread writes chunk n while this one hashes it (both let go of the GIL): the copy costs
    # about the read and the md5, not their sum with the write.
    with ThreadPoolExecutor(1) as writer:
        written = None
        for chunk in iter(lambda: source.read(_CHUNK), b""):
            if written is not None:
                written.result()
            written = writer.submit(out.write, chunk)
            digest.update(chunk)
        if written is not None:
            written.result()
    return digest.hexdigest()


#: The most a `.dir` listing may hold (DVC's listings of gangflow's datasets are a few hundred bytes).
MAX_LISTING_BYTES = 64 << 20


def _open_object(fs, path: str):
    """The remote's object `path` opened for reading. On a local remote only a regular file: a FIFO
    (a read that never ends) or a device (/dev/zero: one that fills the disk) is refused unread."""
    from fsspec.implementations.local import LocalFileSystem  # noqa: PLC0415 - fsspec is imported by _fs already

    if not isinstance(fs, LocalFileSystem):
        return fs.open(path, "rb")
    fd = os.open(fs._strip_protocol(path), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open waits for a writer
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"the remote's object {path} is not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _copy(fs, src: str, tmp: Path) -> str:
    """Copy the object `src` to the new file `tmp`; returns the md5 of the copy. From a local
    remote the kernel copies (sendfile) and the copy is hashed, so reading the object costs no
    pass of its own."""
    from fsspec.implementations.local import LocalFileSystem  # noqa: PLC0415 - fsspec is imported by _fs already

    with _open_object(fs, src) as source, open(tmp, "w+b") as out:
        if isinstance(fs, LocalFileSystem):
            st = os.fstat(source.fileno())
            if st.st_size:
                try:
                    return _copy_in_kernel(source.fileno(), out.fileno(), st.st_size)
                except OSError as exc:
                    if exc.errno not in _NO_KERNEL_COPY:
                        raise
                    out.seek(0)  # sendfile moved `out`'s offset (not `source`'s: it was given offsets)
                    out.truncate()
        return _copy_through(source, out)


def _download(fs, src: str, target: Path, expected: str, what: str) -> None:
    """Copy src to target through a unique temporary file, hashing the copy; rename if it matches
    (atomic: another rank's copy, if any, has the same bytes). No fsync: a file already there is
    verified again before it is reused, so one a crash cut short is fetched again."""
    with replacing(target) as tmp:
        try:
            actual = _copy(fs, src, tmp)
        except FileNotFoundError:
            raise DatasetNotFound(f"{what}: the object {src} is missing on the remote") from None
        if actual != expected:
            raise ChecksumMismatch(f"{what}: md5 mismatch: expected {expected}, actual {actual} "
                                   f"(the remote's object {src} is corrupt or was changed; refusing it)",
                                   expected=expected, actual=actual)


def fetch_dataset(remote: str, version: str, dest_dir: str | os.PathLike, *,
                  relpaths: Iterable[str] = DATASET_FILES) -> dict[str, Path]:
    """Fetch and verify `relpaths` of dataset `version` into `dest_dir/<version>/`; {relpath: local path}."""
    listing = dir_listing(remote, version)
    by_path = {e["relpath"]: e["md5"] for e in listing}
    wanted = list(relpaths)
    missing = [r for r in wanted if r not in by_path]
    if missing:
        raise DatasetNotFound(f"dataset version {version} has no {', '.join(missing)}; "
                              f"its files are: {', '.join(sorted(by_path)) or '(none)'}")
    fs, root = _fs(remote)
    out: dict[str, Path] = {}
    for relpath in wanted:
        try:  # the version's folder and every name resolve inside dest_dir (a planted link does not)
            target = inside(dest_dir, f"{version}/{plain_name(relpath, f'dataset version {version}: relpath')}",
                            f"dataset version {version}: relpath")
        except UnsafePath as exc:
            raise DataError(str(exc)) from None
        expected = by_path[relpath]
        what = f"dataset version {version} file {relpath}"
        if not (target.is_file() and file_md5(target) == expected):  # reuse a verified earlier fetch
            _download(fs, object_path(root, expected), target, expected, what)
        out[relpath] = target
    return out
