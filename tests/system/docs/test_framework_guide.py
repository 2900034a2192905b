"""docs/extending.md, "Hugging Face Trainer" and "Lightning", run: each file is written into a
folder of its own and trained under torchrun (2 ranks, gloo) on a DVC remote's dataset version; a
rank killed after a committed checkpoint leaves it for the second attempt, which resumes the
framework from it and logs the final model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from doc_commands import PROJECT_ROOT, blocks
from trainer_fixtures import make_dvc_remote

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (extra `frameworks`): not installed")

# (package, dataset builder, steps, kill step, the checkpoint the kill leaves last)
GUIDES = {
    # save_steps=20: step-20 is committed before the kill at step 30
    "myhf": (["data/prepare_corpus.py"], 40, 30, 20),
    # 1347 rows, 64 per rank and step on 2 ranks: 11 steps an epoch (3 epochs), committed at 11 and 22
    "mylightning": (["data/prepare.py", "--params", str(PROJECT_ROOT / "params.yaml")], 30, 25, 22),
}


@pytest.mark.parametrize("package", sorted(GUIDES))
def test_the_guides_framework_script_resumes_after_a_kill(package, tmp_path):
    prepare, steps, kill, resumed = GUIDES[package]
    for kind, path, body in blocks():
        if kind == "file" and path.startswith(f"{package}/"):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(body)
    assert (tmp_path / package / "train.py").is_file()
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(PROJECT_ROOT / prepare[0]), *prepare[1:], "--out", str(data)], check=True,
                   timeout=120, capture_output=True)
    version = make_dvc_remote(tmp_path / "remote", {p.name: p.read_bytes() for p in data.iterdir()})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANGFLOW", "MLFLOW", "RANK", "WORLD_SIZE", "HF_"))}
    env |= {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(PROJECT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "OMP_NUM_THREADS": "1", "GANGFLOW_ALLOW_FAULTS": "1", "GANGFLOW_FAULT": f"kill@step={kill},rank=1",
            "TMPDIR": str(tmp_path)}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
           "-m", "trainer.user", "--run-dir", str(run_dir), "--set", f"data.remote={tmp_path / 'remote'}",
           "--set", f"data.version={version}", "--set", f"train.max_steps={steps}", "--module", f"{package}.train"]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0 and f"fires on rank 1 at step {kill}" in first.stdout + first.stderr, first.stderr[-3000:]
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert f"gangflow: resuming from checkpoint step-{resumed}" in out
    assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "final" / "model_card.json").is_file()
    assert any('"loss"' in line and '"event"' not in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())
