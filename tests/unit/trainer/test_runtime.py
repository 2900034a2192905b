"""trainer.runtime: the API a training loop of one's own uses (checkpoints, report, stop, faults)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainer import EXIT_PREEMPTED, runtime
from trainer.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def env(runtime_env):
    """A rank of one, its run dir under tmp_path (tests/support/trainer_fixtures.py)."""
    return runtime_env


def committed(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step-"))


def test_a_state_dict_round_trips_and_keep_last_prunes(env, tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.ENV_KEEP_LAST, "2")
    run = env()
    assert run.load_checkpoint() is None
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    for step in (1, 2, 3):
        run.save_checkpoint(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": step})
    assert committed(tmp_path) == ["step-2", "step-3"]
    run.close()

    again = env()
    loaded = again.load_checkpoint()
    assert loaded.step == 3 and again.resumed_from == 3 and loaded.folder is None
    assert loaded.state["epoch"] == 3
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state["model"][key], value)
    fresh = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(loaded.state["optimizer"])  # a real optimizer state dict, int keys and all
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_loads(env, tmp_path):
    run = env()
    run.save_checkpoint(1, {"w": torch.zeros(4)})
    run.save_checkpoint(2, {"w": torch.ones(4)})
    run.close()
    state = tmp_path / "run" / "checkpoints" / "step-2" / runtime.STATE_FILE
    state.write_bytes(state.read_bytes()[:-3] + b"xyz")  # same size, other bytes: the sha256 catches it
    loaded = env().load_checkpoint()
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(4))
    assert committed(tmp_path) == ["step-1"]
    assert any(p.name.startswith("corrupt-step-2-") for p in (tmp_path / "run" / "checkpoints").iterdir())



def test_without_a_process_group_another_rank_skips_a_corrupt_newest_checkpoint_too(env, tmp_path, monkeypatch):
    """`process_group=False`: no broadcast of rank 0's choice. Rank 1 took the newest committed step
    and failed on it when it came before rank 0 had set it aside; it now chooses as rank 0 does,
    leaving the moving aside to rank 0."""
    run = env()
    run.save_checkpoint(1, {"w": torch.zeros(4)})
    run.save_checkpoint(2, {"w": torch.ones(4)})
    run.close()
    state = tmp_path / "run" / "checkpoints" / "step-2" / runtime.STATE_FILE
    state.write_bytes(state.read_bytes()[:-3] + b"xyz")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loaded = env(process_group=False).load_checkpoint()  # rank 0 has not started yet
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(4))
    assert committed(tmp_path) == ["step-1", "step-2"]  # rank 0's to move aside

def test_an_uncommitted_folder_is_invisible(env, tmp_path):
    run = env()
    run.save_checkpoint(1, {"w": torch.zeros(1)})
    run.close()
    half = tmp_path / "run" / "checkpoints" / "step-5"
    half.mkdir()
    (half / runtime.STATE_JSON).write_text("{}")  # no manifest: never committed
    assert env().load_checkpoint().step == 1


def test_a_folder_written_by_a_framework_round_trips(env, tmp_path):
    folder = tmp_path / "hf" / "checkpoint-7"
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(os.urandom(1000))
    (folder / "sub" / "trainer_state.json").write_text('{"global_step": 7}')
    run = env()
    run.save_checkpoint(7, folder=folder)
    run.close()
    loaded = env().load_checkpoint()
    assert loaded.step == 7 and loaded.state is None
    assert (loaded.folder / "weights.bin").read_bytes() == (folder / "weights.bin").read_bytes()
    assert json.loads((loaded.folder / "sub" / "trainer_state.json").read_text()) == {"global_step": 7}


def test_a_link_in_a_checkpoint_folder_is_refused(env, tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "escape").symlink_to("/etc/passwd")
    with pytest.raises(CheckpointError, match="escape is a link"):
        env().save_checkpoint(1, folder=folder)


def test_a_checkpoint_of_other_config_or_code_is_refused(env, monkeypatch):
    run = env(config={"lr": 0.1})
    run.save_checkpoint(1, {"w": torch.zeros(1)})
    run.close()
    with pytest.raises(runtime.ResumeMismatch, match=r"config.lr=0.1.*config.lr=0.2"):
        env(config={"lr": 0.2}).load_checkpoint()
    monkeypatch.setenv(runtime.ENV_CODE, "tests:other")
    with pytest.raises(runtime.ResumeMismatch, match="code='tests:train'"):
        env(config={"lr": 0.1}).load_checkpoint()


def test_save_checkpoint_refuses_bad_arguments(env):
    run = env()
    with pytest.raises(TypeError, match="give the state, a folder, or both"):
        run.save_checkpoint(1)
    with pytest.raises(ValueError, match="step=0 must be an integer >= 1"):
        run.save_checkpoint(0, {"w": 1})


def test_report_writes_metrics_for_the_relay_and_refuses_tensors(env, tmp_path):
    run = env()
    run.report(5, loss=0.25, accuracy=0.5)
    with pytest.raises(TypeError, match="loss must be numbers"):
        run.report(6, loss=torch.tensor(1.0))
    run.close()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 5, "loss": 0.25, "accuracy": 0.5}.items() <= next(r for r in lines if r.get("step") == 5 and "loss" in r).items()


def test_sigterm_sets_should_stop_and_exit_preempted_exits_75(env, monkeypatch):
    monkeypatch.setenv(runtime.ENV_GRACE, "100000")  # the grace watchdog would end pytest itself
    run = env()
    assert run.should_stop is False
    os.kill(os.getpid(), signal.SIGTERM)
    assert run.should_stop is True
    with pytest.raises(SystemExit) as exited:
        run.exit_preempted()
    assert exited.value.code == EXIT_PREEMPTED


def test_raise_fault_fires_in_step_done_on_every_attempt(env, monkeypatch):
    monkeypatch.setenv("GANGFLOW_FAULT", "raise@step=2")
    monkeypatch.setenv("GANGFLOW_ALLOW_FAULTS", "1")
    for _ in range(2):
        run = env()
        run.step_done(1)
        with pytest.raises(ValueError, match="injected fault GANGFLOW_FAULT='raise@step=2'"):
            run.step_done(2)
        run.close(status=None)


def test_a_fault_without_permission_is_ignored(env, monkeypatch):
    monkeypatch.setenv("GANGFLOW_FAULT", "raise@step=1")
    run = env()
    run.step_done(1)  # no GANGFLOW_ALLOW_FAULTS: nothing fires


LOOP = textwrap.dedent("""
    import sys, time
    from trainer import runtime
    run = runtime.init(device="cpu")
    ckpt = run.load_checkpoint()
    start = ckpt.step if ckpt else 0
    for step in range(start + 1, 9):
        time.sleep(0.05)
        if step % 2 == 0:
            run.save_checkpoint(step, {"step": step})
        run.step_done(step)
    print("finished", start, flush=True)
""")


def _loop(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "GANGFLOW_FAULT", "MLFLOW_TRACKING_URI")}
    base.update({runtime.ENV_RUN_DIR: str(tmp_path / "run"), runtime.ENV_CODE: "loop", "PYTHONPATH": str(ROOT),
                 "GANGFLOW_ALLOW_FAULTS": "1", **env})
    return subprocess.run([sys.executable, "-c", LOOP], cwd=tmp_path, env=base, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("spec, code", [("kill@step=5", -signal.SIGKILL), ("exit=7@step=5", 7), ("kill@save=2", -signal.SIGKILL)])
def test_once_only_faults_fire_once_and_the_next_attempt_resumes(tmp_path, spec, code):
    first = _loop(tmp_path, GANGFLOW_FAULT=spec)
    assert first.returncode == code, first.stderr
    assert "fault injection: " in first.stdout + first.stderr
    second = _loop(tmp_path, GANGFLOW_FAULT=spec)
    assert second.returncode == 0, second.stderr
    assert "already fired" in second.stderr
    resumed = int(second.stdout.split("finished ")[1])
    assert resumed == (2 if spec == "kill@save=2" else 4)  # the 2nd save never committed; step 4 did


def test_kill_at_time_fires_on_the_timer(tmp_path):
    first = _loop(tmp_path, GANGFLOW_FAULT="kill@time=0.2")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert "unsynchronised" in first.stdout


def test_log_model_publishes_the_folder_with_a_card(env, tmp_path):
    model_dir = tmp_path / "export"
    model_dir.mkdir()
    (model_dir / "weights.pt").write_bytes(b"w" * 10)
    run = env()
    run.step_done(3)
    assert run.log_model(model_dir, flavour="pytorch", metrics={"accuracy": 0.9}) is None  # no MLFLOW_RUN_ID: the task logs it
    final = tmp_path / "run" / "final"
    assert (final / "weights.pt").read_bytes() == b"w" * 10
    card = json.loads((final / runtime.CARD).read_text())
    assert card["kind"] == "folder" and card["flavour"] == "pytorch" and card["steps"] == 3 and card["metrics"] == {"accuracy": 0.9}
    assert "model" not in card  # no factory: evaluation needs the pipeline's evaluation.entrypoint


def test_log_model_with_a_factory_loads_through_the_guarded_loader(env, tmp_path):
    import safetensors.torch

    from trainer.export import load_final_model

    model = torch.nn.Linear(4, 3)
    export = tmp_path / "export"
    export.mkdir()
    safetensors.torch.save_file(model.state_dict(), export / "model.safetensors")
    run = env()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        run.log_model(tmp_path, factory="torch.nn:Linear")
    run.log_model(export, factory="tests_linear:build", kwargs={"n": 4})
    card = json.loads((tmp_path / "run" / "final" / runtime.CARD).read_text())
    assert card["model"] == {"factory": "tests_linear:build", "kwargs": {"n": 4}} and card["weights"]["file"] == "model.safetensors"
    with pytest.raises(Exception, match="not an allowed model architecture"):
        load_final_model(tmp_path / "run" / "final")  # refused before any import unless allow-listed
    assert "classes" not in card  # not said: the training task counts them with a forward pass


def test_log_model_records_the_classifiers_class_count_and_refuses_nonsense(env, tmp_path):
    """`classes=` goes to the card (the registered signature's prob_<k> columns, no torch in the task);
    a value the registry would not read is refused, naming the field and what it accepts."""
    import safetensors.torch

    export = tmp_path / "export"
    export.mkdir()
    safetensors.torch.save_file(torch.nn.Linear(4, 3).state_dict(), export / "model.safetensors")
    run = env()
    for bad, kwargs in ((0, {}), (True, {}), ("3", {}), (70_000, {}), (3, {"task": "regression"})):
        with pytest.raises(ValueError, match=r"classes=.*accepted values are an integer from 1 to 65536"):
            run.log_model(export, factory="tests_linear:build", classes=bad, **kwargs)
    with pytest.raises(ValueError, match="with a factory"):
        run.log_model(export, classes=3)
    run.log_model(export, factory="tests_linear:build", kwargs={"n": 4}, classes=3)
    assert json.loads((tmp_path / "run" / "final" / runtime.CARD).read_text())["classes"] == 3


def test_dataset_fetches_the_pinned_version_verified(env, tmp_path, monkeypatch, make_remote):
    from trainer_fixtures import DATASET_FILES

    version = make_remote(tmp_path / "remote", DATASET_FILES)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "scratch"))
    monkeypatch.setattr("tempfile.tempdir", None)
    run = env()
    with pytest.raises(Exception, match="no dataset version was given"):
        run.dataset()
    monkeypatch.setenv(runtime.ENV_DATA_REMOTE, str(tmp_path / "remote"))
    monkeypatch.setenv(runtime.ENV_DATA_VERSION, version)
    folder = env().dataset()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == DATASET_FILES


def test_the_runtime_imports_and_runs_without_airflow_or_mlflow(tmp_path):
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("airflow", "mlflow"):
                    raise ImportError(f"blocked: {name}")
        sys.meta_path.insert(0, Block())
        from trainer import runtime
        run = runtime.init(device="cpu")
        run.report(1, loss=1.0)
        run.save_checkpoint(1, {"x": 1})
        run.step_done(1)
        import pathlib; d = pathlib.Path("m"); d.mkdir(); (d / "f").write_text("x")
        run.log_model(d)
        print("ok", sorted(m for m in ("airflow", "mlflow") if m in sys.modules))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "GANGFLOW_FAULT")}
    env.update(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI="", **{runtime.ENV_RUN_DIR: str(tmp_path / "run")})
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok []", out.stdout + out.stderr


@pytest.mark.parametrize("metrics, error, needle", [
    ({"acc@1": 0.5}, ValueError, "the metric name 'acc@1' is not one MLflow accepts"),
    ({"a//b": 0.5}, ValueError, "not a path that resolves elsewhere"),
    ({"event": 1.0}, ValueError, "the metric name 'event' is reserved"),
    ({"time": 1.0}, ValueError, "the metric name 'time' is reserved"),
    # an int float() cannot take: the relay's whole batch failed (OverflowError), the losses beside it lost
    ({"tokens_seen": 10**400}, TypeError, "tokens_seen must be numbers a double holds"),
])
def test_report_refuses_names_mlflow_or_the_metrics_file_would_lose(env, tmp_path, metrics, error, needle):
    """One name MLflow refuses failed the whole log_batch, so every metric beside it was lost;
    `event` or `time` overwrote the record's own keys."""
    run = env()
    run.report(1, loss=0.5)
    with pytest.raises(error, match=needle):
        run.report(2, loss=0.4, **metrics)
    with pytest.raises(ValueError, match=r"report: step='epoch-1' must be an integer from 0 to 2\*\*63-1"):
        run.report("epoch-1", loss=0.7)
    with pytest.raises(ValueError, match="report: step=9223372036854775808 must be"):  # MLflow's steps are int64
        run.report(2**63, loss=0.7)
    run.report(3, **{"val/loss": 0.3, "top-1 acc:train": 0.6})
    run.close()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r or "val/loss" in r] == [1, 3]


def test_save_checkpoint_refuses_a_step_below_the_newest(env, tmp_path):
    """Pruning keeps the highest steps: a lower step was committed and deleted at once, silently."""
    run = env()
    run.save_checkpoint(100, {"at": 100})
    with pytest.raises(ValueError, match="step=50 is below step 100"):
        run.save_checkpoint(50, {"at": 50})
    run.save_checkpoint(100, {"at": 100.5})  # the same step again replaces it
    run.close()
    assert env().load_checkpoint().state == {"at": 100.5}
    with pytest.raises(ValueError, match="step=99 is below step 100, already saved or resumed from"):
        _resumed_then_save(env, 99)


def _resumed_then_save(env, step):
    run = env()
    run.load_checkpoint()
    run.save_checkpoint(step, {"at": step})


def test_log_model_checks_its_metrics_before_publishing(env, tmp_path):
    model_dir = tmp_path / "export"
    model_dir.mkdir()
    (model_dir / "weights.pt").write_bytes(b"w")
    run = env()
    for metrics, needle in (({"world_size": 4}, "'world_size': gangflow's own fields"), ({"step": 100}, "'step' is reserved"),
                            ({"accuracy": "n/a"}, "accuracy must be numbers"), ({"acc@1": 0.9}, "'acc@1' is not one MLflow")):
        with pytest.raises((ValueError, TypeError), match=needle):
            run.log_model(model_dir, metrics=metrics)
        assert not (tmp_path / "run" / "final").exists()


def test_a_fifo_in_a_folder_is_refused_naming_the_call(env, tmp_path):
    """A FIFO used to vanish from the checkpoint and final/ without a word; a link in log_model's
    folder was refused as save_checkpoint's."""
    import os

    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w")
    os.mkfifo(folder / "events.pipe")
    run = env()
    with pytest.raises(CheckpointError, match=r"save_checkpoint\(folder=.*\): events.pipe is not a regular file"):
        run.save_checkpoint(1, folder=folder)
    with pytest.raises(CheckpointError, match=r"log_model\(.*\): events.pipe is not a regular file"):
        run.log_model(folder)
    (folder / "events.pipe").unlink()
    (folder / "escape").symlink_to("/etc/passwd")
    with pytest.raises(CheckpointError, match=r"log_model\(.*\): escape is a link"):
        run.log_model(folder)


def test_report_after_close_is_refused(env, tmp_path):
    """After `close()` the metrics file and MLflow are closed: a report then was dropped without a word."""
    run = env()
    run.report(1, loss=0.5)
    run.close()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(RuntimeError, match=r"report\(2, \.\.\.\) after close\(\): .* not recorded"):
        run.report(2, loss=0.25)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_a_closed_run_gives_sigterm_back_unless_a_sigterm_stopped_it(env, monkeypatch):
    """A rank whose code had returned kept gangflow's handler: when a peer failed, torchrun's SIGTERM
    made it wait out the whole grace period (25 s) and exit 75 as if preempted."""
    run = env()
    assert signal.getsignal(signal.SIGTERM) == run.preemption._on_sigterm
    run.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    stopped = env()
    stopped.preemption._on_sigterm(signal.SIGTERM, None)
    stopped.preemption.disarm()
    stopped.close(status=None)
    assert signal.getsignal(signal.SIGTERM) == stopped.preemption._on_sigterm  # its exit 75 is still to come
