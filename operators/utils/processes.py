"""Stopping a process started in a session of its own (`start_new_session=True`), with its group;
reading its output a bounded line at a time; ending a command-line program without interpreter
teardown."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn, TextIO


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with `code` once logs and output are flushed. After a DAG run in this process (Airflow,
    MLflow, Great Expectations and torch imported) the interpreter's teardown takes 5-10 s on these
    machines and does nothing the run needs: the metadata DB is committed, files are closed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: The most of one output line a gang's reader keeps (the rank's full output stays in its log files).
LINE_LIMIT = 64 << 10


def bounded_lines(stream: TextIO, limit: int = LINE_LIMIT) -> Iterator[str]:
    """`stream`'s lines, each cut to `limit` characters with the cut said: a child printing one huge
    line (an array's repr, a binary blob) costs the reader no memory."""
    while line := stream.readline(limit):
        if line.endswith("\n") or len(line) < limit:
            yield line
            continue
        cut = 0
        while (more := stream.readline(limit)) and not more.endswith("\n"):
            cut += len(more)
        cut += len(more.rstrip("\n"))
        yield f"{line} ... ({cut} characters cut)\n"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds, reap the leader.

    The SIGKILL goes to the group even when the leader has exited: its children may still run.
    """
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def stop_group_nowait(proc: subprocess.Popen, grace: float) -> threading.Timer:
    """SIGTERM the process group and return at once, for a caller that reaps the leader itself
    (a reader of its output); a daemon timer SIGKILLs the group after `grace` seconds if the
    leader still runs then. Cancel the returned timer to call the SIGKILL off."""
    _signal_group(proc, signal.SIGTERM)
    timer = threading.Timer(grace, lambda: proc.poll() is None and _signal_group(proc, signal.SIGKILL))
    timer.daemon = True
    timer.start()
    return timer


#: Set (by `tagged_env`) in the environment of a tree `stop_tree` must end whole: every process
#: started below it inherits the tag, also one started after the tree was last looked at.
TREE_TAG_ENV = "GANGFLOW_PROCESS_TREE"


def tagged_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with a fresh `TREE_TAG_ENV` tag, for the root of a tree `stop_tree` will end."""
    import uuid

    return {**env, TREE_TAG_ENV: uuid.uuid4().hex}


def stop_tree(proc: subprocess.Popen, grace: float = 10.0, env: dict[str, str] | None = None) -> None:
    """`stop_group`, then SIGKILL every descendant that left the group (a gang's torchrun runs in a
    session of its own) and, with the `env` the tree was started with (`tagged_env`), every process
    carrying its tag (one spawned meanwhile, e.g. a retry's new gang): what `make ui` and `make
    demo` do when stopped."""
    import psutil  # not needed by stop_group's callers

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    stop_group(proc, grace)
    tag = (env or {}).get(TREE_TAG_ENV)
    for _ in range(3 if tag else 1):  # a process forking as it dies leaves a child: look again
        alive = [p for p in descendants if p.is_running()] + (_tagged(tag) if tag else [])
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        if not alive:
            break


def _tagged(tag: str) -> list:
    """The processes whose environment carries `TREE_TAG_ENV=tag`."""
    import psutil

    found = []
    for pid in pids_with_env(TREE_TAG_ENV, tag):
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def pids_with_env(name: str, value: str, *, prefix: bool = False) -> list[int]:
    """PIDs, other than this process, whose environment has `name=value` (with `prefix`, a value
    starting with `value`), read from Linux /proc: how a tree is found once its processes left
    their group or session."""
    needle = f"{name}={value}".encode()
    found = []
    for pid in _other_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                items = fh.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if any(item.startswith(needle) if prefix else item == needle for item in items):
            found.append(pid)
    return found


def pids_in_folder(folder: str) -> list[int]:
    """PIDs, other than this process, whose working directory is `folder` or below it: a process
    that dropped the environment it was started with (Ray's agents do) still works where it started."""
    prefix = os.path.join(folder, "")
    found = []
    for pid in _other_pids():
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # gone, or another user's
            continue
        if cwd == folder or cwd.startswith(prefix):
            found.append(pid)
    return found


def _other_pids() -> list[int]:
    """Every PID in Linux /proc but this process's."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != os.getpid()]
