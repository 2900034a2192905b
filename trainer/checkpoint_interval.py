"""`checkpoint.every_steps: auto`: the checkpoint interval by Young/Daly, sqrt(2 * C * MTBF).

C is the loop time one save costs (`checkpoint_blocked_s`), MTBF the mean time between the
infrastructure failures and preemptions of this pipeline. The training task reads both from the
pipeline's history and hands them to the ranks as one JSON value (`HISTORY_ENV`); without history
rank 0 times the first save (the probe) and takes the configured prior (`checkpoint.mtbf_prior_s`).
The interval is converted to steps with the step time measured over the first `PROBE_STEPS` steps
and bounded by `checkpoint.auto_min_steps` / `checkpoint.auto_max_steps`. docs/trainer.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from trainer.config import CheckpointConfig
from trainer.errors import ConfigError

HISTORY_ENV = "GANGFLOW_CHECKPOINT_HISTORY"
#: Steps of each attempt timed before the interval is chosen (the first one, with its warm-up, is not counted).
PROBE_STEPS = 20


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The interval in seconds that minimises the expected lost time: sqrt(2 * C * MTBF)."""
    for name, value in (("cost_s", cost_s), ("mtbf_s", mtbf_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r}: must be a finite number of seconds > 0")
    return math.sqrt(2.0 * cost_s * mtbf_s)


@dataclass(frozen=True)
class IntervalInputs:
    """What the pipeline's history says (None: no history for that input), each with its source."""

    cost_s: float | None = None
    cost_source: str = ""
    mtbf_s: float | None = None
    mtbf_source: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> IntervalInputs:
        text = (os.environ if environ is None else environ).get(HISTORY_ENV, "")
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError:
            raise ConfigError(f"environment {HISTORY_ENV} is not JSON: {text[:200]!r}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"environment {HISTORY_ENV} must be a JSON object with cost_s, cost_source, mtbf_s, mtbf_source")
        accepted = ("cost_s", "cost_source", "mtbf_s", "mtbf_source")
        for key in raw:
            if key not in accepted:
                raise ConfigError(f"environment {HISTORY_ENV}: unknown key {key!r}; accepted keys: {', '.join(accepted)}")
        values: dict[str, Any] = {}
        for name in ("cost_s", "mtbf_s"):
            value = raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"environment {HISTORY_ENV}: {name}={value!r} is invalid: must be a number of seconds > 0")
            source = raw.get(name.replace("_s", "_source"))
            if not isinstance(source, str) or not source.strip():
                raise ConfigError(f"environment {HISTORY_ENV}: {name.replace('_s', '_source')} must say where {name} came from")
            values[name], values[name.replace("_s", "_source")] = float(value), source
        return cls(**values)

    def to_env(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v not in (None, "")})


@dataclass(frozen=True)
class IntervalChoice:
    every_steps: int
    seconds: float  # Young/Daly's, before the bounds
    cost_s: float
    cost_source: str
    mtbf_s: float
    mtbf_source: str
    step_s: float
    bound: str | None  # the config key that bounded it, or None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        bound = f", bounded by {self.bound}" if self.bound else ""
        return (f"auto = {self.every_steps} steps (sqrt(2 * C * MTBF) = {self.seconds:.1f} s at {self.step_s:.4f} s/step{bound}; "
                f"C = {self.cost_s:.4f} s from {self.cost_source}; MTBF = {self.mtbf_s:.0f} s from {self.mtbf_source})")


def choose_interval(cfg: CheckpointConfig, *, step_s: float, history: IntervalInputs, probe_cost_s: float | None = None,
                    probe_step: int | None = None) -> IntervalChoice:
    """The interval in steps: history's cost, else the probe's; history's MTBF, else the prior."""
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"step time {step_s!r}: must be a measured number of seconds > 0")
    if history.cost_s is not None:
        cost_s, cost_source = history.cost_s, history.cost_source
    elif probe_cost_s is not None:
        cost_s = max(probe_cost_s, 1e-6)  # a save measured at 0 s still costs something
        cost_source = f"probe: this attempt's first save (step {probe_step}), checkpoint_blocked_s"
    else:
        raise ValueError("no checkpoint cost: neither the pipeline's history nor a probe save measured one")
    if history.mtbf_s is not None:
        mtbf_s, mtbf_source = history.mtbf_s, history.mtbf_source
    else:
        mtbf_s, mtbf_source = cfg.mtbf_prior_s, f"prior: checkpoint.mtbf_prior_s={cfg.mtbf_prior_s:g} (no failure history)"
    seconds = young_daly_s(cost_s, mtbf_s)
    steps, bound = max(1, round(seconds / step_s)), None
    if steps < cfg.auto_min_steps:
        steps, bound = cfg.auto_min_steps, "checkpoint.auto_min_steps"
    elif steps > cfg.auto_max_steps:
        steps, bound = cfg.auto_max_steps, "checkpoint.auto_max_steps"
    return IntervalChoice(every_steps=steps, seconds=round(seconds, 6), cost_s=cost_s, cost_source=cost_source, mtbf_s=mtbf_s,
                          mtbf_source=mtbf_source, step_s=step_s, bound=bound)
