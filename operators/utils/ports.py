"""TCP ports on this machine: one picked for a server or a rendezvous that binds it later."""

from __future__ import annotations

import errno
import os
import random
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

# Ray's workers take 10002-19999 (min/max_worker_port); below that sit well-known services.
FLOOR = 20000
CLAIM_S = 600.0  # long enough for a server to start (a Ray node, a rank); a scheduler picks for days
_claims: dict[int, tuple[int | None, float]] = {}  # port -> (the open lock file claiming it, since)
_lock = threading.Lock()  # the drill's controllers pick from their own threads


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on, that stays free until its server binds it.

    Picked below the kernel's ephemeral range, so no port-0 bind (a gRPC server, a gloo rank) and
    no outgoing connection can be handed it meanwhile; claimed by a lock file for CLAIM_S seconds,
    so no other process picking here gets it too. A kernel pick where the range leaves no
    room below it."""
    with _lock:
        _release(older_than=CLAIM_S)
        low, _ = ephemeral_range()
        for _ in range(200 if low - FLOOR >= 1000 else 0):
            port = random.randrange(FLOOR, low)
            if port in _claims or not _claim(port):
                continue
            if port_is_free(port, host) and port_is_free(port, "0.0.0.0"):
                return port
            _release(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on `port` at `host` (a port in TIME_WAIT counts as free: servers reuse it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _claim(port: int) -> bool:
    """Hold an exclusive lock on this port's file: False when another process holds it."""
    import fcntl

    folder = Path(tempfile.gettempdir()) / f"gangflow-ports-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{folder} is not this user's folder")
        fd = os.open(folder / str(port), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        _claims[port] = (None, time.monotonic())  # nowhere to coordinate (a read-only /tmp): the bind check alone
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _claims[port] = (fd, time.monotonic())
    return True


def _release(*ports_: int, older_than: float | None = None) -> None:
    """Close the claims on these ports, or on those held longer than `older_than` seconds."""
    if older_than is not None:
        ports_ = tuple(p for p, (_, since) in _claims.items() if time.monotonic() - since > older_than)
    for port in ports_:
        fd, _ = _claims.pop(port)
        if fd is not None:
            os.close(fd)
