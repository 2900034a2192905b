"""Model factories: `fn(**kwargs) -> torch.nn.Module` (`model.factory: module:function`).

kwargs are params.yaml's `model` section; the trainer fills `input_dim`, `feature_mean`,
`feature_std`, `target_mean` and `target_std` from the training split when the factory takes them
and the section does not set them. Models return class logits or one value per row (regression).
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


class StandardizedRegressor(nn.Module):
    """An MLP on standardized features whose output is de-standardized: the preprocessing is part
    of the model, so training, evaluation, champion re-scoring and serving apply the same one."""

    def __init__(self, input_dim: int, hidden: int, depth: int, feature_mean: list[float], feature_std: list[float],
                 target_mean: float, target_std: float):
        super().__init__()
        if len(feature_mean) != input_dim or len(feature_std) != input_dim:
            raise ValueError(f"model.feature_mean/feature_std: need {input_dim} values each (one per feature), "
                             f"got {len(feature_mean)} and {len(feature_std)}")
        # Not persistent: they are the factory's kwargs (in the model card), not trained weights.
        self.register_buffer("mean", torch.tensor(feature_mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor([s if s > 0 else 1.0 for s in feature_std], dtype=torch.float32),
                             persistent=False)
        self.target_mean, self.target_std = float(target_mean), float(target_std) or 1.0
        layers: list[nn.Module] = []
        width = input_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std).squeeze(-1) * self.target_std + self.target_mean


def regressor(
    input_dim: int = 10,
    hidden: int = 32,
    depth: int = 1,
    feature_mean: list[float] | None = None,
    feature_std: list[float] | None = None,
    target_mean: float = 0.0,
    target_std: float = 1.0,
) -> nn.Module:
    """A regression MLP (`train.task: regression`) predicting one value per row, in the target's units.

    `feature_mean`/`feature_std`/`target_mean`/`target_std`: when the model section leaves them
    unset, the trainer fills them from the training split (`trainer.data.preprocessing_stats`)
    and records them in the model card, so every later use standardizes the same way.
    """
    for name, value in (("hidden", hidden), ("input_dim", input_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{name}={value!r}: must be an integer >= 1")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"model.depth={depth!r}: must be an integer >= 0 (0: a linear model)")
    mean = list(feature_mean) if feature_mean is not None else [0.0] * input_dim
    std = list(feature_std) if feature_std is not None else [1.0] * input_dim
    return StandardizedRegressor(input_dim, hidden, depth, mean, std, target_mean, target_std)
