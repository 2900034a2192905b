"""operators.registry.gate: the metric's direction, the gate's bounds and its verdict."""

from __future__ import annotations

import math

import pytest

from operators.registry.gate import Decision, Metric, PromotionGate, decide


def test_gate_defaults():
    gate = PromotionGate()
    assert (gate.floor, gate.min_improvement, gate.metric) == (0.9, 0.0, "accuracy")


@pytest.mark.parametrize(
    ("kwargs", "field", "accepted"),
    [
        ({"floor": 1.5}, "floor", r"\[0, 1\]"),
        ({"floor": -0.1}, "floor", r"\[0, 1\]"),
        ({"floor": math.nan}, "floor", r"\[0, 1\]"),
        ({"floor": "0.9"}, "floor", r"\[0, 1\]"),
        ({"floor": True}, "floor", r"\[0, 1\]"),
        ({"min_improvement": 1.0}, "min_improvement", r"\[0, 1\)"),
        ({"min_improvement": -0.01}, "min_improvement", r"\[0, 1\)"),
        ({"min_improvement": math.inf}, "min_improvement", r"\[0, 1\)"),
        ({"metric": ""}, "metric", "name"),
    ],
)
def test_bad_gate_values_are_rejected_naming_the_field(kwargs, field, accepted):
    with pytest.raises(ValueError, match=rf"^{field}=.*{accepted}"):
        PromotionGate(**kwargs)


def test_gate_accepts_edges():
    assert PromotionGate(floor=0, min_improvement=0).floor == 0.0
    assert PromotionGate(floor=1, min_improvement=0.999).floor == 1.0


def test_no_champion_promotes_when_the_floor_is_reached():
    d = decide(0.95, None, PromotionGate(floor=0.9))
    assert d == Decision(True, d.reason) and d.promote
    assert "0.9500" in d.reason and "floor 0.9000" in d.reason and "no champion" in d.reason


def test_floor_is_inclusive():
    assert decide(0.9, None, PromotionGate(floor=0.9)).promote


def test_below_floor_is_rejected_even_without_champion_or_with_a_worse_one():
    gate = PromotionGate(floor=0.9)
    for champion in (None, 0.5):
        d = decide(0.85, champion, gate, champion_version=1)
        assert not d.promote
        assert "0.8500 is below the floor 0.9000" in d.reason


def test_better_candidate_is_promoted():
    d = decide(0.9711, 0.9622, PromotionGate(), champion_version=1)
    assert d.promote
    assert "0.9711" in d.reason and "champion v1 (0.9622)" in d.reason and "0.0089" in d.reason


def test_equal_scores_are_not_promoted():
    d = decide(0.9622, 0.9622, PromotionGate(), champion_version=1)
    assert not d.promote
    assert d.reason == ("not promoted: candidate accuracy 0.9622 does not beat champion v1 (0.9622) "
                        "by more than the minimum improvement 0.0000")


def test_worse_candidate_is_not_promoted():
    assert not decide(0.95, 0.96, PromotionGate(), champion_version=3).promote


def test_min_improvement_is_a_strict_margin():
    gate = PromotionGate(floor=0.0, min_improvement=0.2)
    assert not decide(0.3, 0.1, gate).promote  # exactly the margin (0.1 + 0.2 != 0.3 in floats)
    assert not decide(0.7, 0.5, gate).promote  # exactly the margin, rounding the other way
    assert not decide(0.35, 0.2, gate).promote
    assert decide(0.41, 0.2, gate).promote


def test_nan_scores_are_never_promoted():
    assert not decide(math.nan, None, PromotionGate(floor=0)).promote
    assert not decide(0.99, math.nan, PromotionGate(), champion_version=1).promote


def test_the_metric_owns_the_direction_and_the_gate_uses_it():
    rmse = Metric("rmse", "lower", 0.0, None)
    assert not rmse.higher_is_better and rmse.gain(0.4, 0.5) == pytest.approx(0.1) and rmse.reaches(0.5, 0.5)
    assert not rmse.reaches(0.6, 0.5)
    gate = PromotionGate(floor=0.5, metric="rmse", direction="lower", bounds=(0.0, None))
    assert gate.gated_metric == rmse and not gate.higher_is_better
    with pytest.raises(ValueError, match=r"^direction='up': accepted values are higher, lower$"):
        Metric("accuracy", "up")
    with pytest.raises(ValueError, match=r"^direction='up': accepted values are higher, lower$"):
        PromotionGate(direction="up")
