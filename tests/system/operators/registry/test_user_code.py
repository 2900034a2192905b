"""Bring your own model: the factory's package travels with the registered model (MLflow
`code_paths`), and the model loads and predicts in a fresh process outside the repository where
that package is not importable; its signature and input columns come from the data's schema,
and wrong columns are refused with "expected columns ..., got ..." (real MLflow, SQLite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from operators.registry import versions as registry

from operators.hooks import mlflow as tracking

MYPKG_MODELS = textwrap.dedent('''
    """A user's model package (not part of gangflow, not installed)."""
    import torch


    class Tiny(torch.nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))

        def forward(self, x):
            return self.net(x * 2.0)


    def tiny(hidden: int = 4) -> torch.nn.Module:
        return Tiny(hidden)
''')
SCHEMA = {"a": "float", "b": "float", "c": "float"}
ROWS = pd.DataFrame({"a": [0.1, 0.5, -1.0], "b": [1.5, 0.25, 2.5], "c": [0.3, 0.2, 0.1]}, dtype="float32")

LOAD = textwrap.dedent('''
    import importlib.util, io, json, sys
    import mlflow, pandas as pd
    assert importlib.util.find_spec("mypkg") is None, "mypkg must not be importable here"
    from operators.registry.served_model import load_model
    model = load_model(sys.argv[1])
    rows = pd.read_json(io.StringIO(sys.argv[2]), orient="split")
    out = model.predict(rows)
    try:
        model.predict(rows.rename(columns={"c": "z"}))
        wrong = None
    except Exception as exc:
        wrong = str(exc)
    print(json.dumps({"prediction": out["prediction"].tolist(), "columns": list(out.columns),
                      "mypkg": sys.modules["mypkg"].__file__, "wrong": wrong}))
''')


@pytest.fixture
def user_final_dir(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    pkg = tmp_path / "userpkg" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(MYPKG_MODELS)
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", "mypkg.models:tiny")
    from mypkg.models import tiny

    torch.manual_seed(0)
    model = tiny(hidden=4)
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(final / "model.safetensors"))
    card = {"format": "gangflow-model-card/1", "model": {"factory": "mypkg.models:tiny", "kwargs": {"hidden": 4}},
            "config": {"train": {"task": "classification"}}}
    (final / "model_card.json").write_text(json.dumps(card))
    expected = model(torch.from_numpy(ROWS.to_numpy())).argmax(1).tolist()
    return final, expected


def test_user_code_travels_with_the_model_and_loads_outside_the_repo(home, client, user_final_dir, tmp_path):
    final, expected = user_final_dir
    run_id = tracking.ensure_run(client, tracking.ensure_experiment(client, "gangflow"), dag_id="byom", dag_run_id="r1")
    version = registry.register_version(client, "byom", run_id=run_id, source_dir_or_artifact_path=final,
                                        schema=SCHEMA, input_example=ROWS.head(2))  # fmt: skip
    assert json.loads(version.tags[registry.TAG_INPUT_SCHEMA]) == SCHEMA
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "MLFLOW", "GANGFLOW"))}
    # gangflow installed (its root on the path) and its state dir (the key); no allow-list (issue 23.5)
    env |= {"MLFLOW_TRACKING_URI": tracking.client_uri(client), "GANGFLOW_HOME": str(home),
            "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    done = subprocess.run([sys.executable, "-c", LOAD, f"models:/byom/{version.version}", ROWS.to_json(orient="split")],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["prediction"] == expected and got["columns"] == ["prediction", "prob_0", "prob_1"]
    assert "/code/mypkg/" in got["mypkg"]  # the bundled copy, not the user's folder
    print(got["wrong"])
    assert got["wrong"] and "['c']" in got["wrong"], got["wrong"]  # the signature names the missing column


def test_the_signature_and_schema_check_use_the_datas_columns(home, client, user_final_dir):
    import mlflow

    final, _ = user_final_dir
    run_id = tracking.ensure_run(client, tracking.ensure_experiment(client, "gangflow"), dag_id="byom", dag_run_id="r2")
    version = registry.register_version(client, "byom-schema", run_id=run_id, source_dir_or_artifact_path=final,
                                        schema=SCHEMA, input_example=ROWS.head(2))  # fmt: skip
    with tracking.use_tracking_uri(tracking.client_uri(client)):
        info = mlflow.models.get_model_info(f"models:/byom-schema/{version.version}")
    assert info.signature.inputs.input_names() == ["a", "b", "c"]
    assert registry.model_schema(client, version) == SCHEMA
    pixels = {f"pixel_{i:02d}": "float32" for i in range(64)}
    with pytest.raises(registry.SchemaMismatch) as caught:
        registry.check_schema(pixels, registry.model_schema(client, version), name="byom-schema",
                              champion_version=version.version, dataset_version="abc")  # fmt: skip
    message = str(caught.value)
    assert message.startswith("expected columns [a, b, c] (champion byom-schema v1), got [pixel_00,")
    assert "dataset version abc" in message and "Nothing was registered" in message
