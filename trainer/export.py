"""Final weights: `DIR/final/model.safetensors` + `DIR/final/model_card.json`.

The card says how to rebuild the model and records the config, the data and its md5s and the final
metrics. `load_final_model(final_dir)` rebuilds it without unpickling, for allow-listed factories
only (trainer.allowlist). `final/` is written aside and renamed into place.
"""

from __future__ import annotations

import json
import os
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
from trainer.safetensors_header import described_values
from trainer.checks import is_integer
from trainer.model_card import CARD, CARD_FORMAT, FINAL, WEIGHTS


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


def load_card(final_dir: str | Path) -> dict[str, Any]:
    """The model card as the loader takes it: a JSON object, or an error (trainer.model_card.read_card
    is the lenient reader of hints)."""
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


#: A safetensors header (JSON) larger than this is refused unread (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000


def weights_numel(path: str | Path) -> int:
    """How many values a safetensors file holds, from its header alone (nothing is loaded).

    The header is data: its tensors must describe the file's bytes exactly, or a small file could
    claim billions of values and size a model by them."""
    import struct

    with open(path, "rb") as fh:
        file_bytes = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) != 8:
            raise ModelNotAllowed(f"{path}: not a safetensors file (no header)")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES or 8 + size > file_bytes:
            raise ModelNotAllowed(f"{path}: safetensors header of {size} bytes (limit {MAX_HEADER_BYTES}, file "
                                  f"{file_bytes} bytes)")
        try:
            return described_values(json.loads(fh.read(size)), file_bytes - 8 - size)
        except (ValueError, TypeError) as exc:
            raise ModelNotAllowed(f"{path}: unreadable safetensors header ({exc}); nothing was built") from None


def check_card_sizes(factory: str, kwargs: dict[str, Any], weights_values: int) -> None:
    """Refuse card kwargs that size a model beyond what its weights file holds, before building it.

    Each integer (or list length) of the kwargs is at most the number of values in the weights:
    a width, depth or class count larger than that cannot describe them."""
    bound = max(weights_values, 1)
    for key, value in kwargs.items():
        size = len(value) if isinstance(value, list) else value
        if is_integer(size) and size > bound:
            raise ModelNotAllowed(
                f"model card: model.kwargs.{key}={size if not isinstance(value, list) else f'[{size} items]'} "
                f"is larger than the {weights_values} values its weights hold; nothing was built ({factory})")


def _meta_size(func: Callable[..., Any], kwargs: dict[str, Any]) -> int:
    """Values in the state dict `func(**kwargs)` would have, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = func(**kwargs)
    if not isinstance(model, torch.nn.Module):
        return -1
    return sum(t.numel() for t in model.state_dict().values())


def load_final_model(final_dir: str | Path, *, allowed_models: Iterable[str] | str | None = None) -> torch.nn.Module:
    """The trained model of a run's `final/` dir, on CPU, in eval mode.

    `allowed_models`: `module:function` factories allowed beside the `gangflow.models` entry
    points and `GANGFLOW_ALLOWED_MODELS`; anything else is refused (`ModelNotAllowed`) before
    any import. The card's sizes are checked against the weights file's header before anything
    is built (`check_card_sizes`, then a build on the meta device).
    """
    final_dir = Path(final_dir)
    card = load_card(final_dir)
    weights = card_weights_file(card)  # checked before the factory runs
    factory, kwargs = card_model(card)
    values = weights_numel(final_dir / weights)
    check_card_sizes(factory, kwargs, values)
    func, kwargs = factory_for_card({"model": {"factory": factory, "kwargs": kwargs}}, allowed_models)
    built = _meta_size(func, kwargs)
    if built > values:
        raise ModelNotAllowed(f"model card: {factory}(**model.kwargs) would hold {built} values, its weights "
                              f"{values}; nothing was built")
    model = build_model(factory, kwargs, allowed_models=allowed_models)
    state = safetensors.torch.load_file(str(final_dir / weights))
    model.load_state_dict(state, strict=True)
    return model.eval()
