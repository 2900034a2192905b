"""The registered gangflow model, as an MLflow pyfunc logged *from code* (no pickle).

MLflow stores this file next to the model's artifacts (`artifacts/final/model.safetensors` and
`artifacts/final/model_card.json`) and executes it when the model is loaded, e.g.

    import mlflow, pandas as pd
    model = mlflow.pyfunc.load_model("models:/gangflow-digits@champion")
    model.predict(pd.read_parquet("data/digits/test.parquet").head())
    #    prediction  prob_0 ... prob_9

The input is a DataFrame with the 64 feature columns `pixel_00`..`pixel_63` (other columns,
such as `label`, are ignored); the output has the predicted class in `prediction` and the
softmax probabilities in `prob_<k>`.

Loading needs torch, safetensors and the model factory named in the model card (the `gangflow`
package for the default `trainer.models:mlp`). Weights are read with safetensors and the module
is rebuilt by calling the factory, so nothing is unpickled.

This module is also importable as `operators.model_pyfunc` (for `load_final_model` and
`FEATURE_COLUMNS`); only when MLflow executes the file as model code does it import mlflow and
call `mlflow.models.set_model`. It never imports Airflow.
"""

import importlib
import json
from pathlib import Path
from typing import Any

FEATURE_COLUMNS = [f"pixel_{i:02d}" for i in range(64)]
LABEL_COLUMN = "label"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "model_card.json"


def _factory_from_card(card: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(`module:function`, kwargs) of the model factory recorded in a model card.

    Accepts the layouts a model card may use: `{"model": {"factory": ..., <kwargs>}}`,
    `{"config": {"model": {...}}}`, `{"model_factory": ..., "model_kwargs": {...}}`.
    """
    candidates: list[dict[str, Any]] = []
    for key in ("model", "config", "resolved_config"):
        section = card.get(key)
        if isinstance(section, dict):
            candidates.append(section)
            if isinstance(section.get("model"), dict):
                candidates.append(section["model"])
    for section in candidates:
        factory = section.get("factory")
        if isinstance(factory, str) and ":" in factory:
            kwargs = section.get("kwargs")
            if not isinstance(kwargs, dict):
                kwargs = {k: v for k, v in section.items() if k not in ("factory", "kwargs")}
            return factory, dict(kwargs)
    if isinstance(card.get("model_factory"), str):
        return card["model_factory"], dict(card.get("model_kwargs") or {})
    raise ValueError(f"model card names no model factory (looked for model.factory); keys: {sorted(card)}")


def _build_from_card(final_dir: Path):
    """Rebuild the module from the card's factory and load the safetensors state_dict."""
    from safetensors.torch import load_file

    card = json.loads((final_dir / CARD_FILE).read_text())
    factory, kwargs = _factory_from_card(card)
    module_name, _, func_name = factory.partition(":")
    fn = getattr(importlib.import_module(module_name), func_name)
    model = fn(**kwargs)
    model.load_state_dict(load_file(str(final_dir / WEIGHTS_FILE)))
    return model.eval()


def load_final_model(final_dir: "str | Path"):
    """A `torch.nn.Module` in eval mode from a final dir (`model.safetensors` + `model_card.json`).

    Uses the trainer's own loader (`trainer.export.load_final_model`) when the trainer package
    is installed, else rebuilds the module from the factory named in the model card.
    """
    final_dir = Path(final_dir)
    if not (final_dir / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {final_dir}")
    try:
        from trainer.export import load_final_model as trainer_loader
    except ImportError:
        trainer_loader = None
    if trainer_loader is not None:
        return trainer_loader(final_dir).eval()
    return _build_from_card(final_dir)


def features(frame) -> Any:
    """The float32 [N, 64] feature matrix of a DataFrame (feature columns in order)."""
    import numpy as np

    missing = [c for c in FEATURE_COLUMNS if c not in frame.columns]
    if missing:
        # Accept exactly 64 unnamed/other numeric columns, in order.
        cols = [c for c in frame.columns if c != LABEL_COLUMN]
        if len(cols) != len(FEATURE_COLUMNS):
            raise ValueError(f"input lacks feature columns {missing[:3]}... and has {len(cols)} columns, not 64")
        return np.ascontiguousarray(frame[cols].to_numpy(dtype=np.float32, copy=True))
    return np.ascontiguousarray(frame[FEATURE_COLUMNS].to_numpy(dtype=np.float32, copy=True))


def build_python_model():
    """The `mlflow.pyfunc.PythonModel` MLflow loads from this file."""
    import mlflow.pyfunc
    import pandas as pd

    class GangflowClassifier(mlflow.pyfunc.PythonModel):
        """Digits classifier: safetensors weights + model card, rebuilt by its factory."""

        def load_context(self, context):
            self.model = load_final_model(context.artifacts["final"])

        # Real (not string) annotations: MLflow reads them to validate the input.
        def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
            import numpy as np
            import torch

            frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
            x = torch.from_numpy(features(frame))
            with torch.no_grad():
                probs = torch.softmax(self.model(x), dim=-1).numpy()
            out = pd.DataFrame({"prediction": probs.argmax(axis=1).astype(np.int64)}, index=frame.index)
            for k in range(probs.shape[1]):
                out[f"prob_{k}"] = probs[:, k].astype(np.float64)
            return out

    return GangflowClassifier()


if __name__ != "operators.model_pyfunc":  # executed by MLflow as the model's code
    import mlflow.models

    mlflow.models.set_model(build_python_model())
