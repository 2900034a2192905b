"""trainer.checks: the shared value checks."""

from __future__ import annotations

import pytest

from trainer.checks import is_integer


@pytest.mark.parametrize("value, expected", [(0, True), (-3, True), (10**40, True), (True, False), (False, False), (2.0, False), ("2", False), (None, False)])
def test_is_integer_takes_ints_and_not_bools(value, expected):
    assert is_integer(value) is expected
