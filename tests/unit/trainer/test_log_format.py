"""GANGFLOW_LOG_FORMAT=json (issue 26 item 2): each line of a rank as one JSON object with its job and
rank fields, whole lines only; text stays the default; a bad value is refused naming the variable.
Real ranks under torchrun: tests/system/trainer/test_log_format.py."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from trainer.console import JsonLines, install_log_format, log_fields, log_format, say

ENV = {"RANK": "1", "LOCAL_RANK": "0", "GANGFLOW_GANG": "train-pipeline-0123456789", "GANGFLOW_DAG_ID": "train_pipeline",
       "GANGFLOW_DAG_RUN_ID": "manual__1", "GANGFLOW_PIPELINE": "digits", "GANGFLOW_MLFLOW_RUN_ID": "abc", "GANGFLOW_TRY_NUMBER": "2"}


def test_each_line_becomes_one_json_object_with_the_job_and_rank():
    sink = io.StringIO()
    stream = JsonLines(sink, name="stderr", fields=log_fields(ENV))
    stream.write("Traceback (most recent call last):\n  File")
    assert sink.getvalue().count("\n") == 1  # the partial line waits
    stream.write(' "x.py"\nValueError: boom\n')
    say("gangflow: done", stream=stream)
    stream.write("no newline")
    stream.flush()
    records = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [r["message"] for r in records] == ["Traceback (most recent call last):", '  File "x.py"', "ValueError: boom",
                                               "gangflow: done", "no newline"]
    assert {(r["rank"], r["local_rank"], r["gang"], r["dag_id"], r["dag_run_id"], r["pipeline"], r["mlflow_run_id"], r["attempt"], r["stream"])
            for r in records} == {(1, 0, "train-pipeline-0123456789", "train_pipeline", "manual__1", "digits", "abc", "2", "stderr")}


def test_text_is_the_default_and_a_bad_value_is_refused():
    assert log_format({}) == "text" and log_format({"GANGFLOW_LOG_FORMAT": "json"}) == "json"
    with pytest.raises(ValueError, match="GANGFLOW_LOG_FORMAT='yaml': accepted values are text, json"):
        log_format({"GANGFLOW_LOG_FORMAT": "yaml"})
    assert log_fields({})["mlflow_run_id"] is None and log_fields({"MLFLOW_RUN_ID": "pod-run"})["mlflow_run_id"] == "pod-run"


def test_install_replaces_stdout_and_stderr_only_for_json(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert install_log_format({}) == "text" and sys.stdout is out
    assert install_log_format({**ENV, "GANGFLOW_LOG_FORMAT": "json"}) == "json"
    print("hello")
    assert json.loads(out.getvalue())["message"] == "hello"


def test_the_trainer_refuses_a_bad_log_format_with_exit_2(tmp_path):
    env = {"GANGFLOW_LOG_FORMAT": "yaml", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "trainer", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]))
    assert done.returncode == 2, done.stderr
    assert "GANGFLOW_LOG_FORMAT='yaml': accepted values are text, json" in done.stderr


def test_code_that_writes_bytes_or_reconfigures_stdout_keeps_working():
    """`sys.stdout.buffer.write(...)` and `sys.stdout.reconfigure(line_buffering=True)`, common in
    training scripts, raised AttributeError under GANGFLOW_LOG_FORMAT=json."""
    sink = io.StringIO()
    stream = JsonLines(sink, name="stdout", fields=log_fields(ENV))
    stream.reconfigure(line_buffering=True)
    stream.buffer.write(b"epoch 1 \xff done\n")
    stream.buffer.flush()
    assert [json.loads(line)["message"] for line in sink.getvalue().splitlines()] == ["epoch 1 \ufffd done"]
