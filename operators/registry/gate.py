"""The promotion gate: a metric and which way is better (`Metric`), the floor and margin a
candidate must pass (`PromotionGate`), and its verdict (`decide`). See docs/registry.md.

For a metric where higher is better (accuracy); where lower is better (RMSE) every comparison
turns around (the floor is a ceiling):

* the candidate must reach the floor: ``candidate >= floor`` (lower: ``candidate <= floor``);
* when there is a champion, the candidate must beat it by MORE than the minimum improvement:
  ``candidate - champion > min_improvement`` (lower: ``champion - candidate > ...``; strict:
  with ``min_improvement = 0`` a tie is not a win). Re-running identical training therefore
  promotes nothing, and the alias never moves between two equally good models.

Light (no mlflow): pipeline files are parsed with it at DAG parse time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DIRECTIONS = ("higher", "lower")
# Float scores that differ by less than this are equal (k/N accuracies, summed thresholds).
EPSILON = 1e-12


def check_direction(direction: Any) -> str:
    """`direction` when it is one of DIRECTIONS, else ValueError naming the accepted values."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}: accepted values are {', '.join(DIRECTIONS)}")
    return direction


@dataclass(frozen=True)
class Metric:
    """A metric, which way is better, and the range its values take (None: unbounded)."""

    name: str
    direction: str = "higher"  # "higher" | "lower"
    minimum: float | None = None
    maximum: float | None = None

    def __post_init__(self) -> None:
        check_direction(self.direction)

    @property
    def higher_is_better(self) -> bool:
        return self.direction == "higher"

    def gain(self, candidate: float, reference: float) -> float:
        """How much better `candidate` is than `reference` (positive: better), in the metric's units."""
        return candidate - reference if self.higher_is_better else reference - candidate

    def reaches(self, value: float, floor: float) -> bool:
        """True when `value` reaches `floor` (a ceiling when lower is better); inclusive."""
        return value >= floor if self.higher_is_better else value <= floor

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "direction": self.direction}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class PromotionGate:
    """When a candidate replaces the champion.

    :param floor: the score any candidate needs; inclusive (``candidate >= floor``, or
        ``candidate <= floor`` when lower is better: then it is a ceiling). Within `bounds`.
    :param min_improvement: margin over the champion, >= 0 and below the width of `bounds`;
        strict (``candidate - champion > min_improvement``, or ``champion - candidate > ...``),
        so 0 means "strictly better".
    :param metric: the score's name, used in reasons and tags (``gangflow.candidate_<metric>``).
    :param direction: "higher" (accuracy, F1) or "lower" (RMSE, MAE) is better.
    :param bounds: (lowest, highest) value the metric can take; None: unbounded on that side.
        Default [0, 1], a share such as accuracy.
    """

    floor: float = 0.9
    min_improvement: float = 0.0
    metric: str = "accuracy"
    direction: str = "higher"
    bounds: tuple[float | None, float | None] = (0.0, 1.0)

    def __post_init__(self) -> None:
        check_direction(self.direction)
        low, high = self.bounds
        span = f"[{_bound(low)}, {_bound(high)}]"
        if not _is_number(self.floor) or (low is not None and self.floor < low) or (high is not None and self.floor > high):
            raise ValueError(f"floor={self.floor!r}: must be a number in {span}")
        width = None if low is None or high is None else high - low
        if not _is_number(self.min_improvement) or self.min_improvement < 0 or (width is not None and self.min_improvement >= width):
            raise ValueError(f"min_improvement={self.min_improvement!r}: must be a number in [0, {_bound(width)})")
        if not isinstance(self.metric, str) or not self.metric.replace("_", "").isalnum():
            raise ValueError(f"metric={self.metric!r}: must be a non-empty name of letters, digits and '_'")
        object.__setattr__(self, "floor", float(self.floor))
        object.__setattr__(self, "min_improvement", float(self.min_improvement))

    @property
    def gated_metric(self) -> Metric:
        """The metric this gate compares, with its direction and bounds."""
        return Metric(self.metric, self.direction, *self.bounds)

    @property
    def higher_is_better(self) -> bool:
        return self.gated_metric.higher_is_better

    def gain(self, candidate: float, champion: float) -> float:
        """How much better the candidate is (positive: better), in the metric's units."""
        return self.gated_metric.gain(candidate, champion)

    def reaches_floor(self, candidate: float) -> bool:
        return self.gated_metric.reaches(candidate, self.floor)

    def describe(self) -> str:
        if self.higher_is_better:
            return (f"{self.metric} >= floor {self.floor:.4f} and "
                    f"{self.metric} - champion > min_improvement {self.min_improvement:.4f}")
        return (f"{self.metric} <= ceiling {self.floor:.4f} and "
                f"champion - {self.metric} > min_improvement {self.min_improvement:.4f} (lower is better)")


def _bound(value: float | None) -> str:
    return "inf" if value is None else f"{value:g}"


@dataclass(frozen=True)
class Decision:
    """The gate's verdict. `reason` states both scores and the rule applied."""

    promote: bool
    reason: str


def decide(
    candidate: float,
    champion: float | None,
    gate: PromotionGate,
    *,
    champion_version: int | str | None = None,
) -> Decision:
    """Apply `gate` to a candidate score and the champion's score (None: no champion yet)."""
    m = gate.metric
    champ = f"champion v{champion_version}" if champion_version is not None else "the champion"
    floor = "floor" if gate.higher_is_better else "ceiling"
    if not _is_number(candidate):
        return Decision(False, f"not promoted: candidate {m} {candidate!r} is not a number")
    if not gate.reaches_floor(candidate):
        where = "below the floor" if gate.higher_is_better else "above the ceiling"
        return Decision(False, f"not promoted: candidate {m} {candidate:.4f} is {where} {gate.floor:.4f}")
    if champion is None:
        return Decision(True, f"promoted: candidate {m} {candidate:.4f} reaches the {floor} {gate.floor:.4f} "
                              "and there is no champion yet")
    if not _is_number(champion):
        return Decision(False, f"not promoted: {champ} {m} {champion!r} is not a number; fix or remove the alias")
    gain = gate.gain(candidate, champion)
    better = "" if gate.higher_is_better else " (lower is better)"
    if gain - gate.min_improvement > EPSILON:
        return Decision(True, f"promoted: candidate {m} {candidate:.4f} beats {champ} ({champion:.4f}) by "
                              f"{gain:.4f}, more than the minimum improvement {gate.min_improvement:.4f}{better}")
    return Decision(False, f"not promoted: candidate {m} {candidate:.4f} does not beat {champ} ({champion:.4f}) "
                           f"by more than the minimum improvement {gate.min_improvement:.4f}{better}")
