"""Goodput under injected failures, measured side by side. The last line printed is one JSON object.

Each repetition runs, interleaved (U F U F ...), with fresh run dirs and the same config:

* U, the uninterrupted run: one `LocalBackend.run` of the gang (torchrun `--max-restarts 0`,
  exactly what the Airflow training task runs per try), no fault;
* F, the faulted run: successive attempts on ONE run dir, as Airflow retries the task: attempt k
  gets its own `GANGFLOW_FAULT` (default `kill@step=90,rank=1`, `kill@step=170,rank=0`,
  `kill@step=245,rank=1`: SIGKILL of one rank, at different steps, on different ranks), each
  failure goes through the failure classifier (`operators.failures.classify`, which must call it
  infra/retryable, as the retry policy requires), the next attempt resumes from the last
  committed checkpoint; the last attempt runs without a fault. At most `pipeline.retries + 1`
  attempts (the DAG's retry budget). Attempts run back to back: Airflow's retry delay is not
  included (see `goodput_with_retry_delays`).

Reported:

* `goodput`: median over pairs of U's wall time / F's total wall time (sum of its attempts'
  `LocalBackend.run` wall times). Both sides include process start-up, so 1.0 means the
  failures cost nothing; the rest is lost steps plus one start-up (rendezvous, torch import,
  checkpoint load) per failure.
* `step_goodput`: useful step time over wall time: U's training-loop time for all steps
  (`train_s` of its `final` event: every step survives into the final model exactly once) / F's
  total wall time; `uninterrupted_step_goodput` is the same over U's own wall time (start-up
  dominates small runs, so read it as the ceiling).
* `lost_steps_per_failure`: per failure, steps computed after the last committed checkpoint and
  redone: the step the fault fired at (its marker in `DIR/faults/`) minus the step the next
  attempt resumed from (`gangflow: resuming from checkpoint step-N`). Goal: never more than
  `checkpoint_every_steps`.
* `final_weights_bitwise_equal`: F's `final/model.safetensors` tensors equal U's byte for byte
  (same seed and world size), for every pair.

Usage: `python benchmarks/goodput.py [--reps 3] [--steps 300] [--every 50] [--faults "kill@step=90,rank=1;..."]`
(about 3-6 minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, ROOT, events, note, safetensors_digest, sha256_file, summary, warm_up  # noqa: E402

DEFAULT_FAULTS = "kill@step=90,rank=1;kill@step=170,rank=0;kill@step=245,rank=1"


def prepare_environment(scratch: Path) -> None:
    """The backend passes os.environ to torchrun: make it the same, clean one for both sides."""
    for key in [k for k in os.environ if k.startswith(("AIRFLOW", "MLFLOW", "GANGFLOW"))]:
        del os.environ[key]
    os.environ |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "AIRFLOW_HOME": str(scratch / "airflow"),
                   "GANGFLOW_HOME": str(scratch / "state")}  # fmt: skip
    os.chdir(ROOT)  # the params file's relative data paths


def ensure_data() -> None:
    if not all((ROOT / "data" / "digits" / f).is_file() for f in ("train.parquet", "test.parquet")):
        note("data/digits missing: running data/prepare.py")
        subprocess.run([PY, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True)


class Runner:
    def __init__(self, *, world_size: int, steps: int, every: int, scratch: Path, max_attempts: int):
        from operators.backends.local import LocalBackend

        self.backend = LocalBackend()
        self.world_size = world_size
        self.steps = steps
        self.every = every
        self.scratch = scratch
        self.max_attempts = max_attempts
        self.overrides = (f"train.max_steps={steps}", f"checkpoint.every_steps={every}")

    def attempt(self, name: str, run_dir: Path, attempt: int, fault: str) -> dict:
        from operators.backends.base import GangSpec

        spec = GangSpec(
            name=name, run_dir=str(run_dir), world_size=self.world_size, config_path=str(ROOT / "params.yaml"),
            overrides=self.overrides, env={"GANGFLOW_FAULT": fault, "GANGFLOW_TRY_NUMBER": str(attempt)}, attempt=attempt,
        )  # fmt: skip
        self.backend.check_capacity(spec)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.scratch / f"{name}-try-{attempt}.log", "w") as log:
            t0 = time.time()
            result = self.backend.run(spec, lambda line: print(line, file=log))
            wall = time.time() - t0
        return {"attempt": attempt, "fault": fault or None, "wall_s": wall, "succeeded": result.succeeded,
                "exit_code": result.exit_code, "resumed_from_step": result.resumed_from_step,
                "evidence": result.evidence}  # fmt: skip

    def uninterrupted(self, i: int) -> dict:
        run_dir = self.scratch / f"uninterrupted-{i}"
        r = self.attempt(f"goodput-u{i}", run_dir, 1, "")
        if not r["succeeded"]:
            raise RuntimeError(f"uninterrupted run failed: exit {r['exit_code']}; see {self.scratch}")
        final = events(run_dir, "final")[-1]
        return {"wall_s": r["wall_s"], "train_s": final["train_s"], "run_dir": run_dir}

    def faulted(self, i: int, faults: list[str]) -> dict:
        from operators.failures import classify

        run_dir = self.scratch / f"faulted-{i}"
        attempts = []
        while True:
            n = len(attempts) + 1
            r = self.attempt(f"goodput-f{i}", run_dir, n, faults[n - 1] if n <= len(faults) else "")
            attempts.append(r)
            if r["succeeded"]:
                break
            verdict = classify(r["evidence"])
            r["verdict"] = verdict.to_dict()
            if not verdict.retryable:
                raise RuntimeError(f"attempt {n} failed and the classifier says not retryable: {verdict.to_dict()}")
            if n >= self.max_attempts:
                raise RuntimeError(f"attempt {n} failed and the retry budget ({self.max_attempts} attempts) is spent")
        failures = []
        for prev, nxt in zip(attempts, attempts[1:]):
            fired = _fired_step(run_dir, prev["fault"])
            resumed = nxt["resumed_from_step"] or 0
            failures.append({
                "attempt": prev["attempt"], "fault": prev["fault"], "fired_at_step": fired,
                "root_cause": {k: prev["evidence"].get(k) for k in ("rank", "exit_code", "signal")},
                "ranks": [{k: r.get(k) for k in ("rank", "exit_code", "signal") if r.get(k) is not None}
                          for r in prev["evidence"].get("ranks", [])],
                "verdict": prev["verdict"]["kind"], "next_attempt_resumed_from": resumed,
                "lost_steps": None if fired is None else fired - resumed,
            })  # fmt: skip
        return {"wall_s": sum(a["wall_s"] for a in attempts), "attempt_wall_s": [round(a["wall_s"], 2) for a in attempts],
                "attempts": len(attempts), "failures": failures, "run_dir": run_dir,
                "resume_events": [e["step"] for e in events(run_dir, "resume")]}  # fmt: skip


def _fired_step(run_dir: Path, fault: str | None) -> int | None:
    if not fault:
        return None
    marker = run_dir / "faults" / f"{fault.replace(',', '_')}.fired"
    try:
        return int(json.loads(marker.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


def retry_delays(failures: int) -> float:
    """Airflow's waits before the retries, per ClassifiedRetryPolicy as the DAG configures it:
    min(600 s, base * 2 ** (try - 1)) with base = pipeline.retry_base_delay_seconds."""
    from operators.pipeline import defaults

    base = defaults().retry_base_delay_s
    return sum(min(600.0, base * 2 ** (k - 1)) for k in range(1, failures + 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved uninterrupted/faulted pairs (default 3)")
    parser.add_argument("--steps", type=int, default=300, help="train.max_steps (default 300)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint.every_steps (default 50)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--faults", default=DEFAULT_FAULTS, help=f"';'-separated GANGFLOW_FAULT specs, one per attempt (default {DEFAULT_FAULTS!r})")
    parser.add_argument("--keep", action="store_true", help="keep run dirs and logs (printed as `scratch`)")
    args = parser.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(";") if f.strip()]

    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="gangflow-bench-goodput-"))
    prepare_environment(scratch)
    ensure_data()
    from operators.pipeline import defaults

    max_attempts = defaults().retries + 1
    if len(faults) >= max_attempts:
        parser.error(f"{len(faults)} faults need {len(faults) + 1} attempts; the DAG allows {max_attempts} (pipeline.retries + 1)")
    runner = Runner(world_size=args.world_size, steps=args.steps, every=args.every, scratch=scratch, max_attempts=max_attempts)
    try:
        warm_up(scratch, args.world_size)
        pairs = []
        for i in range(args.reps):
            order = ("u", "f") if i % 2 == 0 else ("f", "u")  # alternate, so load drift hits both sides
            got = {}
            for side in order:
                if side == "u":
                    got["u"] = runner.uninterrupted(i)
                    note(f"rep {i + 1}: uninterrupted {got['u']['wall_s']:.2f}s (loop {got['u']['train_s']:.2f}s)")
                else:
                    got["f"] = runner.faulted(i, faults)
                    lost = [f["lost_steps"] for f in got["f"]["failures"]]
                    note(f"rep {i + 1}: faulted {got['f']['wall_s']:.2f}s over {got['f']['attempts']} attempts "
                         f"{got['f']['attempt_wall_s']}, lost steps {lost}")  # fmt: skip
            u, f = got["u"], got["f"]
            u_final, f_final = u["run_dir"] / "final" / "model.safetensors", f["run_dir"] / "final" / "model.safetensors"
            got["bitwise"] = safetensors_digest(u_final) == safetensors_digest(f_final)
            got["file_identical"] = sha256_file(u_final) == sha256_file(f_final)
            pairs.append(got)

        lost = [x["lost_steps"] for p in pairs for x in p["f"]["failures"]]
        n_fail = len(pairs[0]["f"]["failures"])
        delays = retry_delays(n_fail)
        ratios = [p["u"]["wall_s"] / p["f"]["wall_s"] for p in pairs]
        result = {
            "benchmark": "goodput",
            "goodput": round(statistics.median(ratios), 4),
            "goodput_pairs": summary(ratios),
            "step_goodput": round(statistics.median(p["u"]["train_s"] / p["f"]["wall_s"] for p in pairs), 4),
            "uninterrupted_step_goodput": round(statistics.median(p["u"]["train_s"] / p["u"]["wall_s"] for p in pairs), 4),
            "goodput_with_retry_delays": round(statistics.median(p["u"]["wall_s"] / (p["f"]["wall_s"] + delays) for p in pairs), 4),
            "airflow_retry_delays_s": delays,
            "lost_steps_per_failure": pairs[0]["f"]["failures"] and [x["lost_steps"] for x in pairs[0]["f"]["failures"]],
            "lost_steps_max": max(lost) if None not in lost else None,
            "lost_steps_mean": round(statistics.mean(lost), 2) if None not in lost else None,
            "lost_steps_within_interval": None not in lost and max(lost) <= args.every,
            "checkpoint_every_steps": args.every,
            "failures": n_fail,
            "attempts": pairs[0]["f"]["attempts"],
            "final_weights_bitwise_equal": all(p["bitwise"] for p in pairs),
            "final_weights_file_identical": all(p["file_identical"] for p in pairs),
            "lost_steps_seconds_per_failure": round(statistics.mean(lost) * statistics.median(
                p["u"]["train_s"] / args.steps for p in pairs), 3) if None not in lost else None,
            "restart_cost_s_per_failure": round(statistics.median(
                (p["f"]["wall_s"] - p["u"]["wall_s"]) / max(1, len(p["f"]["failures"])) for p in pairs), 2),
            "uninterrupted_seconds": summary([p["u"]["wall_s"] for p in pairs], 2),
            "faulted_seconds": summary([p["f"]["wall_s"] for p in pairs], 2),
            "uninterrupted_train_loop_seconds": summary([p["u"]["train_s"] for p in pairs], 3),
            "runs": [{"uninterrupted_s": round(p["u"]["wall_s"], 2), "faulted_s": round(p["f"]["wall_s"], 2),
                      "attempt_wall_s": p["f"]["attempt_wall_s"], "resume_events": p["f"]["resume_events"],
                      "failures": p["f"]["failures"], "bitwise_equal": p["bitwise"]} for p in pairs],  # fmt: skip
            "config": {"world_size": args.world_size, "max_steps": args.steps, "checkpoint_every_steps": args.every,
                       "faults": faults, "pairs": args.reps, "launcher": "operators.backends.local.LocalBackend.run "
                       "(torchrun --standalone --max-restarts 0), the Airflow training task's launch path"},  # fmt: skip
            "definitions": {
                "goodput": "uninterrupted run's wall time / faulted run's total wall time over all attempts (both via "
                "LocalBackend.run, start-up included; attempts back to back, no Airflow retry delay); median over interleaved pairs",
                "step_goodput": "uninterrupted run's training-loop time for all max_steps steps (final event train_s; each step "
                "survives into the final model once) / faulted run's total wall time",
                "goodput_with_retry_delays": "goodput with Airflow's retry waits added to the faulted side "
                "(ClassifiedRetryPolicy backoff min(600, base * 2**(try-1)), base = pipeline.retry_base_delay_seconds)",
                "lost_steps": "per failure: step the fault fired at (DIR/faults marker) - step the next attempt resumed from",
                "restart_cost_s_per_failure": "median over pairs of (faulted wall - uninterrupted wall) / failures: a gang "
                "start-up (torchrun, rank start-up, checkpoint load) plus the lost steps, per failure",
                "lost_steps_seconds_per_failure": "mean lost steps x the uninterrupted run's loop time per step: the part of "
                "the restart cost that checkpointing more often would save",
            },
            "goals": {"lost_steps_max": "<= checkpoint_every_steps", "final_weights_bitwise_equal": True},
            "benchmark_seconds": round(time.monotonic() - started, 1),
        }
        if args.keep:
            result["scratch"] = str(scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
