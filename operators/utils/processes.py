"""Stopping a process started in a session of its own (`start_new_session=True`), with its group."""

from __future__ import annotations

import os
import signal
import subprocess
import threading


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


def stop_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """`stop_group`, then SIGKILL every descendant that left the group (a gang's torchrun runs in a
    session of its own): what `make ui` and `make demo` do when stopped."""
    import psutil  # not needed by stop_group's callers

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    stop_group(proc, grace)
    alive = [p for p in descendants if p.is_running()]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
