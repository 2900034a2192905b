"""The pipeline DAG end to end with the real components (slow), and params it refuses (its parse-time
contract is tests/unit/dags/test_train_pipeline.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.numpy import load_file

from pipeline_runs import FAST, PROJECT_ROOT, finish, last_line_of_python, pipeline_env, run_pipeline, start_pipeline


@pytest.mark.parametrize(
    ("conf", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"backend": "slurm"}, "backend"),
        ({"launcher": "srun"}, "launcher"),
        ({"learning_rate": -1}, "learning_rate"),
        ({"dataset_version": "v1"}, "dataset_version"),
        ({"max_steps": "many"}, "max_steps"),
        ({"learning_rate": float("nan")}, "learning_rate"),  # NaN passes every JSON Schema bound
        ({"promotion_floor": float("nan")}, "promotion_floor"),
    ],
)
def test_bad_params_are_refused_naming_the_field(pipeline_home, tmp_path, conf, field):
    summary, output, code = run_pipeline(pipeline_home, conf, tmp_path / "run.log")
    assert code != 0
    assert summary["state"] == "failed" and summary["failure"]["kind"] == "user"
    assert field in summary["failure"]["reason"], summary
    assert summary["train_attempts"] == 0


@pytest.mark.slow
def test_impossible_gang_is_refused_with_a_reason(pipeline_home, tmp_path):
    summary, output, code = run_pipeline(pipeline_home, {**FAST, "world_size": 8}, tmp_path / "run.log", GANGFLOW_POOL_SLOTS="2")
    assert code != 0 and summary["failure"]["kind"] == "user"
    assert "world_size=8" in summary["failure"]["reason"] and "2 slots" in summary["failure"]["reason"]
    assert summary["train_attempts"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("conf", "needles"),
    [
        # JSON Schema counts 2.0 as an integer: admit_gang must not branch to "train_local_2.0".
        # (batch_size not a multiple of world_size goes through the same check: tests/unit/dags/test_params.py)
        ({"world_size": 2.0, "max_steps": 60.0}, ["world_size=2.0: must be an integer", "max_steps=60.0: must be an integer"]),
        # a launcher the backend cannot run, named with it (issue 24.4)
        ({"backend": "ray", "launcher": "mpirun"}, ["backend='ray' with launcher='mpirun' cannot run", "(kubernetes, local)"]),
    ],
)
def test_params_the_schema_cannot_refuse_are_refused_before_admission(pipeline_home, tmp_path, conf, needles):
    summary, output, code = run_pipeline(pipeline_home, {**FAST, **conf}, tmp_path / "run.log")
    assert code != 0 and summary["state"] == "failed", output[-4000:]
    failure = summary["failure"]
    assert failure["kind"] == "user" and failure["task_id"] == "admit_gang", summary
    assert all(needle in failure["reason"] for needle in needles), failure
    assert summary["train_attempts"] == 0 and "train_local_2.0" not in output


@pytest.mark.slow
def test_a_version_that_reads_as_a_number_stays_a_string(pipeline_home, tmp_path):
    """Native template rendering turned this valid (absent) version into inf."""
    version = "12345678901234567890123456e78901"
    summary, output, code = run_pipeline(pipeline_home, {**FAST, "dataset_version": version}, tmp_path / "run.log")
    assert code != 0 and summary["failure"]["task_id"] == "validate_dataset", summary
    assert version in summary["failure"]["reason"] and "inf" not in summary["failure"]["reason"], summary


ASSET_RUN = """
import json
from operators.cli import demo
from operators.config import embedded
embedded.apply()  # before anything imports airflow: it binds its config at import
from operators.config.pipelines import DATASET_ASSET_NAME, DATASET_ASSET_URI
import airflow.models.dagrun as dagrun_module
from airflow.assets.manager import AssetManager
from airflow.sdk import Asset

VERSION = {version!r}
create = dagrun_module.get_or_create_dagrun


def asset_triggered(**kwargs):
    # dag.test() makes its own run; give it what the scheduler gives an Asset-triggered run: the
    # event publish_dataset's outlet records (through the same AssetManager call), consumed by the run.
    run = create(**kwargs)
    session = kwargs["session"]
    event = AssetManager.register_asset_change(
        asset=Asset(DATASET_ASSET_NAME, uri=DATASET_ASSET_URI), extra={{"version": VERSION}}, session=session
    )
    assert event is not None, "the dataset Asset is not registered"
    run.consumed_asset_events.append(event)
    session.commit()
    return run


dagrun_module.get_or_create_dagrun = asset_triggered
from airflow.dag_processing.dagbag import DagBag

dag = DagBag(dag_folder="dags/train_pipeline.py").dags["train_pipeline"]
# Past validation nothing matters here: mark the rest done rather than train.
run = dag.test(mark_success_pattern="^(admit_gang|train_|training_result|evaluate|promote)")
print(json.dumps(demo.summarize(run) | {{"default": dag.params["dataset_version"]}}, default=str))
"""


@pytest.mark.slow
def test_an_asset_triggered_run_trains_the_events_version(pipeline_home):
    """A real asset event (AssetManager, as publish_dataset's outlet records it), consumed by the run:
    validation gets the event's version (absent from DVC here, so it fails naming it), not the
    parse-time default of the Param."""
    version = "0123456789abcdef0123456789abcdef"
    summary = json.loads(last_line_of_python(ASSET_RUN.format(version=version), pipeline_home, timeout=600))
    assert summary["default"] != version
    assert summary["state"] == "failed" and summary["failure"]["task_id"] == "validate_dataset", summary
    assert version in summary["failure"]["reason"], summary


@pytest.mark.slow
def test_first_run_promotes_and_registry_has_lineage(baseline, pipeline_home):
    s = baseline["summary"]
    assert s["state"] == "success", s
    assert s["accuracy"] >= 0.8 and s["promoted"] is True and s["model_version"] == "1"
    assert s["train_attempts"] == 1 and s["dataset_version"]
    registry = _registry(pipeline_home, s["model_name"])
    assert registry["champion"] == "1"
    tags = registry["versions"]["1"]
    assert tags["gangflow.decision"] == "promoted"
    for key in ("dataset_version", "dag_id", "dag_run_id", "mlflow_run_id", "git_commit"):
        assert any(key in k for k in tags), (key, tags)


@pytest.mark.slow
def test_kill_is_retried_resumes_and_matches_uninterrupted_run(baseline, pipeline_home, tmp_path):
    """kill@step=30 on rank 1: one failed try, a retry that resumes from step 30, the same weights."""
    summary, output, code = run_pipeline(pipeline_home, FAST, tmp_path / "run.log", GANGFLOW_FAULT="kill@step=30,rank=1")
    assert code == 0, output[-6000:]
    assert summary["train_attempts"] == 2
    assert "infra failure" in output and "resumed from checkpoint step 30" in output
    # Same seed, same world size: bitwise the same final weights as the uninterrupted baseline.
    assert _weights(pipeline_home, summary) == _weights(pipeline_home, baseline["summary"])
    # Exactly one new version for this training run, not promoted (it only ties the champion).
    registry = _registry(pipeline_home, summary["model_name"])
    assert summary["promoted"] is False and "does not beat" in summary["promotion_reason"]
    assert list(registry["runs"].values()).count(registry["runs"][summary["model_version"]]) == 1
    assert registry["champion"] == baseline["summary"]["model_version"]


@pytest.mark.slow
def test_user_error_fails_after_one_attempt_saying_why(pipeline_home, tmp_path):
    summary, output, code = run_pipeline(pipeline_home, FAST, tmp_path / "run.log", GANGFLOW_FAULT="raise@step=5")
    assert code != 0 and summary["state"] == "failed"
    assert summary["train_attempts"] == 1
    assert summary["failure"]["kind"] == "user"
    reason = summary["failure"]["reason"]
    assert "ValueError" in reason and "step 5" in reason and "rank" in reason, reason
    assert "user failure" in output


@pytest.mark.slow
def test_preemption_commits_a_checkpoint_and_loses_no_steps(pipeline_home, tmp_path):
    summary, output, code = run_pipeline(pipeline_home, FAST, tmp_path / "run.log", GANGFLOW_FAULT="term@step=25")
    assert code == 0, output[-6000:]
    # A preemption is its own outcome (issue 25.1): the task re-launches the gang itself, so
    # Airflow's try count (`train_attempts`: failures) does not move.
    assert summary["train_attempts"] == 1
    assert summary["preemptions"] == 1 and "75" in summary["preemption_reasons"][0], summary
    assert "gangflow: preempted (1 of at most 10)" in output, output[-3000:]
    # The SIGTERM path checkpoints at the step where it stopped: the re-launch resumes there.
    assert summary["resumed_from_step"] in (25, 26), summary
    assert "resumed from checkpoint step 25" in output or "resumed from checkpoint step 26" in output, output[-3000:]


@pytest.mark.slow
def test_a_gang_past_its_run_time_limit_commits_a_checkpoint_and_fails_once_as_the_users(pipeline_home, tmp_path):
    """Issue 25.3: a run-time limit, here the trigger form's Param below the pipeline file's own (the
    ceiling the task's execution_timeout is built from). The gang still training at the limit is
    stopped with SIGTERM (each rank commits a final checkpoint, exit 75), which is no preemption:
    the try fails as the user's, not retried, and the reason names the limit."""
    limit = 45
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    digits = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())
    digits["training"] = {"max_run_time_seconds": 900}
    (pipelines / "digits.yaml").write_text(yaml.safe_dump(digits))
    records = lambda: set((pipeline_home / "runs").glob("train_pipeline/*/failures/try-1.json"))  # noqa: E731
    earlier = records()  # other tests' runs share this state dir
    conf = {**FAST, "max_steps": 100000, "max_run_time_seconds": limit}
    summary, output, code = run_pipeline(pipeline_home, conf, tmp_path / "run.log", GANGFLOW_PIPELINES=str(pipelines))
    assert code != 0 and summary["state"] == "failed", output[-6000:]
    assert summary["train_attempts"] == 1 and summary["preemptions"] == 0, summary
    assert summary["failure"]["kind"] == "user" and f"training.max_run_time_seconds={limit} reached" in summary["failure"]["reason"], summary
    record_path = next(iter(records() - earlier))
    record = json.loads(record_path.read_text())
    assert record["evidence"]["termination_reason"] == "DeadlineExceeded" and record["verdict"]["retryable"] is False
    # the final checkpoint the ranks committed on SIGTERM, named in the
    # reason: a cleared task resumes from it
    steps = sorted(int(p.name.removeprefix("step-")) for p in (record_path.parent.parent / "checkpoints").glob("step-*"))
    assert steps and f"the newest committed checkpoint is step {steps[-1]}" in record["verdict"]["reason"], (steps, record["verdict"])
    assert "got signal: 15" in record["evidence"]["log_tail"]  # torchrun and the ranks were stopped with SIGTERM


@pytest.mark.slow
def test_corrupted_newest_checkpoint_resumes_from_the_one_before(pipeline_home, tmp_path):
    log = tmp_path / "run.log"
    records = lambda: set((pipeline_home / "runs").glob("train_pipeline/*/failures/try-1.json"))  # noqa: E731
    earlier = records()  # other tests' runs share this state dir
    proc = start_pipeline(pipeline_home, FAST, log, GANGFLOW_FAULT="kill@step=35,rank=0", GANGFLOW_RETRY_BASE_DELAY="15")
    failure = _wait_for(lambda: next(iter(records() - earlier), None), proc)
    run_dir = failure.parent.parent
    newest = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.is_dir() and not p.name.startswith("."))[-1]
    victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated, as a crash mid-copy leaves it
    summary, output, code = finish(proc, log)
    assert code == 0, output[-6000:]
    assert "resumed from checkpoint step 20" in output and "corrupt" in output, output[-3000:]


def _wait_for(probe, proc, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := probe()) is not None:
            return found
        assert proc.poll() is None, "pipeline ended before the first try failed"
        time.sleep(0.2)
    raise TimeoutError("first try did not fail in time")


def _run_dir(home: Path, dag_run_id: str) -> Path:
    """The run dir as the deployment computes it (its identity depends on its Airflow config)."""
    code = f"from operators.config import embedded, settings\nembedded.apply()\nprint(settings.run_dir('train_pipeline', {dag_run_id!r}))"
    return Path(last_line_of_python(code, home))


def _weights(home: Path, summary: dict) -> dict:
    final = _run_dir(home, summary["dag_run_id"]) / "final" / "model.safetensors"
    return {k: v.tobytes() for k, v in load_file(final).items()}


def _registry(home: Path, model_name: str) -> dict:
    code = (
        "import json\nfrom mlflow import MlflowClient\nc = MlflowClient()\n"
        f"vs = c.search_model_versions(\"name='{model_name}'\")\n"
        f"try:\n    champ = c.get_model_version_by_alias('{model_name}', 'champion').version\nexcept Exception:\n    champ = None\n"
        "print(json.dumps({'champion': champ and str(champ), 'versions': {str(v.version): v.tags for v in vs}, 'runs': {str(v.version): v.run_id for v in vs}}))"
    )
    env = pipeline_env(home, MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
