"""The network of digits-lightning, shared by the LightningModule, the evaluation and the registered
model (`allowed_models: [digits_lightning.model:build]`: gangflow's guarded loader rebuilds it)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

FEATURES = [f"pixel_{i:02d}" for i in range(64)]
LABEL = "label"
PIXEL_MAX = 16.0  # ink counts 0..16 per pixel


class DigitsNet(nn.Module):
    """Two 3x3 convolutions on the 1x8x8 image, then a linear layer to the ten digits. Takes
    images [N, 1, 8, 8] scaled to 0..1, or the dataset's rows [N, 64] of raw pixels 0..16 (the
    registered model's input)."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(channels * 16, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:
            x = x.reshape(-1, 1, 8, 8) / PIXEL_MAX
        return self.body(x)


def build(channels: int = 32) -> nn.Module:
    return DigitsNet(channels)


def images(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(N x 1 x 8 x 8 float images scaled to [0, 1], N labels) from a digits parquet split."""
    import pandas as pd

    frame = pd.read_parquet(path)
    x = torch.tensor(frame[FEATURES].to_numpy(), dtype=torch.float32).view(-1, 1, 8, 8) / PIXEL_MAX
    return x, torch.tensor(frame[LABEL].to_numpy(), dtype=torch.long)
