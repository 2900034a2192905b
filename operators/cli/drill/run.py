"""`make cluster-drill`: `train_pipeline` with `backend=kubernetes`, the gang's pods run locally.

    python -m operators.cli.drill [--pipeline NAME] [--api jobset|trainjob|mpijob|rayjob] [--runtime process|podman] [--conf JSON] [--keep DIR]
    GANGFLOW_FAULT="kill@step=30,rank=1" python -m operators.cli.drill
    GANGFLOW_DRILL_EVENT="preempt@step=30" python -m operators.cli.drill

Starts an S3 API (moto), an MLflow server, the Kubernetes API test double and the emulated cluster
on 127.0.0.1, and runs the DAG with dag.test(). With --api trainjob the cluster also runs Kubeflow
Trainer v2's controller (trainer_controller.py) on the chart's ClusterTrainingRuntime; with --api
mpijob the MPI Operator's (mpi_controller.py; the DAG's `launcher` is then mpirun); with --api rayjob
KubeRay's (ray_controller.py: a real Ray cluster, `ray job submit`; checkpoints on a PVC); with --runtime
podman each pod is a container of the training image `make images` built. The last line is `make
demo`'s JSON plus `backend`, `api`, `checkpoint_uri`, `resumed_from_step`, `runtime` and
`image_digest`; exit 0 only when the run succeeded and no pod touched
the worker's state dir (docs/kubernetes.md, "The cluster drill").
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from operators.config import settings

NAMESPACE = "gangflow-drill"
BUCKET = "gangflow-drill"
CONN_ID = "kubernetes_default"
S3_SECRET = "gangflow-s3"
MLFLOW_SECRET = "gangflow-mlflow"
# api=rayjob keeps Ray Train's storage under the run dir as a file path: a ReadWriteMany claim (the
# kubelet gives every pod that mounts it the same folder), not checkpoint.uri
CHECKPOINT_CLAIM = "gangflow-checkpoints"
# How a pod's container runs: as local processes in an emulation of the image, or as a podman
# container of the image `make images` built (operators/cli/drill/podman.py).
RUNTIMES = ("process", "podman")
# Settings of this machine the worker container has its own of (operators/cli/drill/worker.py)
WORKER_OWN = frozenset({"GANGFLOW_HOME", "GANGFLOW_PROJECT", "GANGFLOW_GIT_COMMIT", "GANGFLOW_GIT_DIRTY", "GANGFLOW_REGISTRY_KEY_FILE"})
DEFAULT_CONF = {"backend": "kubernetes", "world_size": 2, "max_steps": 120, "checkpoint_every_steps": 10}
# Per pipeline, over DEFAULT_CONF: 120 digits steps reach about 0.9 accuracy, under the file's
# floor; other pipelines keep their gate.
PIPELINE_CONF = {"digits": {"promotion_floor": 0.8}}


class DrillError(RuntimeError):
    """The drill could not set up what it needs, or a pod broke isolation."""


def echo(message: str) -> None:
    print(message, flush=True)


def image_reference(project: Path) -> str:
    """A digest reference for the image the drill emulates: the sha256 of what it is built from
    here (the Dockerfile and the files it copies), so lineage tags change when the image would."""
    digest = hashlib.sha256()
    for name in ("docker/training.Dockerfile", "params.yaml", "constraints.txt"):
        digest.update((project / name).read_bytes())
    return f"gangflow-drill.local/gangflow/training@sha256:{digest.hexdigest()}"


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


def drill_runtime(*, image: str, mlflow_url: str, s3_url: str, rendezvous_port: int, dataset_remote: str, api: str = "jobset") -> dict[str, Any]:
    """The runtime.yaml a cluster admin would install (helm/gangflow values), for this drill."""
    runtime: dict[str, Any] = {
        "image": image,
        "namespace": NAMESPACE,
        "serviceAccountName": "gangflow-training",
        "scheduler": "kueue",
        "api": api,
        "queue": "gangflow",
        "resources": {"cpu": "1", "memory": "2Gi", "gpu": 0},
        "shmSize": "256Mi",
        "checkpoint": {"pvc": CHECKPOINT_CLAIM, "mountPath": "/checkpoints"} if api == "rayjob" else {"uri": f"s3://{BUCKET}/checkpoints"},
        "mlflowTrackingUri": mlflow_url,
        "mlflowSecretRef": {"name": MLFLOW_SECRET, "key": "token"},
        "rendezvousPort": rendezvous_port,
        "admissionTimeoutSeconds": 300,
        "startupTimeoutSeconds": 300,
        "terminationGracePeriodSeconds": 30,  # the least the runtime accepts
    }
    # the data plane: pods fetch the pinned dataset from the DVC remote by content address and
    # write checkpoints to checkpoint.uri with the S3 credentials of a Secret (envFrom)
    runtime["dataset"] = {"remote": dataset_remote, "credentialsSecret": S3_SECRET, "endpointUrl": s3_url}
    return runtime


def trainer_chart_values(runtime: dict[str, Any]) -> dict[str, Any]:
    """The chart values behind the drill's runtime.yaml, for the ClusterTrainingRuntime it renders."""
    repository, digest = runtime["image"].split("@", 1)
    return {"training": {
        "image": {"repository": repository, "digest": digest}, "serviceAccount": {"name": runtime["serviceAccountName"]},
        "resources": runtime["resources"], "rendezvousPort": runtime["rendezvousPort"], "priorityClassName": "",
    }}  # fmt: skip


def _require_data_plane() -> None:
    """Fail loudly, naming what is missing, rather than run the gang on worker paths."""
    import dataclasses

    from operators.kubernetes.runtime import RuntimeDefaults

    if "dataset" not in {f.name for f in dataclasses.fields(RuntimeDefaults)}:
        raise DrillError(
            "the Kubernetes runtime (operators/kubernetes/runtime.py RuntimeDefaults) has no `dataset` setting "
            "(remote, credentialsSecret, endpointUrl): pods could not fetch the pinned dataset by content address "
            "nor reach S3 with credentials from a Secret (issue 9 items 1, 2, 5). The drill refuses to run a gang on worker paths."
        )


def cluster_objects(runtime: dict[str, Any], *, s3_key: str, s3_secret: str, mlflow_token: str, world_size: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(group, plural, object) the Helm chart and the cluster admin would have created."""
    import yaml

    meta = lambda name: {"name": name, "namespace": NAMESPACE}  # noqa: E731
    claims = [("", "persistentvolumeclaims", {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta(runtime["checkpoint"]["pvc"]),
               "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})] if runtime["checkpoint"].get("pvc") else []  # fmt: skip
    return claims + [
        ("", "configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("gangflow-runtime"), "data": {"runtime.yaml": yaml.safe_dump(runtime)}}),
        ("", "secrets", {"apiVersion": "v1", "kind": "Secret", "metadata": meta(S3_SECRET), "type": "Opaque",
                         "data": {"AWS_ACCESS_KEY_ID": _b64(s3_key), "AWS_SECRET_ACCESS_KEY": _b64(s3_secret)}}),
        ("", "secrets", {"apiVersion": "v1", "kind": "Secret", "metadata": meta(MLFLOW_SECRET), "type": "Opaque", "data": {"token": _b64(mlflow_token)}}),
        ("kueue.x-k8s.io", "localqueues", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": meta("gangflow"), "spec": {"clusterQueue": "gangflow-drill"}}),
        ("kueue.x-k8s.io", "clusterqueues", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "gangflow-drill"},
         "spec": {"resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": "drill-node", "resources": [
             {"name": "cpu", "nominalQuota": str(max(world_size, 2))}, {"name": "memory", "nominalQuota": f"{2 * max(world_size, 2)}Gi"}]}]}]}}),
    ]  # fmt: skip


def under(path: str, root: Path) -> bool:
    root_s = str(root).rstrip("/")
    return path == root_s or path.startswith(root_s + "/")


_DAG_TEST_BUG = '{"event": serialize(event.payload)} if event else msg.next_kwargs'


def backport_dag_test_defer_kwargs() -> bool:
    """Make `dag.test()` resume a deferred task with its `defer(kwargs=...)` plus the event, as
    Airflow's triggerer does (models/trigger.py: `next_kwargs["event"] = event.payload`).

    Airflow 3.3.2's dag.test replaces them by the event alone (fixed upstream by apache/airflow
    PR #69942), so `GangTrainingOperator.execute_complete(handle=..., spec=...)` could not resume
    there. Applied only while the installed `_run_task` still has the bug; returns whether it was.
    The wrapper folds the event into the DeferTask's kwargs and answers "no event", which makes
    dag.test store exactly `{**kwargs, "event": payload}`.
    """
    import inspect

    from airflow.sdk.definitions import dag as dag_module
    from airflow.sdk.serde import serialize

    if _DAG_TEST_BUG not in inspect.getsource(dag_module._run_task) or getattr(dag_module._run_inline_trigger, "gangflow_backport", False):
        return False
    original = dag_module._run_inline_trigger

    def run_inline_trigger(trigger, task_sdk_ti):
        event = original(trigger, task_sdk_ti)
        msg = sys._getframe(1).f_locals.get("msg")  # the DeferTask of dag.test's _run_task
        if event is None or msg is None:
            return event
        msg.next_kwargs = {**(msg.next_kwargs or {}), "event": serialize(event.payload)}
        return None

    run_inline_trigger.gangflow_backport = True
    dag_module._run_inline_trigger = run_inline_trigger
    return True


def isolation_findings(runs, state: Path) -> list[str]:
    """Every way a pod reached the worker's state dir: a path its processes opened (audit hook),
    or one named in what it was started with."""
    from operators.cli.drill.audit_hook import read

    names_state = re.compile(re.escape(str(state).rstrip("/")) + r"(?![^/\s:;,'\"])")  # the dir itself or below it
    findings = []
    for run in runs:
        for path in read(run.audit_path):
            if under(path, state):
                findings.append(f"pod {run.name} opened {path}")
        for item in [*run.argv, *run.env.values()]:
            if names_state.search(item):
                findings.append(f"pod {run.name} was started with {item!r}")
    return findings


def mpi_placement_findings(runs) -> list[str]:
    """An MPIJob's launcher that succeeded must have reached its workers (the drill's ssh logs each
    session in the worker pod's folder): else mpirun ran every rank on the launcher pod (Open MPI
    ignores a hostfile it is not given under a name it reads)."""
    findings = []
    for run in runs:
        if "-launcher-" not in run.name or run.exit_code != 0:
            continue
        job = run.name.rsplit("-launcher-", 1)[0]
        workers = [w for w in runs if re.fullmatch(re.escape(job) + r"-worker-\d+", w.name)]
        reached = [w.name for w in workers if (w.dir / "ssh.log").exists()]
        if not reached:
            findings.append(f"launcher {run.name} started no rank on a worker pod of {job} (no ssh session): mpirun ran them on the launcher")
    return findings


def rendered_words(argv: list[str]) -> list[str]:
    """A container's argv, shell text (KubeRay's `bash -c` scripts) split into its words."""
    import shlex

    words = []
    for item in argv:
        try:
            words += shlex.split(item) if any(c.isspace() for c in item) else [item]
        except ValueError:  # not shell text after all
            words.append(item)
    return words


def worker_env(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """What the worker container gets of this process's environment: the drill's servers, their
    credentials and the cluster connection, and the operators' own settings (GANGFLOW_*), but not
    this machine's paths nor the commit, which the image carries."""
    from operators.hooks import dvc as dataset

    names = ["MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
             dataset.REMOTE_ENV, f"AIRFLOW_CONN_{CONN_ID.upper()}"]  # fmt: skip
    names += [k for k in environ if k.startswith("GANGFLOW_") and k not in WORKER_OWN]
    return {k: environ[k] for k in names if k in environ}


RAY_TEMP_PREFIX = "gf-ray-"


def ray_temp_base() -> Path:
    """Where the Ray pods' short /tmp names go: not under /tmp, which the kubelet maps per pod."""
    return Path("/var/tmp" if os.access("/var/tmp", os.W_OK) else "/dev/shm")


def sweep_ray_temp(base: Path, *, empty_after_s: float = 3600.0) -> list[Path]:
    """Remove the short /tmp names a killed drill left in `base` (see `Drill._short_tmp`): this
    user's folders whose links all dangle (their pods' folders are gone), or empty ones older than
    `empty_after_s`. A live drill's links resolve, so its folder stays; links are never followed."""
    removed = []
    for folder in base.glob(f"{RAY_TEMP_PREFIX}*"):
        try:
            info = folder.lstat()
            entries = list(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else None
        except OSError:
            continue
        if entries is None or info.st_uid != os.getuid():
            continue
        stale = all(e.is_symlink() and not e.exists() for e in entries) if entries else time.time() - info.st_mtime > empty_after_s
        if stale:
            for entry in entries:
                entry.unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:  # something new appeared in it: not ours to remove
                continue
            removed.append(folder)
    return removed


class Drill:
    """Owns every server, thread and process of one drill; `close()` ends them all."""

    def __init__(self, *, keep: Path | None = None, fault: str = "", conf: dict[str, Any] | None = None, pipeline: str = "digits",
                 api: str = "jobset", event=None, runtime: str = "process", multikueue: int = 0):  # fmt: skip
        from operators.config.pipelines import pipeline as load_pipeline

        self.event = event  # a DrillEvent the emulated cluster fires at the running gang, or None
        # MultiKueue: the API double the worker talks to is the manager; this many worker clusters behind it
        if multikueue and (multikueue < 2 or runtime != "process" or api != "jobset"):
            raise DrillError(f"--multikueue {multikueue}: needs 2 or more worker clusters, --runtime process and --api jobset")
        if event is not None and (event.action == "lose-worker") != bool(multikueue):
            raise DrillError(f"GANGFLOW_DRILL_EVENT={event.spec}: " + ("lose-worker needs --multikueue N (N >= 2)" if not multikueue
                             else "with --multikueue the drill's event is lose-worker@step=N"))
        self.multikueue = multikueue
        if runtime not in RUNTIMES:
            raise DrillError(f"runtime {runtime!r}: must be one of {', '.join(RUNTIMES)}")
        self.container_runtime = self.worker = None
        if runtime == "podman":  # before any server starts: a missing podman or image is said at once
            from operators.cli.drill.podman import PodmanError, PodmanRuntime, PodmanWorker

            try:
                self.container_runtime, self.worker = PodmanRuntime(), PodmanWorker()
            except PodmanError as exc:
                raise DrillError(str(exc)) from None

        self.id = f"drill-{uuid.uuid4().hex[:10]}"
        self.keep = keep
        self.fault = fault
        self.launch_api = api  # jobset | trainjob | mpijob (runtime.yaml `api`); self.api is the API test double
        self.pipeline = load_pipeline(pipeline)
        self.conf = {**DEFAULT_CONF, **PIPELINE_CONF.get(self.pipeline.name, {}), **(conf or {})}
        if api == "mpijob":  # an MPIJob's launcher runs mpirun and only it (builders.check_launcher)
            if self.conf.setdefault("launcher", "mpirun") != "mpirun":
                raise DrillError(f"--api mpijob runs launcher 'mpirun' only; --conf has launcher={self.conf['launcher']!r}")
            if runtime != "process":
                raise DrillError("--api mpijob: with --runtime process only (the drill's ssh runs the ranks as processes of the worker pods)")
            if event is not None:
                raise DrillError(f"GANGFLOW_DRILL_EVENT={event.spec}: the drill's events act on JobSets, not on an MPIJob (--api mpijob)")
        if api == "rayjob" and (runtime != "process" or event is not None):  # the Ray nodes are processes of their pods
            raise DrillError("--api rayjob: with --runtime process and no GANGFLOW_DRILL_EVENT only (the events act on JobSets)")
        self.state = settings.state_dir()
        base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="gangflow-drill-"))
        if keep and base.exists() and any(base.iterdir()):
            raise DrillError(f"--keep {base}: the folder must be empty or not exist yet")
        if under(str(base.resolve()), self.state) or under(str(self.state), base.resolve()):
            raise DrillError(f"drill dir {base} and the state dir {self.state} must not contain each other: pods must not reach the worker's files")
        base.mkdir(parents=True, exist_ok=True)
        self.dir = base.resolve()
        self.runtime_name = runtime
        self.servers: list = []
        self._ray_temp: Path | None = None  # short names of the pods' /tmp (api=rayjob): see _short_tmp
        self.api = None
        self.cluster = None
        self.runtime: dict[str, Any] = {}
        self._s3 = None  # the S3 client of `_committed_step`

    # --- set-up ------------------------------------------------------------------------------------

    def start(self) -> None:
        from operators.cli.drill.servers import MlflowServer, MotoS3Server
        from operators.utils.ports import free_port

        _require_data_plane()
        if not (settings.airflow_home() / "airflow.db").exists():
            raise DrillError(f"the state dir {self.state} is not set up (no Airflow database): run `make setup` (or `make cluster-drill`, which does)")
        moto = MotoS3Server(self.dir / "s3")
        mlflow = MlflowServer(self.dir / "mlflow")
        self.servers = [moto, mlflow]
        for server in self.servers:
            server.launch()
        moto.wait_ready()
        echo(f"drill: S3 API (moto) on {moto.url}; starting MLflow on {mlflow.url}")
        s3_key, s3_secret = "drill" + secrets.token_hex(6), secrets.token_hex(20)
        self._s3_env(moto.url, s3_key, s3_secret)
        self._bucket()
        remote = f"s3://{BUCKET}/dvc"
        version = self._push_dataset(remote)
        mlflow.wait_ready()
        echo(f"drill: MLflow server on {mlflow.url} (artifacts proxied from {mlflow.artifacts})")
        os.environ["MLFLOW_TRACKING_URI"] = mlflow.url
        self.runtime = drill_runtime(
            image=self.container_runtime.reference if self.container_runtime else image_reference(settings.PROJECT_ROOT),
            mlflow_url=mlflow.url, s3_url=moto.url, rendezvous_port=free_port(), dataset_remote=remote, api=self.launch_api,
        )  # fmt: skip
        self._api(s3_key, s3_secret)
        self._cluster()
        self.conf.setdefault("dataset_version", version)

    def _s3_env(self, url: str, key: str, secret: str) -> None:
        """The Airflow worker's S3 settings (its DVC remote); pods get theirs from the Secret."""
        os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_DEFAULT_REGION="us-east-1")
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            os.environ.pop(name, None)

    def _bucket(self) -> None:
        import boto3

        # s3fs's mkdir sends a location constraint moto refuses: create it with boto3 in us-east-1
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=BUCKET)

    def _push_dataset(self, remote: str) -> str:
        """`dvc push` of the pinned dataset from the worker's DVC cache (filled by `make setup`) to
        the S3 remote, which is the worker's DVC remote from now on. DVC's repository lock is
        shared with anything else running DVC in this checkout: wait for it a little."""
        from dvc.lock import LockError

        from operators.hooks import dvc as dataset

        os.environ[dataset.REMOTE_ENV] = remote
        out = self.pipeline.dataset_out
        version = dataset.pinned_version(out=out)
        started = time.monotonic()
        for attempt in range(10):
            try:
                with dataset.open_repo() as repo:
                    pushed = repo.push(targets=[out], remote=dataset.remote_spec()[0])
                break
            except LockError as exc:
                if attempt == 9:
                    raise DrillError(f"dvc push to {remote}: the DVC repository stayed locked: {exc}") from None
                time.sleep(3)
        echo(f"drill: dvc push of dataset {version} to {remote}: {pushed} object(s) ({time.monotonic() - started:.1f}s)")
        return version

    def _api(self, s3_key: str, s3_secret: str) -> None:
        from operators.cli.drill.api_double import InMemoryKubernetesApi
        from operators.kubernetes.validation import CrdRegistry, validate_object

        registry = CrdRegistry(settings.PROJECT_ROOT / "operators" / "kubernetes" / "crds")
        self.api = InMemoryKubernetesApi(validator=lambda obj: validate_object(obj, registry)).start()
        self._cluster_objects = cluster_objects(
            self.runtime, s3_key=s3_key, s3_secret=s3_secret, mlflow_token=secrets.token_hex(16), world_size=int(self.conf["world_size"])
        )
        for group, plural, obj in self._cluster_objects:
            self.api.put(group, plural, obj)
        if self.launch_api == "trainjob":  # the chart's ClusterTrainingRuntime, rendered with the drill's values
            from operators.cli.drill.trainer_controller import RUNTIMES, chart_training_runtime

            self.api.put(*RUNTIMES, chart_training_runtime(trainer_chart_values(self.runtime)))
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config": self.api.kubeconfig(NAMESPACE), "namespace": NAMESPACE}}
        )
        echo(f"drill: Kubernetes API test double on {self.api.url} (namespace {NAMESPACE})")

    def _cluster(self) -> None:
        from operators.cli.drill import audit_hook
        from operators.cli.drill.cluster import EmulatedCluster
        from operators.cli.drill.image import build_image

        audit_dir = self.dir / "audit"
        audit_dir.mkdir()
        shutil.copyfile(audit_hook.__file__, audit_dir / "sitecustomize.py")
        image = build_image(self.dir / "image")
        extra = {"GANGFLOW_FAULT": self.fault, "GANGFLOW_ALLOW_FAULTS": "1"} if self.fault else {}
        controllers = []
        if self.launch_api == "trainjob":
            from operators.cli.drill.trainer_controller import TrainerController
            from operators.kubernetes.validation import CrdRegistry, validate_object

            registry = CrdRegistry(settings.PROJECT_ROOT / "operators" / "kubernetes" / "crds")
            controllers.append(TrainerController(self.api, validator=lambda obj: validate_object(obj, registry), master_port=self.runtime["rendezvousPort"]))
        if self.launch_api == "mpijob":
            from operators.cli.drill import mpi_ssh
            from operators.cli.drill.mpi_controller import MPIController, drill_launcher_env

            agent = mpi_ssh.install(self.dir / "mpi", image)  # the workers' sshd stand-in and the launcher's ssh
            controllers.append(MPIController(self.api, launcher_env=drill_launcher_env(agent)))
        if self.launch_api == "rayjob":
            from operators.cli.drill.ray_controller import DRILL_PROBE_TIMING, RayController, drill_node_params
            from operators.utils.ports import free_port

            controllers.append(RayController(self.api, node_params=drill_node_params(free_port), probe_timing=DRILL_PROBE_TIMING))
        if self.multikueue:
            self.cluster = self._multikueue(image, audit_dir, extra)
            return
        self.cluster = EmulatedCluster(
            self.api, workdir=self.dir / "pods", image=image, audit_dir=audit_dir, drill_id=self.id, extra_env=extra, echo=echo,
            controllers=controllers, event=self.event, committed_step=self._committed_step,
            runtime=self.container_runtime, tmp_alias=self._short_tmp if self.launch_api == "rayjob" else None,
            # a Ray node is a dozen processes (GCS, raylet, dashboard and agents): pinned to one CPU each
            # on two cores, joining raylets missed Ray's fixed 30 s registration wait
            pin=self.launch_api != "rayjob",
        ).start()  # fmt: skip

    def _short_tmp(self, folder: Path) -> Path:
        """A pod's /tmp folder under a short name (a symlink; api=rayjob): Ray's Unix sockets (raylet,
        object store, the dashboard's forkserver) live under TMPDIR, and a socket path may not
        exceed 107 bytes. Not under /tmp, which the kubelet maps to the pod's own /tmp."""
        if self._ray_temp is None:
            base = ray_temp_base()
            for folder in sweep_ray_temp(base):
                echo(f"drill: removed {folder}, left by a drill that was killed")
            self._ray_temp = Path(tempfile.mkdtemp(prefix=RAY_TEMP_PREFIX, dir=base))
        link = self._ray_temp / str(len(list(self._ray_temp.iterdir())))
        link.symlink_to(folder, target_is_directory=True)
        return link

    def _multikueue(self, image, audit_dir: Path, extra: dict[str, str]):
        """Worker clusters worker-1..N, each an API test double with the namespace's objects (the
        Secrets are created there as on the manager: docs/kubernetes.md, MultiKueue) and a cluster
        of its own, behind the MultiKueue dispatcher on the manager."""
        from operators.cli.drill.api_double import InMemoryKubernetesApi
        from operators.cli.drill.cluster import EmulatedCluster
        from operators.cli.drill.multikueue import MultiKueueDispatcher, WorkerCluster

        workers = []
        for index in range(1, self.multikueue + 1):
            name = f"worker-{index}"
            api = InMemoryKubernetesApi(validator=self.api.validator).start()
            for group, plural, obj in self._cluster_objects:
                api.put(group, plural, obj)
            cluster = EmulatedCluster(api, workdir=self.dir / "pods" / name, image=image, audit_dir=audit_dir,
                                      drill_id=f"{self.id}/{name}", extra_env=extra, echo=lambda m, name=name: echo(f"[{name}] {m}"))  # fmt: skip
            workers.append(WorkerCluster(name, api, cluster))
        echo(f"drill: MultiKueue: this API test double is the manager; worker clusters {', '.join(w.name for w in workers)} "
             f"(each an API test double on {', '.join(w.api.url for w in workers)})")  # fmt: skip
        return MultiKueueDispatcher(self.api, workers, event=self.event, committed_step=self._committed_step, echo=echo).start()

    def _committed_step(self) -> int | None:
        """The newest checkpoint step committed (its manifest written) in the drill's bucket, or None."""
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        steps = []
        try:
            if self._s3 is None:  # one client: each new one logs where it found its endpoint
                self._s3 = boto3.client("s3", region_name="us-east-1")
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="checkpoints/")
            for page in pages:
                for item in page.get("Contents") or ():
                    if m := re.search(r"/checkpoints/step-(\d+)/manifest\.json$", item["Key"]):
                        steps.append(int(m.group(1)))
        except (BotoCoreError, ClientError):
            return None
        return max(steps, default=None)

    # --- the run -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from operators.cli import demo
        from operators.backends.local import _RESUMED  # the trainer's resume line, read as the local backend reads it

        if self.worker is not None:
            summary = self._run_in_airflow_image()
        else:
            if backport_dag_test_defer_kwargs():
                echo("drill: dag.test() keeps defer kwargs on resume (apache/airflow#69942 backported for this run)")
            summary = demo.summarize(demo.run_dag(self.conf, self.pipeline.dag_id), self.pipeline.dag_id)
        runs = list(self.cluster.history)
        resumed = [int(m.group(1)) for run in runs for m in _RESUMED.finditer("".join(run.log_lines))]
        summary |= {
            "backend": "kubernetes",
            "api": self.api_that_ran(),
            # where the pods really wrote: the --run-dir of the containers the backend rendered
            "checkpoint_uri": next((words[i + 1] for run in runs for words in [rendered_words(run.rendered_argv)]
                                    for i, a in enumerate(words[:-1]) if a == "--run-dir"), None),  # fmt: skip
            "resumed_from_step": resumed[-1] if resumed else None,
            "runtime": self.runtime_name,
            # the image that really ran (podman's digest of it); no image runs in the process runtime
            "image_digest": self.container_runtime.image_digest if self.container_runtime else None,
            # the Airflow image the DAG's tasks ran in (podman runtime); None: in this process
            "worker_image_digest": self.worker.image_digest if self.worker else None,
        }
        if self.multikueue:  # what the drill's MultiKueue did, beside what the DAG read back (dispatched_to)
            summary["multikueue"] = self.cluster.summary()
        findings = isolation_findings(runs, self.state)
        if self.worker is not None:  # the worker container's state dir is the worker's too
            findings += isolation_findings(runs, self.dir / "airflow-worker")
        if self.cluster.error is not None:
            findings.append(f"cluster emulation error: {self.cluster.error}")
        if self.launch_api == "mpijob":
            findings += mpi_placement_findings(runs)
        if findings:
            summary["state"] = "failed"
            summary["failure"] = {"kind": "drill", "reason": "; ".join(findings[:5]) + (f" (+{len(findings) - 5} more)" if len(findings) > 5 else "")}
        self._report(summary, runs)
        return summary

    def _run_in_airflow_image(self) -> dict[str, Any]:
        """dag.test() in a container of the Airflow image, with the drill's servers and Secrets as this
        process has them (env by name); its summary, or a failed one naming why there is none."""
        from operators.cli.drill.podman import WORKER_STATE

        state = self.dir / "airflow-worker"
        state.mkdir()
        state.chmod(0o777)  # the image's user (uid 50000) writes there, as in an emptyDir
        env = worker_env(os.environ)
        argv = self.worker.argv(name=f"{self.id}-airflow-worker", state=state, env_names=sorted(env), dag_id=self.pipeline.dag_id, conf=self.conf)
        echo(f"drill: the DAG runs in the Airflow image {self.worker.reference} (state dir {state} as {WORKER_STATE})")
        code, last = self.worker.run(argv, env, echo)
        try:
            summary = json.loads(last[-1])
        except (IndexError, ValueError):
            summary = None
        if code != 0 or not isinstance(summary, dict):
            reason = f"the Airflow worker container exited {code} without a summary: " + " | ".join(last[-5:])
            return {"state": "failed", "train_attempts": 0, "promoted": False, "failure": {"kind": "drill", "reason": reason}}
        return summary

    def api_that_ran(self) -> str:
        """The launch API of the gang objects the backend created (the requested one when none was)."""
        created = [api for api, plural in (("trainjob", "/trainjobs"), ("jobset", "/jobsets"), ("mpijob", "/mpijobs"), ("rayjob", "/rayjobs"))
                   if self.api.count("POST", plural)]  # fmt: skip
        return created[0] if len(created) == 1 else self.launch_api

    def _report(self, summary: dict[str, Any], runs) -> None:
        # what the DAG run left in the cluster it talked to: a gang, a Workload (quota held) or a pod
        left = {plural: [o["metadata"]["name"] for o in self.api.items(group, plural)]
                for group, plural in (("jobset.x-k8s.io", "jobsets"), ("trainer.kubeflow.org", "trainjobs"), ("kubeflow.org", "mpijobs"),
                                      ("ray.io", "rayjobs"), ("kueue.x-k8s.io", "workloads"), ("", "pods"))}  # fmt: skip
        report = {"summary": summary, "state_dir": str(self.state), "drill_dir": str(self.dir), "runtime": self.runtime,
                  "pods": [run.record() | {"audit_path": str(run.audit_path)} for run in runs], "events": self.cluster.events,
                  "left_in_cluster": left}  # fmt: skip
        (self.dir / "report.json").write_text(json.dumps(report, indent=1, default=str))

    # --- tear-down ---------------------------------------------------------------------------------

    def close(self, *, remove: bool, interrupted: bool = False) -> None:
        from operators.cli.drill.cluster import kill_marked
        from operators.cli.drill.image import make_writable

        if self.cluster is not None:
            self.cluster.stop(keep_pod_grace=not interrupted)  # interrupted: everything goes now
        kill_marked(self.id + "/")
        if self.container_runtime is not None:
            self.container_runtime.remove(self.id)
        if self.api is not None:
            self.api.stop()
        for server in reversed(self.servers):
            server.stop()
        if self._ray_temp is not None:  # symlinks only: their targets are the pods' folders
            shutil.rmtree(self._ray_temp, ignore_errors=True)
        if (remove or not any(self.dir.iterdir())) and not self.keep:
            make_writable(self.dir)
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            echo(f"drill: kept {self.dir} (report.json, pods/*/container.log, mlflow/, s3/moto.log)")


_INTERRUPTED = {"failure": {"kind": "interrupted", "reason": "the drill was stopped by a signal; everything it started was stopped"}}
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _stop_on_signal(drill: Drill) -> None:
    """SIGTERM/SIGHUP/SIGINT: stop every server and pod now, say so, exit.

    The drill keeps these signals for the whole run: Airflow's in-process task runner (dag.test)
    installs the task's `on_kill` as the SIGTERM handler and never restores it
    (airflow/sdk/execution_time/task_runner.py `run`), after which a SIGTERM would kill a gang and
    let the DAG run retry it instead of stopping the drill. So `signal.signal` is guarded in this
    process: a request for one of these signals is ignored, the drill's handler stays.
    """
    install = signal.signal

    def handler(signum, frame):
        for other in _STOP_SIGNALS:
            install(other, signal.SIG_IGN)
        try:
            drill.close(remove=False, interrupted=True)
        finally:
            summary = {"state": "failed", "backend": "kubernetes", "api": drill.launch_api, "train_attempts": 0, "promoted": False,
                       "runtime": drill.runtime_name, **_INTERRUPTED}
            print(json.dumps(summary), flush=True)
            os._exit(128 + signum)

    def guarded(signum, action):
        if signum in _STOP_SIGNALS:
            return handler
        return install(signum, action)

    for signum in _STOP_SIGNALS:
        install(signum, handler)
    signal.signal = guarded


def main(argv: list[str] | None = None) -> int:
    from operators.kubernetes.runtime import APIS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="digits", help="the pipeline to run: a file pipelines/<name>.yaml (default digits)")
    parser.add_argument("--conf", default="{}", help="DAG run conf (Params) merged over the drill's: " + json.dumps(DEFAULT_CONF)
                        + "; per pipeline: " + json.dumps(PIPELINE_CONF))
    parser.add_argument("--api", default="jobset", choices=APIS, help="launch API the backend submits (runtime.yaml `api`): jobset (default), "
                        "trainjob, run as Kubeflow Trainer v2 would run it, mpijob, run as the MPI Operator v2 would (launcher mpirun), or rayjob, "
                        "run as KubeRay would (a local Ray cluster, `ray job submit`)")
    parser.add_argument("--runtime", choices=RUNTIMES, default="process",
                        help="process: each pod's container as local processes (default); podman: as a container of the training image `make images` built")
    parser.add_argument("--keep", type=Path, help="keep the drill's files (servers' data, pod dirs and logs, report.json) in this folder")
    parser.add_argument("--multikueue", type=int, default=0, metavar="N",
                        help="N >= 2 worker clusters behind a MultiKueue manager (the API the worker talks to); 0: none (default)")
    args = parser.parse_args(argv)
    try:
        conf = json.loads(args.conf)
    except ValueError as exc:
        parser.error(f"--conf: not valid JSON ({exc})")
    if not isinstance(conf, dict):
        parser.error("--conf: must be a JSON object")
    if conf.get("backend", "kubernetes") != "kubernetes":
        parser.error("--conf: backend must be 'kubernetes' (the drill runs the Kubernetes backend)")
    from operators.config import embedded

    embedded.apply()  # before anything imports Airflow: it binds its settings at import
    from operators.config.pipelines import PipelineConfigError, pipeline

    try:
        pipeline(args.pipeline)
    except PipelineConfigError as exc:
        parser.error(f"--pipeline: {exc}")
    # the fault goes to the emulated pods only; the real backend never forwards GANGFLOW_FAULT
    fault = os.environ.pop("GANGFLOW_FAULT", "")
    os.environ.pop("GANGFLOW_ALLOW_FAULTS", None)
    from operators.cli.drill.cluster import EVENT_ENV, parse_drill_event

    try:
        event = parse_drill_event(os.environ.pop(EVENT_ENV, ""))
    except ValueError as exc:
        parser.error(str(exc))
    summary: dict[str, Any] = {"state": "failed", "backend": "kubernetes", "api": args.api, "train_attempts": 0, "promoted": False, "runtime": args.runtime}
    try:
        drill = Drill(keep=args.keep, fault=fault, conf=conf, pipeline=args.pipeline, api=args.api, event=event, runtime=args.runtime,
                      multikueue=args.multikueue)
    except DrillError as exc:
        print(json.dumps(summary | {"failure": {"kind": "user", "reason": str(exc)}}), flush=True)
        return 2
    _stop_on_signal(drill)
    echo(f"drill {drill.id}: files in {drill.dir}; worker state dir {drill.state}" + (f"; fault for the pods: {fault}" if fault else "")
         + (f"; cluster event: {event.spec}" if event else ""))
    ok, code = False, 1
    try:
        drill.start()
        summary = drill.run()
        ok = summary.get("state") == "success"
        code = 0 if ok else 1
    except Exception as exc:  # servers that did not start, DVC, S3: named, and everything stopped
        if not isinstance(exc, DrillError):
            traceback.print_exc()
        summary["failure"] = {"kind": "drill", "reason": f"{type(exc).__name__}: {exc}"}
    finally:
        drill.close(remove=ok)
    print(json.dumps(summary, default=str), flush=True)
    return code


if __name__ == "__main__":
    from operators.utils.processes import exit_without_teardown

    exit_without_teardown(main())
