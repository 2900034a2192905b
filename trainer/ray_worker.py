"""One Ray Train worker of the `ray` backend (operators/backends/ray.py): the trainer's own main,
with Ray Train's rank, world size and process group (contract 1's arguments, unchanged).

Light on purpose: Ray imports this module in every worker to find `train_loop_per_worker`.
"""

from __future__ import annotations

import os
import sys


class RankExitError(RuntimeError):
    """The trainer on one Ray Train worker ended with a non-zero exit code (its error record says why)."""

    def __init__(self, rank: int, code: int):
        super().__init__(f"rank {rank}: the trainer exited with code {code}")
        self.rank, self.code = rank, code

    def __reduce__(self):
        return (RankExitError, (self.rank, self.code))


def train_loop_per_worker(config: dict) -> None:
    """`python -m trainer ARGV` on this worker; a non-zero exit code raises RankExitError."""
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(context.get_world_size()), LOCAL_RANK=str(context.get_local_rank()))
    if config.get("cwd"):  # the trainer's relative paths (its config's data paths) are the project's
        os.chdir(config["cwd"])
    print(f"gangflow: ray worker rank {rank} pid {os.getpid()}", flush=True)
    from trainer.__main__ import exit_code

    code = exit_code(list(config["argv"]))
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        raise RankExitError(rank, code)
