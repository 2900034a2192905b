"""Model factories.

Signature (`model.factory: module:function`): `fn(**kwargs) -> torch.nn.Module`, where kwargs
are the keys of params.yaml's `model` section other than `factory`. When the factory has an
`input_dim` parameter and the section does not set it, the trainer passes the number of
features of the first training sample; the value used is recorded in the model card.
Models take raw features (the digits' pixels are in [0, 16]) and return class logits.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, input_dim: int, hidden: int, num_classes: int, depth: int, dropout: float, input_scale: float):
        super().__init__()
        self.input_scale = float(input_scale)
        layers: list[nn.Module] = []
        width = input_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.input_scale)


def mlp(
    hidden: int = 128,
    num_classes: int = 10,
    input_dim: int = 64,
    depth: int = 1,
    dropout: float = 0.0,
    input_scale: float = 1.0 / 16.0,
) -> nn.Module:
    """`depth` hidden ReLU layers of width `hidden`; inputs are multiplied by `input_scale` first."""
    for name, value in (("hidden", hidden), ("num_classes", num_classes), ("input_dim", input_dim), ("depth", depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{name}={value!r}: must be an integer >= 1")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"model.dropout={dropout!r}: must be in [0, 1)")
    return MLP(input_dim, hidden, num_classes, depth, float(dropout), float(input_scale))
