"""The served gangflow model: the loader MLflow calls for every version gangflow logs
(`loader_module: operators.registry.served_model` in its MLmodel), installed with gangflow and never
taken from the version's artifacts, and `load_model`, the safe way to load a registered version.

A version's files are data: its platform signature (operators.registry.signing) is verified before
anything of it is imported. docs/registry.md, "What is registered, and how to load it".
"""

from pathlib import Path
from typing import Any

from operators.registry.signing import UnsignedModel, verify_model_dir
from trainer.model_card import CARD, FINAL, WEIGHTS, card_task, read_card

__all__ = ["UnsignedModel", "ServedModel", "load_model", "load_final_model", "LOADER_MODULE"]

#: The MLmodel `loader_module` of every version gangflow logs: this installed module.
LOADER_MODULE = "operators.registry.served_model"
# The digits pipeline's columns: the default for models registered without a dataset schema.
FEATURE_COLUMNS = [f"pixel_{i:02d}" for i in range(64)]
LABEL_COLUMN = "label"
WEIGHTS_FILE, CARD_FILE, FINAL_DIR = WEIGHTS, CARD, FINAL  # the names this module has always used
#: Where a logged model keeps `final/` (MLflow's pyfunc `data`), relative to its root.
MODEL_FINAL_PATH = "data/final"


def load_final_model(final_dir: "str | Path", *, allowed_models=None):
    """A `torch.nn.Module` in eval mode from a final dir (`model.safetensors` + `model_card.json`).

    Always through the trainer's guarded loader (`trainer.export.load_final_model`): the card's
    factory must be allow-listed (`gangflow.models` entry points, `allowed_models`,
    `GANGFLOW_ALLOWED_MODELS`) and is refused before any import otherwise.
    """
    final_dir = Path(final_dir)
    if not (final_dir / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {final_dir}")
    from trainer.export import load_final_model as trainer_loader

    return trainer_loader(final_dir, allowed_models=allowed_models).eval()


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




class GangflowModel:
    """A gangflow model as MLflow's pyfunc serves it: safetensors weights + card, rebuilt by its factory."""

    def __init__(self, final_dir: Path, model_config: "dict[str, Any] | None" = None, allowed_models=None):
        config = model_config or {}
        self.model = load_final_model(final_dir, allowed_models=allowed_models)
        self.columns = list(config.get("features") or FEATURE_COLUMNS)
        self.task = config.get("task") or card_task(read_card(final_dir))

    def predict(self, model_input, params=None):
        import numpy as np
        import pandas as pd
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


def _load_pyfunc(data_path: str, model_config: "dict[str, Any] | None" = None) -> GangflowModel:
    """MLflow's entry into a version gangflow logged (`data: final`): its signature is verified
    before the card's factory is imported; the factory it signed needs no allow-list setting here."""
    final_dir = Path(data_path)
    record = verify_model_dir(final_dir.parents[len(Path(MODEL_FINAL_PATH).parts) - 1])
    return GangflowModel(final_dir, model_config, allowed_models=[record["factory"]] if record.get("factory") else None)


def check_mlmodel(model_dir: "str | Path") -> None:
    """Refuse (UnsignedModel) a downloaded model whose MLmodel names a loader other than this
    installed module, or that is not signed by this platform, before MLflow reads it."""
    import yaml

    model_dir = Path(model_dir)
    try:
        mlmodel = yaml.safe_load((model_dir / "MLmodel").read_text()) or {}
        pyfunc = (mlmodel.get("flavors") or {}).get("python_function") or {}
    except (OSError, ValueError, AttributeError) as exc:
        raise UnsignedModel(f"{model_dir}: no readable MLmodel ({exc}); nothing was loaded") from None
    verify_model_dir(model_dir)  # first: an unsigned version is refused whatever its MLmodel says
    if pyfunc.get("loader_module") != LOADER_MODULE or pyfunc.get("python_model") or pyfunc.get("data") != MODEL_FINAL_PATH:
        raise UnsignedModel(f"{model_dir}: its MLmodel loads through {pyfunc.get('loader_module')!r}, not "
                            f"{LOADER_MODULE!r}; nothing was loaded")


def load_model(model_uri: str, *, tracking_uri: "str | None" = None) -> "ServedModel":
    """The `mlflow.pyfunc.PyFuncModel` (in a `ServedModel`) of a version gangflow registered (`models:/gangflow-digits@champion`,
    `models:/<name>/<version>`, `models:/<model_id>`), loaded only after its source is found inside the
    registry's artifact root, its size within `GANGFLOW_MAX_MODEL_BYTES`, its signature valid and its
    loader this installed module: a planted or altered version runs nothing."""
    import tempfile

    import mlflow.pyfunc

    from operators.hooks.mlflow import get_client
    from operators.registry.versions import download_source, resolve_model_source

    client = get_client(tracking_uri)
    source = resolve_model_source(client, model_uri)
    with tempfile.TemporaryDirectory(prefix="gangflow-serve-") as tmp:
        local = download_source(client, source, tmp, what=model_uri)
        check_mlmodel(local)
        return ServedModel(mlflow.pyfunc.load_model(str(local)))


class ServedModel:
    """A loaded version: MLflow's pyfunc, whose `predict` first narrows float columns to the
    signature's `float` (float32, what the model computes in), so float64 frames are accepted."""

    def __init__(self, pyfunc):
        self.pyfunc = pyfunc
        self.metadata = pyfunc.metadata
        inputs = pyfunc.metadata.get_input_schema()
        self._float32 = [s.name for s in (inputs.inputs if inputs else []) if getattr(s.type, "name", "") == "float"]

    def predict(self, model_input, params=None):
        import numpy as np
        import pandas as pd

        if isinstance(model_input, pd.DataFrame) and self._float32:
            cast = {c: np.float32 for c in self._float32
                    if c in model_input.columns and pd.api.types.is_float_dtype(model_input[c])}
            model_input = model_input.astype(cast) if cast else model_input
        return self.pyfunc.predict(model_input, params=params)
