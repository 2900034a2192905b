"""Committing checkpoints to local disk, in a writer process beside the training process.

Rank 0 starts `python -m trainer.checkpoint_commit` and hands it each checkpoint: a small one's
files over a pipe, a larger one already written into its temporary folder; the writer hashes,
writes or fsyncs, commits (rename) and prunes them off the training process's GIL.
It imports the standard library, trainer.storage and trainer.console only (never torch).
docs/design/checkpoints.md describes the protocol, its timing and the recycling of pruned folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from trainer.console import say
from trainer.storage import Buffer, is_real_dir, mapped_regular, publish_folder, remove_local, write_all, write_folder

FORMAT = "gangflow-checkpoint/1"
MANIFEST = "manifest.json"
# Only the canonical name: every action addresses a checkpoint as f"step-{step}", so a twin
# (`step-007`, non-ASCII digits int() reads, a trailing newline) would be one it cannot reach.
STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)", re.ASCII)
SPARE_PREFIX = ".spare-"  # a pruned folder kept out of view for the next commit to overwrite
_HEADER = struct.Struct("<I")
_PARENT_POLL_S = 1.0
WRITER_STARTS = 3  # writers one commit may use up: more deaths than that is not a fluke


class WriterError(OSError):
    """The writer process failed a commit, or died; the message says which and why."""


class _WriterDied(WriterError):
    """The writer process ended in the middle of a commit."""


def file_entry(data: Buffer) -> dict[str, Any]:
    """A manifest's (and a model card's) record of one file."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def manifest_bytes(step: int, files: dict[str, Buffer]) -> bytes:
    entries = {name: file_entry(data) for name, data in files.items()}
    return json.dumps({"format": FORMAT, "step": step, "files": entries, "time": time.time()}, indent=1).encode()


def step_of(name: str) -> int | None:
    """The step of the checkpoint folder named `name`; None when that is not a checkpoint's name."""
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def new_folder(root: Path, step: int, names: Collection[str]) -> Path:
    """A temporary folder `root/.tmp-step-N-*` for a commit to write `names` into: the spare folder
    a prune left, when there is one, or a new one."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{uuid.uuid4().hex[:8]}"
    if _recycle_spare(root, tmp):
        # Files the new checkpoint does not have go; the rest, its old manifest too, is overwritten
        # in place (deleting a file costs as much as writing it here). The old manifest cannot pass
        # for the new one (state.json's step differs, so its hash does) and nothing reads a .tmp-*.
        # Anything but a regular file of one name goes too (a link planted in the run dir, a hard
        # link to a file elsewhere or a `cp -al` backup's): never written through, only unlinked.
        with os.scandir(tmp) as it:
            for entry in it:
                if (entry.name not in {*names, MANIFEST} or not entry.is_file(follow_symlinks=False)
                        or entry.stat(follow_symlinks=False).st_nlink != 1):
                    remove_local(entry.path)
    else:
        tmp.mkdir()
    return tmp


def commit_local(root: Path, step: int, files: dict[str, bytes], *, before_commit: Callable[[], None] | None = None) -> int:
    """Write `files` and their manifest to `root/.tmp-step-N-*`, the manifest last, fsync every
    file and the folder, rename it to `step-N` (an existing one is moved away first) and fsync
    `root`. `before_commit` runs when the data files are written and the manifest is not.
    Returns the bytes of the data files."""
    tmp = new_folder(root, step, files)
    # The manifest hashes the files while their fsyncs run (hashlib lets go of the GIL).
    write_folder(tmp, {**files, MANIFEST: lambda: manifest_bytes(step, files)}, before_last=before_commit)
    publish_folder(tmp, root / f"step-{step}", aside=f".trash-step-{step}")  # a re-save (e.g. after a resume at it) replaces
    return sum(len(data) for data in files.values())


def stage_local(root: Path, step: int, files: dict[str, Sequence[Buffer]]) -> Path:
    """Write `files` (each a sequence of buffers) into a new `root/.tmp-step-N-*` folder, without
    fsyncs and without a manifest: for `commit_staged` to commit. Returns the folder."""
    tmp = new_folder(root, step, files)
    try:
        write_folder(tmp, {name: list(parts) for name, parts in files.items()}, durable=False)
    except BaseException:
        remove_local(tmp)
        raise
    return tmp


def commit_staged(root: Path, step: int, folder: str, sizes: dict[str, int], *,
                  before_commit: Callable[[], None] | None = None) -> int:
    """Commit `root/folder`, which `stage_local` filled with files of these `sizes`: fsync them and
    the folder, hashing them from the page cache meanwhile, write the manifest last, rename the
    folder to `step-N` and fsync `root` (as `commit_local`). Returns the bytes of the data files."""
    tmp = root / folder
    if not (re.fullmatch(rf"\.tmp-step-{step}-[0-9a-f]{{8}}", folder) and is_real_dir(tmp)):
        raise NotADirectoryError(f"{tmp} is not a temporary folder of step-{step}")
    with contextlib.ExitStack() as stack:
        # Regular files of exactly these sizes, never through a link; mapped, so hashing copies nothing.
        contents = {name: stack.enter_context(mapped_regular(tmp / name, size=size)) for name, size in sizes.items()}
        write_folder(tmp, {MANIFEST: lambda: manifest_bytes(step, contents)}, written=list(sizes), before_last=before_commit)
    publish_folder(tmp, root / f"step-{step}", aside=f".trash-step-{step}")
    return sum(sizes.values())


def _entries(root: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(root) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def committed_steps(root: Path, entries: list[os.DirEntry] | None = None) -> list[int]:
    """Steps of the committed folders below `root`, newest first (not verified)."""
    entries = _entries(root) if entries is None else entries
    # A link named step-N is not a checkpoint of this run dir: never read, never pruned through.
    steps = [step for e in entries if (step := step_of(e.name)) is not None and e.is_dir(follow_symlinks=False)]
    return sorted(steps, reverse=True)


def spares(root: Path, entries: list[os.DirEntry] | None = None) -> list[Path]:
    entries = _entries(root) if entries is None else entries
    return sorted(Path(e.path) for e in entries if e.name.startswith(SPARE_PREFIX) and e.is_dir(follow_symlinks=False))


def _recycle_spare(root: Path, tmp: Path) -> bool:
    """Rename a spare folder to `tmp` (for the commit to overwrite); False when there is none."""
    for spare in spares(root):
        try:
            spare.rename(tmp)
        except OSError:
            continue
        if is_real_dir(tmp):  # checked again after the rename: a link swapped in since the listing
            return True
        remove_local(tmp)
    return False


def prune_local(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` committed folders. Older ones are renamed out of view at once:
    the first to a spare (when there is none yet), for the next commit to overwrite in place, the
    others to `.trash-*`, then deleted; so is what an interrupted prune left out of view."""
    entries = _entries(root)  # one listing for the three questions below
    have_spare = bool(spares(root, entries))
    leftovers = [Path(e.path) for e in entries if e.name.startswith(".trash-")]
    for step in committed_steps(root, entries)[keep_last:]:
        hidden = root / f"{SPARE_PREFIX if not have_spare else '.trash-'}step-{step}-{uuid.uuid4().hex[:8]}"
        try:
            (root / f"step-{step}").rename(hidden)
        except OSError:
            continue
        if have_spare:
            remove_local(hidden)
        have_spare = True
    for leftover in leftovers:
        remove_local(leftover)


def drop_spares(root: Path) -> None:
    """Delete the spare folders below `root` (when no writer is using them)."""
    for spare in spares(root):
        remove_local(spare)


# --- the rank's side ------------------------------------------------------------------------------


def _nbytes(part: Buffer) -> int:
    return part.nbytes if isinstance(part, memoryview) else len(part)


def _nbytes_of(files: dict[str, Sequence[Buffer]]) -> int:
    return sum(_nbytes(part) for parts in files.values() for part in parts)


def _job(root: Path, step: int, files: dict[str, Sequence[Buffer]], keep_last: int, handshake: bool,
         folder: Path | None = None) -> list[Buffer]:
    """One job as the writer reads it: the length-prefixed header, then every file's buffers (none
    when the files are already written into `folder`)."""
    header = json.dumps({"root": str(root), "step": step, "keep_last": keep_last, "handshake": handshake,
                         "files": [[name, sum(map(_nbytes, parts))] for name, parts in files.items()],
                         **({"folder": folder.name} if folder is not None else {})}).encode()
    if folder is not None:
        return [_HEADER.pack(len(header)) + header]
    return [_HEADER.pack(len(header)) + header, *(part for parts in files.values() for part in parts)]


def _grow_pipe(fd: int, wanted: int = 1 << 20) -> int:
    """Ask Linux for a `wanted`-byte pipe (64 KiB by default; 1 MiB is the default cap for
    unprivileged users); returns the usable size, a page short of what the pipe holds."""
    try:
        import fcntl  # noqa: PLC0415 - POSIX only

        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, wanted)
        except OSError:
            pass  # over the cap: keep what the pipe has
        return max(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) - 4096, 0)
    except (ImportError, AttributeError, OSError):
        return 0  # no such call here: every job goes through commit()


class WriterProcess:
    """Rank 0's handle on its writer process, started by `start()` or at the first commit; one
    commit at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pipe_bytes = 0  # what the writer's input pipe holds: a job up to this size never blocks the sender

    def start(self) -> None:
        """Start the process now rather than at the first commit."""
        with self._lock:
            self._started()

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              env={**os.environ, "GANGFLOW_CHECKPOINT_WRITER_PARENT": str(os.getpid())})
            except OSError as exc:
                raise WriterError(exc.errno, f"cannot start the checkpoint writer process ({exc.strerror or exc})") from exc
            self._pipe_bytes = _grow_pipe(self._proc.stdin.fileno())
        return self._proc

    def send_nowait(self, root: Path, step: int, files: dict[str, Sequence[Buffer]], *, keep_last: int) -> bool:
        """Hand a job to the running writer from the caller's own thread, when it fits in the input
        pipe: between jobs the pipe is empty (the writer reads a whole job before it replies), so
        the write cannot block. `commit(..., sent=True)` then only waits for the reply. False when
        nothing was sent (no live writer, or a job too large): `commit` sends it."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return False
            job = _job(root, step, files, keep_last, handshake=False)
            if sum(map(_nbytes, job)) > self._pipe_bytes:
                return False
            try:
                write_all(proc.stdin.fileno(), job)
            except BrokenPipeError:
                return False  # it died since the last job: commit() starts another and sends it there
            return True

    def commit(self, root: Path, step: int, files: dict[str, Sequence[Buffer]], *, keep_last: int,
               before_commit: Callable[[], None] | None = None, sent: bool = False) -> int:
        """Commit `files` (each a sequence of buffers, written in order) as `root/step-N`, then prune
        to `keep_last`. Returns the bytes written; WriterError when it failed. A writer that died
        (the OOM killer's choice, say) is replaced and the commit made again, up to
        `WRITER_STARTS` writers per commit. `sent`: `send_nowait` already handed this job over."""
        with self._lock:
            for _ in range(WRITER_STARTS - 1):
                try:
                    return self._commit(root, step, files, keep_last, before_commit, sent)
                except _WriterDied as exc:
                    say(f"gangflow: {exc}; starting a new writer and committing step-{step} again", stream=sys.stderr)
                    for stale in root.glob(f".tmp-step-{step}-*"):  # the dead writer's half-written folder
                        remove_local(stale)
                sent = False
            try:
                return self._commit(root, step, files, keep_last, before_commit, sent)
            except _WriterDied as exc:
                raise WriterError(f"{exc}; {WRITER_STARTS} writers died committing step-{step}") from None

    def _commit(self, root: Path, step: int, files: dict[str, Sequence[Buffer]], keep_last: int,
                before_commit: Callable[[], None] | None, sent: bool) -> int:
        # A job already sent is answered by the process that took it, or by nobody: if that one
        # died, waiting on a fresh one would wait forever; its end of input says so, and the retry sends.
        proc = self._proc if sent and self._proc is not None else self._started()
        handshake = before_commit is not None
        fd = proc.stdin.fileno()
        try:
            if not sent:
                # A job larger than the pipe is written by this process straight into the commit's
                # folder (one copy, as a plain write) rather than copied through the pipe and again.
                staged = stage_local(root, step, files) if _nbytes_of(files) > self._pipe_bytes else None
                write_all(fd, _job(root, step, files, keep_last, handshake, staged))
            if handshake:
                self._expect(proc, b"written")
                before_commit()
                write_all(fd, [b"commit\n"])
            return int(json.loads(self._expect(proc, b"committed"))["bytes"])
        except (BrokenPipeError, ValueError) as exc:
            raise self._died(proc, exc) from None

    def _expect(self, proc: subprocess.Popen, word: bytes) -> bytes:
        line = proc.stdout.readline()
        if line.startswith(word):
            return line[len(word):].strip()
        if line.startswith(b"error "):
            raise WriterError(line[6:].decode(errors="replace").strip())
        raise self._died(proc, None)

    @staticmethod
    def _died(proc: subprocess.Popen, exc: Exception | None) -> WriterError:
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        return _WriterDied(f"the checkpoint writer process exited with code {code} in the middle of a commit"
                           + (f" ({type(exc).__name__}: {exc})" if exc else ""))

    def close(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# --- the writer's side ----------------------------------------------------------------------------


class _ParentGone(Exception):
    pass


class _Input:
    """The writer's stdin, read so that a parent that died (or forked a child that holds the pipe)
    ends the wait within a second."""

    def __init__(self, fd: int, parent: int) -> None:
        self.fd, self.parent = fd, parent

    def _ready(self) -> None:
        while not select.select([self.fd], [], [], _PARENT_POLL_S)[0]:
            if os.getppid() != self.parent:
                raise _ParentGone

    def exact(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            self._ready()
            chunk = os.read(self.fd, min(left, 1 << 20))
            if not chunk:
                raise _ParentGone
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def line(self) -> bytes:
        out = b""
        while not out.endswith(b"\n"):
            out += self.exact(1)
        return out


# One job at a time: its header (length first) and every file's bytes (none when the header names
# the folder the rank wrote them into), then "committed <JSON>" or "error <message>". "written" /
# "commit" come between only with the handshake, which only an armed kill@save fault asks for: each
# wait on the pipe costs the rank a GIL switch (docs/design/checkpoints.md).
def serve(inp: _Input, out: Any) -> None:
    def reply(text: bytes) -> None:
        out.write(text + b"\n")
        out.flush()

    def handshake() -> None:
        reply(b"written")
        if inp.line() != b"commit\n":
            raise _ParentGone

    while True:
        job = json.loads(inp.exact(_HEADER.unpack(inp.exact(_HEADER.size))[0]))
        root, step, folder = Path(job["root"]), int(job["step"]), job.get("folder")
        before_commit = handshake if job.get("handshake") else None
        files = {name: inp.exact(size) for name, size in job["files"]} if folder is None else {}
        try:
            if folder is None:
                written = commit_local(root, step, files, before_commit=before_commit)
            else:
                written = commit_staged(root, step, folder, dict(job["files"]), before_commit=before_commit)
            prune_local(root, int(job["keep_last"]))
        except OSError as exc:
            reply(b"error " + f"{type(exc).__name__}: {exc}".replace("\n", " ").encode())
            continue
        reply(b"committed " + json.dumps({"bytes": written}).encode())


def main() -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = int(os.environ.get("GANGFLOW_CHECKPOINT_WRITER_PARENT", os.getppid()))
    try:
        serve(_Input(sys.stdin.fileno(), parent), sys.stdout.buffer)
    except _ParentGone:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
