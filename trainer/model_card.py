"""A final model's folder as gangflow writes and reads it: its name, its files, the card's format and
what the registry reads from a card. Imports nothing heavy (the Airflow worker reads cards too)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.checks import is_integer

FINAL = "final"
WEIGHTS = "model.safetensors"
CARD = "model_card.json"
CARD_FORMAT = "gangflow-model-card/1"
#: The most class scores a card may announce (`classes`).
MAX_CARD_CLASSES = 65_536


def read_card(final_dir: str | Path) -> dict[str, Any]:
    """The model card of a final folder; {} when it is missing or not a JSON object."""
    try:
        card = json.loads((Path(final_dir) / CARD).read_text())
    except (OSError, ValueError):
        return {}
    return card if isinstance(card, dict) else {}


def card_task(card: Any) -> str:
    """The task the model was trained for (`config.train.task`): classification unless it says regression."""
    try:
        task = card["config"]["train"]["task"]
    except (KeyError, TypeError):
        return "classification"
    return "regression" if task == "regression" else "classification"


def card_factory(card: Any) -> str | None:
    """The `module:function` model factory the card names; None when it names none."""
    try:
        factory = card["model"]["factory"]
    except (KeyError, TypeError):
        return None
    return factory if isinstance(factory, str) else None


def card_classes(card: Any) -> int | None:
    """A classifier card's `classes` (how many class scores its module returns, recorded by the
    rank that trained it), or None when the card does not say or says something else."""
    classes = card.get("classes") if isinstance(card, Mapping) else None
    return classes if is_integer(classes) and 1 <= classes <= MAX_CARD_CLASSES else None
