"""Real multi-process runs: torchrun with 2 ranks (gloo, CPU), kills, SIGTERM, resumes.

Runs are small (60 steps, a checkpoint every 20) and shared between tests via module fixtures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_fixtures import RESUME

from operators.utils.ports import free_port

from trainer import EXIT_CONFIG_ERROR, EXIT_PREEMPTED
from trainer.checkpoint import Checkpointer

pytestmark = pytest.mark.slow


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_bitwise_equal(run_dir: Path, reference: Path) -> None:
    assert (run_dir / "final" / "model.safetensors").read_bytes() == (reference / "final" / "model.safetensors").read_bytes()
    a, b = weights(run_dir), weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def accuracy(run_dir: Path) -> float:
    return json.loads((run_dir / "final" / "model_card.json").read_text())["metrics"]["test_accuracy"]


def copy_run(src: Path, dst: Path, keep: set[int]) -> Path:
    """A copy of a finished run dir holding only the checkpoints in `keep` (no final/)."""
    shutil.copytree(src / "checkpoints", dst / "checkpoints")
    for path in (dst / "checkpoints").iterdir():
        if int(path.name.split("-")[1]) not in keep:
            shutil.rmtree(path)
    return dst


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer-runs")


@pytest.fixture(scope="module")
def reference(h, work) -> Path:
    """An uninterrupted 2-rank run: the yardstick for every resume test."""
    run_dir = work / "reference"
    out = h.check_ok(h.run(run_dir))
    assert "gangflow: starting from step 0" in out
    return run_dir


def test_reference_run_layout(h, reference):
    card = json.loads((reference / "final" / "model_card.json").read_text())
    assert card["model"] == {"factory": "trainer.models:mlp", "kwargs": {"hidden": 128, "num_classes": 10, "input_dim": 64}}
    assert card["world_size"] == 2 and card["steps"] == 60 and card["data"]["train_md5"]
    assert card["classes"] == 10  # the served signature's prob_<k> columns, counted where torch is loaded
    assert card["metrics"]["test_accuracy"] > 0.7
    steps = [m["step"] for m in h.metrics(reference) if "loss" in m]
    assert steps == [10, 20, 30, 40, 50, 60]
    events = [m for m in h.metrics(reference) if m.get("event") == "checkpoint"]
    assert [e["step"] for e in events] == [20, 40, 60] and all(e["bytes"] > 0 and "duration_s" in e for e in events)
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step-40", "step-60"]  # keep_last 2
    from trainer.export import load_final_model

    model = load_final_model(reference / "final")
    assert not model.training


def test_kill_and_resume_is_bitwise_equal(h, work, reference):
    run_dir = work / "killed"
    first = h.run(run_dir, GANGFLOW_FAULT="kill@step=30")
    assert first.returncode != 0
    assert -9 in h.torchrun_exitcodes(first.stdout), first.stdout[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-20"]
    assert (run_dir / "faults" / "kill@step=30.fired").is_file()
    for rank in (0, 1):  # every rank says at start that a fault is armed
        assert f"fault injection ARMED on rank {rank}: GANGFLOW_FAULT='kill@step=30'" in first.stdout
    second = h.check_ok(h.run(run_dir, GANGFLOW_FAULT="kill@step=30"))  # fires at most once per run dir
    assert "kill@step=30 already fired in an earlier attempt" in second
    assert RESUME.search(second).group(1) == "20"
    assert "starting from step 0" not in second
    records = h.metrics(run_dir)
    resume_at = next(i for i, m in enumerate(records) if m.get("event") == "resume")
    assert records[resume_at]["step"] == 20
    assert [m["step"] for m in records[resume_at:] if "loss" in m] == [30, 40, 50, 60]
    assert_bitwise_equal(run_dir, reference)


def test_sigterm_fault_commits_checkpoint_and_exits_75(h, work, reference):
    run_dir = work / "preempted"
    first = h.run(run_dir, GANGFLOW_FAULT="term@step=25,rank=1")
    assert first.returncode != 0
    assert h.torchrun_exitcodes(first.stdout).count(EXIT_PREEMPTED) == 2, first.stdout[-3000:]  # both ranks
    match = re.search(r"gangflow: preempted \(SIGTERM\): stopped at step (\d+); checkpoint step-\1 committed", first.stdout)
    assert match, first.stdout[-3000:]
    step = int(match.group(1))
    assert step in (25, 26)  # the stop flag is agreed within one step
    Checkpointer.verify(run_dir / "checkpoints" / f"step-{step}")
    second = h.check_ok(h.run(run_dir, GANGFLOW_FAULT="term@step=25,rank=1"))
    assert RESUME.search(second).group(1) == str(step)
    assert_bitwise_equal(run_dir, reference)  # preemption loses nothing


def test_sigterm_to_torchrun_is_forwarded_to_the_workers(h, work):
    run_dir = work / "agent-sigterm"
    sets = ("train.max_steps=1000000", "checkpoint.every_steps=100000", "train.log_every_steps=10")
    proc = subprocess.Popen(h.command(run_dir, sets), cwd=h.ROOT, env=h.trainer_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").is_file() and any("loss" in m for m in h.metrics(run_dir)):
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Received 15 death signal, shutting down workers" in out
    match = re.search(r"gangflow: preempted \(SIGTERM\): stopped at step (\d+); checkpoint step-\1 committed.*exiting with 75", out)
    assert match, out[-3000:]
    Checkpointer.verify(run_dir / "checkpoints" / f"step-{match.group(1)}")
    assert [m for m in h.metrics(run_dir) if m.get("event") == "preempted"]


def test_truncated_newest_checkpoint_is_skipped(h, work, reference):
    run_dir = copy_run(reference, work / "truncated", keep={40, 60})
    newest = run_dir / "checkpoints" / "step-60" / "model.safetensors"
    os.truncate(newest, newest.stat().st_size // 2)
    out = h.check_ok(h.run(run_dir))
    assert re.search(r"gangflow: checkpoint step-60 is corrupt \(.+\); resuming from step-40", out), out[-3000:]
    assert RESUME.search(out).group(1) == "40"
    assert_bitwise_equal(run_dir, reference)


def test_resume_on_fewer_ranks(h, work, reference):
    run_dir = copy_run(reference, work / "two-to-one", keep={40})
    out = h.check_ok(h.run(run_dir, nproc=1))
    assert RESUME.search(out).group(1) == "40"
    assert "written by 2 ranks; continuing on 1" in out
    assert accuracy(run_dir) >= 0.8
    # Same global batches in the same order: equal up to floating-point summation order.
    a, b = weights(run_dir), weights(reference)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_resume_on_more_ranks(h, work, reference):
    run_dir = work / "one-to-two"
    first = h.run(run_dir, nproc=1, GANGFLOW_FAULT="exit=3@step=30")
    assert first.returncode != 0 and 3 in h.torchrun_exitcodes(first.stdout), first.stdout[-3000:]
    out = h.check_ok(h.run(run_dir, nproc=2, GANGFLOW_FAULT="exit=3@step=30"))
    assert RESUME.search(out).group(1) == "20"
    assert "written by 1 ranks; continuing on 2" in out
    assert accuracy(run_dir) >= 0.8
    a, b = weights(run_dir), weights(reference)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_raise_leaves_structured_error_records(h, work):
    run_dir = work / "raised"
    elastic = work / "torchrun-error.json"
    termination = work / "k8s"
    termination.mkdir()
    out = h.run(run_dir, GANGFLOW_FAULT="raise@step=5", TORCHELASTIC_ERROR_FILE=str(elastic),
                GANGFLOW_TERMINATION_LOG=str(termination / "termination-log"))
    assert out.returncode != 0
    assert h.torchrun_exitcodes(out.stdout).count(1) == 2, out.stdout[-3000:]
    for rank in (0, 1):
        record = json.loads((run_dir / "errors" / f"rank-{rank}.json").read_text())
        assert record["exc_type"] == "ValueError" and record["source"] == "user"
        assert record["rank"] == rank and record["step"] == 5
        assert "maybe_raise" in record["traceback"]
    # torchrun copies the root cause's TorchElastic error file to its own error file.
    extra = json.loads(elastic.read_text())["message"]["extraInfo"]
    assert extra["source"] == "user" and extra["exc_type"] == "ValueError" and extra["step"] == 5
    message = (termination / "termination-log").read_text()
    assert len(message.encode()) < 4096 and json.loads(message)["source"] == "user"
    assert not (run_dir / "final").exists()


def test_bad_config_is_rejected_before_any_process_group(h, work):
    run_dir = work / "bad-config"
    elastic = work / "torchrun-config-error.json"
    out = h.run(run_dir, sets=("train.lr=-1",), TORCHELASTIC_ERROR_FILE=str(elastic))
    assert out.returncode != 0
    # The first rank to fail exits 2; torchrun may tear the other down before it gets there.
    assert h.root_cause_exitcode(out.stdout) == EXIT_CONFIG_ERROR, out.stdout[-3000:]
    assert "gangflow: config error: train.lr=-1.0 is invalid: must be a number > 0" in out.stdout
    assert "starting from step 0" not in out.stdout
    assert json.loads(elastic.read_text())["message"]["extraInfo"]["source"] == "config"
    assert json.loads((run_dir / "errors" / "rank-0.json").read_text() if (run_dir / "errors" / "rank-0.json").exists()
                      else (run_dir / "errors" / "rank-1.json").read_text())["source"] == "config"


def test_md5_mismatch_refuses_to_start(h, work):
    out = h.run(work / "bad-md5", sets=("data.train_md5=" + "0" * 32,), nproc=None)
    assert out.returncode == 1
    assert "data.train_md5 mismatch" in out.stdout
    assert json.loads((work / "bad-md5" / "errors" / "rank-0.json").read_text())["source"] == "user"


def test_mpirun_environment_runs_the_same_training(h, work, reference):
    """OpenMPI's variables (as mpirun sets them) start the same gang as torchrun."""
    run_dir = work / "mpi"
    port = str(free_port())
    procs = [
        subprocess.Popen(h.command(run_dir, nproc=None), cwd=h.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=h.trainer_env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                                           OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "done: 60 steps on 2 rank(s)" in outs[0]
    assert_bitwise_equal(run_dir, reference)


def test_default_config_reaches_95_percent_with_mlflow(h, work, digits):
    """params.yaml as shipped, 2 ranks; the data read from a suffix-less copy pinned by md5; MLflow on."""
    from trainer.datastore import file_md5

    blob = work / "dvc-cache" / "3f" / "a9c0ffee"
    blob.parent.mkdir(parents=True)
    shutil.copy(digits / "train.parquet", blob)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    run_dir = work / "default"
    started = time.monotonic()
    out = h.check_ok(h.run(run_dir, sets=(f"data.train_path={blob}", f"data.test_path={digits / 'test.parquet'}",
                                          f"data.train_md5={file_md5(blob)}",
                                          f"tracking.mlflow_uri={uri}", "tracking.experiment=trainer-tests")))
    elapsed = time.monotonic() - started
    acc = accuracy(run_dir)
    print(f"default config on 2 ranks: test accuracy {acc:.4f} in {elapsed:.1f}s (incl. start-up and MLflow)")
    assert acc >= 0.95, out[-3000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "600"
    assert run.data.metrics["test_accuracy"] == pytest.approx(acc)
    assert len(client.get_metric_history(run_id, "loss")) == 60
    assert {"samples_per_sec", "checkpoint_duration_s", "checkpoint_bytes"} <= set(run.data.metrics)


def test_finished_checkpoint_under_other_data_is_refused(h, work, reference, digits):
    """Issue 12.3: resuming a (finished) checkpoint made with other data would publish its weights
    under this run's data; the trainer refuses, naming both md5s."""
    from trainer.datastore import file_md5

    run_dir = copy_run(reference, work / "other-data", keep={60})
    other = work / "other-train.parquet"
    shutil.copy(digits / "test.parquet", other)  # a valid dataset, another md5
    out = h.run(run_dir, sets=(f"data.train_path={other}", *h.SMALL), nproc=None)
    assert out.returncode != 0, out.stdout[-3000:]
    assert (f"was made with data.train_md5='{file_md5(digits / 'train.parquet')}'; this run has "
            f"data.train_md5='{file_md5(other)}'") in out.stdout, out.stdout[-3000:]
    assert not (run_dir / "final").exists()
