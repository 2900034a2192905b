"""Trainer overheads, measured side by side. The last line printed is one JSON object:

* `trainer_ws1_over_plain`: the trainer's step time at world size 1 (`python -m trainer`, no
  torchrun: no process group and no DDP wrapper, by design) over a plain single-process loop
  (same model, data, global batch, optimizer; a shuffling DataLoader): what the trainer's own
  loop costs (sampler, scheduler, metrics, fault and preemption checks). Goal <= 1.05. (This
  was called `ddp_ws1_over_plain`, which it never measured: there is no DDP at world size 1.)
* `ddp_wrapper_ws1_over_plain`: the same plain loop with the model wrapped in
  `DistributedDataParallel` in a gloo process group of one rank, over the plain loop: what the
  DDP wrapper itself costs when there is nobody to talk to (reported; the trainer skips it).
* `checkpoint_overhead_fraction`: ALL the checkpoint time at the default interval (params.yaml
  checkpoint.every_steps) over the loop's time, from the trainer's own checkpoint events: the
  sum of every save's `duration_s` (CPU snapshot, serialization, sha256, fsync, commit, prune:
  the blocked part and the background writer) over `train_s`. An upper bound of what saving
  costs the loop (a background write that runs on an idle core costs it nothing), and stable
  under load, unlike a with/without A/B. Goal <= 0.03. `checkpoint_seconds_per_save` and
  `checkpoint_every_steps_for_goal` (the interval at which the same saves would meet the goal,
  at the measured step time) go with it.
* `checkpoint_loop_cost_fraction`: what the saves cost the loop, measured inside the same run
  (no A/B across runs): the 10-step windows a save touches (its snapshot and its background
  write) against the windows no save touches. The stall plus the CPU and GIL time the writer
  takes from the loop, without the time the writer waits on the disk. Reported beside the goal
  figure, not instead of it.
* `checkpoint_overhead_span_ab`: the A/B view of the same: (start -> final event with
  checkpoints) / (the same without intermediate checkpoints) - 1, median of pairs (reported:
  the pairs swing by tens of percent on a shared machine).
* `checkpoint_stall_fraction`: the blocked part only: time the loop is blocked in checkpoint
  saves over the loop's time. Goal <= 0.02.
* `ranks2_over_ranks1_throughput`: samples/s of 2 ranks (torchrun, gloo) over 1 rank (reported).

The machine is shared and noisy, so: configurations are interleaved in every repetition; a
run's step time is the median over its 10-step windows (a burst of interference spoils a few
windows, not the run; the trainer's windows come from its own metrics.jsonl, the plain loop
times the same windows); ratios are the median over repetitions of the per-repetition ratio
(adjacent runs share the machine's mood). Process start-up is excluded on both sides.

    python benchmarks/trainer.py [--reps 4] [--steps 3000]     # a few minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))
WINDOW = 10  # steps; the trainer's train.log_every_steps default


def plain_loop(steps: int, train_path: str, ddp: bool = False) -> dict:
    """The baseline, run in its own process: a textbook single-process training loop; with `ddp`,
    the model is wrapped in DistributedDataParallel in a one-rank gloo process group."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from trainer.config import load_config
    from trainer.data import parquet_dataset
    from trainer.models import mlp

    cfg = load_config(ROOT / "params.yaml")
    torch.manual_seed(cfg.train.seed)
    data = parquet_dataset(train_path)
    model = mlp(**cfg.model.kwargs)
    if ddp:
        store = dist.FileStore(tempfile.mktemp(prefix="gangflow-bench-ddp-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum, weight_decay=cfg.train.weight_decay)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True)
    windows = []
    t0 = w0 = time.perf_counter()
    done = 0
    while done < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done % WINDOW == 0:
                now = time.perf_counter()
                windows.append((now - w0) / WINDOW)
                w0 = now
            if done == steps:
                break
    if ddp:
        dist.destroy_process_group()
    return {"train_s": time.perf_counter() - t0, "windows": windows}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_plain(steps: int, data: Path, ddp: bool = False) -> dict:
    out = subprocess.run([PY, __file__, "--plain", "--steps", str(steps), "--data", str(data), *(["--ddp"] if ddp else [])],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"step_s": statistics.median(result["windows"][1:]), "train_s": result["train_s"]}


def run_trainer(world_size: int, steps: int, every: int, tmp: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"ws{world_size}-"))
    sets = [f"train.max_steps={steps}", f"checkpoint.every_steps={every}", "checkpoint.keep_last=2",
            f"train.log_every_steps={WINDOW}", f"data.train_path={tmp / 'data' / 'train.parquet'}",
            f"data.test_path={tmp / 'data' / 'test.parquet'}"]
    args = ["-m", "trainer", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    if world_size == 1:
        cmd = [PY, *args]
    else:
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(world_size), "--max-restarts", "0", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = next(e for e in events if e.get("event") == "final")
    start = next(e for e in events if e.get("event") == "start")
    batch = final["global_batch"]
    timed = [(e["step"], WINDOW * batch / e["samples_per_sec"]) for e in events if "samples_per_sec" in e]
    windows = [t / WINDOW for _, t in timed]
    saves = [e for e in events if e.get("event") == "checkpoint"]
    return {"step_s": statistics.median(windows[1:]), "train_s": final["train_s"], "span_s": final["time"] - start["time"],
            "blocked_s": final["checkpoint_blocked_s"], "checkpoints": len(saves),
            "write_s": sum(e.get("duration_s", 0.0) for e in saves),
            "loop_cost_s": loop_cost(timed[1:], [e["step"] for e in saves])}  # fmt: skip


def loop_cost(timed: list[tuple[int, float]], save_steps: list[int]) -> float:
    """What the saves cost the loop, from inside one run: the time of the windows a save can touch
    (the one ending at its step, where the snapshot is taken, and the two after it, where the
    background write runs) beyond the mean of the windows no save touches. It holds the stall and
    everything the writer takes from the loop (CPU, the GIL), and none of the writer's waiting on
    the disk; interference hits both kinds of window alike, so it cancels on average."""
    touched = {n + k * WINDOW for n in save_steps for k in (0, 1, 2)}
    hit = [t for step, t in timed if step in touched]
    clean = [t for step, t in timed if step not in touched]
    return sum(hit) - len(hit) * statistics.fmean(clean) if hit and clean else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--ddp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        print(json.dumps(plain_loop(args.steps, args.data, ddp=args.ddp)))
        return 0
    sys.path.insert(0, str(ROOT))
    from trainer.config import load_config

    every = load_config(ROOT / "params.yaml").checkpoint.every_steps
    if not (ROOT / "data/digits/train.parquet").is_file():
        subprocess.run([PY, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True, capture_output=True)
    plain, plain_ddp, ws1, ws1_ckpt, ws2 = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="gangflow-bench-") as tmp:
        data = Path(tmp) / "data"  # a private copy: nothing else in the tree can change it mid-run
        shutil.copytree(ROOT / "data" / "digits", data)
        for rep in range(args.reps):  # interleaved: every configuration sees the same noise
            plain.append(run_plain(args.steps, data / "train.parquet"))
            plain_ddp.append(run_plain(args.steps, data / "train.parquet", ddp=True))
            ws1.append(run_trainer(1, args.steps, args.steps * 10, Path(tmp)))
            ws1_ckpt.append(run_trainer(1, args.steps, every, Path(tmp)))
            ws2.append(run_trainer(2, args.steps, args.steps * 10, Path(tmp)))
            print(f"rep {rep + 1}/{args.reps}: ms/step plain {plain[-1]['step_s'] * 1e3:.3f}, plain + DDP wrapper "
                  f"{plain_ddp[-1]['step_s'] * 1e3:.3f}, trainer ws1 "
                  f"{ws1[-1]['step_s'] * 1e3:.3f}, ws2 {ws2[-1]['step_s'] * 1e3:.3f}; with checkpoints every {every}: "
                  f"start->final {ws1_ckpt[-1]['span_s']:.2f}s vs {ws1[-1]['span_s']:.2f}s, blocked "
                  f"{ws1_ckpt[-1]['blocked_s'] * 1e3:.1f} ms in {ws1_ckpt[-1]['checkpoints']} saves", file=sys.stderr, flush=True)
    med = statistics.median
    result = {
        "trainer_ws1_over_plain": round(med(w["step_s"] / p["step_s"] for w, p in zip(ws1, plain)), 4),
        "ddp_wrapper_ws1_over_plain": round(med(d["step_s"] / p["step_s"] for d, p in zip(plain_ddp, plain)), 4),
        "checkpoint_overhead_fraction": round(med(r["write_s"] / r["train_s"] for r in ws1_ckpt), 4),
        "checkpoint_overhead_per_rep": [round(r["write_s"] / r["train_s"], 4) for r in ws1_ckpt],
        "checkpoint_seconds_per_save": round(med(r["write_s"] / max(r["checkpoints"], 1) for r in ws1_ckpt), 5),
        "checkpoint_every_steps_for_goal": math.ceil(med(r["write_s"] / max(r["checkpoints"], 1) / (0.03 * r["step_s"])
                                                         for r in ws1_ckpt)),
        "checkpoint_loop_cost_fraction": round(med(r["loop_cost_s"] / r["train_s"] for r in ws1_ckpt), 4),
        "checkpoint_loop_cost_per_rep": [round(r["loop_cost_s"] / r["train_s"], 4) for r in ws1_ckpt],
        "checkpoint_overhead_span_ab": round(med(c["span_s"] / w["span_s"] for c, w in zip(ws1_ckpt, ws1)) - 1, 4),
        "checkpoint_overhead_span_pairs": [round(c["span_s"] / w["span_s"] - 1, 4) for c, w in zip(ws1_ckpt, ws1)],
        "checkpoint_stall_fraction": round(med(r["blocked_s"] / r["train_s"] for r in ws1_ckpt), 5),
        "checkpoints_per_run": ws1_ckpt[0]["checkpoints"],
        "ranks2_over_ranks1_throughput": round(med(a["step_s"] / b["step_s"] for a, b in zip(ws1, ws2)), 4),
        "plain_step_ms": round(med(p["step_s"] for p in plain) * 1e3, 4),
        "plain_ddp_wrapper_step_ms": round(med(p["step_s"] for p in plain_ddp) * 1e3, 4),
        "trainer_ws1_step_ms": round(med(r["step_s"] for r in ws1) * 1e3, 4),
        "trainer_ws2_step_ms": round(med(r["step_s"] for r in ws2) * 1e3, 4),
        "checkpoint_every_steps": every,
        "steps": args.steps,
        "reps": args.reps,
        "goals": {"trainer_ws1_over_plain": "<= 1.05", "checkpoint_overhead_fraction": "<= 0.03",
                  "checkpoint_stall_fraction": "<= 0.02"},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
