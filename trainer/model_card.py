"""A final model's folder as gangflow writes and reads it: its name, its files, the card's format and
what the registry reads from a card. Imports nothing heavy (the Airflow worker reads cards too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.checks import is_integer

FINAL = "final"
WEIGHTS = "model.safetensors"
CARD = "model_card.json"
CARD_FORMAT = "gangflow-model-card/1"
#: The most class scores a card may announce (`classes`).
MAX_CARD_CLASSES = 65_536


def card_classes(card: Any) -> int | None:
    """A classifier card's `classes` (how many class scores its module returns, recorded by the
    rank that trained it), or None when the card does not say or says something else."""
    classes = card.get("classes") if isinstance(card, Mapping) else None
    return classes if is_integer(classes) and 1 <= classes <= MAX_CARD_CLASSES else None
