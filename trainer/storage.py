"""The run dir on any storage: a local path, `file:///...`, or an fsspec URL (`s3://`, `gs://`, ...).

Local writes are durable and atomic (temporary file, fsync, rename); elsewhere one object write is
atomic but a folder is not, so callers that publish several files write a marker file last.
Credentials come from the storage's standard environment (for S3, the `AWS_*` variables).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import posixpath
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

_LOCAL_SCHEMES = ("", "file", "local")


def _scheme(text: str) -> str:
    return text.split("://", 1)[0].lower() if "://" in text else ""


def is_remote(location: str | os.PathLike) -> bool:
    return _scheme(os.fspath(location)) not in _LOCAL_SCHEMES


class UnsafePath(ValueError):
    """A name taken from data (a manifest, a listing, a run dir) that could leave its root."""


def plain_name(rel: object, what: str) -> str:
    """`rel` when it is a plain relative '/'-separated name (no '..', '.', empty part, absolute
    path or NUL); UnsafePath naming `what` otherwise. Checked before anything is opened."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"{what}: {rel!r} is not a plain relative name (no '..', '.', empty part, "
                         "absolute path or NUL)")
    return rel


def inside(root: str | os.PathLike, rel: str, what: str) -> Path:
    """`root/rel` for a plain name `rel`, after checking that it resolves (links included) inside `root`."""
    base = Path(root).resolve()
    target = base.joinpath(plain_name(rel, what))
    if not target.resolve().is_relative_to(base):
        raise UnsafePath(f"{what}: {rel!r} resolves outside {base} (through a link)")
    return target


def check_regular_tree(folder: str | os.PathLike, what: str) -> None:
    """UnsafePath unless everything below the local `folder` is a regular file or a folder (no link,
    FIFO or device): for a folder about to be uploaded, whose files would be read through links."""
    pending = [Path(folder)]
    while pending:
        with os.scandir(pending.pop()) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                elif not entry.is_file(follow_symlinks=False):
                    raise UnsafePath(f"{what}: {entry.path} is not a regular file (a link, a FIFO or a device); refusing to upload it")


def remove_local(path: str | os.PathLike) -> None:
    """Delete a local file, folder or link; a link is removed itself, never what it points at.
    Missing is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # rmtree does not follow links below it
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def is_real_dir(path: str | os.PathLike) -> bool:
    """A folder, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def regular_fd(path: str | os.PathLike, size: int | None = None, limit: int | None = None) -> Iterator[tuple[int, int]]:
    """(fd, size) of the regular file `path`, opened as `read_regular` describes; closed on exit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "not a regular file (a link)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file")
        if (size is not None and st.st_size != size) or (limit is not None and st.st_size > limit):
            raise SizeMismatch(st.st_size)
        yield fd, st.st_size
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike, *, size: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path`, opened without following a link and read only when
    its size is `size` (or at most `limit`): a FIFO, a device, a link or a file of another size
    is never read. FileNotFoundError, NotRegularFile (a link: ELOOP too) or SizeMismatch otherwise."""
    with regular_fd(path, size, limit) as (fd, actual), os.fdopen(os.dup(fd), "rb") as fh:
        return fh.read(actual)


@contextlib.contextmanager
def mapped_regular(path: str | os.PathLike, *, size: int | None = None) -> Iterator[mmap.mmap | bytes]:
    """The bytes of the regular file `path`, checked as `read_regular` checks them but mapped, not
    read: the page cache's own pages, no copy (b"" for an empty file, which cannot be mapped)."""
    with regular_fd(path, size) as (fd, actual):
        if not actual:
            yield b""
            return
        with mmap.mmap(fd, actual, access=mmap.ACCESS_READ) as mapped:
            yield mapped


def read_json_record(path: str | os.PathLike, *, limit: int = 4 << 20) -> dict[str, Any]:
    """A JSON object a run dir holds (a try's failure record, the preemptions), read with
    `read_regular` (no link followed, at most `limit` bytes); {} when it is missing, not a regular
    file, too large, not JSON (or nested past the parser's depth) or not an object: a run dir is
    not trusted."""
    try:
        data = json.loads(read_regular(path, limit=limit).decode("utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


class LinkInPath(OSError):
    """A folder on the way to a path below a storage root is a link (ELOOP): never followed."""


class NotRegularFile(OSError):
    """A link, a FIFO, a device: not a file a checkpoint or a listing may name."""


class SizeMismatch(OSError):
    def __init__(self, actual: int) -> None:
        super().__init__(f"{actual} bytes")
        self.actual = actual


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike, data: bytes) -> None:
    """Write and fsync one local file (no rename: for files inside a folder renamed later)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


@contextlib.contextmanager
def replacing(target: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside the local file `target` for its new content (the writer fsyncs
    it); on a clean exit it is renamed over `target` (readers see the old file or the new one,
    never half of one) and the folder fsynced, on an error removed. Creates missing folders."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)


def replace_file(path: str | os.PathLike, data: bytes) -> None:
    """Replace one local file atomically and durably (see `replacing`)."""
    with replacing(path) as tmp:
        write_file(tmp, data)


def write_json(path: str | os.PathLike, value: Any, **dumps: Any) -> None:
    """Replace the local file `path` with `json.dumps(value, **dumps)`, atomically and durably."""
    replace_file(path, json.dumps(value, **dumps).encode())


Buffer = bytes | bytearray | memoryview | mmap.mmap


def write_all(fd: int, parts: Sequence[Buffer]) -> int:
    """Write every byte of `parts`, in order, in as few writev calls as the kernel allows (no
    copy); returns how many."""
    views = [view for view in (memoryview(p).cast("B") for p in parts) if view.nbytes]
    total = sum(view.nbytes for view in views)
    while views:
        done = os.writev(fd, views[:512])  # IOV_MAX is 1024 on Linux
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if done:
            views[0] = views[0][done:]
    return total


_fsync_pool: ThreadPoolExecutor | None = None


def _own_file(name: str, dir_fd: int) -> int:
    """`name` in the folder `dir_fd` opened for writing (no O_TRUNC: `write_folder` overwrites in
    place), never through a link: a file there that has another name (a hard link to a file
    elsewhere, a `cp -al` backup's) or is not a regular file (a FIFO, never waited on) is unlinked
    and a new one created, so that one is never written."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: a FIFO with no reader
            raise
    else:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            os.set_blocking(fd, True)
            return fd
        os.close(fd)
    os.unlink(name, dir_fd=dir_fd)
    # O_EXCL: a name linked in again since the unlink is an error, never written through.
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)


def write_folder(folder: str | os.PathLike, files: Mapping[str, Buffer | Sequence[Buffer] | Callable[[], Buffer]], *,
                 before_last: Callable[[], None] | None = None, written: Sequence[str] = (), durable: bool = True) -> None:
    """Write `files` into an existing local `folder` in order and make the files and the folder
    durable, issuing each file's fsync as soon as it is written. A journaling filesystem commits
    concurrent fsyncs in one journal transaction, so four files and a folder cost about one fsync
    and a half here, not five; nothing returns before all of them are on disk (for a folder
    renamed into place afterwards). A value is the file's bytes, a list of buffers to write in
    order, or a function returning the bytes: it is called when its turn comes, while the earlier
    files' fsyncs run (a manifest hashing the files). A file already there is overwritten in place
    and cut to its new length (a recycled checkpoint folder: no blocks freed and allocated again),
    unless it has another name: then it is replaced by a new file.
    `before_last` runs after every file but the last is written. `written`: files another process
    wrote into the folder, made durable with these (their fsyncs first). `durable=False` only
    writes: the fsyncs are left to whoever commits the folder."""
    global _fsync_pool
    if _fsync_pool is None:
        _fsync_pool = ThreadPoolExecutor(8, thread_name_prefix="gangflow-fsync")
    fds: list[int] = []
    futures = []

    def sync(fd: int) -> None:
        if durable:
            futures.append(_fsync_pool.submit(os.fsync, fd))

    # Never through a link: the folder itself and each file are opened with O_NOFOLLOW (ELOOP).
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in written:
            fds.append(os.open(plain_name(name, "write_folder"), os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd))
            sync(fds[-1])
        names = list(files)
        for i, name in enumerate(names):
            if i == len(names) - 1 and before_last is not None:
                before_last()
            data = files[name]
            data = data() if callable(data) else data
            fd = _own_file(plain_name(name, "write_folder"), dir_fd)
            fds.append(fd)
            size = write_all(fd, data if isinstance(data, (list, tuple)) else [data])
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            sync(fd)
        fds.append(dir_fd)
        sync(dir_fd)
    finally:
        wait(futures)  # all of them, so that no fsync is still running when its fd is closed
        for fd in fds:
            os.close(fd)
        if dir_fd not in fds:
            os.close(dir_fd)
    for future in futures:
        future.result()


def publish_folder(tmp: Path, final: Path, *, aside: str) -> None:
    """Make the complete, fsynced folder `tmp` visible as `final` by a rename, and durable by an
    fsync of the parent. A `final` already there (a re-save) is first renamed to `<aside>-<id>`
    beside it and deleted after: readers see the old folder or the new one, never neither."""
    old = None
    if os.path.lexists(final):
        old = final.with_name(f"{aside}-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        remove_local(old)


class Storage:
    """A folder on local disk or on an fsspec filesystem; paths below it are '/'-separated."""

    def __init__(self, location: str | os.PathLike | Storage) -> None:
        if isinstance(location, Storage):
            self.fs, self.root, self.url, self.anchor = location.fs, location.root, location.url, location.anchor
            return
        text = os.fspath(location)
        scheme = _scheme(text)
        if scheme in _LOCAL_SCHEMES:
            self.fs = None
            self.root = text.split("://", 1)[1] if scheme else text
            self.url = text
            self.anchor = self.root  # below it (children included) no link is followed
        else:
            import fsspec  # noqa: PLC0415 - only for remote run dirs

            self.fs, root = fsspec.core.url_to_fs(text)
            self.root = root.rstrip("/")
            self.url = text.rstrip("/")
            self.anchor = self.root

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def __str__(self) -> str:
        return self.url

    @property
    def local(self) -> bool:
        return self.fs is None

    def child(self, *parts: str) -> Storage:
        sub = Storage(self)
        sub.root = self.path(*parts)
        sub.url = self.uri(*parts)
        return sub

    def path(self, *parts: str) -> str:
        """Filesystem path (local path or the fsspec path without protocol) of `parts`."""
        if self.local:
            return str(Path(self.root, *parts)) if parts else str(Path(self.root))
        return posixpath.join(self.root, *parts) if parts else self.root

    def uri(self, *parts: str) -> str:
        """What to show a person (and pass on): the location of `parts` as given."""
        return posixpath.join(self.url, *parts) if parts else self.url

    def local_path(self, *parts: str) -> Path:
        """The local path of `parts`; LinkInPath when a folder between the anchor (the location
        this storage was made from) and it is a link. The last part itself is left to the
        operation (removed as a link, opened with O_NOFOLLOW, replaced by a rename)."""
        assert self.local, "local_path() of a remote location"
        path = Path(self.path(*parts))
        anchor = Path(self.anchor)
        if path != anchor and path.is_relative_to(anchor):
            names = path.relative_to(anchor).parts
            current = anchor
            for name in names[:-1] if parts else names:
                current = current / name
                if os.path.islink(current):
                    raise LinkInPath(errno.ELOOP, f"{current} is a link; paths below {anchor} never follow one")
        return path

    # --- files ----------------------------------------------------------------------------------

    def read_bytes(self, *parts: str) -> bytes:
        """FileNotFoundError when missing (both kinds)."""
        if self.local:
            return read_regular(self.local_path(*parts))  # never through a link, never a FIFO
        return self.fs.cat_file(self.path(*parts))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace one file atomically and durably (a single object PUT on object storage)."""
        if self.local:
            replace_file(self.local_path(rel), data)
        else:
            self.fs.pipe_file(self.path(rel), data)

    def exists(self, *parts: str) -> bool:
        if self.local:
            return self.local_path(*parts).exists()
        return self.fs.exists(self.path(*parts))

    def listdir(self, *parts: str) -> list[str]:
        """Names directly below `parts` (files and folders); [] when it does not exist."""
        if self.local:
            folder = self.local_path(*parts)
            return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        path = self.path(*parts)
        self.fs.invalidate_cache(path)  # another process (an earlier attempt) may have written
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries} - {""})

    def makedirs(self, *parts: str) -> None:
        if self.local:
            self.local_path(*parts).mkdir(parents=True, exist_ok=True)
        # object stores have no folders: nothing to create

    def remove(self, *parts: str) -> None:
        """Delete a file or folder; missing is fine."""
        if self.local:
            remove_local(self.local_path(*parts))
            return
        try:
            self.fs.rm(self.path(*parts), recursive=True)
        except FileNotFoundError:
            pass

    def rename(self, src: str, dst: str) -> None:
        """Atomic on local disk; on object storage a copy then a delete."""
        if self.local:
            self.local_path(src).rename(self.local_path(dst))
            return
        source = self.path(src)
        self.fs.invalidate_cache(source)
        files = self.fs.find(source)  # objects below `src` (or `src` itself when it is one)
        if not files:
            raise FileNotFoundError(self.uri(src))
        for path in files:
            rel = posixpath.relpath(path, source)
            self.fs.copy(path, self.path(dst) if rel == "." else posixpath.join(self.path(dst), rel))
        self.fs.rm(source, recursive=True)

    def put_dir(self, local_dir: str | os.PathLike, rel: str, *, last: str | None = None) -> None:
        """Upload the files of `local_dir` to `rel/`, the file named `last` after all others."""
        names = sorted(p.name for p in Path(local_dir).iterdir() if p.is_file())
        if last in names:
            names.remove(last)
            names.append(last)
        for name in names:
            self.write_bytes(f"{rel}/{name}", (Path(local_dir) / name).read_bytes())

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "local": self.local}
