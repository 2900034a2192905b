"""`make demo --conf` (and `make baseline --conf`): the DAG run's Params must be a JSON object; anything
else is refused naming the option, before anything imports Airflow (security review, item 4)."""

from __future__ import annotations

import argparse

import pytest

from operators.cli.demo import parse_with_conf


@pytest.mark.parametrize("conf", ["[1]", "null", '"world_size=1"', "2", "true"])
def test_conf_that_is_not_a_json_object_is_refused_naming_the_option(capsys, conf):
    with pytest.raises(SystemExit) as exited:
        parse_with_conf(argparse.ArgumentParser(prog="demo"), ["--conf", conf])
    assert exited.value.code == 2
    assert "--conf: must be a JSON object" in capsys.readouterr().err


def test_conf_that_is_not_json_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        parse_with_conf(argparse.ArgumentParser(prog="demo"), ["--conf", "{world_size: 2}"])
    assert "--conf: not valid JSON" in capsys.readouterr().err


def test_a_json_object_is_the_conf():
    _, conf = parse_with_conf(argparse.ArgumentParser(prog="demo"), ["--conf", '{"world_size": 2}'])
    assert conf == {"world_size": 2}
    assert parse_with_conf(argparse.ArgumentParser(prog="demo"), [])[1] == {}


def test_make_baseline_refuses_it_too(capsys):
    from operators.cli import baseline

    with pytest.raises(SystemExit):
        baseline.main(["--conf", "[1]"])
    assert "--conf: must be a JSON object" in capsys.readouterr().err
