"""A checkpoint whose files match its manifest but whose content does not load (security review,
finding 2): select() used to choose it and the load to fail on every retry. It is set aside and the
previous one used, by gangflow's loop (trainer.runtime.Session) and trainer.runtime's Run alike."""

from __future__ import annotations

import hashlib
import json
import signal
import struct
from pathlib import Path

import pytest
import torch

from trainer import runtime
from trainer.checkpoint import Checkpointer, CorruptCheckpoint, Snapshot, cpu_copy, flatten_optimizer, rng_state
from trainer.config import CheckpointConfig, TrackingConfig
from trainer.distributed import Launch
from trainer.errors import CheckpointError
from trainer.preemption import Preemption

IDENTITY = {"code": "tests:content"}


def _loop_state(step: int) -> Snapshot:
    """A checkpoint as gangflow's loop writes it (trainer.loop.Trainer.checkpoint), of a tiny model."""
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 10)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tensors, js = flatten_optimizer(opt.state_dict())
    state = {"step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 1, "identity": IDENTITY,
             "scheduler": scheduler.state_dict(), "optimizer": js, "rng": [rng_state()]}
    return Snapshot(step, cpu_copy(model.state_dict()), tensors, state)


def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace `name` in checkpoint `folder` by `data`, with a manifest entry that vouches for it."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _safetensors(header: dict, body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


HEADERS = {
    "shape disagrees with offsets": {"weight": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 0]}},
    "unknown dtype": {"weight": {"dtype": "ZZZ", "shape": [0], "data_offsets": [0, 0]}},
    "a gap between tensors": {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                              "b": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]}},
    "negative dimension": {"weight": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}},
}
BODIES = {"a gap between tensors": b"xyz"}

HOSTILE = {
    "state.json is {}": ("state.json", b"{}"),
    "state.json without the loop's keys": ("state.json", json.dumps(
        {"optimizer": {"param_groups": [], "state": {}}, "identity": IDENTITY}).encode()),
    **{f"model.safetensors: {why}": ("model.safetensors", _safetensors(h, BODIES.get(why, b""))) for why, h in HEADERS.items()},
}


# --- Checkpointer.select(): the tensors' headers ------------------------------------------------


@pytest.mark.parametrize("why", list(HEADERS))
def test_select_sets_aside_a_safetensors_header_that_does_not_describe_its_tensors(tmp_path, why):
    logs: list[str] = []
    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(keep_last=5, async_save=False), log=logs.append)
    for step in (100, 200, 300):
        ck.save(_loop_state(step))
    ck.close()
    _rewrite(tmp_path / "checkpoints" / "step-300", "model.safetensors", _safetensors(HEADERS[why], BODIES.get(why, b"")))
    with pytest.raises(CorruptCheckpoint, match="model.safetensors: not a safetensors file"):
        ck.verify(tmp_path / "checkpoints" / "step-300", parse=True)
    assert ck.select()[0] == 200
    assert "checkpoint step-300 is corrupt (model.safetensors" in logs[0] and "resuming from step-200" in logs[0]
    assert ck.read(200).step == 200


# --- gangflow's loop: Session.newest_checkpoint() + read_snapshot() ------------------------------


@pytest.fixture()
def session(tmp_path, monkeypatch):
    """Make gangflow's loop's `Session`s of one CPU rank, run dir tmp_path/run."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GANGFLOW_FAULT", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    previous = signal.getsignal(signal.SIGTERM)
    made: list[runtime.Session] = []

    def make() -> runtime.Session:
        preempt = Preemption(600.0)
        preempt.install()
        made.append(runtime.Session(Launch(0, 1, 0, "single"), tmp_path / "run", preemption=preempt, fault=None,
                                    identity=IDENTITY, checkpoint=CheckpointConfig(keep_last=5, async_save=False),
                                    tracking=TrackingConfig(progress_every_s=0), params={}, total_steps=None, device="cpu"))
        return made[-1]

    yield make
    for s in made:
        s.close(status=None)
        s.preemption.disarm()
    signal.signal(signal.SIGTERM, previous)


def _checkpoints(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.parametrize("name, data", list(HOSTILE.values()), ids=list(HOSTILE))
def test_the_loop_sets_aside_a_checkpoint_that_verifies_but_does_not_load(session, tmp_path, capsys, name, data):
    """Every retry used to choose step-300 again and fail reading it (CheckpointError): now it is
    moved aside, the loop resumes from step-200 and the next attempt does too."""
    s = session()
    for step in (100, 200, 300):
        s.save_snapshot(_loop_state(step), block=True)
    s.close(status=None)
    _rewrite(tmp_path / "run" / "checkpoints" / "step-300", name, data)
    for _attempt in (1, 2):
        s = session()
        step = s.newest_checkpoint()
        loaded = s.read_snapshot(step)
        assert step == 200 and loaded.step == 200 and loaded.state["step"] == 200
        assert torch.equal(loaded.model["weight"], _loop_state(200).model["weight"])
        s.close(status=None)
    names = _checkpoints(tmp_path)
    assert "step-300" not in names and [n for n in names if n.startswith("corrupt-step-300-")]
    out = capsys.readouterr().out
    assert f"gangflow: checkpoint step-300 is corrupt ({name}" in out and "resuming from step-200" in out



def _other_tensors(why: str) -> bytes:
    """The tiny model's weights as another model's: a tensor renamed, or of another shape."""
    from safetensors.torch import save

    tensors = dict(_loop_state(300).model)
    if why == "renamed":
        tensors["other.weight"] = tensors.pop("weight")
    else:
        tensors["weight"] = torch.zeros(5, 4)
    return save(tensors)


@pytest.mark.parametrize("why, needle", [("renamed", "missing: weight; unexpected: other.weight"),
                                         ("reshaped", "other shapes: weight")])
def test_the_loop_sets_aside_a_checkpoint_of_other_tensors_under_its_identity(session, tmp_path, capsys, why, needle):
    """Same identity, tensors that are not the model's (a hostile writer of the store): the load used to
    fail inside the loop (load_state_dict's RuntimeError, judged the user's) on every retry."""
    s = session()
    for step in (100, 200, 300):
        s.save_snapshot(_loop_state(step), block=True)
    s.close(status=None)
    _rewrite(tmp_path / "run" / "checkpoints" / "step-300", "model.safetensors", _other_tensors(why))
    s = session()
    s.expect_model(torch.nn.Linear(4, 3).state_dict())
    step = s.newest_checkpoint()
    assert step == 200 and s.read_snapshot(step).step == 200
    assert "step-300" not in _checkpoints(tmp_path)
    assert f"model.safetensors: not this model's tensors ({needle})" in capsys.readouterr().out


def test_the_loop_starts_from_step_0_when_no_checkpoint_loads(session, tmp_path, capsys):
    s = session()
    s.save_snapshot(_loop_state(100), block=True)
    s.close(status=None)
    _rewrite(tmp_path / "run" / "checkpoints" / "step-100", "state.json", b"{}")
    s = session()
    assert s.newest_checkpoint() is None
    assert s.checkpoints.last_step is None  # the next save of step 100 is written, not taken as done
    assert "no older checkpoint; starting from step 0" in capsys.readouterr().out


def test_the_loop_reads_a_good_checkpoint_once_after_select(session, tmp_path, monkeypatch):
    """Rank 0 loads the checkpoint it chose while choosing it: read_snapshot does not read it again."""
    s = session()
    s.save_snapshot(_loop_state(100), block=True)
    s.close(status=None)
    s = session()
    reads = []
    real = Checkpointer.read
    monkeypatch.setattr(Checkpointer, "read", lambda self, *a, **k: (reads.append(a), real(self, *a, **k))[1])
    assert s.read_snapshot(s.newest_checkpoint()).step == 100
    assert len(reads) == 1


def test_an_unreadable_store_is_not_a_malformed_checkpoint(session, tmp_path, monkeypatch):
    """An I/O error while loading stays a failure (infrastructure): the checkpoint is not set aside."""
    s = session()
    s.save_snapshot(_loop_state(100), block=True)
    s.close(status=None)
    s = session()

    def unreachable(self, step, path=None):
        raise CorruptCheckpoint("model.safetensors: unreadable (Input/output error)")

    monkeypatch.setattr(Checkpointer, "read", unreachable)
    step = s.newest_checkpoint()
    assert step == 100
    with pytest.raises(CheckpointError, match="cannot read checkpoint step-100: model.safetensors: unreadable"):
        s.read_snapshot(step)
    assert _checkpoints(tmp_path) == ["step-100"]


def test_a_checkpoint_of_other_identity_is_refused_not_set_aside(session, tmp_path):
    from trainer.identity import ResumeMismatch

    s = session()
    snap = _loop_state(100)
    snap.state["identity"] = {"code": "another"}
    s.save_snapshot(snap, block=True)
    s.close(status=None)
    s = session()
    with pytest.raises(ResumeMismatch):
        s.read_snapshot(s.newest_checkpoint())
    assert _checkpoints(tmp_path) == ["step-100"]


# --- trainer.runtime's Run.load_checkpoint() ------------------------------------------------------


@pytest.fixture()
def env(runtime_env):
    return runtime_env


RUN_HOSTILE = {
    "state.pt is not a torch file": (runtime.STATE_FILE, b"\x80\x02not a torch zip file" * 10),
    "folder.tar is not a tar": (runtime.FOLDER_FILE, b"\x00garbage" * 100),
    "state.json is {}": (runtime.STATE_JSON, b"{}"),
}


@pytest.mark.parametrize("name, data", list(RUN_HOSTILE.values()), ids=list(RUN_HOSTILE))
def test_load_checkpoint_sets_aside_a_checkpoint_that_verifies_but_does_not_load(env, tmp_path, capsys, name, data):
    """A state.pt that is not a torch file used to end the rank in torch's UnpicklingError (judged
    `user`) on every retry: now it is moved aside and the previous checkpoint loads."""
    folder = tmp_path / "framework"
    folder.mkdir()
    run = env()
    for step in (1, 2):
        (folder / "weights.bin").write_bytes(bytes([step]) * 8)
        run.save_checkpoint(step, {"w": torch.full((4,), float(step))}, folder=folder)
    run.close()
    _rewrite(tmp_path / "run" / "checkpoints" / "step-2", name, data)
    for _attempt in (1, 2):
        loaded = env().load_checkpoint()
        assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.ones(4))
        assert (loaded.folder / "weights.bin").read_bytes() == bytes([1]) * 8
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "step-2" not in names and [n for n in names if n.startswith("corrupt-step-2-")]
    assert f"gangflow: checkpoint step-2 is corrupt ({name}" in capsys.readouterr().out


class _NotAllowed:
    """A class torch.load(weights_only=True) refuses to rebuild."""


def test_a_state_torch_cannot_read_back_is_refused_when_saved_not_set_aside_at_resume(env, tmp_path):
    """A checkpoint that does not load is set aside at resume; one the user's own state makes unloadable
    would be set aside at every resume, each retry starting from step 0. It fails the save instead."""
    run = env()
    with pytest.raises(TypeError, match=r"_NotAllowed.*torch.serialization.add_safe_globals"):
        run.save_checkpoint(1, {"w": torch.ones(2), "extra": _NotAllowed()})
    run.close()
    assert not (tmp_path / "run" / "checkpoints" / "step-1").exists()


def test_a_run_refuses_the_loops_checkpoint_format(env, tmp_path):
    """read_snapshot on a Run returned save_checkpoint()'s (Checkpoint, state.json) pair as if it were
    the loop's `Loaded`, and save_snapshot wrote a checkpoint load_checkpoint() then set aside."""
    run = env()
    run.save_checkpoint(1, {"w": torch.ones(2)})
    with pytest.raises(TypeError, match=r"read with load_checkpoint\(\)"):
        run.read_snapshot(run.newest_checkpoint())
    with pytest.raises(TypeError, match=r"written with save_checkpoint\(\)"):
        run.save_snapshot(_loop_state(2), block=True)
    with pytest.raises(TypeError, match=r"Run.expect_model"):
        run.expect_model(torch.nn.Linear(4, 3).state_dict())
    run.close()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1"]
    assert env().load_checkpoint().step == 1


def test_a_manifest_listing_a_huge_file_costs_no_memory_to_verify(tmp_path):
    """verify() read each listed file whole to hash it: a manifest listing a 1 GiB file (sparse
    here) ended select() in MemoryError under a 512 MiB address-space cap, on every retry. It now
    hashes in chunks: the checkpoint verifies (its files are what the manifest says)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(f"""
        import hashlib, json, os, resource, sys
        sys.path[:0] = [{str(Path(__file__).resolve().parents[3])!r}, {str(Path(__file__).resolve().parent)!r}]
        from test_checkpoint_content import _loop_state
        from trainer.checkpoint import Checkpointer
        from trainer.config import CheckpointConfig
        root = {str(tmp_path / 'checkpoints')!r}
        ck = Checkpointer(root, CheckpointConfig(keep_last=3, async_save=False), log=print)
        ck.save(_loop_state(10)); ck.save(_loop_state(20)); ck.close()
        folder = os.path.join(root, "step-20")
        with open(os.path.join(folder, "extra.bin"), "wb") as fh:
            fh.truncate(1 << 30)
        digest = hashlib.sha256()
        with open(os.path.join(folder, "extra.bin"), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                digest.update(chunk)
        manifest = json.load(open(os.path.join(folder, "manifest.json")))
        manifest["files"]["extra.bin"] = {{"bytes": 1 << 30, "sha256": digest.hexdigest()}}
        json.dump(manifest, open(os.path.join(folder, "manifest.json"), "w"))
        used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + (512 << 20), resource.RLIM_INFINITY))
        print("chosen", ck.select()[0])
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=str(Path(__file__).resolve().parents[3]), env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0 and "chosen 20" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_a_remote_file_replaced_after_its_size_was_read_is_not_read_past_it(s3):
    """On object storage the size was asked, then the object read whole: one replaced in between
    (64 MiB here) was held in memory before its sha256 refused it. Now at most size + 1 bytes."""
    ck = Checkpointer(s3.bucket("ck-toctou") + "/run/checkpoints", CheckpointConfig(keep_last=2, async_save=False),
                      log=print)
    ck.save(_loop_state(10))
    ck.close()
    fs, key = ck.store.fs, "ck-toctou/run/checkpoints/step-10/model.safetensors"
    size, cat_file, read = fs.size, fs.cat_file, {}

    def replaced_after_size(path, *args, **kwargs):
        n = size(path, *args, **kwargs)
        if path == key:
            fs.pipe_file(key, b"\0" * (64 << 20))
        return n

    def counted(path, *args, **kwargs):
        data = cat_file(path, *args, **kwargs)
        read[path] = len(data)
        return data

    fs.size, fs.cat_file = replaced_after_size, counted
    try:
        with pytest.raises(CorruptCheckpoint, match="model.safetensors"):
            ck.read(10)
    finally:
        fs.size, fs.cat_file = size, cat_file
    expected = json.loads(cat_file("ck-toctou/run/checkpoints/step-10/manifest.json"))["files"]["model.safetensors"]["bytes"]
    assert read[key] <= expected + 1
