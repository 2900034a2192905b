"""The trainer's CUDA path, drilled on a machine with a GPU (not part of CI: CI has no GPU).

    python benchmarks/gpu_drill.py [--out DIR] [--steps 600] [--every 100] [--device cuda]

What it runs, each a real `torchrun --standalone` of `python -m trainer` on the digits data
(`data/digits/*.parquet`, made by `make data`), 1 rank per GPU:

* `reference`, twice: an uninterrupted run; `cuda_runs_bitwise_equal` says whether two runs
  with the same seed give the same final weights on this GPU (without it, no resume can);
* `kill_at_save`: rank 0 SIGKILLed while its 3rd checkpoint write is in flight
  (`GANGFLOW_FAULT=kill@save=3`, unsynchronised), then the same run dir again: it must resume
  from the last committed checkpoint and end bitwise equal to the reference;
* `kill_at_time`: SIGKILLed after a random share of the reference's loop time
  (`kill@time=S`, unsynchronised: wherever the loop is), resumed, compared the same way;
* `cuda_to_cpu_resume`: a CUDA run killed at its 2nd save, resumed with `train.device=cpu`
  (an Airflow retry landing on a CPU node): it must finish (bitwise equality is not expected
  across devices);
* `ranks_over_gpus`: 2 ranks on a machine with one GPU: the trainer must refuse it as a config
  error (exit 2, naming both numbers) before NCCL fails with `Duplicate GPU detected`.

Prints progress on stderr and, last on stdout, one JSON object. Needs torch with CUDA,
safetensors, pyarrow, numpy, pyyaml; no MLflow, Airflow or DVC (tracking stays in
metrics.jsonl).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESUME = re.compile(r"gangflow: resuming from checkpoint step-(\d+)")


def log(msg: str) -> None:
    print(f"[gpu_drill] {msg}", file=sys.stderr, flush=True)


def trainer(run_dir: Path, sets: list[str], nproc: int = 1, fault: str | None = None, timeout: float = 600) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "0", "-m", "trainer", "--config", str(ROOT / "params.yaml"), "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k not in ("GANGFLOW_FAULT", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
    env |= {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            # the trainer's model allow-list reads entry points; gangflow need not be installed here
            "GANGFLOW_ALLOWED_MODELS": "trainer.models:mlp"}
    if fault:
        env |= {"GANGFLOW_FAULT": fault, "GANGFLOW_ALLOW_FAULTS": "1"}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    resumed = RESUME.search(proc.stdout)
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - start, 2), "output": proc.stdout,
            "resumed_from_step": int(resumed.group(1)) if resumed else None}


def final_digest(run_dir: Path) -> str | None:
    path = run_dir / "final" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def loop_seconds(run_dir: Path) -> float | None:
    """Training-loop time of a finished run, from metrics.jsonl (first step -> final)."""
    times = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") in ("first_step", "final") and rec.get("event") not in times:
            times[rec["event"]] = rec["time"]
    return round(times["final"] - times["first_step"], 3) if len(times) == 2 else None


def keep(out: Path, name: str, result: dict) -> dict:
    (out / f"{name}.log").write_text(result["output"])
    return {k: v for k, v in result.items() if k != "output"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the logs (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: dry-run this script without a GPU")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kill@time moment")
    args = parser.parse_args()
    import torch

    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-drill-out-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-drill-"))
    data = ROOT / "data" / "digits"
    sets = [f"data.train_path={data / 'train.parquet'}", f"data.test_path={data / 'test.parquet'}",
            f"train.max_steps={args.steps}", f"checkpoint.every_steps={args.every}", f"train.device={args.device}",
            "tracking.progress_every_s=0"]
    summary: dict = {"torch": torch.__version__, "device": args.device,
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "gpus": torch.cuda.device_count(), "steps": args.steps, "every": args.every}

    log("reference runs")
    ref = keep(out, "reference", trainer(work / "ref", sets))
    ref2 = keep(out, "reference2", trainer(work / "ref2", sets))
    digest = final_digest(work / "ref")
    summary["reference"] = {**ref, "loop_seconds": loop_seconds(work / "ref") if ref["rc"] == 0 else None}
    summary["cuda_runs_bitwise_equal"] = digest is not None and digest == final_digest(work / "ref2")

    log("kill@save=3, then resume")
    run = work / "kill-save"
    killed = keep(out, "kill_at_save_1", trainer(run, sets, fault="kill@save=3"))
    resumed = keep(out, "kill_at_save_2", trainer(run, sets))
    summary["kill_at_save"] = {"killed_rc": killed["rc"], "resume_rc": resumed["rc"],
                               "resumed_from_step": resumed["resumed_from_step"],
                               "bitwise_equal": final_digest(run) == digest and digest is not None}

    loop = summary["reference"]["loop_seconds"] or 1.0
    rng = random.Random(args.seed)
    at = round(rng.uniform(0.15, 0.85) * loop, 3)
    log(f"kill@time={at}, then resume")
    run = work / "kill-time"
    killed = keep(out, "kill_at_time_1", trainer(run, sets, fault=f"kill@time={at}"))
    resumed = keep(out, "kill_at_time_2", trainer(run, sets))
    summary["kill_at_time"] = {"seconds": at, "killed_rc": killed["rc"], "resume_rc": resumed["rc"],
                               "resumed_from_step": resumed["resumed_from_step"],
                               "bitwise_equal": final_digest(run) == digest and digest is not None}

    log("CUDA checkpoint resumed on CPU")
    run = work / "cross"
    killed = keep(out, "cuda_to_cpu_1", trainer(run, sets, fault="kill@save=2"))
    cpu_sets = [s for s in sets if not s.startswith("train.device=")] + ["train.device=cpu"]
    resumed = keep(out, "cuda_to_cpu_2", trainer(run, cpu_sets))
    summary["cuda_to_cpu_resume"] = {"killed_rc": killed["rc"], "resume_rc": resumed["rc"],
                                     "resumed_from_step": resumed["resumed_from_step"]}

    log("CPU reference (same job) for the time ratio")
    cpu = keep(out, "cpu_reference", trainer(work / "cpu", cpu_sets))
    summary["cpu_reference"] = {**cpu, "loop_seconds": loop_seconds(work / "cpu") if cpu["rc"] == 0 else None}

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        log("2 ranks on fewer GPUs")
        bad = keep(out, "ranks_over_gpus", trainer(work / "over", sets, nproc=2, timeout=300))
        output = (out / "ranks_over_gpus.log").read_text()
        # the trainer refuses before any process group (exit 2, config error), not NCCL at init
        summary["ranks_over_gpus"] = {"rc": bad["rc"], "seconds": bad["seconds"],
                                      "refused_as_config_error": "exitcode  : 2" in output and "NCCL needs one per rank" in output,
                                      "nccl_reached": "ncclInvalidUsage" in output}

    shutil.rmtree(work, ignore_errors=True)
    summary["out"] = str(out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
