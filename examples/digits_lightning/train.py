"""A LightningModule trained by Lightning's Trainer (DDP under torchrun, gloo on CPU) on gangflow's
runtime API: scikit-learn's digits as 8x8 images, a small CNN, promoted on macro-F1.

Run in every rank of the gang (`training.entrypoint: digits_lightning.train:main`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

FEATURES = [f"pixel_{i:02d}" for i in range(64)]
LABEL = "label"
PIXEL_MAX = 16.0  # ink counts 0..16 per pixel


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="digits_lightning.train", description=__doc__)
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank and step")
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=20261203)
    return parser.parse_args(argv)


def build_network(channels: int = 32) -> nn.Module:
    """The CNN: two 3x3 convolutions on the 1x8x8 image, then a linear layer to the ten digits."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(channels * 16, 10),
    )  # fmt: skip


def images(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(N x 1 x 8 x 8 float images scaled to [0, 1], N labels) from a digits parquet split."""
    import pandas as pd

    frame = pd.read_parquet(path)
    x = torch.tensor(frame[FEATURES].to_numpy(), dtype=torch.float32).view(-1, 1, 8, 8) / PIXEL_MAX
    return x, torch.tensor(frame[LABEL].to_numpy(), dtype=torch.long)


def lightning_module(channels: int, lr: float):
    import lightning as L

    class DigitsCNN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_network(channels)
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
    import lightning as L

    from trainer import runtime
    from trainer.integrations import lightning as gangflow_pl

    args = parse_args(argv)
    run = runtime.init()
    x, y = images(run.dataset() / "train.parquet")
    L.seed_everything(args.seed, workers=True, verbose=False)
    module = lightning_module(args.channels, args.lr)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's: processes on this node
    nodes = max(1, run.world_size // local_world_size)
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp" if run.world_size > 1 else "auto", devices=local_world_size,
        num_nodes=nodes, max_epochs=args.epochs, deterministic=True, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=20,
        callbacks=[gangflow_pl.GangflowCheckpoint(run)], logger=gangflow_pl.GangflowLogger(run),
    )  # fmt: skip
    trainer.fit(module, loader, ckpt_path=gangflow_pl.ckpt_path(run))
    if run.rank == 0:
        from safetensors.torch import save_file

        final = Path(tempfile.mkdtemp(prefix="digits-lightning-"))
        save_file(module.net.state_dict(), final / "model.safetensors")  # tensors only: loading runs no code
        (final / "digits_lightning.json").write_text(json.dumps({"channels": args.channels}))
        run.log_model(final)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
