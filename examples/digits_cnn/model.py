"""The CNN, and the test split as it reads it (shared by the training script and the evaluation)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn


def build(channels: int = 32) -> nn.Module:
    """A small CNN for 8x8 one-channel images; takes [N, 64] pixel rows as well (the registered
    model's input: the dataset's 64 pixel columns)."""
    return DigitsCNN(channels)


class DigitsCNN(nn.Module):
    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * channels * 16, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:  # [N, 64] pixel rows, 0..16, as the parquet files hold them
            x = x.reshape(-1, 1, 8, 8) / 16.0
        return self.head(self.features(x))


def load_split(path) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 1, 8, 8] scaled to 0..1, labels [N]) from a digits parquet file."""
    table = pq.read_table(path)
    pixels = sorted(c for c in table.column_names if c != "label")
    x = np.stack([table.column(c).to_numpy() for c in pixels], axis=1).astype(np.float32)
    y = table.column("label").to_numpy().astype(np.int64)
    return torch.from_numpy(x).reshape(-1, 1, 8, 8) / 16.0, torch.from_numpy(y)
