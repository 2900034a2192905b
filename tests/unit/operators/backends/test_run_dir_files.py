"""What the local and ray backends read from a run dir (the ranks' error records, torchrun's
failure summary and error files) and write into it (their logs): regular files only, never
through a link, never blocking on a FIFO, a hostile record never ending the task in a traceback."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from operators.backends.base import GangSpec
from operators.backends.local import LocalBackend, errors_since, mpirun_evidence, parse_torchrun_failures
from operators.failures import classify
from trainer.storage import LinkInPath

FIXTURES = Path(__file__).with_name("fixtures")


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _within(fn, timeout: float = 5.0):
    """fn()'s result (or the exception it raised); a failure when it blocked past `timeout`."""
    out = {}

    def call():
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["value"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"blocked for more than {timeout}s"
    return out["value"]


# --- the ranks' error records (errors_since: the mpirun path and the ray backend) ----------------


def _plant(errors: Path, kind: str, outside: Path) -> None:
    path = errors / "rank-1.json"
    if kind == "link":
        outside.write_text(json.dumps({"aws_secret_access_key": "AKIA-NOT-FOR-THE-RUN-DIR"}))
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "nested":
        path.write_text("[" * 200_000)
    elif kind == "not-an-object":
        path.write_text("[1, 2]")
    elif kind == "too-large":
        path.write_text(json.dumps({"message": "x" * (5 << 20)}))


@pytest.mark.parametrize("kind", ["link", "fifo", "nested", "not-an-object", "too-large"])
def test_an_error_record_that_is_not_a_regular_json_object_of_the_run_dir_is_no_evidence(tmp_path, kind):
    run = tmp_path / "run"
    (run / "errors").mkdir(parents=True)
    since = time.time()
    own = {"exc_type": "ValueError", "message": "injected fault", "source": "user", "rank": 0}
    (run / "errors" / "rank-0.json").write_text(json.dumps(own))
    _plant(run / "errors", kind, tmp_path / "secret.json")
    assert _within(lambda: errors_since(run, since)) == {0: own}
    agent = (FIXTURES / "mpirun_raise_rank_1.out").read_text()  # names rank 1 first
    evidence = _within(lambda: mpirun_evidence(1, agent, {}, run, since))
    assert evidence["rank"] == 1 and "error_file" not in evidence and "AKIA" not in json.dumps(evidence)


def test_a_linked_errors_folder_is_not_read(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank-0.json").write_text(json.dumps({"message": "not this run's"}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "errors").symlink_to(elsewhere)
    assert errors_since(tmp_path / "run", time.time() - 60) == {}


# --- torchrun's failure summary ------------------------------------------------------------------

SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
rank_main FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : {code} (pid: 10849)
  error_file: {error_file}
  traceback : {traceback}
============================================================"""


@pytest.mark.parametrize("code, name", [(-40, "SIG40"), (-9, "SIGKILL"), (-15, "SIGTERM")])
def test_a_rank_ended_by_a_signal_is_named_by_its_number_when_python_has_no_name_for_it(code, name):
    text = SUMMARY.format(code=code, error_file="<N/A>", traceback=f"Signal {-code} (<N/A>) received by PID 10849")
    assert parse_torchrun_failures(text) == [{"root_cause": True, "rank": 0, "exit_code": code, "signal": name}]
    evidence = LocalBackend._evidence(1, text, {0: ["step 3"]})
    assert (evidence["rank"], evidence["exit_code"], evidence["signal"]) == (0, code, name)
    assert classify(evidence).reason  # the classifier reads it (SIG40 by its exit code)


def test_a_traceback_line_that_looks_like_a_summary_field_is_not_one():
    traceback = ("Traceback (most recent call last):\n    File \"/app/train.py\", line 3, in main\n  ValueError: bad\n"
                 "  rank      : all of them\n  exitcode  : none\n  error_file: /etc/passwd")  # fmt: skip
    text = SUMMARY.format(code=1, error_file="<N/A>", traceback=traceback)
    assert parse_torchrun_failures(text) == [{"root_cause": True, "rank": 0, "exit_code": 1}]


@pytest.mark.parametrize("kind", ["link", "fifo", "nested"])
def test_torchruns_error_file_is_read_only_when_a_regular_file(tmp_path, kind):
    path = tmp_path / "error.json"
    if kind == "link":
        (tmp_path / "secret.json").write_text(json.dumps({"aws_secret_access_key": "AKIA-NOT-FOR-THE-RUN-DIR"}))
        path.symlink_to(tmp_path / "secret.json")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("[" * 200_000)
    text = SUMMARY.format(code=1, error_file=path, traceback="<N/A>")
    evidence = _within(lambda: LocalBackend._evidence(1, text, {}))
    assert isinstance(evidence, dict) and evidence["exit_code"] == 1 and "AKIA" not in json.dumps(evidence)
    if kind == "nested":  # not JSON that can be read: its text is the message, as for any other
        assert evidence["error_file"]["message"].startswith("[[[")
    else:
        assert "error_file" not in evidence


# --- logs written into the run dir ---------------------------------------------------------------


class _QuickLocal(LocalBackend):
    """Stands in for torchrun: one line, exit 0."""

    def command(self, spec, log_dir):
        return [sys.executable, "-c", "print('[default0]:hello')"]


@pytest.mark.parametrize("linked", ["torchrun", "torchrun/try-1"])
def test_the_local_backend_never_makes_its_log_folder_through_a_link(home, tmp_path, linked):
    outside, run = tmp_path / "outside", tmp_path / "run"
    outside.mkdir()
    (run / linked).parent.mkdir(parents=True)
    (run / linked).symlink_to(outside)
    spec = GangSpec(name="g", run_dir=str(run), world_size=1)
    with pytest.raises(LinkInPath, match=str(run / linked)):
        _QuickLocal().run(spec, lambda line: None)
    assert list(outside.iterdir()) == []
    (run / linked).unlink()
    assert _QuickLocal().run(spec, lambda line: None).succeeded and (run / "torchrun" / "try-1").is_dir()


def _ray(tmp_path):
    from operators.backends.ray import RayBackend

    backend = RayBackend()
    backend.command = lambda spec: [sys.executable, "-c", "print('driver output')"]  # stands in for the driver
    return backend, GangSpec(name="g", run_dir=str(tmp_path / "run"), world_size=1)


@pytest.mark.parametrize("kind", ["link", "fifo", "linked-folder"])
def test_the_ray_backend_never_writes_its_log_through_a_link_or_into_a_fifo(home, tmp_path, kind):
    victim = tmp_path / "outside" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("important\n")
    backend, spec = _ray(tmp_path)
    log = Path(spec.run_dir) / "ray" / "try-1.log"
    if kind == "linked-folder":
        Path(spec.run_dir).mkdir()
        log.parent.symlink_to(victim.parent)
    else:
        log.parent.mkdir(parents=True)
        log.symlink_to(victim) if kind == "link" else os.mkfifo(log)
    raised = _within(lambda: backend.run(spec, lambda line: None))
    assert isinstance(raised, LinkInPath) and str(log if kind != "linked-folder" else log.parent) in str(raised)
    assert victim.read_text() == "important\n" and os.listdir(victim.parent) == ["precious.txt"]


def test_the_ray_backends_log_with_another_name_is_replaced_never_emptied(home, tmp_path):
    backup = tmp_path / "backup-try-1.log"  # a `cp -al` backup of the run dir
    backup.write_text("the first run's log\n")
    backend, spec = _ray(tmp_path)
    log = Path(spec.run_dir) / "ray" / "try-1.log"
    log.parent.mkdir(parents=True)
    os.link(backup, log)
    result = backend.run(spec, lambda line: None)
    assert not result.succeeded  # no result line: the stand-in is no driver
    assert backup.read_text() == "the first run's log\n" and log.read_text() == "driver output\n"
