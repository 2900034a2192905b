"""The training loop of one rank: set up, resume, train, checkpoint, stop, export.

gangflow's own loop is one user of the runtime API (trainer.runtime): `run()`, called by the entry
point after the config was validated, opens a `Session` (process group, SIGTERM, faults, metrics,
progress, the stop agreement, checkpoints) and `Trainer.fit()` trains on it, with its own model,
data, checkpoint contents (Snapshot: weights, optimizer, scheduler, RNG, data position) and export.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import EXIT_OK, errors
from trainer.checkpoint import Snapshot, cpu_copy, flatten_optimizer, rng_state, set_rng_state
from trainer.checkpoint_interval import PROBE_STEPS, IntervalInputs, choose_interval
from trainer.console import say
from trainer.config import AUTO, Config, resolve_factory
from trainer.data import PREPROCESSING_PARAMS, DataFiles, make_loader, preprocessing_stats, resolve_data
from trainer.distributed import Launch
from trainer.errors import DataError, user_code
from trainer.export import write_final
from trainer.faults import Fault
from trainer.identity import TRAIN_IDENTITY
from trainer.metrics import score
from trainer.preemption import Preemption
from trainer.runtime import Session
from trainer.storage import Storage


def run_identity(cfg: Config, data: DataFiles) -> dict[str, Any]:
    """The training-relevant config (trainer.identity) and the data identity, as recorded in every
    checkpoint; a resume under another one is refused."""
    train = {f"train.{k}": getattr(cfg.train, k) for k in TRAIN_IDENTITY}
    model = {"model.factory": cfg.model.factory, **{f"model.{k}": v for k, v in sorted(cfg.model.kwargs.items())}}
    ident = {f"data.{k}": v for k, v in data.identity().items()}
    return {**ident, "data.factory": cfg.data.factory, **model, **train}


class WarmupCosine:
    """LR scheduler: lr = base_lr * factor(completed steps); linear warm-up, then cosine to 0 at
    `max_steps` (or constant). Its whole state is `state_dict()` (JSON), saved in checkpoints.
    (A tiny class rather than LambdaLR: it runs every step and costs a microsecond.)"""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: Config) -> None:
        self.optimizer = optimizer
        self.warmup, self.total, self.cosine = cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.lr_schedule == "cosine"
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    def factor(self, k: int) -> float:
        f = min(1.0, (k + 1) / self.warmup) if self.warmup > 0 else 1.0
        if self.cosine:
            f *= 0.5 * (1.0 + math.cos(math.pi * min(k, self.total) / self.total))
        return f

    def _apply(self) -> None:
        f = self.factor(self.last_step)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * f

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step, self.base_lrs = int(state["last_step"]), [float(x) for x in state["base_lrs"]]
        self._apply()


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _Window:
    """Loss and time since the last log line (the loss stays on the device until logged)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    def take(self) -> tuple[float, int, float]:
        steps = len(self.losses)
        out = (float(torch.stack(self.losses).mean()) if steps else 0.0, steps, time.perf_counter() - self.t0)
        self.losses, self.t0 = [], time.perf_counter()
        return out


class Trainer:
    """gangflow's model, optimizer and data on one rank, trained on the runtime `Session` `run`."""

    def __init__(self, cfg: Config, run: Session, data: DataFiles) -> None:
        self.cfg, self.run, self.data = cfg, run, data
        self.d = d = run.dist
        t = cfg.train
        self.global_batch = t.batch_size
        self.local_batch = t.batch_size // d.world_size
        with user_code():
            self.train_set = resolve_factory(cfg.data.factory, "data.factory")(data.train_path)
            self.model_kwargs = self._model_kwargs()
            seed_all(t.seed)  # identical initial weights on every rank and at every world size
            self.model = resolve_factory(cfg.model.factory, "model.factory")(**self.model_kwargs).to(d.device)
        params = self.model.parameters()
        if t.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = WarmupCosine(self.optimizer, cfg)
        self.loader, self.sampler = make_loader(self.train_set, batch_size=self.local_batch, rank=d.rank,
                                                world_size=d.world_size, seed=t.seed, num_workers=cfg.data.num_workers)
        if len(self.sampler) // self.local_batch == 0:
            raise DataError(f"the training set has {len(self.train_set)} rows, fewer than one global batch "
                            f"(train.batch_size={t.batch_size})")
        self.config_dict = cfg.to_dict()
        self.step = self.epoch = self.batch_in_epoch = 0
        self.ckpt_blocked_s = 0.0
        self.output_width = 0  # the model's outputs per sample, as the final evaluation saw them
        # checkpoint.every_steps: auto is chosen PROBE_STEPS steps into each attempt (None until then)
        auto = cfg.checkpoint.every_steps == AUTO
        self.every_steps: int | None = None if auto else cfg.checkpoint.every_steps
        self.interval_history = IntervalInputs.from_env() if auto else None  # a bad value fails before any step

    def log(self, message: str) -> None:
        if self.d.is_main:
            say(message)

    def _model_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.cfg.model.kwargs)
        factory = resolve_factory(self.cfg.model.factory, "model.factory")
        params = inspect.signature(factory).parameters
        if "input_dim" not in kwargs and "input_dim" in params:
            kwargs["input_dim"] = int(torch.as_tensor(self.train_set[0][0]).numel())
        wanted = [k for k in PREPROCESSING_PARAMS if k in params and k not in kwargs]
        if wanted:  # the training split's statistics, recorded in the card with the other kwargs
            stats = preprocessing_stats(self.train_set)
            kwargs.update({k: stats[k] for k in wanted})
        return kwargs

    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.cfg.train.task == "regression":
            return F.mse_loss(out.reshape(-1), y.to(out.dtype), reduction=reduction)
        return F.cross_entropy(out, y, reduction=reduction)

    # --- the loop -------------------------------------------------------------------------------

    def fit(self) -> int:
        t, d, run = self.cfg.train, self.d, self.run
        self.resume()
        model = DDP(self.model, device_ids=[d.device] if d.device.type == "cuda" else None) if d.world_size > 1 else self.model
        model.train()
        self.sampler.set_epoch(self.epoch)
        self.sampler.set_start(self.batch_in_epoch * self.local_batch)
        self._it = iter(self.loader)
        window, train_t0 = _Window(), time.perf_counter()
        run.start_loop()  # progress lines and kill@time count from here
        probe_at = self.step + PROBE_STEPS if self.every_steps is None else None
        first_step_done = 0.0
        while self.step < t.max_steps and not run.should_stop:
            loss = self.train_step(model, *self.next_batch(), step=self.step + 1)
            self.step += 1
            window.add(loss)
            if self.step % t.log_every_steps == 0 or self.step == t.max_steps:
                self.log_metrics(window)
            if self.every_steps is not None:
                if self.step % self.every_steps == 0 and self.step < t.max_steps:
                    self.ckpt_blocked_s += self.checkpoint()
            elif self.step == probe_at - PROBE_STEPS + 1:
                first_step_done = time.perf_counter()  # the first step's warm-up is not timed
            elif self.step == probe_at and self.step < t.max_steps:
                self.choose_interval((time.perf_counter() - first_step_done) / (PROBE_STEPS - 1))
            run.step_done(self.step)  # a due GANGFLOW_FAULT fires (after this step's checkpoint); progress line
        train_s = time.perf_counter() - train_t0
        if run.end_loop() and self.step < t.max_steps:  # stopped for a SIGTERM (on any rank)
            return self.preempted()
        self.checkpoint(block=True)
        return self.finish(train_s)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            x, y = next(self._it)
        except StopIteration:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            self.sampler.set_epoch(self.epoch)
            self.sampler.set_start(0)
            self._it = iter(self.loader)
            x, y = next(self._it)
        self.batch_in_epoch += 1
        if self.d.device.type == "cpu":
            return x, y
        return x.to(self.d.device, non_blocking=True), y.to(self.d.device, non_blocking=True)

    def train_step(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, step: int) -> torch.Tensor:
        with user_code():
            loss = self.loss(model(x), y)
            self.run.faults.maybe_raise(step)  # raise@step=N: inside the step, a user error
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss

    def log_metrics(self, window: _Window) -> None:
        """Every rank calls this at the same steps (the loss is averaged over ranks)."""
        loss, steps, elapsed = window.take()
        self.run.report(self.step, loss=self.d.mean(loss), lr=self.scheduler.get_last_lr()[0],
                        samples_per_sec=steps * self.global_batch / elapsed, epoch=self.epoch,
                        step_time_s=round(elapsed / max(steps, 1), 6))

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint(self, block: bool = False) -> float:
        """Save the state at self.step on every rank (rank 0 writes). Returns the time blocked."""
        if self.run.checkpoints.last_step == self.step:
            self.run.checkpoints.wait()
            return 0.0
        t0 = time.perf_counter()
        rng = self.d.gather_json(rng_state(self.d.device))
        opt_tensors, opt_json = flatten_optimizer(self.optimizer.state_dict())
        state = {
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "samples_seen": self.step * self.global_batch, "global_batch": self.global_batch,
            "world_size": self.d.world_size, "config": self.config_dict, "model_kwargs": self.model_kwargs,
            "identity": self.run.identity,
            "scheduler": self.scheduler.state_dict(), "optimizer": opt_json, "rng": rng,
            "torch_version": torch.__version__, "time": time.time(),
        }
        snap = Snapshot(self.step, cpu_copy(self.model.state_dict()), opt_tensors, state)
        snap.blocked_s = time.perf_counter() - t0
        self.run.save_snapshot(snap, block=block)
        return time.perf_counter() - t0

    def choose_interval(self, step_s: float) -> None:
        """`checkpoint.every_steps: auto` (every rank, at the same step): Young/Daly from the
        pipeline's history, else from a probe save timed now; rank 0 chooses, every rank follows."""
        history = self.interval_history or IntervalInputs()
        probe_s = None
        if history.cost_s is None:
            probe_s = self.checkpoint()  # the probe: the loop time this attempt's first save holds
            self.ckpt_blocked_s += probe_s
        chosen = None
        if self.d.is_main:
            chosen = choose_interval(self.cfg.checkpoint, step_s=step_s, history=history, probe_cost_s=probe_s, probe_step=self.step)
        self.every_steps = self.d.broadcast_int(chosen.every_steps if chosen else None)
        if chosen is not None:
            self.log(f"gangflow: checkpoint interval: {chosen.describe()}")
            attempt, tracker = self.run.progress.attempt, self.run.tracker
            tracker.event("checkpoint_interval", self.step, mlflow_prefix="checkpoint_interval_", mlflow_step=attempt,
                          attempt=attempt, **chosen.as_dict())
            # a tag, not a param: a retry may choose another interval, and MLflow params never change
            tracker.write({"event": "tracking", "step": self.step, "params": {},
                           "tags": {"gangflow.checkpoint_interval": json.dumps({"attempt": attempt, **chosen.as_dict()})}})

    def resume(self) -> None:
        """Every rank: restore the newest committed checkpoint, or seed a fresh start."""
        d = self.d
        self.run.expect_model(self.model.state_dict())  # tensors of another shape: set aside, not a crash here
        step = self.run.newest_checkpoint()
        if step is None:
            seed_all(self.cfg.train.seed + d.rank)
            return
        restore_t0 = time.perf_counter()
        loaded = self.run.read_snapshot(step)  # verified, and refused under another config or data
        state = loaded.state
        self.model.load_state_dict(loaded.model)
        self.optimizer.load_state_dict(loaded.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        saved_rng = state["rng"]
        if d.rank < len(saved_rng):
            set_rng_state(saved_rng[d.rank], d.device)
        else:  # a rank that did not exist when the checkpoint was written
            seed_all(self.cfg.train.seed + d.rank + 1_000_003 * step)
        if state["world_size"] != d.world_size:
            self.log(f"gangflow: checkpoint step-{step} was written by {state['world_size']} ranks; continuing on "
                     f"{d.world_size} (global batch {self.global_batch} and sample order unchanged)")
        self.run.resumed(step, loaded.path, checkpoint_world_size=state["world_size"],
                         restore_s=round(time.perf_counter() - restore_t0, 4))

    # --- endings --------------------------------------------------------------------------------

    def preempted(self) -> int:
        if self.step > 0:
            self.checkpoint(block=True)
        return self.run.preempted(f"checkpoint step-{self.step} committed" if self.step > 0
                                  else "no step done, nothing to checkpoint")

    def evaluate(self) -> dict[str, float]:
        with user_code():
            test_set = resolve_factory(self.cfg.data.factory, "data.factory")(self.data.test_path)
        loader = torch.utils.data.DataLoader(test_set, batch_size=1024)
        self.model.eval()
        outputs, targets, loss, total = [], [], 0.0, 0
        with torch.no_grad():
            for x, y in loader:
                x, y = x.to(self.d.device), y.to(self.d.device)
                out = self.model(x)
                loss += float(self.loss(out, y, reduction="sum"))
                outputs.append(out.cpu().numpy())
                targets.append(y.cpu().numpy())
                total += len(y)
        self.model.train()
        # trainer.metrics: the same computation as the pipeline's evaluate task (scores agree).
        outputs = np.concatenate(outputs)
        self.output_width = int(outputs.shape[-1]) if outputs.ndim > 1 else 1
        metrics = score(self.cfg.train.task, outputs, np.concatenate(targets))
        return {**{f"test_{k}": v for k, v in metrics.items()}, "test_loss": loss / max(total, 1)}

    def finish(self, train_s: float) -> int:
        d = self.d
        if d.is_main:
            metrics = self.evaluate()
            card = {
                "model": {"factory": self.cfg.model.factory, "kwargs": self.model_kwargs},
                "config": self.cfg.to_dict(),
                "data": self.data.card(),
                "metrics": metrics, "world_size": d.world_size, "steps": self.step,
                "global_batch": self.global_batch, "resumed_from_step": self.run.resumed_from,
                "torch_version": torch.__version__, "python_version": sys.version.split()[0],
                "mlflow_run_id": self.run.tracker.mlflow_run_id, "created": time.time(),
            }
            if self.cfg.train.task == "classification":
                card["classes"] = self.output_width  # the served signature's prob_<k> columns
            logged: list[str | None] = []
            final = write_final(self.run.run_dir, self.model, card,
                                then=lambda local: logged.append(self.run.tracker.log_final(local)))
            if logged and logged[0]:
                self.log(f"gangflow: final weights logged to MLflow as {logged[0]}")
            self.run.tracker.event("final", self.step, mlflow_prefix="", **metrics, world_size=d.world_size,
                                   global_batch=self.global_batch,
                                   train_s=round(train_s, 4), checkpoint_blocked_s=round(self.ckpt_blocked_s, 6))
            headline = "; ".join(f"{k.replace('_', ' ', 1)} {v:.4f}" for k, v in metrics.items() if k != "test_loss")
            self.log(f"gangflow: done: {self.step} steps on {d.world_size} rank(s); {headline}; "
                     f"final weights at {final}/model.safetensors")
        d.barrier()
        self.run.close(status="FINISHED")  # the attempt's record, the last commit, the tracker
        return EXIT_OK


def run(cfg: Config, fault: Fault | None, launch: Launch, run_dir: str | Path | Storage,
        preempt: Preemption | None = None, data: DataFiles | None = None) -> int:
    """Train on this rank; returns the exit code (exceptions propagate after writing error records).
    `run_dir` is a local path or an fsspec URL; `data` defaults to `resolve_data(cfg.data)`."""
    run_dir = Storage(run_dir)
    run_dir.makedirs()
    if preempt is None:
        preempt = Preemption(cfg.checkpoint.grace_period_s)
        preempt.install()
    errors.context.rank = launch.rank
    session = None
    try:
        if data is None:
            data = resolve_data(cfg.data, run_dir.url)
        session = Session(launch, run_dir, preemption=preempt, fault=fault, identity=run_identity(cfg, data),
                          checkpoint=cfg.checkpoint, tracking=cfg.tracking, params=cfg.to_dict(),
                          total_steps=cfg.train.max_steps, global_batch=cfg.train.batch_size, device=cfg.train.device)
        return Trainer(cfg, session, data).fit()  # fit closes the session (finished or preempted)
    except BaseException as exc:
        if not isinstance(exc, SystemExit):
            errors.write_records(exc, rank=launch.rank, step=errors.context.step, run_dir=run_dir)
        if session is not None:
            try:
                session.close(status="FAILED")
            except BaseException:  # noqa: BLE001 - the original error matters
                pass
        raise
