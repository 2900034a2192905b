"""A rank the kernel's OOM killer ends, told from one killed from outside (issue 28, item 7): both
leave torchrun only `exitcode: -9`; the local backend counts the kernel's OOM kills while the gang
runs, and the classifier weighs the count. A real OOM kill: rank 1 of a 2-rank torchrun gang moves
itself into a memory cgroup of 64 MiB and fills 512 MiB."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]

RANK_SCRIPT = """\
import os, signal, sys, time
if os.environ["RANK"] == "1":
    mode, cgroup = sys.argv[1], sys.argv[2]
    if mode == "oom":
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
        hog = b"x" * (512 << 20)  # past the cgroup's 64 MiB: the kernel's OOM killer ends this rank
    else:
        os.kill(os.getpid(), signal.SIGKILL)  # killed from outside, as a node's reclaim would
time.sleep(120)  # rank 0: torchrun stops it once rank 1 is gone
"""


def own_memory_cgroup() -> Path | None:
    """A 64 MiB memory cgroup below this process's own (cgroup v1 or v2), or None when it cannot be made."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((line.split(":", 2)[2] for line in lines if line.split(":")[1:2] == ["memory"]), None)
    v2 = next((line[3:] for line in lines if line.startswith("0::")), None)
    candidates = []
    if v1 is not None:
        candidates.append((Path("/sys/fs/cgroup/memory") / v1.lstrip("/"), "memory.limit_in_bytes"))
    if v2 is not None:
        candidates.append((Path("/sys/fs/cgroup") / v2.lstrip("/"), "memory.max"))
    for parent, limit in candidates:
        child = parent / f"gangflow-oom-{uuid.uuid4().hex[:8]}"
        try:
            child.mkdir()
        except OSError:
            continue
        try:
            (child / limit).write_text(str(64 << 20))
            swap = child / ("memory.memsw.limit_in_bytes" if limit == "memory.limit_in_bytes" else "memory.swap.max")
            if swap.exists():
                swap.write_text(str(64 << 20) if limit == "memory.limit_in_bytes" else "0")
            return child
        except OSError:
            child.rmdir()
    return None


@pytest.fixture
def memory_cgroup():
    child = own_memory_cgroup()
    if child is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable cgroup v1 memory controller or "
                    "v2 with memory delegated): run as root, as CI does, to provoke a real OOM kill")
    yield child
    child.rmdir()


@pytest.mark.slow
@pytest.mark.parametrize("mode, kind", [("oom", "user"), ("kill", "infra")])
def test_a_rank_the_kernel_oom_killed_is_the_users_and_one_killed_from_outside_infra(memory_cgroup, tmp_path, monkeypatch,
                                                                                     mode, kind):
    from operators import failure_context
    from operators.backends import GangSpec
    from operators.backends.local import LocalBackend
    from operators.failures import classify

    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GANGFLOW_PROJECT", str(tmp_path))  # the script is a path inside the working directory
    spec = GangSpec(name=f"oom-{mode}", run_dir=str(tmp_path / "run"), world_size=2, config_path=str(ROOT / "params.yaml"),
                    user_code=("--script", "rank.py", "--", mode, str(memory_cgroup)))
    log: list[str] = []
    result = LocalBackend(nproc_limit=2, relay_tracking=False).run(spec, log.append)
    text = "\n".join(log[-40:])
    assert not result.succeeded and result.evidence.get("signal") in (9, "SIGKILL"), text
    assert (result.oom_kills or 0) >= 1 if mode == "oom" else result.oom_kills == 0, (result.oom_kills, text)
    context = failure_context.gather(result.evidence, gang=spec.name, oom_kills=result.oom_kills)
    verdict = classify({**result.evidence, "context": context})
    assert (verdict.kind, verdict.rule) == (kind, "killed-from-outside"), verdict.reason
    if mode == "oom":
        assert not verdict.retryable and "the kernel's OOM killer ended" in verdict.reason
    assert os.path.isdir(memory_cgroup)
