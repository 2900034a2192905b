"""The backend interface behind `GangTrainingOperator`.

A backend turns a `GangSpec` (what to run: world size, run dir, trainer options) into a gang of
ranks that start together or not at all, and reports a `GangResult` with the evidence the
failure classifier reads. Synchronous backends implement `run`; deferrable ones implement
`submit` + `trigger` + `collect` and set `deferrable = True`.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainer.urls import credentials_refusal, has_credentials
from trainer.checks import is_integer

GANG_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")  # a Kubernetes node name
ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_PYTHONS = ("python", "python3")


def is_count(value: Any, minimum: int) -> bool:
    """`value` is an integer (not a bool) >= `minimum`: the check behind every count and limit in seconds."""
    return is_integer(value) and value >= minimum


def _relative(where: str, text: str) -> str:
    if not text or text.startswith("/") or ".." in text.split("/"):
        raise ValueError(f"{where}={text!r}: must be a path relative to the project, without '..'")
    return text


def user_code_args(*, entrypoint: str | None = None, kwargs: Mapping[str, Any] | None = None,
                   command: Sequence[str] | None = None, project_root: Path | None = None,
                   prefix: str = "") -> tuple[str, ...]:
    """`python -m trainer.user`'s target (GangSpec.user_code) for training code of one's own:
    `entrypoint` (module:function, called with `kwargs`) or `command` ([python, -m, MODULE, ARGS...]
    or [python, SCRIPT.py, ARGS...]); () for neither (gangflow's loop). ValueError names the field
    (`prefix` + its name) and what is accepted. A script must exist below `project_root` when given."""
    if entrypoint is None and command is None:
        if kwargs:
            raise ValueError(f"{prefix}kwargs goes with {prefix}entrypoint")
        return ()
    if entrypoint is not None and command is not None:
        raise ValueError(f"give exactly one of {prefix}entrypoint (module:function) and {prefix}command (a list: "
                         "[python, -m, module, ARGS...] or [python, script.py, ARGS...])")
    if entrypoint is not None:
        if not isinstance(entrypoint, str) or not ENTRYPOINT_RE.fullmatch(entrypoint):
            raise ValueError(f"{prefix}entrypoint={entrypoint!r}: must be module:function, e.g. mypkg.train:main")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise ValueError(f"{prefix}kwargs={kwargs!r}: must map keyword argument names to values")
        try:
            text = json.dumps(dict(kwargs), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{prefix}kwargs: values must be JSON (numbers, strings, lists, mappings): {exc}") from None
        return ("--entrypoint", entrypoint, "--kwargs", text)
    if kwargs:
        raise ValueError(f"{prefix}kwargs goes with {prefix}entrypoint; give {prefix}command its arguments in the list")
    where = f"{prefix}command"
    if isinstance(command, str) or not isinstance(command, Sequence) or not command or not all(isinstance(a, str) for a in command):
        raise ValueError(f"{where}={command!r}: must be a list of strings, e.g. [python, -m, mypkg.train, --epochs, '3']")
    args = list(command)
    if args[0] in _PYTHONS:
        args = args[1:]
    if args[:1] == ["-m"]:
        if len(args) < 2 or not _MODULE_RE.fullmatch(args[1]):
            raise ValueError(f"{where}={list(command)!r}: `-m` needs a module name, e.g. [python, -m, mypkg.train]")
        return ("--module", args[1], "--", *args[2:])
    if args and args[0].endswith(".py"):
        script = _relative(f"{where}[script]", args[0])
        if project_root is not None and not (Path(project_root) / script).is_file():
            raise ValueError(f"{where}={list(command)!r}: no script {script!r} in {project_root}")
        return ("--script", script, "--", *args[1:])
    raise ValueError(f"{where}={list(command)!r}: must be [python, -m, MODULE, ARGS...] or [python, SCRIPT.py, ARGS...] "
                     f"(the interpreter, if named, is one of {', '.join(_PYTHONS)}: the ranks' own)")
#: How the ranks are started: torchrun's agent (torchrun or the local backend's forking
#: trainer.launch) or Open MPI's mpirun; which backend runs which: `GangBackend.launchers`.
LAUNCHERS = ("torchrun", "mpirun")


# mpirun's own options for a gang: `--tag-output` prefixes each rank's lines (the evidence is cut
# from them); `--oversubscribe`: Open MPI allows one rank per core, the pool (or the MPIJob's
# slotsPerWorker) admits the gang; `--bind-to none`: the ranks' threads are not pinned.
MPIRUN_OPTIONS = ("--oversubscribe", "--bind-to", "none", "--tag-output")


def mpirun_argv(mpirun: str, world_size: int, exported, rank_argv) -> list[str]:
    """`mpirun -np N OPTIONS -x NAME ... RANK ARGV`: the one option list of an mpirun gang, for the
    local backend and the Kubernetes MPIJob's launcher (operators.kubernetes.builders). Variables go by name
    (`-x NAME`: the value stays in mpirun's environment, never in argv)."""
    return [mpirun, "-np", str(world_size), *MPIRUN_OPTIONS,
            *(item for name in exported for item in ("-x", name)), *rank_argv]  # fmt: skip


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
    # Training code of one's own instead of gangflow's loop: `python -m trainer.user`'s target
    # (`--entrypoint m:f --kwargs JSON`, `--module m -- ARGS`, `--script p -- ARGS`); empty: `-m trainer`.
    user_code: tuple[str, ...] = ()
    # Folders (relative to the project / the image's /app) put on the ranks' PYTHONPATH for it.
    package_roots: tuple[str, ...] = ()
    launcher: str = "torchrun"  # one of LAUNCHERS
    # Nodes an earlier try's verdict named suspect (contract 4's `exclude_nodes`): a backend that
    # places pods keeps this try off them (Kubernetes: node affinity); the others have one node.
    avoid_nodes: tuple[str, ...] = ()
    # The longest the ranks may run (training.max_run_time_seconds), None: no limit. Past it they are
    # stopped with SIGTERM (a final checkpoint) and the try fails as the user's, naming the limit.
    max_run_time_s: int | None = None
    # The longest the gang may wait for admission where it queues (training.max_queue_wait_seconds;
    # Kubernetes: instead of the runtime's admissionTimeoutSeconds), None: the backend's own bound.
    max_queue_wait_s: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "overrides", tuple(self.overrides))
        object.__setattr__(self, "avoid_nodes", tuple(self.avoid_nodes))
        for node in self.avoid_nodes:
            if not isinstance(node, str) or not _NODE.fullmatch(node):
                raise ValueError(f"avoid_nodes item {node!r}: must be a node name (letters, digits, '.', '_', '-')")
        object.__setattr__(self, "user_code", tuple(self.user_code))
        object.__setattr__(self, "package_roots", tuple(self.package_roots))
        for root in self.package_roots:
            if not root or root.startswith("/") or ".." in root.split("/"):
                raise ValueError(f"package_roots item {root!r}: must be a path relative to the project, without '..'")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: accepted values are {', '.join(LAUNCHERS)}")
        for name in ("max_run_time_s", "max_queue_wait_s"):
            limit = getattr(self, name)
            if limit is not None and not is_count(limit, 1):
                raise ValueError(f"{name}={limit!r}: must be an integer >= 1 (seconds) or None")
        if not is_count(self.world_size, 1):
            raise ValueError(f"world_size={self.world_size!r}: must be an integer >= 1")
        if not GANG_NAME.fullmatch(self.name):
            raise ValueError(f"name={self.name!r}: must be a DNS-1123 label (a-z, 0-9, '-', at most 63 chars)")
        for item in self.overrides:
            if "=" not in item:
                raise ValueError(f"overrides item {item!r}: must look like section.key=value")
            key, _, value = item.partition("=")
            if has_credentials(value):  # argv is seen by every process lister and printed in the task log
                raise ValueError(credentials_refusal(f"overrides {key}", value))
        if has_credentials(self.run_dir):
            raise ValueError(credentials_refusal("run_dir", self.run_dir))

    @property
    def entry_module(self) -> str:
        """The module each rank runs: `trainer` (gangflow's loop) or `trainer.user` (the user's code)."""
        return "trainer.user" if self.user_code else "trainer"

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
    start_step_known: bool = True  # False: the backend did not read the ranks' start (pods' logs stay in the cluster)
    detail: str = ""
    pauses: int = 0  # times the gang was paused and resumed while it ran (local gangs: `local_control`)
    oom_kills: int | None = None  # the kernel's OOM kills while a failed gang ran (local backend); None: not counted


LogFn = Callable[[str], None]


class GangBackend(abc.ABC):
    """Base class of gang backends; `operators.backends.get_backend(name)` picks one."""

    name: ClassVar[str]
    deferrable: ClassVar[bool] = False
    #: The `GangSpec.launcher` values this backend runs; any other is refused before admission.
    launchers: ClassVar[tuple[str, ...]] = ("torchrun",)
    #: Whether the backend runs training code of one's own (GangSpec.user_code) as well as gangflow's loop.
    runs_user_code: ClassVar[bool] = True
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

    def resubmit(self, spec: GangSpec) -> dict[str, Any]:
        """Create the gang again after a preemption (`collect` tore the preempted one down); a handle."""
        return self.submit(spec)

    def trigger(self, handle: dict[str, Any]):
        """The trigger that watches the gang named by `handle` until it ends."""
        raise NotImplementedError

    def collect(self, handle: dict[str, Any], event: dict[str, Any]) -> GangResult:
        """Turn the trigger's final event into a `GangResult`, tearing the gang down."""
        raise NotImplementedError

    def kill(self) -> None:
        """Stop the gang now (the task was killed)."""


def driver_argv(python: str, spec: GangSpec, *, run_dir: str, cpus_per_worker: int, exports, address: str | None,
                trainer_args) -> list[str]:
    """The Ray driver's argv (`python -m operators.backends.ray ... -- TRAINER ARGS`): the local Ray
    backend's, and a KubeRay RayJob's entrypoint (operators.kubernetes.builders.build_rayjob, `--address auto`)."""
    args = [python, "-m", "operators.backends.ray", "--world-size", str(spec.world_size),
            "--run-dir", run_dir, "--name", f"{spec.name}-try-{spec.attempt}",
            "--cpus-per-worker", str(cpus_per_worker)]  # fmt: skip
    for name in exports:
        args += ["--export", name]
    if address:
        args += ["--address", address]
    return [*args, "--", *trainer_args]
