"""A pipeline whose trainer config says `checkpoint.every_steps: auto` (issue 25.5): the trigger form
offers `auto` or an integer, and training code of one's own refuses it when the file is read."""

from __future__ import annotations

import re

import pytest
import yaml

from operators.config.pipelines import PipelineConfigError, check_params, parse_pipeline

from pipeline_runs import PROJECT_ROOT

DIGITS = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())
CNN = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits-cnn.yaml").read_text())


def _auto_trainer(tmp_path):
    path = tmp_path / "auto.yaml"
    path.write_text("checkpoint: {every_steps: auto}\n")
    return str(path)


def test_an_auto_pipeline_offers_auto_or_an_integer_in_the_form(tmp_path, dag_module):
    config = parse_pipeline(DIGITS | {"trainer_config": _auto_trainer(tmp_path)}, source="pipelines/x.yaml")
    assert config.checkpoint_every_steps == "auto"
    param = dag_module.build_params(config)["checkpoint_every_steps"]
    assert param.value == "auto" and param.schema["type"] == "string"
    pattern = re.compile(param.schema["pattern"])
    assert [v for v in ("auto", "1", "250", "0", "-3", "2.5", "often", "") if pattern.fullmatch(v)] == ["auto", "1", "250"]
    # an integer pipeline keeps its integer field
    fixed = dag_module.build_params(parse_pipeline(DIGITS, source="pipelines/x.yaml"))["checkpoint_every_steps"]
    assert fixed.schema["type"] == "integer"


def test_training_code_of_ones_own_refuses_auto_when_the_pipeline_is_read(tmp_path):
    roots = [str(PROJECT_ROOT / "examples")]
    with pytest.raises(PipelineConfigError) as caught:
        parse_pipeline(CNN | {"trainer_config": _auto_trainer(tmp_path), "package_roots": roots}, source="pipelines/x.yaml")
    message = str(caught.value)
    assert "checkpoint.every_steps='auto'" in message and "pipelines/x.yaml" in message and "training code of one's own" in message


@pytest.mark.parametrize("value", ["auto\n", "200\n"])
def test_admission_refuses_what_the_forms_pattern_lets_through_before_a_final_newline(tmp_path, dag_module, value):
    """JSON Schema's `pattern` is searched (Python's `$` matches before a final newline): admission
    matches the whole value, so the ranks never get a value the trainer refuses."""
    from operators.exceptions import InvalidParams

    params = dag_module.build_params(parse_pipeline(DIGITS | {"trainer_config": _auto_trainer(tmp_path)}, source="x.yaml"))
    schemas = {name: param.schema for name, param in params.items()}
    values = {name: param.value for name, param in params.items()}
    check_params(values | {"checkpoint_every_steps": "200"}, schemas)
    with pytest.raises(InvalidParams) as caught:
        check_params(values | {"checkpoint_every_steps": value}, schemas)
    assert f"checkpoint_every_steps={value!r}" in str(caught.value) and "auto" in str(caught.value)
