"""Hugging Face `transformers` Trainer on gangflow's runtime API.

    from trainer import runtime
    from trainer.integrations import huggingface as gangflow_hf   # before transformers: offline by default

    run = runtime.init()
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=gangflow_hf.scratch_dir(run), ...), ...)
    gangflow_hf.train(trainer, run)   # resumes from the last committed checkpoint, if any

`GangflowCallback` commits every checkpoint the Trainer writes (`checkpoint-N` under its
`output_dir`, a local scratch folder) through `run.save_checkpoint(step, folder=...)`, so it follows
contract 2 wherever the run dir is; `resume_checkpoint(run)` is the folder of the newest committed
one, for `Trainer.train(resume_from_checkpoint=...)`. Logged metrics go to `run.report`, the
fault hook and the preemption flag to every optimizer step. `load_best_model_at_end=True` is
refused: the local copy of a committed checkpoint is removed, and a retry may run elsewhere.

The ranks run offline: importing this module sets `HF_HUB_OFFLINE=1` unless the environment
already says otherwise (`HF_HUB_OFFLINE=0` allows downloads), since a rank must not wait on, or
silently depend on, the Hub.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub read it

from transformers import TrainerCallback  # noqa: E402 - after the offline default

#: Logged values that are not metrics (the Trainer logs them beside the loss).
NOT_METRICS = frozenset({"epoch", "total_flos"})


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def scratch_dir(run: Any) -> str:
    """A local folder for the Trainer's `output_dir`: checkpoints are written there, then committed."""
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"gangflow-hf-{os.getuid()}"
    return str(base / _run_key(run))


def _run_key(run: Any) -> str:
    # One folder per run dir, shared by the ranks of this machine (the Trainer writes the model
    # from rank 0 and an RNG file from every rank into the same checkpoint-N).
    import hashlib

    return hashlib.sha256(run.run_dir.url.encode()).hexdigest()[:16]


def resume_checkpoint(run: Any) -> str | None:
    """The newest committed checkpoint's folder (for `resume_from_checkpoint`), or None."""
    checkpoint = run.load_checkpoint()
    if checkpoint is None:
        return None
    if getattr(checkpoint, "folder", None) is None:
        raise ValueError(f"the committed checkpoint of step {checkpoint.step} holds a state dict, not a "
                         "Trainer folder: was this run dir written by another training script?")
    return str(checkpoint.folder)


def check_arguments(args: Any) -> None:
    """Refuse the `TrainingArguments` gangflow cannot honour (ValueError)."""
    if getattr(args, "load_best_model_at_end", False):
        # The Trainer reloads the best checkpoint-N from its output_dir at the end; gangflow removes
        # each local copy once committed, and keep_last may prune the committed one.
        raise ValueError("TrainingArguments(load_best_model_at_end=True) is not supported under gangflow: each "
                         "checkpoint is committed to the run dir and its local copy removed (and a retry may resume on "
                         "another machine), so the Trainer would end with the last weights, not the best. Set "
                         "load_best_model_at_end=False (evaluation metrics still reach run.report; "
                         "EarlyStoppingCallback needs only metric_for_best_model)")


class GangflowCallback(TrainerCallback):
    """Commits the Trainer's checkpoints (contract 2), reports its logs, runs the fault and
    preemption hooks."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._preempted = False

    def on_train_begin(self, args, state, control, **kwargs):
        check_arguments(args)  # also when the callback was added without train()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.run.step_done(state.global_step)
        if self.run.should_stop:  # SIGTERM (any rank): save now (committed in on_save), then exit 75
            self._preempted = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        # Every rank wrote its rng_state_<rank>.pth into the folder; the Trainer does not wait for them.
        _barrier()
        self.run.save_checkpoint(state.global_step, folder=folder)
        _barrier()
        if state.is_world_process_zero:  # committed: the scratch copy is not needed any more
            shutil.rmtree(folder, ignore_errors=True)
        if self._preempted:
            self.run.exit_preempted()  # every rank: exit 75, the retry resumes from this checkpoint
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return control
        metrics = {name: float(value) for name, value in logs.items()
                   if name not in NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool)
                   and math.isfinite(value)}  # fmt: skip
        if metrics:
            self.run.report(state.global_step, **metrics)
        return control


_LOAD = object()


def train(trainer: Any, run: Any, *, checkpoint: str | None | object = _LOAD, **train_kwargs: Any) -> Any:
    """`trainer.train()` with gangflow's callback, resumed from the last committed checkpoint if any
    (`checkpoint`: the folder `resume_checkpoint(run)` returned, when the caller needed it first)."""
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError("train(): gangflow chooses resume_from_checkpoint (its last committed checkpoint; "
                        "pass checkpoint=resume_checkpoint(run) if the code needs it before training)")
    check_arguments(trainer.args)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging

    if not any(isinstance(cb, GangflowCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(GangflowCallback(run))
    # The Trainer's printers (tqdm bars, or log dicts with disable_tqdm): gangflow's progress line
    # (run.step_done) and run.report replace them.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar per save in the task log
    # A killed attempt can leave a half-written checkpoint-N in the output folder: only committed
    # checkpoints resume, so the Trainer's own leftovers (and nothing else there) are removed.
    if run.local_rank == 0:
        for stale in Path(trainer.args.output_dir).glob("checkpoint-*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    resume = resume_checkpoint(run) if checkpoint is _LOAD else checkpoint
    return trainer.train(resume_from_checkpoint=resume, **train_kwargs)
