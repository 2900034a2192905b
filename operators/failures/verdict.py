"""The classifier's answer (contract 4's JSON object)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["infra", "user", "unknown"]
KINDS = ("infra", "user", "unknown")
MAX_REASON = 299


@dataclass(frozen=True)
class Verdict:
    """The classifier's answer. `rule` names the decisive rule (not part of the JSON contract)."""

    kind: Kind
    retryable: bool
    reason: str
    rule: str = field(default="", compare=False)
    context: tuple[str, ...] = field(default=(), compare=False)  # the platform's facts the verdict used
    exclude_nodes: tuple[str, ...] = field(default=(), compare=False)  # nodes a retry should avoid

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: must be one of {KINDS}")

    def to_dict(self) -> dict[str, Any]:
        """The contract-4 JSON object: {"kind", "retryable", "reason"}, plus "context" and
        "exclude_nodes" when the platform's context was used."""
        out: dict[str, Any] = {"kind": self.kind, "retryable": self.retryable, "reason": self.reason}
        if self.context:
            out["context"] = list(self.context)
        if self.exclude_nodes:
            out["exclude_nodes"] = list(self.exclude_nodes)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        kind = data.get("kind", "unknown")
        context = data.get("context") if isinstance(data.get("context"), list) else []
        exclude = data.get("exclude_nodes") if isinstance(data.get("exclude_nodes"), list) else []
        return cls(kind=kind, retryable=bool(data.get("retryable", kind != "user")), reason=str(data.get("reason", "")),
                   context=tuple(map(str, context)), exclude_nodes=tuple(map(str, exclude)))


def clip(reason: str, tail: str = "") -> str:
    """`reason` on one line, at most MAX_REASON characters; `tail` (a note) stays whole at the end."""
    reason, tail = " ".join(reason.split()), " ".join(tail.split())
    room = MAX_REASON - len(tail) - 1 if tail else MAX_REASON
    if len(reason) > room:
        reason = reason[: max(room - 1, 0)].rstrip() + "…"
    return (f"{reason} {tail}" if tail else reason)[:MAX_REASON]
