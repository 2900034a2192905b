"""A checkpoint's identity: what it must share with the run that resumes it.

Every checkpoint records the identity of the run that wrote it (gangflow's loop: config and data,
trainer.loop.run_identity; trainer.runtime: code, config and data); a resume under another
identity is refused with ResumeMismatch, so a finished checkpoint under a new dataset or config
never publishes old weights.
"""

from __future__ import annotations

from typing import Any

from trainer.errors import ConfigError

# The training settings a checkpoint must share with the run resuming it. Not here: world size
# (resume across world sizes is supported), device, logging/checkpoint/tracking settings, file
# paths (the data's md5s stand for them).
TRAIN_IDENTITY = ("max_steps", "seed", "batch_size", "lr", "momentum", "weight_decay", "warmup_steps",
                  "optimizer", "lr_schedule")


class ResumeMismatch(ConfigError):
    """The newest checkpoint was made with another config or other data than this run's."""


def identity_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]


def check_identity(where: str, saved: Any, current: dict[str, Any], *, what: str = "config/data") -> None:
    """Refuse (ResumeMismatch) to resume checkpoint `where` when the identity it records differs from
    this run's: gangflow's loop and trainer.runtime's checkpoints alike."""
    advice = ("resuming would mix two runs and could publish old weights under this run's lineage; "
              f"use a new run dir for the new {what}, or run with the checkpoint's")
    if not isinstance(saved, dict):
        raise ResumeMismatch(f"{where} records no {what} identity (written by an older trainer); {advice}")
    diff = identity_mismatch(saved, current)
    if diff:
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        now = ", ".join(f"{k}={current.get(k)!r}" for k in diff)
        raise ResumeMismatch(f"{where} was made with {was}; this run has {now}: {advice}")
