"""The kernel's count of OOM kills: what tells a rank the host's OOM killer ended from one killed
from outside, when both leave only a SIGKILL (exit code -9 / 137) behind."""

from __future__ import annotations

import re
from pathlib import Path

_COUNT = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)


def oom_kill_count(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """OOM kills so far: this process's cgroup v2 `memory.events` (its descendants counted, so only
    the gang's neighbours in it can blur the count), else the host's `/proc/vmstat` (Linux >= 4.13;
    cgroup v1 keeps no count over descendants); None when neither can be read."""
    for path in (_own_memory_events(proc, cgroup_root), proc / "vmstat"):
        if path is None:
            continue
        try:
            found = _COUNT.search(path.read_text())
        except OSError:
            continue
        if found:
            return int(found.group(1))
    return None


def _own_memory_events(proc: Path, cgroup_root: Path) -> Path | None:
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = next((line[3:] for line in lines if line.startswith("0::")), None)
    if not unified or unified == "/" or ".." in unified.split("/"):
        return None  # the root cgroup keeps no memory.events
    return cgroup_root / unified.lstrip("/") / "memory.events"
