"""Adversarial and robustness tests of the failure classifier (issue 10, item 5).

An exception is judged by its type first and its message second; odd evidence (missing,
wrong-typed, huge, deeply nested) never makes `classify` raise nor the CLI print a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operators.failures import classify

PROJECT_ROOT = Path(__file__).resolve().parents[4]


def tb(exc_line: str, *, raise_line: str = "raise_it()", path: str = "/app/train.py") -> str:
    """A traceback whose innermost frame is `path` running `raise_line`."""
    return (
        "Traceback (most recent call last):\n"
        f'  File "{path}", line 10, in <module>\n'
        "    main()\n"
        f'  File "{path}", line 7, in main\n'
        f"    {raise_line}\n"
        f"{exc_line}\n"
    )


# -- type first, message second ---------------------------------------------------------------


@pytest.mark.parametrize(
    "exc_line, raise_line",
    [
        ('ValueError: could not parse "Connection reset by peer" out of the log', "raise ValueError(msg)"),
        ("KeyError: 'NCCL timeout: Connection closed by peer'", "raise KeyError(key)"),
        ("AssertionError: loss is nan after Input/output error retry", "assert not torch.isnan(loss), msg"),
        ("TimeoutError: data loader stalled", "raise TimeoutError('data loader stalled')"),
        ("TypeError: expected 503 Service Unavailable to be an int", "raise TypeError(msg)"),
    ],
)
def test_user_exception_with_infra_words_in_its_message_is_user(exc_line, raise_line):
    verdict = classify({"exit_code": 1, "log_tail": tb(exc_line, raise_line=raise_line)})
    assert verdict.kind == "user", verdict.reason
    assert not verdict.retryable


def test_trainer_record_of_a_user_valueerror_with_infra_words_is_user():
    record = {
        "exc_type": "ValueError",
        "message": "bad sample: Connection reset by peer",
        "source": "user",
        "rank": 0,
        "step": 3,
        "traceback": tb("ValueError: bad sample: Connection reset by peer", raise_line="raise ValueError(msg)"),
    }
    assert classify({"exit_code": 1, "error_file": record}).kind == "user"


@pytest.mark.parametrize(
    "exc_line, line",
    [
        ("ConnectionResetError: [Errno 104] Connection reset by peer", "data = sock.recv(4096)"),
        ("OSError: [Errno 5] Input/output error", "torch.save(state, path)"),
        ("BrokenPipeError: [Errno 32] Broken pipe", "conn.send(batch)"),
        ("OSError: [Errno 116] Stale file handle", "with open(path) as fh:"),
        ("TimeoutError: timed out", "data = sock.recv(4096)"),  # raised by the socket, not by user code
    ],
)
def test_infra_symptom_raised_inside_user_frames_is_infra(exc_line, line):
    verdict = classify({"exit_code": 1, "log_tail": tb(exc_line, raise_line=line)})
    assert verdict.kind == "infra", verdict.reason


def test_library_valueerror_with_a_dns_message_is_infra():
    log = tb("ValueError: host not found: Temporary failure in name resolution", raise_line="store = TCPStore(addr)",
             path="/usr/lib/python3.11/site-packages/torch/distributed/rendezvous.py")  # fmt: skip
    assert classify({"exit_code": 1, "log_tail": log}).kind == "infra"


# -- odd evidence -------------------------------------------------------------------------------


def nested(depth: int, leaf=None):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "evidence",
    [
        {"exit_code": 10**5000},
        {"exit_code": "9" * 5000},
        {"signal": 10**5000},
        {"rank": 10**5000, "step": -(10**5000)},
        {"error_file": {"rank": 10**5000, "message": "ValueError: x", "source": "user"}},
        {"log_tail": nested(5000, "Connection reset by peer")},
        {"pod_message": nested(3000)},
        {"events": [{"reason": nested(3000), "message": nested(3000)}]},
        {"pod_conditions": [{"type": nested(3000, "DisruptionTarget")}]},
        {"error_file": {"message": nested(3000, "x"), "extraInfo": {"py_callstack": nested(3000)}}},
        {"error_file": json.dumps({"message": nested(900, "x")})},  # a 1.9 KB termination message
        {"ranks": [{"ranks": [{"ranks": [{"exit_code": 137}]}]}]},
        {"ranks": [{"rank": i, "exit_code": 1} for i in range(20000)]},
        {"exit_code": float("nan"), "signal": float("inf")},
        {"exit_code": True, "signal": False, "pod_phase": 3, "pod_reason": ["Evicted"], "log_tail": {"a": 1}},
        {"events": [{"reason": "Evicted", "message": 10**5000}]},
    ],
)
def test_classify_never_raises(evidence):
    verdict = classify(evidence)
    assert verdict.kind in {"infra", "user", "unknown"}
    assert "\n" not in verdict.reason and len(verdict.reason) < 300


def test_a_huge_log_is_bounded_in_time():
    log = ("step 1 loss 0.5 " * 40 + "\n") * 60_000 + "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    start = time.perf_counter()
    verdict = classify({"log_tail": log})
    assert time.perf_counter() - start < 5
    assert verdict.kind == "user"  # the end of the log (where the cause is) is kept


def run_cli(stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "operators.failures"], input=stdin, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60
    )


@pytest.mark.parametrize(
    "stdin",
    [
        '{"exit_code": ' + "9" * 5000 + "}",
        '{"log_tail": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "[" * 100_000,
        '{"error_file": ' + json.dumps(json.dumps({"message": nested(900, "x")})) + "}",
    ],
    ids=["huge-int", "deep-list", "deep-unclosed", "deep-termination-message"],
)
def test_cli_never_prints_a_traceback(stdin):
    proc = run_cli(stdin)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if proc.returncode == 0:
        verdict = json.loads(proc.stdout)
        assert set(verdict) == {"kind", "retryable", "reason"}
    else:
        assert proc.returncode == 2 and proc.stdout == "" and "operators.failures:" in proc.stderr


def test_cli_reads_huge_ints_as_evidence():
    proc = run_cli('{"exit_code": ' + "9" * 5000 + ', "termination_reason": "OOMKilled"}')
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kind"] == "user"


# -- negative exit codes keep their sign ---------------------------------------------------------


def test_torchrun_sigkill_exit_code_keeps_its_sign():
    from operators.backends.local import LocalBackend

    evidence = LocalBackend._evidence(-9, "torch.distributed.elastic: worker group failed", {})
    assert evidence["exit_code"] == -9
    verdict = classify(evidence)
    assert (verdict.rule, verdict.retryable) == ("killed-from-outside", True), verdict.reason


def test_cli_reads_undecodable_bytes_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "operators.failures"], input=b'\xff\xfe{"exit_code": 1}', capture_output=True,
        cwd=PROJECT_ROOT, timeout=60, env={"PYTHONIOENCODING": "ascii:strict", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert b"Traceback" not in proc.stderr and proc.returncode == 2


def test_random_evidence_never_raises():
    import random

    rng = random.Random(10)
    atoms = [None, True, -9, 137, 10**30, 1.5, float("nan"), "", "SIGKILL", "OOMKilled", "Evicted", "DisruptionTarget",
             "Traceback (most recent call last):\n", "ValueError: x", '  File "/app/t.py", line 1, in f\n', "[rank1]: ",
             "failed (exitcode: -9) local_rank: 0", "NVRM: Xid (PCI:0): 79", "\x1b[31m", "{", "\n"]  # fmt: skip
    keys = ["exit_code", "signal", "termination_reason", "pod_phase", "pod_reason", "pod_message", "pod_conditions",
            "events", "log_tail", "error_file", "rank", "step", "ranks", "type", "reason", "message", "source"]  # fmt: skip

    def value(depth: int):
        roll = rng.random()
        if depth > 3 or roll < 0.5:
            return rng.choice(atoms)
        if roll < 0.7:
            return "".join(str(rng.choice(atoms)) for _ in range(rng.randint(1, 6)))
        if roll < 0.85:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 5))}

    for _ in range(400):
        evidence = {rng.choice(keys): value(0) for _ in range(rng.randint(0, 8))}
        verdict = classify(evidence)
        assert verdict.kind in {"infra", "user", "unknown"} and len(verdict.reason) < 300
