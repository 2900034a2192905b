"""Stopping a process started in a session of its own (`start_new_session=True`), with its group."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds, reap the leader.

    The SIGKILL goes to the group even when the leader has exited: its children may still run.
    """
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
