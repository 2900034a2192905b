"""The runtime API for training code of one's own: data by version, checkpoints, metrics, the
final model, preemption and fault drills, for a loop gangflow did not write.

    from trainer import runtime

    run = runtime.init()                       # rank, world size, process group, SIGTERM flag, faults
    data = run.dataset()                       # the pinned dataset version, fetched and md5-verified
    ckpt = run.load_checkpoint()               # the newest committed checkpoint, or None
    for step in range(ckpt.step if ckpt else 0, max_steps):
        ...                                    # the user's own step
        run.report(step + 1, loss=loss)        # task log + MLflow
        if (step + 1) % 50 == 0 or run.should_stop:
            run.save_checkpoint(step + 1, {"model": model.state_dict()})
        if run.should_stop:
            run.exit_preempted()               # SIGTERM: exit 75, the retry resumes
        run.step_done(step + 1)                # GANGFLOW_FAULT drills; progress lines
    run.log_model(folder)                      # the final model, to the DAG run's MLflow run

What the launcher passes (environment; `python -m trainer.user` sets it from the same options as
`python -m trainer`): GANGFLOW_RUN_DIR, GANGFLOW_DATA_REMOTE, GANGFLOW_DATA_VERSION,
GANGFLOW_KEEP_LAST, GANGFLOW_GRACE_PERIOD_S, GANGFLOW_PROGRESS_EVERY_S, GANGFLOW_CODE, GANGFLOW_PARAMS
(`run.params`: the run's `train.*` and `checkpoint.*` values, e.g. the trigger form's), and torchrun's
RANK/WORLD_SIZE/LOCAL_RANK. Importing this module imports neither Airflow nor MLflow. Checkpoints
follow contract 2 and faults contract 3 (docs/contracts.md); docs/extending.md, "Bring your own
training script", is the user's page.

`Session` is the same machinery from explicit arguments (rank, process group, SIGTERM, faults,
tracker, progress, stop agreement, checkpointer, step bookkeeping): gangflow's own loop
(trainer.loop) runs on one, with its own config and checkpoint format; `Run` is a `Session` from
the launcher's environment, plus the user's checkpoint format, dataset and final model.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import EXIT_PREEMPTED, errors
from trainer.checkpoint import REQUIRED as SNAPSHOT_FILES
from trainer.checkpoint import Checkpointer, CorruptCheckpoint, Loaded, MalformedCheckpoint, Snapshot
from trainer.checks import is_integer
from trainer.config import CheckpointConfig, TrackingConfig
from trainer.console import say
from trainer.distributed import Dist, Launch, StopAgreement, detect, pick_device, setup, teardown
from trainer.errors import CheckpointError, ConfigError
from trainer.faults import Fault, FaultInjector, fault_from_env
from trainer.identity import TRAIN_IDENTITY, ResumeMismatch, check_identity
from trainer.model_card import CARD, CARD_FORMAT, MAX_CARD_CLASSES, WEIGHTS, card_classes
from trainer.preemption import Preemption
from trainer.storage import Storage, publish_folder
from trainer.tracking import FINAL_ARTIFACT_PATH, MAX_STEP, Progress, Tracker, check_metrics

__all__ = ["Checkpoint", "ResumeMismatch", "Run", "Session", "current", "init"]

ENV_RUN_DIR = "GANGFLOW_RUN_DIR"
ENV_DATA_REMOTE = "GANGFLOW_DATA_REMOTE"
ENV_DATA_VERSION = "GANGFLOW_DATA_VERSION"
ENV_KEEP_LAST = "GANGFLOW_KEEP_LAST"
ENV_GRACE = "GANGFLOW_GRACE_PERIOD_S"
ENV_PROGRESS = "GANGFLOW_PROGRESS_EVERY_S"
ENV_CODE = "GANGFLOW_CODE"  # what the launcher runs (entry point or command): part of a checkpoint's identity
ENV_PARAMS = "GANGFLOW_PARAMS"  # JSON {"train.max_steps": ..., ...}: the run's parameters (the trigger form's values)
DEFAULT_RUN_DIR = "runs/byo"

STATE_JSON = "state.json"
STATE_FILE = "state.pt"
FOLDER_FILE = "folder.tar"
CHECKPOINT_KIND = "gangflow-runtime/1"
#: What a runtime checkpoint's manifest must list (state.pt and folder.tar when saved).
REQUIRED = (STATE_JSON,)
#: What gangflow's loop reads from a checkpoint's state.json besides the optimizer (trainer.loop's resume).
LOOP_STATE = {"step": is_integer, "epoch": is_integer, "batch_in_epoch": is_integer, "world_size": is_integer,
              "scheduler": lambda v: isinstance(v, dict), "rng": lambda v: isinstance(v, list)}


def tensors_unlike(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> str:
    """How `found` (tensor name: shape) differs from `expected`, briefly; "" when it does not."""
    parts = []
    for label, names in (("missing", sorted(expected.keys() - found.keys())), ("unexpected", sorted(found.keys() - expected.keys())),
                         ("other shapes", sorted(n for n in expected.keys() & found.keys() if expected[n] != found[n]))):
        if names:
            parts.append(f"{label}: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}")
    return "; ".join(parts)


@dataclass
class Checkpoint:
    """A committed checkpoint, verified: `state` (what `save_checkpoint` was given) and/or
    `folder` (a local copy of the folder it was given)."""

    step: int
    state: Any = None
    folder: Path | None = None
    path: str = ""


def _env_number(name: str, default: float, kind: type, minimum: float) -> Any:
    text = os.environ.get(name, "").strip()
    if not text:
        return kind(default)
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"environment {name}={text!r} is invalid: must be a number >= {minimum:g}") from None
    if value < minimum:
        raise ConfigError(f"environment {name}={text!r} is invalid: must be a number >= {minimum:g}")
    return value


def _tar_folder(folder: Path, *, what: str) -> bytes:
    """`folder`'s regular files and subfolders as an uncompressed tar; a link, a FIFO, a socket or a
    device is refused (CheckpointError starting with `what`), never dropped without a word."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                kind = "a link" if path.is_symlink() else "not a regular file"
                raise CheckpointError(f"{what}: {rel} is {kind}; only regular files and folders are kept")
            tar.add(path, arcname=rel, recursive=False)
    return buf.getvalue()


def _untar(data: bytes, dest: Path) -> None:
    """Extract a checkpoint's folder.tar into `dest`: regular files and folders inside it only."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:  # uncompressed, as _tar_folder writes it
        tar.extractall(dest, filter="data")  # refuses absolute paths, `..`, links out of `dest`, devices


class Session:
    """One rank's part of a training run, from explicit arguments: rank, world size and process
    group, the SIGTERM flag, GANGFLOW_FAULT, metrics.jsonl, progress lines, the stop agreement, the
    checkpointer and the step bookkeeping. gangflow's own loop (trainer.loop) runs on one; `Run`
    is one made from the launcher's environment. `preemption` comes installed (the entry point
    installs it before anything slow); `identity` is what a checkpoint records and a resume must
    match; `params` go to the tracker (MLflow params); `required`: the files a checkpoint's manifest
    must list."""

    def __init__(self, launch: Launch, run_dir: str | Path | Storage, *, preemption: Preemption, fault: Fault | None,
                 identity: dict[str, Any], checkpoint: CheckpointConfig, tracking: TrackingConfig, params: dict[str, Any],
                 total_steps: int | None, global_batch: int | None = None, required: tuple[str, ...] = SNAPSHOT_FILES,
                 device: str = "auto", process_group: bool = True) -> None:
        self.preemption = preemption
        self.rank, self.world_size, self.local_rank = launch.rank, launch.world_size, launch.local_rank
        errors.context.rank = self.rank
        self.run_dir = Storage(run_dir)
        self.faults = FaultInjector(fault, self.run_dir, self.rank, self.world_size)  # a bad rank=R fails here, before any group
        self.run_dir.makedirs()
        self.identity = identity
        self._owns_group = process_group
        try:
            if process_group:
                self.dist = setup(launch, device)
            else:  # the framework starts the process group itself; collectives use its default group
                self.dist = Dist(launch.rank, launch.world_size, launch.local_rank, launch.launcher,
                                 pick_device(device, launch.local_rank))
            self.device = self.dist.device
            self.tracker = Tracker(self.run_dir, enabled=self.is_main, mlflow_uri=tracking.mlflow_uri,
                                   experiment=tracking.experiment, flush_every_s=tracking.flush_every_s, params=params,
                                   tags={"gangflow.world_size": str(self.world_size), "gangflow.run_dir": self.run_dir.url})
            self.checkpoints = Checkpointer(self.run_dir.child("checkpoints"), checkpoint, rank=self.rank, log=self.log,
                                            on_commit=self._on_commit, at_save=self.faults.save_hook, required=required)
            self.checkpoints.start_writer()  # rank 0: it starts beside the rank's own start, not at the first save
        except BaseException:
            if process_group:
                teardown()
            raise
        self.progress = Progress(self.tracker, log=self.log, every_s=tracking.progress_every_s, total=total_steps,
                                 global_batch=global_batch, start_step=0, committed_step=None)
        self.step = 0  # the last step done on this rank (step_done), or the step resumed from
        self.resumed_from: int | None = None
        self._loaded: tuple[int, Any] | None = None  # rank 0: the checkpoint select() chose, loaded while choosing
        self._model_shapes: dict[str, tuple[int, ...]] | None = None  # expect_model()'s
        self._stop = StopAgreement(self.dist, lambda: self.preemption.requested)
        self._clock_started = False
        self._closed = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, message: str) -> None:
        """A line in the task log, from rank 0 only."""
        if self.is_main:
            say(message)

    @property
    def _collectives(self) -> bool:
        import torch.distributed as dist

        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    # --- checkpoints (contract 2) -------------------------------------------------------------

    def newest_checkpoint(self) -> int | None:
        """The step of the newest committed checkpoint that verifies and loads (rank 0 loads it; a
        corrupt or malformed newer one is set aside), the same on every rank; None, logged as a
        start from step 0, when there is none. Call it on every rank."""
        chosen = None
        if self.is_main:
            self.checkpoints.cleanup_stale()
            chosen = self.checkpoints.select(load=self._try_load)
        elif not self._collectives:
            # No process group to hear rank 0's choice: each rank makes the same one, leaving the
            # moving aside to rank 0 (one it moves meanwhile reads as missing here: skipped too).
            chosen = self.checkpoints.select(load=self._try_load, move_aside=False)
        step = self.dist.broadcast_int(chosen[0] if chosen else None) if self._collectives else (chosen[0] if chosen else None)
        if step is None:
            self.log("gangflow: starting from step 0")
            self.tracker.event("start", 0, world_size=self.world_size)
        return step

    def _try_load(self, step: int) -> None:
        """select()'s last check, on rank 0: the checkpoint it chose loads. Its content not loading
        (MalformedCheckpoint) sets it aside before the step is broadcast, so every rank resumes from
        the one before; any other failure (I/O, another run's) the read after the broadcast reports."""
        last_step = self.checkpoints.last_step
        try:
            self._loaded = (step, self._load(step))
        except MalformedCheckpoint:
            self.checkpoints.last_step = last_step
            raise
        except Exception:  # noqa: BLE001 - reported by read_snapshot / load_checkpoint on every rank alike
            self.checkpoints.last_step = last_step

    def _chosen(self, step: int) -> Any:
        """Checkpoint `step` loaded: the load select() made on this rank, else a load now."""
        loaded, self._loaded = self._loaded, None
        return loaded[1] if loaded is not None and loaded[0] == step else self._load(step)

    def _load(self, step: int) -> Any:
        """Checkpoint `step` in this session's format, which select() checks: here the Snapshot format
        (model and optimizer tensors, state.json: gangflow's loop's), a `Loaded`; `Run` has its own.
        ResumeMismatch when it records another identity than this session's."""
        loaded = self.checkpoints.read(step)
        check_identity(f"checkpoint step-{step} ({loaded.path})", loaded.state.get("identity"), self.identity)
        bad = [key for key, ok in LOOP_STATE.items() if not ok(loaded.state.get(key))]
        if bad:
            raise MalformedCheckpoint(f"state.json: {', '.join(bad)} missing or malformed")
        if self._model_shapes is not None:
            unlike = tensors_unlike(self._model_shapes, {name: tuple(t.shape) for name, t in loaded.model.items()})
            if unlike:
                raise MalformedCheckpoint(f"model.safetensors: not this model's tensors ({unlike})")
        return loaded

    def expect_model(self, state_dict: Mapping[str, Any]) -> None:
        """The loop's model, before newest_checkpoint(): a checkpoint whose tensors are not its (names,
        shapes) under the same identity was not written by this code, so it is set aside as malformed."""
        self._model_shapes = {name: tuple(t.shape) for name, t in state_dict.items()}

    def read_snapshot(self, step: int) -> Loaded:
        """Checkpoint `step` in the Snapshot format (model and optimizer tensors, state.json: gangflow's
        loop's), verified; ResumeMismatch when it records another identity than this session's."""
        try:
            return self._chosen(step)
        except CorruptCheckpoint as exc:
            raise self._unreadable(step, exc) from None

    def _unreadable(self, step: int, exc: Exception) -> CheckpointError:
        return CheckpointError(f"rank {self.rank} cannot read checkpoint step-{step}: {exc}")

    def resumed(self, step: int, where: Any, **fields: Any) -> None:
        """This rank resumed from checkpoint `step` (at `where`): the step bookkeeping, the log line
        and the `resume` event (`fields`: its figures)."""
        self.step = self.resumed_from = step
        errors.context.step = step
        self.progress.start_step = self.progress.last_step = step
        self.progress.committed_step = step
        self.log(f"gangflow: resuming from checkpoint step-{step} ({where})")
        self.tracker.event("resume", step, world_size=self.world_size, **fields)

    def save_snapshot(self, snapshot: Snapshot, *, block: bool = False) -> None:
        """Commit `snapshot` (every rank at the same step; rank 0 writes, in the background unless
        `block` or checkpoint.async_save is off). Its step is done on this rank: an unsynchronised
        fault firing during the write records it."""
        self.faults.step = max(self.faults.step, snapshot.step)
        self.checkpoints.save(snapshot, block=block)

    def _on_commit(self, info: dict[str, Any]) -> None:
        self.progress.committed(info)
        self.tracker.event("checkpoint", info["step"], mlflow_prefix="checkpoint_", duration_s=info["duration_s"],
                           blocked_s=info["blocked_s"], bytes=info["bytes"], path=info["path"])

    # --- the loop: progress, metrics, faults, stopping -----------------------------------------

    def start_loop(self) -> None:
        """The training loop starts now (every rank, after the resume): progress lines, the
        attempt's run time and `kill@time` count from here. Without this call (training code of
        one's own) they count from `init()` and the first `step_done`."""
        self.progress.restart()
        errors.context.step = self.step + 1  # the step in progress, for error records
        self._start_clock()

    def _start_clock(self) -> None:
        if not self._clock_started:
            self._clock_started = True
            self.faults.start_clock()

    def report(self, step: int, **metrics: float) -> None:
        """Metrics at `step`: metrics.jsonl (relayed to the DAG run's MLflow run) from rank 0; a
        `loss` also goes into the progress line. Other ranks' calls are ignored."""
        if not is_integer(step) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"report: step={step!r} must be an integer from 0 to 2**63-1")
        check_metrics(f"report({step}, ...)", metrics)
        if self._closed:
            raise RuntimeError(f"report({step}, ...) after close(): the metrics file and MLflow are closed; "
                               "not recorded")
        if "loss" in metrics:
            self.progress.loss = float(metrics["loss"])
        self.tracker.step(step, **{k: v if isinstance(v, int) else float(v) for k, v in metrics.items()})

    def step_done(self, step: int) -> None:
        """Step `step` (1-based) is complete, on this rank: fires a due GANGFLOW_FAULT (step=N:
        after a barrier; raise: a ValueError; time=S: counted from the first call) and prints
        the progress line every GANGFLOW_PROGRESS_EVERY_S. Call it on every rank after every step."""
        self.step = self.faults.step = step
        errors.context.step = step + 1
        self._start_clock()
        self.faults.maybe_raise(step)
        if self.faults.process_fault_due(step):
            self.checkpoints.wait()  # drills are reproducible: pending writes are committed first
            self.dist.barrier()  # and every rank reached the step
            self.faults.fire(step)
        self.progress.tick(step)

    @property
    def stopped_by_sigterm(self) -> bool:
        """A SIGTERM reached this rank, or the ranks agreed to stop for one another rank received."""
        return self.preemption.requested or self._stop.stopped

    @property
    def should_stop(self) -> bool:
        """True once a SIGTERM reached any rank (all ranks agree, at most a step late): save a
        checkpoint and call `exit_preempted()`. Poll it on every rank at the same points."""
        if not self._collectives:
            return self.preemption.requested
        return self._stop.should_stop()

    def end_loop(self) -> bool:
        """The training loop ended (every rank): the `kill@time` clock stops and the stop agreement
        is settled. True when it ended for a SIGTERM (on any rank)."""
        self.faults.stop_clock()
        errors.context.step = self.step
        if not self._collectives:
            return self.preemption.requested
        return self._stop.drain()

    def preempted(self, saved: str | None = None) -> int:
        """Stop after a SIGTERM (every rank, its checkpoint saved): wait for every rank, record the
        attempt, close; returns 75 (the retry resumes). `saved`: what the loop committed, for the
        log line (with how long after the signal)."""
        self.end_loop()
        self.dist.barrier()  # every rank exits only once the checkpoint is committed
        what = f"stopped at step {self.step}"
        if saved is not None:
            since = (f"{time.monotonic() - self.preemption.received_at:.2f}s after the signal" if self.preemption.received_at
                     else "(SIGTERM was received by another rank)")
            what += f"; {saved} {since}"
        self.log(f"gangflow: preempted (SIGTERM): {what}; exiting with {EXIT_PREEMPTED}")
        self.tracker.event("preempted", self.step)
        self.progress.attempt_record(self.step)
        self.close(status=None)
        return EXIT_PREEMPTED

    def exit_preempted(self) -> None:
        """Stop after a SIGTERM: wait for every rank, then exit 75 (the retry resumes)."""
        raise SystemExit(self.preempted())

    # --- the end ------------------------------------------------------------------------------

    def close(self, status: str | None = "FINISHED") -> None:
        """Finish this rank's part: FINISHED records the attempt; the checkpointer and the tracker
        close, and the process group ends when this session started it. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.faults.stop_clock()
        try:
            if status == "FINISHED":
                self.progress.attempt_record(self.step)
            self.checkpoints.close()
        finally:
            self.tracker.close(status=status)
            if self._owns_group:
                teardown()


class Run(Session):
    """One rank's handle on gangflow (made by `init()`): a `Session` from the launcher's
    environment, with checkpoints of the user's own state, the dataset and the final model."""

    def __init__(self, *, config: Mapping[str, Any] | None = None, total_steps: int | None = None,
                 device: str = "auto", process_group: bool = True) -> None:
        preemption = Preemption(_env_number(ENV_GRACE, 25.0, float, 0.001))
        preemption.install()  # from now on a SIGTERM is a request to stop at a step boundary
        launch = detect()
        errors.context.rank = launch.rank
        fault = fault_from_env(rank=launch.rank)
        self.data_remote = os.environ.get(ENV_DATA_REMOTE, "")
        self.data_version = os.environ.get(ENV_DATA_VERSION, "")
        self.code = os.environ.get(ENV_CODE, " ".join(sys.argv))
        self.config = dict(config or {})
        try:
            self.params: dict[str, Any] = json.loads(os.environ.get(ENV_PARAMS) or "{}")
        except ValueError:
            raise ConfigError(f"environment {ENV_PARAMS} is not a JSON object") from None
        checkpoint = CheckpointConfig(keep_last=_env_number(ENV_KEEP_LAST, 2, int, 1), async_save=False)
        tracking = TrackingConfig(progress_every_s=_env_number(ENV_PROGRESS, 10.0, float, 0.0))
        # What a checkpoint must share with the run resuming it: the code, the data, the training
        # parameters the launcher passed (as the trainer's TRAIN_IDENTITY) and the code's own config.
        identity = {"code": self.code, "data.version": self.data_version,
                    **{f"train.{k}": self.params[f"train.{k}"] for k in TRAIN_IDENTITY if f"train.{k}" in self.params},
                    **{f"config.{k}": v for k, v in sorted(self.config.items())}}
        self._data: Path | None = None
        self._scratch: list[Path] = []
        self._pid = os.getpid()  # the rank's own process: a forked child never closes the run
        self.model_uri: str | None = None
        super().__init__(launch, os.environ.get(ENV_RUN_DIR) or DEFAULT_RUN_DIR, preemption=preemption, fault=fault,
                         identity=identity, checkpoint=checkpoint, tracking=tracking,
                         params={"code": self.code, "config": self.config},
                         total_steps=total_steps or self.params.get("train.max_steps"), required=REQUIRED,
                         device=device, process_group=process_group)

    def dataset(self) -> Path:
        """The pinned dataset version's files as a local folder, fetched by content address and
        md5-verified (once per rank; a verified earlier fetch on this machine is reused)."""
        if self._data is None:
            if not (self.data_remote and self.data_version):
                raise ConfigError(f"run.dataset(): no dataset version was given ({ENV_DATA_REMOTE} and {ENV_DATA_VERSION} are "
                                  "unset); launch through a gangflow pipeline, or set both")
            from trainer.data import scratch_dir
            from trainer.datastore import dir_listing, fetch_dataset

            relpaths = [entry["relpath"] for entry in dir_listing(self.data_remote, self.data_version)]
            fetch_dataset(self.data_remote, self.data_version, scratch_dir(), relpaths=relpaths)
            self._data = scratch_dir() / self.data_version
        return self._data

    # --- checkpoints (contract 2) -------------------------------------------------------------

    def save_checkpoint(self, step: int, state: Any = None, folder: str | os.PathLike | None = None) -> None:
        """Commit checkpoint `step` (call it on every rank at the same step; rank 0 writes): `state`,
        anything `torch.save` takes whose contents `torch.load(weights_only=True)` reads back
        (tensors, state dicts, numbers, strings, lists, dicts), and/or `folder`, a folder a
        framework wrote. Written aside, committed atomically, the oldest beyond GANGFLOW_KEEP_LAST pruned."""
        if state is None and folder is None:
            raise TypeError("save_checkpoint(step, state=None, folder=None): give the state, a folder, or both")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"save_checkpoint: step={step!r} must be an integer >= 1")
        newest = self.checkpoints.last_step
        if newest is not None and step < newest:  # pruning keeps the highest steps: it would vanish at once
            raise ValueError(f"save_checkpoint: step={step} is below step {newest}, already saved or resumed from; "
                             "steps must not go back (the same step again replaces it)")
        files: dict[str, bytes] = {}
        if self.is_main:
            if state is not None:
                buf = io.BytesIO()
                torch.save(state, buf)
                # A state resume cannot read back would be set aside as malformed at every resume: say so now.
                buf.seek(0)
                if unsafe := torch.serialization.get_unsafe_globals_in_checkpoint(buf):
                    raise TypeError(f"save_checkpoint: the state holds {', '.join(unsafe)}, which "
                                    "torch.load(weights_only=True) will not rebuild at resume; save tensors, state dicts, "
                                    "numbers, strings, lists and dicts, or allow the classes with "
                                    "torch.serialization.add_safe_globals")
                files[STATE_FILE] = buf.getvalue()
            if folder is not None:
                if not Path(folder).is_dir():
                    raise CheckpointError(f"save_checkpoint(folder={str(folder)!r}): not a folder")
                files[FOLDER_FILE] = _tar_folder(Path(folder), what=f"save_checkpoint(folder={str(folder)!r})")
            meta = {"kind": CHECKPOINT_KIND, "step": step, "identity": self.identity, "world_size": self.world_size,
                    "torch_version": torch.__version__, "time": time.time()}
            files[STATE_JSON] = json.dumps(meta, separators=(",", ":")).encode()
        self.checkpoints.save(Snapshot(step, {}, {}, {}, files=files), block=True)

    def load_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint that verifies and loads (a corrupt newer one is set aside),
        or None; call it on every rank. ResumeMismatch when it was made by other code, config or data."""
        step = self.newest_checkpoint()
        if step is None:
            return None
        try:
            loaded, meta = self._chosen(step)
        except CorruptCheckpoint as exc:
            raise self._unreadable(step, exc) from None
        self.resumed(step, loaded.path, checkpoint_world_size=meta.get("world_size"))
        return loaded

    def read_snapshot(self, step: int) -> Loaded:
        """Not a Run's: its checkpoints are `save_checkpoint()`'s, read by `load_checkpoint()`."""
        raise TypeError("Run.read_snapshot: a Run's checkpoints are read with load_checkpoint()")

    def save_snapshot(self, snapshot: Snapshot, *, block: bool = False) -> None:
        """Not a Run's: `load_checkpoint()` would set such a checkpoint aside as malformed."""
        raise TypeError("Run.save_snapshot: a Run's checkpoints are written with save_checkpoint()")

    def expect_model(self, state_dict: Mapping[str, Any]) -> None:
        """Not a Run's: its checkpoints hold whatever state the user saves."""
        raise TypeError("Run.expect_model: a Run's checkpoints hold the state given to save_checkpoint(), checked by "
                        "the code that loads it")

    def _load(self, step: int) -> tuple[Checkpoint, dict[str, Any]]:
        """Checkpoint `step` and its state.json; MalformedCheckpoint when its files verify but do not
        load, ResumeMismatch when it was made by other code, config or data."""
        files = self.checkpoints.read_files(step)
        try:
            meta = json.loads(files[STATE_JSON])
        except ValueError as exc:
            raise MalformedCheckpoint(f"{STATE_JSON}: not JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("kind") != CHECKPOINT_KIND:
            raise MalformedCheckpoint(f"{STATE_JSON}: not a {CHECKPOINT_KIND} checkpoint's")
        where = self.checkpoints.store.uri(f"step-{step}")
        check_identity(f"checkpoint step-{step} ({where})", meta.get("identity"), self.identity, what="code/config/data")
        loaded = Checkpoint(step=step, path=where)
        if STATE_FILE in files:
            try:
                loaded.state = torch.load(io.BytesIO(files[STATE_FILE]), map_location="cpu", weights_only=True)
            except MemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - verified bytes in memory: whatever fails is their content
                raise MalformedCheckpoint(f"{STATE_FILE}: not loadable ({type(exc).__name__}: {str(exc)[:200]})") from None
        if FOLDER_FILE in files:
            dest = Path(tempfile.mkdtemp(prefix=f"gangflow-ckpt-{step}-"))
            self._scratch.append(dest)  # removed at close(), whoever takes this load
            try:
                _untar(files[FOLDER_FILE], dest)
            except (tarfile.TarError, ValueError, EOFError) as exc:  # not OSError: a full disk is not the tar's fault
                shutil.rmtree(dest, ignore_errors=True)
                raise MalformedCheckpoint(f"{FOLDER_FILE}: not extractable ({type(exc).__name__}: {str(exc)[:200]})") from None
            loaded.folder = dest
        return loaded, meta

    # --- the final model -----------------------------------------------------------------------

    def log_model(self, folder: str | os.PathLike, flavour: str | None = None, *, factory: str | None = None,
                  kwargs: Mapping[str, Any] | None = None, task: str = "classification",
                  metrics: Mapping[str, float] | None = None, classes: int | None = None) -> str | None:
        """Publish `folder` (the trained model, as the code writes it) as the run's `final/`, with a
        model card (flavour, code, data version, metrics), from rank 0. The training task logs
        `final/` to the DAG run's MLflow run (`runs:/<id>/final`), as it does the trainer's.

        With `factory` (`module:function`, allow-listed by the pipeline's `allowed_models`) and a
        `model.safetensors` in `folder`, the card says how to rebuild the module (`factory(**kwargs)`
        + the weights): gangflow's guarded loader, evaluation and the registered pyfunc load it
        without unpickling anything. `classes`: how many class scores that module returns (the served
        signature's `prob_<k>` columns); without it the training task counts them with one forward
        pass, which costs it an `import torch`. Returns the MLflow URI when this rank logs it itself
        (MLFLOW_RUN_ID set), else None."""
        self.faults.stop_clock()
        if not self.is_main:
            return None
        source = Path(folder)
        if not source.is_dir():
            raise CheckpointError(f"log_model({str(folder)!r}): not a folder")
        if (source / CARD).exists():
            raise CheckpointError(f"log_model({str(folder)!r}): {CARD} is gangflow's model card; name your file otherwise")
        if task not in ("classification", "regression"):
            raise ValueError(f"log_model: task={task!r}: accepted values are classification, regression")
        check_metrics("log_model(metrics=...)", metrics or {})
        if clash := sorted((metrics or {}).keys() & {"world_size", "sync", "mlflow_prefix", "mlflow_step"}):
            raise ValueError(f"log_model(metrics=...): {', '.join(map(repr, clash))}: gangflow's own fields of the "
                             "final event; name the metrics otherwise")
        if classes is not None and (task != "classification" or factory is None
                                    or card_classes({"classes": classes}) is None):  # what the registry reads
            raise ValueError(f"log_model: classes={classes!r}: accepted values are an integer from 1 to {MAX_CARD_CLASSES}, "
                             "for task='classification' with a factory (the module's class scores)")
        card: dict[str, Any] = {
            "format": CARD_FORMAT, "kind": "folder", "flavour": flavour, "code": self.code,
            "config": {"train": {"task": task}, "user": self.config},
            "data": {"version": self.data_version or None, "remote": self.data_remote or None},
            "metrics": {k: float(v) for k, v in (metrics or {}).items()}, "world_size": self.world_size,
            "steps": self.step, "resumed_from_step": self.resumed_from, "torch_version": torch.__version__,
            "python_version": sys.version.split()[0], "created": time.time()}
        if factory is not None:
            weights = source / WEIGHTS
            if not weights.is_file():
                raise CheckpointError(f"log_model(factory={factory!r}): {folder}/{WEIGHTS} is missing (the module's "
                                      "state_dict, safetensors.torch.save_file)")
            from trainer.checkpoint import file_entry

            card["model"] = {"factory": factory, "kwargs": dict(kwargs or {})}
            if classes is not None:
                card["classes"] = int(classes)
            card["weights"] = {"file": WEIGHTS, **file_entry(weights.read_bytes())}
        staging = Path(tempfile.mkdtemp(prefix="gangflow-final-"))
        try:
            _untar(_tar_folder(source, what=f"log_model({str(folder)!r})"), staging / FINAL_ARTIFACT_PATH)
            staged = staging / FINAL_ARTIFACT_PATH
            (staged / CARD).write_text(json.dumps(card, indent=2) + "\n")
            if self.run_dir.local:
                final = self.run_dir.local_path(FINAL_ARTIFACT_PATH)
                tmp = final.with_name(f".final-tmp-{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                staged.rename(tmp) if staged.stat().st_dev == final.parent.stat().st_dev else shutil.copytree(staged, tmp)
                publish_folder(tmp, final, aside=".final-old")
                logged_from = final
            else:
                self.run_dir.remove(FINAL_ARTIFACT_PATH, CARD)
                self.run_dir.put_dir(staged, FINAL_ARTIFACT_PATH, last=CARD)  # the card marks a complete final/
                logged_from = staged
            self.model_uri = self.tracker.log_final(logged_from)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.tracker.event("final", self.step, mlflow_prefix="", **card["metrics"], world_size=self.world_size)
        self.log(f"gangflow: done: {self.step} steps on {self.world_size} rank(s); final model at "
                 f"{self.run_dir.uri(FINAL_ARTIFACT_PATH)}")
        return self.model_uri

    # --- the end ------------------------------------------------------------------------------

    def close(self, status: str | None = "FINISHED") -> None:
        """Finish this rank's part (the launcher calls it when the user's code returns). Only in the
        rank's own process: a child the code forked shares the process group and the run dir."""
        if self._closed or os.getpid() != self._pid:
            return
        try:
            super().close(status)
        finally:
            if not self.stopped_by_sigterm:  # ended: a SIGTERM now (a peer failed) has nothing to wait for
                self.preemption.uninstall()
            for path in self._scratch:
                shutil.rmtree(path, ignore_errors=True)
            global _current, _stopped_by_sigterm
            if _current is self:
                _stopped_by_sigterm = self.stopped_by_sigterm
                _current = None
                teardown()


_current: Run | None = None
_stopped_by_sigterm = False  # of the Run closed last (exit_preempted closes it before its SystemExit)


def init(*, config: Mapping[str, Any] | None = None, total_steps: int | None = None, device: str = "auto",
         process_group: bool = True) -> Run:
    """This rank's `Run` (idempotent: a second call returns the same one). `config`: the values
    that must match for a checkpoint to be resumed (hyperparameters), recorded in each checkpoint;
    `total_steps`: shown in progress lines; `process_group=False` leaves torch.distributed to a
    framework that starts it itself."""
    global _current
    if _current is None:
        _current = Run(config=config, total_steps=total_steps, device=device, process_group=process_group)
        atexit.register(_close_at_exit)
    return _current


def current() -> Run | None:
    """The `Run` of this process, if `init()` was called."""
    return _current


def stopped_by_sigterm() -> bool:
    """Whether this process's `Run`, open or closed, stopped for a SIGTERM (on any rank)."""
    return _current.stopped_by_sigterm if _current is not None else _stopped_by_sigterm


def _close_at_exit() -> None:
    if _current is not None:
        _current.close(status=None)
