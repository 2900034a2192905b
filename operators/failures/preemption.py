"""Which ended gangs were preempted: the task re-launches those without spending a retry.

A preemption is not a failure of the gang: Kueue evicted its Workload (Preempted,
InactiveWorkload, PodsReadyTimeout), the pod got the `DisruptionTarget` condition (scheduler
preemption, a node drain, the taint manager), the cloud took the machine back, or the ranks
stopped on SIGTERM after committing a final checkpoint (exit 75). The classifier's verdict for
these stays `infra` (the corpus scores kinds); this module answers the separate question.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.storage import read_json_record

#: In a DAG run's run dir: its preemptions, across its tries (written by the training task).
PREEMPTIONS_FILE = "preemptions.json"

#: Kueue's eviction reasons that end a gang through no fault of its own (docs/kubernetes.md).
KUEUE_EVICTIONS = frozenset({"Preempted", "InactiveWorkload", "PodsReadyTimeout"})
#: Rules of the table whose `infra` verdict means the gang was preempted.
PREEMPTION_RULES = frozenset({"k8s-preempted", "k8s-disruption", "cloud-preemption", "trainer-preempted-exit"})


def preemption_reason(evidence: Mapping[str, Any]) -> str | None:
    """Why the gang was preempted (one line), or None when its end was a failure."""
    if not isinstance(evidence, Mapping):
        return None
    for cond in evidence.get("pod_conditions") or ():
        if isinstance(cond, Mapping) and cond.get("type") == "Evicted" and cond.get("reason") in KUEUE_EVICTIONS:
            message = str(cond.get("message") or "").strip()
            return f"Kueue evicted the Workload ({cond['reason']})" + (f": {message}" if message else "")
    from operators.failures.ranks import classify

    verdict = classify(evidence, precedents=False)
    if verdict.kind == "infra" and verdict.rule in PREEMPTION_RULES:
        return verdict.reason
    return None


def recorded_preemptions(run_dir: str | Path) -> list[str]:
    """The reasons of the preemptions a DAG run's run dir recorded (PREEMPTIONS_FILE); [] if none."""
    reasons = read_json_record(Path(run_dir) / PREEMPTIONS_FILE).get("reasons")
    return [str(r) for r in reasons] if isinstance(reasons, list) else []
