"""Goodput under injected failures at `checkpoint.every_steps: auto` against fixed intervals 4x
shorter and 4x longer. The last line printed is one JSON object; goal: `auto_minus_best_points`
>= -2 (auto within 2 points of goodput of the best of the three).

Two parts, in one run:

1. **Measured, real trainer** (`python -m trainer`, one rank, a private copy of the digits data, a
   larger MLP, `--model-hidden`/`--model-depth`, so that a save costs steps rather than
   microseconds): run H saves every 20 steps and gives the save cost C (median `blocked_s` of its
   `checkpoint` events; with `checkpoint.async_save=false`, the default here, the loop pays the whole
   save), the commit lag (`duration_s - blocked_s`), the step time (its 10-step windows) and the
   restart cost R (`first_step.startup_s`: launch to the end of the first step; the 10-step windows
   that hold no save give the step time). Run A is the
   trainer with `every_steps: auto` handed that history (`GANGFLOW_CHECKPOINT_HISTORY`: C, and the
   MTBF of the injected failures) and records the interval it chooses (its `checkpoint_interval`
   event): the code under test chooses the auto arm's interval, not this script. Run P is `auto`
   without history: its probe save's cost is reported beside C.
2. **Simulated failures** (a discrete-event simulation driven by those measurements): a long job
   of `--work-mtbfs` MTBFs of steps, failures a Poisson process in wall time with the injected MTBF,
   each failure losing the steps since the last *committed* checkpoint and costing R before the
   next step (failures during a restart restart it again). Every step time, save cost and commit
   lag is drawn from the measured ones. The three arms see the same failure times (common random
   numbers) over `--seeds` seeds. The auto arm behaves as the trainer does: no checkpoint before
   step PROBE_STEPS of each attempt, then one at every multiple of the chosen interval.

Why simulated: the comparison needs hundreds of failures per arm to separate intervals by a few
points of goodput, and a real restart (a new torch process) takes seconds here; three real arms
would take hours. What is simulated is only the arithmetic of loss and restart; every duration in
it was measured by the real trainer in the same run.

The injected MTBF defaults to 30 x the measured restart cost (`--mtbf-s` sets it): restarts then
take about 3% of the time, as minutes-long restarts on a cluster failing every few hours do.

    python benchmarks/checkpoint_interval.py [--seeds 20] [--mtbf-s S] [--async-save]   # ~1-3 min
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, ROOT, clean_env, events, note, summary  # noqa: E402

sys.path.insert(0, str(ROOT))
from trainer.checkpoint_interval import HISTORY_ENV, PROBE_STEPS, young_daly_s  # noqa: E402

WINDOW = 10  # train.log_every_steps: the step-time windows of metrics.jsonl


def run_trainer(run_dir: Path, data: Path, sets: list[str], args, env_extra: dict[str, str] | None = None) -> list[dict]:
    """One real single-rank trainer run; its metrics.jsonl records."""
    sets = [f"data.train_path={data / 'train.parquet'}", f"data.test_path={data / 'test.parquet'}",
            f"model.hidden={args.model_hidden}", f"model.depth={args.model_depth}", f"train.log_every_steps={WINDOW}",
            f"checkpoint.async_save={'true' if args.async_save else 'false'}", "checkpoint.keep_last=2",
            "tracking.progress_every_s=0", *sets]
    cmd = [PY, "-m", "trainer", "--run-dir", str(run_dir), "--config", str(ROOT / "params.yaml"),
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(**(env_extra or {})), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def measure(tmp: Path, data: Path, args) -> dict:
    """Run H: saves every 20 steps; C, commit lag, step time and restart cost from its own events."""
    records = run_trainer(tmp / "H", data, [f"train.max_steps={args.measure_steps}", f"checkpoint.every_steps={2 * WINDOW}"], args)
    saves = [r for r in records if r.get("event") == "checkpoint"]
    final = next(r for r in records if r.get("event") == "final")
    # A save at step 20k falls in the window after it (the window's clock restarts at the log line,
    # before the save): the windows ending at 20k hold steps only. The first holds the warm-up.
    windows = [final["global_batch"] / r["samples_per_sec"] for r in records
               if "samples_per_sec" in r and r["step"] % (2 * WINDOW) == 0 and r["step"] > 2 * WINDOW]
    first = next(r for r in records if r.get("event") == "first_step")
    return {"blocked_s": [s["blocked_s"] for s in saves], "lag_s": [max(0.0, s["duration_s"] - s["blocked_s"]) for s in saves],
            "bytes": saves[-1]["bytes"], "step_s": windows, "restart_s": first["startup_s"]}


def trainer_choice(tmp: Path, data: Path, args, *, cost_s: float, mtbf_s: float) -> dict:
    """Run A: the trainer's own choice for `auto`, given C and the MTBF as a pipeline's history."""
    history = {"cost_s": cost_s, "cost_source": "benchmark: median blocked_s of run H", "mtbf_s": mtbf_s,
               "mtbf_source": "benchmark: the injected failure rate"}
    records = run_trainer(tmp / "A", data, [f"train.max_steps={PROBE_STEPS + 5}", "checkpoint.every_steps=auto",
                                            "checkpoint.auto_max_steps=1000000"], args, {HISTORY_ENV: json.dumps(history)})
    return next(r for r in records if r.get("event") == "checkpoint_interval")


def probe_choice(tmp: Path, data: Path, args) -> dict:
    """Run P: `auto` with no history: the probe save's cost (reported beside run H's C)."""
    records = run_trainer(tmp / "P", data, [f"train.max_steps={PROBE_STEPS + 5}", "checkpoint.every_steps=auto"], args)
    return next(r for r in records if r.get("event") == "checkpoint_interval")


def simulate(every: int, *, total_steps: int, m: dict, mtbf_s: float, seed: int, probe_gap: bool) -> float:
    """Goodput of one arm: useful step time / wall time, failures from `seed` (shared by the arms)."""
    fail_rng, draw = random.Random(seed), random.Random(seed * 7919 + every)
    windows, blocked, lags, restart = m["step_s"], m["blocked_s"], m["lag_s"], m["restart_s"]
    t, next_fail = 0.0, fail_rng.expovariate(1.0 / mtbf_s)
    durable, durable_at_step_pending = 0, None  # committed step; (step, commit time) of a write in flight
    step, attempt_start = 0, 0

    def fail() -> None:
        nonlocal t, next_fail, step, attempt_start, durable_at_step_pending
        t = next_fail
        next_fail = t + fail_rng.expovariate(1.0 / mtbf_s)
        durable_at_step_pending = None  # a write in flight dies with the gang
        while next_fail < t + restart:  # a failure during the restart starts it again
            t = next_fail
            next_fail = t + fail_rng.expovariate(1.0 / mtbf_s)
        t += restart
        step = attempt_start = durable

    while step < total_steps:
        target = min(total_steps, (step // every + 1) * every)
        if probe_gap and target <= attempt_start + PROBE_STEPS:  # auto: nothing saved before the choice
            target = min(total_steps, ((attempt_start + PROBE_STEPS) // every + 1) * every)
        n = target - step
        # per-step times from the measured 10-step windows, a window at a time
        seg = WINDOW * sum(draw.choice(windows) for _ in range(n // WINDOW)) + (n % WINDOW) * draw.choice(windows)
        if durable_at_step_pending and durable_at_step_pending[1] <= t + seg and durable_at_step_pending[1] <= next_fail:
            durable = durable_at_step_pending[0]
            durable_at_step_pending = None
        if t + seg > next_fail:
            fail()
            continue
        t += seg
        step = target
        if step >= total_steps:
            break
        if durable_at_step_pending:  # the previous write is still going: the save waits for it
            t = max(t, durable_at_step_pending[1])
            durable = durable_at_step_pending[0]
            durable_at_step_pending = None
        cost = draw.choice(blocked)
        if t + cost > next_fail:
            fail()
            continue
        t += cost
        lag = draw.choice(lags)
        if lag <= 0:
            durable = step
        else:
            durable_at_step_pending = (step, t + lag)
    return total_steps * statistics.fmean(windows) / t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20, help="simulated jobs per arm, the same failures for every arm (default 20)")
    parser.add_argument("--mtbf-s", type=float, default=None, help="injected MTBF in seconds (default: 30 x the measured restart cost)")
    parser.add_argument("--work-mtbfs", type=float, default=100.0, help="useful work of a simulated job, in MTBFs (default 100)")
    parser.add_argument("--measure-steps", type=int, default=300, help="steps of run H (default 300)")
    parser.add_argument("--model-hidden", type=int, default=1024)
    parser.add_argument("--model-depth", type=int, default=4)
    parser.add_argument("--async-save", action="store_true", help="checkpoint.async_save=true: C is the snapshot, the write's lag is simulated")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (printed as `scratch`)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if not (ROOT / "data" / "digits" / "train.parquet").is_file():
        subprocess.run([PY, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True, capture_output=True)
    tmp = Path(tempfile.mkdtemp(prefix="gangflow-bench-ckpt-interval-"))
    try:
        data = tmp / "data"  # a private copy: nothing else in the tree can change it mid-run
        shutil.copytree(ROOT / "data" / "digits", data)
        note(f"run H: {args.measure_steps} steps of a {args.model_depth}x{args.model_hidden} MLP, a save every {2 * WINDOW} steps")
        m = measure(tmp, data, args)
        cost_s, step_s = statistics.median(m["blocked_s"]), statistics.fmean(m["step_s"])
        mtbf_s = args.mtbf_s or 30.0 * m["restart_s"]
        note(f"measured: C {cost_s:.4f} s ({len(m['blocked_s'])} saves of {m['bytes'] / 1e6:.1f} MB), step {step_s * 1e3:.2f} ms, "
             f"restart {m['restart_s']:.2f} s; injected MTBF {mtbf_s:.1f} s")
        chosen = trainer_choice(tmp, data, args, cost_s=cost_s, mtbf_s=mtbf_s)
        probe = probe_choice(tmp, data, args)
        auto = chosen["every_steps"]
        note(f"run A: the trainer chose every {auto} steps (Young/Daly {chosen['seconds']:.2f} s at {chosen['step_s'] * 1e3:.2f} ms/step); "
             f"run P's probe save cost {probe['cost_s']:.4f} s")
        arms = {"auto": auto, "shorter_4x": max(1, round(auto / 4)), "longer_4x": auto * 4}
        total_steps = int(args.work_mtbfs * mtbf_s / step_s)
        goodput: dict[str, list[float]] = {name: [] for name in arms}
        for seed in range(args.seeds):
            for name, every in arms.items():
                goodput[name].append(simulate(every, total_steps=total_steps, m=m, mtbf_s=mtbf_s, seed=seed,
                                              probe_gap=name == "auto"))
        pooled = {name: statistics.fmean(v) for name, v in goodput.items()}
        best = max(pooled, key=pooled.get)
        per_seed = [g_auto - max(goodput[n][i] for n in arms) for i, g_auto in enumerate(goodput["auto"])]
        result = {
            "benchmark": "checkpoint_interval",
            "method": "real trainer runs measure C, commit lag, step time and restart cost and choose the auto interval; "
                      "failures and their losses are simulated from those measurements",
            "measured": {"cost_s": round(cost_s, 5), "probe_cost_s": round(probe["cost_s"], 5),
                         "commit_lag_s": round(statistics.median(m["lag_s"]), 5), "checkpoint_bytes": m["bytes"],
                         "step_s": round(step_s, 6), "restart_s": m["restart_s"], "saves": len(m["blocked_s"])},
            "mtbf_s": round(mtbf_s, 3),
            "young_daly_s": round(young_daly_s(cost_s, mtbf_s), 4),
            "trainer_choice": {k: chosen[k] for k in ("every_steps", "seconds", "step_s", "bound", "cost_source", "mtbf_source")},
            "every_steps": arms,
            "goodput": {name: summary(v, 4) for name, v in goodput.items()},
            "goodput_pooled": {name: round(v, 4) for name, v in pooled.items()},
            "best_arm": best,
            "auto_minus_best_points_per_seed": summary([100 * d for d in per_seed], 3),
            "simulated": {"seeds": args.seeds, "steps_per_job": total_steps, "work_mtbfs": args.work_mtbfs,
                          "async_save": args.async_save, "model": f"mlp depth {args.model_depth} hidden {args.model_hidden}"},
            "goals": {"auto_minus_best_points": ">= -2"},
            "benchmark_seconds": round(time.monotonic() - started, 1),
            "auto_minus_best_points": round(100 * (pooled["auto"] - pooled[best]), 3),
        }
        if args.keep:
            result["scratch"] = str(tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"goodput at every {arms['shorter_4x']} / {arms['auto']} (auto) / {arms['longer_4x']} steps: "
          f"{pooled['shorter_4x']:.4f} / {pooled['auto']:.4f} / {pooled['longer_4x']:.4f}; "
          f"auto - best = {result['auto_minus_best_points']:+.2f} points (goal >= -2)", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
