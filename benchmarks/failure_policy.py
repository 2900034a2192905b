"""Replays failure sequences through the retry policy (issue 28, item 7; docs/failures.md).

    python benchmarks/failure_policy.py [--retries 3]

Each train/dev corpus case becomes a task with `retries` retries: a user bug fails the same way
on every try (its evidence recurs), an infra fault fails once and the retry succeeds. The real
`ClassifiedRetryPolicy` decides each try from the real classifier's verdict (precedents leave
the case itself out). Against an oracle that retries exactly the infra faults, it counts:

* wasted attempts: tries spent re-running a user bug (the oracle: 0);
* lost runs: infra faults failed without a retry (the oracle: 0).

Policies, side by side in one run:
* `evidence-only`: the verdict's kind alone (infra retried, unknown once, user never): before item 7;
* `ambiguous-once`: as shipped without history: an ambiguous crash (user but retryable) is
  retried once, the recurrence (and the unknown budget) stops a deterministic one;
* `with-history`: as shipped, with the context the operator passes when the same pipeline has
  run before: an infra fault's configuration passed the failing step in an earlier run; a user
  bug's (new code, config or data: a new identity) never ran before and failed before progress.
  Its context is drawn from the label, so it is the ceiling context can reach, not a measurement.
The last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airflow.sdk import RetryAction  # noqa: E402

from operators.exceptions import InfraFailure, UnknownFailure, UserFailure  # noqa: E402
from operators.failures import classify  # noqa: E402
from operators.failures.cases import load_cases, load_split  # noqa: E402
from operators.failures.verdict import Verdict  # noqa: E402
from operators.retry import ClassifiedRetryPolicy  # noqa: E402

FAILURES = {"infra": InfraFailure, "user": UserFailure, "unknown": UnknownFailure}


class _Ti:
    def __init__(self, task_id: str, try_number: int):
        self.dag_id, self.task_id, self.map_index, self.try_number = "replay", task_id, -1, try_number


def _context(task_id: str, try_number: int) -> dict:
    return {"ti": _Ti(task_id, try_number), "run_id": "replay__1"}


def verdict_for(case, policy: str, try_number: int) -> Verdict:
    evidence = dict(case.evidence)
    if policy == "with-history":
        if case.label == "infra":
            evidence.update(step=evidence.get("step") or 100, context={"history_checked": True, "passed_step": 10_000})
        else:
            evidence.update(step=0, context={"history_checked": True, "passed_step": None, "steps_since_resume": 0,
                                             "recurrences": try_number - 1})  # fmt: skip
    elif policy == "ambiguous-once" and try_number > 1:
        evidence["context"] = {"recurrences": try_number - 1}  # the retry ledger's record of this signature
    verdict = classify(evidence, exclude_precedents={case.id})
    if policy == "evidence-only" and verdict.kind == "user":
        verdict = Verdict("user", False, verdict.reason, rule=verdict.rule)  # no ambiguous-crash retry
    return verdict


def replay(cases, policy: str, retries: int) -> dict:
    decider = ClassifiedRetryPolicy(base_delay=__import__("datetime").timedelta(0))
    wasted = lost = tries_total = 0
    for case in cases:
        task = f"{policy}.{case.id}"[:200].replace("/", "_")
        for try_number in range(1, retries + 2):
            tries_total += 1
            verdict = verdict_for(case, policy, try_number)
            failure = FAILURES[verdict.kind](verdict, evidence=case.evidence, attempt=try_number)
            decision = decider.evaluate(failure, try_number=try_number, max_tries=retries, context=_context(task, try_number))
            if decision.action is not RetryAction.RETRY:
                if case.label == "infra":
                    lost += 1  # an infra fault failed without the retry that would have succeeded
                break
            if case.label == "infra":
                tries_total += 1  # the retry of an infra fault succeeds
                break
            wasted += 1  # a user bug re-run: it fails again
    users = sum(1 for c in cases if c.label == "user")
    infras = len(cases) - users
    return {"wasted_attempts": wasted, "lost_runs": lost, "user_bugs": users, "infra_faults": infras, "tries": tries_total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--retries", type=int, default=3)
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)  # one decision log line per replayed try would drown the table
    split = load_split()
    cases = load_cases([*split.files("train"), *split.files("dev")])
    results = {}
    with tempfile.TemporaryDirectory() as home:
        os.environ["GANGFLOW_HOME"] = home  # the retry ledger of the replayed tasks
        for policy in ("evidence-only", "ambiguous-once", "with-history"):
            results[policy] = replay(cases, policy, args.retries)
            r = results[policy]
            print(f"{policy:15} wasted attempts {r['wasted_attempts']:4} (of {r['user_bugs']} user bugs)   "
                  f"lost runs {r['lost_runs']:4} (of {r['infra_faults']} infra faults)   tries {r['tries']}",
                  file=sys.stderr)  # fmt: skip
    users, infras = results["evidence-only"]["user_bugs"], results["evidence-only"]["infra_faults"]
    print(f"{'oracle':15} wasted attempts    0 (of {users} user bugs)   lost runs    0 (of {infras} infra faults)   "
          f"tries {users + 2 * infras}", file=sys.stderr)  # fmt: skip
    print(json.dumps({"retries": args.retries, "cases": len(cases), **results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
