"""One promote task in a process of its own, for the champion race test (tests/system/operators/test_promotion_race.py).

Both racers wait at a barrier once they have decided (so each decided against the same old
champion), then move the alias; the slower one's alias write is made slower still, so without a
compare-and-set the LAST write (the worse model's) would win.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace


def promote(args: dict, barrier, out) -> None:
    os.environ["GANGFLOW_HOME"] = args["home"]
    os.environ["GANGFLOW_ALLOWED_MODELS"] = args["allowed"]
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the store: the state dir's SQLite, or args["tracking_uri"]
    from operators import promotion
    from operators.registry import versions as registry

    record, set_alias = registry.record_decision, registry.promote
    first = [True]

    def record_then_wait(*a, **kw):
        tags = record(*a, **kw)
        if first[0]:  # both racers have decided against the same champion
            first[0] = False
            barrier.wait(timeout=120)
            time.sleep(args["start_delay_s"])
        return tags

    def slow_set_alias(*a, **kw):
        time.sleep(args["set_delay_s"])  # the window between reading the alias and writing it
        return set_alias(*a, **kw)

    promotion.record_decision = record_then_wait
    registry.promote = slow_set_alias
    if hasattr(promotion, "promote"):  # a promote task that sets the alias directly
        promotion.promote = slow_set_alias
    op = promotion.PromoteModelOperator(
        task_id="promote", model_name=args["name"], model_uri=args["model_uri"], dataset=args["dataset"],
        mlflow_run_id=args["run_id"], candidate_metrics=args["metrics"], floor=0.5,
        tracking_uri=args.get("tracking_uri"),
    )
    ti = SimpleNamespace(dag_id="gangflow_train", run_id=args["label"], try_number=1)
    try:
        result = op.execute({"ti": ti, "run_id": args["label"]})
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}"}
    out.put((args["label"], json.dumps(result)))
