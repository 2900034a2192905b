"""operators.evaluation: metrics on hand-made cases, the PNG, and the operator against a real
MLflow on a temporary SQLite store."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from model_cards import tiny_mlp, write_final_dir

from operators import evaluation

from operators.hooks import mlflow as tracking
from operators.evaluation import EvaluateModelOperator, classification_metrics, evaluate
from operators.exceptions import UserError
from trainer.datastore import file_md5

PROJECT_ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("digits")  # data/digits, built when missing (a fresh clone)
TEST_SPLIT = PROJECT_ROOT / "data" / "digits" / "test.parquet"


@pytest.fixture(autouse=True)
def _allow_test_model(monkeypatch):
    """The tests' own factory is allowed the way a deployment allows one (the env var)."""
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", "model_cards:tiny_mlp")


# --------------------------------------------------------------------------- pure metrics


def test_metrics_on_a_hand_made_case():
    y_true = [0, 0, 1, 1, 2, 2]
    y_pred = [0, 1, 1, 1, 2, 0]
    m = classification_metrics(y_true, y_pred, 3)
    assert m["confusion_matrix"] == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["per_class"]["0"] == pytest.approx({"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2})
    assert m["per_class"]["1"] == pytest.approx({"precision": 2 / 3, "recall": 1.0, "f1": 0.8, "support": 2})
    assert m["per_class"]["2"] == pytest.approx({"precision": 1.0, "recall": 0.5, "f1": 2 / 3, "support": 2})
    assert m["macro_f1"] == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    assert m["num_examples"] == 6 and m["num_classes"] == 3
    json.dumps(m)  # XCom-serialisable: plain types only


def test_metrics_match_scikit_learn():
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support

    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 5, 200)
    y_pred = np.where(rng.random(200) < 0.7, y_true, rng.integers(0, 5, 200))
    y_pred[y_pred == 4] = 3  # class 4 is never predicted: precision 0 by convention
    m = classification_metrics(y_true, y_pred, 5)
    p, r, f, s = precision_recall_fscore_support(y_true, y_pred, labels=range(5), zero_division=0)
    assert m["accuracy"] == pytest.approx(accuracy_score(y_true, y_pred))
    assert m["macro_f1"] == pytest.approx(f1_score(y_true, y_pred, labels=range(5), average="macro", zero_division=0))
    assert m["confusion_matrix"] == confusion_matrix(y_true, y_pred, labels=range(5)).tolist()
    for k in range(5):
        row = m["per_class"][str(k)]
        assert (row["precision"], row["recall"], row["f1"], row["support"]) == pytest.approx((p[k], r[k], f[k], s[k]))


def test_absent_class_counts_zero_in_macro_f1():
    m = classification_metrics([0, 0, 1], [0, 0, 1], 3)
    assert m["accuracy"] == 1.0
    assert m["per_class"]["2"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    assert m["macro_f1"] == pytest.approx(2 / 3)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="labels outside"):
        classification_metrics([0, 5], [0, 1], 3)
    with pytest.raises(ValueError, match="empty"):
        classification_metrics([], [], 3)
    with pytest.raises(ValueError, match="2 labels but 3 predictions"):
        classification_metrics([0, 1], [0, 1, 1], 3)


def test_evaluate_runs_the_model():
    # Logits = x: the prediction is the index of the largest feature.
    model = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    x = np.array([[5, 0, 0], [0, 5, 0], [0, 0, 5], [5, 0, 0]], dtype=np.float32)
    y = np.array([0, 1, 2, 2])
    m = evaluate(model, x, y)  # num_classes from the model's width
    assert m["num_classes"] == 3
    assert m["accuracy"] == 0.75
    assert m["confusion_matrix"] == [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    assert evaluate(model, torch.from_numpy(x), torch.from_numpy(y), num_classes=4)["num_classes"] == 4


def test_confusion_matrix_png(tmp_path):
    path = evaluation.confusion_matrix_png([[3, 1], [0, 4]], tmp_path / "sub" / "cm.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000


def test_flat_metrics_names():
    m = classification_metrics([0, 1, 1], [0, 1, 0], 2)
    flat = evaluation.flat_metrics(m)
    assert set(flat) == {"test_accuracy", "test_macro_f1", "test_precision_class_0", "test_recall_class_0",
                         "test_f1_class_0", "test_precision_class_1", "test_recall_class_1", "test_f1_class_1"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in flat.values())


# --------------------------------------------------------------------------- final dirs


def test_evaluate_final_dir_on_the_real_test_split(tmp_path):
    torch.manual_seed(0)
    final = write_final_dir(tmp_path / "run", tiny_mlp())
    m = evaluation.evaluate_final_dir(final, TEST_SPLIT)
    assert m["num_examples"] == 450 and m["num_classes"] == 10
    assert sum(m["per_class"][str(k)]["support"] for k in range(10)) == 450
    assert m["test_md5"] == file_md5(TEST_SPLIT)
    assert 0.0 <= m["accuracy"] <= 1.0


def test_test_split_without_parquet_suffix(tmp_path):
    """DVC cache objects are named by hash, without a suffix."""
    blob = tmp_path / "d82dc74b3a3f4e8b3b51d13271f59bb3"
    blob.write_bytes(TEST_SPLIT.read_bytes())
    x, y = evaluation.load_test_arrays(blob)
    assert x.shape == (450, 64) and x.dtype == np.float32 and y.dtype == np.int64


# --------------------------------------------------------------------------- operator

DATASET_VERSION = "d82dc74b3a3f4e8b3b51d13271f59bb3"


def _context():
    return {"ti": SimpleNamespace(dag_id="gangflow_train", run_id="manual__1", try_number=1), "run_id": "manual__1"}


def _manifest(**extra):
    return {"version": DATASET_VERSION, "test_path": str(TEST_SPLIT), "test_md5": file_md5(TEST_SPLIT),
            **extra}


def _logged_run(tmp_path, dag_run_id: str, seed: int = 1) -> tuple:
    """An MLflow run holding final/ under artifact path `final`, as the trainer's rank 0 logs it."""
    torch.manual_seed(seed)
    final = write_final_dir(tmp_path / dag_run_id, tiny_mlp())
    client = tracking.get_client()
    run_id = tracking.ensure_run(client, tracking.ensure_experiment(client, "gangflow"),
                                 dag_id="gangflow_train", dag_run_id=dag_run_id)
    client.log_artifacts(run_id, str(final), "final")
    return client, run_id, f"runs:/{run_id}/final"


def test_operator_logs_metrics_and_artifacts_to_the_run(home, tmp_path):
    client, run_id, model_uri = _logged_run(tmp_path, "manual__1")
    op = EvaluateModelOperator(task_id="evaluate", model_uri=model_uri, dataset=_manifest(), mlflow_run_id=run_id)
    assert {"model_uri", "dataset", "mlflow_run_id", "tracking_uri", "allowed_models"} <= set(op.template_fields)
    result = op.execute(_context())

    json.loads(json.dumps(result))  # XCom-serialisable
    assert set(result) >= {"accuracy", "macro_f1", "per_class", "confusion_matrix", "test_md5", "num_examples"}
    assert result["num_examples"] == 450
    # No worker path travels downstream: the model by URI, the data by version + md5.
    assert "test_path" not in result and str(tmp_path) not in json.dumps(result)
    assert (result["model_uri"], result["dataset_version"]) == (model_uri, DATASET_VERSION)
    run = client.get_run(run_id)
    metrics = run.data.metrics
    assert metrics["test_accuracy"] == pytest.approx(result["accuracy"])
    assert metrics["test_macro_f1"] == pytest.approx(result["macro_f1"])
    assert metrics["test_f1_class_3"] == pytest.approx(result["per_class"]["3"]["f1"])
    assert metrics["test_precision_class_9"] == pytest.approx(result["per_class"]["9"]["precision"])
    assert run.data.tags[evaluation.TAG_TEST_MD5] == file_md5(TEST_SPLIT)
    files = {a.path for a in client.list_artifacts(run_id, "evaluation")}
    assert files == {"evaluation/metrics.json", "evaluation/confusion_matrix.png"}
    local = Path(client.download_artifacts(run_id, "evaluation", str(tmp_path / "dl")))
    assert json.loads((local / "metrics.json").read_text())["confusion_matrix"] == result["confusion_matrix"]
    assert (local / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"
    # The artifacts landed under the state dir, not in ./mlruns.
    assert str(home.resolve()) in client.get_run(run_id).info.artifact_uri


def test_operator_without_run_id_only_evaluates(home, tmp_path):
    _, _, model_uri = _logged_run(tmp_path, "manual__3")
    op = EvaluateModelOperator(task_id="evaluate", model_uri=model_uri, dataset=_manifest())
    assert op.execute(_context())["num_examples"] == 450


def test_operator_missing_weights_is_a_user_error(home, tmp_path):
    _, run_id, _ = _logged_run(tmp_path, "manual__4")
    op = EvaluateModelOperator(task_id="evaluate", model_uri=f"runs:/{run_id}/no-such-folder", dataset=_manifest())
    with pytest.raises(UserError, match=f"no model at runs:/{run_id}/no-such-folder"):
        op.execute(_context())


def test_operator_fetches_the_test_split_by_content_address_and_checks_its_md5(home, tmp_path, monkeypatch):
    """12.7 + 9.3: a worker without the DVC cache object fetches the split from the DVC remote by
    the version's content address; bytes that differ from the manifest's test_md5 are refused."""
    from operators.exceptions import DatasetHashMismatch

    from trainer.datastore import listing_digest, object_path

    # A DVC 3 remote holding one version (the layout `dvc push` writes).
    remote = tmp_path / "remote"
    data = {"test.parquet": TEST_SPLIT.read_bytes(), "train.parquet": b"train"}
    entries = [{"md5": hashlib.md5(b).hexdigest(), "relpath": rel} for rel, b in sorted(data.items())]
    version = listing_digest(entries)
    for entry in entries:
        obj = Path(object_path(str(remote), entry["md5"]))
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(data[entry["relpath"]])
    listing = Path(object_path(str(remote), version, ".dir"))
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text(json.dumps(sorted(entries, key=lambda e: e["relpath"])))

    _, _, model_uri = _logged_run(tmp_path, "manual__5")
    dataset = {"version": version, "test_path": str(tmp_path / "not-on-this-worker"), "test_md5": entries[0]["md5"]}
    monkeypatch.setenv("GANGFLOW_DVC_REMOTE", remote.as_uri())
    op = EvaluateModelOperator(task_id="evaluate", model_uri=model_uri, dataset=dataset)
    assert op.execute(_context())["num_examples"] == 450
    op = EvaluateModelOperator(task_id="evaluate", model_uri=model_uri, dataset=dataset | {"test_md5": "0" * 32})
    with pytest.raises(DatasetHashMismatch, match=f"test split of dataset version {version}: md5 "
                                                  f"{entries[0]['md5']}, but the validated manifest says test_md5 "
                                                  f"{'0' * 32}"):
        op.execute(_context())


def test_operator_subclass_adds_a_metric(home, tmp_path):
    class WithErrorCount(EvaluateModelOperator):
        def metrics(self, model, x, y):
            m = super().metrics(model, x, y)
            m["errors"] = int(round((1 - m["accuracy"]) * m["num_examples"]))
            return m

    client, run_id, model_uri = _logged_run(tmp_path, "manual__2")
    result = WithErrorCount(task_id="evaluate", model_uri=model_uri, dataset=_manifest(),
                            mlflow_run_id=run_id).execute(_context())
    assert client.get_run(run_id).data.metrics["test_errors"] == result["errors"]


# --------------------------------------------------------------------------- loading is allow-listed


def _card(final: Path, model: dict, **extra) -> Path:
    card = json.loads((final / "model_card.json").read_text())
    (final / "model_card.json").write_text(json.dumps({**card, "model": model, **extra}))
    return final


def test_a_card_naming_code_off_the_allow_list_is_refused_before_any_import(home, tmp_path, monkeypatch):
    """12.1: a model card is data; a module it names is never imported unless allow-listed."""
    from trainer.allowlist import ModelNotAllowed

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    marker = tmp_path / "imported"
    (pkg / "gangflow_evil_model.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\ndef build(**kw):\n    open({str(marker)!r}, 'w').write('called')\n")
    monkeypatch.syspath_prepend(str(pkg))
    final = _card(write_final_dir(tmp_path / "run", tiny_mlp()), {"factory": "gangflow_evil_model:build", "kwargs": {}})
    with pytest.raises(ModelNotAllowed, match=r"model\.factory='gangflow_evil_model:build' is not an allowed model "
                                              r"architecture; nothing was imported\. Allowed: .*trainer\.models:mlp"):
        evaluation.load_final_model(final)
    assert not marker.exists()
    import sys

    assert "gangflow_evil_model" not in sys.modules
    # The operator fails the task with the same reason, as a user error.
    op = EvaluateModelOperator(task_id="evaluate", model_uri=str(final), dataset=_manifest())
    with pytest.raises(UserError, match="not an allowed model architecture"):
        op.execute(_context())
    assert not marker.exists()
    # Allowed explicitly by the DAG (the operator argument), the same card loads.
    (pkg / "gangflow_evil_model.py").write_text("from model_cards import tiny_mlp as build\n")
    allowed = EvaluateModelOperator(task_id="evaluate", model_uri=str(final), dataset=_manifest(),
                                    allowed_models=["gangflow_evil_model:build"])
    assert allowed.execute(_context())["num_examples"] == 450


@pytest.mark.parametrize(("model", "extra", "message"), [
    ({"factory": "model_cards:tiny_mlp", "kwargs": {"hidden": 8, "bias": True}}, {},
     r"model\.kwargs\.bias=True: model_cards:tiny_mlp takes no argument 'bias'; it accepts: hidden, num_classes"),
    ({"factory": "model_cards:tiny_mlp", "kwargs": {"hidden": "8"}}, {}, r"model\.kwargs\.hidden='8': .* expects int"),
    ({"factory": "model_cards:tiny_mlp", "kwargs": {"hidden": 8.5}}, {}, r"model\.kwargs\.hidden=8\.5: .* expects int"),
    ({"factory": "model_cards:tiny_mlp", "kwargs": {"hidden": {"__class__": "x"}}}, {}, r"only numbers, strings"),
    ({"factory": "model_cards:tiny_mlp", "kwargs": {"_private": 1}}, {}, r"not a keyword argument name"),
    ({"factory": "model_cards:tiny_mlp", "kwargs": {}}, {"weights": {"file": "../../etc/passwd.safetensors"}},
     r"weights\.file='\.\./\.\./etc/passwd\.safetensors' must be a file name"),
    ({"factory": "subprocess:run", "kwargs": {"args": ["true"]}}, {}, r"model\.factory='subprocess:run' is not an allowed"),
    ({"factory": ["trainer.models:mlp"]}, {}, r"model\.factory=\['trainer\.models:mlp'\] must be a name"),
])  # fmt: skip
def test_card_kwargs_and_weights_are_validated(tmp_path, model, extra, message):
    from trainer.allowlist import ModelNotAllowed

    torch.manual_seed(0)
    final = _card(write_final_dir(tmp_path / "run", tiny_mlp()), model, **extra)
    with pytest.raises(ModelNotAllowed, match=message):
        evaluation.load_final_model(final)


def test_built_in_models_come_from_the_entry_points(tmp_path, monkeypatch):
    """`trainer.models:mlp` is allowed because pyproject.toml declares it (entry points group
    `gangflow.models`), by its value or its entry-point name, with no env var or argument."""
    from importlib.metadata import entry_points

    from trainer import export, models

    monkeypatch.delenv("GANGFLOW_ALLOWED_MODELS")
    assert {(ep.name, ep.value) for ep in entry_points(group="gangflow.models")} >= {("mlp", "trainer.models:mlp")}
    model = models.mlp(hidden=16)
    for factory in ("trainer.models:mlp", "mlp"):
        final = export.write_final(tmp_path / factory.replace(":", "_"), model,
                                   {"model": {"factory": factory, "kwargs": {"hidden": 16, "input_dim": 64}}})
        x = torch.rand(3, 64) * 16
        assert torch.equal(evaluation.load_final_model(final)(x), model.eval()(x))
    with pytest.raises(export.ModelNotAllowed, match="model_cards:tiny_mlp' is not an allowed"):
        evaluation.load_final_model(write_final_dir(tmp_path / "tiny", tiny_mlp()))
