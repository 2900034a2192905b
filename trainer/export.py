"""Final weights: `DIR/final/model.safetensors` + `DIR/final/model_card.json`.

The card records how to rebuild the model (`model.factory`, `model.kwargs`), the resolved
config, the data files and their md5, the final metrics, world size, steps and versions.
`load_final_model(final_dir)` rebuilds the module from the card and loads the weights; nothing
is unpickled. The folder is written aside and renamed into place (an existing `final/` is moved
away first and deleted after), so a reader never sees a half-written `final/`.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from trainer.checkpoint import _fsync_dir, _write_file, cpu_copy
from trainer.config import resolve_factory

FINAL = "final"
WEIGHTS = "model.safetensors"
CARD = "model_card.json"
CARD_FORMAT = "gangflow-model-card/1"


def write_final(run_dir: str | Path, model: torch.nn.Module, card: dict[str, Any]) -> Path:
    """Atomically publish `run_dir/final/` with the weights of `model` and `card`."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".final-tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    weights = _write_file(tmp / WEIGHTS, safetensors.torch.save(cpu_copy(model.state_dict())))
    card = {"format": CARD_FORMAT, **card, "weights": {"file": WEIGHTS, **weights}}
    _write_file(tmp / CARD, (json.dumps(card, indent=2) + "\n").encode())
    _fsync_dir(tmp)
    final = run_dir / FINAL
    old = None
    if final.exists():
        old = run_dir / f".final-old-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(run_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_card(final_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(final_dir) / CARD).read_text())


def build_model(factory: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    return resolve_factory(factory, "model.factory")(**kwargs)


def load_final_model(final_dir: str | Path) -> torch.nn.Module:
    """The trained model of a run's `final/` dir, on CPU, in eval mode."""
    final_dir = Path(final_dir)
    card = read_card(final_dir)
    model = build_model(card["model"]["factory"], card["model"]["kwargs"])
    state = safetensors.torch.load_file(str(final_dir / card.get("weights", {}).get("file", WEIGHTS)))
    model.load_state_dict(state, strict=True)
    return model.eval()
