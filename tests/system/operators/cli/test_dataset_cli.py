"""`python -m operators.cli.dataset publish` then `validate --pipeline NAME` on a fresh state dir:
real DVC and the pipeline's Great Expectations suite (issue 23, item 6; the CLI's refusals are
tests/unit/operators/cli/test_dataset_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pipeline_runs import PROJECT_ROOT, pipeline_env


@pytest.mark.slow
def test_validate_runs_the_pipelines_suite_on_the_pinned_version(tmp_path):
    """Not only the hashes (`resolve`): the Great Expectations suite, with its Data Docs."""
    env = pipeline_env(tmp_path / "home")
    published = subprocess.run([sys.executable, "-m", "operators.cli.dataset", "publish", "--pipeline", "diabetes"],
                               cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert published.returncode == 0, published.stderr[-3000:]
    version = published.stdout.strip().splitlines()[-1]
    done = subprocess.run([sys.executable, "-m", "operators.cli.dataset", "validate", "--pipeline", "diabetes"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads(done.stdout)
    assert manifest["version"] == version and manifest["data_docs"] and manifest["rows"]["train"] > 0
