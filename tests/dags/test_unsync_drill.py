"""The DAG-level unsynchronised drill (issue 11.1, contract 3): a rank killed with no barrier and
no drain, retried by Airflow (dag.test(), the classified retry policy), resumes and succeeds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from pipeline_runs import FAST, PROJECT_ROOT, pipeline_env, run_pipeline


def _weights(home: Path, dag_run_id: str) -> dict:
    code = ("from operators import embedded, settings\nembedded.apply()\n"
            f"print(settings.run_dir('train_pipeline', {dag_run_id!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=pipeline_env(home), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    final = Path(done.stdout.strip().splitlines()[-1]) / "final" / "model.safetensors"
    return {k: v.tobytes() for k, v in load_file(final).items()}


@pytest.mark.slow
def test_kill_at_save_on_rank_1_is_retried_once_resumes_and_matches(baseline, pipeline_home, tmp_path):
    """kill@save=2,rank=1 (UNSYNCHRONISED): rank 1 is SIGKILLed when it hands checkpoint step-20 to
    rank 0, while rank 0 writes it; nobody waits or meets at a barrier. Airflow retries the task
    once (infra failure); the retry resumes from the last committed checkpoint (step-10, or step-20
    if rank 0's write committed before torchrun tore it down), loses <= 2 checkpoint intervals, and
    ends bitwise equal to the uninterrupted baseline."""
    every = FAST["checkpoint_every_steps"]
    summary, output, code = run_pipeline(pipeline_home, FAST, tmp_path / "run.log", GANGFLOW_FAULT="kill@save=2,rank=1")
    assert code == 0, output[-6000:]
    assert summary["train_attempts"] == 2, summary
    assert "kill@save=2,rank=1 fires on rank 1 at step 20 (checkpoint step-20 in flight)" in output, output[-6000:]
    assert "infra failure" in output
    resumed = re.search(r"resumed from checkpoint step (\d+)", output)
    assert resumed, output[-6000:]
    assert int(resumed.group(1)) in (every, 2 * every) and 20 - int(resumed.group(1)) <= 2 * every
    assert _weights(pipeline_home, summary["dag_run_id"]) == _weights(pipeline_home, baseline["summary"]["dag_run_id"])
