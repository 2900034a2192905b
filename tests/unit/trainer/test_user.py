"""trainer.user: how a rank of one's own code ends when the code exits by itself (sys.exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _rank(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, dict]:
    """One rank of `body` (a script in tmp_path, its working directory) as `python -m trainer.user`."""
    (tmp_path / "train.py").write_text("import sys\nfrom trainer import runtime\nrun = runtime.init()\n" + body)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW_", "MLFLOW_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "trainer.user", "--run-dir", str(tmp_path / "run"), "--script", "train.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    record = tmp_path / "run" / "errors" / "rank-0.json"
    return proc, json.loads(record.read_text()) if record.exists() else {}


def test_sys_exit_with_a_message_is_the_users_failure_with_its_message(tmp_path):
    """The message was swallowed and nothing recorded: the classifier saw exit code 1 alone
    (`unknown`, retried)."""
    proc, record = _rank(tmp_path, "sys.exit('the learning rate 20 diverged: loss is nan at step 3')\n")
    assert proc.returncode == 1
    assert "the learning rate 20 diverged" in proc.stderr and "the learning rate 20 diverged" in record["message"]
    assert record["source"] == "user"


@pytest.mark.parametrize("code", [3, 2])
def test_sys_exit_with_a_code_is_recorded_as_the_users(tmp_path, code):
    proc, record = _rank(tmp_path, f"sys.exit({code})\n")
    assert proc.returncode == code and record["source"] == "user" and f"exited with code {code}" in record["message"]


@pytest.mark.parametrize("body", ["sys.exit(75)\n", "run.exit_preempted()\n"])
def test_exit_75_without_a_sigterm_is_not_a_preemption(tmp_path, body):
    """75 is the preemption exit: taken without a SIGTERM, the gang was re-launched up to
    training.max_preemptions times without spending a retry."""
    proc, record = _rank(tmp_path, body)
    assert proc.returncode == 1 and record["source"] == "user"
    assert "75 is the preemption exit" in record["message"]


def test_exit_preempted_after_a_sigterm_exits_75(tmp_path):
    proc, record = _rank(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n"
                                   "assert run.should_stop\nrun.exit_preempted()\n")
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert not record


def test_a_forked_child_that_exits_leaves_the_ranks_run_alone(tmp_path):
    """The child's sys.exit(0) ran the rank's epilogue: an attempt record in metrics.jsonl, the
    process group torn down under its parent, a "returned without logging a model" record."""
    proc, record = _rank(tmp_path, "import os, pathlib\npid = os.fork()\nif pid == 0:\n    sys.exit(0)\n"
                                   "os.waitpid(pid, 0)\nrun.report(1, loss=0.5)\n"
                                   "d = pathlib.Path('model'); d.mkdir(); (d / 'weights.bin').write_bytes(b'0')\n"
                                   "run.log_model(d)\n")
    assert proc.returncode == 0 and not record, proc.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in lines if r.get("event") == "attempt"]) == 1  # the parent's only


def test_a_failure_says_when_the_code_replaced_gangflows_sigterm_handler(tmp_path):
    """A common `signal.signal(SIGTERM, lambda *a: sys.exit(0))` turned a preemption into "returned
    without logging a model", saying nothing of the handler."""
    proc, record = _rank(tmp_path, "import os, signal\ndef on_term(*a):\n    sys.exit(0)\n"
                                   "signal.signal(signal.SIGTERM, on_term)\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert proc.returncode == 1 and "returned without logging a model" in record["message"]
    assert "replaced gangflow's SIGTERM handler (with on_term)" in record["message"]
    proc, record = _rank(tmp_path, "sys.exit(0)\n")  # gangflow's own handler: nothing said of it
    assert "SIGTERM" not in record["message"]
