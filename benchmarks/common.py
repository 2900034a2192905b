"""Helpers shared by `benchmarks/pipeline.py` and `benchmarks/goodput.py` (stdlib only: the
benchmark processes themselves stay light, everything measured runs in subprocesses).

Conventions: progress goes to stderr, the result is one JSON object on the last line of stdout;
repetitions of the two sides of a comparison are interleaved (A B A B ...) because the machine
is shared and noisy, and medians are reported together with their spread.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))
PROBE = Path(__file__).resolve().parent / "probe"
_STARTED = time.monotonic()


def note(message: str) -> None:
    """Progress line on stderr, stamped with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def summary(values: list[float], digits: int = 4) -> dict:
    """Median, min, max and the relative spread ((max - min) / median) of repetitions."""
    values = [float(v) for v in values]
    med = statistics.median(values)
    return {
        "median": round(med, digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "spread": round((max(values) - min(values)) / med, 3) if med else None,
        "n": len(values),
        "values": [round(v, digits) for v in values],
    }


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without Airflow/MLflow/gangflow settings, one BLAS thread per rank, and
    bytecode cached as on any deployed machine: a PYTHONDONTWRITEBYTECODE in the environment (this
    workplace's sandboxes set it) would make every process compile gangflow's own modules again,
    which no Airflow worker or rank does (the DAG file's parse: 0.29 -> 0.21 s here, 2026-12-02)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "MLFLOW", "GANGFLOW")) and k != "PYTHONDONTWRITEBYTECODE"}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return env | extra


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def events(run_dir: Path, name: str) -> list[dict]:
    """The trainer's `metrics.jsonl` events called `name` (`start`, `resume`, `checkpoint`, `final`)."""
    return [row for row in read_jsonl(Path(run_dir) / "metrics.jsonl") if row.get("event") == name]


def last_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    raise ValueError(f"no JSON object on the last line:\n{text[-3000:]}")


def run_demo(conf: dict, env: dict[str, str], log: Path, timeout: float) -> tuple[dict, str, float]:
    """One `python -m operators.cli.demo --conf CONF` (what `make demo` runs: dag.test()), its output in
    `log`. Returns (the summary JSON, the log text, wall seconds); raises unless the run succeeded."""
    t0 = time.time()
    with open(log, "w") as out:
        code = subprocess.run([PY, "-m", "operators.cli.demo", "--conf", json.dumps(conf)], cwd=ROOT, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode  # fmt: skip
    wall = time.time() - t0
    text = log.read_text()
    result = last_json_line(text)
    if code != 0 or result.get("state") != "success":
        raise RuntimeError(f"DAG run failed (exit {code}): {result}; see {log}")
    return result, text, wall


def utc_epoch(text: str) -> float:
    """Epoch seconds of an Airflow/structlog UTC timestamp ('2026-11-29 19:16:15.18' or '...T...Z')."""
    text = text.strip().rstrip("Z").replace("T", " ")
    text = text.split("+")[0]
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp()


def bare_torchrun(run_dir: Path, trainer_args: list[str], *, world_size: int, env: dict[str, str], log: Path) -> dict:
    """`torchrun --standalone --nproc-per-node N --max-restarts 0 -m trainer ...`, timed from just
    before the process is spawned until it has exited."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(world_size), "--max-restarts", "0",
           "-m", "trainer", "--run-dir", str(run_dir), *trainer_args]  # fmt: skip
    with open(log, "w") as out:
        t0 = time.time()
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        t1 = time.time()
    if code != 0:
        raise RuntimeError(f"bare torchrun exited {code}; see {log}:\n{log.read_text()[-3000:]}")
    return {"wall_s": t1 - t0, "t0": t0, "t1": t1, **phases(run_dir, t0, t1)}


def phases(run_dir: Path, t0: float, t1: float) -> dict:
    """Split [t0, t1] with the trainer's own events: start-up (until the `start` event), the
    training loop (`start` to `final`, which includes the test-set evaluation and writing
    final/), and the tail (`final` until t1: process-group teardown, tracking close, exit)."""
    start, final = events(run_dir, "start"), events(run_dir, "final")
    if not start or not final:
        return {}
    return {
        "startup_s": start[-1]["time"] - t0,
        "train_to_final_s": final[-1]["time"] - start[-1]["time"],
        "tail_s": t1 - final[-1]["time"],
        "train_s": final[-1].get("train_s"),
    }


def safetensors_digest(path: Path) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and raw bytes (safetensors header parsed by hand:
    no torch or numpy import needed)."""
    data = Path(path).read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    out = {}
    for name, info in sorted(header.items()):
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        h = hashlib.sha256(f"{info['dtype']}{info['shape']}".encode())
        h.update(body[start:end])
        out[name] = h.hexdigest()
    return out


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def warm_up(scratch: Path, world_size: int = 2) -> None:
    """One short, discarded gang run (10 steps on the repo's data/digits), so the first measured
    repetition does not pay for a cold page cache (torch's libraries, the data files)."""
    if not (ROOT / "data" / "digits" / "train.parquet").is_file():
        return
    try:
        r = bare_torchrun(scratch / "warm-up", ["--config", str(ROOT / "params.yaml"), "--set", "train.max_steps=10"],
                          world_size=world_size, env=clean_env(), log=scratch / "warm-up.log")  # fmt: skip
        note(f"warm-up run (not counted): {r['wall_s']:.1f}s")
    except RuntimeError as exc:
        note(f"warm-up run failed (ignored): {str(exc).splitlines()[0]}")


# -- start-up probe (benchmarks/probe/sitecustomize.py) -----------------------------------------


def probe_env(folder: Path) -> dict[str, str]:
    """Environment that makes every Python process under it (torchrun's agent, the ranks, an
    Airflow task process) record its phases into `folder` (see probe/sitecustomize.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(PROBE), os.environ.get("PYTHONPATH", "")) if p)
    return {"GANGFLOW_BENCH_PROBE": str(folder), "PYTHONPATH": path}


def probe_marks(folder: Path) -> list[dict[str, float]]:
    """Per process: {mark: first time seen}, with "argv0"."""
    out = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        marks: dict = {}
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            marks.setdefault(row["mark"], row["t"])
            marks.setdefault("argv0", row.get("argv0", ""))
            if marks.get("rank") is None:  # a forked rank gets RANK after its first marks
                marks["rank"] = row.get("rank")
        out.append(marks)
    return out


def _span(m: dict, name: str) -> float:
    b, e = m.get(f"{name}:begin"), m.get(f"{name}:end")
    return (e - b) if b is not None and e is not None else 0.0


def rank0_phases(folder: Path, t0: float) -> dict:
    """Rank 0's start-up phases (seconds) from the probe, `t0` being the torchrun launch:
    torchrun_agent (launch -> rank process exists), interpreter, imports (-> trainer main),
    data_md5 (-> resolve_data returned), rendezvous, data_load, optimizer_dynamo (torch._dynamo
    import, triggered by the first torch.optim optimizer), mlflow (MlflowSink init), checkpoint_load,
    other (the rest up to the end of the first step); plus close_s (Trainer.close: tracking flush)."""
    ranks = [m for m in probe_marks(folder) if "call:main:begin" in m]
    if not ranks:
        return {}
    m = next((r for r in ranks if r.get("rank") == "0"), ranks[0])  # torchrun sets RANK
    first = m.get("call:first_step:end")
    out = {
        "launch_to_first_step_s": (first - t0) if first else None,
        "torchrun_agent_s": m.get("process_start", m["site"]) - t0,
        "interpreter_s": m["site"] - m.get("process_start", m["site"]),
        "imports_s": m["call:main:begin"] - m["site"],
        "torch_import_s": _span(m, "import:torch"),
        "data_md5_s": m.get("call:data_resolve_md5:end", m["call:main:begin"]) - m["call:main:begin"],
        "rendezvous_s": _span(m, "call:rendezvous"),
        "data_load_s": _span(m, "call:data_load"),
        "optimizer_dynamo_s": _dynamo_wait(m),
        "dynamo_import_s": _span(m, "import:torch._dynamo"),
        "mlflow_s": _span(m, "call:mlflow_connect"),
        "mlflow_import_s": _span(m, "import:mlflow"),
        "checkpoint_load_s": _span(m, "call:checkpoint_load"),
        "close_s": _span(m, "call:close"),
    }
    if first:
        named = ("torchrun_agent_s", "interpreter_s", "imports_s", "data_md5_s", "rendezvous_s", "data_load_s",
                 "optimizer_dynamo_s", "mlflow_s", "checkpoint_load_s")  # fmt: skip
        out["other_s"] = out["launch_to_first_step_s"] - sum(out[k] for k in named)
    if "atexit" in m and "call:close:end" in m:
        out["close_to_exit_s"] = m["atexit"] - m["call:close:end"]
    return out


def _dynamo_wait(m: dict) -> float:
    """The part of rank 0's torch._dynamo import on its path to the first step. Imported on need
    (by the first optimizer, right after the model is built): the whole import. Imported in a
    thread from the start (trainer/__main__.py): what is left when the model is built."""
    begin, end, need = m.get("import:torch._dynamo:begin"), m.get("import:torch._dynamo:end"), m.get("call:model_init:end")
    if begin is None or end is None:
        return 0.0
    if need is None or begin >= need:
        return end - begin
    return max(0.0, end - need)


def task_process_phases(folder: Path) -> dict:
    """The Airflow task process's (dag.test's) MLflow costs before the launch, from the probe."""
    procs = [m for m in probe_marks(folder) if "call:op_execute:begin" in m]
    if not procs:
        return {}
    m = procs[0]
    # MLflow imported by an earlier task of the same dag.test process is not the training task's cost
    imported_in_task = m.get("import:mlflow:begin", 0.0) >= m["call:op_execute:begin"]
    return {"op_mlflow_import_s": _span(m, "import:mlflow") if imported_in_task else 0.0,
            "op_mlflow_run_s": _span(m, "call:op_mlflow_run"),
            "op_open_run_s": _span(m, "call:op_open_run"),  # in the relay's thread, beside the launch
            "op_relay_finish_s": _span(m, "call:op_relay_finish"),
            "op_finish_s": _span(m, "call:op_finish")}  # fmt: skip
