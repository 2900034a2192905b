"""Configuration: one small dataclass per params.yaml section, validated on construction.

`load_config(path, overrides)` reads the trainer's sections of a params file, applies
`--set section.key=value` overrides and builds a `Config`; an unknown key or a bad value raises
`ConfigError` naming the field, the value and what is accepted. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from trainer.errors import ConfigError
from trainer.urls import credentials_refusal, has_credentials
from trainer.checks import is_integer

#: `module:name`, a dotted module path and a name in it: how a factory, a model architecture, an
#: expectation suite or a backend class is named (here, in trainer.allowlist and in pipeline files).
FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_MD5_RE = re.compile(r"^[0-9a-f]{32}$")


def _fail(key: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is invalid: {accepted}")


class _Section:
    """Type-checks the fields (from their annotations), then runs `validate()`."""

    SECTION = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            key = f"{self.SECTION}.{f.name}"
            value = getattr(self, f.name)
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise _fail(key, value, "must be an integer")
            elif f.type == "float":
                value = _as_float(key, value)
            elif f.type == "str":
                if value is None:
                    value = ""
                if not isinstance(value, str):
                    raise _fail(key, value, "must be a string")
            elif f.type == "bool":
                if not isinstance(value, bool):
                    raise _fail(key, value, "must be true or false")
            object.__setattr__(self, f.name, value)
        self.validate()

    def validate(self) -> None:  # pragma: no cover - overridden
        pass

    def _require(self, name: str, ok: bool, accepted: str) -> None:
        if not ok:
            raise _fail(f"{self.SECTION}.{name}", getattr(self, name), accepted)


def _no_credentials(key: str, url: str) -> None:
    """URL settings reach argv, logs and MLflow params: user:password@ in them is refused."""
    if has_credentials(url):
        raise ConfigError(credentials_refusal(key, url))


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _fail(key, value, "must be a number")
    if isinstance(value, str):  # YAML 1.1 reads `1e-3` as a string
        try:
            value = float(value)
        except ValueError:
            raise _fail(key, value, "must be a number") from None
    if not isinstance(value, (int, float)):
        raise _fail(key, value, "must be a number")
    if not math.isfinite(value):
        raise _fail(key, value, "must be a finite number")
    return float(value)


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION = "data"
    train_path: str = "data/digits/train.parquet"
    test_path: str = "data/digits/test.parquet"
    train_md5: str = ""
    factory: str = "trainer.data:parquet_dataset"
    num_workers: int = 0
    remote: str = ""  # fsspec URL of a DVC 3 remote (s3://bucket/dvc, file:///abs/dvc-remote, a local path)
    version: str = ""  # md5 of the dataset's DVC directory object: fetch by content address

    def validate(self) -> None:
        self._require("train_path", bool(self.train_path), "must be a non-empty path")
        self._require("test_path", bool(self.test_path), "must be a non-empty path")
        self._require("train_md5", self.train_md5 == "" or bool(_MD5_RE.fullmatch(self.train_md5)),
                      'must be "" (no check) or 32 lowercase hex digits (an md5, as DVC records it)')
        self._require("factory", bool(FACTORY_RE.fullmatch(self.factory)),
                      "must be 'module:function', e.g. 'trainer.data:parquet_dataset'")
        self._require("num_workers", self.num_workers >= 0, "must be >= 0")
        self._require("version", self.version == "" or bool(_MD5_RE.fullmatch(self.version)),
                      'must be "" (read data.train_path/test_path) or 32 lowercase hex digits '
                      "(the md5 of the dataset's DVC directory object, without '.dir')")
        self._require("remote", bool(self.remote.strip()) or not self.version,
                      "must be the DVC remote's URL (e.g. s3://bucket/dvc or file:///abs/dvc-remote) when data.version is set")
        _no_credentials("data.remote", self.remote)


@dataclass(frozen=True)
class ModelConfig:
    """`factory` plus the keyword arguments it is called with (the rest of the section)."""

    SECTION = "model"
    factory: str = "trainer.models:mlp"
    kwargs: dict[str, Any] = field(default_factory=lambda: {"hidden": 128, "num_classes": 10})

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or not FACTORY_RE.fullmatch(self.factory):
            raise _fail("model.factory", self.factory, "must be 'module:function', e.g. 'trainer.models:mlp'")
        if not isinstance(self.kwargs, dict):
            raise _fail("model", self.kwargs, "must be a mapping of factory keyword arguments")
        for key, value in self.kwargs.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise _fail(f"model.{key}", value, "model keys must be Python identifiers (factory keyword arguments)")
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise _fail(f"model.{key}", value, "must be a YAML scalar, list or mapping") from None

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> ModelConfig:
        section = dict(section)
        factory = section.pop("factory", cls.factory)
        if factory == cls.factory:  # the default factory's defaults apply under the given keys
            section = {**cls().kwargs, **section}
        return cls(factory=factory, kwargs=section)


@dataclass(frozen=True)
class TrainConfig(_Section):
    SECTION = "train"
    max_steps: int = 600
    seed: int = 1234
    batch_size: int = 64  # global: split evenly over the ranks
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0001
    warmup_steps: int = 20
    log_every_steps: int = 10
    optimizer: str = "sgd"
    lr_schedule: str = "cosine"
    device: str = "auto"
    task: str = "classification"  # classification (cross-entropy) | regression (mean squared error)

    def validate(self) -> None:
        self._require("max_steps", self.max_steps >= 1, "must be an integer >= 1")
        self._require("seed", 0 <= self.seed < 2**32, "must be an integer in [0, 2**32)")
        self._require("batch_size", self.batch_size >= 1, "must be an integer >= 1 (the global batch, split over ranks)")
        self._require("lr", self.lr > 0, "must be a number > 0")
        self._require("momentum", 0 <= self.momentum < 1, "must be a number in [0, 1)")
        self._require("weight_decay", self.weight_decay >= 0, "must be a number >= 0")
        self._require("warmup_steps", self.warmup_steps >= 0, "must be an integer >= 0")
        self._require("log_every_steps", self.log_every_steps >= 1, "must be an integer >= 1")
        self._require("optimizer", self.optimizer in ("sgd", "adamw"), "must be one of: sgd, adamw")
        self._require("lr_schedule", self.lr_schedule in ("cosine", "constant"), "must be one of: cosine, constant")
        self._require("device", self.device in ("auto", "cpu", "cuda"), "must be one of: auto, cpu, cuda")
        self._require("task", self.task in ("classification", "regression"), "must be one of: classification, regression")


#: `checkpoint.every_steps: auto`
AUTO = "auto"


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    SECTION = "checkpoint"
    every_steps: int | str = 100  # or "auto": Young/Daly from measured save cost and failure rate (trainer.checkpoint_interval)
    keep_last: int = 2
    async_save: bool = True  # commit from a background thread (the loop goes on); the commit stays atomic
    grace_period_s: float = 25.0  # after SIGTERM: hard exit (75) if the final checkpoint takes longer
    mtbf_prior_s: float = 86400.0  # auto: the MTBF assumed when the pipeline has no failure history
    auto_min_steps: int = 10  # auto: bounds of the chosen interval
    auto_max_steps: int = 10000

    def validate(self) -> None:
        every = self.every_steps
        self._require("every_steps", every == AUTO or (is_integer(every) and every >= 1),
                      f"must be an integer >= 1 or {AUTO!r} (chosen from the measured save cost and failure rate)")
        self._require("mtbf_prior_s", self.mtbf_prior_s > 0, "must be a number of seconds > 0 (e.g. 86400: one failure a day)")
        self._require("auto_min_steps", self.auto_min_steps >= 1, "must be an integer >= 1")
        self._require("auto_max_steps", self.auto_max_steps >= self.auto_min_steps,
                      f"must be an integer >= checkpoint.auto_min_steps ({self.auto_min_steps})")
        self._require("keep_last", self.keep_last >= 1, "must be an integer >= 1")
        self._require("grace_period_s", self.grace_period_s > 0, "must be a number of seconds > 0")


@dataclass(frozen=True)
class TrackingConfig(_Section):
    SECTION = "tracking"
    mlflow_uri: str = ""
    experiment: str = "gangflow"
    flush_every_s: float = 5.0  # MLflow metrics are batched and sent by a background thread
    progress_every_s: float = 10.0  # rank 0's progress line (task log, MLflow); 0 = off

    def validate(self) -> None:
        _no_credentials("tracking.mlflow_uri", self.mlflow_uri)
        self._require("experiment", bool(self.experiment.strip()), "must be a non-empty experiment name")
        self._require("flush_every_s", self.flush_every_s > 0, "must be a number of seconds > 0")
        self._require("progress_every_s", self.progress_every_s >= 0, "must be a number of seconds >= 0 (0 = no progress lines)")


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "tracking": TrackingConfig,
}


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Config:
        check_section_names(raw)
        built: dict[str, Any] = {}
        for name, section_cls in SECTIONS.items():
            section = raw.get(name) or {}
            if not isinstance(section, Mapping):
                raise _fail(name, section, "must be a mapping of keys to values")
            if section_cls is ModelConfig:
                built[name] = ModelConfig.from_section(section)
                continue
            accepted = [f.name for f in fields(section_cls)]
            for key in section:
                if key not in accepted:
                    raise ConfigError(f"unknown key {name}.{key}; accepted keys of {name}: {', '.join(accepted)}")
            try:
                built[name] = section_cls(**section)
            except TypeError as exc:  # pragma: no cover - keys checked above
                raise ConfigError(f"section {name}: {exc}") from None
        return cls(**built)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config in params.yaml's layout (JSON-able)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS if name != "model"}
        out["model"] = {"factory": self.model.factory, **self.model.kwargs}
        return {name: out[name] for name in SECTIONS}

    def check_factories(self) -> None:
        """Import the dataset and model factories and check the model kwargs against the signature."""
        resolve_factory(self.data.factory, "data.factory")
        check_model_kwargs(self.model)


def resolve_factory(spec: str, key: str) -> Callable[..., Any]:
    if not FACTORY_RE.fullmatch(spec):
        raise _fail(key, spec, "must be 'module:function'")
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a config error
        raise _fail(key, spec, f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise _fail(key, spec, f"module {module_name!r} has no callable {func_name!r}")
    return func


def check_model_kwargs(model: ModelConfig) -> Callable[..., Any]:
    factory = resolve_factory(model.factory, "model.factory")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return factory
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key, value in model.kwargs.items():
        if key not in named:
            raise _fail(f"model.{key}", value, f"{model.factory} takes no argument {key!r}; it accepts: {', '.join(named)}")
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            if name not in model.kwargs and name != "input_dim":
                raise ConfigError(f"model.{name} is missing: {model.factory} requires it")
    return factory


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value). String fields keep the text exactly as given
    (never YAML: `a #b` would lose ` #b` as a comment, `0123` would become a number); other
    fields are parsed as a YAML scalar (`true`, `0.1`, `[1, 2]`), and so are `model.*` keyword
    arguments, except that a YAML string result is replaced by the text as given (a quoted
    YAML string keeps its quotes removed)."""
    key, sep, text = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name or "." in name:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=0.1")
    if section not in SECTIONS:
        raise ConfigError(f"--set {item!r}: unknown section {section!r}; the trainer's sections are: {', '.join(SECTIONS)}")
    kind = _field_type(section, name)
    if kind == "str":
        return section, name, text
    if not text.strip():
        return section, name, ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: the value is not a YAML scalar ({exc.__class__.__name__})") from None
    if isinstance(value, str) and not text.strip().startswith(("'", '"')):
        value = text  # e.g. a path: YAML would cut it at ` #`
    return section, name, value


def _field_type(section: str, name: str) -> str | None:
    cls = SECTIONS[section]
    if cls is ModelConfig:
        return "str" if name == "factory" else None
    return next((f.type for f in fields(cls) if f.name == name), None)


def check_section_names(names: Iterable[Any]) -> None:
    """Refuse a section that looks like a misspelt trainer section. Others are other stages' (a DVC
    params.yaml holds them all) and are ignored, so a typo would silently keep the defaults."""
    import difflib

    for name in names:
        if isinstance(name, str) and name not in SECTIONS:
            near = difflib.get_close_matches(name.lower(), SECTIONS, n=1, cutoff=0.8)
            if near:
                raise ConfigError(f"section {name!r} is not the trainer's; did you mean {near[0]!r}? (the trainer's "
                                  f"sections: {', '.join(SECTIONS)}; other stages' sections are ignored)")


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Read `path` (None: built-in defaults), apply `--set` overrides, validate."""
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {str(path)!r}: not valid YAML ({exc})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {str(path)!r}: must be a mapping of sections")
        check_section_names(loaded)
        for name in SECTIONS:
            section = loaded.get(name)
            if section is None:
                continue
            if not isinstance(section, dict):
                raise _fail(name, section, "must be a mapping of keys to values")
            raw[name] = dict(section)
    for item in overrides:
        section, name, value = parse_override(item)
        raw.setdefault(section, {})[name] = value
    return Config.from_dict(raw)
