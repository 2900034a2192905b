"""Fault injection for tests, benchmarks and drills (contract 3, docs/contracts.md).

    GANGFLOW_ALLOW_FAULTS=1 GANGFLOW_FAULT="ACTION@WHEN[,rank=R]"

ACTION: kill, term, exit=CODE, raise; WHEN: step=N (synchronised), save[=K] or time=SECONDS (kill
only, unsynchronised). docs/trainer.md, "Fault injection", says when and where each one fires.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
import sys
from pathlib import Path

from trainer.console import say
from trainer.errors import ConfigError
from trainer.storage import Storage

ENV = "GANGFLOW_FAULT"
ALLOW_ENV = "GANGFLOW_ALLOW_FAULTS"
_SPEC = re.compile(r"^(?P<action>kill|term|raise|exit=(?P<code>\d+))@(?:step=(?P<step>\d+)|(?P<save>save)(?:=(?P<nth>\d+))?"
                   r"|time=(?P<seconds>\d+(?:\.\d+)?))(?:,rank=(?P<rank>\d+))?$")
EXPECTED = ("expected ACTION@step=N[,rank=R] with ACTION one of kill, term, raise, exit=CODE, or "
            "kill@save[=K][,rank=R] or kill@time=SECONDS[,rank=R] (e.g. 'kill@step=30,rank=1', 'kill@time=2.5')")
ONCE = ("kill", "term", "exit")


@dataclass(frozen=True)
class Fault:
    action: str  # kill | term | exit | raise
    step: int | None  # for when == "step"
    rank: int | None = None
    code: int | None = None  # for exit
    when: str = "step"  # step (synchronised) | save | time (unsynchronised)
    nth: int = 1  # for save: the K-th checkpoint write of the attempt
    seconds: float | None = None  # for time

    @property
    def spec(self) -> str:
        action = f"exit={self.code}" if self.action == "exit" else self.action
        if self.when == "save":
            at = "save" if self.nth == 1 else f"save={self.nth}"
        elif self.when == "time":
            at = f"time={self.seconds:g}"
        else:
            at = f"step={self.step}"
        return f"{action}@{at}" + (f",rank={self.rank}" if self.rank is not None else "")

    @property
    def synchronised(self) -> bool:
        return self.when == "step"

    def targets(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse_fault(text: str | None) -> Fault | None:
    """Parse GANGFLOW_FAULT; empty or unset means no fault. Malformed raises ConfigError."""
    if text is None or not text.strip():
        return None
    match = _SPEC.fullmatch(text.strip().replace(" ", ""))
    if not match:
        raise ConfigError(f"{ENV}={text!r} is invalid: {EXPECTED}")
    action = match["action"]
    code = None
    if action.startswith("exit="):
        action, code = "exit", int(match["code"])
        if not 1 <= code <= 255:
            raise ConfigError(f"{ENV}={text!r} is invalid: exit=CODE needs CODE in 1..255")
    rank = int(match["rank"]) if match["rank"] is not None else None
    if match["step"] is None:  # save / time: unsynchronised, kill only
        if action != "kill":
            raise ConfigError(f"{ENV}={text!r} is invalid: @save and @time take ACTION kill only (an unsynchronised "
                              "SIGKILL); use @step=N for term, exit=CODE and raise")
        if match["save"]:
            nth = int(match["nth"]) if match["nth"] is not None else 1
            if nth < 1:
                raise ConfigError(f"{ENV}={text!r} is invalid: save=K needs K >= 1")
            return Fault(action="kill", step=None, rank=rank, when="save", nth=nth)
        seconds = float(match["seconds"])
        if seconds <= 0:
            raise ConfigError(f"{ENV}={text!r} is invalid: time=SECONDS needs SECONDS > 0")
        return Fault(action="kill", step=None, rank=rank, when="time", seconds=seconds)
    step = int(match["step"])
    if step < 1:
        raise ConfigError(f"{ENV}={text!r} is invalid: step must be >= 1")
    return Fault(action=action, step=step, rank=rank, code=code)


def fault_from_env(environ=None, *, rank: int = 0) -> Fault | None:
    """GANGFLOW_FAULT, honoured only with GANGFLOW_ALLOW_FAULTS=1; logs (stderr) what it decided."""
    env = os.environ if environ is None else environ
    text = env.get(ENV)
    if text is None or not text.strip():
        return None
    if env.get(ALLOW_ENV, "").strip() != "1":
        say(f"gangflow: warning: {ENV}={text!r} is ignored on rank {rank}: fault injection needs {ALLOW_ENV}=1 "
            "(tests, benchmarks and drills set it); training runs without a fault", stream=sys.stderr)
        return None
    fault = parse_fault(text)
    say(f"gangflow: fault injection ARMED on rank {rank}: {ENV}={fault.spec!r} ({ALLOW_ENV}=1)", stream=sys.stderr)
    return fault


def marker_name(spec: str) -> str:
    """Where, relative to the run dir, a fired fault leaves its marker (one name a spec)."""
    return f"faults/{spec.replace(',', '_')}.fired"


class FaultInjector:
    """Decides, per rank, whether the configured fault fires, and fires it.

    Synchronised (`step=N`): the loop asks `process_fault_due(step)` and calls `fire(step)` after
    draining and a barrier. Unsynchronised: `start_clock()` arms the `time=` timer when the loop
    starts; `at_save(writer=...)` is called by the checkpointer during each write (`save`).
    `step` is kept current by the loop so the marker records how far the rank got."""

    def __init__(self, fault: Fault | None, run_dir: str | Path | Storage, rank: int, world_size: int) -> None:
        self.fault = fault
        self.rank = rank
        self.step = 0  # the last completed step (set by the loop; read by unsynchronised firing)
        self._saves = 0
        self._timer: threading.Timer | None = None
        if fault is not None and fault.rank is not None and fault.rank >= world_size:
            raise ConfigError(f"{ENV}={fault.spec!r} is invalid: rank={fault.rank} but the world size is {world_size}")
        self.store = Storage(run_dir)
        self.marker_rel = marker_name(fault.spec) if fault else None
        self.marker = (self.store.local_path(self.marker_rel) if self.store.local else self.store.uri(self.marker_rel)) if fault else None
        # Decided once, at start, on every rank: whether this attempt may fire a once-only fault.
        self.armed = fault is not None and (fault.action == "raise" or not self.store.exists(self.marker_rel))
        if fault is not None and not self.armed:
            say(f"gangflow: fault injection: {fault.spec} already fired in an earlier attempt ({self.marker}); disarmed", stream=sys.stderr)

    def process_fault_due(self, step: int) -> bool:
        """True on every rank when a synchronised kill/term/exit fault is due after `step`."""
        return self.armed and self.fault.action in ONCE and self.fault.when == "step" and step == self.fault.step

    def fire(self, step: int) -> None:
        """Persist the marker, then kill/term/exit this process if it is targeted."""
        assert self.fault is not None and self.marker is not None
        self.armed = False
        if not self.fault.targets(self.rank):
            return
        record = {"fault": self.fault.spec, "rank": self.rank, "step": step, "time": time.time()}
        self.store.write_bytes(self.marker_rel, json.dumps(record).encode())  # durable before firing
        say(f"gangflow: fault injection: {self.fault.spec} fires on rank {self.rank} at step {step}")
        if self.fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # pragma: no cover - never returns
        elif self.fault.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault.action == "exit":
            os._exit(self.fault.code)

    # --- unsynchronised ---------------------------------------------------------------------------

    def start_clock(self) -> None:
        """The training loop starts: arm `kill@time=SECONDS` on a daemon timer (no barrier)."""
        f = self.fault
        if self.armed and f.when == "time" and f.targets(self.rank):
            self._timer = threading.Timer(f.seconds, self._fire_unsynchronised, kwargs={"where": f"{f.seconds:g} s into the loop"})
            self._timer.daemon = True
            self._timer.start()

    def stop_clock(self) -> None:
        """The loop ended before the timer: nothing fires (and no marker is written)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def save_hook(self) -> Callable[[int], None] | None:
        """`at_save` when a kill@save fault is armed, else None: the checkpointer's writer then
        commits without stopping between the data files and the commit (no handshake to wait for)."""
        return self.at_save if self.armed and self.fault.when == "save" else None

    def at_save(self, ckpt_step: int) -> None:
        """Called once per checkpoint write (Checkpointer's `at_save`): on the writer, rank 0,
        between the data files and the commit (on its writer thread for async saves); on the
        other ranks when they hand the step over (their save call)."""
        f = self.fault
        if not (self.armed and f.when == "save"):
            return
        self._saves += 1
        if self._saves == f.nth and f.targets(self.rank):
            self._fire_unsynchronised(where=f"checkpoint step-{ckpt_step} in flight")

    def _fire_unsynchronised(self, *, where: str) -> None:
        self.armed = False
        record = {"fault": self.fault.spec, "rank": self.rank, "step": self.step, "where": where, "time": time.time()}
        self.store.write_bytes(self.marker_rel, json.dumps(record).encode())  # durable before firing
        say(f"gangflow: fault injection: {self.fault.spec} fires on rank {self.rank} at step {self.step} ({where}); "
            "unsynchronised: no barrier, no wait")
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # pragma: no cover - never returns

    def maybe_raise(self, step: int) -> None:
        """Called inside training step `step` (1-based): the user-bug fault."""
        f = self.fault
        if f is not None and f.action == "raise" and step == f.step and f.targets(self.rank):
            raise ValueError(f"injected fault {ENV}={f.spec!r}: a ValueError from training step {step} on rank {self.rank}")
