"""What keeps validation cheap without changing what GX checks or shows.

* `operators.expectations.columns`: a multi-column expectation builds its configuration once per
  `_get_runtime_kwargs` call (GX rebuilt it once per kwarg key), with GX's values, never stale.
* `operators.expectations.data_docs`: every Data Docs view shares one Jinja bytecode cache, so a template is
  compiled once per process; the pages are GX's, byte for byte (timestamps aside).
"""

from __future__ import annotations

import re
from pathlib import Path

import great_expectations as gx
import great_expectations.expectations as gxe
import jinja2
import pandas as pd
import pytest
from great_expectations.expectations.expectation import BatchExpectation, Expectation

from operators.expectations import data_docs
from operators.expectations.columns import ExpectColumnsTypesToBe, ExpectColumnsValuesToBeBetween, ExpectColumnsValuesToNotBeNull
from operators.validation import run_expectations

COLUMNS = [f"c{i:02d}" for i in range(40)]


def _suite(split: str) -> gx.ExpectationSuite:
    return gx.ExpectationSuite(name=f"tiny.{split}", expectations=[
        gxe.ExpectTableRowCountToBeBetween(min_value=5, max_value=50),
        ExpectColumnsTypesToBe(columns=COLUMNS, type_="float64"),
        ExpectColumnsValuesToNotBeNull(columns=COLUMNS),
        ExpectColumnsValuesToBeBetween(columns=COLUMNS, min_value=0, max_value=1),
    ])  # fmt: skip


def _frames(bad: bool = False) -> dict[str, pd.DataFrame]:
    frames = {split: pd.DataFrame({c: [0.5] * 10 for c in COLUMNS}) for split in ("train", "test")}
    if bad:
        frames["test"].loc[3, "c07"] = 7.0
    return frames


@pytest.fixture
def configuration_builds(monkeypatch):
    """Counts the builds of GX's `Expectation.configuration` (the pydantic dict() of all fields)."""
    builds = []
    build = Expectation.configuration.fget

    def counted(self):
        builds.append(type(self).__name__)
        return build(self)

    monkeypatch.setattr(Expectation, "configuration", property(counted))
    return builds


def test_runtime_kwargs_build_the_configuration_once_with_gx_values(configuration_builds):
    expectation = ExpectColumnsValuesToBeBetween(columns=COLUMNS, min_value=0, max_value=16)
    kwargs = expectation._get_runtime_kwargs({"result_format": "SUMMARY"})
    assert len(configuration_builds) == 1
    # GX's own method (one build per key) gives the same kwargs.
    assert kwargs == BatchExpectation._get_runtime_kwargs(expectation, {"result_format": "SUMMARY"})
    assert len(configuration_builds) > 2
    assert kwargs["columns"] == COLUMNS and kwargs["max_value"] == 16 and kwargs["result_format"]["result_format"] == "SUMMARY"

    # Nothing is kept between calls: a changed field is seen at once.
    expectation.max_value = 1
    assert expectation._get_runtime_kwargs()["max_value"] == 1
    assert expectation.configuration.kwargs["max_value"] == 1
    assert "_configuration_in_call" not in expectation.dict() and "_configuration_in_call" not in expectation.configuration.kwargs


def test_the_bytecode_cache_recompiles_a_changed_template():
    sources = {"page.html": "v1 {{ x }}"}
    compiled = []

    class Counting(jinja2.Environment):
        def compile(self, *args, **kwargs):
            compiled.append(args[1] if len(args) > 1 else kwargs.get("name"))
            return super().compile(*args, **kwargs)

    cache = data_docs.InMemoryBytecodeCache()

    def render() -> str:
        env = Counting(loader=jinja2.DictLoader(sources), bytecode_cache=cache)  # a fresh env, as GX's views
        return env.get_template("page.html").render(x=1)

    assert render() == "v1 1" and compiled == ["page.html"]
    assert render() == "v1 1" and compiled == ["page.html"]  # second env: reused, not compiled
    sources["page.html"] = "v2 {{ x }}"
    assert render() == "v2 1" and compiled == ["page.html", "page.html"]  # checksum changed: compiled


def _pages(root: Path) -> dict[str, str]:
    """Every HTML page under a Data Docs root, run timestamps (in names and text) and random
    element ids masked."""
    stamp = re.compile(r"\d{8}T\d{6}\.\d+Z|\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d+)?( UTC|Z|\+00:00)?"
                       r"|_run_time_sort': [\d.]+|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    return {stamp.sub("T", p.relative_to(root).as_posix()): stamp.sub("T", p.read_text()) for p in root.rglob("*.html")}


def test_data_docs_compile_templates_once_and_stay_gx_pages(tmp_path, monkeypatch):
    compiled = []
    compile_ = jinja2.Environment.compile

    def counting(self, source, name=None, filename=None, *args, **kwargs):
        compiled.append(name)
        return compile_(self, source, name, filename, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    data_docs.BYTECODE.clear()

    report = run_expectations(_frames(), _suite, docs_dir=tmp_path / "first", run_name="same")
    assert report.success
    first = len(compiled)
    assert first > 0
    # Several views, one cache: no template is compiled twice in a build.
    assert len(set(compiled)) == first, sorted(compiled)

    # A second build, with bad data: nothing compiled again, and the failure is in the pages.
    bad = run_expectations(_frames(bad=True), _suite, docs_dir=tmp_path / "second", run_name="same")
    assert not bad.success and [f.column for f in bad.failures] == ["c07"]
    assert len(compiled) == first
    cached = _pages(tmp_path / "second")
    page = next(text for name, text in cached.items() if name.startswith("validations/tiny/test/"))
    assert "c07" in page and "1 of 40 columns failed" in page

    # The same pages as GX's default views render.
    plain = {
        "class_name": "SiteBuilder", "show_how_to_buttons": False,
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(tmp_path / "plain")},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    }  # fmt: skip
    monkeypatch.setattr(data_docs, "site_config", lambda base: plain)
    run_expectations(_frames(bad=True), _suite, docs_dir=tmp_path / "plain", run_name="same")
    assert _pages(tmp_path / "plain") == cached
