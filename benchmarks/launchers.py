"""What the other control approaches cost, side by side in one run (issue 24.6). The last line
printed is one JSON object.

Three arms per repetition, interleaved (rotating which goes first), each the training task's own
launch path at demo size (params.yaml: 600 steps, 2 ranks, the digits data) on a fresh run dir:

* `local_task`: `LocalBackend.run` with launcher torchrun (its default, `trainer.launch`: torchrun's
  agent, ranks forked from one warm interpreter);
* `mpirun_task`: `LocalBackend.run` with launcher mpirun (Open MPI; a fresh `python -m trainer` per rank);
* `ray_task`: `RayBackend.run` (a driver process starts a local Ray cluster, Ray Train's
  TorchTrainer starts 2 workers, each runs the trainer's main; the cluster stops with the driver).

Per arm: `*_s` launch (the `run` call) to return, `*_first_step_s` launch to rank 0's first
step (the trainer's `first_step` event time in metrics.jsonl). Ratios (median of per-repetition
ratios): `ray_task_over_local_task`, `mpirun_over_torchrun` (the mpirun task over the local
torchrun task), and the same for launch-to-first-step.

    python benchmarks/launchers.py [--reps 1] [--steps 600]    # about 2-5 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from operators.backends.base import GangSpec  # noqa: E402
from operators.backends.local import LocalBackend  # noqa: E402
from operators.backends.ray import RayBackend  # noqa: E402


def first_step_time(run_dir: Path) -> float | None:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "first_step":
            return float(record["time"])
    return None


def arm(name: str, work: Path, steps: int) -> dict:
    run_dir = work / name
    launcher = "mpirun" if name == "mpirun_task" else "torchrun"
    spec = GangSpec(name="bench", run_dir=str(run_dir), world_size=2, config_path=str(ROOT / "params.yaml"),
                    overrides=(f"train.max_steps={steps}",), launcher=launcher)  # fmt: skip
    backend = RayBackend() if name == "ray_task" else LocalBackend(nproc_limit=2)
    lines: list[str] = []
    started = time.time()
    result = backend.run(spec, lines.append)
    wall = time.time() - started
    if not result.succeeded:
        raise SystemExit(f"{name} failed:\n" + "\n".join(lines[-40:]))
    first = first_step_time(run_dir)
    return {"s": wall, "first_step_s": None if first is None else first - started,
            "weights": (run_dir / "final" / "model.safetensors").read_bytes()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(ROOT)  # params.yaml's data paths are the project's
    arms = ["local_task", "mpirun_task", "ray_task"]
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory(prefix="gangflow-launchers-") as tmp:
        for rep in range(args.reps):
            order = arms[rep % 3:] + arms[: rep % 3]
            for name in order:
                one = arm(name, Path(tmp) / f"rep-{rep}", args.steps)
                runs[name].append(one)
                print(f"rep {rep} {name}: {one['s']:.2f} s, first step {one['first_step_s']:.2f} s", flush=True)

    def ratio(a: str, b: str, key: str) -> float:
        return round(statistics.median(x[key] / y[key] for x, y in zip(runs[a], runs[b])), 3)

    summary = {
        "ray_task_over_local_task": ratio("ray_task", "local_task", "s"),
        "mpirun_over_torchrun": ratio("mpirun_task", "local_task", "s"),
        "ray_first_step_over_local_first_step": ratio("ray_task", "local_task", "first_step_s"),
        "mpirun_first_step_over_torchrun_first_step": ratio("mpirun_task", "local_task", "first_step_s"),
        **{f"{name}_s": round(statistics.median(x["s"] for x in runs[name]), 2) for name in arms},
        **{f"{name}_first_step_s": round(statistics.median(x["first_step_s"] for x in runs[name]), 2) for name in arms},
        "final_weights_bitwise_equal": all(
            runs[name][i]["weights"] == runs["local_task"][i]["weights"] for name in arms for i in range(args.reps)
        ),
        "reps": args.reps,
        "steps": args.steps,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
