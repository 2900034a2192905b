"""The kernel's count of OOM kills: what tells a rank the host's OOM killer ended from one killed
from outside, when both leave only a SIGKILL (exit code -9 / 137) behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

_COUNT = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)


def oom_kill_count(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """OOM kills so far in this process's memory cgroup and those below it, where the ranks it starts
    run: cgroup v2's `memory.events` (which counts descendants), or the sum of cgroup v1's
    `memory.oom_control` counts below. In the root cgroup, or where neither can be read, the host's
    `/proc/vmstat` (any process's OOM kill counts then). None when nothing can be read."""
    own = _own_cgroups(proc)
    v2 = own.get("")
    if v2 not in (None, "/"):
        count = _read_count(cgroup_root / v2.lstrip("/") / "memory.events")
        if count is not None:
            return count
    v1 = own.get("memory")
    if v1 not in (None, "/"):
        count = _subtree_count(cgroup_root / "memory" / v1.lstrip("/"))
        if count is not None:
            return count
    return _read_count(proc / "vmstat")


def _own_cgroups(proc: Path) -> dict[str, str]:
    """{controller: path} of /proc/self/cgroup; "" is cgroup v2's unified hierarchy."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return {}
    own = {}
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if ".." in path.split("/"):
            continue
        for controller in controllers.split(","):  # "" is cgroup v2's line
            own[controller] = path
    return own


def _subtree_count(top: Path) -> int | None:
    total, found = 0, False
    for folder, _, _ in os.walk(top):  # os.walk follows no links into other trees
        count = _read_count(Path(folder) / "memory.oom_control")
        if count is not None:
            total, found = total + count, True
    return total if found else None


def _read_count(path: Path) -> int | None:
    try:
        found = _COUNT.search(path.read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None
