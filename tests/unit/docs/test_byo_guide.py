"""docs/extending.md, "Bring your own training script": its pipeline block is a valid pipeline file
once the guide's package exists (tests/system/docs/test_byo_guide.py runs the files)."""

from __future__ import annotations

import re
import shutil

import yaml

from doc_commands import GUIDE, PROJECT_ROOT, blocks
from operators.config import settings
from operators.config.pipelines import parse_pipeline


def test_the_guides_pipeline_block_parses_into_a_pipeline_of_its_own_code(tmp_path, monkeypatch):
    text = GUIDE.read_text()
    (body,) = [b for b in re.findall(r"^```yaml\n(.*?)^```$", text, re.S | re.M) if "name: mydigits" in b]
    for kind, path, code in blocks():
        if path.startswith("mytrain/"):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(code)
    (tmp_path / "pipelines" / "trainer").mkdir(parents=True)
    shutil.copy(PROJECT_ROOT / "pipelines" / "trainer" / "digits-cnn.yaml", tmp_path / "pipelines" / "trainer")
    monkeypatch.setattr(settings, "PROJECT_ROOT", tmp_path)
    monkeypatch.syspath_prepend(str(PROJECT_ROOT))  # the guide's pipeline keeps this project's data suite (data.expectations)
    p = parse_pipeline(yaml.safe_load(body), source="pipelines/mydigits.yaml", name="mydigits")
    assert p.training_code == ("--module", "mytrain.train", "--") and p.package_roots == (str(tmp_path),)
    assert p.training_kwargs()["package_roots"] == (".",)
    assert p.evaluation_entrypoint == "mytrain.evaluate:score" and p.metric.name == "accuracy"
