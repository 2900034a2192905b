"""Small value checks the trainer and the operators share (standard library only)."""

from __future__ import annotations

from typing import Any


def is_integer(value: Any) -> bool:
    """An int and not a bool (True is an int to Python, not a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)
