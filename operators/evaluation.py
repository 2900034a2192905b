"""Evaluation of a trained model on the held-out test split, and the Airflow task that does it.

The pure part (`evaluate`, `evaluate_final_dir`, `confusion_matrix_png`) knows nothing of Airflow or
MLflow (promote reuses it to score the champion); `EvaluateModelOperator` logs the metrics, a
per-class report and a confusion matrix to the DAG run's MLflow run. torch, mlflow and matplotlib
are imported inside functions: Airflow parses the DAG files that import this module.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator

from operators.exceptions import GangflowError, UserError
from trainer.model_card import card_task, read_card
from trainer.urls import redact_url

if TYPE_CHECKING:
    import numpy as np
    import torch

    from airflow.sdk import Context

log = logging.getLogger(__name__)

METRICS_ARTIFACT = "evaluation/metrics.json"
CONFUSION_ARTIFACT = "evaluation/confusion_matrix.png"
TAG_TEST_MD5 = "gangflow.test_data_md5"


# --------------------------------------------------------------------------- pure functions


def _as_numpy(a: Any) -> np.ndarray:
    import numpy as np

    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def predict_classes(model: torch.nn.Module, x: Any, *, batch_size: int = 1024) -> tuple[np.ndarray, int]:
    """Class predictions (argmax of the logits) for `x` and the model's number of outputs."""
    import numpy as np
    import torch

    xs = torch.as_tensor(_as_numpy(x), dtype=torch.float32)
    model.eval()
    preds: list[np.ndarray] = []
    width = 0
    with torch.no_grad():
        for start in range(0, len(xs), batch_size):
            logits = model(xs[start : start + batch_size])
            if logits.ndim != 2:
                raise ValueError(f"model output has shape {tuple(logits.shape)}; expected [batch, classes]")
            width = int(logits.shape[1])
            preds.append(logits.argmax(dim=1).cpu().numpy())
    return (np.concatenate(preds) if preds else np.zeros(0, dtype=np.int64)), width


def classification_metrics(y_true: Any, y_pred: Any, num_classes: int) -> dict[str, Any]:
    """Accuracy, macro-F1, per-class precision/recall/F1/support and the confusion matrix.

    Rows of the confusion matrix are true classes, columns predicted classes. A class that is
    never predicted has precision 0; never present, recall 0; F1 is 0 when precision+recall is
    0 (scikit-learn's `zero_division=0`). Macro-F1 averages over all `num_classes` classes.
    Every value is a plain int/float/str/list/dict, so the result is XCom/JSON-serialisable.
    """
    import numpy as np

    y_true = _as_numpy(y_true).astype(np.int64).ravel()
    y_pred = _as_numpy(y_pred).astype(np.int64).ravel()
    if y_true.shape != y_pred.shape:
        raise ValueError(f"{len(y_true)} labels but {len(y_pred)} predictions")
    if len(y_true) == 0:
        raise ValueError("cannot evaluate on an empty test set")
    bad = (y_true < 0) | (y_true >= num_classes)
    if bad.any():
        raise ValueError(f"labels outside [0, {num_classes}): {sorted(set(y_true[bad].tolist()))[:5]}")
    cm = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(cm, (y_true, np.clip(y_pred, 0, num_classes - 1)), 1)
    tp = np.diag(cm).astype(float)
    predicted = cm.sum(axis=0).astype(float)
    support = cm.sum(axis=1)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support.astype(float), out=np.zeros_like(tp), where=support > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    per_class = {
        str(k): {
            "precision": float(precision[k]),
            "recall": float(recall[k]),
            "f1": float(f1[k]),
            "support": int(support[k]),
        }
        for k in range(num_classes)
    }
    return {
        "accuracy": float((y_true == y_pred).mean()),
        "macro_f1": float(f1.mean()),
        "num_examples": int(len(y_true)),
        "num_classes": int(num_classes),
        "per_class": per_class,
        "confusion_matrix": cm.tolist(),
    }


def model_outputs(model: torch.nn.Module, x: Any, *, batch_size: int = 1024) -> np.ndarray:
    """The model's raw outputs for `x` (float64 numpy), in batches of `batch_size` as the trainer's
    own evaluation runs them."""
    import numpy as np
    import torch

    xs = torch.as_tensor(_as_numpy(x), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        outs = [model(xs[i : i + batch_size]).cpu().numpy() for i in range(0, len(xs), batch_size)]
    return np.concatenate(outs).astype(np.float64) if outs else np.zeros(0)


def regression_metrics(model: torch.nn.Module, x: Any, y: Any) -> dict[str, Any]:
    """RMSE, MAE and R^2 of a regressor on (x, y): `trainer.metrics.score`, the function the
    trainer reports its own test metrics with, so both scores agree."""
    from trainer.metrics import score

    y_np = _as_numpy(y)
    return {**score("regression", model_outputs(model, x), y_np), "num_examples": int(len(y_np)), "task": "regression"}


def evaluate(
    model: torch.nn.Module, x: Any, y: Any, num_classes: int | None = None, *, task: str = "classification"
) -> dict[str, Any]:
    """Evaluate a model on (x, y): a classifier (see `classification_metrics` for the returned
    dict) or, with `task="regression"`, a regressor (`regression_metrics`).

    `x` is float [N, features], `y` int [N] class ids or float [N] targets (numpy arrays or
    tensors). `num_classes` defaults to the model's number of outputs (or the largest label + 1,
    if larger).
    """
    if task == "regression":
        return regression_metrics(model, x, y)
    if task != "classification":
        raise ValueError(f"task={task!r}: accepted values are classification, regression")
    y_np = _as_numpy(y)
    preds, width = predict_classes(model, x)
    if num_classes is None:
        num_classes = max(width, int(y_np.max()) + 1 if len(y_np) else 0)
    return classification_metrics(y_np, preds, int(num_classes))


DEFAULT_DATA_FACTORY = "trainer.data:parquet_dataset"


def load_test_arrays(path: str | Path, data_factory: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(x float32 [N, F], y [N]) from a Parquet file at any path (DVC cache objects have no
    suffix). Uses the trainer's reader when installed, so both sides read data the same way;
    with `data_factory` (the pipeline's trainer config's `data.factory`, `module:function`), the
    test split goes through that factory exactly as the trainer's own evaluation reads it."""
    if data_factory and data_factory != DEFAULT_DATA_FACTORY:
        return _arrays_from_factory(data_factory, path)
    try:
        from trainer.data import load_arrays
    except ImportError:
        load_arrays = None
    if load_arrays is not None:
        return load_arrays(str(path))
    import numpy as np
    import pandas as pd

    from operators.registry.served_model import LABEL_COLUMN, features

    frame = pd.read_parquet(path)
    y = frame[LABEL_COLUMN].to_numpy()
    y = y.astype(np.float32 if np.issubdtype(y.dtype, np.floating) else np.int64)
    return features(frame, [c for c in frame.columns if c != LABEL_COLUMN]), y


def _arrays_from_factory(data_factory: str, path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    from trainer.config import resolve_factory

    dataset = resolve_factory(data_factory, "data.factory")(str(path))
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        raise ValueError(f"data.factory={data_factory!r} gave no rows for {path}")
    x = np.stack([_as_numpy(a).astype(np.float32).ravel() for a, _ in items])
    y = np.asarray([_as_numpy(b) for _, b in items]).ravel()
    return x, y.astype(np.float32 if np.issubdtype(y.dtype, np.floating) else np.int64)


def load_final_model(final_dir: str | Path, *, allowed_models: Sequence[str] | str | None = None) -> torch.nn.Module:
    """The model saved in a run's `final/` dir (safetensors + model card), in eval mode; the
    card's factory must be allow-listed (`trainer.allowlist`), else `ModelNotAllowed`."""
    from operators.registry.served_model import load_final_model as _load

    return _load(final_dir, allowed_models=allowed_models)


def evaluate_final_dir(
    final_dir: str | Path,
    test_path: str | Path,
    num_classes: int | None = None,
    *,
    allowed_models: Sequence[str] | str | None = None,
    data_factory: str | None = None,
) -> dict[str, Any]:
    """Evaluate the weights in `final_dir` on the Parquet test split at `test_path` (read through
    `data_factory` when given, see `load_test_arrays`).

    The result also names the test file and its md5, so a later comparison can check that two
    scores come from the same split.
    """
    from trainer.datastore import file_md5  # as DVC computes it: the test split's identity in tags

    model = load_final_model(final_dir, allowed_models=allowed_models)
    x, y = load_test_arrays(test_path, data_factory)
    metrics = evaluate(model, x, y, num_classes, task=card_task(read_card(final_dir)))
    metrics["test_path"] = str(test_path)
    metrics["test_md5"] = file_md5(test_path)
    return metrics


def score_with_entrypoint(entrypoint: str, model_dir: str | Path, test_path: str | Path) -> dict[str, Any]:
    """The pipeline's `evaluation.entrypoint` (`module:function`, named by the pipeline file) called
    with the model folder (a run's `final/`) and the test split's local path; its metrics, a
    mapping of names to finite numbers (other JSON values are kept in the report)."""
    import importlib

    module_name, _, func_name = str(entrypoint).partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"evaluation.entrypoint={entrypoint!r} cannot be imported here ({type(exc).__name__}: {exc}); "
                        "is its package on the path (the pipeline's package_roots)?") from None
    try:
        metrics = func(Path(model_dir), Path(test_path))
    except GangflowError:
        raise
    except Exception as exc:  # the user's evaluation code failed: retrying will not help
        raise UserError(f"evaluation.entrypoint={entrypoint!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(metrics, Mapping) or not metrics or not all(isinstance(k, str) for k in metrics):
        raise UserError(f"evaluation.entrypoint={entrypoint!r} returned {type(metrics).__name__}: it must return a "
                        "mapping of metric names to numbers")
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise UserError(f"evaluation.entrypoint={entrypoint!r} returned non-finite {', '.join(sorted(bad))}")
    return dict(metrics)


def manifest_of(dataset: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """The validated-dataset manifest (a dict, or its JSON as a rendered template gives it)."""
    if isinstance(dataset, str):
        try:
            dataset = json.loads(dataset)
        except ValueError:
            raise UserError(f"dataset={dataset[:80]!r}: expected the validate task's manifest (a JSON object)") from None
    if not isinstance(dataset, Mapping):
        raise UserError(f"dataset={dataset!r}: expected the validate task's manifest (keys version, test_md5)")
    for key in ("version", "test_md5"):
        if not dataset.get(key):
            raise UserError(f"dataset manifest lacks {key!r} (keys: {sorted(dataset)}): pass the validate task's output")
    return dict(dataset)


def fetch_test_split(dataset: Mapping[str, Any] | str, scratch: str | Path, *, remote: str | None = None) -> Path:
    """The test split of the manifest's dataset version, by content address, md5-verified.

    Read from this worker's DVC cache when it holds the object (the validate task ran here),
    else fetched from the DVC remote (`trainer.datastore`, as the ranks fetch their data) into
    `scratch`. Either way its md5 must equal the manifest's `test_md5` (`DatasetHashMismatch`
    otherwise): a score is only comparable on the very bytes that were validated.
    """
    from operators.exceptions import DatasetHashMismatch, StorageUnavailable
    from trainer.datastore import file_md5

    manifest = manifest_of(dataset)
    version, expected = str(manifest["version"]), str(manifest["test_md5"])
    cached = manifest.get("test_path")
    if cached and Path(str(cached)).is_file():
        path = Path(str(cached))
    else:
        from trainer.failure_catalogue import transient_exception
        from trainer.datastore import fetch_dataset

        if remote is None:
            from operators.hooks.dvc import remote_url

            remote = remote_url()
        try:
            path = fetch_dataset(remote, version, Path(scratch), relpaths=("test.parquet",))["test.parquet"]
        except Exception as exc:  # DataError: missing or corrupt objects; OSError: the remote
            why = transient_exception(exc)
            if why or (isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)):
                raise StorageUnavailable(redact_url(f"fetching test.parquet of dataset version {version} from {remote} "
                                                    f"failed: {type(exc).__name__}: {exc}")) from exc
            raise UserError(redact_url(f"cannot fetch test.parquet of dataset version {version} from {remote}: "
                                       f"{type(exc).__name__}: {exc}")) from exc
    actual = file_md5(path)
    if actual != expected:
        raise DatasetHashMismatch(
            f"test split of dataset version {version}: md5 {actual}, but the validated manifest says "
            f"test_md5 {expected}; refusing to score a model on other data"
        )
    return path


def confusion_matrix_png(cm: Sequence[Sequence[int]], path: str | Path, *, title: str = "Confusion matrix") -> Path:
    """Write the confusion matrix (rows: true class, columns: predicted) as a PNG at `path`."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    matrix = np.asarray(cm)
    n = matrix.shape[0]
    size = max(4.0, 0.5 * n + 2)
    fig = Figure(figsize=(size, size), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set(xticks=range(n), yticks=range(n), xlabel="predicted class", ylabel="true class", title=title)
    threshold = matrix.max() / 2 if matrix.size else 0
    for i in range(n):
        for j in range(n):
            ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=8,
                    color="white" if matrix[i, j] > threshold else "black")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def flat_metrics(metrics: dict[str, Any], prefix: str = "test_") -> dict[str, float]:
    """The scalar MLflow metrics of an evaluation: `test_accuracy`, `test_macro_f1`,
    `test_precision_class_K`, `test_recall_class_K`, `test_f1_class_K` (a classifier);
    `test_rmse`, `test_mae`, `test_r2` (a regressor)."""
    out = {f"{prefix}{k}": metrics[k] for k in ("accuracy", "macro_f1", "rmse", "mae", "r2") if k in metrics}
    for k, row in metrics.get("per_class", {}).items():
        for name in ("precision", "recall", "f1"):
            out[f"{prefix}{name}_class_{k}"] = row[name]
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and math.isfinite(v)}


# --------------------------------------------------------------------------- operator


class EvaluateModelOperator(BaseOperator):
    """Evaluate a training run's final weights on the test split and log the result to MLflow.

    Downloads the model from MLflow (`model_uri`, `models:/<model_id>` as the training task
    returns it: only its `model.safetensors` + `model_card.json`; the card's factory must be allow-listed),
    gets the test split of the dataset version the run trained on by content address
    (`fetch_test_split`: md5-checked against the manifest's `test_md5`), evaluates, and, when
    `mlflow_run_id` is set, logs to that run:

    * metrics `test_accuracy`, `test_macro_f1`, `test_{precision,recall,f1}_class_<k>`;
    * the artifact `evaluation/metrics.json` (everything below, per-class support included);
    * the artifact `evaluation/confusion_matrix.png`;
    * the tag `gangflow.test_data_md5` (md5 of the test file).

    Returns (XCom) the metrics dict: `accuracy`, `macro_f1`, `num_examples`, `num_classes`,
    `per_class` {"<k>": {precision, recall, f1, support}}, `confusion_matrix` (list of lists),
    `test_md5`, `dataset_version`, `model_uri` (no worker paths).

    :param model_uri: the model the training task logged (templated), `models:/<model_id>`.
    :param dataset: the validate task's manifest (an XComArg or dict; templated): its `version`,
        `test_md5` (and, when this worker has it, `test_path` in the DVC cache).
    :param mlflow_run_id: MLflow run to log into (templated); empty: do not log.
    :param tracking_uri: MLflow tracking URI (templated); default `operators.config.settings.tracking_uri()`.
    :param num_classes: number of classes; default: the model's number of outputs.
    :param allowed_models: `module:function` model factories allowed beside the `gangflow.models`
        entry points (templated); a card naming anything else is refused before any import.
    :param data_factory: the `data.factory` of the pipeline's trainer config (templated): the test
        split is read through it, as the trainer reads it (default: the Parquet reader).
    :param evaluation_entrypoint: `module:function(model_dir, test_path) -> metrics`, the
        pipeline's `evaluation.entrypoint`, for models of one's own code: it replaces
        `load_model`, `load_test_data` and `metrics` (docs/extending.md, "Bring your own training script").

    Subclassing (data engineers): override

    * `load_model(final_dir)` to load another kind of model (must return something callable on
      a float tensor [N, features] giving logits [N, classes]);
    * `load_test_data(test_path)` to read another format (returns `(x, y)` arrays);
    * `metrics(model, x, y)` to add metrics: call `super().metrics(...)` and add JSON-friendly
      keys; numbers at the top level are logged to MLflow with the `test_` prefix too;
    * `log_to_mlflow(metrics)` to log more artifacts (call `super()` first).

    Failures: no weights at `model_uri`, a model card that is not allowed, a test split whose
    md5 differs from the manifest: `UserError` (fail at once); MLflow or the DVC remote
    unreachable: `RegistryUnavailable` / `StorageUnavailable` (retried).
    """

    template_fields: Sequence[str] = ("model_uri", "dataset", "mlflow_run_id", "tracking_uri", "num_classes",
                                      "allowed_models", "data_factory")
    template_fields_renderers = {"dataset": "json"}
    ui_color = "#e8f4ea"
    metric_prefix: ClassVar[str] = "test_"
    #: Metrics a subclass's `metrics` adds to the task's own: a pipeline file may gate on them.
    extra_metrics: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def declared_metrics(cls, task: str) -> tuple[str, ...]:
        """The scalar metrics this operator reports for a `task` model, sorted."""
        from trainer.metrics import EVALUATED_METRICS

        return tuple(sorted({*EVALUATED_METRICS.get(task, ()), *cls.extra_metrics}))

    def __init__(
        self,
        *,
        model_uri: str,
        dataset: Mapping[str, Any] | str,
        mlflow_run_id: str | None = None,
        tracking_uri: str | None = None,
        num_classes: int | None = None,
        allowed_models: Sequence[str] | None = None,
        data_factory: str | None = None,
        evaluation_entrypoint: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("multiple_outputs", True)  # each metric is also an XCom of its own key
        super().__init__(**kwargs)
        self.data_factory = data_factory
        self.evaluation_entrypoint = evaluation_entrypoint
        self.model_uri = model_uri
        self.dataset = dataset
        self.mlflow_run_id = mlflow_run_id
        self.tracking_uri = tracking_uri
        self.num_classes = num_classes
        self.allowed_models = allowed_models

    # -- hooks -----------------------------------------------------------------------------

    def load_model(self, final_dir: Path) -> Any:
        """The model to evaluate; default: rebuilt from the safetensors weights + model card."""
        return load_final_model(final_dir, allowed_models=self.allowed_models)

    def load_test_data(self, test_path: Path) -> tuple[Any, Any]:
        """(x, y) of the test split (a verified local copy), through `data_factory` when set."""
        return load_test_arrays(test_path, self.data_factory or None)

    def metrics(self, model: Any, x: Any, y: Any) -> dict[str, Any]:
        """The metrics dict (JSON-serialisable); default: `evaluate(model, x, y, num_classes,
        task=...)`, the task (`classification` | `regression`) read from the model card."""
        num_classes = int(self.num_classes) if self.num_classes not in (None, "", "None") else None
        return evaluate(model, x, y, num_classes, task=getattr(self, "task", "classification"))

    def log_to_mlflow(self, metrics: dict[str, Any]) -> None:
        """Log metrics, the JSON report and the confusion-matrix PNG to `mlflow_run_id`."""
        from mlflow.entities import Metric, RunTag

        from operators.hooks.mlflow import client_uri, get_client, mlflow_errors

        client = get_client(self.tracking_uri or None)
        uri = client_uri(client)
        run_id = str(self.mlflow_run_id)
        scalars = flat_metrics(metrics, self.metric_prefix)
        for key, value in metrics.items():  # extra scalar metrics added by subclasses
            name = f"{self.metric_prefix}{key}"
            if name not in scalars and isinstance(value, (int, float)) and not isinstance(value, bool):
                if key not in ("num_examples", "num_classes") and math.isfinite(value):
                    scalars[name] = float(value)
        now = int(time.time() * 1000)
        with mlflow_errors(uri, f"log evaluation metrics to run {run_id}"), tempfile.TemporaryDirectory() as tmp:
            tags = [RunTag(TAG_TEST_MD5, str(metrics["test_md5"]))] if metrics.get("test_md5") else []
            client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in sorted(scalars.items())], tags=tags)
            report = Path(tmp) / "metrics.json"
            report.write_text(json.dumps(metrics, indent=2, sort_keys=True))
            client.log_artifact(run_id, str(report), artifact_path=str(Path(METRICS_ARTIFACT).parent))
            if "confusion_matrix" in metrics and "accuracy" in metrics:  # a classifier's
                png = confusion_matrix_png(metrics["confusion_matrix"], Path(tmp) / "confusion_matrix.png",
                                           title=f"{self.task_id}: accuracy {metrics['accuracy']:.4f}")
                client.log_artifact(run_id, str(png), artifact_path=str(Path(CONFUSION_ARTIFACT).parent))
        log.info("logged %d metrics and %s, %s to MLflow run %s at %s",
                 len(scalars), METRICS_ARTIFACT, CONFUSION_ARTIFACT, run_id, uri)

    # -- execute ---------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        from operators.registry.versions import download_model
        from operators.hooks.mlflow import get_client

        manifest = manifest_of(self.dataset)
        model_uri = str(self.model_uri)
        with tempfile.TemporaryDirectory(prefix="gangflow-evaluate-") as tmp:
            final_dir = download_model(get_client(self.tracking_uri or None), model_uri, Path(tmp) / "model")
            test_path = fetch_test_split(manifest, Path(tmp) / "data")
            self.task = card_task(read_card(final_dir))  # as trained: the card's train.task
            if self.evaluation_entrypoint:
                metrics = score_with_entrypoint(self.evaluation_entrypoint, final_dir, test_path)
                return self._finish(metrics, manifest, model_uri, num_examples=metrics.get("num_examples"))
            try:
                model = self.load_model(final_dir)
            except GangflowError:
                raise
            except Exception as exc:  # the model card, the factory or the weights are wrong
                raise UserError(f"cannot load the model at {model_uri}: {type(exc).__name__}: {exc}") from exc
            try:
                x, y = self.load_test_data(test_path)
            except GangflowError:
                raise
            except Exception as exc:  # unreadable file, wrong schema
                raise UserError(f"cannot read test.parquet of dataset version {manifest['version']}: "
                                f"{type(exc).__name__}: {exc}") from exc
            metrics = self.metrics(model, x, y)
        return self._finish(metrics, manifest, model_uri, num_examples=metrics.get("num_examples", len(y)))

    def _finish(self, metrics: dict[str, Any], manifest: Mapping[str, Any], model_uri: str, *, num_examples: Any) -> dict[str, Any]:
        metrics.pop("test_path", None)  # a temporary or worker-local path: meaningless downstream
        metrics["test_md5"] = str(manifest["test_md5"])  # verified by fetch_test_split
        metrics["dataset_version"] = str(manifest["version"])
        metrics["model_uri"] = model_uri
        headline = ", ".join(f"{k} {metrics[k]:.4f}" for k in ("accuracy", "macro_f1", "rmse", "mae", "r2")
                             if isinstance(metrics.get(k), (int, float)))
        log.info(
            "evaluated %s (%s) on dataset version %s test split (%d examples, md5 %s): %s",
            model_uri, self.task, manifest["version"], num_examples, metrics["test_md5"], headline,
        )
        if self.mlflow_run_id:
            self.log_to_mlflow(metrics)
        else:
            log.warning("no mlflow_run_id: metrics not logged to MLflow")
        return metrics
