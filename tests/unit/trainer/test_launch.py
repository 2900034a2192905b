"""trainer.launch: torchrun's agent with the ranks forked from a warm interpreter.

It must be a drop-in for `torchrun ... -m trainer`: the same results bit for bit, the same exit
status and failure summary (real gangs: tests/system/trainer/test_launch.py), and a clear
refusal of what it does not run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from operators.backends.local import LocalBackend

LAUNCH = [sys.executable, "-m", "trainer.launch"]


def test_the_command_refuses_another_entry_point_with_the_config_exit_status():
    argv = ["--standalone", "--nproc-per-node", "1", "-m", "other"]
    proc = subprocess.run([*LAUNCH, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "runs `-m trainer` or `-m trainer.user` only, got '-m other'" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--standalone", "--nproc-per-node", "1", "train.py"], "runs `-m trainer` or `-m trainer.user` only, got 'train.py'"),
    (["--standalone", "--start-method", "spawn", "--nproc-per-node", "1", "-m", "trainer"], "--start-method"),
    (["--standalone", "--start_method=forkserver", "--nproc-per-node", "1", "-m", "trainer"], "--start-method"),
])  # fmt: skip
def test_refuses_what_it_does_not_run(argv, message):
    from trainer.launch import LaunchError, parse  # in this process: the refusal comes before anything is launched

    with pytest.raises(LaunchError) as refused:
        parse(argv)
    assert message in str(refused.value)


@pytest.mark.parametrize("argv", [
    ["--standalone", "--nproc-per-node", "1", "-m", "trainer.user", "--run-dir", "/r", "--module", "mypkg.train",
     "--", "--start-method", "spawn"],
    ["--standalone", "--nproc-per-node", "1", "-m", "trainer", "--run-dir", "/r", "--set", "x.y=--start_method=fork"],
])  # fmt: skip
def test_the_training_programs_own_arguments_are_not_the_launchers(argv):
    from trainer.launch import parse

    config, entry = parse(argv)
    assert entry == argv[argv.index("-m") + 1:] and config.start_method == "fork"


@pytest.mark.parametrize("option", [["--start-m", "spawn"], ["--start_method", "fork"]])
def test_a_start_method_given_to_the_launcher_in_any_spelling_is_refused(option):
    from trainer.launch import LaunchError, parse

    with pytest.raises(LaunchError, match="--start-method"):
        parse(["--standalone", *option, "--nproc-per-node", "1", "-m", "trainer"])


def test_the_local_backend_launches_through_it_unless_told_otherwise(tmp_path):
    from operators.backends.base import GangSpec

    spec = GangSpec(name="g", run_dir=str(tmp_path), world_size=2, config_path="params.yaml")
    assert LocalBackend().command(spec, tmp_path)[1:3] == ["-m", "trainer.launch"]
    assert LocalBackend(launcher="torchrun").command(spec, tmp_path)[1:3] == ["-m", "torch.distributed.run"]
    with pytest.raises(ValueError, match="launcher='mpirun': accepted values are fork, torchrun"):
        LocalBackend(launcher="mpirun")


def test_importing_the_launcher_leaves_it_safe_to_fork():
    # What must hold when the ranks are forked: no CUDA context and no thread besides the main one.
    code = ("import threading, torch, trainer.launch; "
            "print(torch.cuda.is_initialized(), threading.active_count(), 'torch._dynamo' in __import__('sys').modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["False", "1", "True"]
