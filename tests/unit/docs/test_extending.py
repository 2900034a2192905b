"""docs/extending.md runs: its `file=` blocks are written into a clone of the repository and the
third pipeline they add is built by real DVC, validated by real Great Expectations, parsed into
a DAG by the factory, trained by the real trainer and scored by the evaluate code, whose score
must equal the trainer's (tests/system/docs/test_extending.py). Here: the guide names the files a
pipeline needs, and README's set-up commands are checked against the Makefile."""

from __future__ import annotations

import re

from doc_commands import PROJECT_ROOT, README, blocks


def test_the_guide_names_the_files_a_pipeline_needs():
    files = {path for kind, path, _ in blocks() if kind == "file"}
    assert {"data/prepare_wine.py", "data/wine_expectations.py", "mymodels/wine.py", "pipelines/wine.yaml",
            "pipelines/trainer/wine.yaml"} <= files  # fmt: skip
    assert ("append", "dvc.yaml") in {(k, p) for k, p, _ in blocks()}


def test_readme_commands_exist_in_the_makefile():
    """README's commands (make targets, the demo's PIPELINE, dvc repro through make data)."""
    readme, makefile = README.read_text(), (PROJECT_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    used = set(re.findall(r"\bmake ([a-z-]+)", readme))
    assert used and used <= targets, used - targets
    assert "make demo PIPELINE=diabetes" in readme and "--pipeline $(PIPELINE)" in makefile
    assert "$(BIN)/dvc repro" in makefile and "export PATH := $(abspath $(BIN))" in makefile
