"""`checkpoint.every_steps: auto` (issue 25.5): the Young/Daly arithmetic, its bounds, the config's
accepted values and where each input came from; then one real single-rank run choosing it."""

from __future__ import annotations

import json
import math

import pytest

from trainer.checkpoint_interval import HISTORY_ENV, PROBE_STEPS, IntervalInputs, choose_interval, young_daly_s
from trainer.config import CheckpointConfig, load_config
from trainer.errors import ConfigError

AUTO = CheckpointConfig(every_steps="auto")


def test_young_daly_is_the_square_root_of_twice_the_cost_times_the_mtbf():
    assert young_daly_s(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly_s(0.5, 86400.0) == pytest.approx(math.sqrt(86400.0))
    for cost, mtbf in ((0.0, 10.0), (1.0, 0.0), (-1.0, 10.0), (float("nan"), 10.0), (1.0, float("inf"))):
        with pytest.raises(ValueError):
            young_daly_s(cost, mtbf)


def test_the_interval_in_seconds_becomes_steps_at_the_measured_step_time():
    history = IntervalInputs(cost_s=2.0, cost_source="mlflow: 12 saves", mtbf_s=3600.0, mtbf_source="mlflow: 3 failures")
    chosen = choose_interval(AUTO, step_s=0.5, history=history)
    assert chosen.seconds == pytest.approx(120.0)
    assert chosen.every_steps == 240 and chosen.bound is None
    assert (chosen.cost_s, chosen.mtbf_s, chosen.step_s) == (2.0, 3600.0, 0.5)


def test_the_interval_is_bounded_by_the_configured_min_and_max_steps():
    cfg = CheckpointConfig(every_steps="auto", auto_min_steps=50, auto_max_steps=400)
    cheap = IntervalInputs(cost_s=0.001, cost_source="h", mtbf_s=100.0, mtbf_source="h")  # 0.45 s: 4 steps
    low = choose_interval(cfg, step_s=0.1, history=cheap)
    assert low.every_steps == 50 and low.bound == "checkpoint.auto_min_steps"
    dear = IntervalInputs(cost_s=100.0, cost_source="h", mtbf_s=1e7, mtbf_source="h")  # 44721 s: 447214 steps
    high = choose_interval(cfg, step_s=0.1, history=dear)
    assert high.every_steps == 400 and high.bound == "checkpoint.auto_max_steps"
    assert high.seconds == pytest.approx(math.sqrt(2 * 100.0 * 1e7))  # the unbounded figure is kept


def test_the_defaults_bound_it_too():
    assert (AUTO.auto_min_steps, AUTO.auto_max_steps, AUTO.mtbf_prior_s) == (10, 10000, 86400.0)
    tiny = choose_interval(AUTO, step_s=10.0, history=IntervalInputs(cost_s=0.01, cost_source="h", mtbf_s=60.0, mtbf_source="h"))
    assert tiny.every_steps == 10 and tiny.bound == "checkpoint.auto_min_steps"


def test_each_input_says_where_it_came_from_history_probe_or_prior():
    # nothing from history: the cost is the probe save's, the MTBF the configured prior
    chosen = choose_interval(AUTO, step_s=0.01, history=IntervalInputs(), probe_cost_s=0.25, probe_step=20)
    assert chosen.cost_s == 0.25 and chosen.cost_source.startswith("probe") and "step 20" in chosen.cost_source
    assert chosen.mtbf_s == 86400.0 and chosen.mtbf_source.startswith("prior") and "checkpoint.mtbf_prior_s" in chosen.mtbf_source
    # history wins over the probe, and each source is passed through as the history said it
    history = IntervalInputs(cost_s=0.5, cost_source="mlflow: median of 9 saves", mtbf_s=7200.0, mtbf_source="airflow: 2 failures")
    chosen = choose_interval(AUTO, step_s=0.01, history=history, probe_cost_s=0.25, probe_step=20)
    assert (chosen.cost_s, chosen.cost_source) == (0.5, "mlflow: median of 9 saves")
    assert (chosen.mtbf_s, chosen.mtbf_source) == (7200.0, "airflow: 2 failures")
    # a configured prior is used as configured
    mine = CheckpointConfig(every_steps="auto", mtbf_prior_s=3600.0)
    assert choose_interval(mine, step_s=0.01, history=IntervalInputs(), probe_cost_s=0.25, probe_step=20).mtbf_s == 3600.0
    with pytest.raises(ValueError, match="cost"):  # neither history nor probe: nothing to choose from
        choose_interval(AUTO, step_s=0.01, history=IntervalInputs())
    with pytest.raises(ValueError, match="step"):
        choose_interval(AUTO, step_s=0.0, history=history)


def test_the_choice_is_recorded_with_all_its_inputs():
    chosen = choose_interval(AUTO, step_s=0.02, history=IntervalInputs(), probe_cost_s=0.1, probe_step=20)
    record = chosen.as_dict()
    assert set(record) == {"every_steps", "seconds", "cost_s", "cost_source", "mtbf_s", "mtbf_source", "step_s", "bound"}
    assert record["every_steps"] == chosen.every_steps and json.loads(json.dumps(record)) == record


def test_history_reaches_the_ranks_as_one_json_environment_value():
    assert IntervalInputs.from_env({}) == IntervalInputs()
    given = {"cost_s": 0.3, "cost_source": "mlflow: x", "mtbf_s": 5000.0, "mtbf_source": "airflow: y"}
    assert IntervalInputs.from_env({HISTORY_ENV: json.dumps(given)}) == IntervalInputs(**given)
    assert IntervalInputs.from_env({HISTORY_ENV: json.dumps({"cost_s": 0.3, "cost_source": "m"})}).mtbf_s is None
    assert json.loads(IntervalInputs(**given).to_env()) == given
    for bad, field in (("{not json", HISTORY_ENV), ('{"cost_s": -1, "cost_source": "m"}', "cost_s"),
                       ('{"mtbf_s": "often", "mtbf_source": "m"}', "mtbf_s"), ('{"cost_s": 1}', "cost_source"),
                       ("[1]", HISTORY_ENV), ('{"rate": 1}', "rate")):
        with pytest.raises(ConfigError, match=field):
            IntervalInputs.from_env({HISTORY_ENV: bad})


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "often", "AUTO", None, "10"])
def test_every_steps_is_an_integer_or_auto_and_nothing_else(value):
    with pytest.raises(ConfigError) as caught:
        CheckpointConfig(every_steps=value)
    assert "checkpoint.every_steps" in str(caught.value) and "'auto'" in str(caught.value) and ">= 1" in str(caught.value)


def test_every_steps_accepts_integers_and_auto_from_files_and_overrides(tmp_path):
    assert CheckpointConfig(every_steps=7).every_steps == 7 and AUTO.every_steps == "auto"
    assert load_config(None, ["checkpoint.every_steps=auto"]).checkpoint.every_steps == "auto"
    assert load_config(None, ["checkpoint.every_steps=50"]).checkpoint.every_steps == 50
    (tmp_path / "p.yaml").write_text("checkpoint: {every_steps: auto, mtbf_prior_s: 3600, auto_max_steps: 500}\n")
    cfg = load_config(tmp_path / "p.yaml").checkpoint
    assert (cfg.every_steps, cfg.mtbf_prior_s, cfg.auto_max_steps) == ("auto", 3600.0, 500)


@pytest.mark.parametrize(("change", "needle"), [
    ({"mtbf_prior_s": 0}, r"checkpoint.mtbf_prior_s=0(\.0)? is invalid"),  # floats are shown as read: 0.0
    ({"auto_min_steps": 0}, "checkpoint.auto_min_steps=0 is invalid"),
    ({"auto_min_steps": 20, "auto_max_steps": 10}, "checkpoint.auto_max_steps=10 is invalid"),
])
def test_the_bounds_and_prior_are_validated(change, needle):
    with pytest.raises(ConfigError, match=needle):
        CheckpointConfig(every_steps="auto", **change)


def test_training_code_of_ones_own_refuses_auto_naming_the_field(tmp_path):
    from trainer import user

    args = user.build_parser().parse_args(["--run-dir", str(tmp_path), "--set", "checkpoint.every_steps=auto",
                                           "--entrypoint", "mypkg.train:main"])
    with pytest.raises(ConfigError) as caught:
        user.export_runtime_env(args)
    assert "checkpoint.every_steps='auto'" in str(caught.value) and "integer" in str(caught.value)


def test_a_real_run_chooses_the_interval_from_a_probe_save_and_the_prior(h, tmp_path):
    """No history: the first save at step PROBE_STEPS is the probe; the chosen interval (bounded
    here to 25 steps, since a digits step is milliseconds) drives the next saves."""
    run_dir = tmp_path / "probe"
    out = h.check_ok(h.run(run_dir, sets=("train.max_steps=60", "checkpoint.every_steps=auto", "checkpoint.auto_max_steps=25"),
                           nproc=None))
    assert "gangflow: checkpoint interval: auto = 25 steps" in out, out[-3000:]
    records = h.metrics(run_dir)
    [chosen] = [r for r in records if r.get("event") == "checkpoint_interval"]
    assert chosen["every_steps"] == 25 and chosen["bound"] == "checkpoint.auto_max_steps"
    assert chosen["cost_source"].startswith("probe") and chosen["mtbf_source"].startswith("prior")
    assert chosen["cost_s"] > 0 and chosen["step_s"] > 0 and chosen["mtbf_s"] == 86400.0
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [PROBE_STEPS, 25, 50, 60]


def test_a_real_run_takes_its_inputs_from_history_without_a_probe_save(h, tmp_path):
    run_dir = tmp_path / "history"
    history = {"cost_s": 50.0, "cost_source": "mlflow: median of 4 saves", "mtbf_s": 1e6, "mtbf_source": "airflow: 1 failure"}
    out = h.check_ok(h.run(run_dir, sets=("train.max_steps=60", "checkpoint.every_steps=auto", "checkpoint.auto_max_steps=15"),
                           nproc=None, **{HISTORY_ENV: json.dumps(history)}))
    records = h.metrics(run_dir)
    [chosen] = [r for r in records if r.get("event") == "checkpoint_interval"]
    assert (chosen["cost_s"], chosen["cost_source"], chosen["mtbf_s"], chosen["mtbf_source"]) == (
        50.0, "mlflow: median of 4 saves", 1e6, "airflow: 1 failure")
    assert chosen["every_steps"] == 15 and "mlflow: median of 4 saves" in out
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [30, 45, 60]  # chosen at step 20: no probe save
