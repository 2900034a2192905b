"""The promote task: register the candidate, score the champion on the same test split, apply
the gate, record why, and move the `champion` alias only when the candidate wins.

A candidate that fails the gate is not a task failure: the DAG run succeeds and the registry
records why nothing was promoted. MLflow being unreachable is `RegistryUnavailable` (retried).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator

from trainer.allowlist import ModelNotAllowed
from trainer.model_card import read_card

from operators.config import settings
from operators.exceptions import RegistryUnavailable, UserError
from operators.registry.gate import Decision, PromotionGate, decide
from operators.registry.lineage import git_commit, git_dirty, lineage_tags, require_commit
from operators.registry.versions import (
    CHAMPION_ALIAS,
    ChampionChanged,
    ChampionEvaluationFailed,
    check_schema,
    current_champion,
    download_model,
    download_version,
    input_schema,
    model_schema,
    move_champion,
    record_decision,
    recorded_decision,
    register_version,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from airflow.sdk import Context

log = logging.getLogger(__name__)


def _number(name: str, value: Any) -> float:
    """A float from a literal or a rendered template ("0.9"); UserError naming the field."""
    if isinstance(value, bool):
        raise UserError(f"{name}={value!r}: must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{name}={value!r}: must be a number") from None


def _is_template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


class PromoteModelOperator(BaseOperator):
    """Register a training run's model and make it the champion if it beats the current one.

    Steps (each safe to repeat when Airflow retries the task):

    1. download the candidate's weights and card from MLflow (`model_uri`, `models:/<model_id>`, the
       model the training task logged: only its `final/`) and get the test
       split of the manifest's dataset version by content address (md5-checked against the
       manifest's `test_md5`);
    2. check that the candidate's input columns (the validated dataset's schema, less the
       label) are the champion's (`SchemaMismatch` otherwise: nothing is registered), then
       register `model_uri` as a version of `model_name` (the signed pyfunc the training task
       logged; see `operators.registry.versions.register_version`): a retry reuses the version already registered
       from `mlflow_run_id`; the version gets the run's `gangflow.*` lineage tags;
    3. if that version already holds the `champion` alias (a retry after the alias moved),
       report it as promoted without deciding again;
    4. score the candidate (`candidate_metrics` from the evaluate task when they are for this
       test file, else a fresh evaluation) and the current champion, downloaded and evaluated
       now ON THE SAME TEST SPLIT; a champion whose card names a factory off the allow-list is
       never loaded: the task fails (`ChampionEvaluationFailed`) and nothing is promoted;
    5. `decide` with `PromotionGate(floor, min_improvement, metric, direction)`: promote iff the
       candidate reaches the floor (a ceiling when lower is better) and beats the champion by
       MORE than `min_improvement`;
    6. record the decision on the version and the registered model (`gangflow.*` tags, see
       docs/registry.md) and, only when promoted, move the `champion` alias by compare-and-set
       (`operators.registry.versions.move_champion`): if another promotion moved it meanwhile, decide
       again against the new champion (at most `max_rounds` times, then `ChampionChanged`,
       retried), so a slower, worse candidate never overwrites a better champion.

    Returns (XCom): `promoted`, `reason`, `model_name`, `model_version` (str, as in MLflow's REST
    API and UI), `candidate_accuracy`, `champion_version` (the champion compared against, str;
    None without one), `champion_accuracy` (None for a regressor), plus `metric`, `direction`,
    `candidate_score`, `champion_score` (the gated metric; equal to the accuracies by default).

    :param model_name: registered model name (templated).
    :param model_uri: the candidate the training task logged (templated), `models:/<model_id>`.
    :param dataset: the validate task's manifest (templated): `version`, `test_md5`, ...
    :param mlflow_run_id: the DAG run's MLflow run (templated); the version links to it.
    :param candidate_metrics: the evaluate task's metrics dict (an XComArg; templated).
    :param floor: the score a candidate needs (templated): at least this when higher is better,
        at most this when lower is better; within `metric_bounds`.
    :param min_improvement: margin over the champion, >= 0 and below the bounds' width (templated).
    :param metric: the metrics key the gate compares (default the class's `metric_name`, accuracy).
    :param direction: "higher" or "lower" is better (default the class's `direction`, higher).
    :param metric_bounds: (lowest, highest) value of the metric, None for unbounded (default
        (0, 1), a share).
    :param lineage: extra version tags, e.g. {"train_try_number": ...}; stored as
        `gangflow.<key>`; `dag_id`, `dag_run_id`, `try_number`, `git_commit`, `mlflow_run_id`
        are filled from the context when absent; `dataset_version`, `dataset_md5` and
        `test_data_md5` always come from the manifest (`dataset`) (templated).
    :param tracking_uri: MLflow tracking/registry URI (templated); default from settings.
    :param allowed_models: `module:function` model factories allowed beside the `gangflow.models`
        entry points (templated), for the candidate and the champion alike.
    :param data_factory: the pipeline's `data.factory`: the test split is read through it (templated).

    Subclassing: set `metric_name` (and `direction`) or pass `metric=`, and override
    `score(metrics)` to compute it, e.g. ``metric_name = "macro_f1"``; override
    `evaluate_model_dir(final_dir, test_path)` to evaluate differently (it scores both candidate
    and champion, so they stay comparable); override `gate()` for another gate policy.
    """

    template_fields: Sequence[str] = (
        "model_name", "model_uri", "dataset", "mlflow_run_id", "candidate_metrics",
        "floor", "min_improvement", "lineage", "tracking_uri", "allowed_models", "data_factory",
    )
    template_fields_renderers = {"dataset": "json", "lineage": "json"}
    ui_color = "#fdf2d0"
    metric_name: ClassVar[str] = "accuracy"
    direction: ClassVar[str] = "higher"
    metric_bounds: ClassVar[tuple[float | None, float | None]] = (0.0, 1.0)
    #: How often the alias may move under this promotion before it gives up (and is retried).
    max_rounds: ClassVar[int] = 5

    def __init__(
        self,
        *,
        model_name: str,
        model_uri: str,
        dataset: Mapping[str, Any] | str,
        mlflow_run_id: str,
        candidate_metrics: Mapping[str, Any] | None = None,
        floor: float | str = 0.9,
        min_improvement: float | str = 0.0,
        lineage: Mapping[str, Any] | None = None,
        tracking_uri: str | None = None,
        allowed_models: Sequence[str] | None = None,
        metric: str | None = None,
        direction: str | None = None,
        metric_bounds: Sequence[float | None] | None = None,
        data_factory: str | None = None,
        evaluation_entrypoint: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("multiple_outputs", True)  # `promote.output["model_version"]` in a DAG of one's own
        super().__init__(**kwargs)
        self.data_factory = data_factory
        self.evaluation_entrypoint = evaluation_entrypoint
        if metric:
            self.metric_name = metric
        if direction:
            self.direction = direction
        if metric_bounds is not None:
            self.metric_bounds = tuple(metric_bounds)
        self.model_name = model_name
        self.model_uri = model_uri
        self.dataset = dataset
        self.mlflow_run_id = mlflow_run_id
        self.candidate_metrics = candidate_metrics
        self.floor = floor
        self.min_improvement = min_improvement
        self.lineage = lineage
        self.tracking_uri = tracking_uri
        self.allowed_models = allowed_models
        if not (_is_template(floor) or _is_template(min_improvement)) and all(
            isinstance(v, (int, float)) for v in (floor, min_improvement)
        ):
            try:  # fail at DAG parse time on literal bad values
                PromotionGate(floor=floor, min_improvement=min_improvement, metric=self.metric_name,
                              direction=self.direction, bounds=self.metric_bounds)
            except ValueError as exc:
                raise ValueError(f"{self.task_id}: {exc}") from None

    # -- hooks -----------------------------------------------------------------------------

    def gate(self) -> PromotionGate:
        try:
            return PromotionGate(
                floor=_number("floor", self.floor),
                min_improvement=_number("min_improvement", self.min_improvement),
                metric=self.metric_name,
                direction=self.direction,
                bounds=self.metric_bounds,
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None

    def score(self, metrics: Mapping[str, Any]) -> float:
        """The number the gate compares; default `metrics[metric_name]` (accuracy)."""
        if self.metric_name not in metrics:
            raise UserError(f"metric={self.metric_name!r} is not among the evaluation's metrics "
                            f"({', '.join(sorted(k for k, v in metrics.items() if isinstance(v, (int, float))))}): "
                            "set the pipeline's metric.name to one of them")
        return float(metrics[self.metric_name])

    def evaluate_model_dir(self, final_dir: Path, test_path: Path) -> dict[str, Any]:
        """Metrics of the model in `final_dir` on `test_path` (candidate and champion alike)."""
        from operators.evaluation import evaluate_final_dir, score_with_entrypoint

        if self.evaluation_entrypoint:  # the pipeline's own evaluation (models of one's own code)
            return score_with_entrypoint(self.evaluation_entrypoint, final_dir, test_path)

        return evaluate_final_dir(final_dir, test_path, allowed_models=self.allowed_models,
                                  data_factory=self.data_factory or None)

    # -- steps -----------------------------------------------------------------------------

    def candidate_metrics_for(self, final_dir: Path, test_path: Path, test_md5: str) -> dict[str, Any]:
        """The evaluate task's metrics when they are for this test file, else a fresh evaluation."""
        given = dict(self.candidate_metrics) if isinstance(self.candidate_metrics, Mapping) else None
        if given and self.metric_name in given:
            md5 = given.get("test_md5")
            if md5 == test_md5:
                return given
            log.warning("candidate metrics were computed on another test file (md5 %s, not %s): re-evaluating",
                        md5, test_md5)
        elif self.candidate_metrics:
            log.warning("candidate_metrics lack %r: re-evaluating the candidate", self.metric_name)
        return self.evaluate_model_dir(final_dir, test_path)

    def champion_metrics(self, client: MlflowClient, champion: ModelVersion, test_path: Path) -> dict[str, Any]:
        """Download the champion and evaluate it on the same test split."""
        with tempfile.TemporaryDirectory(prefix="gangflow-champion-") as tmp:
            final_dir = download_version(client, champion, tmp)
            try:
                return self.evaluate_model_dir(final_dir, test_path)
            except (RegistryUnavailable, UserError):
                raise
            except ModelNotAllowed as exc:  # a card naming code we do not run: never load it
                raise ChampionEvaluationFailed(
                    f"refusing to load champion {champion.name} v{champion.version}: {exc}. Nothing was promoted; "
                    "allow its factory (allowed_models, GANGFLOW_ALLOWED_MODELS) if you trust it, or point the "
                    f"'{CHAMPION_ALIAS}' alias at a version you do trust (docs/registry.md)."
                ) from exc
            except Exception as exc:
                raise ChampionEvaluationFailed(
                    f"cannot evaluate champion {champion.name} v{champion.version} on the test split: "
                    f"{type(exc).__name__}: {exc}. Nothing was promoted. If the dataset's schema changed, the "
                    "candidate is a model of other data: give its pipeline another model_name rather than "
                    f"removing the '{CHAMPION_ALIAS}' alias (docs/registry.md)."
                ) from exc

    def input_schema(self, manifest: Mapping[str, Any], test_path: Path) -> dict[str, str]:
        """The model's input columns and dtypes: the validated dataset's schema (the manifest's
        `schema`, else the test file's) without the label."""
        schema = manifest.get("schema")
        if not isinstance(schema, Mapping) or not schema:
            import pyarrow.parquet as pq

            schema = {f.name: str(f.type) for f in pq.read_schema(test_path)}
        return input_schema(schema)

    def input_example(self, test_path: Path, schema: Mapping[str, str], rows: int = 5) -> Any:
        """A few rows of the test split's feature columns: the registered model's input example."""
        import pyarrow.parquet as pq

        return pq.read_table(test_path, columns=list(schema)).slice(0, rows).to_pandas()

    def lineage_for(self, context: Context, candidate_metrics: Mapping[str, Any], final_dir: Path,
                    manifest: Mapping[str, Any]) -> dict[str, str]:
        ti = context.get("ti") if isinstance(context, Mapping) else None
        dag_run = context.get("dag_run") if isinstance(context, Mapping) else None
        # The dataset's lineage has one route: the validate task's manifest (it wins over `lineage`
        # and over the run's tags, which `register_version` copies first).
        dataset = {"dataset_version": manifest.get("version"), "dataset_md5": manifest.get("train_md5"),
                   "test_data_md5": manifest.get("test_md5")}
        return lineage_tags(
            {**dict(self.lineage or {}), **{k: v for k, v in dataset.items() if v is not None}},
            dag_id=getattr(ti, "dag_id", None) or getattr(self, "dag_id", None),
            dag_run_id=(context.get("run_id") if isinstance(context, Mapping) else None)
            or getattr(dag_run, "run_id", None) or getattr(ti, "run_id", None),
            try_number=getattr(ti, "try_number", None),
            git_commit=require_commit(git_commit()),  # before anything is registered
            git_dirty=git_dirty(),
            mlflow_run_id=str(self.mlflow_run_id),
            model_uri=str(self.model_uri),
            **_card_lineage(final_dir),
        )

    # -- execute ---------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        from operators.evaluation import fetch_test_split, manifest_of
        from operators.hooks.mlflow import get_client

        gate = self.gate()
        if not self.mlflow_run_id:
            raise UserError("mlflow_run_id is empty: the version must link to the DAG run's MLflow run")
        try:  # settings the metrics read after promoting: a bad one is refused before anything moves
            settings.metrics_address(), settings.metrics_linger_s()
        except ValueError as exc:
            raise UserError(str(exc)) from None
        manifest = manifest_of(self.dataset)
        client = get_client(self.tracking_uri or None)
        with tempfile.TemporaryDirectory(prefix="gangflow-promote-") as tmp:
            final_dir = download_model(client, str(self.model_uri), Path(tmp) / "candidate")
            test_path = fetch_test_split(manifest, Path(tmp) / "data")
            result = self._promote(context, client, gate, final_dir, test_path, manifest)
        self.publish_metrics(context, result)
        from operators.hooks.mlflow import end_run

        end_run(client, str(self.mlflow_run_id), succeeded=True)  # the DAG run's last step: its MLflow run ends
        return result

    def publish_metrics(self, context: Context, result: Mapping[str, Any]) -> None:
        """The version promote registered, as a Prometheus series of the run (docs/observability.md)."""
        from operators.hooks.prometheus import publish_promotion
        from operators.training import gang_name, pipeline_of

        dag_id, run_id = context["ti"].dag_id, context["run_id"]
        labels = {"dag_id": dag_id, "dag_run_id": run_id, "pipeline": pipeline_of(context) or "", "gang": gang_name(dag_id, run_id)}
        publish_promotion(labels, mlflow_run_id=str(self.mlflow_run_id), model_name=str(result["model_name"]),
                          model_version=result["model_version"], promoted=bool(result["promoted"]), log=log.info)

    def _promote(self, context: Context, client: MlflowClient, gate: PromotionGate, final_dir: Path,
                 test_path: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
        name = str(self.model_name)
        candidate_metrics = self.candidate_metrics_for(final_dir, test_path, str(manifest["test_md5"]))
        candidate_score = self.score(candidate_metrics)
        schema = self.input_schema(manifest, test_path)
        champion = current_champion(client, name)
        if champion is not None and str(champion.run_id) != str(self.mlflow_run_id):  # before registering
            check_schema(schema, model_schema(client, champion), name=name, champion_version=champion.version,
                         dataset_version=manifest.get("version"))
        # The training task logged the model once (`models:/<model_id>`): that is what is registered.
        # An older `runs:/<run>/final` is logged here from the files just downloaded.
        logged = str(self.model_uri).startswith("models:/")
        version = register_version(
            client, name, run_id=str(self.mlflow_run_id),
            source_dir_or_artifact_path=str(self.model_uri) if logged else final_dir,
            tags=self.lineage_for(context, candidate_metrics, final_dir, manifest), schema=schema,
            input_example=None if logged else self.input_example(test_path, schema),
            allowed_models=self.allowed_models,
        )
        for _ in range(self.max_rounds):
            if champion is not None and str(champion.version) == str(version.version):
                recorded = recorded_decision(client.get_model_version(name, str(version.version)))
                reason = recorded.get("gangflow.reason") or f"{name} v{version.version} already holds the alias"
                log.info("%s v%s already holds @%s (a retried task): not deciding again. %s",
                         name, version.version, CHAMPION_ALIAS, reason)
                prev_version = recorded.get("gangflow.champion_version", "none")
                prev_score = recorded.get(f"gangflow.champion_{gate.metric}", "none")
                return self._result(
                    Decision(True, reason), version, candidate_metrics, candidate_score,
                    champion_version=None if prev_version == "none" else prev_version,
                    champion_metrics=None, champion_score=None if prev_score == "none" else float(prev_score),
                )

            champion_metrics = self.champion_metrics(client, champion, test_path) if champion is not None else None
            champion_score = self.score(champion_metrics) if champion_metrics is not None else None
            decision = decide(candidate_score, champion_score, gate,
                              champion_version=champion.version if champion is not None else None)
            record_decision(client, version, decision, candidate_score=candidate_score, champion=champion,
                            champion_score=champion_score, gate=gate)
            result = self._result(
                decision, version, candidate_metrics, candidate_score,
                champion_version=str(champion.version) if champion is not None else None,
                champion_metrics=champion_metrics, champion_score=champion_score,
            )
            if not decision.promote:
                stays = f"champion stays v{champion.version}" if champion is not None else "there is still no champion"
                log.info("NOT PROMOTED %s v%s (%s). %s", name, version.version, stays, decision.reason)
                return result
            moved, now = move_champion(client, version, expected=champion, metric=gate.metric)
            if moved:
                log.info("PROMOTED %s v%s to @%s. %s", name, version.version, CHAMPION_ALIAS, decision.reason)
                return result
            was = f"v{champion.version}" if champion is not None else "no champion"
            log.warning("the %s alias of %s moved from %s to %s while this promotion decided: not moving it; "
                        "deciding again against the new champion", CHAMPION_ALIAS, name, was,
                        f"v{now.version}" if now is not None else "none")
            champion = now
        raise ChampionChanged(
            f"the {CHAMPION_ALIAS} alias of {name} moved {self.max_rounds} times while v{version.version} was being "
            "decided (promotions racing); nothing was moved by this try, the retry decides again"
        )

    def _result(
        self,
        decision: Decision,
        version: ModelVersion,
        candidate_metrics: Mapping[str, Any],
        candidate_score: float,
        *,
        champion_version: str | None,
        champion_metrics: Mapping[str, Any] | None,
        champion_score: float | None,
    ) -> dict[str, Any]:
        def acc(metrics: Mapping[str, Any] | None, fallback: float | None) -> float | None:
            if metrics is not None and "accuracy" in metrics:
                return float(metrics["accuracy"])
            return fallback if self.metric_name == "accuracy" else None

        return {
            "promoted": bool(decision.promote),
            "reason": decision.reason,
            "model_name": str(self.model_name),
            "model_version": str(version.version),
            "candidate_accuracy": acc(candidate_metrics, candidate_score),
            "champion_version": champion_version,
            "champion_accuracy": acc(champion_metrics, champion_score),
            "metric": self.metric_name,
            "direction": self.direction,
            "candidate_score": float(candidate_score),
            "champion_score": None if champion_score is None else float(champion_score),
        }


def _card_lineage(final_dir: Path) -> dict[str, Any]:
    """Lineage the model card carries (data md5s, model factory), as `card_*` entries."""
    card = read_card(final_dir)
    found: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{path}_{key}" if path else str(key))
        elif ("md5" in path or path.endswith("factory")) and isinstance(node, str) and node:
            found[f"card_{path}"] = node

    walk(card, "")
    return found
