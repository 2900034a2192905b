"""The framework pipelines (issue 22 items 3, 4, 6) through the real DAG (validate -> gang ->
evaluate -> promote): charlm (Hugging Face's Trainer) and digits-lightning (Lightning's Trainer,
DDP). A rank killed mid-loop (as it hands its second checkpoint over) is infrastructure: the retry
resumes the framework from gangflow's last committed checkpoint and ends with the uninterrupted
run's metric, bit for bit (both frameworks replay the same batches: no dropout, samplers seeded by
epoch; gloo's sums on 2 CPU ranks are ordered); an exception in the code (Lightning), or a bad
framework setting (Hugging Face), is the user's: one attempt.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from pipeline_runs import KILL_AT_SECOND_SAVE as KILL
from pipeline_runs import PROJECT_ROOT, failure_record, run_pipeline

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (extra `frameworks`): not installed")

# Small drills with at least two checkpoints (the kill strikes at the second).
DRILLS = {
    "charlm": {"max_steps": 120, "checkpoint_every_steps": 10, "world_size": 2},
    "digits-lightning": {"max_steps": 400, "world_size": 2},  # a checkpoint at every epoch end (43 steps)
}
METRIC = {"charlm": ("perplexity", "lower"), "digits-lightning": ("macro_f1", "higher")}
CODE = {"charlm": "charlm/train.py", "digits-lightning": "digits_lightning/train.py"}


@pytest.fixture(scope="module", params=sorted(DRILLS))
def uninterrupted(request, pipeline_home, tmp_path_factory) -> dict:
    """The pipeline's first run at the drill's size: promoted, the metric the kill drill must match."""
    pipeline = request.param
    summary, output, code = run_pipeline(pipeline_home, DRILLS[pipeline], tmp_path_factory.mktemp("logs") / f"{pipeline}.log",
                                         pipeline=pipeline)
    assert code == 0 and summary["state"] == "success", output[-6000:]
    assert summary["promoted"] is True and summary["train_attempts"] == 1, summary
    name, direction = METRIC[pipeline]
    assert summary["metric"]["name"] == name and summary["metric"]["direction"] == direction
    return {"pipeline": pipeline, "summary": summary}


def test_a_killed_rank_resumes_the_framework_from_gangflows_checkpoint_with_the_same_metric(uninterrupted, pipeline_home,
                                                                                          tmp_path):
    pipeline, first = uninterrupted["pipeline"], uninterrupted["summary"]
    summary, output, code = run_pipeline(pipeline_home, DRILLS[pipeline], tmp_path / "kill.log", pipeline=pipeline,
                                         GANGFLOW_FAULT=KILL)
    assert code == 0 and summary["state"] == "success", output[-6000:]
    assert summary["train_attempts"] == 2, summary
    assert summary["resumed_from_step"] and summary["resumed_from_step"] > 0, summary
    assert f"fault injection: {KILL} fires on rank 1" in output
    assert "gangflow: infra failure" in output
    assert f"gangflow: resuming from checkpoint step-{summary['resumed_from_step']}" in output
    assert summary["metric"]["value"] == first["metric"]["value"]  # bitwise: the same model
    assert summary["promoted"] is False  # the second run with the same metric does not beat the champion


# charlm's user failure is the bad TrainingArguments value below (one DAG run fewer, CI time)
@pytest.mark.parametrize("pipeline", ["digits-lightning"])
def test_an_exception_in_the_code_fails_once_as_the_users(pipeline, pipeline_home, tmp_path):
    summary, output, code = run_pipeline(pipeline_home, DRILLS[pipeline], tmp_path / "raise.log", pipeline=pipeline,
                                         GANGFLOW_FAULT="raise@step=5")
    assert code != 0 and summary["state"] == "failed", output[-6000:]
    assert summary["train_attempts"] == 1 and summary["failure"]["kind"] == "user", summary
    assert "injected fault" in summary["failure"]["reason"] or "ValueError" in summary["failure"]["reason"], summary
    record = failure_record(pipeline_home, summary)
    assert "Traceback" in json.dumps(record["evidence"]) and CODE[pipeline] in json.dumps(record["evidence"])


def test_a_bad_training_arguments_value_is_the_users_with_transformers_message(pipeline_home, tmp_path):
    # The pipeline as a user would mistype it: a scheduler name TrainingArguments does not know.
    folder = tmp_path / "pipelines"
    folder.mkdir()
    raw = yaml.safe_load((PROJECT_ROOT / "pipelines" / "charlm.yaml").read_text())
    raw["training"]["kwargs"]["lr_scheduler"] = "cosine_with_bogus"
    (folder / "charlm.yaml").write_text(yaml.safe_dump(raw))
    summary, output, code = run_pipeline(pipeline_home, DRILLS["charlm"], tmp_path / "bad-args.log", pipeline="charlm",
                                         GANGFLOW_PIPELINES=str(folder))
    assert code != 0 and summary["state"] == "failed", output[-6000:]
    assert summary["train_attempts"] == 1 and summary["failure"]["kind"] == "user", summary
    assert "cosine_with_bogus is not a valid SchedulerType" in summary["failure"]["reason"], summary
    evidence = json.dumps(failure_record(pipeline_home, summary)["evidence"])  # the user's traceback, through their code
    assert "Traceback" in evidence and CODE["charlm"] in evidence, evidence[-3000:]
    shutil.rmtree(folder)
