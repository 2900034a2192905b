"""DatasetValidationOperator end to end: real git + DVC repo, real local remote, real GX.

Built once per module (like tests/unit/operators/hooks/test_dvc.py): a fresh-clone project, published.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from operators.hooks import dvc as dataset
from trainer.datastore import file_md5
from operators.exceptions import DataValidationFailed, UserError
from operators.validation import DatasetValidationOperator, ValidationReport

PROJECT_ROOT = Path(__file__).resolve().parents[3]
PROJECT_FILES = ("data/prepare.py", "data/expectations.py", "params.yaml", "dvc.yaml", "dvc.lock", ".gitignore")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    for rel in PROJECT_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT_ROOT / rel, root / rel)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    from dvc.repo import Repo

    Repo.init(str(root)).close()
    home = tmp_path_factory.mktemp("state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GANGFLOW_HOME", str(home))
        mp.delenv(dataset.REMOTE_ENV, raising=False)
        dataset.publish(root)
        yield root


def lock_md5s(root: Path) -> tuple[str, dict[str, str]]:
    """The version pinned in dvc.lock and the file md5s its manifest lists (read with plain json)."""
    out = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["prepare"]["outs"][0]
    version = out["md5"].removesuffix(".dir")
    from operators.config import settings

    manifest = settings.dvc_cache() / "files" / "md5" / version[:2] / f"{version[2:]}.dir"
    return version, {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}


def test_import_does_not_load_heavy_modules():
    code = (
        "import sys, json, operators.validation\n"
        "print(json.dumps(sorted(m for m in ('great_expectations', 'dvc', 'pandas', 'pyarrow', 'torch') if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_operator_interface():
    op = DatasetValidationOperator(task_id="validate")
    assert "dataset_version" in op.template_fields
    assert op.dataset_version == "{{ params.dataset_version }}"
    assert op.suite == "data.expectations:digits_suite"
    assert op.ui_color
    for hook in ("resolve", "verify", "load", "expectations", "validate", "on_failed", "build_manifest"):
        assert f"``{hook}(" in DatasetValidationOperator.__doc__
    with pytest.raises(TypeError):
        DatasetValidationOperator("validate")  # keyword-only
    op.render_template_fields({"params": {"dataset_version": "pinned"}})
    assert op.dataset_version == "pinned"


def test_execute_validates_the_pinned_version_and_returns_its_manifest(project):
    op = DatasetValidationOperator(task_id="validate", dataset_version="", project_root=str(project))
    manifest = op.execute({"run_id": "manual__2026-11-29T18:00:00+00:00"})
    version, md5s = lock_md5s(project)
    assert json.loads(json.dumps(manifest)) == manifest
    assert manifest["version"] == version
    assert manifest["train_md5"] == md5s["train.parquet"] == file_md5(manifest["train_path"])
    assert manifest["test_md5"] == md5s["test.parquet"] == file_md5(manifest["test_path"])
    assert manifest["rows"] == {"train": 1347, "test": 450}
    assert manifest["schema"]["label"] == "int64" and manifest["schema"]["pixel_00"] == "float32"
    docs = Path(manifest["data_docs"])
    from operators.config import settings

    assert docs == settings.reports_dir() / version / "index.html"
    assert "Data Docs created by Great Expectations" in docs.read_text()
    assert list((docs.parent / "validations" / "digits" / "train").rglob("*.html"))


def test_a_version_that_fails_expectations_is_refused_with_the_list(project):
    """Publish a second version whose split is wrong (60% test), then validate it by hash."""
    pinned = {name: (project / name).read_text() for name in ("params.yaml", "dvc.lock")}
    params = yaml.safe_load(pinned["params.yaml"])
    params["prepare"]["test_fraction"] = 0.6
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    try:
        bad_version = dataset.publish(project)
    finally:  # the pin stays where it was; the bad version stays in the cache and the remote
        for name, text in pinned.items():
            (project / name).write_text(text)
    assert bad_version != dataset.pinned_version(project)

    op = DatasetValidationOperator(task_id="validate", dataset_version=bad_version, project_root=str(project))
    with pytest.raises(DataValidationFailed) as info:
        op.execute({})
    message = str(info.value)
    assert not info.value.retryable
    lines = message.splitlines()
    assert lines[0].startswith(f"dataset data/digits version {bad_version} failed 2 of 16 expectations")
    assert "[train] expect_table_row_count_to_be_between(min_value=1200, max_value=1500) -> observed 719" in message
    assert "[test] expect_table_row_count_to_be_between(min_value=400, max_value=500) -> observed 1078" in message
    assert lines[-1].startswith("Data Docs: ") and Path(lines[-1].removeprefix("Data Docs: ")).is_file()


def test_bring_your_own_suite_and_on_failed_hook(project):
    (project / "suites").mkdir(exist_ok=True)
    (project / "suites" / "strict.py").write_text(textwrap.dedent("""
        import great_expectations as gx
        import great_expectations.expectations as gxe

        def suite(split):
            return gx.ExpectationSuite(name="strict", expectations=[
                gxe.ExpectTableRowCountToBeBetween(min_value=10_000),
                gxe.ExpectColumnMaxToBeBetween(column="pixel_00", max_value=0),
            ])
    """))
    seen: list[ValidationReport] = []

    class WarnOnly(DatasetValidationOperator):
        def on_failed(self, report, resolved):
            seen.append(report)  # accept the data anyway

    op = WarnOnly(task_id="validate", dataset_version="pinned", project_root=str(project), suite="suites.strict:suite")
    manifest = op.execute({})
    assert manifest["version"] == dataset.pinned_version(project)
    (report,) = seen
    assert list(report.evaluated.items()) == [("train", 2), ("test", 2)]
    assert {(f.split, f.expectation) for f in report.failures} == {
        ("train", "expect_table_row_count_to_be_between"),
        ("test", "expect_table_row_count_to_be_between"),
    }

    with pytest.raises(UserError, match="suite='suites.strict:nope'.*no function 'nope'"):
        DatasetValidationOperator(
            task_id="v", dataset_version="pinned", project_root=str(project), suite="suites.strict:nope"
        ).execute({})


def test_execute_rejects_a_bad_version_string(project):
    op = DatasetValidationOperator(task_id="validate", dataset_version="latest", project_root=str(project))
    with pytest.raises(dataset.InvalidDatasetVersion, match=r"^dataset_version='latest' is not a dataset version"):
        op.execute({})
