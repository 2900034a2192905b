"""The failure classifier: why did a training gang fail, and is it worth another try?

`classify(evidence) -> Verdict` (contract 4, docs/contracts.md) says `infra` (retry), `user` (fail
now) or `unknown`; `python -m operators.failures < evidence.json` prints it as JSON. Modules:
`evidence`, `rules` (the rule table), `ranks` (the root cause across ranks), `precedent` (the corpus
decides when no rule speaks), `cases` (the corpus), `cli`; transient conditions: trainer.failure_catalogue.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from operators.failures.evidence import Evidence
    from operators.failures.ranks import classify
    from operators.failures.rules import RULES, Rule
    from operators.failures.verdict import KINDS, Verdict

__all__ = ["KINDS", "RULES", "Evidence", "Rule", "Verdict", "classify", "main"]

# Loaded on first use: `trainer.failure_catalogue` alone (the retry policy, the dataset
# fetch, tracking) must not compile the whole rule table, e.g. while Airflow parses a DAG.
_LAZY = {
    "Evidence": "evidence", "classify": "ranks", "RULES": "rules", "Rule": "rules", "KINDS": "verdict",
    "Verdict": "verdict",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"operators.failures.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'operators.failures' has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """`python -m operators.failures [FILE] < evidence.json`: print the verdict as JSON."""
    from operators.failures.cli import main as cli_main

    return cli_main(argv)
