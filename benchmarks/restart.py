"""What a restart costs before the first step, side by side with its floor. The last line printed
is one JSON object.

Three arms per repetition, interleaved (rotating which goes first), each a fresh process tree:

* `torch_import`: a cold `python -c "import torch"` (fresh interpreter; the page cache is warm,
  as it is on a retry), spawn to exit.
* `bare_torchrun`: `torchrun --standalone --nproc-per-node 2` of a minimal script (import torch,
  gloo process group, a DDP-wrapped linear layer, an SGD optimizer, one step), spawn to the end
  of rank 0's first step. The floor for "a 2-rank torch gang that has taken one step".
* `torch_dynamo_import`: a cold `python -c "import torch, torch._dynamo"`: what every rank that
  builds a `torch.optim` optimizer imports (the optimizer constructor imports torch._dynamo).
* `task_restart`: the training task's launch path on a retry, in a fresh process as the Airflow
  task's is: `LocalBackend.run` (its default launcher, `trainer.launch`: torchrun's agent with the
  ranks forked from it; `--max-restarts 0`) on a run dir holding a committed
  checkpoint (made once, by an attempt killed with `kill@step=60` at `checkpoint.every_steps=50`;
  each repetition resumes a fresh copy), with MLflow on as under the task: the task's relay
  (`operators.hooks.mlflow_relay`) opens the MLflow run (SQLite, pre-created run) in a thread while torchrun
  starts and relays metrics.jsonl; the ranks import no MLflow. Launch (the `run` call) to the
  first step: the trainer's own `resume` event time in metrics.jsonl (the loop starts right
  after it) and, from the probe below, the end of rank 0's first training step
  (`launch_to_first_step_s`); `relay_finish_s` is the relay's flush after the gang exits.

Phases of `task_restart` (rank 0, medians, seconds). The trainer logs no start-up timestamps
before its `resume` event, so they are measured from outside: `benchmarks/probe/sitecustomize.py`
is put on the ranks' PYTHONPATH and records, without changing trainer/, the process start time
(/proc), when the interpreter is up, when selected modules finish importing, and the first call
of selected trainer functions:

* `torchrun_agent_s`: launch -> rank 0's process exists (under `trainer.launch`: the launcher's
  interpreter and its imports of torch, torch._dynamo, pyarrow and the trainer, its store, the
  fork; the forked rank's `interpreter_s`, `imports_s` and import spans are then ~0. Under
  torchrun: its own interpreter and torch import, its rendezvous store, spawning the ranks);
* `interpreter_s`: rank process start -> `sitecustomize` runs (interpreter start-up);
* `imports_s`: -> `trainer.cli.parse_args` is called (`python -m trainer` imports: torch, of
  which `torch_import_s`);
* `data_md5_s`: -> `trainer.data.resolve_data` returns (pyarrow import, data files' md5 check);
* `rendezvous_s`: `trainer.distributed.setup` (gloo `init_process_group`, all ranks meet);
* `data_load_s`: `trainer.data.parquet_dataset` (reading the train parquet into tensors);
* `optimizer_dynamo_s`: waiting for `torch._dynamo`, which the first `torch.optim` optimizer
  construction needs (`Optimizer.add_param_group` is `torch._disable_dynamo`-decorated); the
  trainer imports it in a thread from its start, so this is only the part left when the
  optimizer is built (`dynamo_import_s` is the whole import, overlapped);
* `mlflow_s`: `trainer.tracking.MlflowSink.__init__` (0 here: the task relays, ranks import no MLflow);
* `checkpoint_load_s`: `trainer.checkpoint.Checkpointer.read`;
* `other_s`: the rest up to the end of the first step (model, DDP wrapper, loader, first step).

`launch_to_first_step_over_torch_import` = task launch -> first step over the cold torch import
(median of the per-repetition ratio). Goal <= 2. What the same path costs with a rank per
fresh interpreter, measured in the same run:
`floor_over_torch_import` = the bare 2-rank torchrun to its first step over the same import (an
agent interpreter + torch import, two ranks importing torch and torch._dynamo on two cores, a gloo
rendezvous: no trainer code), and `task_above_floor_seconds` = what the trainer adds to it.

    python benchmarks/restart.py [--reps 3] [--nproc 2]      # about 2-4 minutes on 2 shared cores
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


def arm_torch_import(code: str = "import torch") -> dict:
    t0 = time.time()
    subprocess.run([PY, "-c", code], cwd=ROOT, env=clean_env(), check=True)
    return {"wall_s": time.time() - t0}


def task_child(arg: str) -> int:
    """The training task's side of a restart, in a fresh process like the Airflow task's: the
    relay opens the MLflow run in a thread while `LocalBackend.run` launches the gang."""
    job = json.loads(arg)
    here = Path(__file__).resolve().parent  # benchmarks/trainer.py would shadow the trainer package
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if p and Path(p).resolve() != here]
    if getattr(sys.modules.get("trainer"), "__file__", "").startswith(str(here)):
        del sys.modules["trainer"]
    from operators.hooks import mlflow as tracking
    from operators.backends.base import GangSpec
    from operators.backends.local import LocalBackend
    from operators.hooks.mlflow_relay import TrackingRelay

    spec = GangSpec(**job["spec"])
    with open(job["log"], "w") as log:
        say = lambda line: print(line, file=log, flush=True)  # noqa: E731
        relay = None
        if job.get("mlflow_run_id"):
            relay = TrackingRelay(spec.run_dir, log=say,
                                  open_run=lambda: (tracking.get_client(job["tracking_uri"]), job["mlflow_run_id"])).start()
        t0 = time.time()
        result = LocalBackend().run(spec, say)
        t1 = time.time()
        if relay is not None:
            relay.finish(succeeded=result.succeeded, final_dir=Path(spec.run_dir) / "final")
        t2 = time.time()
    print(json.dumps({"t0": t0, "wall_s": t1 - t0, "relay_finish_s": t2 - t1, "succeeded": result.succeeded,
                      "resumed_from_step": result.resumed_from_step}))
    return 0


def arm_bare(scratch: Path, i: int, nproc: int) -> dict:
    out = scratch / f"bare-{i}.json"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0", __file__, "--bare-child", str(out)]
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
    """The training task's launch (`task_child`, a fresh process each) on copies of one
    checkpointed run dir."""

    def __init__(self, scratch: Path, mlflow_runs: list[str], nproc: int):
        self.scratch, self.mlflow_runs, self.nproc = scratch, mlflow_runs, nproc
        self.template = scratch / "checkpointed"
        env = {"GANGFLOW_ALLOW_FAULTS": "1", "GANGFLOW_FAULT": f"kill@step={KILL_AT},rank={min(1, nproc - 1)}"}
        r = self.launch(self.template, 1, env, None)
        if r["succeeded"] or not list((self.template / "checkpoints").glob("step-*")):
            raise RuntimeError(f"making the checkpointed run dir failed: {r}; see {scratch}")

    def launch(self, run_dir: Path, attempt: int, env: dict[str, str], mlflow_run_id: str | None) -> dict:
        spec = {"name": "bench-restart", "run_dir": str(run_dir), "world_size": self.nproc, "config_path": str(ROOT / "params.yaml"),
                "overrides": [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}"], "env": env, "attempt": attempt}
        run_dir.mkdir(parents=True, exist_ok=True)
        job = {"spec": spec, "log": str(self.scratch / f"{run_dir.name}-try-{attempt}.log"), "mlflow_run_id": mlflow_run_id,
               "tracking_uri": f"sqlite:///{self.scratch / 'mlflow.db'}"}
        done = subprocess.run([PY, __file__, "--task-child", json.dumps(job)], cwd=ROOT, env=clean_env(**{
            "GANGFLOW_HOME": os.environ["GANGFLOW_HOME"], "MLFLOW_TRACKING_URI": job["tracking_uri"]}),
            capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"task child failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def restart(self, i: int) -> dict:
        run_dir = self.scratch / f"restart-{i}"
        shutil.copytree(self.template, run_dir, ignore=shutil.ignore_patterns("torchrun"))
        probe = self.scratch / f"probe-{i}"
        r = self.launch(run_dir, 2, probe_env(probe), self.mlflow_runs[i])
        if not r["succeeded"] or r["resumed_from_step"] is None:
            raise RuntimeError(f"restart {i} did not resume and finish: {r}; see {self.scratch}")
        resume = events(run_dir, "resume")[-1]["time"]
        return {"wall_s": r["wall_s"], "resumed_from_step": r["resumed_from_step"], "relay_finish_s": r["relay_finish_s"],
                "launch_to_resume_event_s": resume - r["t0"], **rank0_phases(probe, r["t0"])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the three arms (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (printed as `scratch`)")
    parser.add_argument("--nproc", type=int, default=2, choices=(1, 2, 3, 4),
                        help="ranks of the bare torchrun and of the task's gang (default 2; 1 shows the path without two ranks "
                             "contending for this machine's cores)")
    parser.add_argument("--bare-child", help=argparse.SUPPRESS)
    parser.add_argument("--task-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_child:
        return bare_child(args.bare_child)
    if args.task_child:
        return task_child(args.task_child)

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
        task = Task(scratch, runs, args.nproc)
        arm_torch_import()  # warm-up: page cache, byte-compiled files (not counted)
        rows: dict[str, list[dict]] = {"torch_import": [], "torch_dynamo_import": [], "bare_torchrun": [], "task_restart": []}
        for i in range(args.reps):
            arms = [("torch_import", arm_torch_import), ("bare_torchrun", lambda: arm_bare(scratch, i, args.nproc)),
                    ("torch_dynamo_import", lambda: arm_torch_import("import torch, torch._dynamo")),
                    ("task_restart", lambda: task.restart(i))]  # fmt: skip
            arms = arms[i % 4 :] + arms[: i % 4]
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
        floor = [b["launch_to_first_step_s"] / i["wall_s"] for b, i in zip(rows["bare_torchrun"], rows["torch_import"])]
        above = [t["launch_to_first_step_s"] - b["launch_to_first_step_s"] for t, b in zip(rows["task_restart"], rows["bare_torchrun"])]
        task_phases = med("task_restart")
        ranked = sorted(((k, v) for k, v in task_phases.items() if k.endswith("_s") and k not in
                         ("wall_s", "launch_to_first_step_s", "launch_to_resume_event_s", "torch_import_s", "mlflow_import_s",
                          "close_s", "close_to_exit_s", "dynamo_import_s", "relay_finish_s")),
                        key=lambda kv: -kv[1])  # fmt: skip
        result = {
            "benchmark": "restart",
            "torch_import_seconds": summary([r["wall_s"] for r in rows["torch_import"]], 3),
            "torch_dynamo_import_seconds": summary([r["wall_s"] for r in rows["torch_dynamo_import"]], 3),
            "bare_torchrun_to_first_step_seconds": summary([r["launch_to_first_step_s"] for r in rows["bare_torchrun"]], 3),
            "task_restart_to_first_step_seconds": summary([r["launch_to_first_step_s"] for r in rows["task_restart"]], 3),
            "task_restart_to_resume_event_seconds": summary([r["launch_to_resume_event_s"] for r in rows["task_restart"]], 3),
            "phases": {"bare_torchrun": med("bare_torchrun"), "task_restart": task_phases},
            "task_phases_largest_first": [[k, v] for k, v in ranked],
            "task_over_bare_torchrun_to_first_step": round(statistics.median(bare_ratio), 3),
            "floor_over_torch_import": round(statistics.median(floor), 3),
            "task_above_floor_seconds": summary(above, 3),
            "config": {"world_size": args.nproc, "max_steps": STEPS, "checkpoint_every_steps": EVERY, "resumed_from_step":
                       rows["task_restart"][0]["resumed_from_step"], "reps": args.reps, "mlflow": "sqlite, relayed by the task process (ranks import no MLflow)"},
            "goals": {"launch_to_first_step_over_torch_import": "<= 2 (floor: floor_over_torch_import)"},
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
