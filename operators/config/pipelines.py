"""Pipelines as configuration: one YAML file per pipeline under `pipelines/` (or the folder
`GANGFLOW_PIPELINES` names), read at DAG parse time by the DAG factory (dags/train_pipeline.py).

docs/extending.md documents every key; an unknown key or a bad value raises `PipelineConfigError`
naming the file, the key and what is accepted. Cheap: no heavy imports.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.backends.base import ENTRYPOINT_RE as _ENTRYPOINT_RE
from operators.backends.base import is_count, user_code_args
from operators.config import settings
from operators.exceptions import InvalidParams, UserError
from trainer.checks import is_integer
from trainer.config import FACTORY_RE
from trainer.metrics import EVALUATED_METRICS
from operators.registry.gate import Metric, PromotionGate, check_direction

if TYPE_CHECKING:
    from trainer.config import Config as TrainerConfig

#: The pipeline `make demo` runs and whose DAG keeps the id `train_pipeline`.
DEFAULT_PIPELINE = "digits"
DATASET_ASSET_NAME = "gangflow-dataset-digits"
DATASET_ASSET_URI = "dvc://gangflow/data/digits"
# The key of the dataset Asset event's `extra` that names the published version
# (dags/publish_dataset.py writes it, `dataset_version_of_run` reads it).
ASSET_VERSION_KEY = "version"
#: Backends every DAG offers; a pipeline file's `backends` adds its own (name: module:Class).
BUILTIN_BACKENDS = ("local", "kubernetes", "ray")
#: The `launcher` Param's values (operators.backends.base.LAUNCHERS; which backend runs which: its `launchers`).
LAUNCHERS = ("torchrun", "mpirun")

# JSON Schema has no "finite": NaN compares false with every bound, so it satisfies this empty
# range and `not` refuses it (+-inf are refused by each number Param's own bounds).
NOT_NAN = {"not": {"description": "NaN (not a number)", "minimum": 1, "maximum": 0}}

_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
# A DAG id that can name a folder of the state dir (settings.DAG_ID_RE: not '.' or '..'), at most 200 characters
_ID_RE = re.compile(rf"(?=.{{1,200}}$){settings.DAG_ID_RE.pattern}")
_ID_ACCEPTED = "an Airflow DAG id that can name a folder: letters, digits, '_', '.', '-' (not only dots, at most 200)"


class PipelineConfigError(UserError, ValueError):
    """A pipeline file is missing, unreadable, or has an unknown key or a bad value."""


#: training.max_preemptions when the file does not say (GangTrainingOperator's default too)
DEFAULT_MAX_PREEMPTIONS = 10


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline, as declared in `pipelines/<name>.yaml` plus the trainer defaults its
    `trainer_config` holds and the dataset version dvc.lock pins for its dataset."""

    name: str
    dag_id: str
    publish_dag_id: str
    description: str
    source: str  # the pipeline file
    schedule: str | None
    dataset_stage: str
    dataset_out: str
    dataset_asset: str
    suite: str
    trainer_config: str  # absolute path
    task: str
    data_factory: str  # the trainer config's data.factory: evaluate and promote read the test split with it
    metric: Metric
    promotion_floor: float
    min_improvement: float
    model_name: str
    backends: dict[str, str]  # user backends, name -> module:Class (besides BUILTIN_BACKENDS)
    default_backend: str
    launcher: str  # training.launcher: the `launcher` Param's default
    world_size: int
    local_world_sizes: tuple[int, ...]
    retries: int
    retry_base_delay_s: float
    allowed_models: tuple[str, ...]
    # from the trainer config
    max_steps: int
    learning_rate: float
    batch_size: int
    checkpoint_every_steps: int | str  # or "auto" (trainer.checkpoint_interval)
    # pinned in dvc.lock ("" when there is no dvc.lock yet: the form then asks for a version)
    dataset_version: str
    # folders the user's packages import from (absolute), put on sys.path / PYTHONPATH wherever
    # gangflow runs code: the DAG files, the tasks, `make demo`, `make ui`'s processes, the ranks
    package_roots: tuple[str, ...] = ()
    # stage (validate | train | evaluate | promote) -> 'module:Class', a subclass of the stage's operator
    operators: dict[str, str] = field(default_factory=dict)
    # Training code of one's own (`training:`): `python -m trainer.user`'s target; () = gangflow's loop
    training_code: tuple[str, ...] = ()
    evaluation_entrypoint: str | None = None  # `module:function(model_dir, test_path) -> metrics`
    training: Mapping[str, Any] | None = None  # the `training:` section as written
    # training.max_preemptions: preemptions the training task re-launches without spending a retry
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    # training.max_run_time_seconds: the longest a try's gang may run (None: no limit)
    max_run_time_seconds: int | None = None
    # training.max_queue_wait_seconds: the longest a gang may wait for admission where it queues
    max_queue_wait_seconds: int | None = None

    def training_kwargs(self) -> dict[str, Any]:
        """GangTrainingOperator's arguments for the pipeline's own training code and package roots
        ({} for gangflow's loop without any). The ranks get the package roots inside the project,
        relative to it (a pod has them below /app)."""
        project = settings.PROJECT_ROOT.resolve()
        inside = tuple(Path(root).relative_to(project).as_posix() for root in self.package_roots
                       if Path(root).is_relative_to(project))
        kwargs: dict[str, Any] = {"package_roots": inside} if inside else {}
        if self.training_code:
            kwargs |= {"entrypoint": self.training.get("entrypoint"), "entrypoint_kwargs": self.training.get("kwargs"),
                       "command": self.training.get("command")}
        return kwargs

    @property
    def dataset_asset_uri(self) -> str:
        return f"dvc://gangflow/{self.dataset_out}"

    @property
    def trainer_config_in_project(self) -> str | None:
        """The trainer config relative to the project root (as the images hold it), or None."""
        path = Path(self.trainer_config)
        root = settings.PROJECT_ROOT.resolve()
        return path.resolve().relative_to(root).as_posix() if path.resolve().is_relative_to(root) else None

    @property
    def backend_names(self) -> list[str]:
        return [*BUILTIN_BACKENDS, *sorted(b for b in self.backends if b not in BUILTIN_BACKENDS)]


#: Kept for callers that predate pipelines-as-configuration: the defaults of one pipeline.
PipelineDefaults = PipelineConfig

_KEYS = {
    "name", "dag_id", "publish_dag_id", "description", "schedule", "dataset", "trainer_config", "metric",
    "gate", "model_name", "backends", "default_backend", "world_size", "local_world_sizes", "retries",
    "retry_base_delay_seconds", "allowed_models", "package_roots", "operators", "training", "evaluation",
}  # fmt: skip
_TRAINING_KEYS = {"entrypoint", "kwargs", "command", "launcher", "max_preemptions", "max_run_time_seconds",
                  "max_queue_wait_seconds"}
# the `training:` keys that leave gangflow's own loop in place
_PLATFORM_TRAINING_KEYS = {"launcher", "max_preemptions", "max_run_time_seconds", "max_queue_wait_seconds"}
_EVALUATION_KEYS = {"entrypoint"}

_DATASET_KEYS = {"stage", "out", "asset", "suite"}
_METRIC_KEYS = {"name", "direction", "minimum", "maximum"}
_GATE_KEYS = {"threshold", "floor", "min_improvement"}  # floor: the threshold's name before it was direction-neutral
#: The stages whose operator class a pipeline file may name (`operators:`).
STAGES = ("validate", "train", "evaluate", "promote")


def pipelines_dir() -> Path:
    """Where pipeline files live: `GANGFLOW_PIPELINES` when set, else `<project>/pipelines`."""
    return Path(os.environ.get("GANGFLOW_PIPELINES") or settings.PROJECT_ROOT / "pipelines")


def _load_yaml(path):
    import yaml

    try:
        with open(path) as fh:
            return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except FileNotFoundError:
        return {}


def _pinned_version(out: str) -> str:
    from operators.hooks.dvc import pinned_version
    from operators.exceptions import DatasetVersionNotFound

    try:
        return pinned_version(settings.PROJECT_ROOT, out)
    except DatasetVersionNotFound:  # no dvc.lock entry yet: the form then asks for a version
        return ""


def _trainer_config(path: Path, source: str) -> TrainerConfig:
    """The trainer's own reading of its config (`trainer.config.Config`, as `load_config` builds it:
    its defaults, its checks)."""
    from trainer.config import Config
    from trainer.errors import ConfigError

    raw = _load_yaml(path)
    if not raw:
        raise PipelineConfigError(f"{source}: trainer_config={str(path)!r}: no such file, or it is empty")
    if not isinstance(raw, Mapping):
        raise PipelineConfigError(f"{path} (trainer_config of {source}): must be a mapping of sections")
    if "pipeline" in raw:  # used to be read from params.yaml: refuse rather than ignore it
        raise PipelineConfigError(f"{path}: a `pipeline` section is not read any more; pipeline settings live in {source}")
    try:
        return Config.from_dict(raw)
    except ConfigError as exc:
        raise PipelineConfigError(f"{path} (trainer_config of {source}): {exc}") from None


MAX_RETRIES = 100
_DAY_S, _YEAR_S = 86_400, 366 * 86_400
_MODEL_NAME = re.compile(r"[^/:\x00-\x1f\x7f]{1,256}")


def _check_keys(where: str, given: Mapping[str, Any], accepted: set[str]) -> None:
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise PipelineConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; accepted keys: {', '.join(sorted(accepted))}")


def _number(where: str, value: Any, *, integer: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok:
        raise PipelineConfigError(f"{where}={value!r}: must be {'an integer' if integer else 'a finite number'}")
    return value


def _string(where: str, value: Any, pattern: re.Pattern | None = None, accepted: str = "") -> str:
    # fullmatch: `$` alone also matches before a final newline
    if not isinstance(value, str) or not value or (pattern is not None and not pattern.fullmatch(value)):
        raise PipelineConfigError(f"{where}={value!r}: must be {accepted or 'a non-empty string'}")
    return value


def _package_roots(source: str, roots: Any) -> tuple[str, ...]:
    if not isinstance(roots, list):
        raise PipelineConfigError(f"{source}: package_roots={roots!r}: must be a list of folders "
                                  "(relative to the project root, or absolute)")
    resolved = []
    for i, root in enumerate(roots):
        _string(f"{source}: package_roots[{i}]", root)
        path = Path(root) if Path(root).is_absolute() else settings.PROJECT_ROOT / root
        if not path.is_dir():
            raise PipelineConfigError(f"{source}: package_roots[{i}]={root!r}: no such folder ({path})")
        resolved.append(str(path.resolve()))
    return tuple(resolved)


def add_package_roots(roots: Iterable[str]) -> None:
    """Put `roots` first on this process's sys.path (once each): the user's packages import."""
    for root in reversed(list(roots)):
        if root not in sys.path:
            sys.path.insert(0, root)


def module_missing(path: str, roots: Sequence[str] = ()) -> str | None:
    """Why the module of `module:attr` cannot be found, or None when it can. Finds it without
    running it (`importlib.util.find_spec`; its parent packages are imported, as for any import):
    the attribute is checked when the task imports it."""
    module = path.partition(":")[0]
    # The project root is always searched: the tasks run from it (make demo, make ui add it).
    added = [root for root in (*roots, str(settings.PROJECT_ROOT)) if root not in sys.path]
    sys.path[:0] = added
    try:
        found = importlib.util.find_spec(module)
    except Exception as exc:  # noqa: BLE001 - a parent package is missing or fails to import
        found, why = None, f" ({type(exc).__name__}: {exc})"
    else:
        why = ""
    finally:
        for root in added:
            sys.path.remove(root)
    if found is not None:
        return None
    where = f"package_roots {', '.join(roots)}" if roots else "no package_roots"
    return f"no module {module!r}{why}: is its package installed, or its folder in package_roots? ({where})"


def _class_path(where: str, value: Any, roots: Sequence[str], accepted: str = "'module:Class'") -> str:
    path = _string(where, value, FACTORY_RE, accepted)
    if why := module_missing(path, roots):
        raise PipelineConfigError(f"{where}={path!r}: {why}")
    return path


def _gate(source: str, gate: Mapping[str, Any], metric: Metric) -> tuple[float, float]:
    """(threshold, min_improvement), checked against the metric's range in the file's own terms."""
    if "threshold" in gate and "floor" in gate:
        raise PipelineConfigError(f"{source}: give either gate.threshold or gate.floor (its older name), not both")
    key = "floor" if "floor" in gate else "threshold"
    if key in gate:
        threshold = float(_number(f"{source}: gate.{key}", gate[key]))
    elif metric.higher_is_better:
        threshold = metric.minimum if metric.minimum is not None else 0.0
    elif metric.maximum is not None:
        threshold = metric.maximum
    else:  # a default ceiling of 0 would refuse every candidate
        raise PipelineConfigError(
            f"{source}: gate.threshold is required for metric {metric.name} (lower is better) without metric.maximum: "
            f"it is the ceiling a candidate's {metric.name} must not exceed")
    min_improvement = float(_number(f"{source}: gate.min_improvement", gate.get("min_improvement", 0.0)))
    try:  # the gate's own checks, reported under the file's keys
        PromotionGate(floor=threshold, min_improvement=min_improvement, metric=metric.name,
                      direction=metric.direction, bounds=(metric.minimum, metric.maximum))
    except ValueError as exc:
        text = str(exc)
        text = f"gate.{key}{text[len('floor'):]}" if text.startswith("floor=") else f"gate.{text}"
        raise PipelineConfigError(f"{source}: {text} (the range of metric {metric.name}: metric.minimum, "
                                  f"metric.maximum; {metric.direction} is better)") from None
    return threshold, min_improvement


def _relative_path(where: str, value: Any) -> str:
    text = _string(where, value, accepted="a path relative to the project")
    if text.startswith("/") or ".." in text.split("/"):
        raise PipelineConfigError(f"{where}={value!r}: must be a path relative to the project, without '..'")
    return text.rstrip("/")


def _training_code(source: str, training: Any) -> tuple[str, ...]:
    """`python -m trainer.user`'s target for the `training:` section (() when there is none)."""
    if training is None:
        return ()
    if not isinstance(training, Mapping):
        raise PipelineConfigError(f"{source}: training must be a mapping with keys {', '.join(sorted(_TRAINING_KEYS))}")
    _check_keys(f"{source}: training", training, _TRAINING_KEYS)
    if "entrypoint" not in training and "command" not in training:
        if training and set(training) <= _PLATFORM_TRAINING_KEYS:  # gangflow's loop, its launcher and limits
            return ()
        raise PipelineConfigError(f"{source}: training: give exactly one of training.entrypoint (module:function) and "
                                  "training.command; leave the section out for gangflow's own loop")
    try:
        return user_code_args(entrypoint=training.get("entrypoint"), kwargs=training.get("kwargs"),
                              command=training.get("command"), project_root=settings.PROJECT_ROOT, prefix="training.")
    except ValueError as exc:
        raise PipelineConfigError(f"{source}: {exc}") from None


def _evaluation_entrypoint(source: str, evaluation: Any) -> str | None:
    if evaluation is None:
        return None
    if not isinstance(evaluation, Mapping):
        raise PipelineConfigError(f"{source}: evaluation must be a mapping with keys {', '.join(sorted(_EVALUATION_KEYS))}")
    _check_keys(f"{source}: evaluation", evaluation, _EVALUATION_KEYS)
    if "entrypoint" not in evaluation:
        return None
    return _string(f"{source}: evaluation.entrypoint", evaluation["entrypoint"], _ENTRYPOINT_RE,
                   "module:function, e.g. mypkg.evaluate:score (called with the model folder and the test split)")


def parse_pipeline(raw: Mapping[str, Any], *, source: str, name: str | None = None) -> PipelineConfig:
    """A `PipelineConfig` from one pipeline file's mapping; raises PipelineConfigError naming the key."""
    if not isinstance(raw, Mapping):
        raise PipelineConfigError(f"{source}: must be a mapping of keys (see docs/extending.md)")
    _check_keys(source, raw, _KEYS)
    roots = _package_roots(source, raw.get("package_roots") or [])
    pname = _string(f"{source}: name", raw.get("name", name), _NAME_RE,
                    "lower-case letters, digits, '_' and '-', starting with a letter (at most 40)")
    if name is not None and pname != name:
        raise PipelineConfigError(f"{source}: name={pname!r} differs from the file name {name!r}.yaml")
    dataset = raw.get("dataset") or {}
    if not isinstance(dataset, Mapping):
        raise PipelineConfigError(f"{source}: dataset must be a mapping with keys {', '.join(sorted(_DATASET_KEYS))}")
    _check_keys(f"{source}: dataset", dataset, _DATASET_KEYS)
    for key in ("stage", "out", "suite"):
        if key not in dataset:
            raise PipelineConfigError(f"{source}: dataset.{key} is required (keys: {', '.join(sorted(_DATASET_KEYS))})")
    metric_raw = raw.get("metric") or {}
    if not isinstance(metric_raw, Mapping):
        raise PipelineConfigError(f"{source}: metric must be a mapping with keys {', '.join(sorted(_METRIC_KEYS))}")
    _check_keys(f"{source}: metric", metric_raw, _METRIC_KEYS)
    try:
        direction = check_direction(metric_raw.get("direction", "higher"))
    except ValueError as exc:
        raise PipelineConfigError(f"{source}: metric.{exc}") from None
    bounds = {k: None if metric_raw.get(k) is None else float(_number(f"{source}: metric.{k}", metric_raw[k]))
              for k in ("minimum", "maximum")}
    metric = Metric(_string(f"{source}: metric.name", metric_raw.get("name", "accuracy"), re.compile(r"^[a-z][a-z0-9_]*$"),
                            "a metric key such as accuracy, macro_f1, rmse, mae"), direction, **bounds)
    gate = raw.get("gate") or {}
    if not isinstance(gate, Mapping):
        raise PipelineConfigError(f"{source}: gate must be a mapping with keys {', '.join(sorted(_GATE_KEYS))}")
    _check_keys(f"{source}: gate", gate, _GATE_KEYS)
    backends = raw.get("backends") or {}
    if not isinstance(backends, Mapping):
        raise PipelineConfigError(f"{source}: backends must map a backend name to 'module:Class'")
    for bname, path in backends.items():
        _string(f"{source}: backends key", bname, re.compile(r"^[a-z][a-z0-9_]*$"), "a lower-case name")
        if bname in BUILTIN_BACKENDS:
            raise PipelineConfigError(f"{source}: backends.{bname}: {bname!r} is built in; choose another name")
        _class_path(f"{source}: backends.{bname}", path, roots)
    allowed = raw.get("allowed_models") or []
    if not isinstance(allowed, list):
        raise PipelineConfigError(f"{source}: allowed_models must be a list of 'module:function'")
    for i, spec in enumerate(allowed):
        _class_path(f"{source}: allowed_models[{i}]", spec, roots, "'module:function'")
    operators = raw.get("operators") or {}
    if not isinstance(operators, Mapping):
        raise PipelineConfigError(f"{source}: operators must map a stage ({', '.join(STAGES)}) to 'module:Class'")
    for stage, path in operators.items():
        if stage not in STAGES:
            raise PipelineConfigError(f"{source}: operators.{stage}: unknown stage; accepted stages are {', '.join(STAGES)}")
        _class_path(f"{source}: operators.{stage}", path, roots)
    suite = _class_path(f"{source}: dataset.suite", dataset["suite"], roots, "'module:function'")
    trainer_config = settings.trainer_config_path(raw.get("trainer_config"))
    trainer = _trainer_config(trainer_config, source)
    for key, factory in (("model.factory", trainer.model.factory), ("data.factory", trainer.data.factory)):
        if why := module_missing(factory, roots):
            raise PipelineConfigError(f"{trainer_config} (trainer_config of {source}): {key}={factory!r}: {why}")
    training_code = _training_code(source, raw.get("training"))
    if training_code and trainer.checkpoint.every_steps == "auto":
        raise PipelineConfigError(f"{trainer_config} (trainer_config of {source}): checkpoint.every_steps='auto' is for gangflow's "
                                  "own loop: training code of one's own (training.entrypoint / training.command) decides when it "
                                  "saves and reads run.params['checkpoint.every_steps'] as an integer; give an integer >= 1")
    evaluation_entrypoint = _evaluation_entrypoint(source, raw.get("evaluation"))
    for key, path in (("training.entrypoint", (raw.get("training") or {}).get("entrypoint")),
                      ("evaluation.entrypoint", evaluation_entrypoint)):
        if path and (why := module_missing(path, roots)):
            raise PipelineConfigError(f"{source}: {key}={path!r}: {why}")
    task = trainer.train.task  # one place: the trainer's config (and so the model card)
    evaluated = EVALUATED_METRICS.get(task, ())
    # An evaluate class or an evaluation entry point reports metrics of its own: checked when it runs.
    if "evaluate" not in operators and not evaluation_entrypoint and metric.name not in evaluated:
        raise PipelineConfigError(
            f"{source}: metric.name={metric.name!r}: the evaluation of a {task} model (train.task in {trainer_config}) "
            f"reports {', '.join(evaluated)}; gate on one of them, or name an evaluate class that adds it (operators.evaluate)")
    threshold, min_improvement = _gate(source, gate, metric)
    schedule = os.environ.get("GANGFLOW_SCHEDULE", raw.get("schedule"))
    sizes = raw.get("local_world_sizes", [1, 2, 4, 8])
    if not isinstance(sizes, list) or not sizes:
        raise PipelineConfigError(f"{source}: local_world_sizes={sizes!r}: must be a non-empty list of integers >= 1")
    for i, size in enumerate(sizes):  # a gang task of 0 ranks takes no pool slot and trains nothing
        if not is_count(size, 1):
            raise PipelineConfigError(f"{source}: local_world_sizes[{i}]={size!r}: accepted values: integers >= 1 "
                                      "(one local gang task per size)")
    if len(set(sizes)) != len(sizes):  # one task per size: a size twice is two tasks of one id
        raise PipelineConfigError(f"{source}: local_world_sizes={sizes!r}: each size at most once "
                                  "(one local gang task per size)")
    # checked even where GANGFLOW_RETRY_BASE_DELAY overrides it: the file is wrong either way
    retry_base_delay = _number(f"{source}: retry_base_delay_seconds", raw.get("retry_base_delay_seconds", 5))
    if not 0 <= retry_base_delay <= _DAY_S:
        raise PipelineConfigError(f"{source}: retry_base_delay_seconds={retry_base_delay!r}: accepted values: "
                                  f"seconds from 0 to {_DAY_S} (the first retry's delay; later ones grow from it)")
    retries = _number(f"{source}: retries", raw.get("retries", 3), integer=True)
    if not 0 <= retries <= MAX_RETRIES:  # Airflow reads a negative count as "never retry", silently
        raise PipelineConfigError(f"{source}: retries={retries!r}: accepted values: integers from 0 to {MAX_RETRIES} "
                                  "(each task's retries)")
    default_backend = raw.get("default_backend", "local")
    training = raw.get("training") or {}
    if not isinstance(training, Mapping):
        raise PipelineConfigError(f"{source}: training must be a mapping with keys {', '.join(sorted(_TRAINING_KEYS))}")
    _check_keys(f"{source}: training", training, _TRAINING_KEYS)
    launcher = training.get("launcher", "torchrun")
    if launcher not in LAUNCHERS:
        raise PipelineConfigError(f"{source}: training.launcher={launcher!r}: accepted values are {', '.join(LAUNCHERS)}")
    if training_code and launcher != "torchrun":
        raise PipelineConfigError(f"{source}: training.launcher={launcher!r}: training code of one's own "
                                  "(training.entrypoint / training.command) runs under launcher 'torchrun' only")
    max_preemptions = training.get("max_preemptions", DEFAULT_MAX_PREEMPTIONS)
    if not is_count(max_preemptions, 0):
        raise PipelineConfigError(f"{source}: training.max_preemptions={max_preemptions!r}: accepted values: an integer "
                                  ">= 0 (preemptions re-launched without spending a retry; 0: each one spends a retry)")
    limits = {"max_run_time_seconds": "seconds a try's gang may run; past it the ranks are stopped with a final "
                                      "checkpoint and the try fails",
              "max_queue_wait_seconds": "seconds a gang may wait for admission where it queues (Kubernetes)"}
    for key, meaning in limits.items():
        value = training.get(key)
        if value is not None and not (is_count(value, 1) and value <= _YEAR_S):
            raise PipelineConfigError(f"{source}: training.{key}={value!r}: accepted values: an integer from 1 to "
                                      f"{_YEAR_S} ({meaning}), or leave it out for no limit")
    config = PipelineConfig(
        name=pname,
        dag_id=_string(f"{source}: dag_id", raw.get("dag_id", f"train_{pname}"), _ID_RE, _ID_ACCEPTED),
        publish_dag_id=_string(f"{source}: publish_dag_id", raw.get("publish_dag_id", f"publish_{pname}"), _ID_RE,
                               _ID_ACCEPTED),
        description=str(raw.get("description", "")),
        source=source,
        schedule=None if schedule in (None, "", "none", "None") else str(schedule),
        dataset_stage=_string(f"{source}: dataset.stage", dataset["stage"]),
        dataset_out=_string(f"{source}: dataset.out", dataset["out"], re.compile(r"^[A-Za-z0-9_./-]+$"),
                            "a relative path, e.g. data/<name>"),
        dataset_asset=_string(f"{source}: dataset.asset", dataset.get("asset", f"gangflow-dataset-{pname}")),
        suite=suite,
        trainer_config=str(trainer_config),
        task=task,
        data_factory=trainer.data.factory,
        metric=metric,
        promotion_floor=threshold,
        min_improvement=min_improvement,
        model_name=_string(f"{source}: model_name", raw.get("model_name", f"gangflow-{pname}"), _MODEL_NAME,
                           "a registered model name: 1-256 characters, no '/', ':' or control characters (MLflow's rule)"),
        backends=dict(backends),
        default_backend=default_backend,
        launcher=launcher,
        world_size=_number(f"{source}: world_size", raw.get("world_size", 2), integer=True),
        local_world_sizes=tuple(sizes),
        retries=retries,
        retry_base_delay_s=float(os.environ.get("GANGFLOW_RETRY_BASE_DELAY") or retry_base_delay),
        allowed_models=tuple(allowed),
        max_steps=trainer.train.max_steps,
        learning_rate=trainer.train.lr,
        batch_size=trainer.train.batch_size,
        checkpoint_every_steps=trainer.checkpoint.every_steps,
        dataset_version=_pinned_version(dataset["out"]),
        package_roots=roots,
        operators=dict(operators),
        training_code=training_code,
        training=dict(raw["training"]) if raw.get("training") else None,
        evaluation_entrypoint=evaluation_entrypoint,
        max_preemptions=max_preemptions,
        max_run_time_seconds=training.get("max_run_time_seconds"),
        max_queue_wait_seconds=training.get("max_queue_wait_seconds"),
    )
    if default_backend not in config.backend_names:
        raise PipelineConfigError(f"{source}: default_backend={default_backend!r}: accepted values are "
                                  f"{', '.join(config.backend_names)}")
    return config


_DATASET_ATTRS = ("dataset_stage", "dataset_out", "dataset_asset", "suite")


@dataclass(frozen=True)
class BrokenPipeline:
    """A pipeline file that could not be read: its error, and the DAG id that reports it."""

    name: str  # the file's stem
    source: str
    dag_id: str
    error: PipelineConfigError


@dataclass(frozen=True)
class PipelineFiles:
    """Every pipeline file of a folder: the good ones by name, the broken ones by file stem."""

    configs: dict[str, PipelineConfig]
    broken: dict[str, BrokenPipeline]


def pipeline_files(folder: str | None = None) -> PipelineFiles:
    """Every pipeline file (`*.yaml`) in `folder` (default `pipelines_dir()`, as GANGFLOW_PIPELINES
    says now), sorted; a file that fails to parse is set aside with its error, so one bad file
    never hides the others.

    Two pipelines may not share a DAG id, a dataset output or an Asset: the later file is broken,
    its error naming both files.
    """
    return _pipeline_files(str(Path(folder) if folder else pipelines_dir()))


@functools.cache
def _pipeline_files(folder: str) -> PipelineFiles:
    root = Path(folder)
    found: dict[str, PipelineConfig] = {}
    broken: dict[str, BrokenPipeline] = {}
    for path in sorted(root.glob("*.yaml")):
        raw: Any = None
        try:
            try:
                raw = _load_yaml(path)
            except Exception as exc:  # noqa: BLE001 - a YAML syntax error names the file
                raise PipelineConfigError(f"{path}: not valid YAML ({exc})") from None
            config = parse_pipeline(raw, source=str(path), name=path.stem)
            for other in found.values():
                # Two pipelines may train on one dataset when they declare it identically (stage, out,
                # asset, suite): a new version then triggers both.
                same_dataset = all(getattr(other, a) == getattr(config, a) for a in _DATASET_ATTRS)
                for attr in ("dag_id", "publish_dag_id", "dataset_out", "dataset_asset", "model_name"):
                    if attr in ("dataset_out", "dataset_asset") and same_dataset:
                        continue
                    if getattr(other, attr) == getattr(config, attr):
                        hint = (f" (a shared dataset must be declared identically: {', '.join(_DATASET_ATTRS)})"
                                if attr in ("dataset_out", "dataset_asset") else "")
                        raise PipelineConfigError(f"{path} and {other.source} share {attr}={getattr(config, attr)!r}{hint}")
        except Exception as exc:  # noqa: BLE001 - isolate the file, whatever broke in it
            error = exc if isinstance(exc, PipelineConfigError) else PipelineConfigError(f"{path}: {type(exc).__name__}: {exc}")
            broken[path.stem] = BrokenPipeline(path.stem, str(path), _broken_dag_id(raw, path.stem), error)
            continue
        found[config.name] = config
    taken = {dag_id for c in found.values() for dag_id in (c.dag_id, c.publish_dag_id)}
    for stem, bad in list(broken.items()):  # a broken file's DAG never replaces a good one's
        if bad.dag_id in taken:
            broken[stem] = BrokenPipeline(bad.name, bad.source, f"pipeline_error_{_safe_id(stem)}", bad.error)
        taken.add(broken[stem].dag_id)
    return PipelineFiles(found, broken)


def _safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:190] or "_"


def _broken_dag_id(raw: Any, stem: str) -> str:
    """The training DAG id the file meant to have when it says one, else `train_<stem>`."""
    dag_id = raw.get("dag_id") if isinstance(raw, Mapping) else None
    return dag_id if isinstance(dag_id, str) and _ID_RE.fullmatch(dag_id) else f"train_{_safe_id(stem)}"


@functools.cache
def load_pipelines(folder: str | None = None) -> dict[str, PipelineConfig]:
    """Every pipeline of `folder` (default `pipelines_dir()`), by name; raises the first broken
    file's PipelineConfigError (a tool that needs every pipeline). The DAG files use
    `pipeline_files`, which sets a broken file aside."""
    files = pipeline_files(folder)
    for bad in files.broken.values():
        raise bad.error
    return files.configs


def pipeline(name: str = DEFAULT_PIPELINE) -> PipelineConfig:
    """The pipeline called `name` (its file's error when that file is broken); PipelineConfigError
    lists the known ones otherwise."""
    files = pipeline_files()
    if name in files.broken:
        raise files.broken[name].error
    if name not in files.configs:
        raise PipelineConfigError(
            f"pipeline={name!r}: no {pipelines_dir() / (name + '.yaml')}; known pipelines: {', '.join(files.configs) or 'none'}"
        )
    return files.configs[name]


PIPELINE_TAG_PREFIX = "pipeline:"


def pipeline_tag(name: str) -> str:
    """The tag every DAG of pipeline `name` carries (`pipeline:<name>`): how a DAG names its pipeline."""
    return f"{PIPELINE_TAG_PREFIX}{name}"


def tagged_pipeline(tags: Iterable[str]) -> str | None:
    """The pipeline a DAG's tags name (see `pipeline_tag`), or None."""
    return next((tag.removeprefix(PIPELINE_TAG_PREFIX) for tag in tags if tag.startswith(PIPELINE_TAG_PREFIX)), None)


def defaults(name: str = DEFAULT_PIPELINE) -> PipelineConfig:
    """The defaults of one pipeline (the digits pipeline unless named)."""
    return pipeline(name)


# --------------------------------------------------------------------------------------------
# Run-time checks of a run's Params (admit_gang), and the dataset version a run trains


def check_params(values: Mapping[str, Any], schemas: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse what the trigger form's JSON Schemas let through, before a gang is admitted.

    JSON Schema counts 2.0 as an integer and NaN passes every bound; and it cannot relate two
    fields. `schemas` are the DAG's Param schemas (`{name: param.schema}`), so the accepted
    ranges live in one place. Raises `InvalidParams` naming every offending field.
    """
    problems = []
    for name, schema in schemas.items():
        if name in values and (problem := _check_value(name, values[name], schema)):
            problems.append(problem)
    world_size, batch_size = values.get("world_size"), values.get("batch_size")
    if is_count(world_size, 1) and is_integer(batch_size) and batch_size % world_size:
        lower, upper = batch_size // world_size * world_size, (batch_size // world_size + 1) * world_size
        hint = f"{lower} or {upper}" if lower else str(upper)
        problems.append(
            f"batch_size={batch_size} is not a multiple of world_size={world_size}: each rank takes "
            f"batch_size / world_size samples (e.g. batch_size {hint})"
        )
    if problems:
        raise InvalidParams("; ".join(problems))


#: Where each trigger-form field's default comes from: a key of the pipeline file, or (train.*, checkpoint.*)
#: of its trainer config (see `parse_pipeline`, `_gate`).
FORM_FIELD_KEYS = {
    "dataset_version": "dvc.lock's version of dataset.out", "world_size": "world_size", "backend": "default_backend",
    "launcher": "training.launcher", "max_steps": "train.max_steps", "learning_rate": "train.lr",
    "batch_size": "train.batch_size", "checkpoint_every_steps": "checkpoint.every_steps",
    "max_run_time_seconds": "training.max_run_time_seconds", "max_queue_wait_seconds": "training.max_queue_wait_seconds",
    "promotion_floor": "gate.threshold", "min_improvement": "gate.min_improvement",
}  # fmt: skip


def check_form_defaults(config: PipelineConfig, params: Mapping[str, Any]) -> None:
    """Refuse a pipeline whose own values its trigger form (`params`, the DAG's Airflow Params) or
    admission (`check_params`) refuses: Airflow would refuse to build its DAG (a schedule needs valid
    defaults), taking the DAG file down, or admission every run. PipelineConfigError naming the file
    (the trainer config for train.* and checkpoint.*), the key and what is accepted."""
    for name, param in params.items():
        key = FORM_FIELD_KEYS.get(name, name)
        problem = _value_problem(param.value, param.schema)
        if problem is None:
            try:  # the schema as Airflow checks it (enum, NaN, ...)
                param.resolve(suppress_exception=False)
            except Exception as exc:  # noqa: BLE001 - ParamValidationError, reported under the file's key
                problem = f"{exc} ({_accepted(param.schema)})"
        if problem:
            where = (f"{config.trainer_config} (trainer_config of {config.source})"
                     if key.startswith(("train.", "checkpoint.")) else config.source)
            raise PipelineConfigError(f"{where}: {key}={param.value!r}: the trigger form's {name} refuses it: {problem}")
    try:  # what relates two fields (batch_size, a multiple of world_size)
        check_params({name: param.value for name, param in params.items()},
                     {name: param.schema for name, param in params.items()})
    except InvalidParams as exc:
        named = ", ".join(
            f"{name} from {key}" + (f" in {config.trainer_config}" if key.startswith(("train.", "checkpoint.")) else "")
            for name, key in FORM_FIELD_KEYS.items() if f"{name}=" in str(exc))
        raise PipelineConfigError(f"{config.source}: every run would be refused at admission: {exc} "
                                  f"(the form's defaults: {named})") from None


def _check_value(name: str, value: Any, schema: Mapping[str, Any]) -> str | None:
    problem = _value_problem(value, schema)
    return problem and f"{name}={value!r}: {problem}"


def _value_problem(value: Any, schema: Mapping[str, Any]) -> str | None:
    """Why one value fails what its Param schema cannot say (NaN, 2.0, a pattern matched before a final
    newline) or says (its range), or None."""
    kind = schema.get("type")
    if isinstance(kind, list):  # ["null", "integer"]: a field the form may leave empty
        if value is None and "null" in kind:
            return None
        kind = next((k for k in kind if k != "null"), None)
    if kind == "integer":
        if not is_integer(value):
            return f"must be an integer, written without a decimal point ({_accepted(schema)})"
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"must be a finite number ({_accepted(schema)})"
    elif kind == "string" and schema.get("pattern") and isinstance(value, str):
        # JSON Schema searches the pattern, and Python's `$` matches before a final newline ("auto\n"):
        # the whole value must match (the schema's pattern stays ECMA-262 for the form).
        return None if re.fullmatch(schema["pattern"], value) else f"does not match the whole pattern ({_accepted(schema)})"
    else:
        return None
    low, high = schema.get("minimum"), schema.get("maximum")
    xlow, xhigh = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if (low is not None and value < low) or (high is not None and value > high) or (
        (xlow is not None and value <= xlow) or (xhigh is not None and value >= xhigh)
    ):
        return f"out of range ({_accepted(schema)})"
    return None


def _accepted(schema: Mapping[str, Any]) -> str:
    if schema.get("enum") is not None:
        return f"accepted values: {', '.join(map(str, schema['enum']))}"
    if schema.get("pattern") is not None:
        return f"accepted: strings matching {schema['pattern']}"
    bounds = []
    if schema.get("minimum") is not None:
        bounds.append(f">= {schema['minimum']}")
    if schema.get("exclusiveMinimum") is not None:
        bounds.append(f"> {schema['exclusiveMinimum']}")
    if schema.get("maximum") is not None:
        bounds.append(f"<= {schema['maximum']}")
    if schema.get("exclusiveMaximum") is not None:
        bounds.append(f"< {schema['exclusiveMaximum']}")
    kind = schema.get("type")
    what = "integers" if kind == "integer" or (isinstance(kind, list) and "integer" in kind) else "finite numbers"
    empty = ", or empty" if isinstance(kind, list) and "null" in kind else ""
    return f"accepted: {what} {' and '.join(bounds)}".rstrip() + empty


def dataset_version_of_run(params: Mapping[str, Any], dag_run: Any, asset_name: str = DATASET_ASSET_NAME) -> str:
    """The dataset version a DAG run trains (a template macro of every pipeline DAG).

    A run started by events on the dataset Asset (`asset_name`, the pipeline's) trains the newest event's version
    (`extra["version"]`, as `publish_dataset` emits it), not the parse-time default of the
    `dataset_version` Param; any other run trains its Param. An event without a version (one
    posted by hand) falls back to the Param.
    """
    events = [
        event
        for event in (getattr(dag_run, "consumed_asset_events", None) or ())
        if getattr(event.asset, "name", None) == asset_name
        and isinstance(event.extra, Mapping)
        and event.extra.get(ASSET_VERSION_KEY) not in (None, "")
    ]
    if events:
        return str(max(events, key=lambda event: event.timestamp).extra[ASSET_VERSION_KEY])
    return params["dataset_version"]
