"""Dataset validation: the first task of every gangflow DAG run.

`DatasetValidationOperator` resolves a DVC-pinned dataset version to its read-only files, re-checks
their hashes, runs a Great Expectations suite on every split, writes GX Data Docs and returns the
validated-dataset manifest (XCom). `run_expectations()` is the same run without Airflow. Heavy
libraries are imported inside the methods, never when a DAG file imports this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from operators.hooks import dvc as dataset

from operators.config import settings
from operators.exceptions import DataValidationFailed, UserError

if TYPE_CHECKING:
    import pandas as pd
    from great_expectations import ExpectationSuite
    from great_expectations.core import ExpectationValidationResult

    from operators.hooks.dvc import ResolvedDataset

SuiteFactory = Callable[[str], "ExpectationSuite"]

#: At most this many failed expectations are spelled out in the exception message.
MAX_LISTED_FAILURES = 40
#: Above this many failures that only say a column is missing, the schema line says it once.
MAX_ABSENT_COLUMN_LINES = 10


@dataclass(frozen=True)
class ExpectationFailure:
    """One failed expectation, in words a data engineer can act on."""

    split: str
    expectation: str
    column: str | None
    expected: str
    observed: str

    def __str__(self) -> str:
        column = f" column {self.column}:" if self.column else ""
        return f"[{self.split}]{column} {self.expectation}({self.expected}) -> {self.observed}"


@dataclass
class ValidationReport:
    """What `run_expectations` found: per-split GX results, failures, and the Data Docs index.

    `failures` has one entry per failing column of a multi-column expectation
    (operators/expectations/columns.py), so it can be longer than the count of failed expectations,
    which is `failed` (per split).
    """

    success: bool
    failures: list[ExpectationFailure]
    evaluated: dict[str, int]
    data_docs: Path | None
    results: dict[str, Any] = field(repr=False, default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    #: Per split whose columns are not the suite's: (expected columns, columns found).
    schema_mismatch: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)

    def describe(self, version: str | None = None, *, limit: int = MAX_LISTED_FAILURES, dataset: str | None = None) -> str:
        """A multi-line summary: a wrong schema first ("expected columns ..., got ..."), then one
        line per other failed expectation (at most `limit`); a missing column is said once, in
        the schema line, not once per expectation that needed it."""
        total = sum(self.evaluated.values())
        what = f"dataset {dataset} version {version}" if dataset and version else (
            f"dataset version {version}" if version else f"dataset {dataset}" if dataset else "the dataset")
        if self.success:
            return f"{what} passed all {total} expectations ({self._per_split()})"
        failed = sum(self._failed().values())
        lines = []
        for split, (expected, got) in self.schema_mismatch.items():
            missing, extra = [c for c in expected if c not in got], [c for c in got if c not in expected]
            lines.append(f"[{split}] expected columns {_short(expected)}, got {_short(got)}"
                         + (f": missing {_short(missing)}" if missing else "")
                         + (f"; unexpected {_short(extra)}" if extra else ""))
        lines.insert(0, f"{what} failed {failed} of {total} expectations ({self._per_split()}):")
        absent = {(split, c) for split, (expected, got) in self.schema_mismatch.items() for c in expected if c not in got}
        rest = [f for f in self.failures if (f.split, f.column) not in absent and not _about_absent_column(f, absent)]
        if len(self.failures) - len(rest) <= MAX_ABSENT_COLUMN_LINES:  # a few: each check on them still says so
            rest = list(self.failures)
        hidden = len(self.failures) - len(rest)
        lines += [f"  - {failure}" for failure in rest[:limit]]
        if hidden:
            lines.append(f"  ({hidden} more failures only say that those columns are missing)")
        if len(rest) > limit:
            lines.append(f"  ... and {len(rest) - limit} more (see the Data Docs)")
        if self.data_docs:
            lines.append(f"Data Docs: {self.data_docs}")
        return "\n".join(lines)

    def _failed(self) -> dict[str, int]:
        if self.failed:
            return self.failed
        failed: dict[str, int] = {}
        for failure in self.failures:
            failed[failure.split] = failed.get(failure.split, 0) + 1
        return failed

    def _per_split(self) -> str:
        failed = self._failed()
        return ", ".join(f"{split}: {failed.get(split, 0)} failed of {n}" for split, n in self.evaluated.items())


class DatasetValidationOperator(BaseOperator):
    """Validate a DVC-pinned dataset version with Great Expectations; return its manifest.

    :param dataset_version: the version to validate: 32 hex digits (the DVC md5 of the dataset
        directory, as in dvc.lock without `.dir`), or `"pinned"` / empty for the version
        pinned in dvc.lock. Templated; defaults to the DAG param `dataset_version`.
    :param project_root: the git + DVC repository holding dvc.yaml/dvc.lock (templated);
        default `operators.config.settings.PROJECT_ROOT`.
    :param suite: `"module:function"` of the suite factory, called as `function(split)` for each
        split and returning a `great_expectations.ExpectationSuite` (templated). Modules under
        the project root (such as `data.expectations`) are loaded from there.
    :param dvc_out: the DVC-tracked folder of the dataset (an `outs` entry of dvc.yaml); default
        the class attribute `dvc_out` (`data/digits`). A pipeline file's `dataset.out`.

    ``execute`` runs these steps, each a method you can override in a subclass:

    1. ``resolve(version)``: turn the version into a `ResolvedDataset` (read-only files in the
       DVC cache, fetched from the DVC remote when absent). Raises DatasetVersionNotFound,
       StorageUnavailable (retried) or InvalidDatasetVersion.
    2. ``verify(resolved)``: recompute every file's md5; a changed byte raises
       DatasetHashMismatch. What is validated is exactly what is trained on (the trainer
       re-checks the train file's md5 from the manifest).
    3. ``load(resolved)``: read every split into a pandas DataFrame, keyed by split name.
    4. ``expectations(split)``: the ExpectationSuite for one split (default: the `suite`
       factory). Override to build suites from code or config instead.
    5. ``validate(frames, version=..., run_name=...)``: run GX on every split with an
       ephemeral context and write Data Docs to ``data_docs_dir(version)``.
    6. ``on_failed(report, resolved)``: called when an expectation failed. The default raises
       DataValidationFailed whose message lists each failure (split, column, expectation,
       expected vs observed); it is what the task log shows. Override to alert first (then
       call ``super().on_failed``), or return normally to accept the data anyway (warn-only).
    7. ``build_manifest(resolved, frames, report)``: the dict returned as XCom: version, uri,
       train/test paths and md5s, rows, schema, data_docs, files.

    No step is retried for user errors (bad version, missing version, changed bytes, failed
    expectations); an unreachable DVC remote raises StorageUnavailable, which is retried.
    """

    template_fields: Sequence[str] = ("dataset_version", "project_root", "suite")
    ui_color = "#d8f3dc"
    ui_fgcolor = "#1b4332"

    #: The DVC-tracked directory (an `outs` entry in dvc.yaml) that holds the dataset.
    dvc_out: str = dataset.DEFAULT_OUT

    def __init__(
        self,
        *,
        dataset_version: str = "{{ params.dataset_version }}",
        project_root: str | None = None,
        suite: str = "data.expectations:digits_suite",
        dvc_out: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("multiple_outputs", True)  # `validate.output["version"]` in a DAG of one's own
        super().__init__(**kwargs)
        self.dataset_version = dataset_version
        self.project_root = project_root
        self.suite = suite
        if dvc_out:
            self.dvc_out = dvc_out

    # -- the steps -------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        return Path(self.project_root or settings.PROJECT_ROOT)

    def resolve(self, version: str) -> ResolvedDataset:
        return dataset.resolve(version, self.root, out=self.dvc_out)

    def verify(self, resolved: ResolvedDataset) -> ResolvedDataset:
        return dataset.verify(resolved)

    def load(self, resolved: ResolvedDataset) -> dict[str, pd.DataFrame]:
        import pandas as pd

        return {split: pd.read_parquet(path) for split, path in resolved.splits.items()}

    def expectations(self, split: str) -> ExpectationSuite:
        return load_suite_factory(self.suite, self.root)(split)

    def data_docs_dir(self, version: str) -> Path:
        return settings.reports_dir() / version

    def validate(self, frames: Mapping[str, pd.DataFrame], *, version: str, run_name: str) -> ValidationReport:
        return run_expectations(
            frames, self.expectations, docs_dir=self.data_docs_dir(version), run_name=run_name
        )

    def on_failed(self, report: ValidationReport, resolved: ResolvedDataset) -> None:
        raise DataValidationFailed(report.describe(resolved.version, dataset=self.dvc_out))

    def build_manifest(
        self, resolved: ResolvedDataset, frames: Mapping[str, pd.DataFrame], report: ValidationReport
    ) -> dict[str, Any]:
        rows = {split: len(frame) for split, frame in frames.items()}
        schema = {str(c): str(t) for c, t in frames["train"].dtypes.items()} if "train" in frames else None
        return dataset.manifest(resolved, data_docs=report.data_docs, rows=rows, schema=schema)

    # -- the task --------------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        return self.validate_version(run_name=_run_name(context))

    def validate_version(self, *, run_name: str) -> dict[str, Any]:
        """The steps above on `dataset_version`; the manifest. Outside Airflow too
        (`python -m operators.cli.dataset validate`)."""
        version = dataset.normalize_version(self.dataset_version, self.root, out=self.dvc_out)
        self.log.info("Validating dataset %s version %s (asked for %r)", self.dvc_out, version, self.dataset_version)
        resolved = self.verify(self.resolve(version))
        self.log.info(
            "Dataset version %s: hashes verified %s (manifest %s)",
            version, ", ".join(f"{n}={m}" for n, m in sorted(resolved.md5s.items())), resolved.uri,
        )
        frames = self.load(resolved)
        report = self.validate(frames, version=version, run_name=run_name)
        if report.success:
            self.log.info("%s", report.describe(version, dataset=self.dvc_out))
        else:
            self.on_failed(report, resolved)  # raises DataValidationFailed unless overridden
            self.log.warning("Accepted despite failed expectations: %s", report.describe(version, dataset=self.dvc_out))
        result = self.build_manifest(resolved, frames, report)
        self.log.info(
            "Validated dataset %s version %s: rows %s, train md5 %s, test md5 %s, Data Docs %s",
            self.dvc_out, version, result["rows"], result["train_md5"], result["test_md5"], result["data_docs"],
        )
        return result


# --------------------------------------------------------------------------------------------
# Suites


def _quiet_gx_logs() -> None:
    """GX logs hundreds of INFO lines about its own internals on import; keep task logs readable.

    Only when nobody configured the `great_expectations` logger: set a level to get them back.
    """
    gx_logger = logging.getLogger("great_expectations")
    if gx_logger.level == logging.NOTSET:
        gx_logger.setLevel(logging.WARNING)


def load_suite_factory(spec: str, root: str | Path | None = None) -> SuiteFactory:
    """Import the `module:function` suite factory; modules under `root` are loaded from there."""
    _quiet_gx_logs()
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"suite={spec!r}: expected 'module:function', e.g. 'data.expectations:digits_suite'")
    root = Path(root or settings.PROJECT_ROOT)
    candidate = root.joinpath(*module_name.split(".")).with_suffix(".py")
    try:
        if candidate.is_file():
            module = _load_from_file(module_name, candidate)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"suite={spec!r}: cannot import {module_name}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"suite={spec!r}: {module_name} has no function {attr!r}")
    return factory


def _load_from_file(module_name: str, path: Path) -> Any:
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


# --------------------------------------------------------------------------------------------
# Running Great Expectations


def run_expectations(
    frames: Mapping[str, pd.DataFrame],
    suite_factory: SuiteFactory,
    *,
    docs_dir: str | Path | None = None,
    run_name: str = "gangflow",
) -> ValidationReport:
    """Validate each split's DataFrame against `suite_factory(split)` with an ephemeral GX context.

    Uses a pandas data source with one DataFrame asset and a whole-dataframe batch definition
    per split. With `docs_dir`, GX Data Docs (a SiteBuilder site on the local filesystem, GX's
    views sharing one template cache: operators/expectations/data_docs.py) are built there, failures
    included; `report.data_docs` is its index.html.
    """
    _quiet_gx_logs()
    import great_expectations as gx
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    sites = {}
    if docs_dir is not None:
        from operators.expectations.data_docs import site_config

        docs_dir = Path(docs_dir)
        docs_dir.mkdir(parents=True, exist_ok=True)
        sites["gangflow"] = site_config(str(docs_dir))
    context = gx.get_context(
        mode="ephemeral",
        project_config=DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
            data_docs_sites=sites,
            analytics_enabled=False,
            progress_bars=ProgressBarsConfig(globally=False),
        ),
    )
    source = context.data_sources.add_pandas("gangflow")
    run_id = RunIdentifier(run_name=_safe(run_name), run_time=datetime.now(timezone.utc))
    results: dict[str, Any] = {}
    failures: list[ExpectationFailure] = []
    evaluated: dict[str, int] = {}
    failed: dict[str, int] = {}
    schema_mismatch: dict[str, tuple[list[str], list[str]]] = {}
    used: set[str] = set()
    for split, frame in frames.items():
        suite = suite_factory(split)
        if suite.name in used:  # a factory may give every split the same suite name
            suite.name = f"{suite.name}.{split}"
        used.add(suite.name)
        suite = context.suites.add(suite)
        batch = source.add_dataframe_asset(name=split).add_batch_definition_whole_dataframe(split)
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=f"{suite.name}:{split}", data=batch, suite=suite)
        )
        result = definition.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY", run_id=run_id)
        results[split] = result
        evaluated[split] = len(result.results)
        failed[split] = sum(1 for r in result.results if not r.success)
        failures += [f for r in result.results if not r.success for f in describe_failures(split, r)]
        for r in result.results:
            config = r.expectation_config
            if not r.success and config.type == "expect_table_columns_to_match_set":
                expected = list(config.kwargs.get("column_set") or [])
                schema_mismatch[split] = (expected, [str(c) for c in frame.columns])
    data_docs = None
    if docs_dir is not None:
        context.build_data_docs(site_names=["gangflow"])
        data_docs = docs_dir / "index.html"
    return ValidationReport(
        success=not failures, failures=failures, evaluated=evaluated, data_docs=data_docs, results=results,
        failed=failed, schema_mismatch=schema_mismatch,
    )


def _about_absent_column(failure: ExpectationFailure, absent: set[tuple[str, str]]) -> bool:
    """A failure that only says a column of the schema line is missing (GX: 'does not exist')."""
    return any(failure.split == split and column in failure.observed and "exist" in failure.observed
               for split, column in absent)


def describe_failures(split: str, result: ExpectationValidationResult) -> list[ExpectationFailure]:
    """One ExpectationFailure per failing column for the multi-column expectations
    (`details.columns` in their result, operators/expectations/columns.py), else `[describe_failure(...)]`."""
    per_column = ((result.result or {}).get("details") or {}).get("columns")
    if not isinstance(per_column, dict) or not per_column:
        return [describe_failure(split, result)]
    config = result.expectation_config
    kwargs = {k: v for k, v in dict(config.kwargs).items() if k not in ("batch_id", "columns") and v is not None}
    expected = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items())
    failures = []
    for column, found in per_column.items():
        if found.get("missing"):
            observed = "column is missing"
        elif "observed" in found:
            observed = f"observed {_short(found['observed'])}"
        else:
            observed = _unexpected(found, config.type)
        failures.append(ExpectationFailure(split, config.type, column, expected, observed))
    return failures


def describe_failure(split: str, result: ExpectationValidationResult) -> ExpectationFailure:
    """Expected vs observed, in words, for one failed GX expectation result."""
    config = result.expectation_config
    kwargs = {k: v for k, v in dict(config.kwargs).items() if k not in ("batch_id", "column") and v is not None}
    column = config.kwargs.get("column")
    expected = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items())
    return ExpectationFailure(split, config.type, column, expected, _observed(config.type, result))


def _observed(kind: str, result: ExpectationValidationResult) -> str:
    info = result.exception_info or {}
    raised = [info] if "raised_exception" in info else [v for v in info.values() if isinstance(v, dict)]
    for item in raised:
        if item.get("raised_exception"):
            message = str(item.get("exception_message") or "error").strip().splitlines()[0]
            return f"could not be evaluated: {message}"
    res = dict(result.result or {})
    details = res.get("details") or {}
    if "unexpected_count" in res and res.get("element_count") is not None:
        return _unexpected(res, kind)
    if kind == "expect_column_kl_divergence_to_be_less_than":
        observed = res.get("observed_value")
        shares = details.get("observed_partition") or {}
        pairs = ", ".join(
            f"{value}: {weight:.3f}" for value, weight in zip(shares.get("values", []), shares.get("weights", []))
        )
        kl = "infinite (values outside the partition)" if observed is None else f"{observed:.4f}"
        return f"KL divergence {kl}; observed shares {{{pairs}}}"
    mismatched = details.get("mismatched")
    if isinstance(mismatched, dict):
        parts = [f"{k} {_short(sorted(map(str, v)))}" for k, v in mismatched.items() if v]
        return "columns " + "; ".join(parts) if parts else f"observed {_short(res.get('observed_value'))}"
    return f"observed {_short(res.get('observed_value'))}"


def _unexpected(res: Mapping[str, Any], kind: str) -> str:
    count, total = res["unexpected_count"], res["element_count"]
    missing = res.get("missing_count") or 0
    sample = res.get("partial_unexpected_list") or []
    text = f"{count} of {total} values unexpected ({100.0 * count / max(total, 1):.2f}%)"
    if sample:
        text += f", e.g. {_short(sample[:8])}"
    if missing and kind != "expect_column_values_to_not_be_null":
        text += f"; {missing} null"
    return text


def _short(value: Any, limit: int = 8) -> str:
    if isinstance(value, (list, tuple, set)):
        items = list(value)
        if len(items) > limit:
            head = ", ".join(_short(v) for v in items[:3])
            return f"[{head}, ... ({len(items)} items)]"
        return "[" + ", ".join(_short(v) for v in items) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "gangflow"


def _run_name(context: Any) -> str:
    try:
        run_id = context.get("run_id") if hasattr(context, "get") else None
    except Exception:  # noqa: BLE001 - a label only
        run_id = None
    return str(run_id or "manual")
