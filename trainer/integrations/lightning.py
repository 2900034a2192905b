"""Lightning's Trainer on gangflow's runtime API.

    from trainer import runtime
    from trainer.integrations import lightning as gangflow_pl

    run = runtime.init()
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=run.local_world_size, num_nodes=...,
                        callbacks=[gangflow_pl.GangflowCheckpoint(run)], logger=gangflow_pl.GangflowLogger(run),
                        enable_checkpointing=False)
    trainer.fit(module, datamodule, ckpt_path=gangflow_pl.ckpt_path(run))

`GangflowCheckpoint` writes Lightning's own checkpoint (`trainer.save_checkpoint`) into a local
scratch folder at the end of every `every_n_epochs`-th training epoch and commits that folder
through `run.save_checkpoint(step, folder=...)` (contract 2); `ckpt_path(run)` is the newest
committed one's `lightning.ckpt`, for `Trainer.fit(ckpt_path=...)`. Epoch ends are where
Lightning resumes exactly (a mid-epoch checkpoint restarts its epoch's data); a SIGTERM still saves
at once, mid-epoch, then `run.exit_preempted()`. `GangflowLogger` sends what `self.log` logs to
`run.report`.
"""

from __future__ import annotations

import os
import tempfile
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

#: The file name of Lightning's checkpoint inside a committed folder.
CHECKPOINT_FILE = "lightning.ckpt"


def ckpt_path(run: Any) -> str | None:
    """The newest committed checkpoint's Lightning file (for `Trainer.fit(ckpt_path=...)`), or None."""
    checkpoint = run.load_checkpoint()
    if checkpoint is None:
        return None
    folder = getattr(checkpoint, "folder", None)
    if folder is None or not (Path(folder) / CHECKPOINT_FILE).is_file():
        raise ValueError(f"the committed checkpoint of step {checkpoint.step} holds no {CHECKPOINT_FILE}: "
                         "was this run dir written by another training script?")
    return str(Path(folder) / CHECKPOINT_FILE)


class GangflowCheckpoint(Callback):
    """Commits Lightning's checkpoints through the runtime API and runs its per-step hooks."""

    def __init__(self, run: Any, *, every_n_epochs: int = 1) -> None:
        if not isinstance(every_n_epochs, int) or isinstance(every_n_epochs, bool) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs={every_n_epochs!r}: must be an integer >= 1")
        self.run = run
        self.every_n_epochs = every_n_epochs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.run.step_done(trainer.global_step)
        if self.run.should_stop:  # SIGTERM (any rank): a final checkpoint, then exit 75 (the retry resumes)
            self.save(trainer)
            self.run.exit_preempted()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def save(self, trainer) -> None:
        """Lightning's checkpoint of now, committed as step `trainer.global_step` (every rank calls it)."""
        step = trainer.global_step
        # Written by global rank 0 (strategy.save_checkpoint), then a barrier; the others pass
        # their own, empty folder: the runtime commits rank 0's. The scratch folder goes with the
        # save (a preempted rank exits right after it, without Lightning's teardown).
        with tempfile.TemporaryDirectory(prefix="gangflow-pl-") as scratch:
            folder = Path(scratch) / f"step-{step}"
            trainer.save_checkpoint(folder / CHECKPOINT_FILE, weights_only=False)  # the full state: it resumes
            self.run.save_checkpoint(step, folder=folder)


class GangflowLogger(Logger):
    """Lightning logger whose metrics go to `run.report` (task log and the DAG run's MLflow run)."""

    def __init__(self, run: Any) -> None:
        super().__init__()
        self.run = run

    @property
    def name(self) -> str:
        return "gangflow"

    @property
    def version(self) -> str:
        return os.environ.get("TORCHELASTIC_RUN_ID", "0")

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        pass  # the pipeline's Params are on the MLflow run already

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {name: float(value) for name, value in metrics.items() if name != "epoch"}
        if values:
            # Lightning counts from 0 before the optimizer step; gangflow counts completed steps
            # (what GangflowCheckpoint last gave step_done, so metrics and checkpoints agree).
            self.run.report(self.run.step or int(step or 0) + 1, **values)
