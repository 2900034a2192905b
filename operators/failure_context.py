"""What the platform knows about a failed gang beyond its evidence (contract 4's `context`).

Gathered by the training operator when a gang fails and passed to the classifier as data
(`operators.failures.context` weighs it; layer 1 imports no client):

* `passed_step`: the furthest step an earlier MLflow run of the same code+config+data reached
  (runs tagged with the same `gangflow.training_identity`, their `gangflow.reached_step`);
* `steps_since_resume`: the steps this try made before failing;
* `node`, `node_failures`: other gangs' failures on the same node in the last hour (a ledger in
  the state dir, written here);
* `recurrences`: earlier tries of this task that failed with the same signature (the retry ledger).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from operators.config import settings
from trainer.storage import read_json_record
from trainer.checks import is_integer

__all__ = ["IDENTITY_TAG", "REACHED_STEP_TAG", "failed_step", "gather", "node_failures", "passed_step", "record_node_failure",
           "training_identity"]  # fmt: skip

log = logging.getLogger("gangflow.failures")
IDENTITY_TAG = "gangflow.training_identity"
REACHED_STEP_TAG = "gangflow.reached_step"
NODE_WINDOW_S = 3600.0
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")  # a hostname or Kubernetes node name


def training_identity(*, config_bytes: bytes, overrides: Iterable[str], dataset_version: str | None, code: str) -> str:
    """sha256 of what decides a run's steps: the trainer config, its overrides, the data, the code."""
    payload = json.dumps({"config": hashlib.sha256(config_bytes).hexdigest(), "overrides": sorted(overrides),
                          "data": dataset_version, "code": code}, sort_keys=True)  # fmt: skip
    return hashlib.sha256(payload.encode()).hexdigest()


def passed_step(client: Any, experiment_id: str, identity: str, *, exclude_run: str | None = None) -> tuple[int | None, str]:
    """(the furthest step, its run id) among earlier runs of the same identity; (None, "") if none."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{IDENTITY_TAG}` = '{identity}'", max_results=500)
    best: tuple[int | None, str] = (None, "")
    for run in runs:
        if run.info.run_id == exclude_run:
            continue
        raw = run.data.tags.get(REACHED_STEP_TAG, "")
        if raw.isdigit() and (best[0] is None or int(raw) > best[0]):
            best = (int(raw), run.info.run_id)
    return best


def _node_ledger(node: str) -> Path | None:
    if not _NODE_NAME.fullmatch(node):
        return None  # a name from evidence becomes a file name only when it is a plain node name
    return settings.state_dir() / "node-failures" / f"{node}.json"


def _read(path: Path) -> list[dict]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def node_failures(node: str, *, gang: str, now: float | None = None, window_s: float = NODE_WINDOW_S) -> int:
    """How many failures of other gangs this node saw in the last `window_s` seconds."""
    path = _node_ledger(node)
    if path is None:
        return 0
    now = time.time() if now is None else now
    return sum(1 for e in _read(path) if e.get("gang") != gang and isinstance(e.get("at"), (int, float))
               and now - window_s <= e["at"] <= now)  # fmt: skip


def record_node_failure(node: str, *, gang: str, kind: str, now: float | None = None, window_s: float = NODE_WINDOW_S) -> None:
    """Add this gang's failure to the node's ledger (entries older than the window are dropped)."""
    path = _node_ledger(node)
    if path is None:
        return
    from trainer.storage import write_json

    now = time.time() if now is None else now
    entries = [e for e in _read(path) if isinstance(e.get("at"), (int, float)) and e["at"] >= now - window_s]
    entries.append({"gang": gang, "kind": kind, "at": now})
    try:
        write_json(path, entries[-1000:])
    except OSError as exc:
        log.warning("gangflow: cannot record the failure on node %s in %s: %s", node, path, exc)


def nodes_to_avoid(run_dir: str | Path, attempt: int) -> tuple[str, ...]:
    """The nodes the verdicts of this run's earlier tries named (`exclude_nodes` in
    `failures/try-N.json`, N < attempt), oldest first, each once."""
    nodes: list[str] = []
    for earlier in range(1, attempt):
        record = read_json_record(Path(run_dir) / "failures" / f"try-{earlier}.json")
        verdict = record.get("verdict") if isinstance(record.get("verdict"), dict) else {}
        named = verdict.get("exclude_nodes") if isinstance(verdict.get("exclude_nodes"), list) else []
        nodes += [n for n in named if isinstance(n, str) and _NODE_NAME.fullmatch(n) and n not in nodes]
    return tuple(nodes)


def failed_step(evidence: Mapping[str, Any]) -> int | None:
    """The furthest step any rank was at when the gang failed (the evidence's `step`s)."""
    steps = [evidence.get("step"), *(r.get("step") for r in evidence.get("ranks") or [] if isinstance(r, Mapping))]
    known = [s for s in steps if is_integer(s) and s >= 0]
    return max(known) if known else None


def gather(
    evidence: Mapping[str, Any],
    *,
    gang: str,
    node: str = "",
    resumed_from_step: int | None = None,
    history: tuple[int | None, str] | None = None,
    recurrences: int = 0,
    oom_kills: int | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Contract 4's `context` for this failure. `history` is `passed_step(...)`'s answer, or None
    when it could not be looked up (then nothing is claimed about the configuration's past);
    `oom_kills` the kernel's OOM kills while the gang ran, None when the backend did not count."""
    context: dict[str, Any] = {"recurrences": recurrences}
    if oom_kills is not None:
        context["oom_kills"] = oom_kills
    if history is not None:
        context.update(history_checked=True, passed_step=history[0], passed_run=history[1])
    step = failed_step(evidence)
    if step is not None:
        context["steps_since_resume"] = max(0, step - (resumed_from_step or 0))
    if node:
        context.update(node=node, node_failures=node_failures(node, gang=gang, now=now))
    return context
