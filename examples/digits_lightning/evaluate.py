"""The digits-lightning pipeline's evaluation: macro-F1 and accuracy of the final CNN on the test split.

`evaluation.entrypoint: digits_lightning.evaluate:score` in the pipeline file; higher is better.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def score(model_folder: str | os.PathLike, test_path: str | os.PathLike) -> dict[str, float]:
    """{"macro_f1", "accuracy", "num_examples"} of the model in `model_folder` (the run's final
    model: model.safetensors beside gangflow's model card) on the parquet split `test_path`."""
    import torch
    from safetensors.torch import load_file
    from sklearn.metrics import accuracy_score, f1_score

    from digits_lightning.model import build, images

    folder = Path(model_folder)
    card = json.loads(next(p for p in (folder / "model_card.json", folder.parent / "model_card.json") if p.is_file()).read_text())
    net = build(**card["model"]["kwargs"])
    net.load_state_dict(load_file(folder / "model.safetensors"))
    x, y = images(test_path)
    with torch.no_grad():
        predicted = net.eval()(x).argmax(dim=1)
    return {"macro_f1": float(f1_score(y, predicted, average="macro")), "accuracy": float(accuracy_score(y, predicted)),
            "num_examples": int(len(y))}
