"""docs/extending.md runs: its `file=` blocks are written into a clone of the repository and the
third pipeline they add is built by real DVC, validated by real Great Expectations, parsed into
a DAG by the factory, trained by the real trainer and scored by the evaluate code, whose score
must equal the trainer's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import PROJECT_ROOT, blocks

BIN = Path(sys.executable).parent


def _env(clone: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW", "MLFLOW", "AIRFLOW", "DVC"))}
    env |= {"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "GANGFLOW_PROJECT": str(clone),
            "GANGFLOW_HOME": str(clone / ".gangflow"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return env | extra


def _run(args: list[str], clone: Path, timeout: float = 300, **env: str) -> str:
    done = subprocess.run(args, cwd=clone, env=_env(clone, **env), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_guide_adds_a_third_pipeline_that_validates_trains_and_scores(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(PROJECT_ROOT), str(clone)], check=True, timeout=120)
    for kind, path, body in blocks():
        target = clone / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "append":
            target.write_text(target.read_text() + body)
        else:
            target.write_text(body)

    # 1. The data stage, with real DVC and the project's interpreter first on PATH (`make data`).
    _run([str(BIN / "dvc"), "repro", "prepare_wine"], clone)
    from operators.hooks.dvc import pinned_version

    version = pinned_version(clone, "data/wine")
    assert re.fullmatch(r"[0-9a-f]{32}", version)

    # 2. The suite passes the data the stage wrote.
    import pandas as pd

    from operators.validation import load_suite_factory, run_expectations

    frames = {s: pd.read_parquet(clone / "data" / "wine" / f"{s}.parquet") for s in ("train", "test")}
    report = run_expectations(frames, load_suite_factory("data.wine_expectations:wine_suite", clone))
    assert report.success, report.describe(version, dataset="data/wine")

    # 3. The factory builds its DAG from the file alone.
    code = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(clone / 'dags')!r})\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "dag = bag.dags['train_wine']\n"
        "print(json.dumps({'dags': sorted(bag.dags), 'version': dag.params['dataset_version'],\n"
        "  'floor': dag.params['promotion_floor'], 'model': dag.get_task('promote').model_name}))"
    )
    shape = json.loads(_run([sys.executable, "-c", code], clone).strip().splitlines()[-1])
    assert {"train_wine", "publish_wine", "train_pipeline", "train_diabetes"} <= set(shape["dags"])
    assert (shape["version"], shape["floor"], shape["model"]) == (version, 0.8, "gangflow-wine")

    # 4. The trainer trains the user's model; evaluate's score equals the trainer's.
    run_dir = tmp_path / "run"
    allowed = "mymodels.wine:standardized_mlp"
    _run([sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--config", "pipelines/trainer/wine.yaml"], clone,
         GANGFLOW_ALLOWED_MODELS=allowed)  # fmt: skip
    card = json.loads((run_dir / "final" / "model_card.json").read_text())
    assert len(card["model"]["kwargs"]["feature_mean"]) == 13  # the training split's, recorded
    score = (
        "import json, sys\n"
        "from operators.evaluation import evaluate_final_dir\n"
        "m = evaluate_final_dir(sys.argv[1], sys.argv[2], allowed_models=[sys.argv[3]])\n"
        "print(json.dumps(m['accuracy']))"
    )
    accuracy = json.loads(_run([sys.executable, "-c", score, str(run_dir / "final"), "data/wine/test.parquet", allowed],
                               clone).strip().splitlines()[-1])  # fmt: skip
    assert accuracy == pytest.approx(card["metrics"]["test_accuracy"], rel=1e-9)
    assert accuracy >= 0.8  # the gate's floor in the guide's pipeline file
