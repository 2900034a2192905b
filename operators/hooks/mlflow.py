"""MLflow plumbing shared by the training, evaluation and promotion tasks: one MLflow run per DAG
run (`ensure_run` reuses it on a retried task).

Every call that talks to MLflow goes through `mlflow_errors`, which turns connection and server
failures into `RegistryUnavailable` (infra: retried). mlflow is imported only when used.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from operators.config import settings
from operators.exceptions import RegistryUnavailable, UserError
from trainer.urls import credentials_refusal, has_credentials, redact_url

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

TAG_DAG_ID = "gangflow.dag_id"
TAG_DAG_RUN_ID = "gangflow.dag_run_id"
# What a retry looks its run up by: `settings.run_identity` (deployment, DAG id, raw run id), so
# two deployments sharing an MLflow server never adopt each other's run.
TAG_RUN_IDENTITY = "gangflow.run_identity"

_LOCAL_SCHEMES = frozenset({"", "file", "sqlite"})


def is_local_store(tracking_uri: str) -> bool:
    """True for the embedded default (SQLite or a file store), where MLflow would otherwise put
    artifacts in ./mlruns relative to whatever the worker's cwd happens to be."""
    if tracking_uri.split(":", 1)[0] in ("databricks", "databricks-uc", "uc"):
        return False
    scheme = urlparse(tracking_uri).scheme
    return scheme in _LOCAL_SCHEMES or len(scheme) == 1  # "C:" on Windows paths


@contextlib.contextmanager
def mlflow_errors(tracking_uri: str | None, what: str) -> Iterator[None]:
    """Translate "MLflow is unreachable" into `RegistryUnavailable` naming the URI.

    Other errors (a bad request, a missing run) pass through unchanged.
    """
    from trainer.failure_catalogue import transient_exception

    try:
        yield
    except RegistryUnavailable:
        raise
    except Exception as exc:
        if transient_exception(exc):  # connection errors, timeouts, 5xx/429, busy database: the one catalogue
            uri = redact_url(tracking_uri or settings.tracking_uri())
            # MLflow's text repeats the URL it called, password included: only a redacted copy goes on
            cause = f"{type(exc).__name__}: {redact_url(str(exc))}"
            raise RegistryUnavailable(f"MLflow at {uri} unavailable while trying to {what}: {cause}") from None
        raise


def get_client(tracking_uri: str | None = None) -> MlflowClient:
    """An `MlflowClient` for tracking and the model registry (both on the same URI).

    Default: `settings.tracking_uri()` (MLFLOW_TRACKING_URI, else SQLite under the state dir).
    Also turns MLflow's artifact progress bars off (unless set): they flood Airflow task logs.
    """
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from trainer.tracking import mlflow_client

    if has_credentials(tracking_uri):  # a setting (an operator argument): it would reach logs and XCom
        raise UserError(credentials_refusal("tracking_uri", tracking_uri, "from MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN"))
    uri = tracking_uri or settings.tracking_uri()
    with mlflow_errors(uri, "connect"):
        return mlflow_client(uri)


@contextlib.contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent calls (`Model.log`, `models:/` URIs) read the global tracking URI: point
    it at `uri` meanwhile, then restore both the global and the MLFLOW_TRACKING_URI env var
    (which MLflow's own setter would unset when restoring "no URI set")."""
    import mlflow

    try:
        from mlflow.tracking._tracking_service import utils as tracking_utils

        old_global = getattr(tracking_utils, "_tracking_uri", None)
    except ImportError:  # pragma: no cover - private module moved
        old_global = None
    old_env = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old_global)
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


def client_uri(client: MlflowClient) -> str:
    """The tracking URI a client talks to (for error messages and store-kind checks)."""
    return getattr(client, "_tracking_client").tracking_uri


def ensure_experiment(client: MlflowClient, name: str) -> str:
    """The id of experiment `name`, created if missing.

    On a local store (SQLite/file) the experiment's artifacts go to
    `settings.artifact_root()/<name>` as a file URI; a remote server keeps its own default
    artifact root.
    """
    uri = client_uri(client)
    with mlflow_errors(uri, f"get or create experiment {name!r}"):
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                client.restore_experiment(experiment.experiment_id)
            return experiment.experiment_id
        location = None
        if is_local_store(uri):
            path = settings.artifact_root() / name
            path.mkdir(parents=True, exist_ok=True)
            location = path.as_uri()
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:  # created concurrently by another task
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return client.get_experiment_by_name(name).experiment_id


def find_run(client: MlflowClient, experiment_id: str, *, dag_id: str, dag_run_id: str) -> str | None:
    """The id of the MLflow run created for this DAG run (by its run identity), or None."""
    from mlflow.entities import ViewType

    uri = client_uri(client)
    flt = f"tags.`{TAG_RUN_IDENTITY}` = '{settings.run_identity(dag_id, dag_run_id)}'"
    with mlflow_errors(uri, f"search runs of DAG run {dag_id}/{dag_run_id}"):
        runs = client.search_runs(
            [experiment_id], filter_string=flt, run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1, order_by=["attributes.start_time ASC"],
        )
    return runs[0].info.run_id if runs else None


def ensure_run(
    client: MlflowClient,
    experiment_id: str,
    *,
    dag_id: str,
    dag_run_id: str,
    run_name: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> str:
    """The MLflow run id for this DAG run: reused when a run tagged with the same
    `gangflow.run_identity` exists (a retried task), created otherwise. The run also carries
    `gangflow.dag_id`/`gangflow.dag_run_id` for people."""
    existing = find_run(client, experiment_id, dag_id=dag_id, dag_run_id=dag_run_id)
    if existing is not None:
        log.info("reusing MLflow run %s for DAG run %s/%s", existing, dag_id, dag_run_id)
        return existing
    all_tags = {str(k): str(v) for k, v in (tags or {}).items()}
    all_tags.update({TAG_DAG_ID: dag_id, TAG_DAG_RUN_ID: dag_run_id,
                     TAG_RUN_IDENTITY: settings.run_identity(dag_id, dag_run_id)})
    with mlflow_errors(client_uri(client), f"create a run for DAG run {dag_id}/{dag_run_id}"):
        run = client.create_run(experiment_id, tags=all_tags, run_name=run_name)
    log.info("created MLflow run %s for DAG run %s/%s", run.info.run_id, dag_id, dag_run_id)
    return run.info.run_id


def end_run(client: MlflowClient, run_id: str, *, succeeded: bool) -> None:
    """End the DAG run's MLflow run: FINISHED (promote ran) or FAILED (a task failed for good)."""
    with mlflow_errors(client_uri(client), f"end run {run_id}"):
        client.set_terminated(run_id, "FINISHED" if succeeded else "FAILED")


def _literal(value: str) -> str:
    """A string literal for MLflow's search filter (single-quoted unless the value has one)."""
    value = str(value)
    return f'"{value}"' if "'" in value else f"'{value}'"
