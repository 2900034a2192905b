"""The failure classifier (contract 4, docs/contracts.md), tested on evidence text quoted from public bug reports.

Each file in tests/unit/operators/failures/evidence/ holds `source` (where such text is seen publicly),
`expect` ({kind, rule, reason_contains}) and `evidence` (what a backend would collect).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import benchmark_module

from operators.failures import RULES, Verdict, classify

EVIDENCE_DIR = Path(__file__).with_name("evidence")
FIXTURES = sorted(EVIDENCE_DIR.glob("*.json"))
PROJECT_ROOT = Path(__file__).resolve().parents[4]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_there_are_enough_fixtures():
    assert 25 <= len(FIXTURES) <= 90


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture(path: Path):
    fixture = load(path)
    assert fixture["source"].strip(), "every fixture names where its text is seen publicly"
    expect = fixture["expect"]
    verdict = classify(fixture["evidence"], precedents=False)  # the rule table's own verdict
    assert verdict.kind == expect["kind"], verdict.reason
    assert verdict.rule == expect["rule"], verdict.reason
    assert verdict.retryable is expect.get("retryable", expect["kind"] != "user")  # an ambiguous crash is retried once
    for needle in expect["reason_contains"]:
        assert needle in verdict.reason, f"{needle!r} not in {verdict.reason!r}"
    assert verdict.reason.startswith(f"{verdict.kind}: ")
    assert "\n" not in verdict.reason and len(verdict.reason) < 300


def test_every_rule_has_a_fixture():
    covered = {load(p)["expect"]["rule"] for p in FIXTURES}
    missing = [rule.name for rule in RULES if rule.name not in covered]
    assert not missing, f"rules without public evidence: {missing}"
    assert "" in covered, "the unknown verdict needs a fixture too"


def test_rule_table_is_well_formed():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    tiers = [rule.tier for rule in RULES]
    assert tiers == sorted(tiers), "the table is in precedence order: tiers must not go back up"
    assert {rule.kind for rule in RULES} == {"infra", "user", "unknown"}
    # a secondary rule describes a rank that died because another did: never the user's verdict
    assert all(rule.kind in ("infra", "unknown") for rule in RULES if rule.secondary)
    assert [rule.name for rule in RULES if rule.kind == "unknown"] == ["collective-timeout"]


# -- the Verdict ------------------------------------------------------------------------------


def test_verdict_contract():
    verdict = classify({"exit_code": 137, "termination_reason": "OOMKilled"})
    assert verdict.to_dict() == {"kind": "user", "retryable": False, "reason": verdict.reason}
    assert Verdict.from_dict(verdict.to_dict()) == verdict
    with pytest.raises(AttributeError):
        verdict.kind = "infra"  # frozen
    with pytest.raises(ValueError, match="kind"):
        Verdict("maybe", True, "x")


# -- precedence and details not covered by one fixture each -------------------------------------


@pytest.mark.parametrize(
    "evidence, rule",
    [
        ({"signal": "SIGKILL"}, "killed-from-outside"),
        ({"signal": "KILL"}, "killed-from-outside"),
        ({"signal": 9, "termination_reason": "OOMKilled"}, "oom-killed"),
        ({"exit_code": -9}, "killed-from-outside"),
        ({"exit_code": "137"}, "killed-from-outside"),
        ({"signal": "SIGTERM"}, "sigterm"),
        ({"exit_code": -15}, "sigterm"),
        ({"exit_code": 75, "signal": "SIGTERM"}, "trainer-preempted-exit"),
        ({"exit_code": 2}, "trainer-config-error"),
        ({"error_file": {"message": "KeyError: 'train.lr'", "source": "config"}}, "trainer-config-error"),
        # An exception the trainer blamed on the user is still infra when it is an infra symptom.
        ({"error_file": {"message": "OSError: [Errno 5] Input/output error", "source": "user"}}, "transient-storage"),
        ({"error_file": {"message": "ConnectionError: boom", "exc_type": "ConnectionError", "source": "user"}}, "transient-network"),  # fmt: skip
        # Application Xids (13, 31, 43, 45) are not hardware; with an illegal access it is a code bug.
        ({"log_tail": "NVRM: Xid (PCI:0000:3b:00): 31, pid=123, Ch 00000010, intr 10000000. MMU Fault"}, ""),
        (
            {"log_tail": "NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception\nRuntimeError: CUDA error: an illegal memory access was encountered"},  # fmt: skip
            "illegal-memory-access",
        ),
        ({"log_tail": "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, An uncorrectable double bit error (DBE)"}, "gpu-hardware"),
        ({"pod_reason": "DeadlineExceeded", "pod_message": "Pod was active on the node longer than the specified deadline"}, "deadline-exceeded"),  # fmt: skip
        ({"pod_reason": "CreateContainerConfigError"}, "container-config-error"),
        ({"events": [{"reason": "Failed", "message": "Error: couldn't find key VALUE in Secret default/aegis-secret"}]}, "container-config-error"),  # fmt: skip
        ({"exit_code": 0, "termination_reason": "Completed"}, ""),
        ({}, ""),
    ],
)
def test_rule_details(evidence, rule):
    assert classify(evidence, precedents=False).rule == rule


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_a_precedent_never_overrides_a_rule(path: Path):
    evidence = load(path)["evidence"]
    rules_only = classify(evidence, precedents=False)
    verdict = classify(evidence)
    if rules_only.kind != "unknown":
        assert verdict == rules_only and verdict.rule == rules_only.rule
    else:
        assert verdict.rule in {"", "precedent"}
        assert verdict.kind == "unknown" or verdict.reason.startswith(f"{verdict.kind}: like https://")


def test_rank_and_step_from_the_evidence_keys_are_in_the_reason():
    verdict = classify({"rank": 2, "step": 17, "exit_code": 137})
    assert "at rank 2, step 17" in verdict.reason


def test_user_exception_names_the_frame_and_the_rank():
    log = (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/app/trainer/loop.py", line 42, in train_step\n'
        "[rank1]:     loss = model(batch)\n"
        '[rank1]:   File "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1, in _call_impl\n'
        "[rank1]:     return forward_call(*args)\n"
        "[rank1]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x10 and 20x2)\n"
    )
    verdict = classify({"log_tail": log})
    assert verdict.rule == "user-exception"
    assert verdict.reason == (
        "user: RuntimeError raised in training code at rank 1: "
        "mat1 and mat2 shapes cannot be multiplied (4x10 and 20x2) (trainer/loop.py:42)"
    )


def test_a_traceback_only_through_library_frames_is_not_a_user_bug():
    log = (
        "Traceback (most recent call last):\n"
        '  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/run.py", line 806, in main\n'
        "    run(args)\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert classify({"exit_code": 1, "log_tail": log}, precedents=False).kind == "unknown"


def test_chained_exception_with_an_infra_cause_is_infra():
    log = (
        "Traceback (most recent call last):\n"
        '  File "/app/trainer/data.py", line 10, in fetch\n'
        "    return urlopen(url)\n"
        "socket.gaierror: [Errno -3] Temporary failure in name resolution\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "/app/trainer/data.py", line 12, in fetch\n'
        "    raise RuntimeError('dataset download failed')\n"
        "RuntimeError: dataset download failed\n"
    )
    verdict = classify({"log_tail": log})
    assert (verdict.kind, verdict.rule) == ("infra", "transient-network")


def test_ranks_all_secondary_prefers_the_sigtermed_rank():
    verdict = classify(
        {
            "ranks": [
                {"rank": 0, "log_tail": "RuntimeError: [pair.cc:598] Connection closed by peer [10.0.0.2]:1"},
                {"rank": 1, "exit_code": 143},
            ]
        }
    )
    assert (verdict.kind, verdict.rule) == ("infra", "sigterm")
    assert "rank 1" in verdict.reason and "rank 0: peer-connection-lost" in verdict.reason


def test_gang_level_exit_code_does_not_outrank_the_ranks_symptoms():
    verdict = classify(
        {
            "exit_code": 1,  # torchrun's own exit code: no rule, but not a rank that failed on its own
            "ranks": [
                {"rank": 0, "log_tail": "RuntimeError: [pair.cc:598] Connection closed by peer [10.0.0.2]:1"},
                {"rank": 1, "log_tail": "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8)"},
            ],
        }
    )
    # the peer's lost connection names an infra cause; the other rank's timeout names none
    assert (verdict.kind, verdict.rule) == ("infra", "peer-connection-lost")


def test_ranks_merge_gang_level_evidence():
    verdict = classify(
        {
            "exit_code": 1,
            "log_tail": "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
            "ranks": [{"rank": 0, "exit_code": 137, "termination_reason": "OOMKilled"}],
        }
    )
    assert (verdict.kind, verdict.rule) == ("user", "oom-killed")
    assert "rank 0" in verdict.reason


@pytest.mark.parametrize(
    "evidence",
    [
        None,
        [],
        "boom",
        {"exit_code": "n/a", "signal": {"x": 1}, "events": "Evicted", "pod_conditions": [1, "x", None]},
        {"error_file": "not json at all"},
        {"error_file": '{"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": 5}}}'},
        {"error_file": 42, "log_tail": ["Traceback (most recent call last):\n", "ValueError\n"]},
        {"ranks": "rank 0"},
        {"ranks": [None, 1, {"exit_code": 137}]},
        {"log_tail": "Traceback (most recent call last):\n" * 3},
    ],
)
def test_classify_never_raises_on_odd_evidence(evidence):
    verdict = classify(evidence)
    assert verdict.kind in {"infra", "user", "unknown"}
    assert len(verdict.reason) < 300


def test_error_file_as_raw_json_string_and_plain_message():
    raw = json.dumps({"message": {"message": "ValueError: bad shape", "extraInfo": {"py_callstack": "", "timestamp": "1"}}})
    assert classify({"error_file": raw}, precedents=False).kind == "unknown"  # no frames: not provably the user's code
    plain = {"message": "ValueError: bad shape", "rank": 0, "step": 3, "exc_type": "ValueError", "source": "user"}
    verdict = classify({"error_file": plain})
    assert verdict.reason == "user: ValueError raised in training code at rank 0, step 3: bad shape"


TRAINER_TB = (
    "Traceback (most recent call last):\n"
    '  File "/work/trainer/loop.py", line 120, in run\n'
    "    self.checkpointer.save(step)\n"
    '  File "/work/trainer/checkpoint.py", line 88, in save\n'
    "    raise CheckpointError(msg)\n"
    "trainer.errors.CheckpointError: manifest of step 40 lists a missing shard\n"
)


def test_trainer_termination_log_record():
    """The trainer's own record format (DIR/errors/rank-R.json, the Kubernetes termination message)."""
    record = {
        "exc_type": "ValueError", "message": "injected fault at step 5", "source": "user", "rank": 1, "step": 5,
        "time": 1764428400.0, "traceback": "Traceback (most recent call last):\n  File \"/work/trainer/loop.py\", "
        "line 88, in train_step\n    raise ValueError(msg)\nValueError: injected fault at step 5\n",
    }  # fmt: skip
    verdict = classify({"exit_code": 1, "termination_reason": "Error", "error_file": record})
    assert verdict.reason == "user: ValueError raised in training code at rank 1, step 5: injected fault at step 5"


def test_trainer_record_with_null_source_is_not_blamed_on_the_user():
    record = {"exc_type": "CheckpointError", "message": "manifest of step 40 lists a missing shard",
              "source": None, "rank": 0, "step": 40, "traceback": TRAINER_TB}  # fmt: skip
    verdict = classify({"exit_code": 1, "error_file": record, "log_tail": TRAINER_TB}, precedents=False)
    assert verdict.kind == "unknown" and "rank 0, step 40" in verdict.reason
    # Without the trainer's word, the same traceback through the trainer's frames is a code bug.
    assert classify({"exit_code": 1, "log_tail": TRAINER_TB}).rule == "user-exception"
    # And with an infrastructure message it is infra either way.
    record = dict(record, exc_type="RuntimeError", message="[pair.cc:598] Connection closed by peer [10.0.0.3]:41")
    assert classify({"exit_code": 1, "error_file": record}).rule == "peer-connection-lost"


def test_waiting_reason_and_message_of_an_image_pull():
    evidence = {
        "termination_reason": "ErrImagePull",
        "pod_message": 'rpc error: code = NotFound desc = failed to pull and unpack image "ghcr.io/acme/train:v9": not found',
    }
    assert classify(evidence).rule == "image-missing"


def test_reason_is_clipped_to_one_line():
    verdict = classify({"log_tail": "OSError: [Errno 5] Input/output error: " + "x" * 2000 + "\nmore"})
    assert verdict.rule == "transient-storage"
    assert len(verdict.reason) < 300 and "\n" not in verdict.reason


def test_module_imports_nothing_heavy():
    code = (
        "import sys, operators.failures\n"
        "heavy = [m for m in ('torch', 'kubernetes', 'airflow', 'mlflow', 'numpy') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True)
    assert out.stdout.strip() == "[]"


# -- the CLI ---------------------------------------------------------------------------------


def run_cli(stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "operators.failures", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=60,
    )


@pytest.mark.parametrize("name", ["k8s_disruption_preemption_by_scheduler", "ranks_user_exception_beats_peer_reset"])
def test_cli_prints_the_verdict(name):
    fixture = load(EVIDENCE_DIR / f"{name}.json")
    proc = run_cli(json.dumps(fixture["evidence"]))
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert set(printed) == {"kind", "retryable", "reason"}
    assert printed == classify(fixture["evidence"]).to_dict()


def test_cli_reads_a_file_argument(tmp_path):
    path = tmp_path / "evidence.json"
    path.write_text(json.dumps({"exit_code": 137, "termination_reason": "OOMKilled"}))
    proc = run_cli("", str(path))
    assert proc.returncode == 0 and json.loads(proc.stdout)["kind"] == "user"


@pytest.mark.parametrize(
    "stdin, message",
    [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"), ("", "not valid JSON")],
)
def test_cli_rejects_bad_input(stdin, message):
    proc = run_cli(stdin)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stdout == ""


def test_the_docs_rule_table_is_current():
    module = benchmark_module("classifier")
    docs = (PROJECT_ROOT / "docs" / "failures.md").read_text()
    assert module.rule_table() in docs, "regenerate it: python benchmarks/classifier.py --rule-table"


def _user_code_record(message: str, exc_type: str, callstack: str) -> dict:
    """The evidence of a rank whose training code raised: exit code 1 and the trainer's record, source `user`."""
    return {"exit_code": 1, "error_file": {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack, "exc_type": exc_type, "source": "user", "rank": 0, "step": 0}}}}  # fmt: skip


@pytest.mark.parametrize("message", [
    "RuntimeError: CUDA error: no CUDA-capable device is detected",
    "RuntimeError: Failed to initialize NVML: Driver/library version mismatch",
])  # fmt: skip
def test_a_trainer_record_of_user_code_that_met_a_broken_gpu_stack_is_infra(message: str):
    """The trainer records source `user` for any exception raised inside the user's code; one whose
    message names a broken GPU stack is the node's, as it is when read from the raw log alone."""
    name = message.partition(": ")[0]
    callstack = ("Traceback (most recent call last):\n  File \"/work/mytrain.py\", line 12, in main\n"
                 "    model = model.cuda()\n" + f"{message}\n")  # fmt: skip
    verdict = classify(_user_code_record(message, name, callstack), precedents=False)
    assert (verdict.kind, verdict.rule) == ("infra", "gpu-node-fault"), verdict.reason


@pytest.mark.parametrize(("cause", "rule"), [
    ("RuntimeError: CUDA error: no CUDA-capable device is detected", "gpu-node-fault"),
    ("ConnectionResetError: [Errno 104] Connection reset by peer", "peer-connection-lost"),
])  # fmt: skip
def test_a_trainer_record_of_user_code_wrapping_an_infra_cause_is_judged_by_the_cause(cause: str, rule: str):
    """User code that wraps the error (`raise ... from exc`): the cause in the record's chain decides,
    as it does in a raw log's chained traceback and in the trainer's own judgement of a live exception."""
    callstack = ("Traceback (most recent call last):\n  File \"/work/mytrain.py\", line 12, in main\n    model = setup()\n"
                 f"{cause}\n\nThe above exception was the direct cause of the following exception:\n\n"
                 "Traceback (most recent call last):\n  File \"/work/mytrain.py\", line 30, in <module>\n"
                 "    raise RuntimeError(\"could not set up the model\") from exc\n"
                 "RuntimeError: could not set up the model\n")  # fmt: skip
    verdict = classify(_user_code_record("could not set up the model", "RuntimeError", callstack), precedents=False)
    assert (verdict.kind, verdict.rule) == ("infra", rule), verdict.reason
