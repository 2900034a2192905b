"""The data plane, end to end with real processes: datasets fetched by content address (local DVC
remote and S3), run dirs on S3 (moto server on 127.0.0.1), final weights through MLflow, and
resume refusing a checkpoint made with another config or dataset (issue 12.3).

Each run is 2 ranks under torchrun (gloo, CPU) unless it only needs to start and refuse.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from trainer_fixtures import RESUME

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("remote-runs")


@pytest.fixture(scope="module")
def dataset(digits, work, make_remote):
    """The digits data as a DVC 3 remote on local disk: (file:// URL, version, md5s)."""
    root = work / "dvc-remote"
    files = {name: (digits / name).read_bytes() for name in ("train.parquet", "test.parquet")}
    version = make_remote(root, files)
    return f"file://{root}", version, {k: hashlib.md5(v).hexdigest() for k, v in files.items()}


def versioned(remote: str, version: str, *more: str) -> tuple[str, ...]:
    # data.train_path/test_path point nowhere: the run must not read them
    return (f"data.remote={remote}", f"data.version={version}", "data.train_path=/nonexistent/train.parquet",
            "data.test_path=/nonexistent/test.parquet", *more)


def run(h, run_dir, sets, nproc=2, scratch=None, **env):
    """h.run with TMPDIR (the ranks' scratch) set; `sets` come after the helper's digits paths and
    override them (versioned() points them nowhere)."""
    if scratch is not None:
        env["TMPDIR"] = str(scratch)
        Path(scratch).mkdir(parents=True, exist_ok=True)
    return h.run(run_dir, sets=sets, nproc=nproc, timeout=600, **env)


@pytest.fixture(scope="module")
def mlflow_run(work):
    """An MLflow run in a SQLite store with a local artifact root (the embedded default)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("remote-tests", artifact_location=(work / "mlartifacts").as_uri())
    return uri, client, client.create_run(exp).info.run_id


@pytest.fixture(scope="module")
def reference(h, work, dataset, mlflow_run):
    """Uninterrupted 2-rank run on a local run dir, data by version, final weights logged to MLflow."""
    remote, version, _ = dataset
    uri, _, run_id = mlflow_run
    run_dir = work / "reference"
    out = h.check_ok(run(h, run_dir, versioned(remote, version, *h.SMALL), MLFLOW_TRACKING_URI=uri, MLFLOW_RUN_ID=run_id,
                         scratch=str(work / "scratch-ref")))
    assert "gangflow: starting from step 0" in out
    return run_dir, out


def test_dataset_by_version_is_fetched_into_rank_scratch_and_recorded(work, dataset, reference):
    remote, version, md5s = dataset
    run_dir, out = reference
    card = json.loads((run_dir / "final" / "model_card.json").read_text())
    assert card["data"]["version"] == version and card["data"]["remote"] == remote
    assert card["data"]["train_md5"] == md5s["train.parquet"] and card["data"]["test_md5"] == md5s["test.parquet"]
    # scratch private to the user and the run (issue 28.2): $TMPDIR/gangflow-<uid>/<hash of the run dir>/<version>/
    train = Path(card["data"]["train_path"])
    assert (train.name, train.parent.name) == ("train.parquet", version)
    assert train.parents[2] == work / "scratch-ref" / f"gangflow-{os.getuid()}" and re.fullmatch(r"[0-9a-f]{16}", train.parents[1].name)
    assert card["metrics"]["test_accuracy"] > 0.7
    state = json.loads((run_dir / "checkpoints" / "step-60" / "state.json").read_text())
    assert state["identity"]["data.version"] == version and state["identity"]["data.train_md5"] == md5s["train.parquet"]


def test_final_weights_are_mlflow_artifacts_of_the_run(work, reference, mlflow_run):
    run_dir, out = reference
    _, client, run_id = mlflow_run
    assert f"final weights logged to MLflow as runs:/{run_id}/final" in out
    names = sorted(a.path for a in client.list_artifacts(run_id, "final"))
    assert names == ["final/model.safetensors", "final/model_card.json"]
    got = Path(client.download_artifacts(run_id, "final", str(work / "dl")))
    assert (got / "model.safetensors").read_bytes() == (run_dir / "final" / "model.safetensors").read_bytes()


def test_md5_mismatch_is_refused_before_the_first_step(h, work, dataset):
    remote, version, md5s = dataset
    bad_root = work / "dvc-remote-tampered"
    shutil.copytree(remote.removeprefix("file://"), bad_root)
    obj = bad_root / "files" / "md5" / md5s["train.parquet"][:2] / md5s["train.parquet"][2:]
    data = bytearray(obj.read_bytes())
    data[100] ^= 0xFF
    obj.write_bytes(bytes(data))
    actual = hashlib.md5(bytes(data)).hexdigest()
    run_dir = work / "tampered"
    out = run(h, run_dir, versioned(f"file://{bad_root}", version, *h.SMALL), nproc=None, scratch=str(work / "scratch-bad"))
    assert out.returncode == 1, out.stdout[-3000:]
    assert (f"dataset version {version} file train.parquet: md5 mismatch: expected {md5s['train.parquet']}, "
            f"actual {actual}") in out.stdout
    assert "starting from step 0" not in out.stdout and not (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / "errors" / "rank-0.json").read_text())["source"] == "user"


def test_resume_refuses_a_checkpoint_of_another_dataset(h, work, dataset, reference, make_remote, digits):
    """Issue 12.3: a finished checkpoint under a new dataset must not publish old weights."""
    remote, version, md5s = dataset
    ref_dir, _ = reference
    other_root = work / "dvc-remote-v2"
    train = (digits / "train.parquet").read_bytes()
    other = make_remote(other_root, {"train.parquet": (digits / "test.parquet").read_bytes(), "test.parquet": train})
    run_dir = work / "new-dataset"
    shutil.copytree(ref_dir / "checkpoints", run_dir / "checkpoints")
    out = run(h, run_dir, versioned(f"file://{other_root}", other, *h.SMALL), nproc=None, scratch=str(work / "scratch-v2"))
    assert out.returncode != 0, out.stdout[-3000:]
    assert re.search(rf"checkpoint step-60 \(.+\) was made with data\.test_md5='{md5s['test.parquet']}', "
                     rf"data\.train_md5='{md5s['train.parquet']}', data\.version='{version}'; this run has "
                     rf"data\.test_md5='[0-9a-f]{{32}}', data\.train_md5='[0-9a-f]{{32}}', data\.version='{other}'", out.stdout), out.stdout[-3000:]
    assert not (run_dir / "final").exists()
    record = json.loads((run_dir / "errors" / "rank-0.json").read_text())
    assert record["exc_type"] == "ResumeMismatch" and record["source"] == "config"
    # ... and a changed training config is refused the same way.
    out = run(h, run_dir, versioned(remote, version, *h.SMALL, "train.lr=0.1"), nproc=None, scratch=str(work / "scratch-ref"))
    assert out.returncode != 0 and "was made with train.lr=0.05; this run has train.lr=0.1" in out.stdout, out.stdout[-3000:]
    assert not (run_dir / "final").exists()


# --- S3: run dir and dataset on an S3-API server, weights through `mlflow server --serve-artifacts` ---


@pytest.fixture(scope="module")
def mlflow_server(work):
    """The drill's `mlflow server` (SQLite, `--serve-artifacts`, no job runner): (url, artifacts folder)."""
    from operators.cli.drill.servers import MlflowServer

    server = MlflowServer(work / "mlflow-server").start(timeout=300)  # slow to start on a loaded 2-core machine
    try:
        yield server.url, server.artifacts
    finally:
        server.stop()


def test_kill_and_resume_on_s3_is_bitwise_equal(h, work, dataset, reference, s3, mlflow_server):
    import fsspec
    from mlflow.tracking import MlflowClient

    remote, version, _ = dataset
    bucket = s3.bucket("gangflow-e2e")
    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # not an instance cached by an earlier test of this process
    fs.put(remote.removeprefix("file://") + "/", f"{bucket.removeprefix('s3://')}/dvc/", recursive=True)
    url, artifacts = mlflow_server
    client = MlflowClient(url)
    run_id = client.create_run(client.create_experiment("s3-drill")).info.run_id
    run_dir = f"{bucket}/runs/gang-1"
    env = dict(s3.env, MLFLOW_TRACKING_URI=url, MLFLOW_RUN_ID=run_id)
    sets = versioned(f"{bucket}/dvc", version, *h.SMALL)
    first = run(h, run_dir, sets, GANGFLOW_FAULT="kill@step=30", scratch=str(work / "scratch-s3-1"), **env)
    assert first.returncode != 0 and -9 in h.torchrun_exitcodes(first.stdout), first.stdout[-3000:]
    key = run_dir.removeprefix("s3://")
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{key}/checkpoints")) == ["step-20"]
    assert fs.exists(f"{key}/checkpoints/step-20/manifest.json")
    assert fs.exists(f"{key}/faults/kill@step=30.fired")
    assert not fs.exists(f"{key}/final/model_card.json")
    second = run(h, run_dir, sets, GANGFLOW_FAULT="kill@step=30", scratch=str(work / "scratch-s3-2"), **env)
    assert second.returncode == 0, second.stdout[-4000:]
    assert RESUME.search(second.stdout).group(1) == "20"
    assert RESUME.search(second.stdout).group(2) == f"{run_dir}/checkpoints/step-20"
    ref_dir, _ = reference
    assert fs.cat_file(f"{key}/final/model.safetensors") == (ref_dir / "final" / "model.safetensors").read_bytes()
    lines = [json.loads(x) for x in fs.cat_file(f"{key}/metrics.jsonl").decode().splitlines()]
    assert [m["step"] for m in lines if m.get("event") == "resume"] == [20]
    assert [m["step"] for m in lines if m.get("event") == "final"] == [60]
    # The weights went through the server's artifact proxy (nothing written by the trainer on its disk).
    got = Path(client.download_artifacts(run_id, "final", str(work / "dl-http")))
    assert (got / "model.safetensors").read_bytes() == (ref_dir / "final" / "model.safetensors").read_bytes()
    assert list(artifacts.rglob("model_card.json"))


def test_error_records_land_on_s3(h, work, s3):
    """A failing rank's record goes to errors/rank-R.json under an s3:// run dir too."""
    import fsspec

    bucket = s3.bucket("gangflow-errors")
    run_dir = f"{bucket}/runs/raised"
    out = run(h, run_dir, h.SMALL, nproc=None, GANGFLOW_FAULT="raise@step=3", **s3.env)
    assert out.returncode == 1, out.stdout[-3000:]
    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # not an instance cached by an earlier test of this process
    fs.invalidate_cache()
    record = json.loads(fs.cat_file(f"{run_dir.removeprefix('s3://')}/errors/rank-0.json"))
    assert record["exc_type"] == "ValueError" and record["source"] == "user" and record["step"] == 3
    events = [json.loads(x) for x in fs.cat_file(f"{run_dir.removeprefix('s3://')}/metrics.jsonl").decode().splitlines()]
    assert events[0]["event"] == "tracking" and events[1]["event"] == "start"  # params/tags line, then the start
