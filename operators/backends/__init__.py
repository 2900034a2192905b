"""Gang backends, chosen by name (a facade in the style of kubeflow's trainer SDK).

    backend = get_backend("local")                      # torchrun on this machine
    backend = get_backend("kubernetes", namespace="ml")  # JobSet/Kueue or Volcano gang

Users register their own with `register_backend("slurm", "mypkg.slurm:SlurmBackend")`.
"""

from __future__ import annotations

import importlib

from operators.backends.base import GangBackend, GangResult, GangSpec

_BACKENDS: dict[str, str] = {
    "local": "operators.backends.local:LocalBackend",
    "kubernetes": "operators.backends.kubernetes:KubernetesBackend",
}

__all__ = ["GangBackend", "GangResult", "GangSpec", "available_backends", "get_backend", "register_backend"]


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, path: str) -> None:
    """Make `get_backend(name)` build the class at `module:Class`."""
    if ":" not in path:
        raise ValueError(f"backend path {path!r}: must look like module:Class")
    _BACKENDS[name] = path


def get_backend(name: str, **options) -> GangBackend:
    if name not in _BACKENDS:
        raise ValueError(f"backend={name!r}: accepted values are {', '.join(available_backends())}")
    module_name, _, class_name = _BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if cls is None:  # as `from module import Class` says it: an ImportError, a user failure (operators/retry.py)
        raise ImportError(f"backend {name!r}: cannot import name {class_name!r} from {module_name!r} ({_BACKENDS[name]})",
                          name=module_name)
    return cls(**options)
