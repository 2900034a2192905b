"""All-reduce bandwidth by message size, run by each rank of a gang (the platform baseline, docs/observability.md).

    torchrun --standalone --nproc-per-node N -m trainer.collectives --out FILE [--sizes 1024,1048576] [--iters 20]

gloo on CPU, NCCL on CUDA (the backend the trainer would use). Rank 0 writes one JSON object:
`{"backend", "world_size", "device", "results": [{"bytes", "seconds", "algbw_gbps", "busbw_gbps"}]}`
with nccl-tests' conventions: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n (what the links
carry in a ring; 0 for one rank, whose all-reduce moves nothing).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)


def bus_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


def measure(sizes, iters: int, warmup: int = 3) -> dict:
    import torch
    import torch.distributed as dist

    from trainer.distributed import detect, setup, teardown

    d = setup(detect())
    results = []
    try:
        for size in sizes:
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=d.device)
            for _ in range(warmup):
                _all_reduce(dist, tensor, d.world_size)
            _sync(torch, d.device)
            t0 = time.perf_counter()
            for _ in range(iters):
                _all_reduce(dist, tensor, d.world_size)
            _sync(torch, d.device)
            seconds = (time.perf_counter() - t0) / iters
            nbytes = tensor.numel() * 4
            algbw = nbytes / seconds / 1e9
            results.append({"bytes": nbytes, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(d.world_size)})
        return {"backend": d.backend or "none", "world_size": d.world_size, "device": d.device.type, "rank": d.rank, "results": results}
    finally:
        teardown()


def _all_reduce(dist, tensor, world_size: int) -> None:
    if world_size > 1:
        dist.all_reduce(tensor)
    else:  # no process group at world size 1: the local reduction a one-rank all-reduce amounts to
        tensor.add_(0)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where rank 0 writes the JSON result")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="message sizes in bytes, comma-separated")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces per size (after 3 warm-up ones)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        parser.error(f"--sizes={args.sizes!r}: must be byte counts separated by commas")
    if not sizes or min(sizes) < 4 or args.iters < 1:
        parser.error("--sizes must be >= 4 bytes each and --iters >= 1")
    result = measure(sizes, args.iters)
    if result["rank"] == 0:
        from trainer.storage import write_json

        write_json(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
