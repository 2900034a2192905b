"""docs/extending.md, "Bring your own training script", runs: its two files are written into a
folder of their own, the script trains under torchrun on a DVC remote's dataset version, a killed
rank leaves a committed checkpoint the second attempt resumes from, and the evaluation scores the
final model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from doc_commands import PROJECT_ROOT, blocks
from trainer_fixtures import make_dvc_remote


def _write_guide_files(root: Path) -> None:
    for kind, path, body in blocks():
        if kind == "file" and path.startswith("mytrain/"):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(body)
    assert (root / "mytrain" / "train.py").is_file() and (root / "mytrain" / "evaluate.py").is_file()


def test_the_guides_script_trains_resumes_after_a_kill_and_scores(tmp_path):
    _write_guide_files(tmp_path)
    data = tmp_path / "digits"
    subprocess.run([sys.executable, str(PROJECT_ROOT / "data" / "prepare.py"), "--out", str(data),
                    "--params", str(PROJECT_ROOT / "params.yaml")], check=True, timeout=120, capture_output=True)
    version = make_dvc_remote(tmp_path / "remote", {p.name: p.read_bytes() for p in data.iterdir()})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW", "MLFLOW", "RANK", "WORLD_SIZE"))}
    env |= {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(PROJECT_ROOT)]), "OMP_NUM_THREADS": "1",
            "GANGFLOW_ALLOW_FAULTS": "1", "GANGFLOW_FAULT": "kill@step=50,rank=1", "TMPDIR": str(tmp_path)}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
           "-m", "trainer.user", "--run-dir", str(run_dir), "--set", f"data.remote={tmp_path / 'remote'}",
           "--set", f"data.version={version}", "--set", "train.max_steps=100", "--module", "mytrain.train"]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0 and "fires on rank 1 at step 50" in first.stdout + first.stderr, first.stderr[-3000:]
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "gangflow: resuming from checkpoint step-40" in out  # every 20 steps: 40 was the last before the kill
    assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "final" / "model_card.json").is_file()
    score = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from mytrain.evaluate import score; "
                            f"print(score(Path(sys.argv[1]), Path(sys.argv[2]))['accuracy'])", str(run_dir / "final"),
                            str(data / "test.parquet")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert score.returncode == 0 and float(score.stdout) > 0.8, score.stderr
