"""Logs by job and rank (issue 26 item 2) through a real 2-rank gang of the local backend (what the
training task runs; its `log` is the task log): with GANGFLOW_LOG_FORMAT=json every line of every rank,
a user error's traceback included, is one JSON object carrying rank, gang, dag_run_id and
mlflow_run_id, in the task log and in the per-rank files the task log points to."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest


@pytest.mark.slow
def test_every_rank_line_is_json_with_job_and_rank(h, digits, tmp_path, monkeypatch):
    from operators.backends import GangSpec
    from operators.backends.local import LocalBackend

    monkeypatch.setenv("GANGFLOW_ALLOW_FAULTS", "1")
    sets = [f"data.train_path={digits / 'train.parquet'}", f"data.test_path={digits / 'test.parquet'}",
            "train.max_steps=8", "checkpoint.every_steps=4", "train.log_every_steps=2"]
    env = {"GANGFLOW_LOG_FORMAT": "json", "GANGFLOW_GANG": "logs-test", "GANGFLOW_DAG_RUN_ID": "manual__logs",
           "GANGFLOW_DAG_ID": "train_pipeline", "GANGFLOW_MLFLOW_RUN_ID": "run-logs", "GANGFLOW_FAULT": "raise@step=6,rank=1"}
    spec = GangSpec(name="logs-test", run_dir=str(tmp_path / "run"), world_size=2, config_path=str(h.ROOT / "params.yaml"),
                    overrides=sets, env=env)
    log: list[str] = []
    old = os.getcwd()
    os.chdir(h.ROOT)
    try:
        result = LocalBackend(nproc_limit=2).run(spec, log.append)
    finally:
        os.chdir(old)
    assert not result.succeeded  # rank 1 raised: a user error with a traceback
    [where] = [line for line in log if line.startswith("rank logs: ")]
    rank_lines = [(int(m.group(1)), m.group(2)) for line in log if (m := re.match(r"^\[rank (\d+)\] (.*)$", line))]
    assert rank_lines
    records = []
    for rank, text in rank_lines:
        record = json.loads(text)  # every line of every rank
        assert record["rank"] == rank
        assert (record["gang"], record["dag_run_id"], record["mlflow_run_id"]) == ("logs-test", "manual__logs", "run-logs")
        records.append(record)
    assert {r["rank"] for r in records} == {0, 1}
    assert any(r["rank"] == 1 and r["stream"] == "stderr" and "Traceback" in r["message"] for r in records)
    assert any(r["rank"] == 1 and "ValueError" in r["message"] for r in records)
    # the files the task log names hold the same JSON lines, one folder per rank
    folder = Path(where.removeprefix("rank logs: ").split("/<torchrun run id>")[0])
    files = sorted(folder.glob("*/attempt_0/*/stderr.log"))
    assert [f.parent.name for f in files] == ["0", "1"]
    for f in files:
        assert all(json.loads(line)["rank"] == int(f.parent.name) for line in f.read_text().splitlines() if line)
