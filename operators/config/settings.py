"""Where gangflow keeps its state, and the embedded defaults derived from it.

The state dir is `.gangflow/` in the project root unless `GANGFLOW_HOME` says otherwise; it holds
`airflow/`, `mlflow.db`, `mlartifacts/`, `dvc-remote/`, `dvc-cache/`, `runs/` and `reports/`
(docs/pipeline.md, "State dir").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from trainer.urls import credentials_refusal, has_credentials

PROJECT_ROOT = Path(os.environ.get("GANGFLOW_PROJECT", Path(__file__).resolve().parents[2]))


def state_dir() -> Path:
    return Path(os.environ.get("GANGFLOW_HOME") or PROJECT_ROOT / ".gangflow").resolve()


def airflow_home() -> Path:
    return state_dir() / "airflow"


def tracking_uri() -> str:
    """MLflow tracking URI: MLFLOW_TRACKING_URI when set, else SQLite under the state dir."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state_dir() / 'mlflow.db'}"


def artifact_root() -> Path:
    return state_dir() / "mlartifacts"


def dvc_remote() -> Path:
    return state_dir() / "dvc-remote"


def dvc_cache() -> Path:
    return state_dir() / "dvc-cache"


def runs_dir() -> Path:
    return state_dir() / "runs"


def deployment_id() -> str:
    """Which gangflow deployment this is: part of every run identity (see `run_identity`).

    `GANGFLOW_DEPLOYMENT` when set (pin it on Kubernetes: e.g. the Airflow release and
    namespace). Otherwise the location of Airflow's metadata database, without credentials or
    options: every component of one deployment shares it and two deployments never do (two
    Airflows in one namespace have two databases). Airflow's `[api] instance_name` is not used:
    it is a display title that two installs may well share.
    """
    explicit = os.environ.get("GANGFLOW_DEPLOYMENT", "").strip()
    if explicit:
        return explicit
    try:
        from airflow.configuration import conf

        conn = conf.get("database", "sql_alchemy_conn", fallback="") or ""
    except ImportError:  # no Airflow installed: the state dir is the deployment
        conn = ""
    if not conn:
        return f"state:{state_dir()}"
    url = urlsplit(conn)
    netloc = url.hostname or ""
    if url.port:
        netloc = f"{netloc}:{url.port}"
    return f"{url.scheme}://{netloc}{url.path}"


def run_identity(dag_id: str, run_id: str) -> str:
    """The identity of one DAG run, as 64 hex digits: the same for all its tries, distinct for
    any other run of any DAG in any deployment.

    Airflow's unique key of a DAG run is (dag_id, run_id) within one metadata database; the
    deployment id makes it unique across deployments that share a namespace, a bucket or an
    MLflow server. The raw run id goes in unchanged (no lossy sanitising before the hash).
    """
    if not isinstance(dag_id, str) or not dag_id or not isinstance(run_id, str) or not run_id:
        raise ValueError(f"a run identity needs a non-empty dag_id and run_id (got {dag_id!r}, {run_id!r})")
    payload = json.dumps([deployment_id(), dag_id, run_id])
    return hashlib.sha256(payload.encode()).hexdigest()


def run_key(dag_id: str, run_id: str) -> str:
    """One DAG run as a folder or file name: a readable stem of the run id plus 16 hex digits
    of `run_identity`, e.g. `manual__2026-11-30T10_00_00_00_00-3f2a9c01b7d4e855`.

    Never '.', '..' or empty, and distinct runs never share one (the stem alone would:
    `retrain:v2` and `retrain+v2`).
    """
    return f"{run_stem(run_id)}-{run_identity(dag_id, run_id)[:16]}"


def run_stem(run_id: str) -> str:
    """The readable part of `run_key`: for humans only (lossy: ':' and '+' both become '_'); the hash makes it unique."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id)[:60].strip("._-") or "run"


#: A DAG id that can name a folder of the state dir (runs/, failures/, retries/): Airflow's characters,
#: and not only dots ('.' and '..' name this folder or its parent). Pipeline files are checked with it.
DAG_ID_RE = re.compile(r"(?!\.+$)[A-Za-z0-9_.-]+")


def dag_id_folder(dag_id: str) -> str:
    """`dag_id` as a folder name under the state dir; ValueError when it cannot name one."""
    if not isinstance(dag_id, str) or not DAG_ID_RE.fullmatch(dag_id):
        raise ValueError(f"dag_id={dag_id!r} cannot name a folder (accepted: letters, digits, '_', '.', '-', "
                         "not only dots)")
    return dag_id


def run_dir(dag_id: str, run_id: str) -> Path:
    """The training run dir of one DAG run: the same for all its tries, so a retry resumes."""
    return runs_dir() / dag_id_folder(dag_id) / run_key(dag_id, run_id)


def reports_dir() -> Path:
    return state_dir() / "reports"


def trainer_config_path(path: str | os.PathLike | None = None) -> Path:
    """The trainer config a pipeline or a training task names: `path`, relative to the project
    root, by default the project's params.yaml. The one place that decides it."""
    path = Path(path or "params.yaml")
    return path if path.is_absolute() else PROJECT_ROOT / path


#: The Airflow pool that admits local gangs whole: a training task takes `pool_slots = world size`.
TRAINING_POOL = "gangflow_training"


def pool_slots() -> int:
    """Slots of the training pool: `GANGFLOW_POOL_SLOTS`, else this machine's cores."""
    return int(os.environ.get("GANGFLOW_POOL_SLOTS") or os.cpu_count() or 1)


#: `GANGFLOW_METRICS`: where a local training task serves its gang's Prometheus metrics,
#: `HOST:PORT` (port 0: a free one), or `off` (the default). docs/observability.md.
METRICS_ENV = "GANGFLOW_METRICS"


def metrics_address() -> tuple[str, int] | None:
    """(host, port) of the gang exporter, or None when `GANGFLOW_METRICS` is unset or `off`."""
    value = os.environ.get(METRICS_ENV, "").strip()
    if value in ("", "off"):
        return None
    host, _, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address as URLs write it: [::1]:9400
        host = host[1:-1]
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{METRICS_ENV}={value!r}: accepted values are off or HOST:PORT (e.g. 127.0.0.1:0, [::1]:0, port 0 "
                         "for a free one)")
    return host, int(port)


def metrics_linger_s() -> float:
    """`GANGFLOW_METRICS_LINGER_S` (default 15): how long at most the exporter waits, after the gang
    ended, for a scrape to read its final values (exit codes, failure kind)."""
    value = os.environ.get("GANGFLOW_METRICS_LINGER_S", "15")
    try:
        linger = float(value)
    except ValueError:
        linger = -1.0
    if not 0 <= linger <= 600:
        raise ValueError(f"GANGFLOW_METRICS_LINGER_S={value!r}: accepted values are seconds from 0 to 600")
    return linger


def metrics_targets_dir() -> Path:
    """Where exporters write their Prometheus `file_sd_configs` target files (one per gang)."""
    return state_dir() / "prometheus" / "targets"


def _link_setting(name: str) -> str:
    """A URL setting for a link the UI shows (kept in XCom and MLflow tags): refused with user info."""
    value = os.environ.get(name, "").strip()
    if has_credentials(value):
        raise ValueError(credentials_refusal(name, value, "from the browser's own login, never in a link"))
    return value


def dashboard_url(mlflow_run_id: str) -> str | None:
    """The Grafana dashboard of one run (`GANGFLOW_DASHBOARD_URL`, the chart's dashboard URL), or None."""
    base = _link_setting("GANGFLOW_DASHBOARD_URL")
    if not base:
        return None
    parts = urlsplit(base)  # the run's filter goes in the query, before any #fragment
    query = f"{parts.query}&" if parts.query else ""
    return urlunsplit(parts._replace(query=f"{query}var-mlflow_run_id={mlflow_run_id}"))


def mlflow_run_url(experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI's page of a run: `GANGFLOW_MLFLOW_UI_URL`, else the tracking URI when it is the
    server's http(s) URL (without its user info); None for a local store without a UI."""
    base = _link_setting("GANGFLOW_MLFLOW_UI_URL")
    if not base:
        tracking = urlsplit(tracking_uri())
        base = urlunsplit(tracking._replace(netloc=tracking.netloc.rpartition("@")[2]))
    if not base.startswith(("http://", "https://")):
        return None
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def kubernetes_object_url(namespace: str, kind: str, name: str) -> str | None:
    """`GANGFLOW_KUBERNETES_URL` with {namespace}, {kind} and {name} filled in (your cluster console's
    page of an object), or None when unset; other braces (a console's JSON query) are kept as they are."""
    template = _link_setting("GANGFLOW_KUBERNETES_URL")
    if not template:
        return None
    return template.replace("{namespace}", namespace).replace("{kind}", kind.lower()).replace("{name}", name)
