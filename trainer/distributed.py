"""Process group from the launcher's environment, and the few collectives the loop needs.

Launchers: torchrun, OpenMPI's mpirun (with MASTER_ADDR/MASTER_PORT), Ray Train (which makes the
process group itself: it is used as it is) or none; NCCL on CUDA, else
gloo, with control messages on a separate gloo group. At world size 1 there is no process group
and no DDP wrapper (nothing to synchronize).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.errors import ConfigError


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # torchrun | mpirun | single


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment {name}={value!r} is invalid: must be an integer") from None


def detect(environ: dict[str, str] | None = None) -> Launch:
    """Rank and world size from the environment, without starting anything. Under mpirun, also
    exports RANK/WORLD_SIZE/LOCAL_RANK (and MASTER_ADDR/PORT on one node) for env:// init."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launch = Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")), "torchrun")
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, size = int(env["OMPI_COMM_WORLD_RANK"]), int(env.get("OMPI_COMM_WORLD_SIZE", "1"))
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        launch = Launch(rank, size, local, "mpirun")
    else:
        launch = Launch(0, 1, 0, "single")
    if not 0 <= launch.rank < launch.world_size:
        raise ConfigError(f"rank {launch.rank} is outside the world size {launch.world_size} ({launch.launcher} environment)")
    if launch.launcher == "mpirun" and environ is None and launch.world_size > 1:
        _export_mpi_env(launch)
    return launch


def check_device(preference: str, launch: Launch | None = None, environ: dict[str, str] | None = None) -> None:
    """Reject train.device=cuda where there is no GPU, and (under torchrun) more ranks on this
    node than GPUs it can see: NCCL needs a GPU per rank, and two ranks on one device fail at
    the process group with `ncclInvalidUsage: Duplicate GPU detected` (seen on an H200 with
    2 ranks, benchmarks/gpu_drill.py), which a retry would only repeat. torchrun gives every
    local rank the same CUDA_VISIBLE_DEVICES, so LOCAL_WORLD_SIZE is comparable with the
    device count; other launchers may give each rank a GPU of its own, so they are not checked."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' is invalid here: CUDA is not available (use auto or cpu)")
    if preference == "cpu" or launch is None or launch.launcher != "torchrun" or not torch.cuda.is_available():
        return
    env = os.environ if environ is None else environ
    local_ranks, gpus = int(env.get("LOCAL_WORLD_SIZE", "1") or 1), torch.cuda.device_count()
    if local_ranks > gpus:
        raise ConfigError(
            f"train.device={preference!r} is invalid for {local_ranks} ranks on this node: it has {gpus} visible GPU(s) "
            f"and NCCL needs one per rank (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            f"run at most {gpus} ranks per node (torchrun --nproc-per-node) or set train.device=cpu")


def _export_mpi_env(launch: Launch) -> None:
    """Translate OpenMPI's variables into the env:// ones torch reads."""
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", launch.world_size))
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        if local_size != launch.world_size:
            raise ConfigError("under mpirun across nodes, set MASTER_ADDR and MASTER_PORT "
                              "(e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 ...)")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank))


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    launcher: str
    device: torch.device
    backend: str | None = None
    control: Any = None  # gloo process group for control messages

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- collectives (no-ops at world size 1) -------------------------------------------------

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.control)

    def broadcast_int(self, value: int | None) -> int | None:
        """Rank 0's value (None encoded as -1) on every rank."""
        if self.world_size == 1:
            return value
        t = torch.tensor([-1 if value is None else value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.control)
        v = int(t.item())
        return None if v < 0 else v

    def mean(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return float(t.item()) / self.world_size

    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON-able), in rank order, on every rank (no pickling)."""
        if self.world_size == 1:
            return [obj]
        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.control)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self.control)
        return [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(out, sizes)]


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    check_device(preference)
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def setup(launch: Launch, device_preference: str = "auto", timeout_s: float = 600.0) -> Dist:
    device = pick_device(device_preference, launch.local_rank)
    d = Dist(launch.rank, launch.world_size, launch.local_rank, launch.launcher, device)
    if launch.world_size == 1:
        return d
    d.backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():  # the launcher made it (Ray Train's TorchTrainer): use it as it is
        if (dist.get_rank(), dist.get_world_size()) != (launch.rank, launch.world_size):
            raise ConfigError(f"the launcher's process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                              f"the environment says {launch.rank} of {launch.world_size}")
        d.backend = dist.get_backend()
    else:
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(d.backend, init_method="env://", rank=launch.rank, world_size=launch.world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    d.control = dist.new_group(backend="gloo")
    return d


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class StopAgreement:
    """Agree, across ranks, on the step boundary at which to stop (SIGTERM on any rank).

    Each boundary starts an asynchronous MAX all-reduce of the local flag and reads the result
    of the previous boundary's one, so the cost is hidden behind a step and every rank stops
    at the same boundary (at most one step after the signal).
    """

    def __init__(self, d: Dist, local_flag) -> None:
        self.d = d
        self.local_flag = local_flag  # callable -> bool
        self.stopped = False
        self._buf = torch.zeros(1, dtype=torch.int32)
        self._work = None

    def should_stop(self) -> bool:
        if self.stopped:
            return True
        if self.d.world_size == 1:
            self.stopped = bool(self.local_flag())
            return self.stopped
        if self._work is not None:
            self._work.wait()
            self._work = None
            if int(self._buf.item()) > 0:
                self.stopped = True
                return True
        self._buf.fill_(1 if self.local_flag() else 0)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.d.control, async_op=True)
        return False

    def drain(self) -> bool:
        """Finish the outstanding all-reduce (every rank calls it once after the loop)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            self.stopped = self.stopped or int(self._buf.item()) > 0
        return self.stopped
