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
at the next training batch end or validation start or end, mid-epoch, then `run.exit_preempted()`.
During `fit` gangflow's SIGTERM handler replaces Lightning's own (whose `SIGTERMException` would
end the rank as a user error). `GangflowLogger` sends what `self.log` logs to `run.report`.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

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
        self._sigterm: Any = None

    def on_fit_start(self, trainer, pl_module) -> None:
        # gangflow's SIGTERM handler (runtime.init() installed it), before Lightning registers its own
        self._sigterm = signal.getsignal(signal.SIGTERM)

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._take_sigterm_back()

    def on_train_start(self, trainer, pl_module) -> None:
        self._take_sigterm_back()

    def _take_sigterm_back(self) -> None:
        # Lightning's handler makes its loops raise SIGTERMException on the signalled rank alone
        # (and broadcasts from inside the handler): gangflow's flag, agreed by every rank at the
        # hooks below, decides instead. Lightning's teardown restores gangflow's handler anyway.
        if callable(self._sigterm) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.run.step_done(trainer.global_step)
        self._stop_if_preempted(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._stop_if_preempted(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        # Polled once per validation, not per batch: ranks may run unequal numbers of validation
        # batches, and should_stop is a collective.
        self._stop_if_preempted(trainer)

    def _stop_if_preempted(self, trainer) -> None:
        """SIGTERM (any rank): a final checkpoint, then exit 75 (the retry resumes)."""
        if trainer.state.fn == TrainerFn.FITTING and self.run.should_stop:
            self.save(trainer)
            self.run.exit_preempted()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning saw a SIGTERM first (outside fit's training, e.g. trainer.validate()): a
        # preemption, not a user error; the last committed checkpoint stands.
        if isinstance(exception, SIGTERMException):
            self.run.exit_preempted()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def save(self, trainer) -> None:
        """Lightning's checkpoint of now, committed as step `trainer.global_step` (every rank calls
        it); before the first optimizer step there is nothing to commit."""
        step = trainer.global_step
        if step < 1:
            return
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
