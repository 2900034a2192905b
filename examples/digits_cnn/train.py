"""A plain torchrun script with its own training loop: a small CNN on scikit-learn's 8x8 digits.

    torchrun --standalone --nproc-per-node 2 -m digits_cnn.train

The lines marked `# gangflow` are all it takes to get the pinned dataset version, committed
checkpoints it resumes from, metrics in MLflow, preemption and fault drills, and a model the
pipeline evaluates and promotes (pipelines/digits-cnn.yaml).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from digits_cnn.model import build, load_split
from trainer import runtime  # gangflow


def main() -> None:
    run = runtime.init(device="cpu")  # gangflow: rank, process group (gloo), SIGTERM, GANGFLOW_FAULT
    max_steps = int(run.params.get("train.max_steps", 3000))
    batch = int(run.params.get("train.batch_size", 64))  # global: split over the ranks
    lr, seed = float(run.params.get("train.lr", 0.05)), int(run.params.get("train.seed", 1234))
    every = int(run.params.get("checkpoint.every_steps", 100))

    x, y = load_split(run.dataset() / "train.parquet")  # gangflow: fetched by content address, md5-verified
    torch.manual_seed(seed)
    model = build()
    net = DDP(model) if run.world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    start = 0
    if (ckpt := run.load_checkpoint()) is not None:  # gangflow: the newest committed checkpoint
        model.load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        start = ckpt.step

    local = batch // run.world_size
    for step in range(start + 1, max_steps + 1):
        # A step's batch depends on the step alone, so a resumed run sees the very same batches.
        order = torch.randint(len(x), (batch,), generator=torch.Generator().manual_seed(seed * 1_000_003 + step))
        mine = order[run.rank * local : (run.rank + 1) * local]
        loss = F.cross_entropy(net(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stop = run.should_stop  # gangflow: a SIGTERM reached a rank (all ranks agree)
        if step % 50 == 0:
            run.report(step, loss=loss.item())  # gangflow: task log + MLflow
        if step % every == 0 or stop or step == max_steps:
            run.save_checkpoint(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})  # gangflow
        if stop:
            run.exit_preempted()  # gangflow: exit 75; the retry resumes from this checkpoint
        run.step_done(step)  # gangflow: fault drills, progress lines

    with tempfile.TemporaryDirectory() as out:
        safetensors.torch.save_file(model.state_dict(), Path(out) / "model.safetensors")
        run.log_model(out, factory="digits_cnn.model:build", classes=10,  # gangflow
                      metrics={"train_loss": loss.item()})


if __name__ == "__main__":
    main()
