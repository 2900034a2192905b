"""The platform baseline (`dags/platform_baseline.py`, docs/observability.md "Baselines"): collective
bandwidth, storage read throughput and step time per topology, recorded in MLflow and compared with
the last accepted baseline of the same runtime.

Each figure is a name and a value with a direction (`Figure.higher_is_better`); a figure regressed
when it is worse than the accepted baseline's by more than `threshold` (a fraction). A baseline with
no regression becomes the accepted one; one with regressions fails naming each.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from operators.config import settings
from operators.exceptions import GangflowError, InvalidParams
from operators.utils.processes import stop_tree, tagged_env

EXPERIMENT = "gangflow-baseline"
TAG_ACCEPTED = "gangflow.baseline.accepted"
TAG_RUNTIME = "gangflow.baseline.runtime"
TAG_REGRESSIONS = "gangflow.baseline.regressions"
#: Message sizes of the all-reduce sweep (bytes): latency-bound to bandwidth-bound.
COLLECTIVE_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)
LogFn = Callable[[str], None]


class BaselineRegressed(GangflowError):
    """Figures regressed beyond the threshold against the last accepted baseline."""


def _size_name(nbytes: int) -> str:
    for unit, scale in (("mb", 1 << 20), ("kb", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}b"


def higher_is_better(name: str) -> bool:
    """Bandwidths and throughputs are better higher; times lower."""
    return any(unit in name for unit in ("_gbps", "_mbps", "_per_s"))


def _torchrun(nproc: int, module_args: Sequence[str], *, cwd: Path, timeout_s: float) -> None:
    """`-m trainer` through trainer.launch (torch imported once, ranks forked: as the local backend
    launches), any other module through torchrun."""
    launcher = "trainer.launch" if module_args[0] == "trainer" else "torch.distributed.run"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    for key in ("GANGFLOW_FAULT", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "GANGFLOW_METRICS_PORT"):
        env.pop(key, None)
    # without --log-dir torchrun keeps its ranks' error files in a temp folder it never removes
    env = tagged_env(env)  # torchrun starts each rank in a session of its own: found by this tag on a timeout
    with tempfile.TemporaryDirectory(prefix="gangflow-torchrun-") as log_dir:
        cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", "0", "--log-dir", log_dir, "-m", *module_args]
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_tree(proc, grace=10.0, env=env)  # no rank may outlive it: the next measurement shares the machine
            proc.communicate()
            raise GangflowError(f"{module_args[0]} on {nproc} rank(s) did not finish within {timeout_s:g} s; "
                                "its ranks were stopped") from None
    if proc.returncode != 0:
        raise GangflowError(f"{' '.join(module_args[:1])} on {nproc} rank(s) failed (exit {proc.returncode}): "
                            f"{output[-3000:]}")


def topologies(world_size: int) -> list[int]:
    """1 rank and N ranks in one process group on this machine (N pods: only on Kubernetes)."""
    return sorted({1, world_size})


def measure_collectives(world_size: int, *, sizes: Sequence[int] = COLLECTIVE_SIZES, iters: int = 20,
                        log: LogFn = print) -> dict[str, float]:
    """All-reduce bus bandwidth (GB/s) by message size for 1 and `world_size` ranks (`trainer.collectives`)."""
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gangflow-baseline-") as tmp:
        for n in topologies(world_size):
            out = Path(tmp) / f"collectives-{n}.json"
            _torchrun(n, ["trainer.collectives", "--out", str(out), "--sizes", ",".join(map(str, sizes)), "--iters", str(iters)],
                      cwd=settings.PROJECT_ROOT, timeout_s=600)
            result = json.loads(out.read_text())
            for item in result["results"]:
                key = "algbw" if n == 1 else "busbw"  # one rank moves nothing over a link: its figure is algbw
                figures[f"allreduce_{key}_gbps_r{n}_{_size_name(item['bytes'])}"] = round(item[f"{key}_gbps"], 6)
            log(f"all-reduce on {n} rank(s) ({result['backend']}, {result['device']}): "
                + ", ".join(f"{_size_name(i['bytes'])} {i['busbw_gbps' if n > 1 else 'algbw_gbps']:.3f} GB/s" for i in result["results"]))
    return figures


def measure_storage(*, remote: str | None = None, min_bytes: int = 32 << 20, min_s: float = 0.5,
                    log: LogFn = print) -> dict[str, float]:
    """Read throughput (MB/s) of the DVC remote: every object read and md5-hashed, as ranks verify
    a fetched version; repeated until `min_bytes` and `min_s` so a small remote still times reads."""
    import fsspec

    if remote is None:
        from operators.hooks.dvc import remote_url

        remote = remote_url()
    fs, root = fsspec.core.url_to_fs(remote)
    objects = [p for p in fs.find(root) if not p.endswith(".dir")] or fs.find(root)
    if not objects:
        raise GangflowError(f"the DVC remote {remote} holds no objects: publish a dataset first (make setup)")
    total, t0 = 0, time.perf_counter()
    while total < min_bytes or time.perf_counter() - t0 < min_s:
        for path in objects:
            digest = hashlib.md5()
            with fs.open(path, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
                    total += len(chunk)
        if total == 0:
            break
    seconds = time.perf_counter() - t0
    rate = total / seconds / 1e6
    log(f"DVC remote read+md5: {total / 1e6:.1f} MB in {seconds:.2f}s over {len(objects)} object(s): {rate:.1f} MB/s")
    return {"storage_read_mbps": round(rate, 3)}


def measure_step_time(world_size: int, *, steps: int = 30, pipelines: Sequence[str] | None = None,
                      log: LogFn = print) -> dict[str, float]:
    """Median step time (ms) of the pipelines' example models (default: every pipeline) on 1 and
    `world_size` ranks."""
    import statistics

    from operators.config.pipelines import pipeline_files

    files = pipeline_files()  # one broken pipeline file hides no other's measurement
    known = files.configs
    for name, bad in sorted(files.broken.items()):
        if name in (pipelines or ()):
            raise bad.error
        if not pipelines:
            log(f"step time of {name}: not measured, its pipeline file is broken ({bad.error})")
    unknown = sorted(set(pipelines or ()) - set(known))
    if unknown:
        raise GangflowError(f"pipelines={unknown}: accepted values are {', '.join(sorted(known))}")
    figures: dict[str, float] = {}
    for name, pipe in sorted(known.items()):
        if pipelines and name not in pipelines:
            continue
        for n in topologies(world_size):
            with tempfile.TemporaryDirectory(prefix="gangflow-baseline-") as run_dir:
                _torchrun(n, ["trainer", "--run-dir", run_dir, "--config", pipe.trainer_config,
                              "--set", f"train.max_steps={steps}", "--set", "train.log_every_steps=5",
                              "--set", f"checkpoint.every_steps={steps * 10}", "--set", "tracking.progress_every_s=0"],
                          cwd=settings.PROJECT_ROOT, timeout_s=600)
                lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
            times = [r["step_time_s"] for r in lines if r.get("event") is None and "step_time_s" in r][1:]  # first window: warm-up
            if not times:
                raise GangflowError(f"pipeline {name} on {n} rank(s) logged no step times")
            figures[f"step_time_ms_{name}_r{n}"] = round(1000 * statistics.median(times), 4)
            log(f"step time of {name} on {n} rank(s): {figures[f'step_time_ms_{name}_r{n}']:.2f} ms")
    return figures


def environment() -> dict[str, str]:
    """What the figures were measured on: the runtime, image, driver and torch versions."""
    import torch

    driver = "none"
    if torch.cuda.is_available():
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = "unknown"
    return {
        "runtime": os.environ.get("GANGFLOW_BASELINE_RUNTIME", "local"),
        "image": os.environ.get("GANGFLOW_IMAGE", "none (local virtualenv)"),
        "driver_version": driver,
        "cuda_version": str(torch.version.cuda or "none"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": platform.node(),
        "cpus": str(os.cpu_count()),
    }


@dataclass(frozen=True)
class Comparison:
    compared_with: str | None
    regressions: list[dict[str, Any]]


def compare(figures: Mapping[str, float], accepted: Mapping[str, float] | None, *, threshold: float,
            accepted_run: str | None = None) -> Comparison:
    """Each figure worse than the accepted baseline's by more than `threshold` (a fraction)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
        # NaN compares false with everything: no figure would ever regress
        raise InvalidParams(f"threshold={threshold!r}: must be a finite fraction > 0")
    if accepted is None:
        return Comparison(None, [])
    regressions = []
    for name, value in sorted(figures.items()):
        before = accepted.get(name)
        if before is None or before <= 0:
            continue
        change = (value - before) / before  # + is higher
        worse = -change if higher_is_better(name) else change
        if worse > threshold:
            regressions.append({"figure": name, "baseline": before, "value": value, "worse_by": round(worse, 4)})
    return Comparison(accepted_run, regressions)


def last_accepted(client, experiment_id: str, runtime: str) -> tuple[str, dict[str, float]] | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_ACCEPTED}` = 'true' and tags.`{TAG_RUNTIME}` = '{runtime}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return (runs[0].info.run_id, dict(runs[0].data.metrics)) if runs else None


def record(figures: Mapping[str, float], *, threshold: float, dag_id: str, dag_run_id: str,
           log: LogFn = print) -> dict[str, Any]:
    """Log the figures to MLflow, compare with the last accepted baseline of this runtime, mark this
    one accepted when nothing regressed. Returns the summary; raise `BaselineRegressed` separately."""
    from operators.hooks import mlflow as tracking
    from trainer.tracking import log_batches

    env = environment()
    client = tracking.get_client()
    experiment_id = tracking.ensure_experiment(client, EXPERIMENT)
    previous = last_accepted(client, experiment_id, env["runtime"])
    result = compare(figures, previous[1] if previous else None, threshold=threshold,
                     accepted_run=previous[0] if previous else None)
    run_id = client.create_run(experiment_id, run_name=f"baseline-{dag_run_id}"[:250], tags={
        TAG_RUNTIME: env["runtime"], "gangflow.dag_id": dag_id, "gangflow.dag_run_id": dag_run_id,
        **{f"gangflow.baseline.{k}": v for k, v in env.items()}}).info.run_id
    now = int(time.time() * 1000)
    log_batches(client, run_id, metrics=[(k, float(v), now, 0) for k, v in figures.items()],
                params=[("threshold", str(threshold)), *[(k, v) for k, v in env.items()]],
                tags=[(TAG_ACCEPTED, "false" if result.regressions else "true"),
                      ("gangflow.baseline.compared_with", result.compared_with or "none"),
                      (TAG_REGRESSIONS, json.dumps([r["figure"] for r in result.regressions])[:5000])])
    client.set_terminated(run_id, "FAILED" if result.regressions else "FINISHED")
    where = f"against accepted baseline {result.compared_with}" if result.compared_with else "(the first: nothing to compare with)"
    log(f"baseline {run_id} {where}: {len(result.regressions)} regression(s) beyond {threshold:.0%}")
    return {"run_id": run_id, "figures": dict(figures), "environment": env, "compared_with": result.compared_with,
            "regressions": result.regressions, "threshold": threshold}


def regression_message(summary: Mapping[str, Any]) -> str:
    items = "; ".join(f"{r['figure']} {r['value']:g} vs {r['baseline']:g} ({r['worse_by']:.0%} worse)" for r in summary["regressions"])
    return (f"{len(summary['regressions'])} figure(s) regressed beyond {summary['threshold']:.0%} against accepted "
            f"baseline {summary['compared_with']}: {items}")
