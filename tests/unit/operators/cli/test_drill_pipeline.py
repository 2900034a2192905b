"""`make cluster-drill PIPELINE=<name>` (fast: nothing is started): the drill runs a pipeline's
own training DAG and dataset, and refuses an unknown pipeline naming the known ones. The diabetes
drill itself is a slow run (`make cluster-drill PIPELINE=diabetes`, docs/kubernetes.md)."""

from __future__ import annotations

import subprocess
import sys

from pipeline_runs import PROJECT_ROOT, pipeline_env


def test_an_unknown_pipeline_is_refused_naming_the_known_ones(tmp_path):
    done = subprocess.run([sys.executable, "-m", "operators.cli.drill", "--pipeline", "wine"], cwd=PROJECT_ROOT,
                          env=pipeline_env(tmp_path / "home"), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--pipeline: pipeline='wine'" in done.stderr and "known pipelines: " in done.stderr
    assert "diabetes" in done.stderr.rsplit("known pipelines: ", 1)[1]


def test_the_drill_takes_the_pipelines_dag_dataset_and_gate(tmp_path, monkeypatch):
    from operators.cli.drill import run

    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    diabetes = run.Drill(keep=tmp_path / "d", pipeline="diabetes", conf={"max_steps": 60})
    digits = run.Drill(keep=tmp_path / "g")
    assert (diabetes.pipeline.dag_id, diabetes.pipeline.dataset_out) == ("train_diabetes", "data/diabetes")
    assert "promotion_floor" not in diabetes.conf and diabetes.conf["max_steps"] == 60  # its own ceiling (RMSE)
    assert (digits.pipeline.dag_id, digits.conf["promotion_floor"]) == ("train_pipeline", 0.8)
    assert "--pipeline $(PIPELINE)" in (PROJECT_ROOT / "Makefile").read_text().split("cluster-drill: setup", 1)[1].split("\n\n")[0]
