"""What a restart costs before the first step, side by side with its floor. The last line printed
is one JSON object.

Three arms per repetition, interleaved (rotating which goes first), each a fresh process tree:

* `torch_import`: a cold `python -c "import torch"` (fresh interpreter; the page cache is warm,
  as it is on a retry), spawn to exit.
* `bare_torchrun`: `torchrun --standalone --nproc-per-node 2` of a minimal script (import torch,
  gloo process group, a DDP-wrapped linear layer, an SGD optimizer, one step), spawn to the end
  of rank 0's first step. The floor for "a 2-rank torch gang that has taken one step".
* `task_restart`: the training task's launch path on a retry: `LocalBackend.run` (torchrun
  `--max-restarts 0`, as the Airflow task runs it) on a run dir holding a committed checkpoint
  (made once, by an attempt killed with `kill@step=60` at `checkpoint.every_steps=50`; each
  repetition resumes a fresh copy), with MLflow on as under the task (`MLFLOW_TRACKING_URI` and a
  pre-created `MLFLOW_RUN_ID`). Launch (the `run` call) to the first step: the trainer's own
  `resume` event time in metrics.jsonl (the loop starts right after it) and, from the probe
  below, the end of rank 0's first training step (`launch_to_first_step_s`).

Phases of `task_restart` (rank 0, medians, seconds). The trainer logs no start-up timestamps
before its `resume` event, so they are measured from outside: `benchmarks/probe/sitecustomize.py`
is put on the ranks' PYTHONPATH and records, without changing trainer/, the process start time
(/proc), when the interpreter is up, when selected modules finish importing, and the first call
of selected trainer functions:

* `torchrun_agent_s`: launch -> rank 0's process exists (torchrun's own interpreter and torch
  import, its rendezvous store, spawning the ranks);
* `interpreter_s`: rank process start -> `sitecustomize` runs (interpreter start-up);
* `imports_s`: -> `trainer.cli.parse_args` is called (`python -m trainer` imports: torch, of
  which `torch_import_s`);
* `data_md5_s`: -> `trainer.data.resolve_data` returns (pyarrow import, data files' md5 check);
* `rendezvous_s`: `trainer.distributed.setup` (gloo `init_process_group`, all ranks meet);
* `data_load_s`: `trainer.data.parquet_dataset` (reading the train parquet into tensors);
* `optimizer_dynamo_s`: importing `torch._dynamo`, which the first `torch.optim` optimizer
  construction triggers (`Optimizer.add_param_group` is `torch._disable_dynamo`-decorated);
* `mlflow_s`: `trainer.tracking.MlflowSink.__init__` (MLflow import and run lookup);
* `checkpoint_load_s`: `trainer.checkpoint.Checkpointer.read`;
* `other_s`: the rest up to the end of the first step (model, DDP wrapper, loader, first step).

`launch_to_first_step_over_torch_import` = task launch -> first step over the cold torch import
(median of the per-repetition ratio). Goal <= 2.

    python benchmarks/restart.py [--reps 3]      # about 2-4 minutes on 2 shared cores
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
from common import PY, ROOT, TORCHRUN, clean_env, events, note, probe_env, rank0_phases, summary  # noqa: E402

STEPS, EVERY, KILL_AT = 300, 50, 60


# -- the minimal gang (run by torchrun as this file with --bare-child) --------------------------


def bare_child(out: str) -> int:
    t = {"imports_begin": time.time()}
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    t["imports_end"] = time.time()
    dist.init_process_group("gloo")
    t["rendezvous_end"] = time.time()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t["optimizer_end"] = time.time()
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    t["first_step_end"] = time.time()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(t))
    dist.destroy_process_group()
    return 0


# -- the arms -----------------------------------------------------------------------------------


def arm_torch_import() -> dict:
    t0 = time.time()
    subprocess.run([PY, "-c", "import torch"], cwd=ROOT, env=clean_env(), check=True)
    return {"wall_s": time.time() - t0}


def arm_bare(scratch: Path, i: int) -> dict:
    out = scratch / f"bare-{i}.json"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", __file__, "--bare-child", str(out)]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode != 0:
        raise RuntimeError(f"bare torchrun failed ({done.returncode}):\n{done.stderr[-3000:]}")
    t = json.loads(out.read_text())
    return {"launch_to_first_step_s": t["first_step_end"] - t0, "wall_s": wall,
            "to_imports_begin_s": t["imports_begin"] - t0, "imports_s": t["imports_end"] - t["imports_begin"],
            "rendezvous_s": t["rendezvous_end"] - t["imports_end"], "model_optimizer_s": t["optimizer_end"] - t["rendezvous_end"],
            "step_s": t["first_step_end"] - t["optimizer_end"]}  # fmt: skip


class Task:
    """LocalBackend.run, as the training task calls it, on copies of one checkpointed run dir."""

    def __init__(self, scratch: Path, mlflow_runs: list[str]):
        from operators.backends.local import LocalBackend

        self.backend, self.scratch, self.mlflow_runs = LocalBackend(), scratch, mlflow_runs
        self.template = scratch / "checkpointed"
        env = {"GANGFLOW_ALLOW_FAULTS": "1", "GANGFLOW_FAULT": f"kill@step={KILL_AT},rank=1"}
        r = self.launch(self.template, 1, env)
        if r["succeeded"] or not list((self.template / "checkpoints").glob("step-*")):
            raise RuntimeError(f"making the checkpointed run dir failed: {r}; see {scratch}")

    def launch(self, run_dir: Path, attempt: int, env: dict[str, str]) -> dict:
        from operators.backends.base import GangSpec

        spec = GangSpec(name="bench-restart", run_dir=str(run_dir), world_size=2, config_path=str(ROOT / "params.yaml"),
                        overrides=(f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}"), env=env, attempt=attempt)  # fmt: skip
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.scratch / f"{run_dir.name}-try-{attempt}.log", "w") as log:
            t0 = time.time()
            result = self.backend.run(spec, lambda line: print(line, file=log))
            t1 = time.time()
        return {"t0": t0, "wall_s": t1 - t0, "succeeded": result.succeeded, "resumed_from_step": result.resumed_from_step}

    def restart(self, i: int) -> dict:
        run_dir = self.scratch / f"restart-{i}"
        shutil.copytree(self.template, run_dir, ignore=shutil.ignore_patterns("torchrun"))
        probe = self.scratch / f"probe-{i}"
        env = {"MLFLOW_TRACKING_URI": f"sqlite:///{self.scratch / 'mlflow.db'}", "MLFLOW_RUN_ID": self.mlflow_runs[i],
               **probe_env(probe)}  # fmt: skip
        r = self.launch(run_dir, 2, env)
        if not r["succeeded"] or r["resumed_from_step"] is None:
            raise RuntimeError(f"restart {i} did not resume and finish: {r}; see {self.scratch}")
        resume = events(run_dir, "resume")[-1]["time"]
        return {"wall_s": r["wall_s"], "resumed_from_step": r["resumed_from_step"],
                "launch_to_resume_event_s": resume - r["t0"], **rank0_phases(probe, r["t0"])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the three arms (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (printed as `scratch`)")
    parser.add_argument("--bare-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_child:
        return bare_child(args.bare_child)

    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="gangflow-bench-restart-"))
    for key in [k for k in os.environ if k.startswith(("AIRFLOW", "MLFLOW", "GANGFLOW"))]:
        del os.environ[key]
    os.environ |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GANGFLOW_HOME": str(scratch / "state")}
    os.chdir(ROOT)
    try:
        if not (ROOT / "data" / "digits" / "train.parquet").is_file():
            subprocess.run([PY, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True, capture_output=True)
        from pipeline import create_mlflow_runs

        note("creating MLflow runs and the checkpointed run dir (not timed)")
        runs = create_mlflow_runs(scratch, args.reps)
        task = Task(scratch, runs)
        arm_torch_import()  # warm-up: page cache, byte-compiled files (not counted)
        rows: dict[str, list[dict]] = {"torch_import": [], "bare_torchrun": [], "task_restart": []}
        for i in range(args.reps):
            arms = [("torch_import", arm_torch_import), ("bare_torchrun", lambda: arm_bare(scratch, i)),
                    ("task_restart", lambda: task.restart(i))]  # fmt: skip
            arms = arms[i % 3 :] + arms[: i % 3]
            for name, fn in arms:
                rows[name].append(fn())
            imp, bare, tr = rows["torch_import"][-1], rows["bare_torchrun"][-1], rows["task_restart"][-1]
            note(f"rep {i + 1}: import torch {imp['wall_s']:.2f}s, bare torchrun to first step "
                 f"{bare['launch_to_first_step_s']:.2f}s, task restart to first step {tr.get('launch_to_first_step_s') or 0:.2f}s "
                 f"(resume event {tr['launch_to_resume_event_s']:.2f}s)")  # fmt: skip

        def med(name: str) -> dict:
            keys = [k for k in rows[name][0] if isinstance(rows[name][0][k], (int, float)) and k != "resumed_from_step"]
            return {k: round(statistics.median(r[k] for r in rows[name] if r.get(k) is not None), 3) for k in keys}

        ratio = [t["launch_to_first_step_s"] / i["wall_s"] for t, i in zip(rows["task_restart"], rows["torch_import"])]
        bare_ratio = [t["launch_to_first_step_s"] / b["launch_to_first_step_s"] for t, b in zip(rows["task_restart"], rows["bare_torchrun"])]
        task_phases = med("task_restart")
        ranked = sorted(((k, v) for k, v in task_phases.items() if k.endswith("_s") and k not in
                         ("wall_s", "launch_to_first_step_s", "launch_to_resume_event_s", "torch_import_s", "mlflow_import_s",
                          "close_s", "close_to_exit_s")),
                        key=lambda kv: -kv[1])  # fmt: skip
        result = {
            "benchmark": "restart",
            "torch_import_seconds": summary([r["wall_s"] for r in rows["torch_import"]], 3),
            "bare_torchrun_to_first_step_seconds": summary([r["launch_to_first_step_s"] for r in rows["bare_torchrun"]], 3),
            "task_restart_to_first_step_seconds": summary([r["launch_to_first_step_s"] for r in rows["task_restart"]], 3),
            "task_restart_to_resume_event_seconds": summary([r["launch_to_resume_event_s"] for r in rows["task_restart"]], 3),
            "phases": {"bare_torchrun": med("bare_torchrun"), "task_restart": task_phases},
            "task_phases_largest_first": [[k, v] for k, v in ranked],
            "task_over_bare_torchrun_to_first_step": round(statistics.median(bare_ratio), 3),
            "config": {"world_size": 2, "max_steps": STEPS, "checkpoint_every_steps": EVERY, "resumed_from_step":
                       rows["task_restart"][0]["resumed_from_step"], "reps": args.reps, "mlflow": "sqlite, MLFLOW_RUN_ID set"},
            "goals": {"launch_to_first_step_over_torch_import": "<= 2"},
            "benchmark_seconds": round(time.monotonic() - started, 1),
            "launch_to_first_step_over_torch_import": round(statistics.median(ratio), 3),
        }
        if args.keep:
            result["scratch"] = str(scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
