"""The embedded-default backend: one `torchrun --standalone` gang on this machine.

Admission is Airflow's pool (`pool_slots = world size`); this backend refuses at once a gang larger
than the pool or this machine's cores, which could never start. torchrun runs with
`--max-restarts 0`: Airflow's `retries` is the one retry budget.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from operators.config import settings
from operators.backends.base import GangBackend, GangResult, GangSpec, LogFn
from operators.exceptions import GangCapacityError
from operators.utils.processes import stop_group_nowait

LOG_TAIL_LINES = 60
_RANK_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")
_RESUMED = re.compile(r"gangflow: resuming from checkpoint step-(\d+)")
_FAILURE_FIELD = re.compile(r"^\s+(rank|exitcode|error_file)\s*:\s*(.*)$")


def parse_torchrun_failures(text: str) -> list[dict]:
    """Read torchrun's ChildFailedError summary: one dict per failed rank, root cause first."""
    failures: list[dict] = []
    root_cause = False
    current: dict | None = None
    for line in text.splitlines():
        if line.startswith("Root Cause"):
            root_cause = True
        elif re.match(r"^\[\d+\]:$", line):
            current = {"root_cause": root_cause}
            failures.append(current)
        elif current is not None and (m := _FAILURE_FIELD.match(line)):
            key, value = m.group(1), m.group(2).strip()
            if key == "rank":
                current["rank"] = int(value.split()[0])
            elif key == "exitcode":
                code = int(value.split()[0])
                current["exit_code"] = code
                if code < 0:
                    current["signal"] = signal.Signals(-code).name
            elif key == "error_file" and value != "<N/A>":
                current["error_file_path"] = value
    return sorted(failures, key=lambda f: not f["root_cause"])


LAUNCHERS = ("fork", "torchrun")


class LocalBackend(GangBackend):
    """torchrun on this machine; ranks' output is streamed into the task log as `[rank N] ...`.

    `launcher="fork"` (default) runs torchrun's agent through `trainer.launch`, which imports torch,
    torch._dynamo and the trainer once and forks the ranks from it (a restart reaches its first
    step in about 0.7 of the time: benchmarks/README.md); `"torchrun"` starts each rank as a fresh
    `python -m trainer`, as `torchrun` itself does. Same options, output and failure summary."""

    name = "local"

    def __init__(
        self, *, nproc_limit: int | None = None, grace_period_s: float = 60.0, extra_torchrun_args=(),
        dataset_remote: str | None = None, relay_tracking: bool = True, launcher: str = "fork",
    ):
        # relay_tracking (default): the task relays metrics.jsonl to MLflow and the ranks import no
        # MLflow (it cost rank 0 seconds before its first step); False: rank 0 logs itself.
        if not isinstance(relay_tracking, bool):
            raise ValueError(f"relay_tracking={relay_tracking!r}: accepted values are true, false")
        self.relay_tracking = relay_tracking
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher={launcher!r}: accepted values are {', '.join(LAUNCHERS)}")
        self.launcher = launcher
        self.nproc_limit = nproc_limit
        self.grace_period_s = grace_period_s
        self.extra_torchrun_args = tuple(extra_torchrun_args)
        # Where ranks fetch `spec.dataset_version` from; default: the DVC remote of this machine.
        self.dataset_remote = dataset_remote
        self._proc: subprocess.Popen | None = None
        self._kill_requested = False

    def check_capacity(self, spec: GangSpec) -> None:
        slots = settings.pool_slots()
        if spec.world_size > slots:
            raise GangCapacityError(
                f"world_size={spec.world_size}: a gang of {spec.world_size} ranks can never be admitted, "
                f"pool {settings.TRAINING_POOL!r} has {slots} slots (accepted: 1..{slots}; set GANGFLOW_POOL_SLOTS "
                "and rerun `make setup` to change it, or use backend 'kubernetes')"
            )
        limit = self.nproc_limit or os.cpu_count() or 1
        if spec.world_size > limit:
            raise GangCapacityError(
                f"world_size={spec.world_size}: this machine runs at most {limit} ranks (one per core)"
            )

    def command(self, spec: GangSpec, log_dir: Path) -> list[str]:
        """torchrun's argv (or trainer.launch's: the same options). Values are argv items, never shell text."""
        return [
            sys.executable, "-m", "trainer.launch" if self.launcher == "fork" else "torch.distributed.run",
            "--standalone", "--nproc-per-node", str(spec.world_size),
            "--max-restarts", "0",
            "--tee", "3", "--log-dir", str(log_dir),
            *self.extra_torchrun_args,
            "-m", "trainer", *spec.trainer_args(), *self._data_args(spec),
        ]  # fmt: skip

    def _data_args(self, spec: GangSpec) -> list[str]:
        """`--set data.version=MD5 --set data.remote=URL` for a gang that fetches a dataset version
        (`GangSpec.dataset_version`): the ranks read the version by content address like pods do,
        never a path of the worker's DVC cache. An override `data.remote` names another remote."""
        if not spec.dataset_version:
            return []
        args = ["--set", f"data.version={spec.dataset_version}"]
        if any(o.startswith("data.remote=") for o in spec.overrides):
            return args
        if self.dataset_remote is None:
            from operators.hooks.dvc import remote_url

            self.dataset_remote = remote_url()
        return [*args, "--set", f"data.remote={self.dataset_remote}"]

    def run(self, spec: GangSpec, log: LogFn) -> GangResult:
        log_dir = Path(spec.run_dir) / "torchrun" / f"try-{spec.attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **spec.env}
        env["PYTHONUNBUFFERED"] = "1"
        if self.relay_tracking:  # the task relays; a worker's own MLflow settings must not reach rank 0
            for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
                env.pop(key, None)
        cmd = self.command(spec, log_dir)
        log(f"launching gang of {spec.world_size} ranks: {' '.join(cmd)}")
        log(f"rank logs: {log_dir}/<torchrun run id>/attempt_0/<rank>/stdout.log and stderr.log (and below, "
            "prefixed [rank N]); one JSON object a line with GANGFLOW_LOG_FORMAT=json")
        # A session of its own, so on_kill can stop torchrun and every rank together.
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1,
            start_new_session=True, cwd=os.environ.get("GANGFLOW_PROJECT") or None,
        )
        if self._kill_requested:  # kill() came before the gang existed; `run` reaps it below
            stop_group_nowait(self._proc, self.grace_period_s)
        rank_tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=LOG_TAIL_LINES))
        agent_lines: collections.deque = collections.deque(maxlen=400)
        resumed_from = None
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.rstrip("\n")
            if m := _RANK_LINE.match(line):
                rank, text = int(m.group(1)), m.group(2)
                rank_tails[rank].append(text)
                log(f"[rank {rank}] {text}")
                if resumed_from is None and (r := _RESUMED.search(text)):
                    resumed_from = int(r.group(1))
            else:
                agent_lines.append(line)
                log(f"[torchrun] {line}")
        exit_code = self._proc.wait()
        self._proc = None
        if exit_code == 0:
            return GangResult(succeeded=True, exit_code=0, resumed_from_step=resumed_from)
        evidence = self._evidence(exit_code, "\n".join(agent_lines), rank_tails)
        return GangResult(succeeded=False, exit_code=exit_code, evidence=evidence, resumed_from_step=resumed_from)

    @staticmethod
    def _evidence(exit_code: int, agent_text: str, rank_tails: dict) -> dict:
        """Classifier evidence (contract 4, docs/contracts.md): the root-cause rank's fields, all ranks in `ranks`."""
        ranks = []
        for failure in parse_torchrun_failures(agent_text):
            rank = failure.get("rank")
            item = {k: failure[k] for k in ("exit_code", "signal") if k in failure}
            item["rank"] = rank
            item["log_tail"] = "\n".join(rank_tails.get(rank, ()))
            path = failure.get("error_file_path")
            if path and Path(path).is_file():
                try:
                    item["error_file"] = json.loads(Path(path).read_text())
                except ValueError:
                    item["error_file"] = {"message": Path(path).read_text()[:4000]}
            ranks.append(item)
        if not ranks:  # torchrun itself failed (bad flags, rendezvous): its own output is the evidence
            # A negative code is the signal that killed torchrun (-9: SIGKILL): keep its sign.
            return {"exit_code": exit_code, "log_tail": agent_text[-6000:]}
        return {**ranks[0], "ranks": ranks}

    def kill(self) -> None:
        """Stop the gang and wait for it. Called before `run` has started it (another thread of
        the task, e.g. its MLflow relay, gave up first), `run` stops it as soon as it starts."""
        proc = self._proc
        if proc is None:
            self._kill_requested = True
            return
        if proc.poll() is not None:
            return
        # SIGTERM first: the ranks commit a final checkpoint (the preemption path); SIGKILL after the grace period.
        timer = stop_group_nowait(proc, self.grace_period_s)
        try:
            proc.wait(self.grace_period_s + 5)
        finally:
            timer.cancel()
