"""Error records, data helpers, final-weights export, tracking (in-process)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from trainer import errors
from trainer.data import ResumableDistributedSampler, check_md5, load_arrays, parquet_dataset
from trainer.datastore import file_md5
from trainer.errors import DataError, user_code
from trainer.export import load_card, load_final_model, write_final
from trainer.models import mlp
from trainer.tracking import Tracker


def _raise_in_user_code():
    with user_code():
        raise ValueError("bad batch " + "x" * 10_000)


def test_error_record_fields_and_source(tmp_path, monkeypatch):
    log = tmp_path / "k8s" / "termination-log"
    log.parent.mkdir()
    monkeypatch.setenv(errors.TERMINATION_LOG_ENV, str(log))
    try:
        _raise_in_user_code()
    except ValueError as exc:
        record = errors.write_records(exc, rank=3, step=17, run_dir=tmp_path / "run")
    assert record["source"] == "user" and record["rank"] == 3 and record["step"] == 17
    saved = json.loads((tmp_path / "run" / "errors" / "rank-3.json").read_text())
    assert saved["exc_type"] == "ValueError" and "Traceback" in saved["traceback"]
    message = log.read_text()
    assert len(message.encode()) < 4096
    assert json.loads(message)["source"] == "user"
    # The first failure stays: a later rank does not overwrite the termination message.
    errors.write_records(RuntimeError("later"), rank=0, step=18, run_dir=None)
    assert json.loads(log.read_text())["rank"] == 3


def test_termination_log_needs_an_existing_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(errors.TERMINATION_LOG_ENV, str(tmp_path / "missing" / "termination-log"))
    errors.write_records(RuntimeError("x"), rank=0, step=None, run_dir=None)
    assert not (tmp_path / "missing").exists()


def test_sources():
    assert errors.source_of(errors.ConfigError("x")) == "config"
    assert errors.source_of(DataError("x")) == "user"
    assert errors.source_of(RuntimeError("x")) is None
    with pytest.raises(ConnectionResetError) as info:
        with user_code():
            raise ConnectionResetError("Connection reset by peer")
    assert errors.source_of(info.value) is None  # infrastructure, even inside the step


def test_load_arrays_reads_parquet_without_suffix(tmp_path, digits):
    blob = tmp_path / "cache" / "ab" / "cdef0123"  # like a DVC cache object
    blob.parent.mkdir(parents=True)
    shutil.copy(digits / "train.parquet", blob)
    x, y = load_arrays(blob)
    assert x.dtype == np.float32 and x.shape == (1347, 64) and y.dtype == np.int64 and y.shape == (1347,)
    assert 0 <= x.min() and x.max() <= 16
    ds = parquet_dataset(str(blob))
    features, label = ds[0]
    assert features.shape == (64,) and label.dtype == torch.int64
    assert check_md5(blob, file_md5(digits / "train.parquet")) == file_md5(blob)
    with pytest.raises(DataError, match="md5 mismatch"):
        check_md5(blob, "0" * 32)
    with pytest.raises(DataError, match="does not exist"):
        load_arrays(tmp_path / "nope")
    (tmp_path / "text").write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_arrays(tmp_path / "text")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_global_sample_order_is_independent_of_world_size(world_size):
    dataset = list(range(103))
    batch = 8  # global
    reference = list(ResumableDistributedSampler(dataset, num_replicas=1, rank=0, seed=5))[: (103 // batch) * batch]
    local = batch // world_size
    per_rank = [list(ResumableDistributedSampler(dataset, num_replicas=world_size, rank=r, seed=5)) for r in range(world_size)]
    steps = len(per_rank[0]) // local
    assert steps == 103 // batch
    order = [per_rank[r][k * local + j] for k in range(steps) for j in range(local) for r in range(world_size)]
    # Step k's global batch is the same set of samples, whatever the world size.
    for k in range(steps):
        assert sorted(order[k * batch:(k + 1) * batch]) == sorted(reference[k * batch:(k + 1) * batch])
    # Resuming part-way through an epoch skips exactly the consumed samples.
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=0, seed=5)
    sampler.set_start(3 * local)
    assert list(sampler) == per_rank[0][3 * local:]


def test_final_export_round_trip(tmp_path):
    torch.manual_seed(0)
    model = mlp(hidden=16, input_dim=64)
    card = {"model": {"factory": "trainer.models:mlp", "kwargs": {"hidden": 16, "num_classes": 10, "input_dim": 64}}}
    write_final(tmp_path, model, card)
    write_final(tmp_path, model, card)  # replacing an existing final/ works
    loaded = load_final_model(tmp_path / "final")
    assert not loaded.training
    x = torch.rand(5, 64) * 16
    assert torch.equal(loaded(x), model.eval()(x))
    assert load_card(tmp_path / "final")["weights"]["file"] == "model.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_metrics_jsonl(tmp_path):
    tracker = Tracker(tmp_path, enabled=True)
    tracker.step(10, loss=1.5, lr=0.1, samples_per_sec=100.0)
    tracker.event("checkpoint", 10, duration_s=0.1, bytes=5)
    tracker.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 10 and lines[0]["loss"] == 1.5
    assert lines[1]["event"] == "checkpoint" and lines[1]["bytes"] == 5
    Tracker(tmp_path / "nope", enabled=False).step(1, loss=1.0)  # other ranks: no-op


def test_mlflow_logs_into_given_run_in_background(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("op")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    tracker = Tracker(tmp_path, enabled=True, mlflow_uri=uri, flush_every_s=0.2, params={"train": {"lr": 0.1}})
    for step in range(1, 6):
        tracker.step(step, loss=1.0 / step)
    tracker.event("checkpoint", 5, mlflow_prefix="checkpoint_", duration_s=0.25, bytes=1234, path="p")
    tracker.close(status="FINISHED")
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "0.1"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4, 5]
    assert run.data.metrics["checkpoint_bytes"] == 1234
    assert run.info.status == "RUNNING"  # the operator owns the run it created



def test_the_run_dir_tag_and_tags_written_for_the_relay_are_redacted(tmp_path, monkeypatch):
    """The tag `gangflow.run_dir` was the run dir's URL as given (fsspec's memory:// keeps user info
    as part of a path: the URL reached MLflow whole)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    run_dir = "simplecache::memory://user:hunter2@host/run"
    tracker = Tracker(run_dir, enabled=True, mlflow_uri=uri, experiment="e", tags={"gangflow.run_dir": run_dir})
    run_id = tracker.mlflow_run_id
    tracker.close(status="FINISHED")
    assert "hunter2" not in repr(MlflowClient(uri).get_run(run_id).data.tags)
    from trainer.storage import Storage

    assert b"hunter2" not in Storage(run_dir).read_bytes("metrics.jsonl")


def test_an_earlier_metrics_file_on_object_storage_with_bad_bytes_or_huge_fails_no_try(s3, monkeypatch, capsys):
    """It was read whole and decoded strictly: one planted byte ended every try in UnicodeDecodeError,
    and a multi-GB file was loaded (and rewritten at every event)."""
    import fsspec

    from trainer import tracking

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    run_dir = s3.bucket("metrics-bad") + "/runs/a"
    fs.pipe_file("metrics-bad/runs/a/metrics.jsonl", b'{"step": 1, "loss": 1.0}\n\xff\xfe\n')
    tracker = Tracker(run_dir, enabled=True)
    tracker.event("start", 0)
    tracker.close()
    lines = fs.cat_file("metrics-bad/runs/a/metrics.jsonl").decode().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "loss": 1.0} and json.loads(lines[-1])["event"] == "start"

    monkeypatch.setattr(tracking, "REMOTE_METRICS_LIMIT", 100)
    fs.pipe_file("metrics-bad/runs/b/metrics.jsonl", b"".join(b'{"step": %d, "loss": 0.5}\n' % i for i in range(50)))
    tracker = Tracker(s3.bucket("metrics-bad") + "/runs/b", enabled=True)
    tracker.close()
    kept = fs.cat_file("metrics-bad/runs/b/metrics.jsonl").decode().splitlines()
    assert 0 < len(kept) < 50 and json.loads(kept[-1])["step"] == 49 and all(json.loads(line) for line in kept)
    assert "holds 1290 bytes; keeping its last" in capsys.readouterr().err

def test_lr_schedule_and_its_state():
    from trainer.config import load_config
    from trainer.loop import WarmupCosine

    cfg = load_config(None, ["train.max_steps=100", "train.warmup_steps=10", "train.lr=1.0"])
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=cfg.train.lr)
    sched = WarmupCosine(opt, cfg)
    lrs = [sched.get_last_lr()[0]]
    for _ in range(100):
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[0] == pytest.approx(0.1) and max(lrs) <= 1.0 and lrs[-1] == pytest.approx(0.0, abs=1e-12)
    assert lrs[9] > lrs[0] and lrs[50] < lrs[10]
    other = WarmupCosine(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0), cfg)
    state = json.loads(json.dumps(sched.state_dict()))
    other.load_state_dict({**state, "last_step": 37})
    assert other.get_last_lr()[0] == lrs[37]


def test_resolve_data_hashes_files_and_lets_custom_factories_read_folders(tmp_path):
    from trainer.config import load_config
    from trainer.data import resolve_data
    from trainer.errors import DataError

    train = tmp_path / "train.bin"
    train.write_bytes(b"rows")
    data = resolve_data(load_config(None, [f"data.train_path={train}", f"data.test_path={tmp_path / 'none'}"]).data)
    assert data.train_md5 == file_md5(train) and data.test_md5 is None
    assert data.identity() == {"version": "", "train_md5": file_md5(train), "test_md5": None}
    folder = resolve_data(load_config(None, [f"data.train_path={tmp_path}"]).data)  # e.g. a sharded dataset folder
    assert folder.train_md5 is None and folder.identity()["train_path"] == str(tmp_path)
    with pytest.raises(DataError, match="data.train_md5 mismatch"):
        resolve_data(load_config(None, [f"data.train_path={train}", "data.train_md5=" + "0" * 32]).data)
