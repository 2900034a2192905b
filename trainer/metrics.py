"""The test metrics of one task, computed the same way by the trainer (rank 0, at the end of a
run) and by the pipeline's evaluate and promote tasks (operators/evaluation.py), so their scores
agree. numpy only, in float64.

    classification: accuracy (argmax of the logits == label)
    regression:     rmse, mae, r2 (the model returns one value per row, in the target's units)
"""

from __future__ import annotations

from typing import Any

import numpy as np

TASKS = ("classification", "regression")
#: The metric each task is gated on unless a pipeline says otherwise, and which way is better.
DEFAULT_METRIC = {"classification": ("accuracy", "higher"), "regression": ("rmse", "lower")}
#: The scalar metrics the pipeline's evaluate task reports per task (operators/evaluation.py):
#: a pipeline may gate on these (or on what its evaluate class adds, `extra_metrics`).
EVALUATED_METRICS = {"classification": ("accuracy", "macro_f1"), "regression": ("mae", "r2", "rmse")}


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"train.task={task!r}: accepted values are {', '.join(TASKS)}")
    return task


def predictions(task: str, outputs: Any) -> np.ndarray:
    """What a model's outputs predict: class ids (classification) or values (regression)."""
    out = np.asarray(outputs, dtype=np.float64)
    if check_task(task) == "classification":
        if out.ndim != 2:
            raise ValueError(f"model output has shape {tuple(out.shape)}; a classifier returns [batch, classes]")
        return out.argmax(axis=1)
    if out.ndim == 2 and out.shape[1] == 1:
        out = out[:, 0]
    if out.ndim != 1:
        raise ValueError(f"model output has shape {tuple(out.shape)}; a regressor returns [batch] or [batch, 1]")
    return out


def regression_metrics(y_true: Any, y_pred: Any) -> dict[str, float]:
    y_true = np.asarray(y_true, dtype=np.float64).ravel()
    y_pred = np.asarray(y_pred, dtype=np.float64).ravel()
    if y_true.shape != y_pred.shape:
        raise ValueError(f"{len(y_true)} targets but {len(y_pred)} predictions")
    if len(y_true) == 0:
        raise ValueError("cannot evaluate on an empty test set")
    err = y_pred - y_true
    var = float(((y_true - y_true.mean()) ** 2).sum())
    return {"rmse": float(np.sqrt(np.mean(err**2))), "mae": float(np.mean(np.abs(err))),
            "r2": float(1.0 - (err**2).sum() / var) if var > 0 else 0.0}


def score(task: str, outputs: Any, y_true: Any) -> dict[str, float]:
    """The task's headline metrics of a model's outputs on (x, y_true)."""
    pred = predictions(task, outputs)
    if task == "classification":
        y = np.asarray(y_true).astype(np.int64).ravel()
        return {"accuracy": float((pred == y).mean()) if len(y) else 0.0}
    return regression_metrics(y_true, pred)
