"""Checkpoint commit/skip logic, in-process with a tiny model (no process group)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from trainer.checkpoint import (
    Checkpointer,
    CorruptCheckpoint,
    Snapshot,
    cpu_copy,
    flatten_optimizer,
    rng_state,
    safetensors_parts,
    set_rng_state,
    unflatten_optimizer,
)
from trainer.checkpoint_commit import commit_local, committed_steps
from trainer.config import CheckpointConfig

ROOT = Path(__file__).resolve().parents[3]


def _state(step: int):
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tensors, js = flatten_optimizer(opt.state_dict())
    return model, opt, Snapshot(step, cpu_copy(model.state_dict()), tensors, {"step": step, "optimizer": js, "rng": [rng_state()]})


def _ckpt(tmp_path, logs=None, **cfg):
    return Checkpointer(tmp_path / "checkpoints", CheckpointConfig(**cfg), log=(logs.append if logs is not None else print))


@pytest.mark.parametrize("async_save", [True, False])
def test_save_commits_atomically_and_keeps_last(tmp_path, async_save):
    commits = []
    ck = _ckpt(tmp_path, keep_last=2, async_save=async_save)
    ck.on_commit = commits.append
    for step in (10, 20, 30):
        ck.save(_state(step)[2])
    ck.close()
    assert [s for s, _ in ck.committed()] == [30, 20]
    assert [c["step"] for c in commits] == [10, 20, 30]
    assert all(c["bytes"] > 0 and c["duration_s"] >= 0 for c in commits)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-20", "step-30"]  # no temp or trash left
    manifest = json.loads((tmp_path / "checkpoints" / "step-30" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors", "state.json"}


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    model, opt, snap = _state(5)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    snap.state["rng"] = [rng_state()]
    expected = (random.random(), np.random.rand(), torch.rand(1))
    ck = _ckpt(tmp_path)
    ck.save(snap, block=True)
    loaded = ck.read(5)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.model[key], value)
    fresh = torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(loaded.optimizer)
    for pid, entry in opt.state_dict()["state"].items():
        assert torch.equal(fresh.state_dict()["state"][pid]["momentum_buffer"], entry["momentum_buffer"])
    set_rng_state(loaded.state["rng"][0])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_optimizer_flatten_handles_adam_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    tensors, js = flatten_optimizer(opt.state_dict())
    json.dumps(js)
    back = unflatten_optimizer(tensors, json.loads(json.dumps(js)))
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.01)
    fresh.load_state_dict(back)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _three(tmp_path, logs):
    ck = _ckpt(tmp_path, logs, keep_last=5, async_save=False)
    for step in (100, 200, 300):
        ck.save(_state(step)[2])
    return ck


def test_truncated_newest_is_skipped_and_logged(tmp_path):
    logs: list[str] = []
    ck = _three(tmp_path, logs)
    target = tmp_path / "checkpoints" / "step-300" / "model.safetensors"
    os.truncate(target, target.stat().st_size // 2)
    assert ck.select()[0] == 200
    assert logs == [logs[0]] and "checkpoint step-300 is corrupt (model.safetensors has" in logs[0]
    assert "resuming from step-200" in logs[0]
    assert [s for s, _ in ck.committed()] == [200, 100]  # moved aside, kept for inspection
    assert any(p.name.startswith("corrupt-step-300") for p in (tmp_path / "checkpoints").iterdir())


def test_flipped_byte_and_missing_manifest_are_corrupt(tmp_path):
    logs: list[str] = []
    ck = _three(tmp_path, logs)
    state = tmp_path / "checkpoints" / "step-300" / "optimizer.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    (tmp_path / "checkpoints" / "step-200" / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        ck.verify(tmp_path / "checkpoints" / "step-300")
    assert ck.select()[0] == 100
    assert "step-300 is corrupt (optimizer.safetensors: sha256" in logs[0]
    assert "step-200 is corrupt (no manifest.json); resuming from step-100" in logs[1]


def test_half_written_checkpoints_are_invisible_and_cleaned(tmp_path):
    logs: list[str] = []
    ck = _three(tmp_path, logs)
    tmp = tmp_path / "checkpoints" / ".tmp-step-400-deadbeef"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"partial")
    assert ck.select()[0] == 300 and not logs
    ck.cleanup_stale()
    assert not tmp.exists()


def test_nothing_valid_means_start_from_zero(tmp_path):
    logs: list[str] = []
    ck = _ckpt(tmp_path, logs)
    assert ck.select() is None
    ck.save(_state(10)[2], block=True)
    (tmp_path / "checkpoints" / "step-10" / "state.json").write_text("{}")
    assert ck.select() is None
    assert "no older checkpoint; starting from step 0" in logs[0]


def test_resave_of_same_step_replaces_it(tmp_path):
    ck = _ckpt(tmp_path, async_save=False)
    ck.save(_state(10)[2])
    ck.save(_state(10)[2])
    assert [s for s, _ in ck.committed()] == [10]
    ck.verify(tmp_path / "checkpoints" / "step-10")


def _rewrite_manifest(path, change):
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, why", [
    (lambda m: m["files"].__setitem__("state.json", "not a dict"), "the entry of state.json is malformed"),
    (lambda m: m.__setitem__("files", {}), "does not list model.safetensors, optimizer.safetensors, state.json"),
    (lambda m: m["files"]["model.safetensors"].pop("sha256"), "the entry of model.safetensors is malformed"),
    (lambda m: m["files"]["optimizer.safetensors"].__setitem__("bytes", "12"), "the entry of optimizer.safetensors is malformed"),
    (lambda m: m["files"].pop("state.json"), "does not list state.json"),
])
def test_malformed_manifest_is_moved_aside_and_the_previous_one_used(tmp_path, change, why):
    """Issue 12.8: a malformed manifest is a corrupt checkpoint (not an AttributeError, not a pass)."""
    logs: list[str] = []
    ck = _three(tmp_path, logs)
    _rewrite_manifest(tmp_path / "checkpoints" / "step-300", change)
    with pytest.raises(CorruptCheckpoint, match=why):
        ck.verify(tmp_path / "checkpoints" / "step-300")
    assert ck.select()[0] == 200
    assert f"checkpoint step-300 is corrupt" in logs[0] and why in logs[0] and "resuming from step-200" in logs[0]
    assert any(p.name.startswith("corrupt-step-300") for p in (tmp_path / "checkpoints").iterdir())
    ck.read(200)


# --- the same guarantees on object storage (S3 API, moto server on 127.0.0.1) ------------------------


def test_s3_checkpoints_commit_with_manifest_last_prune_and_fall_back(s3, tmp_path):
    import fsspec

    root = s3.bucket("gangflow-ckpt-unit") + "/runs/g1/checkpoints"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # not an instance cached by an earlier test of this process
    logs: list[str] = []
    ck = Checkpointer(root, CheckpointConfig(keep_last=2, async_save=True), log=logs.append)
    model, opt, snap = _state(30)
    for step in (10, 20, 30):
        ck.save(_state(step)[2] if step != 30 else snap)
    ck.close()
    assert [s for s, _ in ck.committed()] == [30, 20]
    assert ck.committed()[0][1] == root + "/step-30"
    loaded = ck.read(30)
    assert all(torch.equal(loaded.model[k], v) for k, v in model.state_dict().items())
    # A step folder without its manifest (a write cut short) is invisible and cleaned up.
    fs.pipe_file(root.removeprefix("s3://") + "/step-40/model.safetensors", b"partial")
    fs.invalidate_cache()
    assert [s for s, _ in ck.committed()] == [30, 20]
    ck.cleanup_stale()
    assert not fs.exists(root.removeprefix("s3://") + "/step-40/model.safetensors")
    # A corrupt newest one is moved aside and the previous one used.
    fs.pipe_file(root.removeprefix("s3://") + "/step-30/model.safetensors", b"garbage")
    assert ck.select()[0] == 20
    assert "checkpoint step-30 is corrupt (model.safetensors has 7 bytes" in logs[0]
    assert [s for s, _ in ck.committed()] == [20]
    assert any(p.rsplit("/", 1)[-1].startswith("corrupt-step-30") for p in fs.ls(root.removeprefix("s3://"), refresh=True))


def test_s3_a_step_name_that_is_not_canonical_is_not_a_checkpoint(s3):
    """As on local disk: `step-030/` with a manifest is not step 30 (nothing could address it by
    that name); it is never listed, pruned or removed as a checkpoint."""
    import fsspec

    root = s3.bucket("gangflow-ckpt-unit") + "/runs/twins/checkpoints"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    twin = root.removeprefix("s3://") + "/step-030/manifest.json"
    fs.pipe_file(twin, b"{}")
    ck = Checkpointer(root, CheckpointConfig(keep_last=1, async_save=False), log=print)
    assert ck.committed() == []
    for step in (10, 20):
        ck.save(_state(step)[2])
    ck.cleanup_stale()
    ck.close()
    assert [s for s, _ in ck.committed()] == [20]
    fs.invalidate_cache()
    assert fs.exists(twin)


def test_commit_is_durable_before_the_rename_and_after_it(tmp_path, monkeypatch):
    """Every file of the checkpoint and its folder are fsynced before the rename that commits it,
    and the parent after: a power cut can lose the newest checkpoint, never expose a torn one.
    (commit_local is what the writer process runs; here it runs in-process to watch its calls.)"""
    events = []
    real_fsync, real_rename = os.fsync, type(tmp_path).rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self, target):
        events.append(("rename", str(self), str(target)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(type(tmp_path), "rename", rename)
    root = tmp_path / "checkpoints"
    commit_local(root, 10, {"model.safetensors": b"m" * 1000, "optimizer.safetensors": b"o", "state.json": b"{}"})
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert len(renames) == 1, events
    (_, tmp, final), at = events[renames[0]], renames[0]
    synced_before = {e[1] for e in events[:at] if e[0] == "fsync"}
    expected = {os.path.join(tmp, name) for name in ("model.safetensors", "optimizer.safetensors", "state.json", "manifest.json")}
    assert expected | {tmp} <= synced_before, sorted(synced_before)
    assert ("fsync", str(root)) in events[at + 1 :]
    assert final == str(root / "step-10")
    assert Checkpointer.verify(root / "step-10")["step"] == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8,
                                   torch.uint8, torch.bool])  # fmt: skip
def test_safetensors_encoding_reads_back_exactly_with_the_library(dtype):
    torch.manual_seed(0)
    tensors = {
        "w": (torch.randn(3, 5) * 100).to(dtype), "scalar": torch.tensor(7).to(dtype), "empty": torch.zeros(0, 4, dtype=dtype),
        "layer.0/momentum_buffer": (torch.randn(17) * 10).to(dtype),
    }  # fmt: skip
    data = b"".join(safetensors_parts(tensors))
    back = safetensors.torch.load(data)
    assert set(back) == set(tensors)
    for key, tensor in tensors.items():
        assert back[key].dtype == dtype and back[key].shape == tensor.shape and torch.equal(back[key], tensor), key


def test_an_unusual_dtype_falls_back_to_the_library_encoder():
    tensors = {"c": torch.randn(2, 2, dtype=torch.complex64)}
    parts = safetensors_parts(tensors)
    assert len(parts) == 1 and parts[0] == safetensors.torch.save(tensors)


def test_local_commits_run_in_a_writer_process_that_ends_with_its_parent(tmp_path):
    """The rank's saves are committed by one writer process (not a thread of the rank); it exits
    when the rank closes the checkpointer, and when the rank dies without closing it."""
    code = f"""
import os, sys, torch
from trainer.checkpoint import Checkpointer, Snapshot
from trainer.config import CheckpointConfig
ck = Checkpointer({str(tmp_path / "checkpoints")!r}, CheckpointConfig(async_save=True, keep_last=2))
for step in (1, 2, 3):
    ck.save(Snapshot(step, {{"w": torch.ones(4) * step}}, {{}}, {{"step": step}}))
ck.wait()
print("writer", ck._writer._proc.pid, flush=True)
if sys.argv[1] == "close":
    ck.close()
    print("closed", ck._writer._proc, flush=True)
os._exit(0)  # no close, no atexit: as if killed
"""
    for how in ("close", "die"):
        out = subprocess.run([sys.executable, "-c", code, how], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr
        pid = int(out.stdout.split()[1])
        assert _gone_within(pid, 5), f"{how}: writer {pid} still running"
        if how == "close":
            assert "closed None" in out.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]
    assert Checkpointer.verify(tmp_path / "checkpoints" / "step-3")["step"] == 3


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(") ", 1)[1].startswith("Z"):
                    return True  # a zombie: exited, not yet reaped by init
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_writer_killed_between_saves_or_during_one_is_replaced(tmp_path):
    """The OOM killer may pick the writer: the next commit starts a new one (and a commit it was
    in the middle of is made again), so a long run does not fail for it."""
    import signal

    ck = _ckpt(tmp_path, async_save=False, keep_last=5)
    ck.save(_state(1)[2])
    first = ck._writer._proc.pid
    os.kill(first, signal.SIGKILL)
    ck._writer._proc.wait()
    ck.save(_state(2)[2])  # between saves: a new writer
    second = ck._writer._proc.pid
    assert second != first

    killed = []

    def kill_writer_mid_commit():  # after the data files are written, before the manifest
        if not killed:
            killed.append(ck._writer._proc.pid)
            os.kill(ck._writer._proc.pid, signal.SIGKILL)

    ck.at_save = lambda step: kill_writer_mid_commit()
    ck.save(_state(3)[2])
    ck.close()
    assert killed == [second]
    assert [s for s, _ in ck.committed()] == [3, 2, 1]
    for step in (1, 2, 3):
        ck.verify(tmp_path / "checkpoints" / f"step-{step}")


def test_a_commit_the_disk_refuses_fails_with_the_path_and_the_cause(tmp_path):
    from trainer.errors import CheckpointError

    (tmp_path / "checkpoints").write_text("a file where the folder should be")
    ck = _ckpt(tmp_path, async_save=True)
    ck.save(_state(1)[2])
    with pytest.raises(CheckpointError, match=r"writing checkpoint step-1 to .*checkpoints failed: .*(File exists|Not a directory)"):
        ck.wait()
    ck.close()


def test_a_writer_that_keeps_dying_fails_the_save_after_three(tmp_path):
    """More deaths than WRITER_STARTS in one commit is not a fluke: the save fails, saying so."""
    import signal

    from trainer.errors import CheckpointError

    ck = _ckpt(tmp_path, async_save=False)
    pids = []

    def kill_writer():  # every writer, in the middle of the commit
        pids.append(ck._writer._proc.pid)
        os.kill(pids[-1], signal.SIGKILL)

    ck.at_save = lambda step: kill_writer()
    with pytest.raises(CheckpointError, match=r"exited with code -9 in the middle of a commit.*; 3 writers died committing step-1"):
        ck.save(_state(1)[2])
    assert len(set(pids)) == 3
    assert ck.committed() == [] and not list((tmp_path / "checkpoints").glob(".tmp-*"))[1:]  # at most the last one's
    ck.close()


# --- recycling pruned folders; the loop's own hand-over; the compact RNG words ---------------------


def _tree(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in [folder, *folder.iterdir()]}


@pytest.mark.parametrize("async_save", [True, False])
def test_a_pruned_folder_is_kept_as_one_spare_and_the_next_commit_overwrites_it_in_place(tmp_path, async_save):
    """Pruning renames the oldest folder out of view to `.spare-*` (deleting fsynced files costs
    as much as writing them on this disk); the next commit writes into that folder's own files
    (same inodes), and the result verifies. There is never more than one spare."""
    root = tmp_path / "checkpoints"
    ck = _ckpt(tmp_path, keep_last=2, async_save=async_save)
    for step in (1, 2, 3):
        ck.save(_state(step)[2])
    ck.wait()
    [spare] = [p for p in root.iterdir() if p.name.startswith(".spare-")]
    old = _tree(spare)
    ck.save(_state(4)[2])
    ck.wait()
    assert [s for s, _ in ck.committed()] == [4, 3]
    new = _tree(root / "step-4")
    assert {name: new[name] for name in old if name != spare.name} == {n: i for n, i in old.items() if n != spare.name}
    assert new["step-4"] == old[spare.name]  # the folder itself, renamed
    ck.verify(root / "step-4")
    for step in range(5, 9):
        ck.save(_state(step)[2])
    ck.wait()
    assert len([p for p in root.iterdir() if p.name.startswith(".spare-")]) == 1
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".spare-")) == ["step-7", "step-8"]
    ck.close()
    assert sorted(p.name for p in root.iterdir()) == ["step-7", "step-8"]  # close() drops the spare


def test_a_spare_holding_other_and_longer_files_commits_exactly_the_new_checkpoint(tmp_path):
    """What the spare held beyond the new checkpoint (a longer file, a file it does not have, its
    old manifest) leaves no trace: every file has the new length and bytes, and it verifies."""
    root = tmp_path / "checkpoints"
    spare = root / ".spare-step-1-0000beef"
    spare.mkdir(parents=True)
    (spare / "model.safetensors").write_bytes(b"x" * 100_000)
    (spare / "extra.bin").write_bytes(b"left over")
    (spare / "manifest.json").write_text('{"format": "gangflow-checkpoint/1", "step": 1, "files": {}}' + " " * 5000)
    files = {"model.safetensors": b"m" * 1000, "optimizer.safetensors": b"o", "state.json": b'{"step": 2}'}
    commit_local(root, 2, files)
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]
    folder = root / "step-2"
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"} == files
    assert Checkpointer.verify(folder)["step"] == 2


def test_the_next_start_deletes_a_spare_a_dead_rank_left(tmp_path):
    root = tmp_path / "checkpoints"
    ck = _ckpt(tmp_path, keep_last=1, async_save=False)
    for step in (1, 2):
        ck.save(_state(step)[2])
    assert any(p.name.startswith(".spare-") for p in root.iterdir())  # no close(): as if killed
    nxt = _ckpt(tmp_path)
    nxt.cleanup_stale()
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]


def test_a_small_checkpoint_is_handed_to_the_writer_by_the_loop_itself(tmp_path):
    """With the background thread held up, a save that fits in the writer's pipe is committed
    anyway (the loop wrote it to the writer); one too large for the pipe waits for the thread.
    Both end committed, in order, with their commit callbacks."""
    import threading

    commits: list[int] = []
    ck = _ckpt(tmp_path, keep_last=5, async_save=True)
    ck.on_commit = lambda info: commits.append(info["step"])
    ck.start_writer()
    gate = threading.Event()
    for step, size in ((1, 16), (2, 4_000_000)):  # 16 floats; 16 MB, far beyond a 1 MiB pipe
        ck._pool.submit(gate.wait)  # the thread is busy until the gate opens
        ck.save(Snapshot(step, {"w": torch.ones(size)}, {}, {"step": step}))
        # the small one is committed within seconds; the large one cannot be while the thread is held
        deadline = time.monotonic() + (10 if step == 1 else 1)
        while not (tmp_path / "checkpoints" / f"step-{step}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        committed_while_held = (tmp_path / "checkpoints" / f"step-{step}").exists()
        assert committed_while_held == (step == 1), step
        gate.set()
        ck.wait()
        gate.clear()
    ck.close()
    assert commits == [1, 2]
    assert [s for s, _ in ck.committed()] == [2, 1]
    for step in (1, 2):
        ck.verify(tmp_path / "checkpoints" / f"step-{step}")


# --- a checkpoint larger than the writer's pipe: written by the rank into its folder ---------------


def _large(step: int) -> Snapshot:
    """A checkpoint of 2.4 MB: more than the writer's input pipe holds (1 MiB at most)."""
    weight = torch.arange(400_000, dtype=torch.float32) + step
    state = {"step": step, "optimizer": {"param_groups": [], "state": {}}}
    return Snapshot(step, {"w": weight}, {"0/momentum_buffer": weight * 2}, state)


def _large_files(step: int) -> dict[str, list]:
    from trainer.checkpoint import encode

    return encode(_large(step))


def test_a_large_checkpoint_is_written_by_the_rank_and_made_durable_by_the_writer_before_the_rename(tmp_path, monkeypatch):
    """The rank writes the data files into the commit's temporary folder without an fsync; the
    writer fsyncs every one of them, the manifest and the folder before the rename, the parent
    after, and the manifest holds each file's sha256. (In-process, to watch the calls.)"""
    from trainer.checkpoint_commit import commit_staged, stage_local

    events = []
    real_fsync, real_rename = os.fsync, type(tmp_path).rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd)))
    monkeypatch.setattr(type(tmp_path), "rename", lambda self, target: (events.append(("rename", str(self), str(target))),
                                                                         real_rename(self, target))[1])
    root = tmp_path / "checkpoints"
    files = _large_files(7)
    tmp = stage_local(root, 7, files)
    assert events == [] and sorted(p.name for p in tmp.iterdir()) == sorted(files)
    sizes = {name: sum(memoryview(p).nbytes for p in parts) for name, parts in files.items()}
    assert commit_staged(root, 7, tmp.name, sizes) == sum(sizes.values())
    [at] = [i for i, e in enumerate(events) if e[0] == "rename"]
    synced_before = {e[1] for e in events[:at] if e[0] == "fsync"}
    assert {str(tmp / name) for name in [*files, "manifest.json"]} | {str(tmp)} <= synced_before
    assert ("fsync", str(root)) in events[at + 1 :] and events[at][2] == str(root / "step-7")
    manifest = Checkpointer.verify(root / "step-7", parse=True)
    assert {name: entry["sha256"] for name, entry in manifest["files"].items()} == {
        name: hashlib.sha256(b"".join(bytes(p) for p in parts)).hexdigest() for name, parts in files.items()}


@pytest.mark.parametrize("change", ["link", "resized", "fifo", "not-its-folder"])
def test_a_staged_file_that_is_not_what_the_rank_wrote_is_never_committed_or_followed(tmp_path, change):
    from trainer.checkpoint_commit import commit_staged, stage_local

    outside = _outside(tmp_path)
    before = _snapshot_of(outside)
    root = tmp_path / "checkpoints"
    files = _large_files(3)
    tmp = stage_local(root, 3, files)
    sizes = {name: sum(memoryview(p).nbytes for p in parts) for name, parts in files.items()}
    model = tmp / "model.safetensors"
    folder = tmp.name
    if change == "link":
        model.unlink()
        model.symlink_to(outside / "model.safetensors")
        sizes["model.safetensors"] = (outside / "model.safetensors").stat().st_size
    elif change == "resized":
        os.truncate(model, 10)
    elif change == "fifo":
        model.unlink()
        os.mkfifo(model)
    else:
        folder = "../outside"
    with pytest.raises(OSError):
        commit_staged(root, 3, folder, sizes)
    assert _snapshot_of(outside) == before
    assert not (root / "step-3").exists()


def test_large_checkpoints_recycle_the_spare_survive_a_killed_writer_and_load_exactly(tmp_path, monkeypatch):
    """Through the Checkpointer: every save of a large checkpoint goes through the rank's staging;
    the next commit overwrites the spare's files in place (same inodes); a writer SIGKILLed between
    the data files and the manifest is replaced and the commit made again; each one loads bitwise."""
    import signal

    from trainer import checkpoint_commit

    staged: list[int] = []
    real_stage = checkpoint_commit.stage_local
    monkeypatch.setattr(checkpoint_commit, "stage_local",
                        lambda root, step, files: (staged.append(step), real_stage(root, step, files))[1])
    root = tmp_path / "checkpoints"
    ck = _ckpt(tmp_path, keep_last=2, async_save=True)
    ck.start_writer()
    for step in (1, 2, 3):
        ck.save(_large(step))
    ck.wait()
    [spare] = [p for p in root.iterdir() if p.name.startswith(".spare-")]
    old = _tree(spare)
    ck.save(_large(4))
    ck.wait()
    new = _tree(root / "step-4")
    assert new["step-4"] == old[spare.name]  # the spare folder itself, renamed, and its files overwritten in place
    assert {n: new[n] for n in old if n != spare.name} == {n: i for n, i in old.items() if n != spare.name}
    killed: list[int] = []

    def kill_writer_mid_commit(step):
        if not killed:
            killed.append(ck._writer._proc.pid)
            os.kill(killed[0], signal.SIGKILL)

    ck.at_save = kill_writer_mid_commit
    ck.save(_large(5))
    ck.wait()
    assert killed and ck._writer._proc.pid != killed[0]
    ck.at_save = None
    ck.save(_large(6))
    ck.close()
    assert staged == [1, 2, 3, 4, 5, 5, 6]  # the commit the killed writer was making, made again
    assert sorted(p.name for p in root.iterdir()) == ["step-5", "step-6"]
    for step in (5, 6):
        loaded = ck.read(step)
        assert torch.equal(loaded.model["w"], _large(step).model["w"]) and loaded.state["step"] == step


def test_rng_words_are_compact_and_checkpoints_with_word_lists_still_load():
    """state.json carries the Mersenne Twister words as base64 (a third of the JSON of a list);
    the lists that checkpoints written before 2026-12-02 carry restore the same sequence."""
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    state = rng_state()
    assert isinstance(state["python"][1], str) and isinstance(state["numpy"][1], str)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(11), np.random.seed(12)  # what rng_state() wrote before, for the same state
    old_style = json.loads(json.dumps(state))
    old_style["python"][1] = list(random.getstate()[1])
    old_style["numpy"][1] = np.random.get_state()[1].tolist()
    words = lambda s: len(json.dumps([s["python"], s["numpy"]]))  # noqa: E731
    assert words(state) < words(old_style) / 2
    for saved in (state, old_style):
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        set_rng_state(json.loads(json.dumps(saved)))
        assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_a_writer_that_dies_holding_a_job_the_loop_handed_it_is_replaced_and_the_job_sent_again(tmp_path):
    """The loop hands a job over (it sits in the pipe: the writer is stopped), then the writer is
    SIGKILLed before reading it. The background thread's commit must not wait on a new writer
    for the answer to a job it never got: it sees the old one's end, starts another and sends."""
    import signal
    import threading

    from trainer.checkpoint_commit import WriterProcess

    writer = WriterProcess()
    writer.start()
    root = tmp_path / "checkpoints"
    files = {"model.safetensors": [b"m" * 1000], "optimizer.safetensors": [b"o"], "state.json": [b'{"step": 1}']}
    pid = writer._proc.pid
    os.kill(pid, signal.SIGSTOP)
    assert writer.send_nowait(root, 1, files, keep_last=2)
    os.kill(pid, signal.SIGKILL)
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(writer.commit(root, 1, files, keep_last=2, sent=True)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert done == [1012], "the commit waited on a writer that never got the job"
    assert writer._proc.pid != pid
    writer.close()
    assert Checkpointer.verify(root / "step-1")["step"] == 1


# --- issue 28.2: storage stays inside its root ------------------------------------------------------


def _outside(tmp_path):
    """A folder outside the run dir with files a hostile link points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    (outside / "model.safetensors").write_bytes(b"not yours")
    return outside


def _snapshot_of(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("cleanup", [True, False])
def test_a_spare_linked_outside_the_run_dir_is_never_followed(tmp_path, cleanup):
    """The reproduction of issue 28: `checkpoints/.spare-evil -> /some/dir` and a 4-step run that
    saves every 2 steps deleted every entry of /some/dir and wrote a checkpoint into it."""
    outside = _outside(tmp_path)
    before = _snapshot_of(outside)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".spare-evil").symlink_to(outside, target_is_directory=True)
    ck = _ckpt(tmp_path, keep_last=1, async_save=False)
    if cleanup:
        ck.cleanup_stale()
    for step in (2, 4):
        ck.save(_state(step)[2])
    ck.close()
    assert _snapshot_of(outside) == before  # nothing deleted, nothing written there
    assert [s for s, _ in ck.committed()] == [4]
    assert not (root / "step-4").is_symlink()
    ck.verify(root / "step-4")


def test_a_checkpoint_folder_linked_outside_is_ignored_never_pruned_through(tmp_path):
    """A `step-N` link is not a committed checkpoint of this run dir: never read, never pruned
    into (pruning deletes what it points at)."""
    other = _ckpt(tmp_path / "elsewhere", async_save=False)
    other.save(_state(900)[2])
    target = tmp_path / "elsewhere" / "checkpoints" / "step-900"
    before = _snapshot_of(target)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step-500").symlink_to(target, target_is_directory=True)
    ck = _ckpt(tmp_path, keep_last=1, async_save=False)
    assert ck.committed() == [] and ck.select() is None
    for step in (1, 2, 3):
        ck.save(_state(step)[2])
    ck.close()
    assert _snapshot_of(target) == before
    assert [s for s, _ in ck.committed()] == [3]


@pytest.mark.parametrize("name", ["step-0999999999", "step-\uff19\uff19\uff19", "step-007", "step-1\n", "step-+5", "step- 5"])
def test_a_step_name_that_is_not_canonical_is_not_a_checkpoint(tmp_path, name):
    """Every action addresses a checkpoint as `step-{step}`: a twin name (a leading zero, non-ASCII
    digits that int() reads) counted as one would hold a keep_last slot for ever, so every real
    checkpoint got pruned. It is not a checkpoint: never counted, never pruned, never moved aside."""
    root = tmp_path / "checkpoints"
    (root / name).mkdir(parents=True)
    logs: list[str] = []
    ck = _ckpt(tmp_path, logs, keep_last=1, async_save=False)
    assert ck.committed() == [] and ck.select() is None
    for step in (10, 20, 30):
        ck.save(_state(step)[2])
    ck.close()
    assert [s for s, _ in ck.committed()] == [30]
    assert ck.select()[0] == 30 and logs == []
    assert sorted(p.name for p in root.iterdir()) == sorted([name, "step-30"])


def test_step_0_is_a_checkpoint_name(tmp_path):
    commit_local(tmp_path, 0, {"state.json": b"{}"})
    assert committed_steps(tmp_path) == [0]


def test_a_file_linked_outside_inside_a_spare_is_not_written_through(tmp_path):
    outside = _outside(tmp_path)
    before = _snapshot_of(outside)
    root = tmp_path / "checkpoints"
    spare = root / ".spare-step-1-0000beef"
    spare.mkdir(parents=True)
    (spare / "model.safetensors").symlink_to(outside / "model.safetensors")
    (spare / "manifest.json").symlink_to(outside / "keep.txt")
    files = {"model.safetensors": b"m" * 1000, "optimizer.safetensors": b"o", "state.json": b'{"step": 2}'}
    commit_local(root, 2, files)
    assert _snapshot_of(outside) == before
    folder = root / "step-2"
    assert not any(p.is_symlink() for p in folder.iterdir())
    assert Checkpointer.verify(folder)["step"] == 2


def test_a_file_hard_linked_outside_inside_a_spare_is_not_written_through(tmp_path):
    """A hard link is a regular file too: a recycled spare drops it (unlinks its own name) rather
    than overwrite the inode it shares with a file outside the run dir."""
    outside = _outside(tmp_path)
    before = _snapshot_of(outside)
    root = tmp_path / "checkpoints"
    spare = root / ".spare-step-1-0000beef"
    spare.mkdir(parents=True)
    os.link(outside / "model.safetensors", spare / "model.safetensors")
    os.link(outside / "keep.txt", spare / "manifest.json")
    files = {"model.safetensors": b"m" * 1000, "optimizer.safetensors": b"o", "state.json": b'{"step": 2}'}
    commit_local(root, 2, files)
    assert _snapshot_of(outside) == before
    folder = root / "step-2"
    assert all(p.stat().st_nlink == 1 for p in folder.iterdir())
    assert Checkpointer.verify(folder)["step"] == 2


@pytest.mark.parametrize("async_save", [True, False])
def test_a_hard_link_backup_of_a_checkpoint_survives_its_recycling(tmp_path, async_save):
    """A backup made with hard links (`cp -al`, `rsync --link-dest`) shares the checkpoint's inodes:
    pruned into the spare and recycled, that checkpoint must leave the backup's bytes as they were."""
    root = tmp_path / "checkpoints"
    ck = _ckpt(tmp_path, keep_last=1, async_save=async_save)
    ck.save(_state(1)[2])
    ck.wait()
    backup = tmp_path / "backup-step-1"
    backup.mkdir()
    for p in (root / "step-1").iterdir():
        os.link(p, backup / p.name)
    before = _snapshot_of(backup)
    for step in (2, 3):
        ck.save(_state(step)[2])
    ck.close()
    assert _snapshot_of(backup) == before
    assert Checkpointer.verify(backup)["step"] == 1
    ck.verify(root / "step-3")


def _hostile_entry(ck_dir, name, data):
    """Point the manifest of `ck_dir` at `name`, with the right size and sha256 of `data`."""
    _rewrite_manifest(ck_dir, lambda m: m["files"].__setitem__(name, {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


@pytest.mark.parametrize("name", ["../../outside/keep.txt", "{outside}/keep.txt", "/dev/null", "sub/../state.json",
                                  "./state.json", "state.json\x00x", "", "/dev/zero"])
def test_a_manifest_naming_a_path_outside_its_folder_is_corrupt_before_anything_is_opened(tmp_path, monkeypatch, name):
    """Issue 28: `../../../secret.txt` or an absolute path with the right sha256 passed verify;
    `/dev/zero` ended the rank in MemoryError (the user's exit code), so the checkpoint was neither
    moved aside nor the previous one used."""
    outside = _outside(tmp_path)
    name = name.format(outside=outside)
    logs: list[str] = []
    ck = _three(tmp_path, logs)
    data = b"" if name.startswith("/dev/") else b"precious"
    _hostile_entry(tmp_path / "checkpoints" / "step-300", name, data)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1])
    with pytest.raises(CorruptCheckpoint, match="is not a plain file name of the checkpoint folder"):
        ck.verify(tmp_path / "checkpoints" / "step-300")
    assert not [p for p in opened if "outside" in p or p.startswith("/dev/")]
    assert ck.select()[0] == 200
    assert "checkpoint step-300 is corrupt" in logs[0] and "resuming from step-200" in logs[0]
    assert any(p.name.startswith("corrupt-step-300") for p in (tmp_path / "checkpoints").iterdir())


def test_the_size_message_does_not_say_whether_a_file_outside_exists(tmp_path):
    _outside(tmp_path)
    ck = _three(tmp_path, [])
    messages = []
    manifest = tmp_path / "checkpoints" / "step-300" / "manifest.json"
    original = manifest.read_bytes()
    for name in ("../../outside/keep.txt", "../../outside/nothing.txt"):
        manifest.write_bytes(original)  # one hostile entry at a time
        _hostile_entry(tmp_path / "checkpoints" / "step-300", name, b"x" * 7)
        with pytest.raises(CorruptCheckpoint) as info:
            ck.verify(tmp_path / "checkpoints" / "step-300")
        messages.append(str(info.value).replace(name, "NAME"))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_listed_file_that_is_a_link_or_not_a_regular_file_is_corrupt_and_not_followed(tmp_path, kind):
    outside = _outside(tmp_path)
    logs: list[str] = []
    ck = _three(tmp_path, logs)
    folder = tmp_path / "checkpoints" / "step-300"
    data = (folder / "state.json").read_bytes()
    (folder / "state.json").unlink()
    if kind == "link":
        (outside / "copy.json").write_bytes(data)
        (folder / "state.json").symlink_to(outside / "copy.json")
    else:
        os.mkfifo(folder / "state.json")  # reading it would block the rank for ever
    with pytest.raises(CorruptCheckpoint, match="state.json: not a regular file"):
        ck.verify(folder)
    assert ck.select()[0] == 200


@pytest.mark.parametrize("name, garbage", [("model.safetensors", b"\xff" * 64), ("state.json", b"[1, 2"),
                                           ("optimizer.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}")])
def test_a_checkpoint_whose_hashes_match_but_whose_content_is_hostile_is_moved_aside(tmp_path, name, garbage):
    """Bytes the manifest vouches for are still data: malformed tensors or JSON make the checkpoint
    corrupt (set aside, the previous one used), never an exception that ends the rank as a user error."""
    logs: list[str] = []
    ck = _three(tmp_path, logs)
    folder = tmp_path / "checkpoints" / "step-300"
    (folder / name).write_bytes(garbage)
    _hostile_entry(folder, name, garbage)
    assert ck.select()[0] == 200
    assert f"checkpoint step-300 is corrupt ({name}" in logs[0]
    ck.read(200)
