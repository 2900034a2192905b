"""Checkpoints: complete training state, committed atomically, loaded only when intact (contract 2).

`DIR/checkpoints/step-N/` holds the model and optimizer tensors (safetensors), `state.json` and,
written last, `manifest.json` (size and sha256 of each file); readers ignore a folder without it
and set a corrupt one aside. On local disk a writer process commits by rename
(trainer.checkpoint_commit). Layout and resume: docs/trainer.md; design: docs/design/checkpoints.md.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import re
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from trainer.config import CheckpointConfig
from trainer.errors import CheckpointError
from trainer.checkpoint_commit import (FORMAT, MANIFEST, SPARE_PREFIX, WriterProcess, committed_steps, drop_spares, file_entry,
                                      manifest_bytes, prune_local, step_of)
from trainer.safetensors_header import described_values
from trainer.storage import NotRegularFile, SizeMismatch, Storage, read_regular, regular_fd
from trainer.checks import is_integer

__all__ = ["FORMAT", "MANIFEST", "Checkpointer", "CorruptCheckpoint", "Loaded", "MalformedCheckpoint", "Snapshot", "cpu_copy",
           "encode", "file_entry", "flatten_optimizer", "rng_state", "safetensors_parts", "set_rng_state", "unflatten_optimizer"]


class CorruptCheckpoint(Exception):
    """A committed checkpoint that does not verify; the message says why."""


class MalformedCheckpoint(CorruptCheckpoint):
    """A checkpoint whose files verify but do not load (their content, not the store's I/O): the
    same on every rank and every retry, so it is set aside like a corrupt one."""


# --- state <-> (tensors, JSON) ------------------------------------------------------------------


def cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, dict[str, Any]] = {}
    for pid, entries in sd["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{pid}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                other.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "state": other}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        pid, _, name = key.partition("/")
        state.setdefault(int(pid), {})[name] = value
    for pid, entries in js.get("state", {}).items():
        state.setdefault(int(pid), {}).update(entries)
    return {"state": state, "param_groups": js["param_groups"]}


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _words_b64(words: Any) -> str:
    """Mersenne Twister state words (32-bit) as base64 of little-endian uint32: a third of the
    JSON a list of numbers takes, and encoded without a Python object per word."""
    if isinstance(words, np.ndarray):
        raw = words.astype("<u4", copy=False).tobytes()
    else:
        raw = struct.pack(f"<{len(words)}I", *words)
    return base64.b64encode(raw).decode()


def _words(value: Any) -> list[int]:
    """The words written by `_words_b64`, or a JSON list of them (checkpoints before 2026-12-02)."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<u4").tolist()
    return [int(v) for v in value]


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Python, numpy and torch (and CUDA) RNG states of this process, as JSON."""
    py = random.getstate()
    npst = np.random.get_state()
    state = {
        "python": [py[0], _words_b64(py[1]), py[2]],
        "numpy": [npst[0], _words_b64(npst[1]), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": _b64(torch.get_rng_state()),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(_words(internal)), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(_words(keys), dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


# --- files --------------------------------------------------------------------------------------

REQUIRED = ("model.safetensors", "optimizer.safetensors", "state.json")
PLAIN_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # what a manifest may name: a file beside it


# safetensors' dtype names (its format spec); any other dtype is encoded by the library itself.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def safetensors_parts(tensors: dict[str, torch.Tensor]) -> list[bytes | memoryview]:
    """The safetensors file of `tensors` (contiguous CPU tensors, as `cpu_copy` makes them) as
    buffers to write in order: the header, then each tensor's own memory, not a copy of it."""
    header: dict[str, Any] = {}
    parts: list[bytes | memoryview] = []
    offset = 0
    for key, tensor in tensors.items():
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return [safetensors.torch.save(tensors)]
        raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        header[key] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
        parts.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads its header to 8 bytes
    return [struct.pack("<Q", len(text)) + text, *parts]


MANIFEST_LIMIT = 1 << 20  # bytes a manifest may have (a few hundred in practice)


@contextlib.contextmanager
def _as_corrupt(name: str, size: int | None = None, limit: int | None = None) -> Iterator[None]:
    """A checkpoint file that is missing, not a regular file, of another size or unreadable is
    CorruptCheckpoint, naming it."""
    try:
        yield
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{name}: missing") from None
    except NotRegularFile:
        raise CorruptCheckpoint(f"{name}: not a regular file (a link, a FIFO or a device is never read)") from None
    except SizeMismatch as exc:
        said = f"the manifest says {size}" if size is not None and exc.actual != size else f"at most {limit} are read"
        raise CorruptCheckpoint(f"{name} has {exc.actual} bytes, {said}") from None
    except OSError as exc:
        raise CorruptCheckpoint(f"{name}: unreadable ({exc.strerror or exc})") from None


def _check_size(actual: int, size: int | None, limit: int | None) -> None:
    if (size is not None and actual != size) or (limit is not None and actual > limit):
        raise SizeMismatch(actual)


def _read_checked(folder: Storage, name: str, size: int | None = None, limit: int | None = None,
                  end: int | None = None) -> bytes:
    """A file of a checkpoint folder (its first `end` bytes with `end`), never through a link and
    never a FIFO or a device (local), read only when its size is the one expected and never past it
    (an object replaced after its size was read); CorruptCheckpoint otherwise."""
    with _as_corrupt(name, size, limit):
        if folder.local and end is None:
            return read_regular(folder.local_path(name), size=size, limit=limit)
        if folder.local:
            with regular_fd(folder.local_path(name), size, limit) as (fd, actual):
                return os.pread(fd, min(end, actual), 0)  # a header: far below a read's 2 GiB cap
        path = folder.path(name)
        _check_size(folder.fs.size(path), size, limit)
        bound = next((b for b in (size, limit) if b is not None), None)
        if bound is None:
            return folder.read_bytes(name)
        data = folder.fs.cat_file(path, start=0, end=bound + 1 if end is None else min(end, bound + 1))
        if end is None:
            _check_size(len(data), size, limit)
        return data


def _read_verified(folder: Storage, name: str, entry: dict[str, Any]) -> bytes:
    data = _read_checked(folder, name, size=entry["bytes"])
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptCheckpoint(f"{name}: sha256 does not match the manifest")
    return data


_CHUNK = 1 << 20
STATE_JSON_LIMIT = 64 << 20  # bytes a state.json may have (a few kilobytes in practice)


def _sha256_of(folder: Storage, name: str, size: int) -> str:
    """The sha256 of a checkpoint file of `size` bytes, read a chunk at a time (never held whole)."""
    digest = hashlib.sha256()
    with _as_corrupt(name, size):
        if folder.local:
            with regular_fd(folder.local_path(name), size) as (fd, _):
                for offset in range(0, size, _CHUNK):
                    digest.update(os.pread(fd, min(_CHUNK, size - offset), offset))
        else:
            path = folder.path(name)
            _check_size(folder.fs.size(path), size, None)
            with folder.fs.open(path, "rb") as fh:
                left = size
                while left and (chunk := fh.read(min(_CHUNK, left))):
                    digest.update(chunk)
                    left -= len(chunk)
    return digest.hexdigest()


def _verify_file(folder: Storage, name: str, entry: dict[str, Any], *, parse: bool = False) -> None:
    """One file against its manifest entry, in bounded memory: its sha256 and, with `parse`, what
    `_check_content` checks (a safetensors header, a state.json object); CorruptCheckpoint if not."""
    size = entry["bytes"]
    if _sha256_of(folder, name, size) != entry["sha256"]:
        raise CorruptCheckpoint(f"{name}: sha256 does not match the manifest")
    if not parse:
        return
    if name.endswith(".safetensors"):
        head = _read_checked(folder, name, size=size, end=8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        _check_content(name, _read_checked(folder, name, size=size, end=8 + min(length, _HEADER_LIMIT)), size)
    elif name == "state.json":
        _check_content(name, _read_checked(folder, name, size=size, limit=STATE_JSON_LIMIT), size)


_HEADER_LIMIT = 100_000_000  # the most safetensors itself reads as a header


def _check_safetensors(head: bytes, total: int) -> None:
    """ValueError unless `head`, the first bytes of a file of `total` bytes, is the header of what
    safetensors loads (it describes the file's data exactly)."""
    if total < 8 or len(head) < 8:
        raise ValueError("shorter than a header")
    (length,) = struct.unpack("<Q", head[:8])
    if length > total - 8 or length > _HEADER_LIMIT:
        raise ValueError(f"its header length {length} exceeds the file")
    if head[8:9] != b"{":
        raise ValueError("its header is not a JSON object")
    described_values(json.loads(head[8 : 8 + length]), total - 8 - length)


def _check_content(name: str, data: bytes, total: int) -> None:
    """Bytes the manifest vouches for are still data: a safetensors file safetensors loads (`data`:
    at least its header, of a file of `total` bytes), a state.json that is a JSON object;
    CorruptCheckpoint otherwise (cheap: no tensor is built)."""
    if name.endswith(".safetensors"):
        try:
            _check_safetensors(data, total)
        except (struct.error, ValueError) as exc:
            raise CorruptCheckpoint(f"{name}: not a safetensors file ({str(exc)[:200]})") from None
    elif name == "state.json":
        try:
            state = json.loads(data)
        except ValueError as exc:
            raise CorruptCheckpoint(f"{name}: not JSON ({exc})") from None
        if not isinstance(state, dict):
            raise CorruptCheckpoint(f"{name}: not a JSON object")


def _manifest(folder: Storage, required: tuple[str, ...] = REQUIRED) -> dict[str, Any]:
    """The parsed manifest; CorruptCheckpoint unless it is well-formed and lists every `required` file."""
    try:
        manifest = json.loads(_read_checked(folder, MANIFEST, limit=MANIFEST_LIMIT))
    except CorruptCheckpoint as exc:
        if str(exc) == f"{MANIFEST}: missing":
            raise CorruptCheckpoint(f"no {MANIFEST}") from None
        raise
    except ValueError as exc:
        raise CorruptCheckpoint(f"{MANIFEST} unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"{MANIFEST} is not a {FORMAT} manifest")
    files = manifest["files"]
    for name in files:  # before anything is opened: a name is a file of this folder, nothing else
        if not PLAIN_FILE.fullmatch(name) or name == MANIFEST:
            raise CorruptCheckpoint(f"{MANIFEST}: {name[:120]!r} is not a plain file name of the checkpoint folder")
    missing = [name for name in required if name not in files]
    if missing:
        raise CorruptCheckpoint(f"{MANIFEST} does not list {', '.join(missing)}")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and is_integer(entry.get("bytes"))
                and isinstance(entry.get("sha256"), str)):
            raise CorruptCheckpoint(f"{MANIFEST}: the entry of {name} is malformed (expected {{bytes: int, sha256: str}}, "
                                    f"got {json.dumps(entry)[:80]})")
    return manifest


@dataclass
class Snapshot:
    """A CPU copy of the training state at `step`, ready to be written by any thread."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    state: dict[str, Any]  # state.json
    blocked_s: float = 0.0  # loop time spent taking the snapshot (reported, not written)
    # The files to commit, already encoded (trainer.runtime's checkpoints: state.json, state.pt,
    # folder.tar); None: model/optimizer/state as `encode` writes them.
    files: dict[str, bytes] | None = None


@dataclass
class Loaded:
    step: int
    path: Path | str
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # a state_dict for optimizer.load_state_dict
    state: dict[str, Any]


def encode(snap: Snapshot) -> dict[str, list[bytes | memoryview]]:
    """A checkpoint's files as buffers to write in order (headers and JSON; the tensors' own memory)."""
    if snap.files is not None:
        return {name: [data] for name, data in snap.files.items()}
    return {
        "model.safetensors": safetensors_parts(snap.model),
        "optimizer.safetensors": safetensors_parts(snap.optimizer),
        "state.json": [json.dumps(snap.state, separators=(",", ":")).encode()],
    }


class Checkpointer:
    """`save(step, ...)` on every rank at the same step; `load()`; `wait()` before exiting.

    `root` is a local folder or an fsspec URL (see trainer.storage)."""

    def __init__(
        self,
        root: str | Path | Storage,
        cfg: CheckpointConfig,
        *,
        rank: int = 0,
        log: Callable[[str], None] = print,
        on_commit: Callable[[dict[str, Any]], None] | None = None,
        at_save: Callable[[int], None] | None = None,
        required: tuple[str, ...] = REQUIRED,
    ) -> None:
        self.store = Storage(root)
        self.required = required  # the files a checkpoint's manifest must list (trainer.runtime's differ)
        try:  # a run dir's `checkpoints` that is a link is refused: nothing is written or deleted through it
            self.root = self.store.local_path() if self.store.local else self.store.url
        except OSError as exc:
            raise CheckpointError(f"checkpoints at {self.store.url}: {exc.strerror or exc}") from None
        self.cfg = cfg
        self.rank = rank
        self.log = log
        self.on_commit = on_commit
        # Fault injection's kill@save (contract 3, docs/contracts.md): called with the step once per
        # write, by the writer after the data files and before the commit, by other ranks in save().
        self.at_save = at_save
        self.last_step: int | None = None  # newest step saved or loaded (same on every rank)
        self.blocked_s = 0.0  # loop time spent in save() (the stall)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gangflow-ckpt") if cfg.async_save and rank == 0 else None
        self._pending: Future | None = None
        self._writer: WriterProcess | None = None  # rank 0, local disk: by start_writer() or the first write

    def _location(self, name: str) -> Path | str:
        return self.store.local_path(name) if self.store.local else self.store.uri(name)

    # --- saving ---------------------------------------------------------------------------------

    def start_writer(self) -> None:
        """Start the writer process now (rank 0, local disk), so that the first save does not wait
        for its start-up: it comes up beside the rank's own start (resume, first steps)."""
        if self.rank == 0 and self.store.local and self._writer is None:
            self._writer = WriterProcess()
            self._writer.start()

    def save(self, snapshot: Snapshot, *, block: bool = False) -> None:
        """Commit `snapshot` (rank 0 writes; other ranks only record the step)."""
        t0 = time.perf_counter()
        self.last_step = snapshot.step
        if self.rank != 0 and self.at_save is not None:
            self.at_save(snapshot.step)
        if self.rank == 0:
            self.wait()  # at most one write in flight
            # Encoded here, not by the background thread: a few hundred microseconds of headers and
            # JSON, which that thread would take longer over, contending with the loop for the GIL.
            files = encode(snapshot)
            if self._pool is not None and not block:
                sent = self._send_now(snapshot, files)
                snapshot.blocked_s += time.perf_counter() - t0
                self._pending = self._pool.submit(self._commit, snapshot, files, blocking=False, sent=sent)
            else:
                self._commit(snapshot, files, blocking=True)
        self.blocked_s += time.perf_counter() - t0

    def _send_now(self, snap: Snapshot, files: dict[str, list[bytes | memoryview]]) -> bool:
        """A checkpoint that fits in the writer's input pipe is handed over by the loop itself (one
        writev, tens of microseconds), so the writer starts at once instead of when the background
        thread first gets the GIL; that thread then only waits for the reply. Not with kill@save
        armed: its handshake runs through the thread."""
        return (self._writer is not None and self.at_save is None
                and self._writer.send_nowait(self.store.local_path(), snap.step, files, keep_last=self.cfg.keep_last))

    def wait(self) -> None:
        """Block until the write in flight (if any) is committed; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._writer is not None:
                self._writer.close()
                drop_spares(self.store.local_path())  # the writer has exited: nobody will reuse it

    def _commit(self, snap: Snapshot, files: dict[str, list[bytes | memoryview]], *, blocking: bool,
                sent: bool = False) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            info = self.write(snap, files, sent=sent)
        except OSError as exc:
            raise CheckpointError(f"writing checkpoint step-{snap.step} to {self.store.url} failed: {exc}") from exc
        write_s = time.perf_counter() - t0
        info["duration_s"] = round(snap.blocked_s + write_s, 6)  # snapshot + serialize + write + commit
        info["blocked_s"] = round(snap.blocked_s + (write_s if blocking else 0.0), 6)
        if self.on_commit is not None:
            self.on_commit(info)
        return info

    def write(self, snap: Snapshot, files: dict[str, list[bytes | memoryview]] | None = None, *,
              sent: bool = False) -> dict[str, Any]:
        """Write, commit (local: the writer process renames; object storage: manifest last), prune.
        `files`: `encode(snap)`, when the caller has it; `sent`: the writer has it already
        (`_send_now`). Returns {step, path, bytes}."""
        files = encode(snap) if files is None else files
        name = f"step-{snap.step}"
        if self.store.local:
            if self._writer is None:
                self._writer = WriterProcess()
            in_flight = (lambda: self._in_flight(name)) if self.at_save is not None else None
            written = self._writer.commit(self.store.local_path(), snap.step, files, keep_last=self.cfg.keep_last,
                                          before_commit=in_flight, sent=sent)
        else:
            blobs = {file: b"".join(parts) for file, parts in files.items()}
            self._write_remote(name, blobs, manifest_bytes(snap.step, blobs))
            self.prune()
            written = sum(len(data) for data in blobs.values())
        return {"step": snap.step, "path": str(self._location(name)), "bytes": written}

    def _write_remote(self, name: str, blobs: dict[str, bytes], manifest: bytes) -> None:
        """Object storage has no rename: the files, then the manifest LAST. A re-save of the same
        step first deletes the old manifest, so the folder is invisible while it is rewritten."""
        self.store.remove(name, MANIFEST)
        for file, data in blobs.items():
            self.store.write_bytes(f"{name}/{file}", data)
        self._in_flight(name)
        self.store.write_bytes(f"{name}/{MANIFEST}", manifest)  # the commit

    def _in_flight(self, name: str) -> None:
        """The data files are written, the commit is not: where kill@save strikes the writer."""
        if self.at_save is not None:
            self.at_save(int(name.removeprefix("step-")))

    def prune(self) -> None:
        if self.store.local:
            prune_local(self.store.local_path(), self.cfg.keep_last)
            return
        for _, path in self.committed()[self.cfg.keep_last :]:
            name = Path(str(path)).name
            self.store.remove(name, MANIFEST)  # invisible at once
            self.store.remove(name)

    def cleanup_stale(self) -> None:
        """Remove leftovers of interrupted writes and deletions (rank 0, before training): local
        temporary/trash folders; on object storage, step folders without a manifest."""
        for name in self.store.listdir():
            if name.startswith((".tmp-", ".trash-", SPARE_PREFIX)):
                self.store.remove(name)
            elif not self.store.local and step_of(name) is not None and not self.store.exists(name, MANIFEST):
                self.store.remove(name)

    # --- loading --------------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, Path | str]]:
        """Committed checkpoints, newest first (by name; not yet verified). On object storage a
        folder counts only once its manifest exists."""
        if self.store.local:  # the writer process lists the same folders when it prunes
            return [(step, self._location(f"step-{step}")) for step in committed_steps(self.store.local_path())]
        found = []
        for name in self.store.listdir():
            step = step_of(name)
            if step is not None and self.store.exists(name, MANIFEST):
                found.append((step, self._location(name)))
        return sorted(found, key=lambda item: item[0], reverse=True)

    @staticmethod
    def verify(path: Path | str | Storage, required: tuple[str, ...] = REQUIRED, *, parse: bool = False) -> dict[str, Any]:
        """The manifest of a committed checkpoint, after checking every file (and with `parse`,
        that the tensors' headers and state.json are well-formed); CorruptCheckpoint if not."""
        folder = Storage(path)
        manifest = _manifest(folder, required)
        for name, entry in manifest["files"].items():
            _verify_file(folder, name, entry, parse=parse)
        return manifest

    def select(self, load: Callable[[int], object] | None = None, *,
               move_aside: bool = True) -> tuple[int, Path | str] | None:
        """The newest checkpoint that verifies; logs and moves aside the corrupt ones (rank 0; not
        with `move_aside=False`). `load(step)`: the caller's own load of the one chosen; a
        MalformedCheckpoint it raises sets that one aside too (every rank and retry would fail it
        alike) and the one before is tried."""
        corrupt: list[tuple[int, Path | str, str]] = []
        chosen = None
        for step, path in self.committed():
            try:
                self.verify(path, self.required, parse=True)
                if load is not None:
                    load(step)
            except CorruptCheckpoint as exc:
                corrupt.append((step, path, str(exc)))
                continue
            chosen = (step, path)
            break
        then = f"resuming from step-{chosen[0]}" if chosen else "no older checkpoint; starting from step 0"
        for step, _path, why in corrupt if move_aside else ():
            self.log(f"gangflow: checkpoint step-{step} is corrupt ({why}); {then}")
            self.move_aside(step)
        return chosen

    def move_aside(self, step: int) -> None:
        """Keep a bad checkpoint for inspection, out of the way of every later select()."""
        try:
            self.store.rename(f"step-{step}", f"corrupt-step-{step}-{int(time.time())}")
        except OSError:
            if not self.store.local:  # at least make it invisible
                self.store.remove(f"step-{step}", MANIFEST)

    def read(self, step: int, path: Path | str | None = None) -> Loaded:
        """Load checkpoint `step` (verifying it); CorruptCheckpoint if it does not verify,
        MalformedCheckpoint if it verifies but does not load."""
        folder = Storage(path) if path is not None else self.store.child(f"step-{step}")
        files = _manifest(folder)["files"]
        tensors = {}
        for name in ("model.safetensors", "optimizer.safetensors"):
            data = _read_verified(folder, name, files[name])
            try:
                tensors[name] = safetensors.torch.load(data)
            except MemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - the library's own error type: the file is not what it says
                raise MalformedCheckpoint(f"{name}: not loadable ({type(exc).__name__}: {str(exc)[:200]})") from None
        model, opt_tensors = tensors["model.safetensors"], tensors["optimizer.safetensors"]
        data = _read_verified(folder, "state.json", files["state.json"])
        try:
            state = json.loads(data)
            optimizer = unflatten_optimizer(opt_tensors, state["optimizer"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MalformedCheckpoint(f"state.json is malformed ({type(exc).__name__}: {exc})") from None
        self.last_step = step
        return Loaded(step=step, path=path or self._location(f"step-{step}"), model=model, optimizer=optimizer, state=state)

    def read_files(self, step: int) -> dict[str, bytes]:
        """Every file of checkpoint `step`, each verified against the manifest (trainer.runtime's
        checkpoints); CorruptCheckpoint if one does not verify."""
        folder = self.store.child(f"step-{step}")
        files = _manifest(folder, self.required)["files"]
        data = {name: _read_verified(folder, name, entry) for name, entry in files.items()}
        self.last_step = step
        return data
