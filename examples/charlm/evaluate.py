"""The charlm pipeline's evaluation: perplexity of the final model on the corpus' test split.

`evaluation.entrypoint: charlm.evaluate:score` in pipelines/charlm.yaml; lower is better.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def score(model_folder: str | os.PathLike, test_path: str | os.PathLike) -> dict[str, float]:
    """{"perplexity", "loss" (mean token cross-entropy, nats), "num_examples" (tokens predicted)} over the test files."""
    import pandas as pd
    import torch
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    from charlm.train import blocks

    folder = Path(model_folder)
    block = json.loads((folder / "charlm.json").read_text())["block"]
    # GPT-2's own class and local files only: the folder's config cannot name other code to run.
    model = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    data = blocks(tokenizer, list(pd.read_parquet(test_path)["text"]), block)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.split(32):
            logits = model(input_ids=batch).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1),
                                                     reduction="sum")
            total, count = total + float(loss), count + batch[:, 1:].numel()
    mean = total / count
    return {"perplexity": math.exp(mean), "loss": mean, "num_examples": count}  # examples: predicted tokens
