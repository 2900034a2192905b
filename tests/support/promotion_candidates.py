"""Promotion candidates for the promote tests: small models trained here on the real digits split
(bad ~0.25, ok ~0.9, good ~0.96 accuracy), each a training run as the DAG leaves it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from operators import evaluation
from operators.hooks import mlflow as tracking
from operators.promotion import PromoteModelOperator
from operators.registry import versions as registry
from trainer.datastore import file_md5

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TEST_SPLIT = PROJECT_ROOT / "data" / "digits" / "test.parquet"
TRAIN_SPLIT = PROJECT_ROOT / "data" / "digits" / "train.parquet"
FACTORY = f"{__name__}:tiny_mlp"  # importable by name: tests/support is on the pytest pythonpath


def tiny_mlp(hidden: int = 16, num_classes: int = 10) -> torch.nn.Module:
    """The test model factory named in the model cards below (`FACTORY`)."""
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes))


def write_final_dir(run_dir: Path, state_dict: dict, factory: str | None = None) -> Path:
    """A run's `final/` as the trainer leaves it (trainer/export.py's card layout)."""
    final = run_dir / "final"
    final.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(final / "model.safetensors"))
    card = {"format": "gangflow-model-card/1",
            "model": {"factory": factory or FACTORY, "kwargs": {"hidden": 16}},
            "data": {"train_md5": file_md5(TRAIN_SPLIT)}}
    (final / "model_card.json").write_text(json.dumps(card))
    return final


@pytest.fixture(scope="module")
def weights():
    """State dicts after 5 (bad), 40 (ok) and 200 (good) full-batch Adam steps, one training."""
    torch.set_num_threads(1)
    x, y = (torch.from_numpy(a) for a in evaluation.load_test_arrays(TRAIN_SPLIT))
    torch.manual_seed(0)
    model = tiny_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    snaps = {}
    for step in range(1, 201):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step in (5, 40, 200):
            snaps[{5: "bad", 40: "ok", 200: "good"}[step]] = {k: v.clone() for k, v in model.state_dict().items()}
    return snaps


DATASET_VERSION = "d82dc74b3a3f4e8b3b51d13271f59bb3"


def manifest(test_split: Path = TEST_SPLIT) -> dict:
    """The validate task's manifest as promote reads it (the worker's DVC cache holds the file)."""
    return {"version": DATASET_VERSION, "test_path": str(test_split), "test_md5": file_md5(test_split)}


class Candidate:
    """A training run as the DAG leaves it: final/ logged as its MLflow run's model
    (`models:/<model_id>`, as the training task does), and the evaluate task's metrics."""

    def __init__(self, client, tmp: Path, label: str, state_dict: dict, *, factory: str | None = None):
        self.dag_run_id = f"manual__{label}"
        self.run_dir = tmp / label
        write_final_dir(self.run_dir, state_dict, factory)
        exp = tracking.ensure_experiment(client, "gangflow")
        self.mlflow_run_id = tracking.ensure_run(client, exp, dag_id="gangflow_train", dag_run_id=self.dag_run_id)
        # What the training task does after the gang: final/ logged once, as the run's LoggedModel.
        self.model_id = registry.log_final_model(client, self.mlflow_run_id, self.run_dir / "final",
                                                 allowed_models=[factory or FACTORY])
        self.model_uri = f"models:/{self.model_id}"
        loadable = factory is None or factory.startswith("model_cards:")
        self.metrics = evaluation.evaluate_final_dir(self.run_dir / "final", TEST_SPLIT) if loadable else None

    def operator(self, name: str, **kwargs) -> PromoteModelOperator:
        args = dict(task_id="promote", model_name=name, model_uri=self.model_uri, dataset=manifest(),
                    mlflow_run_id=self.mlflow_run_id, candidate_metrics=self.metrics, floor=0.5,
                    lineage={"train_try_number": 1})
        return PromoteModelOperator(**(args | kwargs))

    def context(self, try_number: int = 1) -> dict:
        ti = SimpleNamespace(dag_id="gangflow_train", run_id=self.dag_run_id, try_number=try_number)
        return {"ti": ti, "run_id": self.dag_run_id}

    def promote(self, name: str, try_number: int = 1, **kwargs) -> dict:
        result = self.operator(name, **kwargs).execute(self.context(try_number))
        json.dumps(result)  # XCom-serialisable
        return result


@pytest.fixture
def make(client, weights, tmp_path):
    def _make(label: str, which: str, client=client, **kwargs) -> Candidate:
        return Candidate(client, tmp_path, label, weights[which], **kwargs)

    return _make
