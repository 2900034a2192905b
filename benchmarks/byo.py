"""Training code of one's own: the gangflow training task over the same script run bare under torchrun.

* `byo_task_over_bare_torchrun` (per example in EXAMPLES): wall time of the pipeline's training
  task `train_local_<N>` over a bare `torchrun --standalone --nproc-per-node N --max-restarts 0
  -m <the example's module> <its arguments>`, median of interleaved pairs. Goal <= 1.10.
  - task side: the example's DAG run once per repetition with `dag.test()` (`python -m
    operators.cli.demo --pipeline <name>`, what `make demo PIPELINE=<name>` runs) on a fresh SQLite
    state dir; the time is the task instance's `end_date - start_date` from Airflow's metadata DB
    (template rendering, the capacity check, `LocalBackend.run`: trainer.launch forking the ranks,
    `python -m trainer.user` around the script, the ranks' output streamed into the task log, the
    MLflow relay, the `final/` upload, the XCom push).
  - bare side: the same module under plain torchrun, with the environment `trainer.runtime` reads
    set by hand from the task's own launch line (run dir: a fresh one; dataset remote and version,
    run parameters), no MLflow, timed from spawn to exit.

Add an example by adding an entry to EXAMPLES (its pipeline, its module and arguments, its run
conf). Usage: `python benchmarks/byo.py [--reps 2] [--only digits-cnn]` (about 4 minutes per pair
and example on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from common import PY, ROOT, TORCHRUN, clean_env, note, summary, utc_epoch  # noqa: E402

# benchmarks/trainer.py would shadow the trainer package this script imports (trainer.user)
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

#: name -> the pipeline, the run conf of both sides, the module torchrun runs bare.
EXAMPLES = {
    "digits-cnn": {"pipeline": "digits-cnn", "conf": {"world_size": 2, "max_steps": 600, "checkpoint_every_steps": 100},
                   "module": "digits_cnn.train", "args": []},
    "charlm": {"pipeline": "charlm", "conf": {"world_size": 2, "max_steps": 240, "checkpoint_every_steps": 40},
               "module": "charlm.train", "args": []},  # the entry point's kwargs are main()'s defaults
    "digits-lightning": {"pipeline": "digits-lightning", "conf": {"world_size": 2, "max_steps": 1400},
                         "module": "digits_lightning.train", "args": []},
}
_LAUNCH = "launching gang of "


def pipeline_env(home: Path) -> dict[str, str]:
    return clean_env(GANGFLOW_HOME=str(home), GANGFLOW_RETRY_BASE_DELAY="1")


def setup_state(home: Path) -> None:
    done = subprocess.run([PY, "-m", "operators.cli.setup"], cwd=ROOT, env=pipeline_env(home), capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"operators.cli.setup failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def task_side(home: Path, example: dict, log: Path) -> dict:
    """One DAG run of the example's pipeline; its training task's wall time and launch line."""
    from operators.config.pipelines import load_pipelines

    pipeline = load_pipelines()[example["pipeline"]]
    conf = example["conf"]
    with open(log, "w") as out:
        code = subprocess.run([PY, "-m", "operators.cli.demo", "--pipeline", example["pipeline"], "--conf", json.dumps(conf)],
                              cwd=ROOT, env=pipeline_env(home), stdout=out, stderr=subprocess.STDOUT, timeout=1800).returncode
    text = log.read_text()
    result = json.loads(text.strip().splitlines()[-1])
    if code != 0 or result.get("state") != "success":
        raise RuntimeError(f"{example['pipeline']}: DAG run failed (exit {code}): {result}; see {log}")
    task_id = f"train_local_{conf['world_size']}"
    with sqlite3.connect(home / "airflow" / "airflow.db") as db:
        state, start, end, tries = db.execute(
            "SELECT state, start_date, end_date, try_number FROM task_instance WHERE dag_id = ? AND run_id = ? AND task_id = ?",
            (pipeline.dag_id, result["dag_run_id"], task_id)).fetchone()
    if state != "success" or tries != 1:
        raise RuntimeError(f"{task_id}: state {state}, try {tries} (expected one successful try)")
    named = re.search(r"Airflow's log: (\S+)", text)  # the demo's account is short; the task's lines are there
    if named and Path(named.group(1)).is_file():
        text = Path(named.group(1)).read_text(errors="replace") + text
    launch = next(line for line in text.splitlines() if _LAUNCH in line)
    argv = shlex.split(launch.split("ranks: ", 1)[1].rsplit(" [airflow.task", 1)[0])
    return {"wall_s": utc_epoch(end) - utc_epoch(start), "user_args": argv[argv.index("trainer.user") + 1:]}


def runtime_env(user_args: list[str], run_dir: Path) -> dict[str, str]:
    """What `python -m trainer.user` would export for these arguments (trainer.runtime's environment)."""
    from trainer import user

    args = user.build_parser().parse_args(user_args)
    args.run_dir = str(run_dir)
    saved = dict(os.environ)
    try:
        user.export_runtime_env(args)
        return {k: v for k, v in os.environ.items() if k.startswith("GANGFLOW_")}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def bare_side(example: dict, user_args: list[str], scratch: Path, log: Path) -> dict:
    run_dir = scratch / f"bare-{time.monotonic_ns()}"
    env = clean_env(**runtime_env(user_args, run_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(example["conf"]["world_size"]), "--max-restarts", "0",
           "-m", example["module"], *example["args"]]
    with open(log, "w") as out:
        t0 = time.time()
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800).returncode
        t1 = time.time()
    if code != 0:
        raise RuntimeError(f"bare torchrun exited {code}; see {log}:\n{log.read_text()[-3000:]}")
    return {"wall_s": t1 - t0}


def bench(home: Path, name: str, example: dict, reps: int) -> dict:
    task, bare = [], []
    for i in range(reps):  # interleaved, alternating which side goes first
        order = ("task", "bare") if i % 2 == 0 else ("bare", "task")
        if not task:  # the bare side needs the task's own arguments: the first pair starts with the task
            order = ("task", "bare")
        for side in order:
            note(f"{name}: pair {i + 1}/{reps}, {side}")
            if side == "task":
                task.append(task_side(home, example, home / f"{name}-task-{i}.log"))
            else:
                bare.append(bare_side(example, task[-1]["user_args"], home, home / f"{name}-bare-{i}.log"))
    pairs = [t["wall_s"] / b["wall_s"] for t, b in zip(task, bare)]
    return {"byo_task_over_bare_torchrun": round(statistics.median(pairs), 4), "pairs": summary(pairs),
            "task_seconds": summary([t["wall_s"] for t in task], 3), "bare_torchrun_seconds": summary([b["wall_s"] for b in bare], 3),
            "config": example["conf"], "bare_command": ["torchrun", "-m", example["module"], *example["args"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2, help="interleaved task/bare pairs per example (default 2)")
    parser.add_argument("--only", action="append", choices=sorted(EXAMPLES), help="examples to measure (default all)")
    parser.add_argument("--keep", action="store_true", help="keep the state dir and logs")
    args = parser.parse_args(argv)
    started = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="gangflow-bench-byo-"))
    try:
        note(f"setting up a fresh state dir {home}")
        setup_state(home)
        results = {name: bench(home, name, EXAMPLES[name], args.reps) for name in (args.only or sorted(EXAMPLES))}
        out = {"byo_task_over_bare_torchrun": {name: r["byo_task_over_bare_torchrun"] for name, r in results.items()},
               "examples": results, "goals": {"byo_task_over_bare_torchrun": "<= 1.10 per example"},
               "benchmark_seconds": round(time.monotonic() - started, 1)}
        if args.keep:
            out["home"] = str(home)
        print(json.dumps(out), flush=True)
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
