"""trainer.integrations: Hugging Face's Trainer and Lightning's Trainer on the runtime API.

Each test trains a tiny model for real in this process (a rank of one): the framework's
checkpoints are committed per contract 2 (under checkpoints/step-N, manifest last, keep_last),
a second attempt resumes from the newest committed one (and ends with the weights of an
uninterrupted run, bit for bit), and the framework's logged metrics reach `report`
(metrics.jsonl, which the task relays to MLflow).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from trainer import EXIT_PREEMPTED, runtime

ROOT = Path(__file__).resolve().parents[3]

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (extra `frameworks`): not installed")


@pytest.fixture()
def env(runtime_env, tmp_path, monkeypatch):
    """Make `Run`s of one rank on tmp_path/run (tests/support/trainer_fixtures.py), keep_last 2,
    scratch under tmp_path."""
    monkeypatch.setenv(runtime.ENV_CODE, "tests:integrations")
    monkeypatch.setenv(runtime.ENV_KEEP_LAST, "2")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "scratch"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches its first answer
    (tmp_path / "scratch").mkdir()
    return lambda: runtime_env()


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test (the ranks run offline)."""
    dialled: list[object] = []

    def refuse(self, address, *args, **kwargs):
        dialled.append(address)
        raise AssertionError(f"network connection attempted to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield dialled
    assert dialled == []


def committed(tmp_path) -> list[str]:
    folder = tmp_path / "run" / "checkpoints"
    return sorted((p.name for p in folder.iterdir() if p.name.startswith("step-")), key=lambda n: int(n[5:]))


def reported(tmp_path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" not in r]  # report's records: {step, metrics..., time}


# --------------------------------------------------------------------------------------------
# Hugging Face


def hf_trainer(output_dir: str, max_steps: int, *, callbacks=(), **arguments):
    """A tiny GPT-2 Trainer; `arguments` override its TrainingArguments (with eval_strategy, the
    eval set is the first 8 rows)."""
    from trainer.integrations import huggingface  # noqa: F401 - the offline default first

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 32, (24, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(**{**dict(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=4,
                                       learning_rate=1e-2, save_strategy="steps", save_steps=2, logging_steps=1,
                                       report_to=[], disable_tqdm=True, use_cpu=True, seed=0, dataloader_num_workers=0),
                                **arguments})  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                   eval_dataset=data[:8] if "eval_strategy" in arguments else None, callbacks=list(callbacks))


class StepsSeen:
    """A callback that records the optimizer steps this attempt ran."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        seen = self.seen = []

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                seen.append(state.global_step)

        self.callback = Record()


def test_hf_checkpoints_are_committed_per_contract_2_and_metrics_reach_report(env, tmp_path, no_network):
    from trainer.integrations import huggingface as gangflow_hf

    run = env()
    trainer = hf_trainer(gangflow_hf.scratch_dir(run), max_steps=6)
    gangflow_hf.train(trainer, run)
    # committed under checkpoints/step-N with a manifest, the oldest pruned (GANGFLOW_KEEP_LAST=2)
    assert committed(tmp_path) == ["step-4", "step-6"]
    for name in committed(tmp_path):
        listed = json.loads((tmp_path / "run" / "checkpoints" / name / "manifest.json").read_text())
        assert runtime.FOLDER_FILE in json.dumps(listed)
    # the Trainer's scratch copies are gone once committed
    assert not list(Path(gangflow_hf.scratch_dir(run)).glob("checkpoint-*"))
    run.close()

    again = env()
    loaded = again.load_checkpoint()
    assert loaded.step == 6
    state = json.loads((loaded.folder / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and (loaded.folder / "model.safetensors").is_file()
    assert (loaded.folder / "optimizer.pt").is_file() and (loaded.folder / "rng_state.pth").is_file()

    losses = [r for r in reported(tmp_path) if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5, 6]  # logging_steps=1, each through report
    assert all("epoch" not in r for r in losses)


def test_hf_resumes_from_the_last_committed_checkpoint_and_ends_bitwise_equal(env, tmp_path, monkeypatch):
    from trainer.integrations import huggingface as gangflow_hf

    monkeypatch.setenv(runtime.ENV_RUN_DIR, str(tmp_path / "straight"))
    straight = env()
    reference = hf_trainer(gangflow_hf.scratch_dir(straight), max_steps=6)
    gangflow_hf.train(reference, straight)
    straight.close()

    from transformers import TrainerCallback

    class Crash(TrainerCallback):  # the attempt dies during step 5, after step-4 was committed
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 4:
                raise ConnectionResetError("peer lost")

    monkeypatch.setenv(runtime.ENV_RUN_DIR, str(tmp_path / "run"))
    first = env()
    with pytest.raises(ConnectionResetError):
        gangflow_hf.train(hf_trainer(gangflow_hf.scratch_dir(first), max_steps=6, callbacks=[Crash()]), first)
    first.close(status=None)
    assert committed(tmp_path) == ["step-2", "step-4"]
    # a half-written checkpoint-6 the killed attempt left in the Trainer's scratch folder is not used
    half = Path(gangflow_hf.scratch_dir(first)) / "checkpoint-6"
    half.mkdir(parents=True)
    (half / "trainer_state.json").write_text("{")

    second = env()
    steps = StepsSeen()
    resumed = hf_trainer(gangflow_hf.scratch_dir(second), max_steps=6, callbacks=[steps.callback])
    gangflow_hf.train(resumed, second)
    assert second.resumed_from == 4
    assert steps.seen == [5, 6]  # only the steps after the committed checkpoint ran again
    for (name, value), (_, expected) in zip(resumed.model.state_dict().items(), reference.model.state_dict().items()):
        assert torch.equal(value, expected), name


def test_hf_sigterm_commits_a_final_checkpoint_and_exits_75(env, tmp_path):
    import os

    from transformers import TrainerCallback

    from trainer.integrations import huggingface as gangflow_hf

    class TermAtStep3(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:  # during step 3
                os.kill(os.getpid(), signal.SIGTERM)

    run = env()
    trainer = hf_trainer(gangflow_hf.scratch_dir(run), max_steps=10, callbacks=[TermAtStep3()])
    with pytest.raises(SystemExit) as exited:
        gangflow_hf.train(trainer, run)
    assert exited.value.code == EXIT_PREEMPTED
    assert committed(tmp_path)[-1] == "step-3"  # not a save_steps multiple: the preemption's own save


def test_hf_train_refuses_a_resume_path_of_its_own(env):
    from trainer.integrations import huggingface as gangflow_hf

    run = env()
    with pytest.raises(TypeError, match="resume_from_checkpoint"):
        gangflow_hf.train(hf_trainer(gangflow_hf.scratch_dir(run), max_steps=2), run, resume_from_checkpoint="/x")


def test_hf_refuses_load_best_model_at_end(env, tmp_path):
    from trainer.integrations import huggingface as gangflow_hf

    run = env()
    best = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss")
    # the best checkpoint-N's local copy is gone once committed (and on a retry's machine): the
    # Trainer would end with the last weights, so the argument is refused before any step
    with pytest.raises(ValueError, match="load_best_model_at_end=True"):
        gangflow_hf.train(hf_trainer(gangflow_hf.scratch_dir(run), max_steps=4, **best), run)
    # also when the callback is added by hand
    by_hand = [gangflow_hf.GangflowCallback(run)]
    trainer = hf_trainer(gangflow_hf.scratch_dir(run), max_steps=4, callbacks=by_hand, **best)
    with pytest.raises(ValueError, match="load_best_model_at_end=True"):
        trainer.train()
    assert not (tmp_path / "run" / "checkpoints").is_dir() or committed(tmp_path) == []


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_hf_train_removes_the_trainers_progress_printers(env, capsys, disable_tqdm):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trainer.integrations import huggingface as gangflow_hf

    run = env()
    trainer = hf_trainer(gangflow_hf.scratch_dir(run), max_steps=2, disable_tqdm=disable_tqdm,
                         eval_strategy="steps", eval_steps=2)
    gangflow_hf.train(trainer, run)
    kinds = {type(cb) for cb in trainer.callback_handler.callbacks}
    assert not kinds & {PrinterCallback, ProgressCallback}
    out = capsys.readouterr()
    # neither tqdm bars nor printed log dicts: gangflow's progress line and run.report carry them
    assert "{'loss'" not in out.out + out.err and "{'eval_loss'" not in out.out + out.err and "it/s" not in out.err


# --------------------------------------------------------------------------------------------
# Lightning


def pl_fit(run, max_epochs: int, *, every_n_epochs: int = 1, seen: list | None = None, validated: list | None = None,
           **trainer_args):
    """Fit a tiny module (4 steps an epoch); `seen` records (epoch, batch) of each training step,
    `validated` (given: a validation set of 4 batches) each validation step's; `trainer_args`
    override L.Trainer's."""
    import lightning as L

    from trainer.integrations import lightning as gangflow_pl

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            if seen is not None:
                seen.append((self.current_epoch, batch_idx))
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    if validated is not None:

        class Tiny(Tiny):  # noqa: F811 - the same module, with a validation step
            def validation_step(self, batch, batch_idx):
                validated.append(("sanity" if self.trainer.sanity_checking else self.current_epoch, batch_idx))
                x, y = batch
                self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    L.seed_everything(0, verbose=False)
    module = Tiny()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g))
    # The order of each epoch is a function of the epoch (as under DDP, where Lightning installs a
    # DistributedSampler): what makes an epoch-end resume replay the same batches.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=2)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    trainer = L.Trainer(**{**dict(accelerator="cpu", devices=1, max_epochs=max_epochs, enable_checkpointing=False,
                                   enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                                   deterministic=True, logger=gangflow_pl.GangflowLogger(run),
                                   callbacks=[gangflow_pl.GangflowCheckpoint(run, every_n_epochs=every_n_epochs)]),
                           **trainer_args})  # fmt: skip
    val = torch.utils.data.DataLoader(data, batch_size=4) if validated is not None else None
    trainer.fit(module, loader, val, ckpt_path=gangflow_pl.ckpt_path(run))
    return module


def test_lightning_checkpoints_are_committed_at_epoch_ends_and_metrics_reach_report(env, tmp_path):
    from trainer.integrations import lightning as gangflow_pl

    run = env()
    pl_fit(run, max_epochs=3)
    assert committed(tmp_path) == ["step-8", "step-12"]  # 4 steps per epoch; keep_last 2
    run.close()
    again = env()
    loaded = again.load_checkpoint()
    assert loaded.step == 12
    ckpt = torch.load(loaded.folder / gangflow_pl.CHECKPOINT_FILE, weights_only=False)
    assert ckpt["global_step"] == 12 and ckpt["epoch"] == 2 and "optimizer_states" in ckpt
    steps = [r["step"] for r in reported(tmp_path) if "loss" in r]
    assert steps == list(range(1, 13))  # log_every_n_steps=1: every step's loss through report


def test_lightning_resumes_from_the_last_committed_checkpoint_and_ends_bitwise_equal(env, tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.ENV_RUN_DIR, str(tmp_path / "straight"))
    straight = env()
    reference = pl_fit(straight, max_epochs=3)
    straight.close()

    monkeypatch.setenv(runtime.ENV_RUN_DIR, str(tmp_path / "run"))
    first = env()
    pl_fit(first, max_epochs=2)  # commits step-4, step-8
    first.close()
    second = env()
    seen: list = []
    resumed = pl_fit(second, max_epochs=3, seen=seen)
    assert second.resumed_from == 8
    assert seen == [(2, 0), (2, 1), (2, 2), (2, 3)]  # only the third epoch ran again
    for (name, value), (_, expected) in zip(resumed.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(value, expected), name


def test_lightning_sigterm_commits_a_final_checkpoint_and_exits_75(env, tmp_path):
    import os

    seen: list = []

    class TermDuringStep6(list):
        def append(self, item):  # training_step records (epoch, batch): step 6 is epoch 1, batch 1
            super().append(item)
            if item == (1, 1):
                os.kill(os.getpid(), signal.SIGTERM)

    run = env()
    with pytest.raises(SystemExit) as exited:
        pl_fit(run, max_epochs=3, seen=TermDuringStep6(seen))
    assert exited.value.code == EXIT_PREEMPTED
    assert committed(tmp_path) == ["step-4", "step-6"]  # the epoch-end one and the preemption's own, mid-epoch
    assert not list((tmp_path / "scratch").glob("gangflow-*"))  # a preempted rank skips Lightning's teardown: no scratch left


class TermAt(list):
    """A list that sends this process a SIGTERM when `item` is appended."""

    def __init__(self, item) -> None:
        super().__init__()
        self.item = item

    def append(self, item):
        super().append(item)
        if item == self.item:
            import os

            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize(("during", "expected"), [((1, 0), ["step-4", "step-8"]), (("sanity", 0), [])],
                         ids=["epoch-end-validation", "sanity-check"])
def test_lightning_sigterm_during_validation_commits_and_exits_75(env, tmp_path, during, expected):
    run = env()
    validated = TermAt(during)
    with pytest.raises(SystemExit) as exited:
        pl_fit(run, max_epochs=3, validated=validated)
    # Lightning's own SIGTERM handling (a SIGTERMException, exit code None) does not take over
    assert exited.value.code == EXIT_PREEMPTED
    assert validated[-1] != during  # the validation ran to its end, then the save
    saved = committed(tmp_path) if (tmp_path / "run" / "checkpoints").is_dir() else []
    assert saved == expected  # the sanity check runs before the first step: nothing to commit
    run.close(status=None)

    if expected:  # the retry resumes from the preemption's checkpoint and finishes
        again = env()
        seen: list = []
        pl_fit(again, max_epochs=3, seen=seen, validated=[])
        assert again.resumed_from == 8 and seen == [(2, 0), (2, 1), (2, 2), (2, 3)]
        assert committed(tmp_path) == ["step-8", "step-12"]


def test_lightning_sigterm_before_the_first_optimizer_step_exits_75_without_a_save(env, tmp_path):
    run = env()
    with pytest.raises(SystemExit) as exited:  # accumulating: global_step is still 0 after batch 0
        pl_fit(run, max_epochs=1, seen=TermAt((0, 0)), accumulate_grad_batches=2)
    assert exited.value.code == EXIT_PREEMPTED
    assert not (tmp_path / "run" / "checkpoints").is_dir() or committed(tmp_path) == []


def test_lightning_sigterm_exception_of_lightnings_own_exits_75(env):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from trainer.integrations import lightning as gangflow_pl

    # where Lightning saw the SIGTERM first (trainer.validate(), say): a retry, not a user error
    callback = gangflow_pl.GangflowCheckpoint(env())
    with pytest.raises(SystemExit) as exited:
        callback.on_exception(None, None, SIGTERMException())
    assert exited.value.code == EXIT_PREEMPTED
    callback.on_exception(None, None, RuntimeError("a user error stays one"))  # returns: Lightning re-raises it


def test_lightning_ckpt_path_refuses_a_checkpoint_without_lightnings_file(env):
    from trainer.integrations import lightning as gangflow_pl

    run = env()
    run.save_checkpoint(3, {"w": torch.zeros(1)})
    run.close()
    with pytest.raises(ValueError, match="lightning.ckpt"):
        gangflow_pl.ckpt_path(env())


def test_lightning_every_n_epochs_is_checked():
    from trainer.integrations import lightning as gangflow_pl

    with pytest.raises(ValueError, match="every_n_epochs"):
        gangflow_pl.GangflowCheckpoint(object(), every_n_epochs=0)


# --------------------------------------------------------------------------------------------
# Imports and the network


def test_trainer_imports_no_framework_and_the_hf_integration_runs_offline():
    code = (
        "import sys, os; os.environ.pop('HF_HUB_OFFLINE', None)\n"
        "import trainer, trainer.runtime, trainer.integrations\n"
        "assert not {'transformers', 'lightning', 'huggingface_hub'} & set(sys.modules), sorted(sys.modules)\n"
        "from trainer.integrations import huggingface\n"
        "import huggingface_hub.constants as c\n"
        "assert os.environ['HF_HUB_OFFLINE'] == '1' and c.HF_HUB_OFFLINE is True\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
