"""The digits-cnn pipeline (issue 22 items 1, 4, 6): a plain torchrun script of its own through the
real DAG (validate -> gang -> evaluate -> promote). A rank killed mid-loop (as it hands its second
checkpoint over) is infrastructure: the retry resumes from a committed checkpoint; an exception in
the script is the user's: one attempt."""

from __future__ import annotations

import json

from pipeline_runs import KILL_AT_SECOND_SAVE as KILL
from pipeline_runs import failure_record, last_line_of_python, run_pipeline

PIPELINE = "digits-cnn"
# Small, with 8 checkpoints.
DRILL = {"max_steps": 400, "checkpoint_every_steps": 50, "world_size": 2, "promotion_floor": 0.8}


def test_a_killed_rank_is_retried_and_resumes_from_a_committed_checkpoint(pipeline_home, tmp_path):
    summary, output, code = run_pipeline(pipeline_home, DRILL, tmp_path / "kill.log", pipeline=PIPELINE,
                                         GANGFLOW_FAULT=KILL)
    assert code == 0 and summary["state"] == "success", output[-6000:]
    assert summary["pipeline"] == PIPELINE and summary["train_attempts"] == 2
    assert summary["resumed_from_step"] and summary["resumed_from_step"] > 0, summary
    assert summary["metric"]["name"] == "accuracy" and summary["metric"]["value"] >= 0.8
    assert f"fault injection: {KILL} fires on rank 1" in output
    assert "gangflow: infra failure" in output
    assert f"gangflow: resuming from checkpoint step-{summary['resumed_from_step']}" in output
    # The registered version loads in a fresh process, the user's package travelling with it.
    code = (
        "import sys; import pandas as pd; from operators.registry.served_model import load_model; "
        f"m = load_model('models:/{summary['model_name']}/{summary['model_version']}'); "
        "out = m.predict(pd.DataFrame([[0.0] * 64], columns=[f'pixel_{i:02d}' for i in range(64)], dtype='float32')); "
        "print(len(out), sys.modules['digits_cnn'].__file__)"
    )
    # no GANGFLOW_ALLOWED_MODELS: the signed version names the factory the pipeline allowed
    line = last_line_of_python(code, pipeline_home)
    assert line.startswith("1 ") and "/code/digits_cnn/" in line, line


def test_an_exception_in_the_script_fails_once_as_the_users(pipeline_home, tmp_path):
    summary, output, code = run_pipeline(pipeline_home, DRILL | {"max_steps": 60}, tmp_path / "raise.log",
                                         pipeline=PIPELINE, GANGFLOW_FAULT="raise@step=5")
    assert code != 0 and summary["state"] == "failed", output[-6000:]
    assert summary["train_attempts"] == 1 and summary["failure"]["kind"] == "user", summary
    assert "injected fault" in summary["failure"]["reason"] or "ValueError" in summary["failure"]["reason"], summary
    record = failure_record(pipeline_home, summary)
    assert "Traceback" in json.dumps(record["evidence"]) and "digits_cnn/train.py" in json.dumps(record["evidence"])
