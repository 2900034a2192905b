"""The backend interface behind `GangTrainingOperator`.

A backend turns a `GangSpec` (what to run: world size, run dir, trainer options) into a gang of
ranks that start together or not at all, and reports a `GangResult` with the evidence the
failure classifier reads. Synchronous backends implement `run`; deferrable ones implement
`submit` + `trigger` + `collect` and set `deferrable = True`.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
#: How the ranks are started: torchrun's agent (torchrun or the local backend's forking
#: trainer.launch) or Open MPI's mpirun; which backend runs which: `GangBackend.launchers`.
LAUNCHERS = ("torchrun", "mpirun")


@dataclass(frozen=True)
class GangSpec:
    """What to run. Built by the operator from its (templated) arguments."""

    name: str  # DNS-1123 label, unique per DAG run: also the Kubernetes object name
    run_dir: str  # stable across Airflow tries of the same DAG run, so a retry resumes
    world_size: int
    config_path: str = "params.yaml"
    overrides: tuple[str, ...] = ()  # trainer `--set section.key=value` items (a list is accepted)
    env: Mapping[str, str] = field(default_factory=dict)
    attempt: int = 1  # Airflow try number
    # The dataset version the ranks fetch by content address: each backend turns it into its data
    # arguments (`--set data.version=... data.remote=...`; the local DVC remote, or the Kubernetes runtime's).
    dataset_version: str | None = None
    launcher: str = "torchrun"  # one of LAUNCHERS

    def __post_init__(self):
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: accepted values are {', '.join(LAUNCHERS)}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r}: must be an integer >= 1")
        if not _NAME.match(self.name):
            raise ValueError(f"name={self.name!r}: must be a DNS-1123 label (a-z, 0-9, '-', at most 63 chars)")
        for item in self.overrides:
            if "=" not in item:
                raise ValueError(f"overrides item {item!r}: must look like section.key=value")

    def trainer_args(self) -> list[str]:
        """The trainer's argv after `-m trainer` (contract 1)."""
        args = ["--run-dir", self.run_dir, "--config", self.config_path]
        for item in self.overrides:
            args += ["--set", item]
        return args


@dataclass
class GangResult:
    """How the gang ended. `evidence` uses the classifier's keys (contract 4, docs/contracts.md)."""

    succeeded: bool
    exit_code: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    resumed_from_step: int | None = None
    detail: str = ""


LogFn = Callable[[str], None]


class GangBackend(abc.ABC):
    """Base class of gang backends; `operators.backends.get_backend(name)` picks one."""

    name: ClassVar[str]
    deferrable: ClassVar[bool] = False
    #: The `GangSpec.launcher` values this backend runs; any other is refused before admission.
    launchers: ClassVar[tuple[str, ...]] = ("torchrun",)
    # True: the gang runs beside the task, whose process relays the ranks' metrics.jsonl to MLflow
    # (`operators.hooks.mlflow_relay`) and logs the final weights; the ranks get no MLflow settings. False: the
    # spec's env carries MLFLOW_TRACKING_URI/MLFLOW_RUN_ID and rank 0 logs to MLflow itself.
    relay_tracking: bool = False

    @abc.abstractmethod
    def check_capacity(self, spec: GangSpec) -> None:
        """Raise `GangCapacityError` when the gang can never be admitted."""

    def run(self, spec: GangSpec, log: LogFn) -> GangResult:
        """Run the gang to completion (synchronous backends)."""
        raise NotImplementedError(f"backend {self.name!r} is deferrable: use submit/trigger/collect")

    def submit(self, spec: GangSpec) -> dict[str, Any]:
        """Create the gang (or re-attach to it) and return a JSON-serialisable handle."""
        raise NotImplementedError(f"backend {self.name!r} is not deferrable: use run")

    def trigger(self, handle: dict[str, Any]):
        """The trigger that watches the gang named by `handle` until it ends."""
        raise NotImplementedError

    def collect(self, handle: dict[str, Any], event: dict[str, Any]) -> GangResult:
        """Turn the trigger's final event into a `GangResult`, tearing the gang down."""
        raise NotImplementedError

    def kill(self) -> None:
        """Stop the gang now (the task was killed)."""
