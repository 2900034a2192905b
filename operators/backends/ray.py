"""The `ray` backend: the gang as Ray Train's `TorchTrainer` on a Ray cluster.

Each Ray Train worker runs the trainer's own main (`python -m trainer`'s, same arguments) with the
rank and world size of Ray Train's context and the process group Ray Train made; checkpoints go to
the run dir (gangflow's contract, not Ray's checkpoints) and data by content address, as under
torchrun. Ray's own retries are off (`FailureConfig(max_failures=0)`): Airflow's classified retry
is the one budget. Without an address the driver starts a cluster of its own on 127.0.0.1 (a fresh
temp dir, no dashboard, one CPU per worker) and it ends with the driver; `RAY_ADDRESS` (or the
`address` option) names an existing cluster, which must see the run dir and the trainer config.

The driver is a child process (`python -m operators.backends.ray`), so the task's process never
imports Ray and a kill stops the driver, its cluster and the workers together. Its last line is
`gangflow-ray-result: {json}`; the workers' lines reach the task log as `[rank N] ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import secrets
import signal
import stat
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TextIO

from operators.backends.base import GangResult, GangSpec, LogFn, driver_argv
from operators.backends.local import LocalBackend, ProcessGangBackend, errors_since, run_dir_folder
from operators.exceptions import GangCapacityError
from operators.failures.evidence import RESULT_PREFIX, DriverOutput
from trainer.storage import LinkInPath

# Ray Train's placement-group cleaner polls the State API, which the dashboard serves; without the
# dashboard it says so every second. Kept in the driver's log file, not repeated in the task log.
_NOISE = "State API may be temporarily unavailable"
# What the driver passes on to the workers by name (values through Ray's runtime env, never argv).
EXPORTED = ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GANGFLOW_HOME", "GANGFLOW_PROJECT",
            "GANGFLOW_FAULT", "GANGFLOW_ALLOW_FAULTS", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
            "RAY_TRAIN_ENABLE_PRINT_PATCH")


def open_new_log(path: Path) -> TextIO:
    """`path` written anew, never through what is there: a link, a FIFO or anything but a regular
    file is refused (LinkInPath names it); a file with another name (a `cp -al` backup's) is
    unlinked, not emptied."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise LinkInPath(errno.ELOOP, f"{path} is a link or not a regular file; links in a run dir are never "
                                          "followed for writing")
        os.unlink(path)
    # O_EXCL: a name that appeared since is an error, never followed or opened
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "w")


class RayBackend(ProcessGangBackend):
    """Ray Train's TorchTrainer on a local Ray cluster (started per try) or the one at RAY_ADDRESS."""

    name = "ray"
    launchers = ("torchrun",)  # TorchTrainer makes the torch process group; mpirun has no place in it
    runs_user_code = False  # its workers run gangflow's loop (trainer.ray_worker); user code: not yet

    def __init__(self, *, address: str | None = None, cpus_per_worker: int = 1, grace_period_s: float = 60.0,
                 dataset_remote: str | None = None, relay_tracking: bool = True):
        if not isinstance(cpus_per_worker, int) or isinstance(cpus_per_worker, bool) or cpus_per_worker < 1:
            raise ValueError(f"cpus_per_worker={cpus_per_worker!r}: must be an integer >= 1")
        if not isinstance(relay_tracking, bool):
            raise ValueError(f"relay_tracking={relay_tracking!r}: accepted values are true, false")
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.cpus_per_worker = cpus_per_worker
        self.grace_period_s = grace_period_s
        self.relay_tracking = relay_tracking
        # the data arguments (`--set data.version=... data.remote=...`) are the local backend's
        self._data = LocalBackend(dataset_remote=dataset_remote)
        super().__init__()

    def check_capacity(self, spec: GangSpec) -> None:
        if self.address:  # an existing cluster: Ray's scheduler knows its size
            return
        cores = os.cpu_count() or 1
        if spec.world_size * self.cpus_per_worker > cores:
            raise GangCapacityError(
                f"world_size={spec.world_size}: a local Ray cluster here has {cores} CPUs and each worker takes "
                f"{self.cpus_per_worker} (accepted: 1..{cores // self.cpus_per_worker}); set RAY_ADDRESS for a larger cluster"
            )

    def command(self, spec: GangSpec) -> list[str]:
        """The driver's argv: values as argv items, never shell text; env values stay in the env."""
        return driver_argv(sys.executable, spec, run_dir=spec.run_dir, cpus_per_worker=self.cpus_per_worker,
                           exports=sorted({*EXPORTED, *spec.env}), address=self.address,
                           trainer_args=[*spec.trainer_args(), *self._data._data_args(spec)])

    def _launch(self, spec: GangSpec, log: LogFn, pauses: set[str]) -> GangResult:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **spec.env}
        env["PYTHONUNBUFFERED"] = "1"
        project = os.environ.get("GANGFLOW_PROJECT") or str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [project, env.get("PYTHONPATH")]))
        # Ray's output as plain lines, one per print, none folded into "[repeated Nx]"
        env |= {"RAY_USAGE_STATS_ENABLED": "0", "RAY_COLOR_PREFIX": "0", "RAY_DEDUP_LOGS": "0",
                "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
        if self.relay_tracking:
            for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
                env.pop(key, None)
        cmd = self.command(spec)
        log(f"launching gang of {spec.world_size} Ray Train workers: {' '.join(cmd)}")
        launched_at = time.time()
        output = DriverOutput()
        log_path = run_dir_folder(spec.run_dir, "ray") / f"try-{spec.attempt}.log"  # the driver's own output, as printed
        with open_new_log(log_path) as raw_log, self._gang_process(cmd, spec, log, pauses, env=env, cwd=project) as proc:
            for raw in proc.stdout:
                raw_log.write(raw)
                rank, text = output.feed(raw)
                if rank is not None:
                    log(f"[rank {rank}] {text}")
                elif text is not None and _NOISE not in text:
                    log(f"[ray] {text}")
        exit_code = proc.returncode
        if exit_code == 0 and output.result and output.result.get("succeeded"):
            return GangResult(succeeded=True, exit_code=0, resumed_from_step=output.resumed_from)
        evidence = output.evidence(exit_code, errors_since(Path(spec.run_dir), launched_at))
        return GangResult(succeeded=False, exit_code=exit_code, evidence=evidence, resumed_from_step=output.resumed_from)


# --- the driver: `python -m operators.backends.ray ... -- TRAINER ARGS` ----------------------


def _describe(exc: BaseException) -> dict:
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
            "message": str(exc)[-8000:],
            "traceback": "".join(traceback.format_exception(exc))[-16000:]}  # fmt: skip


def _interrupt(signum, frame) -> None:
    """SIGTERM (the task was killed): unwind the driver, so that ray.shutdown stops its cluster."""
    raise KeyboardInterrupt


def driver(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m operators.backends.ray")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    parser.add_argument("--export", action="append", default=[])
    parser.add_argument("--address")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    signal.signal(signal.SIGTERM, _interrupt)

    if not args.address:
        # Token auth with a token of this cluster's own, in the environment its processes inherit
        # (never argv, never Ray's default file in the home directory); set before Ray reads its config.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainer.ray_worker import train_loop_per_worker

    env_vars = {name: os.environ[name] for name in args.export if name in os.environ}
    runtime_env = {"env_vars": env_vars}
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env, log_to_driver=True)
    else:
        temp_dir = tempfile.mkdtemp(prefix="gangflow-ray-")
        ray.init(num_cpus=args.world_size * args.cpus_per_worker, num_gpus=0, include_dashboard=False,
                 _temp_dir=temp_dir, _node_ip_address="127.0.0.1", runtime_env=runtime_env, log_to_driver=True,
                 configure_logging=False)  # fmt: skip
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"argv": trainer_args, "cwd": os.getcwd()},
            scaling_config=ScalingConfig(num_workers=args.world_size, use_gpu=False,
                                         resources_per_worker={"CPU": args.cpus_per_worker}),
            run_config=RunConfig(name=args.name, storage_path=str(Path(args.run_dir, "ray").resolve()),
                                 failure_config=FailureConfig(max_failures=0)),
        )  # fmt: skip
        trainer.fit()
        result = {"succeeded": True}
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then judged by the classifier
        result = {"succeeded": False, "error": _describe(exc)}
        failures = getattr(exc, "worker_failures", None) or {}
        result["worker_failures"] = {str(rank): _describe(error) for rank, error in failures.items()}
    finally:
        ray.shutdown()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result["succeeded"] else 1


if __name__ == "__main__":
    # by its module's name, so that Ray pickles the worker function by reference, not by value
    from operators.backends.ray import driver as _driver

    sys.exit(_driver())
