"""Registry content is data (issue 28.1) and a registered model stands alone (issue 23.5), against a
real MLflow on a temporary SQLite store.

* a version planted through MLflow's API, whose loader code runs a command, given @champion: the
  docs' serving snippet must refuse it and run nothing;
* a version gangflow logs loads in a fresh process with no GANGFLOW_ALLOWED_MODELS (the signed
  record carries the factory the pipeline allowed), and an altered copy is refused;
* a version whose source is outside the registry's artifact root, or too large, is refused before
  anything is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from model_cards import tiny_mlp, write_final_dir

from operators.hooks import mlflow as tracking
from operators.registry import versions as registry

PROJECT_ROOT = Path(__file__).resolve().parents[4]
DOCS = PROJECT_ROOT / "docs" / "registry.md"
pytestmark = pytest.mark.usefixtures("digits")

PLANTED = textwrap.dedent('''
    import os
    import mlflow

    os.system("touch " + {marker!r})  # what an attacker's loader does on import


    class Planted(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    mlflow.models.set_model(Planted())
''')


def serving_snippet() -> str:
    """The first python block of docs/registry.md that loads the champion: what a user copies."""
    for body in re.findall(r"^```python\n(.*?)^```$", DOCS.read_text(), re.S | re.M):
        if "@champion" in body and "load" in body:
            return body
    raise AssertionError("docs/registry.md has no python block loading the @champion")


def run_snippet(client, model_name: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    """The docs' snippet in a fresh process: only the tracking URI and the model name replaced."""
    code = serving_snippet().replace("sqlite:///.gangflow/mlflow.db", tracking.client_uri(client))
    code = code.replace("gangflow-digits", model_name).replace("data/digits/", str(PROJECT_ROOT / "data/digits") + "/")
    code += "\nprint('PREDICTED', len(model.predict(pd.read_parquet(%r).head(4))))\n" % str(
        PROJECT_ROOT / "data" / "digits" / "test.parquet")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW", "GANGFLOW"))}
    env |= {"GANGFLOW_HOME": str(home), "PYTHONPATH": str(PROJECT_ROOT)}  # the platform's own settings only
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def run_id(client, request):
    exp = tracking.ensure_experiment(client, "gangflow")
    return tracking.ensure_run(client, exp, dag_id="served", dag_run_id=request.node.name)


def test_a_planted_champion_with_loader_code_runs_nothing_in_the_docs_serving_snippet(home, client, run_id, tmp_path):
    import mlflow

    marker = tmp_path / "planted-ran"
    code = tmp_path / "loader.py"
    code.write_text(PLANTED.format(marker=str(marker)))
    with tracking.use_tracking_uri(tracking.client_uri(client)), mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(name="planted", python_model=str(code))
    marker.unlink(missing_ok=True)  # MLflow's own validation load at logging ran it once
    name = "gangflow-planted"
    registry.ensure_registered_model(client, name)
    with tracking.use_tracking_uri(tracking.client_uri(client)):
        version = client.create_model_version(name, source=info.model_uri, run_id=run_id, model_id=info.model_id)
    client.set_registered_model_alias(name, "champion", str(version.version))

    done = run_snippet(client, name, tmp_path, home)
    assert not marker.exists(), "the planted version's loader code ran in the docs' serving snippet"
    assert done.returncode != 0 and "PREDICTED" not in done.stdout
    assert "not signed" in done.stderr, done.stderr[-3000:]


def test_a_version_gangflow_logs_serves_in_a_fresh_process_without_extra_settings(home, client, run_id, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.delenv("GANGFLOW_ALLOWED_MODELS", raising=False)
    torch.manual_seed(0)
    final = write_final_dir(tmp_path / "run", tiny_mlp())
    schema = {f"pixel_{i:02d}": "float32" for i in range(64)}
    model_id = registry.log_final_model(client, run_id, final, schema=schema, allowed_models=["model_cards:tiny_mlp"])
    name = "gangflow-standalone"
    version = registry.register_version(client, name, run_id=run_id, source_dir_or_artifact_path=f"models:/{model_id}",
                                        schema=schema)
    assert version.source == f"models:/{model_id}"
    registry.promote(client, version)

    done = run_snippet(client, name, tmp_path, home)  # no GANGFLOW_ALLOWED_MODELS, no PYTHONPATH to the tests
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PREDICTED 4" in done.stdout

    import mlflow

    with tracking.use_tracking_uri(tracking.client_uri(client)):
        info = mlflow.models.get_model_info(f"models:/{model_id}")
    assert {spec.type.name for spec in info.signature.inputs.inputs} == {"float"}  # float32, as the data
    outputs = info.signature.outputs.input_names()
    assert outputs[:2] == ["prediction", "prob_0"] and len(outputs) == 11


def test_an_altered_version_is_refused_before_anything_is_imported(home, client, run_id, tmp_path, monkeypatch):
    from operators.registry import served_model

    torch.manual_seed(1)
    final = write_final_dir(tmp_path / "run", tiny_mlp())
    model_id = registry.log_final_model(client, run_id, final, allowed_models=["model_cards:tiny_mlp"])
    location = Path(client.get_logged_model(model_id).artifact_location.removeprefix("file://"))
    card = location / "data" / "final" / "model_card.json"
    card.write_text(card.read_text().replace("model_cards:tiny_mlp", "subprocess:run"))
    with pytest.raises(served_model.UnsignedModel, match="altered"):
        served_model.load_model(f"models:/{model_id}", tracking_uri=tracking.client_uri(client))


def test_a_version_whose_source_is_outside_the_artifact_root_is_refused_before_download(client, run_id, tmp_path):
    elsewhere = write_final_dir(tmp_path / "elsewhere", tiny_mlp())
    name = "gangflow-elsewhere"
    registry.ensure_registered_model(client, name)
    version = client.create_model_version(name, source=elsewhere.as_uri(), run_id=run_id)
    dst = tmp_path / "dl"
    with pytest.raises(registry.ModelSourceRefused, match="outside the registry's artifact root"):
        registry.download_version(client, version, dst)
    assert not dst.exists() or not any(dst.rglob("*"))


def test_downloads_have_a_size_limit(client, run_id, tmp_path, monkeypatch):
    final = write_final_dir(tmp_path / "run", tiny_mlp())
    model_id = registry.log_final_model(client, run_id, final, allowed_models=["model_cards:tiny_mlp"])
    version = registry.register_version(client, "gangflow-big", run_id=run_id,
                                        source_dir_or_artifact_path=f"models:/{model_id}")
    monkeypatch.setenv("GANGFLOW_MAX_MODEL_BYTES", "1000")
    dst = tmp_path / "dl"
    with pytest.raises(registry.ModelSourceRefused, match=r"GANGFLOW_MAX_MODEL_BYTES=1000"):
        registry.download_version(client, version, dst)
    assert not dst.exists() or not any(dst.rglob("*"))
