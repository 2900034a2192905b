"""Pause and resume a local gang from outside its task (`python -m operators.cli.gang pause GANG --local`).

The task running a local gang records it in STATE/gangs/GANG.json (STATE: `GANGFLOW_HOME`, as the
worker has it). `pause` writes STATE/gangs/GANG.paused; the task sees it within a second, stops its
own gang as on_kill does (SIGTERM: the ranks commit a final checkpoint), waits until `resume`
removes the file and launches the gang again, which resumes from that checkpoint. The command
signals no process itself: only the task that started the gang stops it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from operators.backends.base import GANG_NAME
from operators.config import settings
from operators.exceptions import GangControlError
from trainer.storage import read_regular, remove_local, write_json

_MARKER_LIMIT = 4096  # bytes read of a pause marker
_RECORD_LIMIT = 64 << 10  # bytes read of a gang's record
_PID_MAX = 2**31 - 1  # the largest pid_t


def gangs_dir() -> Path:
    """Where running local gangs are recorded (STATE/gangs)."""
    return settings.state_dir() / "gangs"


def _path(gang: str, suffix: str) -> Path:
    if not isinstance(gang, str) or not GANG_NAME.fullmatch(gang):
        raise GangControlError(f"gang={gang!r}: must be a gang's name, a DNS-1123 label (a-z, 0-9, '-'), as the task log's "
                               "`gang NAME: N ranks` line gives it")  # fmt: skip
    return gangs_dir() / f"{gang}{suffix}"


def register(gang: str, *, run_dir: str) -> None:
    """Record a running gang of this process (the task), so `pause` can find it."""
    path = _path(gang, ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"gang": gang, "pid": os.getpid(), "run_dir": str(run_dir), "since": time.time()})


def unregister(gang: str) -> None:
    """The gang ended: forget it, and a pause nobody resumed."""
    for suffix in (".json", ".paused"):
        remove_local(_path(gang, suffix))  # whatever is there: a folder too, a link itself


def _running(gang: str) -> dict[str, Any]:
    path = _path(gang, ".json")
    try:
        record = json.loads(read_regular(path, limit=_RECORD_LIMIT))  # never a FIFO, a folder or a link
        pid = record["pid"]
        # a pid <= 0 would name a process group (or all processes) to os.kill, a huge one overflows it
        if type(pid) is not int or not 0 < pid <= _PID_MAX:
            raise ValueError(f"pid {pid!r} is not a process id")
    except FileNotFoundError:
        raise GangControlError(f"gang {gang!r}: no running local gang of that name in {path.parent} (is GANGFLOW_HOME "
                               "the Airflow worker's? a Kubernetes gang needs --namespace)") from None  # fmt: skip
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise GangControlError(f"gang {gang!r}: its record {path} is unreadable ({type(exc).__name__}: {exc})") from None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise GangControlError(f"gang {gang!r}: the task that ran it (pid {pid}) is gone; a retry of the task records it again") from None
    except PermissionError:  # another user's task: alive
        pass
    return record


def pause_note(gang: str) -> tuple[str, str] | None:
    """(pause id, note) while the gang is paused, else None. Anything at the marker's name is a
    pause (`resume` removes it); only a regular file is read, so that no look ever blocks."""
    try:
        marker = json.loads(read_regular(_path(gang, ".paused"), limit=_MARKER_LIMIT))
        return str(marker["id"]), str(marker["note"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError, KeyError, TypeError):  # half-written, foreign, a FIFO: still a pause
        return "unreadable", "paused (marker unreadable)"


def pause(gang: str, reason: str = "") -> dict[str, Any]:
    """Ask the task running `gang` to stop it with a final checkpoint and wait; what was done."""
    record = _running(gang)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    note = f"paused at {stamp}" + (f": {reason}" if reason else "")
    try:  # O_EXCL: never through a link, never over another pause
        fd = os.open(_path(gang, ".paused"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        current = pause_note(gang)
        raise GangControlError(f"gang {gang!r}: already paused ({current[1] if current else 'paused'})") from None
    with os.fdopen(fd, "w") as fh:
        json.dump({"id": uuid.uuid4().hex, "note": note}, fh)
    return {"gang": gang, "backend": "local", "paused": True, "run_dir": record.get("run_dir"), "time": stamp}


def resume(gang: str) -> dict[str, Any]:
    """Let the task launch `gang` again (it resumes from the pause's final checkpoint); what was done."""
    record = _running(gang)
    path = _path(gang, ".paused")
    if not os.path.lexists(path):
        raise GangControlError(f"gang {gang!r}: is not paused")
    remove_local(path)  # a marker that is not a regular file (a folder, a FIFO, a link) too: else the task waits for ever
    if os.path.lexists(path):
        raise GangControlError(f"gang {gang!r}: its pause marker {path} could not be removed; remove it to resume the gang")
    return {"gang": gang, "backend": "local", "paused": False, "run_dir": record.get("run_dir"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
