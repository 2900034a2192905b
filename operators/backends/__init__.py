"""Gang backends, chosen by name (a facade in the style of kubeflow's trainer SDK).

    backend = get_backend("local")                      # torchrun on this machine
    backend = get_backend("kubernetes", namespace="ml")  # JobSet/Kueue or Volcano gang
    backend = get_backend("ray")                         # Ray Train's TorchTrainer on a Ray cluster

Users register their own with `register_backend("slurm", "mypkg.slurm:SlurmBackend")`.
"""

from __future__ import annotations

import importlib

from operators.backends.base import LAUNCHERS, GangBackend, GangResult, GangSpec
from operators.exceptions import UnsupportedCombination

_BACKENDS: dict[str, str] = {
    "local": "operators.backends.local:LocalBackend",
    "kubernetes": "operators.backends.kubernetes:KubernetesBackend",
    "ray": "operators.backends.ray:RayBackend",
}

__all__ = [
    "LAUNCHERS", "GangBackend", "GangResult", "GangSpec", "available_backends", "check_combination", "get_backend",
    "register_backend",
]  # fmt: skip


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, path: str) -> None:
    """Make `get_backend(name)` build the class at `module:Class`."""
    if ":" not in path:
        raise ValueError(f"backend path {path!r}: must look like module:Class")
    _BACKENDS[name] = path


def backend_class(name: str) -> type[GangBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"backend={name!r}: accepted values are {', '.join(available_backends())}")
    module_name, _, class_name = _BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if cls is None:  # as `from module import Class` says it: an ImportError, a user failure (operators/retry.py)
        raise ImportError(f"backend {name!r}: cannot import name {class_name!r} from {module_name!r} ({_BACKENDS[name]})",
                          name=module_name)
    return cls


def get_backend(name: str, **options) -> GangBackend:
    return backend_class(name)(**options)


def check_combination(backend: str, launcher: str, *, user_code: bool = False) -> None:
    """Refuse, before admission, a launcher the backend cannot run, or training code of one's own
    where it cannot run yet (`UnsupportedCombination`, naming both)."""
    if launcher not in LAUNCHERS:
        raise UnsupportedCombination(f"launcher={launcher!r}: accepted values are {', '.join(LAUNCHERS)}")
    supported = backend_class(backend).launchers
    if launcher not in supported:
        raise UnsupportedCombination(
            f"backend={backend!r} with launcher={launcher!r} cannot run: backend {backend!r} runs "
            f"launcher {', '.join(supported)} only; choose launcher={supported[0]!r} or a backend that runs {launcher!r} "
            f"({', '.join(n for n in available_backends() if launcher in backend_class(n).launchers) or 'none'})"
        )
    if user_code and (launcher != "torchrun" or not backend_class(backend).runs_user_code):
        runs = [n for n in available_backends() if backend_class(n).runs_user_code]
        raise UnsupportedCombination(
            f"training code of one's own (training.entrypoint / training.command) with backend={backend!r} and "
            f"launcher={launcher!r} cannot run: it runs under launcher 'torchrun' on backend {', '.join(runs)}"
        )
