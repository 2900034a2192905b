"""trainer.launch runs real gangs: torchrun's agent with the ranks forked from a warm interpreter
trains bit for bit as torchrun does, with the same exit status and failure summary (the local
backend reads it as classifier evidence). tests/unit/trainer/test_launch.py has its refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from operators.backends.local import LocalBackend, parse_torchrun_failures
from operators.failures import classify
from operators.utils.oom import oom_kill_count

LAUNCH = [sys.executable, "-m", "trainer.launch"]


def forked(h, run_dir, **env) -> subprocess.CompletedProcess:
    argv = [*LAUNCH, *h.command(run_dir)[1:]]  # torchrun's options and `-m trainer ...`, unchanged
    return subprocess.run(argv, cwd=h.ROOT, env=h.trainer_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)


@pytest.mark.slow
def test_forked_ranks_train_bit_for_bit_as_torchrun_does(h, tmp_path):
    h.check_ok(h.run(tmp_path / "torchrun"))
    out = h.check_ok(forked(h, tmp_path / "forked"))
    assert "done: 60 steps on 2 rank(s)" in out
    ours, theirs = (tmp_path / "forked" / "final"), (tmp_path / "torchrun" / "final")
    assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
    first = next(e for e in h.metrics(tmp_path / "forked") if e.get("event") == "first_step")
    assert first["since"] == "torchrun launch" and 0 < first["startup_s"] < 120  # counted from the launcher's start


@pytest.mark.slow
def test_a_killed_rank_fails_the_launch_with_torchruns_summary_and_infra_evidence(h, tmp_path):
    before = oom_kill_count()  # counted around the gang, as LocalBackend does
    proc = forked(h, tmp_path / "run", GANGFLOW_FAULT="kill@step=30,rank=1")
    after = oom_kill_count()
    assert proc.returncode == 1, proc.stdout[-3000:]
    # Which rank the agent sees fail first is a race, as under torchrun: the killed rank 1 (-9),
    # or rank 0, whose collective lost its peer (1, a gloo connection error in its error file).
    failures = parse_torchrun_failures(proc.stdout)
    assert failures and {(f["rank"], f["exit_code"]) for f in failures} <= {(1, -9), (0, 1)}, failures
    assert h.root_cause_exitcode(proc.stdout) in (-9, 1)
    evidence = LocalBackend._evidence(1, proc.stdout, {})  # the evidence the backend builds
    # ... and the OOM count it adds: the kill came from outside, so none; where no memory cgroup
    # can be read (no count) the SIGKILL is unexplained, retried once all the same
    counted = None if None in (before, after) else after - before
    verdict = classify(evidence | {"context": {"oom_kills": counted}} if counted is not None else evidence)
    assert verdict.retryable and (counted is None or (counted, verdict.kind) == (0, "infra")), (counted, verdict.reason)


@pytest.mark.slow
def test_a_user_error_keeps_the_ranks_exit_code(h, tmp_path):
    proc = forked(h, tmp_path / "run", GANGFLOW_FAULT="raise@step=5,rank=0")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert h.root_cause_exitcode(proc.stdout) == 1  # the trainer's user-error code, as under torchrun
    assert "ValueError" in proc.stdout or "RuntimeError" in proc.stdout
