"""Both example pipelines end to end with the real components (slow): the diabetes pipeline
(regression, RMSE, lower is better) promotes on its first run and not on the second, saying
why; on every pipeline the trainer's own test score equals the evaluate task's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_runs import PROJECT_ROOT, pipeline_env

CARD = """
import json, sys
import mlflow
from operators.config import embedded
embedded.apply()
client = mlflow.MlflowClient()
v = client.get_model_version(sys.argv[1], sys.argv[2])
path = mlflow.artifacts.download_artifacts(f"{client.get_model_version_download_uri(v.name, v.version)}/data/final/model_card.json")
print(json.dumps(json.load(open(path))["metrics"]))
"""


def _demo(home: Path, pipeline: str, conf: dict, log: Path) -> tuple[dict, int]:
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "operators.cli.demo", "--pipeline", pipeline, "--conf", json.dumps(conf)],
                              cwd=PROJECT_ROOT, env=pipeline_env(home), stdout=out, stderr=subprocess.STDOUT,
                              timeout=1200).returncode  # fmt: skip
    return json.loads(log.read_text().strip().splitlines()[-1]), code


def _card_metrics(home: Path, model_name: str, version: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CARD, model_name, version], cwd=PROJECT_ROOT, env=pipeline_env(home),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_diabetes_promotes_once_then_says_why_not_and_scores_agree(pipeline_home, tmp_path):
    first, code = _demo(pipeline_home, "diabetes", {"world_size": 2}, tmp_path / "first.log")
    assert code == 0 and first["state"] == "success", (tmp_path / "first.log").read_text()[-6000:]
    assert first["pipeline"] == "diabetes" and first["model_name"] == "gangflow-diabetes"
    metric = first["metric"]
    assert (metric["name"], metric["direction"]) == ("rmse", "lower") and 40 < metric["value"] < 65, first
    assert first["promoted"] is True and "no champion yet" in first["promotion_reason"]
    card = _card_metrics(pipeline_home, "gangflow-diabetes", first["model_version"])
    assert card["test_rmse"] == pytest.approx(metric["value"], rel=1e-6)  # the trainer's score == evaluate's

    second, code = _demo(pipeline_home, "diabetes", {"world_size": 2}, tmp_path / "second.log")
    assert code == 0 and second["state"] == "success", (tmp_path / "second.log").read_text()[-6000:]
    assert second["metric"]["value"] == pytest.approx(metric["value"], rel=1e-9)  # same data, same seed
    assert second["promoted"] is False and second["model_version"] != first["model_version"]
    reason = second["promotion_reason"]
    assert f"does not beat champion v{first['model_version']}" in reason and "lower is better" in reason, reason


@pytest.mark.slow
def test_digits_summary_names_its_pipeline_and_metric_and_scores_agree(baseline, pipeline_home):
    s = baseline["summary"]
    assert s["pipeline"] == "digits" and s["metric"]["name"] == "accuracy" and s["metric"]["direction"] == "higher"
    assert s["metric"]["value"] == s["accuracy"]
    card = _card_metrics(pipeline_home, s["model_name"], s["model_version"])
    assert card["test_accuracy"] == pytest.approx(s["accuracy"], rel=1e-9)
