"""The registered gangflow model, as an MLflow pyfunc logged *from code* (no pickle).

MLflow stores this file beside the model's weights and card and runs it when the model is loaded
(`mlflow.pyfunc.load_model("models:/gangflow-digits@champion")`); the factory the card names must
be allow-listed (trainer.allowlist). Only then does it import mlflow; imported as a module it gives
`load_final_model` and `FEATURE_COLUMNS`. docs/registry.md, "What is registered".
"""

from pathlib import Path
from typing import Any

# The digits pipeline's columns: the default for models registered without a dataset schema.
FEATURE_COLUMNS = [f"pixel_{i:02d}" for i in range(64)]
LABEL_COLUMN = "label"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "model_card.json"


def load_final_model(final_dir: "str | Path", *, allowed_models=None):
    """A `torch.nn.Module` in eval mode from a final dir (`model.safetensors` + `model_card.json`).

    Always through the trainer's guarded loader (`trainer.export.load_final_model`): the card's
    factory must be allow-listed (`gangflow.models` entry points, `allowed_models`,
    `GANGFLOW_ALLOWED_MODELS`) and is refused before any import otherwise. The `trainer`
    package travels with the registered model (`code/trainer/`), so this works where gangflow
    is not installed too.
    """
    final_dir = Path(final_dir)
    if not (final_dir / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {final_dir}")
    from trainer.export import load_final_model as trainer_loader

    return trainer_loader(final_dir, allowed_models=allowed_models).eval()


def card_task(final_dir: "str | Path") -> str:
    """The task the model was trained for (`config.train.task` of its card; classification)."""
    import json

    try:
        card = json.loads((Path(final_dir) / CARD_FILE).read_text())
        task = ((card.get("config") or {}).get("train") or {}).get("task") or "classification"
    except (OSError, ValueError, AttributeError):
        return "classification"
    return task if task in ("classification", "regression") else "classification"


def card_factory(final_dir: "str | Path") -> "str | None":
    """The `module:function` model factory the card names (None when unreadable)."""
    import json

    try:
        factory = json.loads((Path(final_dir) / CARD_FILE).read_text())["model"]["factory"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return factory if isinstance(factory, str) else None


def _listed(columns, limit: int = 6) -> str:
    columns = [str(c) for c in columns]
    more = f", ... ({len(columns)} in all)" if len(columns) > limit else ""
    return "[" + ", ".join(columns[:limit]) + more + "]"


def features(frame, columns=None) -> Any:
    """The float32 [N, F] feature matrix of a DataFrame: `columns` (default the digits'
    FEATURE_COLUMNS) in order; other columns are ignored."""
    import numpy as np

    columns = list(columns or FEATURE_COLUMNS)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        # Accept exactly as many unnamed/other numeric columns, in order.
        cols = [c for c in frame.columns if c != LABEL_COLUMN]
        if len(cols) != len(columns) or all(isinstance(c, str) for c in cols):
            raise ValueError(f"expected columns {_listed(columns)}, got {_listed(frame.columns)}: "
                             f"missing {_listed(missing)}")
        return np.ascontiguousarray(frame[cols].to_numpy(dtype=np.float32, copy=True))
    return np.ascontiguousarray(frame[columns].to_numpy(dtype=np.float32, copy=True))


def build_python_model():
    """The `mlflow.pyfunc.PythonModel` MLflow loads from this file."""
    import mlflow.pyfunc
    import pandas as pd

    class GangflowModel(mlflow.pyfunc.PythonModel):
        """A gangflow model: safetensors weights + model card, rebuilt by its factory."""

        def load_context(self, context):
            final = context.artifacts["final"]
            self.model = load_final_model(final)
            config = getattr(context, "model_config", None) or {}
            self.columns = list(config.get("features") or FEATURE_COLUMNS)
            self.task = config.get("task") or card_task(final)

        # Real (not string) annotations: MLflow reads them to validate the input.
        def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
            import numpy as np
            import torch

            frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
            x = torch.from_numpy(features(frame, self.columns))
            with torch.no_grad():
                outputs = self.model(x)
            if self.task == "regression":
                return pd.DataFrame({"prediction": outputs.reshape(-1).numpy().astype(np.float64)}, index=frame.index)
            probs = torch.softmax(outputs, dim=-1).numpy()
            out = pd.DataFrame({"prediction": probs.argmax(axis=1).astype(np.int64)}, index=frame.index)
            for k in range(probs.shape[1]):
                out[f"prob_{k}"] = probs[:, k].astype(np.float64)
            return out

    return GangflowModel()


if __name__ != "operators.registry.served_model":  # executed by MLflow as the model's code
    import mlflow.models

    mlflow.models.set_model(build_python_model())
