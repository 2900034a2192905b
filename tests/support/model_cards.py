"""A run's `final/` folder as the trainer leaves it, with a tiny model, for operator tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def tiny_mlp(hidden: int = 8, num_classes: int = 10) -> torch.nn.Module:
    """The model factory named in the cards below (`model_cards:tiny_mlp`)."""
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes))


def write_final_dir(run_dir: Path, model: torch.nn.Module, **kwargs) -> Path:
    """`run_dir/final/` in trainer/export.py's layout: safetensors weights and a model card."""
    final = run_dir / "final"
    final.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(final / "model.safetensors"))
    card = {"format": "gangflow-model-card/1", "model": {"factory": f"{__name__}:tiny_mlp", "kwargs": kwargs}}
    (final / "model_card.json").write_text(json.dumps(card))
    return final
