"""Checkpoints: complete training state, committed atomically, loaded only when intact.

Layout of `DIR/checkpoints/`:

    step-200/                  committed (the name appears only by an atomic rename)
      model.safetensors        the unwrapped model's state_dict
      optimizer.safetensors    optimizer tensors (e.g. momentum buffers), keys "<param>/<name>"
      state.json               step, epoch, position in the epoch, world size, config, LR
                               scheduler, optimizer param groups, RNG states of every rank
      manifest.json            written last: size and sha256 of every file above
    .tmp-step-300-1a2b3c4d/    being written (ignored; removed on the next start)
    corrupt-step-250-<time>/   a committed checkpoint that failed verification (kept to inspect)

Saving: on the loop thread, `save()` copies the state to CPU (cheap: it is a copy, not a
serialization); rank 0 then serializes, writes to `.tmp-step-N-*`, fsyncs every file and the
folder, renames it to `step-N`, fsyncs the parent, and prunes to `keep_last` -- in a background
thread when `checkpoint.async_save` (one write in flight at most: the next save waits for it).
Loading: the newest `step-N` whose manifest and checksums verify; a corrupt one is logged,
moved aside, and the previous one is used. Nothing is unpickled: tensors are safetensors,
everything else JSON.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from trainer.config import CheckpointConfig
from trainer.errors import CheckpointError

FORMAT = "gangflow-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CorruptCheckpoint(Exception):
    """A committed checkpoint that does not verify; the message says why."""


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


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Python, numpy and torch (and CUDA) RNG states of this process, as JSON."""
    py = random.getstate()
    npst = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": _b64(torch.get_rng_state()),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


# --- files --------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _read_verified(folder: Path, name: str, entry: dict[str, Any]) -> bytes:
    path = folder / name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpoint(f"{name}: unreadable ({exc.strerror or exc})") from None
    if len(data) != entry.get("bytes"):
        raise CorruptCheckpoint(f"{name} has {len(data)} bytes, the manifest says {entry.get('bytes')}")
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise CorruptCheckpoint(f"{name}: sha256 does not match the manifest")
    return data


def _manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{MANIFEST} unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"{MANIFEST} is not a {FORMAT} manifest")
    return manifest


@dataclass
class Snapshot:
    """A CPU copy of the training state at `step`, ready to be written by any thread."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    state: dict[str, Any]  # state.json
    blocked_s: float = 0.0  # loop time spent taking the snapshot (reported, not written)


@dataclass
class Loaded:
    step: int
    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # a state_dict for optimizer.load_state_dict
    state: dict[str, Any]


class Checkpointer:
    """`save(step, ...)` on every rank at the same step; `load()`; `wait()` before exiting."""

    def __init__(
        self,
        root: str | Path,
        cfg: CheckpointConfig,
        *,
        rank: int = 0,
        log: Callable[[str], None] = print,
        on_commit: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self.rank = rank
        self.log = log
        self.on_commit = on_commit
        self.last_step: int | None = None  # newest step saved or loaded (same on every rank)
        self.blocked_s = 0.0  # loop time spent in save() (the stall)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gangflow-ckpt") if cfg.async_save and rank == 0 else None
        self._pending: Future | None = None

    # --- saving ---------------------------------------------------------------------------------

    def save(self, snapshot: Snapshot, *, block: bool = False) -> None:
        """Commit `snapshot` (rank 0 writes; other ranks only record the step)."""
        t0 = time.perf_counter()
        self.last_step = snapshot.step
        if self.rank == 0:
            self.wait()  # at most one write in flight
            if self._pool is not None and not block:
                snapshot.blocked_s += time.perf_counter() - t0
                self._pending = self._pool.submit(self._commit, snapshot, blocking=False)
            else:
                self._commit(snapshot, blocking=True)
        self.blocked_s += time.perf_counter() - t0

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

    def _commit(self, snap: Snapshot, *, blocking: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            info = self.write(snap)
        except OSError as exc:
            raise CheckpointError(f"writing checkpoint step-{snap.step} to {self.root} failed: {exc}") from exc
        write_s = time.perf_counter() - t0
        info["duration_s"] = round(snap.blocked_s + write_s, 6)  # snapshot + serialize + write + commit
        info["blocked_s"] = round(snap.blocked_s + (write_s if blocking else 0.0), 6)
        if self.on_commit is not None:
            self.on_commit(info)
        return info

    def write(self, snap: Snapshot) -> dict[str, Any]:
        """Write aside, fsync, atomically rename into place, prune. Returns {step, path, bytes}."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{snap.step}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        files = {
            "model.safetensors": _write_file(tmp / "model.safetensors", safetensors.torch.save(snap.model)),
            "optimizer.safetensors": _write_file(tmp / "optimizer.safetensors", safetensors.torch.save(snap.optimizer)),
            "state.json": _write_file(tmp / "state.json", json.dumps(snap.state).encode()),
        }
        manifest = {"format": FORMAT, "step": snap.step, "files": files, "time": time.time()}
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: marks completeness
        _fsync_dir(tmp)
        final = self.root / f"step-{snap.step}"
        trash = None
        if final.exists():  # re-saving a step (e.g. after a resume at it): move the old one away first
            trash = self.root / f".trash-step-{snap.step}-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
        tmp.rename(final)
        _fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self.prune()
        size = sum(f["bytes"] for f in files.values())
        return {"step": snap.step, "path": str(final), "bytes": size}

    def prune(self) -> None:
        for _, path in self.committed()[self.cfg.keep_last :]:
            trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
            try:
                path.rename(trash)  # gone from view at once; delete at leisure
            except OSError:
                continue
            shutil.rmtree(trash, ignore_errors=True)

    def cleanup_stale(self) -> None:
        """Remove leftovers of interrupted writes and deletions (rank 0, before training)."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(path, ignore_errors=True)

    # --- loading --------------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, Path]]:
        """Committed checkpoints, newest first (by name; not yet verified)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found, reverse=True)

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """The manifest of a committed checkpoint, after checking every file; CorruptCheckpoint if not."""
        manifest = _manifest(path)
        for name, entry in manifest["files"].items():
            _read_verified(path, name, entry)
        return manifest

    def select(self) -> tuple[int, Path] | None:
        """The newest checkpoint that verifies; logs and moves aside the corrupt ones (rank 0)."""
        corrupt: list[tuple[int, Path, str]] = []
        chosen = None
        for step, path in self.committed():
            try:
                self.verify(path)
            except CorruptCheckpoint as exc:
                corrupt.append((step, path, str(exc)))
                continue
            chosen = (step, path)
            break
        then = f"resuming from step-{chosen[0]}" if chosen else "no older checkpoint; starting from step 0"
        for step, path, why in corrupt:
            self.log(f"gangflow: checkpoint step-{step} is corrupt ({why}); {then}")
            try:
                path.rename(self.root / f"corrupt-step-{step}-{int(time.time())}")
            except OSError:
                pass
        return chosen

    def read(self, step: int, path: Path | None = None) -> Loaded:
        """Load checkpoint `step` (verifying it); CorruptCheckpoint if it does not verify."""
        path = path or self.root / f"step-{step}"
        files = _manifest(path)["files"]
        for name in ("model.safetensors", "optimizer.safetensors", "state.json"):
            if name not in files:
                raise CorruptCheckpoint(f"{MANIFEST} does not list {name}")
        model = safetensors.torch.load(_read_verified(path, "model.safetensors", files["model.safetensors"]))
        opt_tensors = safetensors.torch.load(_read_verified(path, "optimizer.safetensors", files["optimizer.safetensors"]))
        state = json.loads(_read_verified(path, "state.json", files["state.json"]))
        self.last_step = step
        return Loaded(step=step, path=path, model=model, optimizer=unflatten_optimizer(opt_tensors, state["optimizer"]), state=state)
