"""The pipeline's evaluation (`evaluation.entrypoint: digits_cnn.evaluate:score`)."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
from sklearn.metrics import accuracy_score, f1_score

from digits_cnn.model import build, load_split


def score(model_dir: Path, test_path: Path) -> dict[str, float]:
    """Accuracy and macro-F1 of the model in `model_dir` (a run's final/) on the test split."""
    model = build()
    model.load_state_dict(safetensors.torch.load_file(str(Path(model_dir) / "model.safetensors")))
    model.eval()
    x, y = load_split(test_path)
    with torch.no_grad():
        predicted = model(x).argmax(dim=1).numpy()
    return {"accuracy": float(accuracy_score(y.numpy(), predicted)),
            "macro_f1": float(f1_score(y.numpy(), predicted, average="macro")),
            "num_examples": int(len(y))}
