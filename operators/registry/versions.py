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
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.exceptions import InfraError, UserError
from operators.hooks.mlflow import client_uri, mlflow_errors, use_tracking_uri
from operators.registry.gate import Decision, PromotionGate
from operators.registry.lineage import run_lineage
from trainer.model_card import WEIGHTS, card_classes, card_factory, card_task, read_card
from trainer.urls import redact_url

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


class VersionNotTheCandidates(UserError):
    """A version registered from the candidate's run holds another model: someone registered it
    there; nothing is promoted."""


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
    """The MLflow column type of a dataset dtype: the data's own width (float32 is `float`)."""
    dtype = dtype.lower()
    if dtype in ("float", "float32", "float16", "halffloat", "half"):
        return "float"
    if dtype.startswith(("float", "double")):
        return "double"
    if dtype in ("int8", "int16", "int32", "uint8", "uint16", "int"):
        return "integer"
    if dtype.startswith(("int", "uint")):
        return "long"
    if dtype.startswith("bool"):
        return "boolean"
    return "string"


def _pyfunc_signature(schema: Mapping[str, str], outputs: Sequence[tuple[str, str]] | None = None):
    """Inputs: the dataset's feature columns and types; outputs: what `GangflowModel.predict` returns."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    out = Schema([ColSpec(t, c) for c, t in outputs]) if outputs else None
    return ModelSignature(inputs=Schema([ColSpec(_colspec_type(t), c) for c, t in schema.items()]), outputs=out)


def _output_columns(card: Mapping[str, Any], staged: Path, n_features: int, allowed: str | None) -> list[tuple[str, str]]:
    """`prediction` (and `prob_<k>` for a classifier: k from the card's `classes`, else from one
    forward pass of the model, built only when its factory is allowed); just `prediction` when the
    model cannot be built here."""
    from operators.registry.served_model import load_final_model

    if card_task(card) == "regression":
        return [("prediction", "double")]
    classes = card_classes(card)
    if classes is not None:  # recorded by the rank that trained it: no torch in this process
        return [("prediction", "long")] + [(f"prob_{k}", "double") for k in range(classes)]
    if card_factory(card) is None:  # a folder of one's own without a module factory: nothing to build
        return [("prediction", "long")]
    try:
        import torch

        with torch.no_grad():
            classes = int(load_final_model(staged, allowed_models=[allowed] if allowed else None)(
                torch.zeros(1, n_features)).shape[-1])
    except Exception as exc:  # noqa: BLE001 - the signature then names the prediction only
        log.warning("the model's outputs could not be described (%s: %s): the signature names `prediction` only",
                    type(exc).__name__, exc)
        return [("prediction", "long")]
    return [("prediction", "long")] + [(f"prob_{k}", "double") for k in range(classes)]


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
    for dist in ("gangflow", "torch", "safetensors", "numpy", "pandas", "mlflow"):  # gangflow: the loader
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


def _bundled_code(staging: Path, factory: str | None) -> list[str]:
    """The package of a user model `factory` that is not installed (`mypkg.models:tiny_cnn`
    bundles `mypkg/`), as MLflow `code_paths`: signed with the rest, so it loads where the package
    is not importable. gangflow's own code (the loader, `trainer`) is never bundled: it is installed."""
    user = user_code_location(factory) if factory else None
    if user is None:
        return []
    _copy_sources(user, staging / user.name)
    log.info("bundling the model factory's code %s with the model (MLflow code_paths)", user)
    return [str(staging / user.name)]


def _allowed_spec(factory: str | None, allowed_models: Sequence[str] | str | None) -> str | None:
    """The `module:function` the card's factory stands for when the platform allows it, else None."""
    from trainer.allowlist import ModelNotAllowed, allowed_factories

    if not factory:
        return None
    try:
        return allowed_factories(allowed_models).get(factory)
    except ModelNotAllowed:
        return None


def log_final_model(
    client: MlflowClient,
    run_id: str,
    final_dir: str | Path,
    *,
    name: str = LOGGED_MODEL_NAME,
    schema: Mapping[str, str] | None = None,
    input_example: Any = None,
    allowed_models: Sequence[str] | str | None = None,
    tags: Mapping[str, str] | None = None,
) -> str:
    """Log a run's `final/` (model.safetensors + model_card.json) ONCE as an MLflow LoggedModel of
    run `run_id` and return its id (`models:/<model_id>`, what promote registers).

    The model is a pyfunc whose MLmodel names the installed loader (`loader_module:
    operators.registry.served_model`; no loader code or `trainer` copy among its artifacts), signed
    by the platform (`operators.registry.signing`): the signature covers every file and the card's
    factory when `allowed_models` (or the entry points) allow it, so the version serves where no
    allow-list is set, and nothing else can grant itself that trust. `schema` ({column: dtype}, the
    validated dataset's) is the signature's inputs; the outputs are the predict frame's columns."""
    import mlflow.pyfunc
    from mlflow.entities import LoggedModelOutput

    from operators.registry import served_model
    from operators.registry.signing import sign_model_dir

    final_dir = Path(final_dir)
    uri = client_uri(client)
    with mlflow_errors(uri, f"log the model of run {run_id}"), tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / served_model.FINAL_DIR  # only the files the model needs, whatever else final/ holds
        staged.mkdir()
        for fname in (served_model.WEIGHTS_FILE, served_model.CARD_FILE):
            source = final_dir / fname
            if not source.is_file() or source.is_symlink():
                raise UserError(f"cannot log {final_dir}: {fname} is missing (or a link)")
            shutil.copy2(source, staged / fname)
        card = read_card(staged)
        # training code of one's own (`run.log_model`): the tokenizer, config and other files of its
        # folder belong to the model (its `evaluation.entrypoint` reads them for the champion too)
        if card.get("kind") == "folder":
            for path in sorted(final_dir.rglob("*")):
                if path.is_file() and not path.is_symlink() and not any(p.is_symlink() for p in path.parents):
                    (staged / path.relative_to(final_dir)).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, staged / path.relative_to(final_dir))
        if schema is None:
            schema = {c: "float32" for c in served_model.FEATURE_COLUMNS}
        factory = card_factory(card)
        allowed = _allowed_spec(factory, allowed_models)
        task = card_task(card)
        model_dir = Path(tmp) / "model"
        with warnings.catch_warnings():
            # Advice to add an input example: the training task has no test rows (promote may add none either)
            warnings.filterwarnings("ignore", message=".*input example was not provided.*")
            mlflow.pyfunc.save_model(
            str(model_dir),
                loader_module=served_model.LOADER_MODULE,
                data_path=str(staged),
                code_paths=_bundled_code(Path(tmp) / "code", factory) or None,
                signature=_pyfunc_signature(schema, _output_columns(card, staged, len(schema), allowed)),
                input_example=input_example,
                model_config={"features": list(schema), "task": task},
                pip_requirements=_pip_requirements(),
            )
        sign_model_dir(model_dir, factory=allowed)
        experiment_id = client.get_run(run_id).info.experiment_id
        logged = client.create_logged_model(
            experiment_id, name=name, source_run_id=run_id, model_type="gangflow-safetensors",
            tags={TAG_MLFLOW_RUN_ID: run_id, **{str(k): str(v) for k, v in (tags or {}).items()}},
        )
        client.log_model_artifacts(logged.model_id, str(model_dir))
        client.finalize_logged_model(logged.model_id, "READY")
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
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
    allowed_models: Sequence[str] | str | None = None,
) -> ModelVersion:
    """Register the model of MLflow run `run_id` as a new version of `name`, IDEMPOTENTLY.

    If a version of `name` from the same run exists (a retried task), it is returned and nothing
    is logged or registered again. Otherwise:

    * `models:/<model_id>` (what the training task logged, `log_final_model`) is registered as is;
    * a local directory (a run's `final/` dir) is logged first (`log_final_model`, with
      `allowed_models`, `schema`, `input_example`);
    * anything else is taken as an artifact URI (`runs:/<id>/model`, `models:/<model_id>`,
      `file://...`, `s3://...`) and registered as is.

    The version gets every `gangflow.*` lineage tag of the run (gang, job UID, image digest,
    dataset version: whatever the training task and backend recorded), then `tags` (lineage,
    winning over the run's), plus `gangflow.mlflow_run_id` and, with `schema` (the model's
    input columns, see `log_final_model`), `gangflow.input_schema`.
    """
    tags = {**run_lineage(client, run_id), **{str(k): str(v) for k, v in (tags or {}).items()}}
    tags.setdefault(TAG_MLFLOW_RUN_ID, run_id)
    if schema is not None:
        tags[TAG_INPUT_SCHEMA] = json.dumps(dict(schema))[:5000]
    ensure_registered_model(client, name)
    existing = find_version_for_run(client, name, run_id)
    source = str(source_dir_or_artifact_path)
    if existing is not None:
        _check_reused(client, existing, source, run_id)
        log.info("model %s v%s is already registered from run %s: reusing it", name, existing.version, run_id)
        return existing
    uri = client_uri(client)
    model_id = None
    if "://" not in source and Path(source).is_dir():
        model_id = log_final_model(client, run_id, source, schema=schema, input_example=input_example,
                                   allowed_models=allowed_models)
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


def _check_reused(client: MlflowClient, existing: ModelVersion, source: str, run_id: str) -> None:
    """Refuse (VersionNotTheCandidates) to reuse a version of the candidate's run that holds another
    model: the one it was asked to register (`models:/<id>`), or one this run logged (a `final/` dir)."""
    # The source is what a download of the version reads (search results may leave model_id out).
    held_source = str(existing.source or "")
    held = held_source.removeprefix("models:/") if held_source.startswith("models:/") else getattr(existing, "model_id", None)
    where = f"{existing.name} v{existing.version}, registered from run {run_id},"
    if source.startswith("models:/m-"):
        if held != source.removeprefix("models:/"):
            raise VersionNotTheCandidates(f"{where} holds models:/{held}, not {source}: it was registered by someone "
                                          "else; nothing was promoted. Delete that version, then retry the task")
    elif held is not None:
        with mlflow_errors(client_uri(client), f"read the logged model {held}"):
            logged_by = client.get_logged_model(held).source_run_id
        if logged_by != run_id:
            raise VersionNotTheCandidates(f"{where} holds models:/{held}, logged by run {logged_by}, not by this run: "
                                          "it was registered by someone else; nothing was promoted. Delete that "
                                          "version, then retry the task")


def holds_champion(client: MlflowClient, version: ModelVersion) -> bool:
    champion = current_champion(client, version.name)
    return champion is not None and str(champion.version) == str(version.version)


class ModelSourceRefused(UserError):
    """A model's artifacts lie outside the registry's artifact root, or exceed the size limit:
    refused before anything is downloaded."""


ARTIFACT_ROOTS_ENV = "GANGFLOW_ARTIFACT_ROOTS"  # extra roots, comma-separated URIs (e.g. s3://bucket/mlflow)
MAX_MODEL_BYTES_ENV = "GANGFLOW_MAX_MODEL_BYTES"
MAX_MODEL_BYTES = 4 << 30


def artifact_roots() -> list[str]:
    """Where the registry's artifacts may live: the state dir's `mlartifacts/` (the embedded
    store), an MLflow server's own proxied store (`mlflow-artifacts:`), and `GANGFLOW_ARTIFACT_ROOTS`."""
    from operators.config import settings

    extra = [r.strip().rstrip("/") for r in os.environ.get(ARTIFACT_ROOTS_ENV, "").split(",") if r.strip()]
    return [settings.artifact_root().resolve().as_uri(), "mlflow-artifacts:", *extra]


def _host_of(uri: str | None) -> str:
    from urllib.parse import urlparse

    return urlparse(uri or "").netloc.rpartition("@")[2].lower()


def _check_proxy_host(source: str, what: str, tracking_uri: str | None) -> None:
    # MLflow's client sends a proxied download, with the tracking credentials, to the host it names.
    if str(source).startswith("mlflow-artifacts:") and _host_of(source) not in ("", _host_of(tracking_uri)):
        raise ModelSourceRefused(
            f"{what}: source {redact_url(source)!r} names host {_host_of(source)!r}, not the tracking "
            f"server's ({_host_of(tracking_uri) or 'none'}); nothing was downloaded")


def check_source(source: str, what: str, *, tracking_uri: str | None = None) -> None:
    """Refuse (ModelSourceRefused) an artifact URI outside `artifact_roots()`, before any download."""
    from urllib.parse import unquote, urlparse

    source = str(source)
    parsed = urlparse(source)
    if ".." in unquote(parsed.path).split("/"):
        raise ModelSourceRefused(f"{what}: source {redact_url(source)!r} has a '..' segment; nothing was downloaded")
    _check_proxy_host(source, what, tracking_uri)
    if parsed.scheme in ("", "file"):
        path = Path(unquote(parsed.path)).resolve()
        inside = any(path.is_relative_to(Path(unquote(urlparse(root).path)))
                     for root in artifact_roots() if root.startswith("file:"))
    else:
        inside = any(source == root or source.startswith(root if root.endswith(":") else root + "/")
                     for root in artifact_roots() if not root.startswith("file:"))
    if not inside:
        raise ModelSourceRefused(
            f"{what}: source {redact_url(source)!r} is outside the registry's artifact root "
            f"({', '.join(map(redact_url, artifact_roots()))}; "
            f"more with {ARTIFACT_ROOTS_ENV}); nothing was downloaded")


def _max_bytes() -> int:
    raw = os.environ.get(MAX_MODEL_BYTES_ENV)
    if not raw:
        return MAX_MODEL_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{MAX_MODEL_BYTES_ENV}={raw!r}: must be a number of bytes") from None
    if value <= 0:
        raise UserError(f"{MAX_MODEL_BYTES_ENV}={raw!r}: must be a number of bytes > 0")
    return value


def download_source(client: MlflowClient, source: str, dst: str | Path, *, what: str,
                    subpath: str | None = None, in_root: bool = True) -> Path:
    """Download an artifact URI (or its `subpath` folder) under `dst`: only inside the registry's
    artifact root (unless not `in_root`: a URI the DAG itself gave) and within
    `GANGFLOW_MAX_MODEL_BYTES` (default 4 GiB), both checked first."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    uri, limit = client_uri(client), _max_bytes()
    if in_root:
        check_source(source, what, tracking_uri=uri)
    else:
        _check_proxy_host(source, what, uri)
    with mlflow_errors(uri, f"download {what}"), use_tracking_uri(uri):
        repo = get_artifact_repository(source)
        total, files, stack = 0, 0, [subpath or None]
        while stack:
            for info in repo.list_artifacts(stack.pop()):
                if info.is_dir:
                    stack.append(info.path)
                    continue
                files += 1
                total += int(info.file_size or 0)
                if total > limit:
                    raise ModelSourceRefused(f"{what}: more than {limit} bytes at {redact_url(source)} ({MAX_MODEL_BYTES_ENV}="
                                             f"{limit}); nothing was downloaded")
        if not files:
            raise ModelNotFound(f"no model at {what} (MLflow at {uri}): no files at {redact_url(source)}"
                                + (f"/{subpath}" if subpath else ""))
        Path(dst).mkdir(parents=True, exist_ok=True)
        local = Path(repo.download_artifacts(subpath or "", str(dst)))
    return local


def resolve_model_source(client: MlflowClient, model_uri: str) -> str:
    """The artifact URI behind `models:/<model_id>`, `models:/<name>@<alias>`,
    `models:/<name>/<version>` or `runs:/<run>/<path>` (any other URI is returned as is)."""
    uri = str(model_uri)
    if uri.startswith("runs:/"):
        from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

        with mlflow_errors(client_uri(client), f"resolve {uri}"), use_tracking_uri(client_uri(client)):
            return RunsArtifactRepository.get_underlying_uri(uri)
    if not uri.startswith("models:/"):
        return uri
    ref = uri.removeprefix("models:/").strip("/")
    with mlflow_errors(client_uri(client), f"resolve {uri}"):
        if ref.startswith("m-") and "/" not in ref and "@" not in ref:
            return client.get_logged_model(ref).artifact_location
        if "@" in ref:
            name, _, alias = ref.partition("@")
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, number = ref.rpartition("/")
            version = client.get_model_version(name, number)
        return client.get_model_version_download_uri(version.name, str(version.version))


def _weights_dir(local: Path, what: str) -> Path:
    hits = sorted(local.rglob(WEIGHTS), key=lambda p: len(p.parts))
    if not hits:
        raise ModelNotFound(f"{what} has no {WEIGHTS}: did training finish and log its final weights?")
    return hits[0].parent


def download_model(client: MlflowClient, model_uri: str, dst: str | Path) -> Path:
    """Download the weights and card of a model (`models:/<model_id>`, what the training task
    returns; `runs:/<run>/final` of older runs; any MLflow artifact URI) under `dst`; return the
    folder holding `model.safetensors`. Of a logged model only `final/` is downloaded.

    This is how evaluate and promote get a candidate: through MLflow, never from a path on the
    worker that trained it. The files are data: load them with `load_final_model` (allow-listed),
    never by executing anything they contain."""
    from mlflow.exceptions import MlflowException

    from operators.registry.served_model import MODEL_FINAL_PATH

    uri = client_uri(client)
    Path(dst).mkdir(parents=True, exist_ok=True)
    try:
        if str(model_uri).startswith("models:/"):
            local = download_source(client, resolve_model_source(client, model_uri), dst, what=str(model_uri),
                                    subpath=MODEL_FINAL_PATH)
        else:  # `runs:/...` or a URI the DAG gave (not read from the registry): the size limit only
            local = download_source(client, resolve_model_source(client, model_uri), dst, what=str(model_uri),
                                    in_root=False)
    except (MlflowException, OSError) as exc:
        if isinstance(exc, MlflowException) and exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND",
                                                                        "INVALID_PARAMETER_VALUE"):
            raise
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            raise
        raise ModelNotFound(f"no model at {model_uri} (MLflow at {uri}): {exc}") from exc
    return _weights_dir(local, str(model_uri))


def download_version(client: MlflowClient, version: ModelVersion, dst: str | Path) -> Path:
    """Download a version's weights and card under `dst` (the logged model's `final/`, or the root
    of a plain folder) and return the folder holding `model.safetensors`. Its source must lie in the
    registry's artifact root and within the size limit (`download_source`)."""
    from operators.registry.served_model import MODEL_FINAL_PATH

    what = f"{version.name} v{version.version}"
    with mlflow_errors(client_uri(client), f"find the artifacts of {what}"):
        source = client.get_model_version_download_uri(version.name, str(version.version))
    check_source(source, what, tracking_uri=client_uri(client))
    with mlflow_errors(client_uri(client), f"list {what}"), use_tracking_uri(client_uri(client)):
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        has_final = any(i.is_dir and i.path.rstrip("/").endswith("data")
                        for i in get_artifact_repository(source).list_artifacts())
    try:
        local = download_source(client, source, dst, what=what, subpath=MODEL_FINAL_PATH if has_final else None)
        return _weights_dir(local, f"{what} ({redact_url(source)})")
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


#: The registered model whose existence is the champion lock of `<name>` on an MLflow server.
LOCK_MODEL_SUFFIX = ".gangflow-champion-lock"
TAG_LOCK_EXPIRES = "gangflow.lock_expires_at"
#: A lock held this long is taken as left by a dead holder (the move itself takes a few requests).
LOCK_LEASE_S = 300.0


@contextlib.contextmanager
def champion_lock(client: MlflowClient, name: str, *, wait_s: float = 600.0) -> Iterator[str | None]:
    """Hold the champion lock of registered model `name` for a compare-and-set.

    On a SQLite store (the embedded default) this is an exclusive `flock` on a file beside the
    database: every process that can write that database shares its filesystem and the kernel
    releases the lock when a holder dies. On an MLflow server it is the registered model
    `<name>.gangflow-champion-lock`: creating it is atomic on the server (its name is unique in the
    backend store, so of two creators exactly one succeeds), deleting it releases; a lock older
    than `LOCK_LEASE_S` is taken as left by a dead holder and removed.
    """
    db = _sqlite_file(client_uri(client))
    if db is None:
        with _server_lock(client, name, wait_s=wait_s) as lock:
            yield lock
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


def _already_exists(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS")


def _missing(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


@contextlib.contextmanager
def _server_lock(client: MlflowClient, name: str, *, wait_s: float) -> Iterator[str]:
    import random
    import time

    from mlflow.exceptions import MlflowException

    lock = f"{name}{LOCK_MODEL_SUFFIX}"
    uri = client_uri(client)
    deadline = time.monotonic() + wait_s
    with mlflow_errors(uri, f"take the champion lock of {name!r}"):
        while True:
            try:
                client.create_registered_model(
                    lock, tags={TAG_LOCK_EXPIRES: f"{time.time() + LOCK_LEASE_S:.3f}"},
                    description=f"gangflow: held while a promotion moves the champion alias of {name}; removed after")
                break
            except MlflowException as exc:
                if not _already_exists(exc):
                    raise
            try:
                held = client.get_registered_model(lock)
                expires = float((held.tags or {}).get(TAG_LOCK_EXPIRES) or 0)
            except MlflowException as exc:
                if _missing(exc):
                    continue  # released meanwhile
                raise
            except ValueError:
                expires = 0.0
            if expires < time.time():
                log.warning("the champion lock %s expired (a holder died?): removing it", lock)
                _release(client, lock)
                continue
            if time.monotonic() > deadline:
                raise ChampionChanged(f"the champion lock {lock} stayed held for {wait_s:.0f}s (other promotions of "
                                      f"{name}); nothing was moved by this try, the retry decides again")
            time.sleep(0.1 + random.random() * 0.2)
    try:
        yield lock
    finally:
        with mlflow_errors(uri, f"release the champion lock of {name!r}"):
            _release(client, lock)


def _release(client: MlflowClient, lock: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.delete_registered_model(lock)
    except MlflowException as exc:
        if not _missing(exc):
            raise


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

    Under `champion_lock`, the alias is re-read just before the move and once after it. Returns
    (moved, the champion found): when it changed, nothing moves and the caller decides again against the
    champion found (so a slower, worse candidate never overwrites a better champion).
    """
    with champion_lock(client, version.name):
        current = current_champion(client, version.name)
        if _champion_state(current, metric) != _champion_state(expected, metric):
            return False, current
        promote(client, version)
        after = current_champion(client, version.name)  # the check after the write
        if after is None or str(after.version) != str(version.version):
            log.warning("the %s alias of %s was moved to %s by a writer outside the lock right after this move",
                        CHAMPION_ALIAS, version.name, f"v{after.version}" if after is not None else "nothing")
            return False, after
        return True, current


def recorded_decision(version: ModelVersion) -> dict[str, str]:
    """The `gangflow.*` audit tags already on a version (empty if never decided)."""
    return {k: v for k, v in (version.tags or {}).items() if k.startswith("gangflow.")}
