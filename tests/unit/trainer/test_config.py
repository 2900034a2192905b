"""Config validation: defaults, YAML + --set overrides, clear errors naming field, value and rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer import EXIT_CONFIG_ERROR, EXIT_PREEMPTED, EXIT_USER_ERROR
from trainer.cli import build_parser
from trainer.config import Config, ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parents[3]
PARAMS = ROOT / "params.yaml"


def test_exit_codes_are_the_documented_ones():
    assert (EXIT_USER_ERROR, EXIT_CONFIG_ERROR, EXIT_PREEMPTED) == (1, 2, 75)


def test_params_yaml_loads_and_matches_built_in_defaults():
    cfg = load_config(PARAMS)
    raw = yaml.safe_load(PARAMS.read_text())
    for section in ("data", "model", "train", "checkpoint", "tracking"):
        for key, value in raw[section].items():
            assert cfg.to_dict()[section][key] == value, f"{section}.{key}"
    # With no params file: the built-in defaults (the same values as the shipped params.yaml).
    assert Config().to_dict() == load_config(None).to_dict()


def test_overrides_are_yaml_typed():
    cfg = load_config(PARAMS, ["train.max_steps=7", "train.lr=1e-3", "checkpoint.async_save=false",
                               "data.train_md5=", "model.hidden=32", "tracking.experiment=exp one"])
    assert cfg.train.max_steps == 7 and cfg.train.lr == 0.001
    assert cfg.checkpoint.async_save is False
    assert cfg.data.train_md5 == ""
    assert cfg.model.kwargs["hidden"] == 32
    assert cfg.tracking.experiment == "exp one"
    assert parse_override("train.lr=0.5") == ("train", "lr", 0.5)


def test_other_stages_sections_are_ignored(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("prepare: {seed: 1}\nevaluate: {threshold: 0.9}\ntrain: {max_steps: 5}\n")
    assert load_config(path).train.max_steps == 5


@pytest.mark.parametrize(("section", "meant"), [("chekpoint", "checkpoint"), ("trian", "train"), ("modle", "model"),
                                                ("Data", "data")])
def test_a_misspelt_section_is_refused_not_ignored_as_another_stages(tmp_path, section, meant):
    """`chekpoint: {every_steps: 10}` used to leave every_steps at its default: ten times the work lost to a retry."""
    path = tmp_path / "p.yaml"
    path.write_text(f"{section}: {{}}\nprepare: {{seed: 1}}\ntraining: {{epochs: 3}}\n")
    with pytest.raises(ConfigError, match=f"section {section!r} is not the trainer's; did you mean {meant!r}"):
        load_config(path)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=0.1", "unknown key train.lrr; accepted keys of train: max_steps"),
        ("train.lr=-0.1", "train.lr=-0.1 is invalid: must be a number > 0"),
        ("train.lr=fast", "train.lr='fast' is invalid: must be a number"),
        ("train.max_steps=abc", "train.max_steps='abc' is invalid: must be an integer"),
        ("train.batch_size=1.5", "train.batch_size=1.5 is invalid: must be an integer"),
        ("train.max_steps=0", "train.max_steps=0 is invalid: must be an integer >= 1"),
        ("train.momentum=1", "train.momentum=1.0 is invalid: must be a number in [0, 1)"),
        ("train.optimizer=lbfgs", "train.optimizer='lbfgs' is invalid: must be one of: sgd, adamw"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last=0 is invalid"),
        ("checkpoint.async_save=maybe", "checkpoint.async_save='maybe' is invalid: must be true or false"),
        ("data.train_md5=abc", "data.train_md5='abc' is invalid"),
        ("data.factory=not a factory", "data.factory='not a factory' is invalid: must be 'module:function'"),
        ("model.factory=nope", "model.factory='nope' is invalid: must be 'module:function'"),
        ("trian.lr=0.1", "unknown section 'trian'"),
        ("train.lr", "expected section.key=value"),
        ("train.lr=[1", "not a YAML scalar"),
    ],
)
def test_bad_values_are_rejected_with_field_value_and_rule(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(PARAMS, [override])
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.factory=no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        ("model.factory=trainer.models:nothing", "module 'trainer.models' has no callable 'nothing'"),
        ("model.hiddn=3", "model.hiddn=3 is invalid: trainer.models:mlp takes no argument 'hiddn'"),
        ("data.factory=trainer.data:nothing", "data.factory='trainer.data:nothing' is invalid"),
    ],
)
def test_factories_are_checked_before_training(override, expected):
    cfg = load_config(PARAMS, [override])
    with pytest.raises(ConfigError) as info:
        cfg.check_factories()
    assert expected in str(info.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "sec.yaml").write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train=3 is invalid"):
        load_config(tmp_path / "sec.yaml")


def test_help_documents_every_option():
    text = build_parser().format_help()
    for option in ("--run-dir", "--config", "--set", "--print-config"):
        assert option in text
    for key in Config().to_dict()["train"] | {"every_steps": 0, "keep_last": 0, "mlflow_uri": 0, "train_md5": 0}:
        assert key in text
    for code in ("75", "GANGFLOW_FAULT", "MLFLOW_RUN_ID", "OMPI_COMM_WORLD_RANK"):
        assert code in text


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_help_and_print_config():
    out = _cli("--help")
    assert out.returncode == 0 and "--run-dir" in out.stdout
    out = _cli("--run-dir", "/tmp/unused", "--print-config", "--set", "train.lr=0.2")
    assert out.returncode == 0, out.stderr
    assert '"lr": 0.2' in out.stdout


def test_cli_rejects_bad_config_with_exit_2_and_a_record(tmp_path):
    import os

    env = {**os.environ, "GANGFLOW_TERMINATION_LOG": str(tmp_path / "termination-log")}
    env.pop("GANGFLOW_FAULT", None)
    out = _cli("--run-dir", str(tmp_path / "run"), "--set", "train.lr=-1", env=env)
    assert out.returncode == EXIT_CONFIG_ERROR
    assert "gangflow: config error: train.lr=-1.0 is invalid: must be a number > 0" in out.stderr
    record = __import__("json").loads((tmp_path / "run" / "errors" / "rank-0.json").read_text())
    assert record["source"] == "config" and record["exc_type"] == "ConfigError"
    assert "train.lr" in (tmp_path / "termination-log").read_text()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cli_rejects_bad_fault_spec(tmp_path):
    import os

    env = {**os.environ, "GANGFLOW_FAULT": "explode@step=3", "GANGFLOW_ALLOW_FAULTS": "1"}
    out = _cli("--run-dir", str(tmp_path / "run"), env=env)
    assert out.returncode == EXIT_CONFIG_ERROR
    assert "GANGFLOW_FAULT='explode@step=3' is invalid" in out.stderr


@pytest.mark.parametrize("value", [
    "/data/run #3/train.parquet",  # YAML would cut it at " #"
    "0123",  # YAML would make it a number
    "  spaced ",
    "yes",  # YAML 1.1 would make it a bool
    "a: b",  # YAML would make it a mapping
])
def test_set_keeps_string_values_exactly(value):
    cfg = load_config(None, [f"data.train_path={value}", f"tracking.experiment={value}"])
    assert cfg.data.train_path == value and cfg.tracking.experiment == value


def test_set_keeps_typed_values_and_untyped_model_strings():
    cfg = load_config(None, ["train.max_steps=12", "checkpoint.async_save=false", "train.lr=1e-3",
                             "model.hidden=32", "model.note=run #2 of 3"])
    assert cfg.train.max_steps == 12 and cfg.checkpoint.async_save is False and cfg.train.lr == 0.001
    assert cfg.model.kwargs["hidden"] == 32 and cfg.model.kwargs["note"] == "run #2 of 3"


def test_data_version_needs_a_remote_and_an_md5():
    cfg = load_config(None, ["data.version=" + "ab" * 16, "data.remote=s3://bucket/dvc"])
    assert cfg.data.version == "ab" * 16 and cfg.data.remote == "s3://bucket/dvc"
    with pytest.raises(ConfigError, match=r"data.version='v1' is invalid: must be .* 32 lowercase hex digits"):
        load_config(None, ["data.version=v1", "data.remote=/r"])
    with pytest.raises(ConfigError, match="data.remote='' is invalid: must be the DVC remote's URL"):
        load_config(None, ["data.version=" + "ab" * 16])


def test_fault_without_allow_is_ignored_with_a_warning(tmp_path):
    """12.5: a stray GANGFLOW_FAULT does not fire unless GANGFLOW_ALLOW_FAULTS=1."""
    from trainer.faults import fault_from_env

    env = {"GANGFLOW_FAULT": "raise@step=1"}
    assert fault_from_env(env) is None
    assert fault_from_env({**env, "GANGFLOW_ALLOW_FAULTS": "0"}) is None
    assert fault_from_env({**env, "GANGFLOW_ALLOW_FAULTS": "1"}).spec == "raise@step=1"


def test_cli_warns_and_trains_without_the_fault_unless_allowed(h, tmp_path):
    sets = ("train.max_steps=3", "checkpoint.every_steps=100", "train.log_every_steps=1")
    proc = h.run(tmp_path / "run", sets=sets, nproc=None, GANGFLOW_FAULT="raise@step=1", GANGFLOW_ALLOW_FAULTS="")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "GANGFLOW_FAULT='raise@step=1' is ignored on rank 0: fault injection needs GANGFLOW_ALLOW_FAULTS=1" in proc.stdout
    proc = h.run(tmp_path / "armed", sets=sets, nproc=None, GANGFLOW_FAULT="raise@step=1")
    assert proc.returncode == 1
    assert "fault injection ARMED on rank 0: GANGFLOW_FAULT='raise@step=1'" in proc.stdout


# --- issue 28.4: no credential in a URL setting ------------------------------------------------------


@pytest.mark.parametrize("override, field", [
    ("data.remote=s3://AKIAEXAMPLE:wJalr-secret@bucket/dvc", "data.remote"),
    ("tracking.mlflow_uri=https://bob:wJalr-secret@mlflow.example.com", "tracking.mlflow_uri"),
])
def test_a_url_setting_with_credentials_is_refused_naming_the_field_without_the_secret(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert message.startswith(f"{field}=") and "must not carry credentials" in message
    assert "wJalr-secret" not in message and ":***@" in message


def test_a_run_dir_url_with_credentials_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer", "--run-dir", "s3://AKIAEXAMPLE:wJalr-secret@bucket/runs/r1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr
    assert "--run-dir" in proc.stderr and "must not carry credentials" in proc.stderr
    assert "wJalr-secret" not in proc.stdout + proc.stderr


def test_a_chained_remote_with_credentials_is_refused():
    """`simplecache::s3://key:secret@...` passed the check (its scheme is not at the start) into argv."""
    from trainer.config import load_config
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.remote=.*AKIAEXAMPLE:\*\*\*@.*must not carry credentials"):
        load_config(None, ["data.remote=simplecache::s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/dvc"])
