"""Final weights: `DIR/final/model.safetensors` + `DIR/final/model_card.json`.

The card says how to rebuild the model and records the config, the data and its md5s and the final
metrics. `load_final_model(final_dir)` rebuilds it without unpickling, for allow-listed factories
only (trainer.allowlist). `final/` is written aside and renamed into place.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from trainer.checkpoint import cpu_copy, file_entry
from trainer.storage import Storage, publish_folder, write_folder
from trainer.allowlist import ModelNotAllowed, card_model, card_weights_file, factory_for_card

FINAL = "final"
WEIGHTS = "model.safetensors"
CARD = "model_card.json"
CARD_FORMAT = "gangflow-model-card/1"


def _write_files(folder: Path, model: torch.nn.Module, card: dict[str, Any]) -> None:
    """The weights and the card in `folder`, both fsynced, and the folder too."""
    weights = safetensors.torch.save(cpu_copy(model.state_dict()))
    card = {"format": CARD_FORMAT, **card, "weights": {"file": WEIGHTS, **file_entry(weights)}}
    write_folder(folder, {WEIGHTS: weights, CARD: (json.dumps(card, indent=2) + "\n").encode()})


def write_final(run_dir: str | Path | Storage, model: torch.nn.Module, card: dict[str, Any],
                then: Callable[[Path], None] | None = None) -> Path | str:
    """Publish `run_dir/final/` with the weights of `model` and `card`; returns its location.

    Local disk: written aside and renamed into place. Object storage: written in a local staging
    folder, uploaded with the card LAST (the card marks a complete `final/`; an old card is
    deleted first). `then(local_dir)` is called with a local folder holding the published files
    (e.g. to log them to MLflow) before a staging folder is removed."""
    store = Storage(run_dir)
    if not store.local:
        staging = Path(tempfile.mkdtemp(prefix="gangflow-final-"))
        try:
            _write_files(staging, model, card)
            store.remove(FINAL, CARD)
            store.put_dir(staging, FINAL, last=CARD)
            if then is not None:
                then(staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return store.uri(FINAL)
    run_dir = store.local_path()
    tmp = run_dir / f".final-tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    _write_files(tmp, model, card)
    final = run_dir / FINAL
    publish_folder(tmp, final, aside=".final-old")
    if then is not None:
        then(final)
    return final


def read_card(final_dir: str | Path) -> dict[str, Any]:
    card = json.loads((Path(final_dir) / CARD).read_text())
    if not isinstance(card, dict):
        raise ModelNotAllowed(f"{Path(final_dir) / CARD}: a model card is a JSON object, not {type(card).__name__}")
    return card


def build_model(factory: str, kwargs: dict[str, Any], *, allowed_models: Iterable[str] | str | None = None) -> torch.nn.Module:
    """The module `factory(**kwargs)`, only for an allow-listed factory and kwargs its signature takes."""
    func, kwargs = factory_for_card({"model": {"factory": factory, "kwargs": kwargs}}, allowed_models)
    model = func(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ModelNotAllowed(f"model.factory={factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def load_final_model(final_dir: str | Path, *, allowed_models: Iterable[str] | str | None = None) -> torch.nn.Module:
    """The trained model of a run's `final/` dir, on CPU, in eval mode.

    `allowed_models`: `module:function` factories allowed beside the `gangflow.models` entry
    points and `GANGFLOW_ALLOWED_MODELS`; anything else is refused (`ModelNotAllowed`) before
    any import.
    """
    final_dir = Path(final_dir)
    card = read_card(final_dir)
    weights = card_weights_file(card)  # checked before the factory runs
    factory, kwargs = card_model(card)
    model = build_model(factory, kwargs, allowed_models=allowed_models)
    state = safetensors.torch.load_file(str(final_dir / weights))
    model.load_state_dict(state, strict=True)
    return model.eval()
