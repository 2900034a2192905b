"""GANGFLOW_FAULT parsing and the fire-at-most-once logic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.errors import ConfigError
from trainer.faults import Fault, FaultInjector, parse_fault

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "text, fault",
    [
        ("kill@step=30", Fault("kill", 30)),
        ("term@step=5,rank=1", Fault("term", 5, 1)),
        ("exit=3@step=7", Fault("exit", 7, None, 3)),
        ("raise@step=1,rank=0", Fault("raise", 1, 0)),
        (" kill@step=2 ", Fault("kill", 2)),
        ("", None),
        (None, None),
    ],
)
def test_parse(text, fault):
    assert parse_fault(text) == fault
    if fault:
        assert parse_fault(fault.spec) == fault


@pytest.mark.parametrize("text", ["kill", "kill@30", "kill@step=", "boom@step=3", "exit@step=3", "exit=0@step=3",
                                  "exit=256@step=3", "kill@step=0", "kill@step=3,rank=x", "kill@step=3;rank=1",
                                  "raise@step=-1"])
def test_malformed_specs_are_config_errors(text):
    with pytest.raises(ConfigError, match="GANGFLOW_FAULT="):
        parse_fault(text)


def test_rank_outside_world_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="rank=3 but the world size is 2"):
        FaultInjector(parse_fault("kill@step=3,rank=3"), tmp_path, rank=0, world_size=2)


def test_once_only_faults_are_disarmed_by_their_marker(tmp_path):
    fault = parse_fault("term@step=4,rank=1")
    rank0 = FaultInjector(fault, tmp_path, rank=0, world_size=2)
    assert rank0.process_fault_due(4) and not rank0.process_fault_due(3)
    rank0.fire(4)  # not targeted: no marker, no signal
    assert not rank0.marker.exists()
    # A marker left by an earlier attempt (written by the targeted rank before firing) disarms it.
    rank0.marker.parent.mkdir(parents=True)
    rank0.marker.write_text("{}")
    again = FaultInjector(fault, tmp_path, rank=1, world_size=2)
    assert not again.armed and not again.process_fault_due(4)


def test_raise_fires_on_every_attempt(tmp_path):
    fault = parse_fault("raise@step=2")
    for _ in range(2):
        injector = FaultInjector(fault, tmp_path, rank=0, world_size=1)
        injector.maybe_raise(1)
        with pytest.raises(ValueError, match="training step 2"):
            injector.maybe_raise(2)
    other = FaultInjector(parse_fault("raise@step=2,rank=1"), tmp_path, rank=0, world_size=2)
    other.maybe_raise(2)  # not this rank


def test_exit_fault_persists_marker_then_exits_with_code(tmp_path):
    code = ("import sys; from trainer.faults import *; "
            f"i = FaultInjector(parse_fault('exit=7@step=3'), {str(tmp_path)!r}, rank=0, world_size=1); "
            "i.fire(3); sys.exit(0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 7
    assert (tmp_path / "faults" / "exit=7@step=3.fired").is_file()
    again = FaultInjector(parse_fault("exit=7@step=3"), tmp_path, rank=0, world_size=1)
    assert not again.armed


@pytest.mark.parametrize("spec, hooked", [(None, False), ("kill@step=3", False), ("kill@time=2", False),
                                          ("raise@step=1", False), ("kill@save", True), ("kill@save=2,rank=1", True)])
def test_the_checkpointer_is_given_a_save_hook_only_when_kill_at_save_is_armed(tmp_path, spec, hooked):
    """Without an armed kill@save the writer commits in one go: no stop between the data files and
    the commit for a hook to strike in (each stop costs the writer a round trip to the rank)."""
    inj = FaultInjector(parse_fault(spec), tmp_path, rank=0, world_size=2)
    assert (inj.save_hook == inj.at_save) if hooked else inj.save_hook is None
    if hooked:  # fired in an earlier attempt (its marker exists): disarmed, so no hook either
        (tmp_path / inj.marker_rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / inj.marker_rel).write_text("{}")
        assert FaultInjector(parse_fault(spec), tmp_path, rank=0, world_size=2).save_hook is None
