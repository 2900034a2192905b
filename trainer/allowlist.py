"""Which model architectures a model card may name, decided before anything is imported.

A model card is data: the factory it names must be allow-listed (entry points of the group
`gangflow.models`, `allowed_models`, `GANGFLOW_ALLOWED_MODELS`) and its kwargs must fit the
factory's signature, or `ModelNotAllowed` says why. Imports no model code (and not torch).
"""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from trainer.config import FACTORY_RE
from trainer.checks import is_integer
from trainer.model_card import WEIGHTS

ENTRY_POINT_GROUP = "gangflow.models"
ALLOWED_ENV = "GANGFLOW_ALLOWED_MODELS"

_WEIGHTS_RE = re.compile(r"^[\w.-]+\.safetensors$")
_SCALARS = (bool, int, float, str, type(None))


class ModelNotAllowed(ValueError):
    """A model card names an architecture (or kwargs) the platform does not allow."""


def _specs(values: Iterable[str] | str | None, where: str) -> list[str]:
    if values is None:
        return []
    if isinstance(values, str):
        values = values.split(",")
    out = []
    for value in values:
        value = str(value).strip()
        if not value:
            continue
        if not FACTORY_RE.fullmatch(value):
            raise ModelNotAllowed(f"{where}: {value!r} is not 'module:function' (e.g. 'trainer.models:mlp')")
        out.append(value)
    return out


def allowed_factories(extra: Iterable[str] | str | None = None) -> dict[str, str]:
    """Every name a card may use, mapped to the `module:function` it stands for."""
    allowed: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if FACTORY_RE.fullmatch(ep.value):  # a malformed entry point of some distribution is ignored
            allowed[ep.value] = ep.value
            allowed.setdefault(ep.name, ep.value)
    for spec in (*_specs(os.environ.get(ALLOWED_ENV), ALLOWED_ENV), *_specs(extra, "allowed_models")):
        allowed[spec] = spec
    return allowed


def card_model(card: Any) -> tuple[str, dict[str, Any]]:
    """(`model.factory`, `model.kwargs`) of a card, after checking their shape (no import)."""
    model = card.get("model") if isinstance(card, Mapping) else None
    if not isinstance(model, Mapping):
        raise ModelNotAllowed("model card: 'model' must be an object with 'factory' and 'kwargs'")
    factory, kwargs = model.get("factory"), model.get("kwargs", {})
    if not isinstance(factory, str) or not factory:
        raise ModelNotAllowed(f"model card: model.factory={factory!r} must be a name from the allow-list")
    if not isinstance(kwargs, Mapping):
        raise ModelNotAllowed(f"model card: model.kwargs={kwargs!r} must be an object of keyword arguments")
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ModelNotAllowed(f"model card: model.kwargs key {key!r} is not a keyword argument name")
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, _SCALARS) for v in items):
            raise ModelNotAllowed(f"model card: model.kwargs.{key}={value!r}: only numbers, strings, booleans, "
                                  "null and lists of those are accepted")
    return factory, dict(kwargs)


def card_weights_file(card: Any) -> str:
    """The weights' file name in the card: a bare `*.safetensors` name (no path)."""
    weights = card.get("weights") if isinstance(card, Mapping) else None
    name = weights.get("file", WEIGHTS) if isinstance(weights, Mapping) else WEIGHTS
    if not isinstance(name, str) or not _WEIGHTS_RE.fullmatch(name) or name.startswith("."):
        raise ModelNotAllowed(f"model card: weights.file={name!r} must be a file name ending in .safetensors, no path")
    return name


def resolve(factory: str, extra: Iterable[str] | str | None = None) -> Callable[..., Any]:
    """The factory a card names, imported only when the name is on the allow-list."""
    allowed = allowed_factories(extra)
    spec = allowed.get(factory)
    if spec is None:
        listed = ", ".join(sorted(allowed)) or "(none)"
        raise ModelNotAllowed(
            f"model card: model.factory={factory!r} is not an allowed model architecture; nothing was imported. "
            f"Allowed: {listed} (entry points group {ENTRY_POINT_GROUP!r}, the operators' allowed_models, "
            f"or {ALLOWED_ENV})"
        )
    module_name, _, func_name = spec.partition(":")
    func = getattr(importlib.import_module(module_name), func_name, None)
    if not callable(func):
        raise ModelNotAllowed(f"model.factory={factory!r}: allow-listed {spec!r} is not a callable")
    return func


def _type_ok(value: Any, annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return is_integer(value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence) or annotation in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value) if args else isinstance(value, list)
    return True  # an annotation we cannot judge: the value is still a checked JSON scalar/list


def check_kwargs(func: Callable[..., Any], factory: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse kwargs the factory's signature does not take, lacks, or types differently."""
    try:
        sig = inspect.signature(func, eval_str=True)
    except (TypeError, ValueError, NameError) as exc:
        raise ModelNotAllowed(f"model.factory={factory!r}: its signature cannot be read ({exc})") from None
    params = {n: p for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key, value in kwargs.items():
        if key not in params:
            raise ModelNotAllowed(f"model card: model.kwargs.{key}={value!r}: {factory} takes no argument {key!r}; "
                                  f"it accepts: {', '.join(params) or '(none)'}")
        annotation = params[key].annotation
        if not _type_ok(value, annotation):
            name = getattr(annotation, "__name__", str(annotation))
            raise ModelNotAllowed(f"model card: model.kwargs.{key}={value!r}: {factory} expects {name}")
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise ModelNotAllowed(f"model card: model.kwargs lacks {', '.join(missing)}, required by {factory}")


def factory_for_card(card: Any, extra: Iterable[str] | str | None = None) -> tuple[Callable[..., Any], dict[str, Any]]:
    """(factory, kwargs) for a card: shape checked, name allow-listed, kwargs checked."""
    factory, kwargs = card_model(card)
    func = resolve(factory, extra)
    check_kwargs(func, factory, kwargs)
    return func, kwargs
