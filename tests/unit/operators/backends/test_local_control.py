"""Pausing a local gang (`python -m operators.cli.gang pause|resume GANG --local`): the command's
refusals, and the local backend stopping, waiting and launching again around a pause, with a
small Python program standing in for torchrun (tests/system/operators/backends/test_local_pause.py
runs a real 2-rank trainer gang)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from operators.backends import local_control
from operators.backends.base import GangResult, GangSpec
from operators.backends.local import LocalBackend
from operators.cli.gang import control


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _wait_for(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- the command ------------------------------------------------------------------------------


def test_the_command_says_where_the_gang_runs(home, capsys):
    for argv in (["pause", "g"], ["pause", "g", "--local", "--namespace", "team"]):
        with pytest.raises(SystemExit) as info:
            control(argv)
        assert info.value.code == 2
        assert "--namespace NS (a Kubernetes gang) or --local (backend local)" in capsys.readouterr().err


def test_no_running_local_gang_is_an_error_naming_where_it_looked(home):
    code, out = control(["pause", "train-1", "--local"])
    assert code == 1 and out["action"] == "pause"
    assert "no running local gang" in out["error"] and str(home / "gangs") in out["error"] and "GANGFLOW_HOME" in out["error"]


@pytest.mark.parametrize("name", ["../etc", "A", "x/y", "x-", ""])
def test_a_name_that_is_not_a_gang_name_is_refused_before_any_path_is_built(home, name):
    code, out = control(["pause", name, "--local"])
    assert code == 1 and "must be a gang's name, a DNS-1123 label" in out["error"]
    assert not (home / "gangs").exists()


def test_pause_then_resume_and_their_refusals(home):
    local_control.register("g-1", run_dir="/runs/g-1")
    assert json.loads((home / "gangs" / "g-1.json").read_text())["pid"] == os.getpid()
    assert local_control.pause_note("g-1") is None
    code, out = control(["pause", "g-1", "--local", "--reason", "node maintenance"])
    assert code == 0 and out["paused"] is True and out["backend"] == "local" and out["run_dir"] == "/runs/g-1"
    pause_id, note = local_control.pause_note("g-1")
    assert note.startswith("paused at ") and note.endswith(": node maintenance") and len(pause_id) == 32
    code, out = control(["pause", "g-1", "--local"])
    assert code == 1 and "already paused (paused at" in out["error"]
    assert control(["resume", "g-1", "--local"])[0] == 0 and local_control.pause_note("g-1") is None
    code, out = control(["resume", "g-1", "--local"])
    assert code == 1 and "is not paused" in out["error"]
    local_control.unregister("g-1")
    assert list((home / "gangs").iterdir()) == []


def test_a_gang_whose_task_is_gone_cannot_be_paused(home):
    (home / "gangs").mkdir(parents=True)
    (home / "gangs" / "g-2.json").write_text(json.dumps({"gang": "g-2", "pid": 2**22 + 12345, "run_dir": "/r"}))
    code, out = control(["pause", "g-2", "--local"])
    assert code == 1 and "(pid 4206649) is gone" in out["error"]
    assert not (home / "gangs" / "g-2.paused").exists()


def test_the_pause_marker_is_never_written_through_a_link(home, tmp_path):
    local_control.register("g-3", run_dir="/r")
    target = tmp_path / "elsewhere"
    (home / "gangs" / "g-3.paused").symlink_to(target)
    code, out = control(["pause", "g-3", "--local"])
    assert code == 1 and "already paused" in out["error"]
    assert not target.exists()
    # the link reads as a pause (never as none), and is not followed
    assert local_control.pause_note("g-3") == ("unreadable", "paused (marker unreadable)")


def _in_thread(fn, timeout: float = 5.0):
    """fn()'s result, or a failure when it has not returned within `timeout` (it blocked)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"blocked for more than {timeout}s"
    return out["value"]


def test_a_pause_marker_that_is_a_fifo_is_a_pause_never_opened_and_resume_removes_it(home):
    local_control.register("g-4", run_dir="/r")
    marker = home / "gangs" / "g-4.paused"
    os.mkfifo(marker)
    assert _in_thread(lambda: local_control.pause_note("g-4")) == ("unreadable", "paused (marker unreadable)")
    code, out = _in_thread(lambda: control(["pause", "g-4", "--local"]))
    assert code == 1 and "already paused" in out["error"]
    assert _in_thread(lambda: control(["resume", "g-4", "--local"]))[0] == 0
    assert not os.path.lexists(marker) and local_control.pause_note("g-4") is None


@pytest.mark.parametrize("kind", ["fifo", "folder", "link"])
def test_a_gang_record_that_is_not_a_regular_file_is_an_error_naming_it(home, tmp_path, kind):
    record = home / "gangs" / "g-5.json"
    record.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(record)
    elif kind == "folder":
        record.mkdir()
    else:
        (tmp_path / "elsewhere.json").write_text(json.dumps({"gang": "g-5", "pid": os.getpid(), "run_dir": "/r"}))
        record.symlink_to(tmp_path / "elsewhere.json")
    code, out = _in_thread(lambda: control(["pause", "g-5", "--local"]))
    assert code == 1 and f"its record {record} is unreadable" in out["error"]
    assert not os.path.lexists(home / "gangs" / "g-5.paused")


@pytest.mark.parametrize("pid", [2**70, 0, -1, "12x", True])
def test_a_gang_record_whose_pid_is_not_a_process_id_is_an_error_naming_it(home, pid):
    record = home / "gangs" / "g-6.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"gang": "g-6", "pid": pid, "run_dir": "/r"}))
    for action in ("pause", "resume"):
        code, out = control([action, "g-6", "--local"])
        assert code == 1 and f"its record {record} is unreadable" in out["error"], out
    assert not os.path.lexists(home / "gangs" / "g-6.paused")


def test_a_gang_record_without_its_run_dir_is_still_paused_and_resumed(home):
    record = home / "gangs" / "g-8.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"gang": "g-8", "pid": os.getpid()}))
    code, out = control(["pause", "g-8", "--local"])
    assert code == 0 and out["paused"] is True and out["run_dir"] is None
    code, out = control(["resume", "g-8", "--local"])
    assert code == 0 and out["paused"] is False


def test_resume_removes_a_pause_marker_that_is_a_folder(home):
    local_control.register("g-7", run_dir="/r")
    marker = home / "gangs" / "g-7.paused"
    (marker / "inside").mkdir(parents=True)
    assert local_control.pause_note("g-7") == ("unreadable", "paused (marker unreadable)")
    code, out = control(["resume", "g-7", "--local"])
    assert code == 0 and out["paused"] is False, out
    assert not os.path.lexists(marker) and local_control.pause_note("g-7") is None
    marker.mkdir()  # one nobody resumed is forgotten with the gang
    local_control.unregister("g-7")
    assert list((home / "gangs").iterdir()) == []


# --- the backend around a pause --------------------------------------------------------------

# Stands in for torchrun: the first launch runs until SIGTERM, then "commits" and exits 75 as the
# ranks do; the next one finds the commit and ends at once, as a resumed gang that is done.
_GANG = """
import os, signal, sys, time
run = sys.argv[1]
if os.path.exists(os.path.join(run, "committed")):
    print("[default0]:gangflow: resuming from checkpoint step-7 (x)", flush=True)
    sys.exit(0)
def term(*_):
    open(os.path.join(run, "committed"), "w").close()
    sys.exit(75)
signal.signal(signal.SIGTERM, term)
open(os.path.join(run, "started"), "w").close()
while True:
    time.sleep(0.05)
"""


class _ScriptBackend(LocalBackend):
    def command(self, spec, log_dir):
        return [sys.executable, "-c", _GANG, spec.run_dir]


def _start(tmp_path):
    spec = GangSpec(name="paused-gang", run_dir=str(tmp_path / "run"), world_size=1, config_path="params.yaml")
    Path(spec.run_dir).mkdir()
    backend, log, out = _ScriptBackend(grace_period_s=10), [], {}
    thread = threading.Thread(target=lambda: out.setdefault("result", backend.run(spec, log.append)), daemon=True)
    thread.start()
    _wait_for(lambda: (tmp_path / "run" / "started").exists(), "the gang to start")
    return backend, log, out, thread


def test_a_paused_gang_is_stopped_with_its_checkpoint_waits_and_is_launched_again(home, tmp_path):
    backend, log, out, thread = _start(tmp_path)
    assert control(["pause", "paused-gang", "--local", "--reason", "maintenance"])[0] == 0
    _wait_for(lambda: any("waiting for `python -m operators.cli.gang resume paused-gang --local`" in x for x in log), "the wait")
    assert (tmp_path / "run" / "committed").exists()  # it was stopped with SIGTERM, its final checkpoint taken
    assert any("stopping it (SIGTERM" in x and "maintenance" in x for x in log)
    time.sleep(1.0)
    assert thread.is_alive()  # paused, not failed
    assert control(["resume", "paused-gang", "--local"])[0] == 0
    thread.join(20)
    result: GangResult = out["result"]
    assert result.succeeded and result.pauses == 1 and result.resumed_from_step == 7
    assert backend.paused_s >= 1.0
    assert any(x.startswith("gang paused-gang: resumed after") for x in log)
    assert list((home / "gangs").iterdir()) == []  # forgotten once it ended


def test_a_gang_killed_while_paused_ends_at_once_and_is_not_launched_again(home, tmp_path):
    backend, log, out, thread = _start(tmp_path)
    assert control(["pause", "paused-gang", "--local"])[0] == 0
    _wait_for(lambda: any("waiting for" in x for x in log), "the wait")
    backend.kill()
    thread.join(5)
    assert not thread.is_alive()
    result: GangResult = out["result"]
    assert not result.succeeded and result.detail == "stopped while paused" and result.pauses == 1
    assert not any("launching it again" in x for x in log)
    assert list((home / "gangs").iterdir()) == []  # the pause nobody resumed is forgotten too


def test_a_fifo_as_the_pause_marker_never_blocks_the_task_and_kill_ends_it(home, tmp_path):
    spec = GangSpec(name="fifo-gang", run_dir=str(tmp_path / "run"), world_size=1, config_path="params.yaml")
    Path(spec.run_dir).mkdir()
    (home / "gangs").mkdir(parents=True)
    os.mkfifo(home / "gangs" / "fifo-gang.paused")
    backend, log, out = _ScriptBackend(grace_period_s=10), [], {}
    thread = threading.Thread(target=lambda: out.setdefault("result", backend.run(spec, log.append)), daemon=True)
    thread.start()
    _wait_for(lambda: any("waiting for" in x for x in log), "the wait", timeout=5)
    backend.kill()
    thread.join(5)
    assert not thread.is_alive() and out["result"].detail == "stopped while paused"
    assert not (tmp_path / "run" / "started").exists()
    assert list((home / "gangs").iterdir()) == []


def test_a_gang_whose_output_cannot_be_read_is_stopped_and_reaped_with_its_pause_watch(home, tmp_path):
    """Reading the gang's output raised (here: the task's log): the gang is stopped (SIGTERM, so
    its final checkpoint), reaped, and its pause watch ends; nothing is left running."""
    spec = GangSpec(name="broken-log", run_dir=str(tmp_path / "run"), world_size=1, config_path="params.yaml")
    Path(spec.run_dir).mkdir()
    backend = _ScriptBackend(grace_period_s=10)

    def log(line):
        if (tmp_path / "run" / "started").exists():
            raise OSError("the task's log is gone")

    _GANG_PRINTS = _GANG.replace("while True:", "while True:\n    print('step', flush=True)")
    backend.command = lambda spec, log_dir: [sys.executable, "-c", _GANG_PRINTS, spec.run_dir]
    with pytest.raises(OSError, match="log is gone"):
        backend.run(spec, log)
    assert (tmp_path / "run" / "committed").exists() and backend._proc is None
    _wait_for(lambda: not [t for t in threading.enumerate() if t.name == "pause-watch-broken-log"], "the watch to end")


def test_paused_time_does_not_count_against_the_run_time_limit(worker_manifest_free_operator):
    op, spec = worker_manifest_free_operator

    class Paused:
        deferrable = False
        paused_s = 0.0

        def __init__(self):
            self.kills = 0

        def run(self, spec, log):
            for _ in range(30):  # 1.5 s of which 1.4 s paused, under a 1 s limit
                time.sleep(0.05)
                self.paused_s = min(self.paused_s + 0.05, 1.4)
            return GangResult(succeeded=True, exit_code=0, pauses=1)

        def kill(self):
            self.kills += 1

    op._backend = gang = Paused()
    result = op._run_gang(spec, print)
    assert result.succeeded and gang.kills == 0 and op.pauses == 1


@pytest.fixture()
def worker_manifest_free_operator(tmp_path):
    import dataclasses

    from operators.training import GangTrainingOperator

    op = GangTrainingOperator(task_id="train", world_size=1, max_run_time_seconds=1)
    spec = GangSpec(name="g", run_dir=str(tmp_path / "run"), world_size=1, config_path="params.yaml", max_run_time_s=1)
    return op, dataclasses.replace(spec)
