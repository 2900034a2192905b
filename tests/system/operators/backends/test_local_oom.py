"""A rank the kernel's OOM killer ends, told from one killed from outside (issue 28, item 7): both
leave torchrun only `exitcode: -9`; the local backend counts the kernel's OOM kills in its memory
cgroup and those below while the gang runs, and the classifier weighs the count. A real OOM kill:
the backend runs in a cgroup of its own (other tests' gangs must not see its OOM kill), and rank 1
of its 2-rank torchrun gang moves into a child cgroup of 64 MiB and fills 512 MiB."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
V1_MEMORY = Path("/sys/fs/cgroup/memory")

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

# The backend in the cgroup of its own (argv[1]); the spec as JSON (argv[2]); the result as the last line.
BACKEND = """\
import json, os, sys
from pathlib import Path
Path(sys.argv[1], "cgroup.procs").write_text(str(os.getpid()))
from operators.backends import GangSpec
from operators.backends.local import LocalBackend
log = []
result = LocalBackend(nproc_limit=2, relay_tracking=False).run(GangSpec(**json.loads(sys.argv[2])), log.append)
print(json.dumps({"succeeded": result.succeeded, "evidence": result.evidence, "oom_kills": result.oom_kills,
                  "log": log[-40:]}, default=str))
"""


@pytest.fixture
def memory_cgroups():
    """(the backend's cgroup, a 64 MiB one below it), made at cgroup v1's memory root."""
    if not (V1_MEMORY / "memory.oom_control").is_file():
        pytest.skip("no cgroup v1 memory controller at /sys/fs/cgroup/memory: this test provokes its OOM kill there "
                    "(the count's cgroup v2 reading is unit-tested in tests/unit/operators/utils/test_oom.py)")
    own = V1_MEMORY / f"gangflow-oom-{uuid.uuid4().hex[:8]}"
    limited = own / "limited"
    try:
        limited.mkdir(parents=True)
        (limited / "memory.limit_in_bytes").write_text(str(64 << 20))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup under {V1_MEMORY} ({exc}): run as root, as CI does")
    yield own, limited
    for folder in (limited, own):
        folder.rmdir()


@pytest.mark.slow
@pytest.mark.parametrize("mode, kind", [("oom", "user"), ("kill", "infra")])
def test_a_rank_the_kernel_oom_killed_is_the_users_and_one_killed_from_outside_infra(memory_cgroups, tmp_path, mode, kind):
    from operators import failure_context
    from operators.failures import classify

    own, limited = memory_cgroups
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    spec = {"name": f"oom-{mode}", "run_dir": str(tmp_path / "run"), "world_size": 2, "config_path": str(ROOT / "params.yaml"),
            "user_code": ["--script", "rank.py", "--", mode, str(limited)]}
    env = {"PATH": "/usr/bin:/bin", "GANGFLOW_HOME": str(tmp_path / "home"),
           "GANGFLOW_PROJECT": str(tmp_path), "OMP_NUM_THREADS": "1"}  # the script is a path inside the working directory
    done = subprocess.run([sys.executable, "-c", BACKEND, str(own), json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    text = "\n".join(result["log"])
    assert not result["succeeded"] and result["evidence"].get("signal") in (9, "SIGKILL"), text
    assert (result["oom_kills"] or 0) >= 1 if mode == "oom" else result["oom_kills"] == 0, (result["oom_kills"], text)
    context = failure_context.gather(result["evidence"], gang=spec["name"], oom_kills=result["oom_kills"])
    verdict = classify({**result["evidence"], "context": context})
    assert (verdict.kind, verdict.rule) == (kind, "killed-from-outside"), verdict.reason
    if mode == "oom":
        assert not verdict.retryable and "the kernel's OOM killer ended" in verdict.reason
