"""The training task relays a real torchrun gang's metrics.jsonl to MLflow (operators.hooks.mlflow_relay,
issue 11): a killed try's metrics reach the run, the retry logs into the same run with its final
weights, and the ranks import no MLflow (tests/unit/operators/hooks/test_mlflow_relay.py has the
relay's unit tests)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[4]


_PROBE = """
import atexit, json, os, sys
def _dump():
    if os.environ.get("RANK") is not None:
        path = os.path.join(os.environ["GANGFLOW_TEST_PROBE"], "rank%s.json" % os.environ["RANK"])
        heavy = [m for m in ("mlflow", "sqlalchemy", "pandas", "sklearn", "dvc", "boto3", "s3fs") if m in sys.modules]
        with open(path, "w") as fh:
            json.dump({"heavy": heavy}, fh)
atexit.register(_dump)
# Ranks forked by trainer.launch end through multiprocessing (its finalizers), not atexit; a
# multiprocessing child clears the finalizers it inherited, then runs these after-fork hooks.
import multiprocessing.util
class _Hook:
    pass
_HOOK = _Hook()
multiprocessing.util.register_after_fork(_HOOK, lambda _: multiprocessing.util.Finalize(None, _dump, exitpriority=100))
"""


@pytest.mark.slow
def test_task_relays_a_real_gang_and_ranks_import_no_mlflow(client, home, tmp_path, monkeypatch):
    """A real 2-rank gang through GangTrainingOperator.execute: try 1 is killed by a fault
    (`kill@step=40,rank=1`, synchronised) after a checkpoint: its metrics reach the run, no final
    weights do; try 2 resumes, logs into the same run, and its final weights are the run's
    artifacts. Neither rank ever imports mlflow, nor pandas and the like (a sitecustomize probe
    records sys.modules at exit; a rank forked by trainer.launch holds what the launcher imported
    too)."""
    from operators.exceptions import InfraFailure
    from operators.training import GangTrainingOperator

    data = tmp_path / "digits"
    data.mkdir()
    folder = ROOT / "data" / "digits"
    if not (folder / "train.parquet").is_file():
        subprocess.run([sys.executable, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    for name in ("train.parquet", "test.parquet"):
        shutil.copyfile(folder / name, data / name)
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(probe))
    monkeypatch.setenv("GANGFLOW_TEST_PROBE", str(probe))
    monkeypatch.setenv("GANGFLOW_PROJECT", str(ROOT))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")  # a worker's setting: must not reach ranks
    op = GangTrainingOperator(
        task_id="train_local_2", world_size=2, experiment="relay-gang", run_dir=str(tmp_path / "run"),
        config_path=str(ROOT / "params.yaml"), backend_options={"nproc_limit": 2},
        overrides={"data.train_path": str(data / "train.parquet"), "data.test_path": str(data / "test.parquet"),
                   "train.max_steps": 80, "checkpoint.every_steps": 20, "train.log_every_steps": 10},
    )

    def context(try_number):
        ti = SimpleNamespace(dag_id="relay_dag", try_number=try_number, start_date=datetime.now(timezone.utc))
        return {"ti": ti, "run_id": "manual__relay"}

    monkeypatch.setenv("GANGFLOW_ALLOW_FAULTS", "1")
    monkeypatch.setenv("GANGFLOW_FAULT", "kill@step=40,rank=1")
    with pytest.raises(InfraFailure):
        op.execute(context(1))
    run_id = op._relay.run_id
    assert run_id and client.get_run(run_id).data.metrics.get("loss") is not None, "try 1's metrics not relayed"
    assert client.list_artifacts(run_id) == []  # a failed try never logs final
    for rank in (0, 1):
        if (probe / f"rank{rank}.json").is_file():  # the killed rank writes nothing
            assert json.loads((probe / f"rank{rank}.json").read_text())["heavy"] == []
        (probe / f"rank{rank}.json").unlink(missing_ok=True)

    monkeypatch.delenv("GANGFLOW_FAULT")
    result = op.execute(context(2))
    model_id = result["model_uri"].removeprefix("models:/")
    assert result["mlflow_run_id"] == run_id and result["model_uri"].startswith("models:/m-")
    assert result["resumed_from_step"] == 40
    # final/ logged once, as the run's LoggedModel (issue 21.3), not as run artifacts
    assert {f.path for f in client.list_logged_model_artifacts(model_id, "data/final")} >= {
        "data/final/model.safetensors", "data/final/model_card.json"}
    assert [o.model_id for o in client.get_run(run_id).outputs.model_outputs] == [model_id]
    for rank in (0, 1):
        assert json.loads((probe / f"rank{rank}.json").read_text())["heavy"] == [], f"rank {rank} imported heavy modules"
    run = client.get_run(run_id)
    history = client.get_metric_history(run_id, "attempt_queue_wait_s")
    assert {m.step for m in history} == {1, 2} and all(0 <= m.value < 120 for m in history)  # per try, at its first step
    assert {m.step for m in client.get_metric_history(run_id, "attempt_startup_s")} >= {2}
    assert run.data.params["train.max_steps"] == "80" and run.data.tags["gangflow.world_size"] == "2"
    assert run.data.tags["gangflow.gang"] == op.build_spec(context(2), mlflow_run_id=None).name
    assert "test_accuracy" in run.data.metrics and max(m.step for m in client.get_metric_history(run_id, "loss")) == 80
