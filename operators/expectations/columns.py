"""Multi-column Great Expectations checks: one vectorised pass over many columns.

`ExpectColumnsTypesToBe`, `ExpectColumnsValuesToNotBeNull` and `ExpectColumnsValuesToBeBetween` mean
what GX's per-column expectations mean, and each result names every failing column
(`result["details"]["columns"]`). Importing this module registers them with GX (and imports GX:
import it from a suite module, never from a DAG file).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from great_expectations.core.metric_domain_types import MetricDomainTypes
from great_expectations.execution_engine import PandasExecutionEngine
from great_expectations.expectations.expectation import BatchExpectation
from great_expectations.expectations.metrics.metric_provider import metric_value
from great_expectations.expectations.metrics.table_metric_provider import TableMetricProvider
from pydantic.v1 import PrivateAttr

#: Distinct unexpected values kept per failing column (GX's partial_unexpected_list is 20 rows).
EXAMPLES = 8


def _frame(execution_engine: PandasExecutionEngine, metric_domain_kwargs: dict):
    df, _, _ = execution_engine.get_compute_domain(domain_kwargs=metric_domain_kwargs, domain_type=MetricDomainTypes.TABLE)
    return df


class ColumnsDtypes(TableMetricProvider):
    """{column: dtype name, or None when the column is missing}."""

    metric_name = "gangflow.columns.dtypes"
    value_keys = ("columns",)

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine, metric_domain_kwargs, metric_value_kwargs, metrics, runtime_configuration):
        # df.dtypes once: df[c] builds a Series per column (most of this metric's time at 65 columns).
        dtypes = _frame(execution_engine, metric_domain_kwargs).dtypes
        return {c: (str(dtypes[c]) if c in dtypes.index else None) for c in metric_value_kwargs["columns"]}


class ColumnsNullCounts(TableMetricProvider):
    """{column: number of nulls, or None when the column is missing}, one `isna().sum()` pass."""

    metric_name = "gangflow.columns.null_counts"
    value_keys = ("columns",)

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine, metric_domain_kwargs, metric_value_kwargs, metrics, runtime_configuration):
        df = _frame(execution_engine, metric_domain_kwargs)
        columns = list(metric_value_kwargs["columns"])
        present = [c for c in columns if c in df.columns]
        counts = df[present].isna().sum() if present else {}
        return {c: (int(counts[c]) if c in present else None) for c in columns}


class ColumnsOutOfRange(TableMetricProvider):
    """{column: {"count", "examples"}} for columns with non-null values outside [min, max],
    {"missing": True} for missing columns; columns that pass are left out. One comparison over
    the columns' values as a 2-D array (same-dtype columns: no copy per column)."""

    metric_name = "gangflow.columns.out_of_range"
    value_keys = ("columns", "min_value", "max_value")

    @metric_value(engine=PandasExecutionEngine)
    def _pandas(cls, execution_engine, metric_domain_kwargs, metric_value_kwargs, metrics, runtime_configuration):
        df = _frame(execution_engine, metric_domain_kwargs)
        columns = list(metric_value_kwargs["columns"])
        lo, hi = metric_value_kwargs["min_value"], metric_value_kwargs["max_value"]
        out: dict[str, Any] = {c: {"missing": True} for c in columns if c not in df.columns}
        # A non-numeric column cannot be compared with the bounds: name it instead of raising.
        dtypes = df.dtypes
        present = [c for c in columns if c in dtypes.index and dtypes[c].kind in "biuf"]
        out |= {c: {"observed": f"non-numeric dtype {dtypes[c]}"} for c in columns if c in dtypes.index and c not in present}
        if present:
            values = df[present].to_numpy()
            bad = np.zeros(values.shape, dtype=bool)
            if lo is not None:
                bad |= values < lo  # NaN compares False: nulls are the null check's business
            if hi is not None:
                bad |= values > hi
            counts = bad.sum(axis=0)
            for i in np.flatnonzero(counts):
                examples = np.unique(values[bad[:, i], i])[:EXAMPLES]
                out[present[i]] = {"count": int(counts[i]), "examples": [v.item() for v in examples]}
        return out


class _ColumnsExpectation(BatchExpectation):
    """A batch expectation over `columns` whose result details name every failing column."""

    columns: list[str]
    domain_keys: ClassVar[tuple[str, ...]] = ("batch_id",)
    # The configuration built once for one _get_runtime_kwargs call (None outside such a call).
    _configuration_in_call: Any = PrivateAttr(default=None)

    @property
    def configuration(self):  # noqa: ANN201 - GX's ExpectationConfiguration
        built = self._configuration_in_call
        return built if built is not None else super().configuration

    def _get_runtime_kwargs(self, runtime_configuration: dict | None = None) -> dict:
        # GX's version reads `self.configuration` once per kwarg key, and that property rebuilds
        # the whole configuration each time (a pydantic dict() of every field, the 64 column names
        # included): ~10 rebuilds per call, ~40 per expectation and validation; such rebuilds were
        # 28% of a digits validation. Build it once per call (nothing changes the fields within
        # one) and keep nothing after it, so a later change of a field is always seen.
        self._configuration_in_call = super().configuration
        try:
            return super()._get_runtime_kwargs(runtime_configuration)
        finally:
            self._configuration_in_call = None

    def _per_column(self, observed: dict[str, Any], rows: int) -> dict[str, dict]:
        raise NotImplementedError

    def _result(self, failing: dict[str, dict]) -> dict:
        # observed_value is what Data Docs shows: name the failing columns there too.
        observed = f"{len(failing)} of {len(self.columns)} columns failed"
        if failing:
            names = [f"{c} ({_brief(found)})" for c, found in list(failing.items())[:10]]
            observed += ": " + ", ".join(names) + (", ..." if len(failing) > 10 else "")
        return {"success": not failing, "result": {"observed_value": observed, "details": {"columns": failing}}}


def _brief(found: dict) -> str:
    if found.get("missing"):
        return "missing"
    if "observed" in found:
        return str(found["observed"])
    return f"{found['unexpected_count']} of {found['element_count']} rows"


class ExpectColumnsTypesToBe(_ColumnsExpectation):
    """Every column in `columns` has dtype `type_` (pandas dtype name, e.g. "float32")."""

    type_: str
    metric_dependencies = ("gangflow.columns.dtypes",)
    success_keys = ("columns", "type_")
    args_keys = ("columns", "type_")

    def _validate(self, metrics, runtime_configuration=None, execution_engine=None):
        dtypes = metrics["gangflow.columns.dtypes"]
        return self._result({
            c: ({"missing": True} if t is None else {"observed": t}) for c, t in dtypes.items() if t != self.type_
        })  # fmt: skip


class ExpectColumnsValuesToNotBeNull(_ColumnsExpectation):
    """No column in `columns` holds a null (NaN, None, NaT)."""

    metric_dependencies = ("gangflow.columns.null_counts", "table.row_count")
    success_keys = ("columns",)
    args_keys = ("columns",)

    def _validate(self, metrics, runtime_configuration=None, execution_engine=None):
        rows = metrics["table.row_count"]
        failing = {}
        for c, n in metrics["gangflow.columns.null_counts"].items():
            if n is None:
                failing[c] = {"missing": True}
            elif n:
                failing[c] = {"unexpected_count": n, "element_count": rows}
        return self._result(failing)


class ExpectColumnsValuesToBeBetween(_ColumnsExpectation):
    """Every non-null value of every column in `columns` lies in [min_value, max_value] (inclusive)."""

    min_value: float | None = None
    max_value: float | None = None
    metric_dependencies = ("gangflow.columns.out_of_range", "table.row_count")
    success_keys = ("columns", "min_value", "max_value")
    args_keys = ("columns", "min_value", "max_value")

    def _validate(self, metrics, runtime_configuration=None, execution_engine=None):
        rows = metrics["table.row_count"]
        failing = {}
        for c, found in metrics["gangflow.columns.out_of_range"].items():
            failing[c] = found if "count" not in found else {
                "unexpected_count": found["count"], "element_count": rows, "partial_unexpected_list": found["examples"],
            }  # fmt: skip
        return self._result(failing)
