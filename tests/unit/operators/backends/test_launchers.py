"""The `launcher` choice (torchrun | mpirun): refusals before admission, mpirun's argv and env,
and the classifier's verdict on what real mpirun gangs printed (fixtures/mpirun_*: captured from
2-rank `mpirun ... python -m trainer` runs with GANGFLOW_FAULT, paths shortened to /app and /tmp/run)."""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from operators.backends import check_combination
from operators.backends.base import GangSpec
from operators.backends.local import LocalBackend, mpirun_evidence, rank_of_line
from operators.exceptions import GangCapacityError, InvalidParams, UnsupportedCombination
from operators.failures import classify
from operators.failures.evidence import parse_mpirun_failure

FIXTURES = Path(__file__).with_name("fixtures")


def spec(tmp_path, **kw) -> GangSpec:
    return GangSpec(name="g", run_dir=str(tmp_path), world_size=2, config_path="params.yaml", launcher="mpirun", **kw)


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["ray"])
def test_a_backend_that_cannot_run_mpirun_is_refused_naming_both(backend):
    with pytest.raises(UnsupportedCombination, match=f"backend='{backend}' with launcher='mpirun' cannot run") as info:
        check_combination(backend, "mpirun")
    assert isinstance(info.value, InvalidParams) and "local" in str(info.value)  # who can run it


def test_what_works_passes_and_an_unknown_launcher_is_refused():
    # kubernetes with mpirun: accepted here, refused at planning unless the runtime's api is mpijob
    # (tests/unit/operators/kubernetes/test_render_rayjob_mpijob.py)
    for backend, launcher in [("local", "torchrun"), ("local", "mpirun"), ("kubernetes", "torchrun"), ("kubernetes", "mpirun"),
                              ("ray", "torchrun")]:
        check_combination(backend, launcher)
    with pytest.raises(UnsupportedCombination, match="launcher='srun': accepted values are torchrun, mpirun"):
        check_combination("local", "srun")
    with pytest.raises(ValueError, match="launcher='srun': accepted values are torchrun, mpirun"):
        GangSpec(name="g", run_dir="/tmp/x", world_size=2, launcher="srun")


def test_admission_refuses_the_combination_before_any_task_runs():
    from operators.training import gang_task_id

    with pytest.raises(UnsupportedCombination, match="backend='ray' with launcher='mpirun'"):
        gang_task_id(backend="ray", world_size=2, local_world_sizes=(1, 2), launcher="mpirun")
    with pytest.raises(GangCapacityError, match="backend='slurm': accepted values"):
        gang_task_id(backend="slurm", world_size=2, local_world_sizes=(1, 2), launcher="mpirun")
    assert gang_task_id(backend="ray", world_size=2, local_world_sizes=(1, 2), launcher="torchrun") == "train_ray"


def test_the_pipeline_file_names_the_default_launcher(tmp_path):
    from operators.config.pipelines import PipelineConfigError, parse_pipeline

    base = {"dataset": {"stage": "prepare", "out": "data/digits", "suite": "data.expectations:digits_suite"}}
    assert parse_pipeline(base, source="p.yaml", name="p").launcher == "torchrun"
    assert parse_pipeline({**base, "training": {"launcher": "mpirun"}}, source="p.yaml", name="p").launcher == "mpirun"
    with pytest.raises(PipelineConfigError, match=r"training.launcher='srun': accepted values are torchrun, mpirun"):
        parse_pipeline({**base, "training": {"launcher": "srun"}}, source="p.yaml", name="p")
    with pytest.raises(PipelineConfigError, match="training: unknown key"):
        parse_pipeline({**base, "training": {"launch": "mpirun"}}, source="p.yaml", name="p")


# --- argv and env ---------------------------------------------------------------------------


def test_mpirun_argv_runs_the_trainer_per_rank_and_keeps_values_out_of_argv(tmp_path):
    env = {"PATH": "/bin", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "MLFLOW_RUN_ID": "secret-run"}
    s = spec(tmp_path, env={"MLFLOW_RUN_ID": "secret-run"}, overrides=("train.max_steps=5",))
    argv = LocalBackend(dataset_remote="/remote").mpirun_command(s, env)
    assert Path(argv[0]).name == "mpirun" and argv[1:3] == ["-np", "2"] and "--oversubscribe" in argv
    assert "--tag-output" in argv  # the per-rank output the evidence is cut from
    exported = [argv[i + 1] for i, item in enumerate(argv) if item == "-x"]
    assert exported == sorted(["PATH", "MASTER_ADDR", "MASTER_PORT", "MLFLOW_RUN_ID"])  # by name; unset ones left out
    tail = argv[argv.index(sys.executable):]
    assert tail[:3] == [sys.executable, "-m", "trainer"] and "--run-dir" in tail and "train.max_steps=5" in tail
    assert not any("secret-run" in item or "1234" in item for item in argv)


def test_mpirun_env_meets_on_loopback_on_a_port_of_its_own(monkeypatch):
    backend = LocalBackend()
    one, two = backend.mpirun_env({}), backend.mpirun_env({})
    assert one["MASTER_ADDR"] == "127.0.0.1" and int(one["MASTER_PORT"]) > 0
    assert one["MASTER_PORT"] != two["MASTER_PORT"] or int(one["MASTER_PORT"]) > 0
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert backend.mpirun_env({})["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    assert backend.mpirun_env({})["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in backend.mpirun_env({})


def test_the_trainer_under_mpirun_gets_its_rendezvous(monkeypatch):
    """trainer.distributed.detect turns Open MPI's variables into the env:// ones (one node)."""
    from trainer.distributed import detect

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    launch = detect()
    assert (launch.rank, launch.world_size, launch.launcher) == (1, 2, "mpirun")
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "1")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"].isdigit()


# --- evidence from real mpirun output ---------------------------------------------------------


def replay(name: str, run_dir: Path, exit_code: int) -> dict:
    """The evidence LocalBackend builds from a captured mpirun output and the ranks' error records."""
    agent, tails = [], collections.defaultdict(collections.deque)
    for line in (FIXTURES / f"{name}.out").read_text().splitlines():
        rank, text = rank_of_line(line, "mpirun")
        (tails[rank] if rank is not None else agent).append(text)
    (run_dir / "errors").mkdir(parents=True, exist_ok=True)
    started = time.time()
    for record in FIXTURES.glob(f"{name}.rank-*.json"):
        shutil.copyfile(record, run_dir / "errors" / f"{record.name.split('.')[-2]}.json")
    return mpirun_evidence(exit_code, "\n".join(agent), tails, run_dir, started)


def test_mpirun_summary_names_the_first_failed_rank():
    killed = parse_mpirun_failure((FIXTURES / "mpirun_kill_time_rank_1.out").read_text())
    assert killed == {"rank": 1, "exit_code": -9, "signal": "SIGKILL"}
    raised = parse_mpirun_failure((FIXTURES / "mpirun_raise_rank_1.out").read_text())
    assert raised == {"rank": 1, "exit_code": 1}
    assert parse_mpirun_failure("mpirun: Error: unknown option --frobnicate") is None


def test_a_rank_killed_under_mpirun_is_infra_when_the_backend_counted_no_oom_kill(tmp_path):
    evidence = replay("mpirun_kill_time_rank_1", tmp_path, 137)
    assert evidence["rank"] == 1 and [r["rank"] for r in evidence["ranks"]] == [1, 0]
    verdict = classify(evidence | {"context": {"oom_kills": 0}})  # what LocalBackend adds (operators/utils/oom.py)
    assert (verdict.kind, verdict.rule, verdict.retryable) == ("infra", "killed-from-outside", True), verdict.reason
    assert "SIGKILL" in verdict.reason and "rank 1" in verdict.reason
    alone = classify(evidence)  # nothing says whether the kernel's OOM killer sent it: retried once
    assert (alone.kind, alone.rule, alone.retryable) == ("user", "killed-from-outside", True), alone.reason


def test_a_raise_under_mpirun_is_the_users(tmp_path):
    evidence = replay("mpirun_raise_rank_1", tmp_path, 1)
    assert evidence["rank"] == 1 and evidence["exit_code"] == 1
    assert "ValueError: injected fault" in evidence["log_tail"]
    verdict = classify(evidence)
    assert verdict.kind == "user" and not verdict.retryable, verdict.reason
    assert "ValueError" in verdict.reason and "rank 1" in verdict.reason


def test_only_this_tries_error_records_are_evidence(tmp_path):
    (tmp_path / "errors").mkdir()
    stale = tmp_path / "errors" / "rank-0.json"
    stale.write_text(json.dumps({"exc_type": "ValueError", "message": "from try 1", "source": "user", "rank": 0}))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    text = (FIXTURES / "mpirun_kill_time_rank_1.out").read_text()
    evidence = mpirun_evidence(137, text, {}, tmp_path, time.time())
    assert [r["rank"] for r in evidence["ranks"]] == [1] and classify(evidence).rule == "killed-from-outside"


def test_the_launchers_own_signal_line_is_read_from_a_log_tail():
    """A log tail with only mpirun's summary (no per-rank fields) is judged as torchrun's -9 is."""
    verdict = classify({"exit_code": 137, "log_tail": (FIXTURES / "mpirun_kill_time_rank_1.out").read_text()})
    assert verdict.kind == "infra", verdict.reason


# --- the ray backend: argv, refusals, and evidence from real Ray Train runs -----------------------


def test_ray_driver_argv_names_the_gang_and_exports_by_name(tmp_path):
    from operators.backends.ray import RayBackend

    s = GangSpec(name="g", run_dir=str(tmp_path), world_size=2, config_path="/app/params.yaml", attempt=3,
                 env={"MLFLOW_RUN_ID": "secret-run", "GANGFLOW_FAULT": "kill@time=1"})  # fmt: skip
    argv = RayBackend(address="127.0.0.1:6379").command(s)
    assert argv[:3] == [sys.executable, "-m", "operators.backends.ray"]
    assert argv[argv.index("--world-size") + 1] == "2" and argv[argv.index("--name") + 1] == "g-try-3"
    assert argv[argv.index("--address") + 1] == "127.0.0.1:6379"
    exported = [argv[i + 1] for i, item in enumerate(argv) if item == "--export"]
    assert "MLFLOW_RUN_ID" in exported and "GANGFLOW_FAULT" in exported
    assert not any("secret-run" in item or "kill@time" in item for item in argv)
    trainer = argv[argv.index("--") + 1:]
    assert trainer[:4] == ["--run-dir", str(tmp_path), "--config", "/app/params.yaml"]


def test_a_local_ray_cluster_larger_than_this_machine_is_refused(monkeypatch, tmp_path):
    from operators.backends.ray import RayBackend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    big = GangSpec(name="g", run_dir=str(tmp_path), world_size=4)
    with pytest.raises(GangCapacityError, match="world_size=4: a local Ray cluster here has 2 CPUs"):
        RayBackend().check_capacity(big)
    RayBackend(address="10.0.0.1:6379").check_capacity(big)  # an existing cluster's scheduler decides
    with pytest.raises(ValueError, match="cpus_per_worker=0: must be an integer >= 1"):
        RayBackend(cpus_per_worker=0)


def replay_ray(name: str, run_dir: Path, exit_code: int = 1) -> dict:
    """The evidence RayBackend builds from a captured driver output and the ranks' error records."""
    from operators.backends.ray import DriverOutput, errors_since

    output = DriverOutput()
    for line in (FIXTURES / f"{name}.log").read_text().splitlines(keepends=True):
        output.feed(line)
    (run_dir / "errors").mkdir(parents=True, exist_ok=True)
    started = time.time()
    for record in FIXTURES.glob(f"{name}.rank-*.json"):
        shutil.copyfile(record, run_dir / "errors" / f"{record.name.split('.')[-2]}.json")
    assert output.result is not None and output.result["succeeded"] is False
    assert set(output.rank_tails) == {0, 1}  # the workers' lines, mapped from Ray's pid prefix to ranks
    return output.evidence(exit_code, errors_since(run_dir, started))


def test_a_ray_worker_killed_is_infra_on_its_rank(tmp_path):
    evidence = replay_ray("ray_kill_time_rank_1", tmp_path)
    assert evidence["rank"] == 1 and "WorkerHealthCheckFailedError: A worker health check failed" in evidence["log_tail"]
    assert [r["rank"] for r in evidence["ranks"]] == [1, 0]
    assert "The actor died unexpectedly" in evidence["log_tail"]
    verdict = classify(evidence)
    assert verdict.kind == "infra" and verdict.retryable, verdict.reason
    assert "rank 1" in verdict.reason


def test_a_raise_inside_the_ray_train_function_is_the_users(tmp_path):
    evidence = replay_ray("ray_raise_rank_1", tmp_path)
    assert evidence["rank"] == 1 and evidence["exit_code"] == 1 and evidence["error_file"]["source"] == "user"
    verdict = classify(evidence)
    assert verdict.kind == "user" and not verdict.retryable, verdict.reason
    assert "ValueError" in verdict.reason and "rank 1" in verdict.reason


@pytest.mark.parametrize("error, kind", [
    # Ray's own exception types, as its docs print them: a node lost is infra; the node's memory or
    # the object store exhausted by the job's own data is the job's (as a host OOM under torchrun)
    ("ray.exceptions.NodeDiedError: The node with node id: 3b1f and address: 10.0.0.7 and node name: 10.0.0.7 has been marked dead", "infra"),
    ("ray.exceptions.ObjectStoreFullError: Failed to put object ffff in object store because it is full. Object size is 2147483648 bytes.", "user"),
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.", "user"),
])  # fmt: skip
def test_ray_system_failures_of_a_worker_are_judged_like_torchruns(error, kind):
    from operators.failures.evidence import ray_evidence

    kind_name = error.split(":", 1)[0]
    result = {"succeeded": False, "worker_failures": {"0": {"type": kind_name, "message": error.split(": ", 1)[1],
                                                            "traceback": f"Traceback (most recent call last):\n  File \"/venv/lib/python3.11/site-packages/ray/_private/worker.py\", line 1055, in get_objects\n    raise value\n{error}\n"}}}  # fmt: skip
    evidence = ray_evidence(result, 1, "", {}, {})
    assert kind_name in evidence["log_tail"] and set(evidence) <= {"rank", "log_tail", "exit_code", "error_file", "ranks"}
    verdict = classify(evidence, precedents=False)
    assert verdict.kind == kind, verdict.reason
    assert "CUDA" not in verdict.reason  # a host's or the object store's memory, not a GPU's


def test_a_ray_driver_that_never_reached_the_workers_is_evidence_too():
    from operators.failures.evidence import ray_evidence

    evidence = ray_evidence({}, -9, "[ray] starting the cluster", {}, {})
    assert evidence == {"exit_code": -9, "log_tail": "[ray] starting the cluster"}
    verdict = classify(evidence)
    assert (verdict.rule, verdict.retryable) == ("killed-from-outside", True), verdict.reason


def test_a_ray_driver_failure_is_not_blamed_on_the_training_code():
    """ray.init or Ray Train failing in the driver (gangflow's and Ray's code) is recorded with
    `source: null`, so the classifier never reads the driver's frames as the user's."""
    from operators.failures.evidence import ray_evidence

    tb = ('Traceback (most recent call last):\n  File "/app/operators/backends/ray.py", line 233, in driver\n'
          '    ray.init(num_cpus=2)\n  File "/venv/lib/python3.11/site-packages/ray/_private/node.py", line 952, in get_gcs_client\n'
          '    raise RuntimeError("Failed to start GCS.")\nRuntimeError: Failed to start GCS.\n')  # fmt: skip
    result = {"succeeded": False, "error": {"type": "RuntimeError", "message": "Failed to start GCS.", "traceback": tb}}
    evidence = ray_evidence(result, 1, "starting", {}, {})
    assert evidence["error_file"]["source"] is None and evidence["error_file"]["exc_type"] == "RuntimeError"
    assert "training code" not in classify(evidence, precedents=False).reason


def test_the_pipeline_file_sets_the_preemption_budget():
    from operators.config.pipelines import PipelineConfigError, parse_pipeline

    base = {"dataset": {"stage": "prepare", "out": "data/digits", "suite": "data.expectations:digits_suite"}}
    assert parse_pipeline(base, source="p.yaml", name="p").max_preemptions == 10
    assert parse_pipeline({**base, "training": {"max_preemptions": 0}}, source="p.yaml", name="p").max_preemptions == 0
    for bad in (-1, "lots", 1.5):
        with pytest.raises(PipelineConfigError, match=r"training.max_preemptions=.*accepted values: an integer >= 0"):
            parse_pipeline({**base, "training": {"max_preemptions": bad}}, source="p.yaml", name="p")


def test_the_pipeline_file_sets_the_run_time_and_queue_wait_limits():
    from operators.config.pipelines import PipelineConfigError, parse_pipeline

    base = {"dataset": {"stage": "prepare", "out": "data/digits", "suite": "data.expectations:digits_suite"}}
    assert parse_pipeline(base, source="p.yaml", name="p").max_run_time_seconds is None
    limited = parse_pipeline({**base, "training": {"max_run_time_seconds": 3600}}, source="p.yaml", name="p")
    assert limited.max_run_time_seconds == 3600 and limited.training_code == ()  # still gangflow's own loop
    waiting = parse_pipeline({**base, "training": {"max_queue_wait_seconds": 1800}}, source="p.yaml", name="p")
    assert waiting.max_queue_wait_seconds == 1800 and waiting.max_run_time_seconds is None
    for key in ("max_run_time_seconds", "max_queue_wait_seconds"):
        for bad in (0, -5, "1h", 1.5, True):
            with pytest.raises(PipelineConfigError, match=rf"training.{key}=.*accepted values: an integer from 1 to"):
                parse_pipeline({**base, "training": {key: bad}}, source="p.yaml", name="p")
