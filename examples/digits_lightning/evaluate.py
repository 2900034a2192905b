"""The digits-lightning pipeline's evaluation: macro-F1 and accuracy of the final CNN on the test split.

`evaluation.entrypoint: digits_lightning.evaluate:score` in the pipeline file; higher is better.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def score(model_folder: str | os.PathLike, test_path: str | os.PathLike) -> dict[str, float]:
    """{"macro_f1", "accuracy"} of the model in `model_folder` on the parquet split `test_path`."""
    import torch
    from safetensors.torch import load_file
    from sklearn.metrics import accuracy_score, f1_score

    from digits_lightning.train import build_network, images

    folder = Path(model_folder)
    net = build_network(**json.loads((folder / "digits_lightning.json").read_text()))
    net.load_state_dict(load_file(folder / "model.safetensors"))
    x, y = images(test_path)
    with torch.no_grad():
        predicted = net.eval()(x).argmax(dim=1)
    return {"macro_f1": float(f1_score(y, predicted, average="macro")), "accuracy": float(accuracy_score(y, predicted))}
