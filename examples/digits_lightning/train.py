"""A LightningModule trained by Lightning's Trainer (DDP under torchrun, gloo on CPU) on gangflow's
runtime API: scikit-learn's digits as 8x8 images, a small CNN, promoted on macro-F1.

Run in every rank of the gang (`training.command: [python, -m, digits_lightning.train]` in
pipelines/digits-lightning.yaml).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from digits_lightning.model import build, images

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="digits_lightning.train", description="The model's shape and the checkpoint cadence.")
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--every-n-epochs", type=int, default=1, help="commit a checkpoint every N epochs")
    return parser.parse_args(argv)


def lightning_module(channels: int, lr: float):
    import lightning as L

    class DigitsCNN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build(channels)
            self.lr = lr

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss, on_step=True, prog_bar=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.lr)

    return DigitsCNN()


def main(argv: Sequence[str] | None = None) -> int:
    """One rank's training: `run.params` gives train.max_steps (rounded up to whole epochs),
    train.batch_size (global, split over the ranks), train.lr and train.seed (the trigger form can
    change them)."""
    import lightning as L

    from trainer import runtime
    from trainer.integrations import lightning as gangflow_pl

    args = parse_args(argv)
    run = runtime.init(config={"channels": args.channels, "every_n_epochs": args.every_n_epochs})
    params = run.params
    max_steps, batch = int(params.get("train.max_steps", 1400)), int(params.get("train.batch_size", 32))
    lr, seed = float(params.get("train.lr", 2e-3)), int(params.get("train.seed", 20261203))
    if batch % run.world_size:
        raise ValueError(f"train.batch_size={batch} is not a multiple of the world size {run.world_size}")
    x, y = images(run.dataset() / "train.parquet")
    L.seed_everything(seed, workers=True, verbose=False)
    module = lightning_module(args.channels, lr)
    # Under DDP Lightning replaces the sampler by a DistributedSampler whose order is a function of
    # the seed and the epoch: an epoch-end resume replays exactly the batches of the run it continues.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch // run.world_size,
                                         shuffle=True)
    # Bounded by epochs, not steps: Lightning resumes an epoch-end checkpoint bit for bit only then
    # (with max_steps and max_epochs=-1 the resumed run's weights drift in the last bits).
    steps_per_epoch = math.ceil(math.ceil(len(x) / run.world_size) / (batch // run.world_size))
    epochs = max(1, math.ceil(max_steps / steps_per_epoch))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's: processes on this node
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp" if run.world_size > 1 else "auto", devices=local_world_size,
        num_nodes=max(1, run.world_size // local_world_size), max_epochs=epochs, deterministic=True,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=20,
        callbacks=[gangflow_pl.GangflowCheckpoint(run, every_n_epochs=args.every_n_epochs)],
        logger=gangflow_pl.GangflowLogger(run),
    )  # fmt: skip
    trainer.fit(module, loader, ckpt_path=gangflow_pl.ckpt_path(run))
    if run.rank == 0:
        from safetensors.torch import save_file

        loss = trainer.callback_metrics.get("loss")
        with tempfile.TemporaryDirectory() as final:  # log_model copies it
            save_file(module.net.state_dict(), Path(final) / "model.safetensors")  # tensors only: loading runs no code
            run.log_model(final, factory="digits_lightning.model:build", kwargs={"channels": args.channels}, classes=10,
                          metrics={} if loss is None else {"train_loss": float(loss)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
