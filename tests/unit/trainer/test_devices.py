"""Device choice (trainer/distributed.py): refusals that must come before any process group.

The GPU cases fake the CUDA runtime's answers (`torch.cuda.is_available`, `device_count`): this
machine has no GPU. The refusal they guard was found on a real one: benchmarks/gpu_drill.py ran
2 ranks on an H200 machine with one GPU, and NCCL failed at the process group with
`ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60`, which the
failure classifier could only call `unknown` (so a retry would repeat it).
"""

from __future__ import annotations

import pytest
import torch

from trainer.distributed import Launch, check_device
from trainer.errors import ConfigError

TORCHRUN_RANK_0 = Launch(rank=0, world_size=2, local_rank=0, launcher="torchrun")


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("preference", ["cuda", "auto"])
def test_more_torchrun_ranks_than_gpus_is_a_config_error_naming_both_numbers(one_gpu, preference):
    with pytest.raises(ConfigError) as err:
        check_device(preference, TORCHRUN_RANK_0, {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0"})
    message = str(err.value)
    assert f"train.device={preference!r}" in message and "2 ranks on this node" in message
    assert "1 visible GPU" in message and "--nproc-per-node" in message and "train.device=cpu" in message


def test_as_many_ranks_as_gpus_and_cpu_and_other_launchers_pass(one_gpu):
    check_device("cuda", TORCHRUN_RANK_0, {"LOCAL_WORLD_SIZE": "1"})
    check_device("cpu", TORCHRUN_RANK_0, {"LOCAL_WORLD_SIZE": "8"})
    # mpirun (or Slurm) may give every rank a GPU of its own through CUDA_VISIBLE_DEVICES
    check_device("cuda", Launch(rank=1, world_size=2, local_rank=1, launcher="mpirun"), {"LOCAL_WORLD_SIZE": "2"})


def test_no_gpu_leaves_auto_on_cpu_and_refuses_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_device("auto", TORCHRUN_RANK_0, {"LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="CUDA is not available"):
        check_device("cuda", TORCHRUN_RANK_0, {"LOCAL_WORLD_SIZE": "1"})
