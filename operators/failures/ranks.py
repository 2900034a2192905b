"""`classify`: judge each rank alone with the rule table, then choose the root cause.

A primary verdict wins, in table order; secondary rules (collective timeout, lost peer, rendezvous
failure, SIGTERM) decide only when no rank has a primary cause or an unknown one. When no rule
speaks at all, the corpus's nearest precedents may (`operators.failures.precedent`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from operators.failures.context import AMBIGUOUS_NOTE, Context, weigh
from operators.failures.evidence import MAX_ITEMS, SIGNAL_NAMES, Evidence, one_line
from operators.failures.rules import RULE_INDEX, RULES, Hit, Rule
from operators.failures.verdict import Verdict, clip

__all__ = ["classify"]


@dataclass(frozen=True)
class _Judged:
    rule: Rule | None
    hit: Hit | None
    facts: Evidence
    label: str  # "rank 1", "gang", "rank entry 2"

    @property
    def order(self) -> int:
        return RULE_INDEX[self.rule.name] if self.rule else len(RULES)


def _judge(facts: Evidence, label: str) -> _Judged:
    undecided: _Judged | None = None
    for rule in RULES:
        try:
            hit = rule.matcher(facts)
        except Exception:  # noqa: BLE001 - a malformed piece of evidence must not hide the others
            hit = None
        if hit is None:
            continue
        if rule.kind != "unknown":
            return _Judged(rule, hit, facts, label)
        # A rule that names the symptom but not the culprit (a collective timeout) lets a later
        # rule that does name one decide (torchrun's "exitcode: -9" for the same worker).
        undecided = undecided or _Judged(rule, hit, facts, label)
    return undecided or _Judged(None, None, facts, label)


def _where(rank: int | None, step: int | None) -> str:
    parts = ([f"rank {rank}"] if rank is not None else []) + ([f"step {step}"] if step is not None else [])
    return f" at {', '.join(parts)}" if parts else ""


def _fallback_summary(f: Evidence) -> str:
    bits = []
    if f.exit_code is not None:
        bits.append(f"exit code {f.exit_code}")
    if f.signal is not None and f.signal in SIGNAL_NAMES:
        bits.append(SIGNAL_NAMES[f.signal])
    if f.termination_reason:
        bits.append(f"termination reason {f.termination_reason}")
    if f.pod_reason:
        bits.append(f"pod reason {f.pod_reason}")
    last = next((ln.strip() for ln in reversed(f.log_tail.splitlines()) if ln.strip()), "")
    if last:
        bits.append(f"last log line: {one_line(last, 120)}")
    return "; ".join(bits) or "no evidence"


def _verdict(judged: _Judged, note: str = "") -> Verdict:
    f = judged.facts
    if judged.rule is None or judged.hit is None:
        where = _where(f.rank, f.step)
        reason = f"unknown: no rule matched{where} ({_fallback_summary(f)})"
        return Verdict("unknown", True, clip(reason + note), rule="")
    hit = judged.hit
    rank = hit.rank if hit.rank is not None else f.rank
    step = hit.step if hit.step is not None else f.step
    reason = f"{judged.rule.kind}: {hit.what}{_where(rank, step)}"
    excerpt = one_line(hit.excerpt, 160, hit.focus)
    if excerpt:
        reason += f": {excerpt}"
    return Verdict(judged.rule.kind, judged.rule.retryable, clip(reason + note), rule=judged.rule.name)


def _pick_root(judged: list[_Judged]) -> tuple[_Judged, str]:
    primary = [j for j in judged if j.rule is not None and not j.rule.secondary]
    # Gang-level evidence that matched nothing (torchrun's "exit code 1") is not a rank that
    # failed on its own: it does not outrank the ranks' secondary symptoms.
    unknown_ranks = [j for j in judged if j.rule is None and j.label != "gang"]
    secondary = [j for j in judged if j.rule is not None and j.rule.secondary]
    if primary:
        root = min(primary, key=lambda j: j.order)
    elif unknown_ranks:
        # A rank that died for no visible reason is likelier the first failure than the peers
        # that lost their connection to it.
        root = unknown_ranks[0]
    elif secondary:
        # A SIGTERMed rank (preempted pod) explains its peers' lost connections, not the reverse;
        # a symptom that names an infra cause beats one that names none (a collective timeout).
        root = min(secondary, key=lambda j: (j.rule.name != "sigterm", j.rule.kind == "unknown", j.order))
    else:
        root = judged[0]
    others = [j for j in judged if j is not root and j.rule is not None and j.rule is not root.rule]
    note = ""
    if others:
        seen: list[str] = []
        for j in others:
            tag = f"{j.label}: {j.rule.name}"
            if tag not in seen:
                seen.append(tag)
        note = f" [also {', '.join(seen[:3])}{', …' if len(seen) > 3 else ''}]"
    return root, note


def _has_gang_evidence(evidence: Mapping[str, Any]) -> bool:
    return any(v not in (None, "", [], {}) for k, v in evidence.items() if k not in {"rank", "step", "ranks", "context"})


def _rule_verdict(evidence: Mapping[str, Any]) -> tuple[Verdict, Evidence]:
    facts = Evidence.parse(evidence)
    if not facts.ranks:
        return _verdict(_judge(facts, "gang")), facts
    judged: list[_Judged] = []
    if _has_gang_evidence(evidence):
        judged.append(_judge(facts, "gang"))
    for i, entry in enumerate(facts.ranks[:MAX_ITEMS]):
        j = _judge(entry, f"rank entry {i}")
        if entry.rank is not None:
            j = _Judged(j.rule, j.hit, j.facts, f"rank {entry.rank}")
        elif j.hit is not None and j.hit.rank is not None:
            j = _Judged(j.rule, j.hit, j.facts, f"rank {j.hit.rank}")
        judged.append(j)
    root, note = _pick_root(judged)
    return _verdict(root, note), facts


def classify(
    evidence: Mapping[str, Any], *, precedents: bool = True, exclude_precedents: Collection[str] = ()
) -> Verdict:
    """Judge a failed gang's evidence (contract 4, docs/failures.md). Never raises on odd evidence.

    `precedents=False` gives the rule table's verdict alone (no corpus lookup);
    `exclude_precedents` leaves those corpus case ids out of the lookup (leave-one-out scoring).
    """
    if not isinstance(evidence, Mapping):
        return Verdict("unknown", True, f"unknown: evidence is a {type(evidence).__name__}, not an object")
    try:
        verdict, facts = _rule_verdict(evidence)
        # What the platform knows (same configuration passed before, the node, a recurrence)
        # weighs before the corpus's nearest cases do: it is about this job, they are not.
        verdict = weigh(verdict, facts, Context.parse(evidence.get("context")))
    except (RecursionError, MemoryError, ValueError, TypeError) as exc:  # bounded parsing makes these unexpected
        return Verdict("unknown", True, clip(f"unknown: unreadable evidence ({type(exc).__name__})"))
    if verdict.kind != "unknown" or not precedents:
        return verdict
    try:
        from operators.failures import precedent

        found = precedent.lookup(facts, exclude=exclude_precedents)
    except Exception:  # noqa: BLE001 - the precedent base is an aid: without it the verdict stays unknown
        found = None
    if found is not None and found.kind == "user" and any(c.startswith(AMBIGUOUS_NOTE) for c in verdict.context):
        # Similar public cases lean user, but the crash itself could be the node's: retried once.
        kind, _, rest = found.reason.partition(": ")
        found = replace(found, retryable=True, reason=clip(f"{kind} ({verdict.context[0]}): {rest}"), context=verdict.context)
    return found or verdict
