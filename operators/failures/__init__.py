"""The failure classifier: why did a training gang fail, and is it worth another try?

`classify(evidence) -> Verdict` reads what the backend collected when a gang failed (contract 4
in docs/failures.md) and says `infra` (retry: the cluster, a node, the network or storage broke),
`user` (fail now: the code, config, data or resource request is wrong and a retry would repeat
it) or `unknown` (nothing decided; `operators.retry.ClassifiedRetryPolicy` retries it once per
task, then treats it as user). The same verdict is printed as JSON by

    python -m operators.failures < evidence.json

The package:

* `evidence`: typed `Evidence`, parsed tolerantly and with bounded sizes (classify never raises);
* `catalogue`: the one catalogue of transient conditions (errno values, exception types, cloud
  error codes, HTTP status classes, NCCL/gloo/CUDA errors), shared with the retry policy, the
  dataset fetch, tracking, the Kubernetes client and the trainer;
* `rules`: the rule table, in precedence order (Kubernetes, container runtime, trainer,
  exception, infrastructure log patterns, exit code);
* `ranks`: each rank judged alone, then the root cause chosen across ranks;
* `precedent`: when no rule speaks, the nearest cases of the public corpus (`corpus/`) decide
  above a similarity threshold;
* `cli`: the command line.
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
