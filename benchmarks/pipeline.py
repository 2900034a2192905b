"""Airflow-side overheads of the pipeline, measured side by side. The last line printed is one
JSON object:

* `dag_parse_seconds`: the DAG file's own parse cost, beyond importing `airflow.sdk`. Each
  repetition is a cold process: it times `import airflow.sdk`, then executing
  `dags/train_pipeline.py` (importlib `spec_from_file_location` + `exec_module`); the latter is
  the number (median). Goal <= 0.2 s. `dag_parse_imports` names what the file imports on top of
  `airflow.sdk` (from `-X importtime`), and `dag_parse_heavy_imports` any of torch, mlflow,
  great_expectations, dvc, pandas that it pulled in (should be empty).
* `train_task_over_bare_torchrun`: wall time of the training task `train_local_<N>` over a bare
  torchrun of the same trainer arguments, median of interleaved pairs. Goal <= 1.10 (aim 1.05).
  - task side: the real DAG run once per repetition with `dag.test()` (what `make demo` does,
    `python -m operators.cli.demo`, on a fresh SQLite state dir); the time is the task instance's
    `end_date - start_date` from Airflow's metadata DB: template rendering, the capacity check,
    `LocalBackend.run` (torchrun with `--tee`/`--log-dir`, ranks' output streamed into the task
    log) with the task's MLflow relay beside it (`operators.hooks.mlflow_relay`: the run lookup/creation in a
    thread during the launch, metrics.jsonl relayed while training; the ranks import no MLflow),
    the relay's flush and `final/` upload after the gang exits, and the XCom push. dag.test runs the task in its
    own process, so the worker's fork and its re-parse of the DAG file are not included (the
    parse is `dag_parse_seconds`).
  - bare side: `torchrun --standalone --nproc-per-node N --max-restarts 0 -m trainer --run-dir
    <fresh> <the task's own trainer arguments>` (read from the task's "launching gang" log line:
    same params file, overrides, data paths and md5 check), no MLflow, timed from spawn to exit.
  - optional third arm (`bare_torchrun_mlflow`): the same bare torchrun with
    `MLFLOW_TRACKING_URI` and a pre-created `MLFLOW_RUN_ID`: rank 0 logging to MLflow itself, as
    on Kubernetes (and as the local task did before the relay): what the relay takes off the path.
  - `phases`: each side split at the trainer's events (start-up until the `start` event, the
    loop until `final`, the tail until exit) and, for the task, the time before the launch.

Usage: `python benchmarks/pipeline.py [--reps 3] [--steps 300] [--parse-reps 7] [--no-mlflow-arm]`
(about 5-8 minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PY, ROOT, bare_torchrun, clean_env, last_json_line, note, phases, probe_env, rank0_phases, run_demo, safetensors_digest, summary,
    task_process_phases, utc_epoch, warm_up,
)

DAG_FILE = ROOT / "dags" / "train_pipeline.py"
HEAVY = ("torch", "mlflow", "great_expectations", "dvc", "pandas", "numpy", "sqlalchemy")
MARK = "GANGFLOW-BENCH-MARK"

PARSE_CHILD = f"""
import importlib.util, json, sys, time
t0 = time.perf_counter()
import airflow.sdk
t1 = time.perf_counter()
before = set(sys.modules)
sys.stderr.write("{MARK}\\n"); sys.stderr.flush()
spec = importlib.util.spec_from_file_location("train_pipeline", {str(DAG_FILE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
t2 = time.perf_counter()
new = set(sys.modules) - before
heavy = sorted(m for m in new if m.split(".")[0] in {HEAVY!r} and "." not in m)
print(json.dumps({{"sdk_s": t1 - t0, "dag_s": t2 - t1, "new_modules": len(new), "heavy": heavy}}))
"""


# -- DAG parse --------------------------------------------------------------------------------


def parse_env(home: Path) -> dict[str, str]:
    return clean_env(
        GANGFLOW_HOME=str(home), AIRFLOW_HOME=str(home / "airflow"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"), AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow' / 'airflow.db'}",
    )  # fmt: skip


def parse_once(env: dict[str, str], importtime: bool = False) -> tuple[dict, str]:
    cmd = [PY, *(["-X", "importtime"] if importtime else []), "-c", PARSE_CHILD]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"parsing {DAG_FILE} failed:\n{done.stderr[-4000:]}")
    return last_json_line(done.stdout), done.stderr


def importtime_top(stderr: str, n: int = 5) -> dict:
    """Modules imported after the marker (i.e. by the DAG file): top self and top-level cumulative times."""
    lines = stderr.splitlines()
    try:
        lines = lines[lines.index(MARK) + 1 :]
    except ValueError:
        return {}
    rows = []
    for line in lines:
        m = re.match(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(1)) / 1e6, int(m.group(2)) / 1e6, len(m.group(3)) // 2, m.group(4)))
    top_self = sorted(rows, key=lambda r: -r[0])[:n]
    top_level = sorted((r for r in rows if r[2] == 0), key=lambda r: -r[1])[:n]
    return {
        "top_self_s": {name: round(s, 4) for s, _, _, name in top_self},
        "top_level_cumulative_s": {name: round(c, 4) for _, c, _, name in top_level},
        "modules": len(rows),
        "note": "from -X importtime in one extra cold process (importtime inflates times; for attribution only)",
    }


def bench_parse(home: Path, reps: int) -> dict:
    env = parse_env(home)
    (home / "airflow").mkdir(parents=True, exist_ok=True)
    parse_once(env)  # warm-up: byte-compiles anything stale; not counted
    runs = []
    for i in range(reps):
        result, _ = parse_once(env)
        runs.append(result)
        note(f"parse {i + 1}/{reps}: airflow.sdk {result['sdk_s']:.3f}s, DAG file {result['dag_s']:.3f}s")
    _, stderr = parse_once(env, importtime=True)
    return {
        "dag_parse_seconds": round(statistics.median(r["dag_s"] for r in runs), 4),
        "dag_parse_spread": summary([r["dag_s"] for r in runs]),
        "airflow_sdk_import_seconds": round(statistics.median(r["sdk_s"] for r in runs), 4),
        # Load-independent view: both times scale with how busy the machine is.
        "dag_parse_over_sdk_import": round(statistics.median(r["dag_s"] / r["sdk_s"] for r in runs), 4),
        "dag_parse_new_modules": runs[-1]["new_modules"],
        "dag_parse_heavy_imports": sorted({m for r in runs for m in r["heavy"]}),
        "dag_parse_imports": importtime_top(stderr),
    }


# -- training task vs bare torchrun ------------------------------------------------------------

_LAUNCH = re.compile(r"^(\S+Z) \[info\s*\] launching gang of (\d+) ranks: (.*?) \[airflow\.task")


def pipeline_env(home: Path) -> dict[str, str]:
    return clean_env(GANGFLOW_HOME=str(home), GANGFLOW_RETRY_BASE_DELAY="1")


def setup_state(home: Path) -> None:
    done = subprocess.run([PY, "-m", "operators.cli.setup"], cwd=ROOT, env=pipeline_env(home), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"operators.cli.setup failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def create_mlflow_runs(home: Path, n: int) -> list[str]:
    code = (
        "import json, mlflow\n"
        "c = mlflow.MlflowClient()\n"
        "e = c.get_experiment_by_name('gangflow') or c.get_experiment(c.create_experiment('gangflow'))\n"
        f"print(json.dumps([c.create_run(e.experiment_id, run_name='bench-bare-{{}}'.format(i)).info.run_id for i in range({n})]))\n"
    )
    env = clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}")
    done = subprocess.run([PY, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"creating MLflow runs failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def task_instance(home: Path, run_id: str, task_id: str) -> dict:
    with sqlite3.connect(home / "airflow" / "airflow.db") as db:
        row = db.execute(
            "SELECT state, start_date, end_date, try_number FROM task_instance WHERE dag_id = ? AND run_id = ? AND task_id = ?",
            ("train_pipeline", run_id, task_id),
        ).fetchone()
    if row is None:
        raise RuntimeError(f"no task instance {task_id} in run {run_id}")
    state, start, end, tries = row
    return {"state": state, "start": utc_epoch(start), "end": utc_epoch(end), "try_number": tries}


def run_task_side(home: Path, conf: dict, log: Path, probe: Path | None = None) -> dict:
    """One `dag.test()` of train_pipeline; the training task's times from the metadata DB."""
    task_id = f"train_local_{conf['world_size']}"
    env = pipeline_env(home) | (probe_env(probe) if probe else {})
    result, text, dag_wall = run_demo(conf, env, log, timeout=900)
    ti = task_instance(home, result["dag_run_id"], task_id)
    if ti["state"] != "success" or ti["try_number"] != 1:
        raise RuntimeError(f"{task_id}: state {ti['state']}, try {ti['try_number']} (expected one successful try)")
    launch = next((m for m in map(_LAUNCH.match, text.splitlines()) if m), None)
    if launch is None:
        raise RuntimeError(f"no 'launching gang' line in {log}")
    argv = shlex.split(launch.group(3))
    trainer_args = argv[argv.index("trainer") + 1 :]
    run_dir = Path(trainer_args[trainer_args.index("--run-dir") + 1])
    launched = utc_epoch(launch.group(1))
    split = phases(run_dir, launched, ti["end"])
    out = {
        "wall_s": ti["end"] - ti["start"],
        "dag_test_wall_s": dag_wall,
        "pre_launch_s": launched - ti["start"],
        **split,
        "run_dir": str(run_dir),
        "trainer_args": trainer_args,
        "world_size": int(launch.group(2)),
    }
    out["tail_s"] = split.get("tail_s")  # final event -> task end: torchrun exit, XCom push, state update
    if probe:
        out |= {f"detail_{k}": v for k, v in (rank0_phases(probe, launched) | task_process_phases(probe)).items()}
    return out


def bare_args(task_args: list[str]) -> list[str]:
    """The task's trainer arguments without its --run-dir (the bare run gets a fresh one)."""
    args, skip = [], False
    for item in task_args:
        if skip:
            skip = False
        elif item == "--run-dir":
            skip = True
        else:
            args.append(item)
    return args


def bench_task(home: Path, *, reps: int, steps: int, world_size: int, every: int, mlflow_arm: bool) -> dict:
    note(f"setting up a fresh state dir {home} (Airflow DB, pool, dataset, MLflow)")
    setup_state(home)
    run_ids = create_mlflow_runs(home, reps) if mlflow_arm else []
    warm_up(home, world_size)
    conf = {"world_size": world_size, "max_steps": steps, "checkpoint_every_steps": every, "promotion_floor": 0.0}
    logs = home / "bench-logs"
    logs.mkdir(exist_ok=True)
    task, bare, bare_ml = [], [], []
    args: list[str] | None = None
    digests = []

    def do_task(i: int) -> None:
        nonlocal args
        r = run_task_side(home, conf, logs / f"task-{i}.log", probe=home / "probe" / f"task-{i}")
        args = args or bare_args(r["trainer_args"])
        task.append(r)
        digests.append(safetensors_digest(Path(r["run_dir"]) / "final" / "model.safetensors"))
        note(f"rep {i + 1}: training task {r['wall_s']:.2f}s (pre-launch {r['pre_launch_s']:.2f}s, "
             f"start-up {r.get('startup_s', 0):.2f}s, loop {r.get('train_to_final_s', 0):.2f}s, tail {r.get('tail_s', 0):.2f}s; "
             f"whole dag.test {r['dag_test_wall_s']:.1f}s)")  # fmt: skip

    def do_bare(i: int, mlflow: bool) -> None:
        run_dir = home / "bare" / f"{'mlflow' if mlflow else 'plain'}-{i}"
        probe = home / "probe" / f"bare-{'mlflow-' if mlflow else ''}{i}"
        env = clean_env(**probe_env(probe))
        if mlflow:
            env |= {"MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}", "MLFLOW_RUN_ID": run_ids[i]}
        r = bare_torchrun(run_dir, args, world_size=world_size, env=env, log=logs / f"bare-{'mlflow-' if mlflow else ''}{i}.log")
        r |= {f"detail_{k}": v for k, v in rank0_phases(probe, r["t0"]).items()}
        (bare_ml if mlflow else bare).append(r)
        digests.append(safetensors_digest(run_dir / "final" / "model.safetensors"))
        note(f"rep {i + 1}: bare torchrun{' + MLflow' if mlflow else ''} {r['wall_s']:.2f}s (start-up {r.get('startup_s', 0):.2f}s, "
             f"loop {r.get('train_to_final_s', 0):.2f}s, tail {r.get('tail_s', 0):.2f}s)")  # fmt: skip

    for i in range(reps):
        # Alternate the order (T B M, B M T, ...) so a drift in the machine's load hits both sides;
        # the first repetition starts with the task, whose log line gives the trainer arguments.
        arms = [lambda: do_task(i), lambda: do_bare(i, False)] + ([lambda: do_bare(i, True)] if mlflow_arm else [])
        if i % 2:
            arms = arms[1:] + arms[:1]
        for arm in arms:
            arm()

    pairs = [t["wall_s"] / b["wall_s"] for t, b in zip(task, bare)]

    def phase_medians(rows: list[dict]) -> dict:
        keys = ["wall_s", "pre_launch_s", "startup_s", "train_to_final_s", "tail_s", "train_s"]
        keys += sorted({k for r in rows for k in r if k.startswith("detail_")})
        return {k: round(statistics.median(r[k] for r in rows), 3) for k in keys if all(r.get(k) is not None for r in rows)}

    out = {
        "train_task_over_bare_torchrun": round(statistics.median(pairs), 4),
        "train_task_over_bare_pairs": summary(pairs),
        "train_task_seconds": summary([t["wall_s"] for t in task], 3),
        "bare_torchrun_seconds": summary([b["wall_s"] for b in bare], 3),
        "phases": {"train_task": phase_medians(task), "bare_torchrun": phase_medians(bare)},
        "same_final_weights": all(d == digests[0] for d in digests),
        "config": {"world_size": world_size, "max_steps": steps, "checkpoint_every_steps": every, "pairs": reps},
        "bare_trainer_args": args,
    }
    if mlflow_arm:
        out["bare_torchrun_mlflow_seconds"] = summary([b["wall_s"] for b in bare_ml], 3)
        out["train_task_over_bare_mlflow"] = round(statistics.median(t["wall_s"] / b["wall_s"] for t, b in zip(task, bare_ml)), 4)
        out["bare_mlflow_over_bare"] = round(statistics.median(m["wall_s"] / b["wall_s"] for m, b in zip(bare_ml, bare)), 4)
        out["phases"]["bare_torchrun_mlflow"] = phase_medians(bare_ml)
    out["task_minus_bare_s"] = where_the_gap_goes(out["phases"])
    out["dag_test_seconds"] = summary([t["dag_test_wall_s"] for t in task], 2)
    return out


def where_the_gap_goes(ph: dict) -> dict:
    """Task minus bare torchrun, per phase (medians, seconds): where the training task's extra time goes."""
    t, b = ph["train_task"], ph["bare_torchrun"]

    def d(key: str, side: dict = b) -> float | None:
        return round(t[key] - side.get(key, 0.0), 3) if key in t else None

    m = ph.get("bare_torchrun_mlflow", {})

    def ml(key: str) -> float | None:  # the trainer's own MLflow cost in a phase: bare+MLflow - bare
        return round(m[key] - b[key], 3) if key in m and key in b else None

    gap = {
        "total": d("wall_s"),
        "pre_launch (task only)": t.get("pre_launch_s"),
        "  of which GangTrainingOperator.mlflow_run (run lookup/creation before the launch: 0 with the relay)": t.get("detail_op_mlflow_run_s"),
        "startup": d("startup_s"),
        "  beside it, not on the path: the relay opening the MLflow run (thread, incl. the mlflow import)": t.get("detail_op_open_run_s"),
        "  of which the trainer's MlflowSink init on rank 0 (0 with the relay)": d("detail_mlflow_s"),
        "  of which torchrun agent": d("detail_torchrun_agent_s"),
        "train_to_final": d("train_to_final_s"),
        "tail": d("tail_s"),
        "  of which the relay's flush and final/ upload after the gang exits": t.get("detail_op_relay_finish_s"),
        "rank 0 logging to MLflow itself instead (bare+MLflow - bare, whole run)": ml("wall_s"),
    }
    return {k: v for k, v in gap.items() if v is not None}


MEASURES = {
    "dag_parse_seconds": "median over cold processes of executing dags/train_pipeline.py (importlib spec_from_file_location + "
    "exec_module) after `import airflow.sdk` was timed separately (airflow_sdk_import_seconds)",
    "train_task_over_bare_torchrun": "median over interleaved pairs of (training task's TI end_date - start_date in Airflow's "
    "metadata DB, from a dag.test() run of train_pipeline) / (wall time of a bare `torchrun --standalone --max-restarts 0 "
    "-m trainer` with the task's own trainer arguments and a fresh run dir, no MLflow)",
    "task_side_includes": "template rendering, capacity check, LocalBackend.run (torchrun with --tee/--log-dir, "
    "log streaming into the task log) with the MLflow relay beside it (run lookup/creation in a thread, metrics.jsonl relayed), "
    "the relay's flush and final/ upload, XCom push; not the worker fork nor the DAG re-parse (dag.test runs the task in-process)",
    "bare_side_includes": "spawn of torchrun to its exit: rendezvous, rank start-up (torch import, gloo init), training, final "
    "evaluation and weights, teardown",
    "phases": "pre_launch: TI start -> 'launching gang' log line; startup: launch (bare: spawn) -> trainer 'start' event; "
    "train_to_final: 'start' -> 'final' event (loop + test evaluation + final/); tail: 'final' event -> TI end (bare: exit); "
    "detail_*: rank 0's start-up phases and the task process's MLflow calls, measured from outside the trainer by "
    "benchmarks/probe/sitecustomize.py (see benchmarks/restart.py)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved task/bare pairs (default 3)")
    parser.add_argument("--steps", type=int, default=300, help="train.max_steps of both sides (default 300)")
    parser.add_argument("--every", type=int, default=100, help="checkpoint.every_steps (default 100)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--parse-reps", type=int, default=7, help="cold processes for dag_parse_seconds (default 7)")
    parser.add_argument("--no-mlflow-arm", dest="mlflow_arm", action="store_false",
                        help="skip the bare torchrun + MLflow arm (saves about a third of the time)")
    parser.add_argument("--parse-only", action="store_true", help="measure dag_parse_seconds only (seconds)")
    parser.add_argument("--home", type=Path, help="state dir to create (default: a temporary one, removed afterwards)")
    parser.add_argument("--keep", action="store_true", help="keep the state dir, logs and run dirs")
    args = parser.parse_args(argv)

    started = time.monotonic()
    home = args.home or Path(tempfile.mkdtemp(prefix="gangflow-bench-pipeline-"))
    home.mkdir(parents=True, exist_ok=True)
    try:
        result: dict = {"benchmark": "pipeline"}
        note("dag_parse_seconds: cold processes")
        result |= bench_parse(home, args.parse_reps)
        if not args.parse_only:
            result |= bench_task(home, reps=args.reps, steps=args.steps, world_size=args.world_size, every=args.every,
                                 mlflow_arm=args.mlflow_arm)  # fmt: skip
        result["goals"] = {"dag_parse_seconds": "<= 0.2", "train_task_over_bare_torchrun": "<= 1.10 (aim 1.05)"}
        result["measures"] = MEASURES
        result["benchmark_seconds"] = round(time.monotonic() - started, 1)
        if args.keep:
            result["home"] = str(home)
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
