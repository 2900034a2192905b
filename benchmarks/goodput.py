"""Goodput under an injected failure, as Airflow runs it. The last line printed is one JSON object.

Every arm is one real run of `train_pipeline` with `dag.test()` (`python -m operators.cli.demo
--conf ...`, what `make demo` runs) on one fresh state dir (SQLite Airflow DB, pool, DVC-published
dataset, MLflow); repetitions interleave the arms, rotating which goes first:

* U, uninterrupted: no fault; the training task succeeds on its first try.
* F0, faulted, no retry delay: `GANGFLOW_ALLOW_FAULTS=1 GANGFLOW_FAULT=<--fault>` (default
  `kill@step=90,rank=1`: SIGKILL of rank 1 after step 90, synchronised) and
  `GANGFLOW_RETRY_BASE_DELAY=0`. The try fails, the DAG's `ClassifiedRetryPolicy` classifies the
  failure (must say retry), Airflow puts the task up for retry, dag.test() runs the next try,
  which resumes from the last committed checkpoint. A fault fires once per run dir, so a DAG run
  has one failure.
* Fd, faulted, the DAG's real delay: the same with the retry delay the DAG configures
  (`pipeline.retry_base_delay_seconds`, `min(600, base * 2**(try-1))`: 5 s before the 2nd try).
  dag.test() polls once a second for a task whose retry time has come, as a scheduler loop would.

The tries' start and end come from Airflow's metadata DB (`task_instance_history` for the failed
try, `task_instance` for the last), the fault's firing time and step from its marker
(`DIR/faults/*.fired`), the resume step and time from the trainer's `resume` event.

Figures (medians over repetitions):

* `goodput_no_delay`, `goodput_real_delay`: U's training task time (TI end - start) / F's
  (first try's start -> last try's end).
* per failure (`failures`): `detection_s` (fault fired -> the failed try ended: torchrun notices
  the dead rank, tears the gang down, the task classifies the evidence and fails), `retry_wait_s`
  (failed try's end -> next try's start: the retry delay plus dag.test's pickup),
  `restart_s` (next try's start -> its trainer's `resume` event: MLflow lookup, launch, gang
  start-up, checkpoint load), `restart_cost_s` = the three, `lost_steps` (fired step - resumed
  step), `lost_seconds` (lost steps x U's seconds per step), and `extra_s` (F - U task time:
  everything the failure cost, measured directly).
* `young_daly`: the optimal checkpoint interval sqrt(2 * C * MTBF) for the measured checkpoint
  cost C (median `blocked_s` of U's checkpoint events: what the loop stops for; and, beside it,
  the median full write time `duration_s`) and the injected failure rate (one failure per U
  training loop: MTBF = U's loop seconds / failures), in seconds and in steps, against the
  configured `checkpoint.every_steps`.
* `final_weights_bitwise_equal`: every faulted run's final weights equal U's, tensor by tensor.

    python benchmarks/goodput.py [--reps 2] [--steps 300] [--every 50] [--fault kill@step=90,rank=1] [--no-real-delay]

About 2-3 minutes per DAG run on 2 shared cores (3 per repetition).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_env, events, note, run_demo, safetensors_digest, summary, utc_epoch  # noqa: E402
from pipeline import _LAUNCH, setup_state  # noqa: E402

DAG_ID = "train_pipeline"
DEFAULT_FAULT = "kill@step=90,rank=1"


def dag_env(home: Path, *, fault: str = "", delay: float | None = None) -> dict[str, str]:
    env = clean_env(GANGFLOW_HOME=str(home))
    if fault:
        env |= {"GANGFLOW_ALLOW_FAULTS": "1", "GANGFLOW_FAULT": fault}
    if delay is not None:
        env["GANGFLOW_RETRY_BASE_DELAY"] = str(delay)
    return env


def tries(home: Path, run_id: str, task_id: str) -> list[dict]:
    """Every try of the task, oldest first: history rows (earlier tries) + the current row."""
    rows = []
    with sqlite3.connect(home / "airflow" / "airflow.db") as db:
        for table in ("task_instance_history", "task_instance"):
            rows += db.execute(
                f"SELECT try_number, state, start_date, end_date FROM {table} WHERE dag_id = ? AND run_id = ? AND task_id = ?",  # noqa: S608
                (DAG_ID, run_id, task_id),
            ).fetchall()
    out = {n: {"try": n, "state": s, "start": utc_epoch(b), "end": utc_epoch(e)} for n, s, b, e in rows if b and e}
    return [out[n] for n in sorted(out)]


def dag_run(home: Path, conf: dict, env: dict[str, str], log: Path) -> dict:
    result, text, dag_wall = run_demo(conf, env, log, timeout=1800)
    task_id = f"train_local_{conf['world_size']}"
    launches = [m for m in map(_LAUNCH.match, text.splitlines()) if m]
    if not launches:
        raise RuntimeError(f"no 'launching gang' line in {log}")
    argv = shlex.split(launches[0].group(3))
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    ts = tries(home, result["dag_run_id"], task_id)
    return {"run_id": result["dag_run_id"], "tries": ts, "launches": [utc_epoch(m.group(1)) for m in launches],
            "run_dir": run_dir, "dag_wall_s": dag_wall, "train_attempts": result.get("train_attempts"),
            "task_s": ts[-1]["end"] - ts[0]["start"]}  # fmt: skip


def failure_figures(f: dict, step_s: float) -> list[dict]:
    out = []
    markers = sorted((f["run_dir"] / "faults").glob("*.fired"))
    fired = [json.loads(m.read_text()) for m in markers]
    resumes = events(f["run_dir"], "resume")
    for k, (failed, nxt) in enumerate(zip(f["tries"], f["tries"][1:])):
        mark = fired[k] if k < len(fired) else {}
        resume = resumes[k] if k < len(resumes) else {}
        lost = (mark["step"] - resume["step"]) if mark and resume else None
        row = {
            "failed_try": failed["try"], "failed_state": failed["state"], "fault": mark.get("fault"),
            "fired_at_step": mark.get("step"), "resumed_from_step": resume.get("step"),
            "detection_s": failed["end"] - mark["time"] if mark else None,
            "retry_wait_s": nxt["start"] - failed["end"],
            "restart_s": resume["time"] - nxt["start"] if resume else None,
            "lost_steps": lost, "lost_seconds": lost * step_s if lost is not None else None,
        }  # fmt: skip
        if None not in (row["detection_s"], row["restart_s"]):
            row["restart_cost_s"] = row["detection_s"] + row["retry_wait_s"] + row["restart_s"]
        out.append(row)
    return out


def young_daly(u_runs: list[dict], failures: int, every: int, steps: int) -> dict:
    ckpts = [e for u in u_runs for e in events(u["run_dir"], "checkpoint")]
    finals = [events(u["run_dir"], "final")[-1] for u in u_runs]
    train_s = statistics.median(f["train_s"] for f in finals)
    step_s = train_s / steps
    blocked = statistics.median(e.get("blocked_s", 0.0) for e in ckpts) if ckpts else None
    duration = statistics.median(e.get("duration_s", 0.0) for e in ckpts) if ckpts else None
    mtbf = train_s / max(1, failures)
    out = {"mtbf_s": round(mtbf, 3), "step_s": round(step_s, 5), "configured_interval_steps": every,
           "configured_interval_s": round(every * step_s, 4), "checkpoints_measured": len(ckpts)}  # fmt: skip
    for name, c in (("blocked", blocked), ("write", duration)):
        if c:
            t = math.sqrt(2 * c * mtbf)
            out[f"checkpoint_cost_{name}_s"] = round(c, 5)
            out[f"optimal_interval_{name}_s"] = round(t, 4)
            out[f"optimal_interval_{name}_steps"] = round(t / step_s, 1)
    out["note"] = ("T_opt = sqrt(2 * C * MTBF); C = checkpoint cost (blocked: the loop's stall per save; write: the "
                   "whole background write); MTBF = one injected failure per uninterrupted training loop")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2, help="interleaved repetitions of the arms (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="max_steps (default 300)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint_every_steps (default 50)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--fault", default=DEFAULT_FAULT, help=f"GANGFLOW_FAULT of the faulted runs (default {DEFAULT_FAULT!r})")
    parser.add_argument("--no-real-delay", dest="real_delay", action="store_false", help="skip the arm with the DAG's real retry delay")
    parser.add_argument("--keep", action="store_true", help="keep the state dir, logs and run dirs (printed as `home`)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="gangflow-bench-goodput-"))
    conf = {"world_size": args.world_size, "max_steps": args.steps, "checkpoint_every_steps": args.every, "promotion_floor": 0.0}
    arms = {"u": dag_env(home), "f0": dag_env(home, fault=args.fault, delay=0)}
    if args.real_delay:
        arms["fd"] = dag_env(home, fault=args.fault)  # the DAG's own pipeline.retry_base_delay_seconds
    try:
        note(f"setting up a fresh state dir {home} (Airflow DB, pool, dataset, MLflow)")
        setup_state(home)
        (home / "logs").mkdir()
        rows: dict[str, list[dict]] = {k: [] for k in arms}
        for i in range(args.reps):
            order = list(arms)[i % len(arms) :] + list(arms)[: i % len(arms)]
            for arm in order:
                r = dag_run(home, conf, arms[arm], home / "logs" / f"{arm}-{i}.log")
                if arm != "u" and len(r["tries"]) < 2:
                    raise RuntimeError(f"{arm}: the fault {args.fault!r} did not fail a try: {r['tries']}")
                rows[arm].append(r)
                note(f"rep {i + 1} {arm}: training task {r['task_s']:.2f}s over {len(r['tries'])} tries, dag.test {r['dag_wall_s']:.1f}s")

        u_digest = safetensors_digest(rows["u"][0]["run_dir"] / "final" / "model.safetensors")
        bitwise = all(safetensors_digest(r["run_dir"] / "final" / "model.safetensors") == u_digest for rs in rows.values() for r in rs)
        yd = young_daly(rows["u"], 1, args.every, args.steps)
        step_s = yd["step_s"]
        result: dict = {"benchmark": "goodput"}
        for arm, label in (("f0", "no_delay"), ("fd", "real_delay")):
            if arm not in rows:
                continue
            ratios = [u["task_s"] / f["task_s"] for u, f in zip(rows["u"], rows[arm])]
            fails = [failure_figures(f, step_s) for f in rows[arm]]
            flat = [x for fs in fails for x in fs]

            def med(key: str, flat=flat) -> float | None:
                vals = [x[key] for x in flat if x.get(key) is not None]
                return round(statistics.median(vals), 3) if vals else None

            result[f"goodput_{label}"] = round(statistics.median(ratios), 4)
            result[f"{label}"] = {
                "goodput_pairs": summary(ratios),
                "faulted_task_seconds": summary([f["task_s"] for f in rows[arm]], 2),
                "extra_s_per_failure": round(statistics.median(
                    (f["task_s"] - u["task_s"]) / max(1, len(f["tries"]) - 1) for u, f in zip(rows["u"], rows[arm])), 3),
                **{f"{k}_median": med(k) for k in ("detection_s", "retry_wait_s", "restart_s", "restart_cost_s",
                                                    "lost_steps", "lost_seconds")},
                "failures": [[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in x.items()} for x in fs] for fs in fails],
                "train_attempts": [f["train_attempts"] for f in rows[arm]],
            }  # fmt: skip
        lost = [x["lost_steps"] for arm in ("f0", "fd") if arm in rows for f in rows[arm] for x in failure_figures(f, step_s)]
        result |= {
            "uninterrupted_task_seconds": summary([u["task_s"] for u in rows["u"]], 2),
            "lost_steps_max": max(lost) if lost and None not in lost else None,
            "lost_steps_within_interval": bool(lost) and None not in lost and max(lost) <= args.every,
            "final_weights_bitwise_equal": bitwise,
            "young_daly": yd,
            "dag_test_seconds": {arm: summary([r["dag_wall_s"] for r in rs], 1) for arm, rs in rows.items()},
            "config": {**conf, "fault": args.fault, "reps": args.reps,
                       "retry_delays": {"no_delay": "GANGFLOW_RETRY_BASE_DELAY=0", "real_delay": "the DAG's pipeline.retry_base_delay_seconds"}},  # fmt: skip
            "goals": {"lost_steps_max": "<= checkpoint_every_steps", "final_weights_bitwise_equal": True},
            "benchmark_seconds": round(time.monotonic() - started, 1),
        }
        if args.keep:
            result["home"] = str(home)
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
