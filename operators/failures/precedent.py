"""Verdict by precedent: when no rule speaks, the nearest corpus cases by text similarity decide.

Filled in once the corpus split exists (issue 10, item 4); until then there is no precedent.
"""

from __future__ import annotations

from operators.failures.evidence import Evidence
from operators.failures.verdict import Verdict


def lookup(evidence: Evidence) -> Verdict | None:
    return None
