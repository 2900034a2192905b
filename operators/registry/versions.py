"""Model-registry calls: idempotent registration, the champion alias, downloads, pyfunc logging,
schema checks and the audit trail of a decision. Small functions over an `MlflowClient`, so each
is testable on its own; `operators.promotion.PromoteModelOperator` strings them together with
the gate (`operators.registry.gate`) and lineage (`operators.registry.lineage`).

Nothing here imports mlflow at import time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.exceptions import InfraError, UserError
from operators.hooks.mlflow import client_uri, mlflow_errors, use_tracking_uri
from operators.registry.gate import Decision, PromotionGate
from operators.registry.lineage import run_lineage

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
LOGGED_MODEL_NAME = "model"

TAG_DECISION = "gangflow.decision"  # "promoted" | "rejected"
TAG_REASON = "gangflow.reason"
TAG_METRIC = "gangflow.gate_metric"
TAG_GATE = "gangflow.gate"
TAG_CHAMPION_VERSION = "gangflow.champion_version"
TAG_DECIDED_AT = "gangflow.decided_at"
TAG_LAST_DECISION = "gangflow.last_decision"  # on the registered model
TAG_LAST_DECIDED_AT = "gangflow.last_decided_at"  # on the registered model
TAG_MLFLOW_RUN_ID = "gangflow.mlflow_run_id"
TAG_INPUT_SCHEMA = "gangflow.input_schema"  # JSON {column: dtype} of the model's input


class ModelNotFound(UserError):
    """No final weights at the model URI the training task returned."""


class ChampionChanged(InfraError):
    """The champion alias kept moving while this promotion decided (other promotions racing);
    retried: the next try decides against the champion of that moment."""


class ChampionEvaluationFailed(UserError):
    """The current champion could not be loaded or evaluated on the candidate's test split;
    a person must decide (retrying would not help)."""


class SchemaMismatch(UserError):
    """The candidate's input columns differ from the champion's: a model of other data cannot
    replace it (checked before anything is registered)."""


# --------------------------------------------------------------------------- registry calls


def _literal(value: str) -> str:
    value = str(value)
    return f'"{value}"' if "'" in value else f"'{value}'"


def ensure_registered_model(client: MlflowClient, name: str, *, description: str | None = None) -> None:
    """Create registered model `name` unless it exists."""
    from mlflow.exceptions import MlflowException

    with mlflow_errors(client_uri(client), f"create registered model {name!r}"):
        try:
            client.create_registered_model(
                name, description=description or "Registered by gangflow; see docs/registry.md for the gate "
                                                  "and the gangflow.* audit tags.")
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise


def find_version_for_run(client: MlflowClient, name: str, run_id: str) -> ModelVersion | None:
    """The (lowest) version of `name` registered from MLflow run `run_id`, or None."""
    with mlflow_errors(client_uri(client), f"search versions of {name!r} for run {run_id}"):
        versions = client.search_model_versions(f"name={_literal(name)} AND run_id={_literal(run_id)}")
    versions = [v for v in versions if v.name == name and v.run_id == run_id]
    return min(versions, key=lambda v: int(v.version)) if versions else None


def input_schema(dataset_schema: Mapping[str, str], label: str | None = None) -> dict[str, str]:
    """The model's input columns and dtypes: the validated dataset's schema (the manifest's
    `schema`, {column: dtype}) without the label column."""
    from operators.registry.served_model import LABEL_COLUMN

    label = label or LABEL_COLUMN
    return {str(c): str(t) for c, t in dataset_schema.items() if c != label}


def _colspec_type(dtype: str) -> str:
    dtype = dtype.lower()
    if dtype.startswith(("float", "double")):
        return "double"  # float32 inputs are accepted (widened); MLflow refuses narrowing
    if dtype.startswith(("int", "uint")):
        return "long"
    if dtype.startswith("bool"):
        return "boolean"
    return "string"


def _pyfunc_signature(schema: Mapping[str, str]):
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec(_colspec_type(t), c) for c, t in schema.items()]))


def model_schema(client: MlflowClient, version: ModelVersion) -> dict[str, str] | None:
    """A registered version's input columns: its `gangflow.input_schema` tag, else the column
    names of its MLflow signature (versions registered before the tag); None when neither."""
    tagged = (version.tags or {}).get(TAG_INPUT_SCHEMA)
    if tagged:
        try:
            return {str(k): str(v) for k, v in json.loads(tagged).items()}
        except (ValueError, AttributeError):
            log.warning("%s v%s: unreadable %s tag %r", version.name, version.version, TAG_INPUT_SCHEMA, tagged[:200])
    try:
        from mlflow.models import get_model_info

        with use_tracking_uri(client_uri(client)):
            signature = get_model_info(f"models:/{version.name}/{version.version}").signature
    except Exception as exc:  # noqa: BLE001 - no MLmodel (a plain folder version): nothing to compare
        log.info("%s v%s has no readable signature (%s)", version.name, version.version, exc)
        return None
    if signature is None or signature.inputs is None:
        return None
    return {str(spec.name): str(spec.type) for spec in signature.inputs.inputs if spec.name}


def check_schema(candidate: Mapping[str, str], champion: Mapping[str, str] | None, *, name: str,
                 champion_version: str | int, dataset_version: str | None = None) -> None:
    """Refuse (SchemaMismatch) a candidate whose input columns differ from the champion's.

    Column names and order are compared (dtypes only by kind: the signature widens floats)."""
    if champion is None:
        return
    ours, theirs = list(candidate), list(champion)
    if ours == theirs:
        return
    data = f" (dataset version {dataset_version})" if dataset_version else ""
    missing, extra = [c for c in theirs if c not in ours], [c for c in ours if c not in theirs]
    detail = (f"; missing {_few(missing)}" if missing else "") + (f"; unexpected {_few(extra)}" if extra else "")
    if not missing and not extra:
        detail = "; same columns in another order"
    raise SchemaMismatch(
        f"expected columns {_few(theirs)} (champion {name} v{champion_version}), got {_few(ours)} from the "
        f"candidate's data{data}{detail}. Nothing was registered: a model of other data cannot replace this "
        f"champion; register it under another model_name (its own pipeline file) instead."
    )


def _few(columns: list[str], limit: int = 6) -> str:
    if len(columns) <= limit:
        return "[" + ", ".join(columns) + "]"
    return "[" + ", ".join(columns[:limit]) + f", ... ({len(columns)} in all)]"


def _pip_requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    reqs = []
    for dist in ("torch", "safetensors", "numpy", "pandas", "mlflow"):
        try:
            reqs.append(f"{dist}=={version(dist).split('+')[0]}")  # 2.13.0+cpu -> 2.13.0
        except PackageNotFoundError:
            reqs.append(dist)
    return reqs


def _copy_sources(src: Path, dst: Path) -> None:
    """The `*.py` files of a package folder (or one module file), no bytecode caches (another
    process may be rewriting them)."""
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst.with_suffix(".py"))
        return
    for path in sorted(src.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def user_code_location(factory: str) -> Path | None:
    """The source of the top-level package (or module) of a `module:function` model factory,
    when it is user code to bundle: importable, not `trainer` (always bundled) and not an
    installed distribution (site-packages: that is a requirement, not code). Found without
    importing it."""
    import importlib.util
    import sysconfig

    top = factory.partition(":")[0].split(".")[0]
    if not top or top == "trainer":
        return None
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    location = origin.parent if origin.name == "__init__.py" else origin
    installed = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    if any(location.is_relative_to(root) for root in installed) or location.suffix not in ("", ".py"):
        return None
    return location


def _bundled_code(staging: Path, factory: str | None = None) -> list[str]:
    """The sources bundled with every model (MLflow `code_paths`, put first on `sys.path` when
    the model loads): the `trainer` package (its guarded loader, `trainer.export` and
    `trainer.allowlist`, is how the pyfunc rebuilds the module, and the built-in model code
    travels with the weights it was trained with), and the package of a user model `factory`
    (`mypkg.models:tiny_cnn` bundles `mypkg/`), so the model loads where neither is installed."""
    # Imported first, so that MLflow's validation load (which puts the bundled copy on sys.path)
    # finds the installed package in sys.modules instead of importing a temporary copy.
    import trainer.export  # noqa: F401

    paths = []
    src = Path(sys.modules["trainer"].__file__).resolve().parent
    _copy_sources(src, staging / "trainer")
    paths.append(str(staging / "trainer"))
    user = user_code_location(factory) if factory else None
    if user is not None:
        _copy_sources(user, staging / user.name)
        paths.append(str(staging / user.name))
        log.info("bundling the model factory's code %s with the model (MLflow code_paths)", user)
    return paths


def _user_folder(final_dir: Path) -> bool:
    """Whether `final_dir` is a folder that training code of one's own published (`run.log_model`):
    its model card says `"kind": "folder"`; the tokenizer, config and other files it holds belong
    to the model (its `evaluation.entrypoint` reads them for the champion too)."""
    from operators.registry import served_model

    try:
        return json.loads((final_dir / served_model.CARD_FILE).read_text()).get("kind") == "folder"
    except (OSError, ValueError, AttributeError):
        return False


def log_pyfunc_model(
    client: MlflowClient,
    run_id: str,
    final_dir: str | Path,
    *,
    name: str = LOGGED_MODEL_NAME,
    tags: Mapping[str, str] | None = None,
    schema: Mapping[str, str] | None = None,
    input_example: Any = None,
) -> str:
    """Log `final_dir` (model.safetensors + model_card.json) as an MLflow pyfunc *from code*
    (operators/registry/served_model.py, no pickle), linked to run `run_id`; returns the model id
    (register `models:/<model_id>`). The `trainer` package is bundled (`code/trainer/`): the
    pyfunc loads through its allow-listed loader, also where gangflow is not installed.

    `schema` ({column: dtype}, from the validated dataset) is the signature and the pyfunc's
    input columns (its `model_config`); `input_example` a few rows of the test split. Without
    them: the digits columns `pixel_00..63` and a row of zeros (callers before pipelines)."""
    import mlflow
    import pandas as pd
    from mlflow.models import Model

    from operators.registry import served_model

    final_dir = Path(final_dir)
    uri = client_uri(client)
    with mlflow_errors(uri, f"log the model of run {run_id}"), tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "final"  # only the files the model needs, whatever else final/ holds
        staged.mkdir()
        for fname in (served_model.WEIGHTS_FILE, served_model.CARD_FILE):
            if not (final_dir / fname).is_file():
                raise UserError(f"cannot register {final_dir}: {fname} is missing")
            shutil.copy2(final_dir / fname, staged / fname)
        if _user_folder(final_dir):  # training code of one's own: its evaluation reads the whole folder
            for path in sorted(final_dir.rglob("*")):
                if path.is_file() and not path.is_symlink() and not any(p.is_symlink() for p in path.parents):
                    (staged / path.relative_to(final_dir)).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, staged / path.relative_to(final_dir))
        experiment_id = client.get_run(run_id).info.experiment_id
        logged = client.create_logged_model(
            experiment_id, name=name, source_run_id=run_id,
            tags={str(k): str(v) for k, v in (tags or {}).items()}, model_type="gangflow-safetensors",
        )
        if schema is None:
            schema = {c: "float32" for c in served_model.FEATURE_COLUMNS}
        example = input_example
        if example is None:
            example = pd.DataFrame([[0.0] * len(schema)], columns=list(schema))
        task = served_model.card_task(staged)
        with use_tracking_uri(uri):
            Model.log(
                artifact_path=None,
                name=name,
                flavor=mlflow.pyfunc,
                run_id=run_id,
                model_id=logged.model_id,
                python_model=str(Path(served_model.__file__).resolve()),
                artifacts={"final": str(staged)},
                signature=_pyfunc_signature(schema),
                input_example=example,
                model_config={"features": list(schema), "task": task},
                pip_requirements=_pip_requirements(),
                code_paths=_bundled_code(Path(tmp) / "code", served_model.card_factory(staged)),
            )
    return logged.model_id


def register_version(
    client: MlflowClient,
    name: str,
    *,
    run_id: str,
    source_dir_or_artifact_path: str | Path,
    tags: Mapping[str, Any] | None = None,
    schema: Mapping[str, str] | None = None,
    input_example: Any = None,
) -> ModelVersion:
    """Register the model of MLflow run `run_id` as a new version of `name`, IDEMPOTENTLY.

    If a version of `name` from the same run exists (a retried task), it is returned and nothing
    is logged or registered again. Otherwise:

    * a local directory (a run's `final/` dir) is logged as a pyfunc LoggedModel from code
      (`log_pyfunc_model`) and registered as `models:/<model_id>`;
    * anything else is taken as an artifact URI (`runs:/<id>/model`, `models:/<model_id>`,
      `file://...`, `s3://...`) and registered as is.

    The version gets every `gangflow.*` lineage tag of the run (gang, job UID, image digest,
    dataset version: whatever the training task and backend recorded), then `tags` (lineage,
    winning over the run's), plus `gangflow.mlflow_run_id` and, with `schema` (the model's
    input columns, see `log_pyfunc_model`), `gangflow.input_schema`.
    """
    tags = {**run_lineage(client, run_id), **{str(k): str(v) for k, v in (tags or {}).items()}}
    tags.setdefault(TAG_MLFLOW_RUN_ID, run_id)
    if schema is not None:
        tags[TAG_INPUT_SCHEMA] = json.dumps(dict(schema))[:5000]
    ensure_registered_model(client, name)
    existing = find_version_for_run(client, name, run_id)
    if existing is not None:
        log.info("model %s v%s is already registered from run %s: reusing it", name, existing.version, run_id)
        return existing
    uri = client_uri(client)
    source = str(source_dir_or_artifact_path)
    model_id = None
    if "://" not in source and Path(source).is_dir():
        model_id = log_pyfunc_model(client, run_id, source, tags={TAG_MLFLOW_RUN_ID: run_id}, schema=schema,
                                    input_example=input_example)
        source = f"models:/{model_id}"
    elif source.startswith("models:/m-"):
        model_id = source.removeprefix("models:/")
    with mlflow_errors(uri, f"create a version of {name!r}"):
        # The SQL registry resolves `models:/<id>` through the *global* tracking URI.
        with use_tracking_uri(uri):
            version = client.create_model_version(name, source=source, run_id=run_id, tags=tags, model_id=model_id)
        if model_id is not None:
            try:  # shows the version on the LoggedModel's page in the UI; cosmetic
                client.set_logged_model_tags(model_id, {"gangflow.registered_as": f"{name}/{version.version}"})
            except Exception as exc:  # noqa: BLE001
                log.debug("could not tag logged model %s: %s", model_id, exc)
    log.info("registered %s v%s from run %s (source %s)", name, version.version, run_id, source)
    return version


def current_champion(client: MlflowClient, name: str) -> ModelVersion | None:
    """The version holding the `champion` alias, or None (no alias, or no such model)."""
    from mlflow.exceptions import MlflowException

    with mlflow_errors(client_uri(client), f"read the champion of {name!r}"):
        try:
            model = client.get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
                return None
            raise
        version = (model.aliases or {}).get(CHAMPION_ALIAS)
        if version is None:
            return None
        return client.get_model_version(name, str(version))


def holds_champion(client: MlflowClient, version: ModelVersion) -> bool:
    champion = current_champion(client, version.name)
    return champion is not None and str(champion.version) == str(version.version)


def _weights_dir(local: Path, what: str) -> Path:
    hits = sorted(local.rglob("model.safetensors"), key=lambda p: len(p.parts))
    if not hits:
        raise ModelNotFound(f"{what} has no model.safetensors: did training finish and log its final weights?")
    return hits[0].parent


def download_model(client: MlflowClient, model_uri: str, dst: str | Path) -> Path:
    """Download a model's artifacts (`runs:/<run>/final`, what the training task returns, or any
    MLflow artifact URI) under `dst`; return the folder holding `model.safetensors`.

    This is how evaluate and promote get a candidate: through MLflow, never from a path on the
    worker that trained it. The files are data: load them with `load_final_model` (allow-listed),
    never by executing anything they contain."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = client_uri(client)
    Path(dst).mkdir(parents=True, exist_ok=True)
    with mlflow_errors(uri, f"download {model_uri}"):
        try:
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=str(model_uri), dst_path=str(dst),
                                                             tracking_uri=uri))
        except (MlflowException, OSError) as exc:
            if isinstance(exc, MlflowException) and exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND",
                                                                            "INVALID_PARAMETER_VALUE"):
                raise
            if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                raise
            raise ModelNotFound(f"no model at {model_uri} (MLflow at {uri}): {exc}") from exc
    return _weights_dir(local, str(model_uri))


def download_version(client: MlflowClient, version: ModelVersion, dst: str | Path) -> Path:
    """Download a version's artifacts under `dst` and return the folder holding
    `model.safetensors` (the pyfunc's `artifacts/final/`, or the root of a plain folder)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    uri = client_uri(client)
    Path(dst).mkdir(parents=True, exist_ok=True)
    with mlflow_errors(uri, f"download {version.name} v{version.version}"):
        source = client.get_model_version_download_uri(version.name, str(version.version))
        local = Path(get_artifact_repository(source).download_artifacts("", str(dst)))
    try:
        return _weights_dir(local, f"{version.name} v{version.version} ({source})")
    except ModelNotFound as exc:
        raise ChampionEvaluationFailed(str(exc)) from None


def _fmt(value: float | None) -> str:
    return "none" if value is None else f"{value:.6f}"


def record_decision(
    client: MlflowClient,
    version: ModelVersion,
    decision: Decision,
    *,
    candidate_score: float,
    champion: ModelVersion | None = None,
    champion_score: float | None = None,
    gate: PromotionGate | None = None,
    decided_at: datetime | None = None,
) -> dict[str, str]:
    """Write the audit trail of one promotion decision and return the version tags written.

    On the model version: tags `gangflow.decision` (promoted|rejected), `gangflow.reason`,
    `gangflow.candidate_<metric>`, `gangflow.champion_version` ("none" if none),
    `gangflow.champion_<metric>`, `gangflow.gate_metric`, `gangflow.gate`, `gangflow.decided_at`
    (UTC ISO 8601), and the reason as the version's description. On the registered model: tags
    `gangflow.last_decision` ("v<N> promoted|rejected: <reason>") and `gangflow.last_decided_at`;
    when promoted, also the model's description. Does NOT move the alias (see `promote`).
    """
    gate = gate or PromotionGate()
    m = gate.metric
    when = (decided_at or datetime.now(timezone.utc)).isoformat(timespec="seconds")
    verdict = "promoted" if decision.promote else "rejected"
    tags = {
        TAG_DECISION: verdict,
        TAG_REASON: decision.reason,
        f"gangflow.candidate_{m}": _fmt(candidate_score),
        TAG_CHAMPION_VERSION: str(champion.version) if champion is not None else "none",
        f"gangflow.champion_{m}": _fmt(champion_score),
        TAG_METRIC: m,
        TAG_GATE: gate.describe(),
        TAG_DECIDED_AT: when,
    }
    name, number = version.name, str(version.version)
    with mlflow_errors(client_uri(client), f"record the decision on {name} v{number}"):
        for key, value in tags.items():
            client.set_model_version_tag(name, number, key, value)
        client.update_model_version(name, number, description=decision.reason)
        client.set_registered_model_tag(name, TAG_LAST_DECISION, f"v{number} {verdict}: {decision.reason}")
        client.set_registered_model_tag(name, TAG_LAST_DECIDED_AT, when)
        if decision.promote:
            client.update_registered_model(
                name, description=f"Champion: v{number} ({m} {candidate_score:.4f}), promoted {when}. {decision.reason}"
            )
    return tags


def promote(client: MlflowClient, version: ModelVersion) -> None:
    """Point the `champion` alias at `version` unconditionally (an operator's manual fix; the
    promote task moves it with `move_champion`, a compare-and-set)."""
    with mlflow_errors(client_uri(client), f"move the {CHAMPION_ALIAS} alias of {version.name}"):
        client.set_registered_model_alias(version.name, CHAMPION_ALIAS, str(version.version))


def _sqlite_file(tracking_uri: str) -> Path | None:
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


@contextlib.contextmanager
def champion_lock(client: MlflowClient, name: str) -> Iterator[str | None]:
    """Hold the champion lock of registered model `name` for a compare-and-set.

    On a SQLite store (the embedded default) this is an exclusive `flock` on a file beside the
    database: every process that can write that database shares its filesystem, the kernel
    releases the lock when a holder dies (no stale lease to expire), and MLflow offers no
    conditional alias update to build on. On an MLflow server there is no lock to take (a tag
    used as a lease is itself a read-then-write, so it would not exclude anything): yields None,
    and the compare-and-set rests on re-reading the alias right before the move.
    """
    db = _sqlite_file(client_uri(client))
    if db is None:
        yield None
        return
    import fcntl
    import hashlib

    lock = db.with_name(f"{db.name}.champion-{hashlib.sha256(name.encode()).hexdigest()[:12]}.lock")
    with open(lock, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield str(lock)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _champion_state(version: ModelVersion | None, metric: str) -> tuple[str, str] | None:
    """What the compare-and-set compares: the champion's version and its recorded score."""
    if version is None:
        return None
    return str(version.version), (version.tags or {}).get(f"gangflow.candidate_{metric}", "none")


def move_champion(
    client: MlflowClient, version: ModelVersion, *, expected: ModelVersion | None, metric: str = "accuracy"
) -> tuple[bool, ModelVersion | None]:
    """Compare-and-set the `champion` alias: point it at `version` only if it still names
    `expected` (None: no champion) with the score recorded when the decision was made.

    Under `champion_lock`, the alias is re-read just before the move. Returns (moved, the
    champion found): when it changed, nothing moves and the caller decides again against the
    champion found (so a slower, worse candidate never overwrites a better champion).
    """
    with champion_lock(client, version.name):
        current = current_champion(client, version.name)
        if _champion_state(current, metric) != _champion_state(expected, metric):
            return False, current
        promote(client, version)
        return True, current


def recorded_decision(version: ModelVersion) -> dict[str, str]:
    """The `gangflow.*` audit tags already on a version (empty if never decided)."""
    return {k: v for k, v in (version.tags or {}).items() if k.startswith("gangflow.")}
