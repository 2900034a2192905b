"""`checkpoint.every_steps: auto` through the real DAG (issue 25.5): the first run probes and takes
the prior, the next one takes the save cost from the first one's MLflow history; the summary shows
the interval and its inputs."""

from __future__ import annotations

import pytest
import yaml

from pipeline_runs import PROJECT_ROOT, run_pipeline

CONF = {"max_steps": 60, "world_size": 2, "promotion_floor": 0.8}  # checkpoint_every_steps: the pipeline's auto


@pytest.mark.slow
def test_an_auto_pipeline_chooses_its_interval_and_learns_the_save_cost(pipeline_home, tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    trainer = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    trainer.pop("prepare", None)
    trainer["checkpoint"] |= {"every_steps": "auto", "auto_max_steps": 25}  # 24 h of prior: bounded to 25 steps
    (folder / "trainer.yaml").write_text(yaml.safe_dump(trainer))
    digits = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())
    # a registry of its own: its versions must not become the champion other tests on this state dir gate against
    (folder / "digits.yaml").write_text(yaml.safe_dump(digits | {"trainer_config": str(folder / "trainer.yaml"),
                                                                 "model_name": "gangflow-digits-auto"}))

    firsts = []
    for i in range(2):
        summary, output, code = run_pipeline(pipeline_home, CONF, tmp_path / f"run{i}.log", GANGFLOW_PIPELINES=str(folder))
        assert code == 0 and summary["state"] == "success", output[-6000:]
        inputs = summary["checkpoint_interval_inputs"]
        assert summary["checkpoint_every_steps"] == 25 and inputs["bound"] == "checkpoint.auto_max_steps", summary
        assert inputs["mtbf_source"].startswith("prior") and inputs["mtbf_s"] == 86400.0, inputs
        assert inputs["step_s"] > 0 and inputs["cost_s"] > 0
        assert "gangflow: checkpoint interval: auto = 25 steps" in output
        firsts.append(inputs["cost_source"])
    # the second run's save cost is the first one's saves, from MLflow (the session's earlier runs may count too)
    assert firsts[1].startswith("mlflow: median checkpoint_blocked_s"), firsts
