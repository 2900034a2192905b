"""operators.registry.versions: idempotent registration, the alias and the audit trail, against a
real MLflow on a temporary SQLite store (one store for the module: migrations are slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from model_cards import tiny_mlp, write_final_dir

from operators import evaluation

from operators.registry import versions as registry

from operators.hooks import mlflow as tracking
from operators.registry.gate import PromotionGate, decide

PROJECT_ROOT = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.usefixtures("digits")  # data/digits, built when missing (a fresh clone)
TEST_SPLIT = PROJECT_ROOT / "data" / "digits" / "test.parquet"


@pytest.fixture(autouse=True)
def _allow_test_model(monkeypatch):
    """The tests' own factory is allowed the way a deployment allows one (the env var)."""
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", "model_cards:tiny_mlp")


# --------------------------------------------------------------------------- the registry


@pytest.fixture(scope="module")
def experiment_id(client):
    return tracking.ensure_experiment(client, "gangflow")


@pytest.fixture
def new_run(client, experiment_id, request):
    counter = iter(range(1000))

    def make() -> str:
        return tracking.ensure_run(client, experiment_id, dag_id="gangflow_train",
                                   dag_run_id=f"{request.node.name}-{next(counter)}")

    return make


@pytest.fixture
def final_dir(tmp_path):
    torch.manual_seed(0)
    final = write_final_dir(tmp_path / "run", tiny_mlp())
    (final / "optimizer_state.bin").write_bytes(b"not part of the model")  # must not be registered
    return final


def test_register_version_is_idempotent_per_run(client, new_run, final_dir):
    run_id = new_run()
    first = registry.register_version(client, "digits-idem", run_id=run_id, source_dir_or_artifact_path=final_dir,
                                      tags={"gangflow.dataset_version": "v1"})
    again = registry.register_version(client, "digits-idem", run_id=run_id, source_dir_or_artifact_path=final_dir,
                                      tags={"gangflow.dataset_version": "v1"})
    assert str(first.version) == str(again.version) == "1"
    assert len(client.search_model_versions("name='digits-idem'")) == 1
    assert first.tags["gangflow.dataset_version"] == "v1"
    assert first.tags["gangflow.mlflow_run_id"] == run_id
    assert first.run_id == run_id
    # Only one model logged for the run (no second LoggedModel on the retry).
    assert [f"models:/{o.model_id}" for o in client.get_run(run_id).outputs.model_outputs] == [first.source]
    other = registry.register_version(client, "digits-idem", run_id=new_run(), source_dir_or_artifact_path=final_dir)
    assert str(other.version) == "2"


def test_a_version_planted_under_the_candidates_run_is_refused_not_promoted(client, new_run, final_dir):
    """Anyone who can reach MLflow can register a version of an older model under the candidate's run:
    reusing it as "the retried task's version" would promote a model nobody scored."""
    name, old_run, run_id = "digits-planted", new_run(), new_run()
    weak = registry.log_final_model(client, old_run, final_dir)
    candidate = registry.log_final_model(client, run_id, final_dir)
    with registry.use_tracking_uri(tracking.client_uri(client)):
        registry.ensure_registered_model(client, name)
        client.create_model_version(name, source=f"models:/{weak}", run_id=run_id, model_id=weak)
    with pytest.raises(registry.VersionNotTheCandidates, match=f"holds models:/{weak}, not models:/{candidate}"):
        registry.register_version(client, name, run_id=run_id, source_dir_or_artifact_path=f"models:/{candidate}")
    with pytest.raises(registry.VersionNotTheCandidates, match=f"logged by run {old_run}"):
        registry.register_version(client, name, run_id=run_id, source_dir_or_artifact_path=final_dir)
    assert registry.current_champion(client, name) is None


def test_a_refused_source_names_the_artifact_roots_without_their_passwords(monkeypatch):
    monkeypatch.setenv(registry.ARTIFACT_ROOTS_ENV, "https://bob:ArtT0ken@artifacts.example/mlflow")
    with pytest.raises(registry.ModelSourceRefused) as info:
        registry.check_source("https://carol:Other@elsewhere.example/model", "digits v3")
    assert "ArtT0ken" not in str(info.value) and "Other" not in str(info.value)
    assert "https://bob:***@artifacts.example/mlflow" in str(info.value)


def test_registered_model_is_signed_data_with_the_installed_loader(client, new_run, final_dir, tmp_path, monkeypatch):
    """Issue 28.1: no loader code among the version's artifacts (no models-from-code file, no copy of
    `trainer`): the MLmodel names gangflow's installed loader and a signature covers every file."""
    import mlflow

    run_id = new_run()
    version = registry.register_version(client, "digits-load", run_id=run_id, source_dir_or_artifact_path=final_dir)
    registry.promote(client, version)

    local = Path(mlflow.artifacts.download_artifacts(
        artifact_uri=client.get_model_version_download_uri("digits-load", str(version.version)),
        dst_path=str(tmp_path / "dl"), tracking_uri=tracking.client_uri(client)))
    files = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    assert {"MLmodel", "data/final/model.safetensors", "data/final/model_card.json", "gangflow_signature.json"} <= files
    assert not [f for f in files if f.endswith((".pkl", ".pickle", ".pt", ".pth", ".bin"))], files
    assert not [f for f in files if f.startswith("code/trainer") or f.endswith("served_model.py")], files
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["loader_module"] == "operators.registry.served_model"  # installed, not from the artifacts
    assert "python_model" not in flavor  # the cloudpickled-PythonModel key

    # Loadable by alias, like a consumer would.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.client_uri(client))
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None)
    model = mlflow.pyfunc.load_model("models:/digits-load@champion")
    frame = pd.read_parquet(TEST_SPLIT).head(7)
    out = model.predict(frame)
    assert list(out.columns[:2]) == ["prediction", "prob_0"] and len(out) == 7
    expected = evaluation.load_final_model(final_dir)(torch.from_numpy(
        frame.drop(columns="label").to_numpy(np.float32, copy=True))).argmax(1).numpy()
    np.testing.assert_array_equal(out["prediction"].to_numpy(), expected)
    np.testing.assert_allclose(out.filter(like="prob_").sum(axis=1), 1.0, rtol=1e-5)


def test_champion_alias_and_audit_trail(client, new_run, final_dir):
    name = "digits-audit"
    assert registry.current_champion(client, name) is None  # no such model yet
    v1 = registry.register_version(client, name, run_id=new_run(), source_dir_or_artifact_path=final_dir)
    assert registry.current_champion(client, name) is None  # model exists, no alias
    gate = PromotionGate(floor=0.5)
    d1 = decide(0.96, None, gate)
    tags = registry.record_decision(client, v1, d1, candidate_score=0.96, gate=gate)
    registry.promote(client, v1)
    assert str(registry.current_champion(client, name).version) == "1"
    assert registry.holds_champion(client, v1)

    recorded = client.get_model_version(name, "1")
    assert recorded.tags["gangflow.decision"] == "promoted"
    assert recorded.tags["gangflow.reason"] == d1.reason == recorded.description
    assert recorded.tags["gangflow.candidate_accuracy"] == "0.960000"
    assert recorded.tags["gangflow.champion_version"] == "none"
    assert recorded.tags["gangflow.champion_accuracy"] == "none"
    assert recorded.tags["gangflow.gate_metric"] == "accuracy"
    assert "floor 0.5000" in recorded.tags["gangflow.gate"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", recorded.tags["gangflow.decided_at"])
    assert tags.items() <= recorded.tags.items()

    v2 = registry.register_version(client, name, run_id=new_run(), source_dir_or_artifact_path=final_dir)
    d2 = decide(0.96, 0.96, gate, champion_version=1)
    registry.record_decision(client, v2, d2, candidate_score=0.96, champion=v1, champion_score=0.96, gate=gate)
    assert str(registry.current_champion(client, name).version) == "1"  # record_decision never moves it
    recorded = client.get_model_version(name, "2")
    assert recorded.tags["gangflow.decision"] == "rejected"
    assert recorded.tags["gangflow.champion_version"] == "1"
    assert recorded.tags["gangflow.champion_accuracy"] == "0.960000"
    model = client.get_registered_model(name)
    assert model.tags["gangflow.last_decision"] == f"v2 rejected: {d2.reason}"
    assert "Champion: v1" in model.description  # written when v1 was promoted, kept


def test_download_version_finds_the_weights(client, new_run, final_dir, tmp_path):
    v = registry.register_version(client, "digits-dl", run_id=new_run(), source_dir_or_artifact_path=final_dir)
    got = registry.download_version(client, v, tmp_path / "dl")
    assert (got / "model.safetensors").read_bytes() == (final_dir / "model.safetensors").read_bytes()
    assert not (got / "optimizer_state.bin").exists()


def test_a_user_folder_is_registered_whole_for_its_evaluation_entrypoint(client, new_run, final_dir, tmp_path):
    """`run.log_model`'s folder (card kind "folder"): the files beside the weights (a tokenizer, a
    config) travel with the version, so the pipeline's evaluation scores the champion from them."""
    card = json.loads((final_dir / "model_card.json").read_text())
    (final_dir / "model_card.json").write_text(json.dumps(card | {"kind": "folder"}))
    (final_dir / "tokenizer").mkdir()
    (final_dir / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "outside.txt").write_text("not the model's")
    (final_dir / "link.txt").symlink_to(tmp_path / "outside.txt")  # a link is never followed
    v = registry.register_version(client, "digits-folder", run_id=new_run(), source_dir_or_artifact_path=final_dir)
    got = registry.download_version(client, v, tmp_path / "dl")
    assert (got / "tokenizer" / "tokenizer.json").read_text() == '{"model": {}}'
    assert (got / "optimizer_state.bin").read_bytes() == b"not part of the model"
    assert not (got / "link.txt").exists()


def test_register_a_plain_artifact_folder(client, new_run, final_dir, tmp_path):
    """A version whose source is a folder of run artifacts (no pyfunc) is downloadable too."""
    run_id = new_run()
    client.log_artifacts(run_id, str(final_dir), "model")
    v = registry.register_version(client, "digits-plain", run_id=run_id,
                                  source_dir_or_artifact_path=f"{client.get_run(run_id).info.artifact_uri}/model")
    got = registry.download_version(client, v, tmp_path / "dl")
    m = evaluation.evaluate_final_dir(got, TEST_SPLIT)
    assert m == evaluation.evaluate_final_dir(final_dir, TEST_SPLIT) | {"test_path": str(TEST_SPLIT)}


def test_the_trainers_own_final_dir_registers_and_loads(client, new_run, tmp_path):
    export = pytest.importorskip("trainer.export")
    models = pytest.importorskip("trainer.models")
    model = models.mlp(hidden=16)
    final = export.write_final(tmp_path / "run", model, {"model": {"factory": "trainer.models:mlp",
                                                                   "kwargs": {"hidden": 16}}})
    v = registry.register_version(client, "digits-trainer", run_id=new_run(), source_dir_or_artifact_path=final)
    got = registry.download_version(client, v, tmp_path / "dl")
    assert evaluation.evaluate_final_dir(got, TEST_SPLIT)["accuracy"] == \
        evaluation.evaluate_final_dir(final, TEST_SPLIT)["accuracy"]
    # Only data was downloaded: the weights and the card (gangflow's code is installed, never bundled).
    assert sorted(p.name for p in got.iterdir()) == ["model.safetensors", "model_card.json"]


def test_the_served_pyfunc_refuses_a_card_off_the_allow_list(client, new_run, final_dir, monkeypatch):
    """12.1: the registered model's own code (operators/registry/served_model.py) loads through the same
    allow-list: a card naming a factory the serving deployment does not allow is refused."""
    import mlflow

    # Logged where the factory was not allowed: the signature carries no factory, so the serving
    # deployment's own allow-list decides (issue 23.5: an allowed one is signed and needs nothing).
    monkeypatch.delenv("GANGFLOW_ALLOWED_MODELS")
    v = registry.register_version(client, "digits-serve-guard", run_id=new_run(), source_dir_or_artifact_path=final_dir)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.client_uri(client))
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None)
    uri = f"models:/digits-serve-guard/{v.version}"
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", "model_cards:tiny_mlp")
    assert len(mlflow.pyfunc.load_model(uri).predict(pd.read_parquet(TEST_SPLIT).head(3))) == 3
    monkeypatch.delenv("GANGFLOW_ALLOWED_MODELS")  # this deployment allows only the built-ins
    with pytest.raises(Exception, match=r"model\.factory='model_cards:tiny_mlp' is not an allowed model architecture"):
        mlflow.pyfunc.load_model(uri)


def test_the_version_carries_the_runs_lineage_tags(client, new_run, final_dir):
    """9.7: gang, job UID, image digest, dataset version recorded on the run reach the version."""
    run_id = new_run()
    lineage = {"gangflow.gang": "train-pipeline-1a2b3c4d5e", "gangflow.job_uid": "5f0c-uid",
               "gangflow.image_digest": "ghcr.io/x/gangflow@sha256:" + "ab" * 32,
               "gangflow.dataset_version": "d82dc74b3a3f4e8b3b51d13271f59bb3"}
    for key, value in lineage.items():
        client.set_tag(run_id, key, value)
    client.set_tag(run_id, "mlflow.note.content", "not lineage")
    v = registry.register_version(client, "digits-lineage", run_id=run_id, source_dir_or_artifact_path=final_dir,
                                  tags={"gangflow.dataset_version": "d82dc74b3a3f4e8b3b51d13271f59bb3",
                                        "gangflow.train_try_number": "2"})
    tags = client.get_model_version("digits-lineage", str(v.version)).tags
    assert lineage.items() <= tags.items()
    assert tags["gangflow.train_try_number"] == "2" and "mlflow.note.content" not in tags


def _signature_outputs(client, run_id) -> list[str]:
    from mlflow.models import get_model_info

    (output,) = client.get_run(run_id).outputs.model_outputs
    with tracking.use_tracking_uri(tracking.client_uri(client)):
        return [c.name for c in get_model_info(f"models:/{output.model_id}").signature.outputs.inputs]


@pytest.mark.parametrize("classes, expected", [(3, 3), (True, 10), (0, 10), ("3", 10), (10**9, 10)])
def test_the_signatures_class_scores_come_from_the_cards_classes(client, new_run, final_dir, tmp_path, monkeypatch,
                                                                 classes, expected):
    """Issue 22: the card's `classes` (what the rank that trained the model recorded) names the
    `prob_<k>` columns without building the model (no `import torch` in the training task); a card
    without a readable count falls back to one forward pass of the allowed model (10 scores)."""
    card = json.loads((final_dir / "model_card.json").read_text())
    (final_dir / "model_card.json").write_text(json.dumps({**card, "classes": classes}))
    built = []
    from operators.registry import served_model

    loader = served_model.load_final_model
    monkeypatch.setattr(served_model, "load_final_model", lambda *a, **k: built.append(1) or loader(*a, **k))
    run_id = new_run()
    registry.log_final_model(client, run_id, final_dir)
    assert _signature_outputs(client, run_id) == ["prediction"] + [f"prob_{k}" for k in range(expected)]
    assert bool(built) == (expected != classes)  # built only when the card did not say


def test_a_folder_without_a_module_factory_is_not_built_for_its_signature(client, new_run, final_dir, tmp_path,
                                                                          monkeypatch):
    """A folder of one's own (charlm's transformers folder: no `model` in its card) names `prediction`
    only, and nothing tries to build it."""
    (final_dir / "model_card.json").write_text(json.dumps({"format": "gangflow-model-card/1", "kind": "folder",
                                                           "flavour": "transformers"}))
    from operators.registry import served_model

    monkeypatch.setattr(served_model, "load_final_model", lambda *a, **k: pytest.fail("the folder was built"))
    run_id = new_run()
    registry.log_final_model(client, run_id, final_dir)
    assert _signature_outputs(client, run_id) == ["prediction"]


def test_the_training_task_logs_a_carded_model_without_importing_torch(client, new_run, final_dir, tmp_path):
    """Issue 22's overhead: after the gang, the task logs the final model and reads the card's steps.
    With the card's `classes`, neither imports torch (about 3 s of every training task before)."""
    card = json.loads((final_dir / "model_card.json").read_text())
    (final_dir / "model_card.json").write_text(json.dumps({**card, "classes": 10, "steps": 7}))
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from types import SimpleNamespace
        from mlflow import MlflowClient
        from operators.registry import versions
        from operators.training import _final_steps
        final = Path({str(final_dir)!r})
        versions.log_final_model(MlflowClient({tracking.client_uri(client)!r}), {new_run()!r}, final)
        steps = _final_steps(SimpleNamespace(run_dir=str(final.parent)))
        print("torch" in sys.modules, steps)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), str(PROJECT_ROOT / "tests" / "support")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "7"], done.stdout[-2000:]


@pytest.mark.parametrize("tracking_uri", [None, "http://127.0.0.1:5000", "http://alice:pw@mlflow.example:5000"])
def test_a_proxied_artifact_uri_naming_another_host_is_refused(tracking_uri):
    """`mlflow-artifacts://host/...` makes MLflow's client send the download, and the worker's MLflow
    credentials, to that host instead of the tracking server."""
    with pytest.raises(registry.ModelSourceRefused, match="names host 'evil.example:8443'"):
        registry.check_source("mlflow-artifacts://evil.example:8443/1/abc/artifacts", "digits v3",
                              tracking_uri=tracking_uri)
    registry.check_source("mlflow-artifacts:/1/abc/artifacts", "digits v3", tracking_uri=tracking_uri)


def test_a_proxied_artifact_uri_naming_the_tracking_server_is_inside():
    registry.check_source("mlflow-artifacts://MLflow.example:5000/1/abc/artifacts", "digits v3",
                          tracking_uri="http://alice:pw@mlflow.example:5000")
    with pytest.raises(registry.ModelSourceRefused, match="names host 'mlflow.example:5001'"):
        registry.check_source("mlflow-artifacts://mlflow.example:5001/1/abc/artifacts", "digits v3",
                              tracking_uri="http://mlflow.example:5000")


def test_a_run_whose_experiment_stores_on_another_host_is_not_downloaded(client, tmp_path):
    """Anyone who can create an experiment names its artifact location: a `runs:/` URI the DAG gives
    must not send the download (and the tracking credentials) to the host that location names."""
    experiment = client.create_experiment("elsewhere", artifact_location="mlflow-artifacts://evil.example/x")
    run_id = client.create_run(experiment).info.run_id
    with pytest.raises(registry.ModelSourceRefused, match="names host 'evil.example'"):
        registry.download_model(client, f"runs:/{run_id}/final", tmp_path / "dl")
    assert not (tmp_path / "dl").exists() or not any((tmp_path / "dl").iterdir())
