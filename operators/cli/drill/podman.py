"""The drill's `--runtime podman`: each rendered pod runs as a podman container of the training
image `make images` built, as a kubelet would run it with a container runtime.

What maps to what (a pure function of the pod, `container_argv`):
- `command` -> `--entrypoint` (JSON), `args` -> the arguments after the image (Kubernetes' rule);
- env (Secrets resolved as the kubelet does) -> `--env NAME` with the value in the podman client's
  environment, so no value (and no secret) is ever in an argv;
- `runAsUser`/`runAsGroup` -> `--user`, `fsGroup` -> `--group-add`, `runAsNonRoot` refused for a
  root user (CreateContainerConfigError, as the kubelet), `readOnlyRootFilesystem` -> `--read-only`
  with no tmpfs podman would add itself, `allowPrivilegeEscalation: false` -> no-new-privileges,
  `capabilities` -> `--cap-drop`/`--cap-add`;
- emptyDir -> a bind mount of a fresh folder of the pod's drill dir (mode 777, as the kubelet
  makes it), a Memory emptyDir at /dev/shm -> `--shm-size` (its sizeLimit), elsewhere a tmpfs;
  a ConfigMap volume -> its keys as files, bind-mounted read-only; the termination-message file;
- `spec.hostname` -> `--hostname` (each container has pid 1: the host name tells ranks apart), and
  the gang's host and DNS names -> `--add-host NAME:127.0.0.1`;
- `--network host`: the pods reach the drill's S3 API, MLflow server and rank 0 on 127.0.0.1 (the
  gang's DNS names are rewritten to 127.0.0.1 as in the process runtime), no pod network.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from operators.cli.drill.pods import ContainerConfigError, Rewrites, expand

IMAGE = "localhost/gangflow/training:local"
_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


class PodmanError(RuntimeError):
    """podman or the training image is missing; the message says how to get them."""


def quantity_bytes(value: str) -> int:
    m = _QUANTITY.fullmatch(str(value))
    if not m:
        raise ContainerConfigError(f"size {value!r}: the drill reads integer quantities with Ki/Mi/Gi/Ti/k/M/G/T")
    return int(m.group(1)) * _FACTORS[m.group(2)]


def container_name(marker: str) -> str:
    """`<drill id>-<pod>`: podman's name for a pod's container (the marker is `<drill id>/<pod>`)."""
    return marker.replace("/", "-")


def _security(pod: Mapping[str, Any], container: Mapping[str, Any], image_user: str) -> list[str]:
    pod_sc = (pod.get("spec") or {}).get("securityContext") or {}
    sc = {**pod_sc, **(container.get("securityContext") or {})}
    opts: list[str] = []
    user, group = sc.get("runAsUser"), sc.get("runAsGroup")
    effective = str(user) if user is not None else (image_user.split(":")[0] or "0")
    if sc.get("runAsNonRoot"):
        if not effective.isdigit():
            raise ContainerConfigError(f"container has runAsNonRoot and image has non-numeric user ({effective}), cannot verify user is non-root")
        if int(effective) == 0:
            raise ContainerConfigError("container has runAsNonRoot and image will run as root")
    if user is not None:
        opts += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if pod_sc.get("fsGroup") is not None:
        opts += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("readOnlyRootFilesystem"):
        opts += ["--read-only", "--read-only-tmpfs=false"]  # only the pod's volumes are writable
    if sc.get("allowPrivilegeEscalation") is False:
        opts += ["--security-opt", "no-new-privileges"]
    caps = sc.get("capabilities") or {}
    opts += [a for cap in caps.get("drop") or [] for a in ("--cap-drop", str(cap))]
    opts += [a for cap in caps.get("add") or [] for a in ("--cap-add", str(cap))]
    return opts


def _volumes(pod: Mapping[str, Any], container: Mapping[str, Any], pod_dir: Path, lookup) -> list[str]:
    """The volume mounts as podman options; folders made under `pod_dir/volumes`."""
    spec = pod.get("spec") or {}
    namespace = (pod.get("metadata") or {}).get("namespace") or "default"
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    opts: list[str] = []
    for mount in container.get("volumeMounts") or []:
        path, volume = mount["mountPath"], volumes.get(mount["name"])
        if volume is None:
            raise ContainerConfigError(f"volume mount {path}: no volume named {mount['name']!r}")
        read_only = ",ro" if mount.get("readOnly") else ""
        if "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                size = quantity_bytes(empty["sizeLimit"]) if empty.get("sizeLimit") else None
                if path == "/dev/shm":
                    opts += ["--shm-size", str(size or 64 * 2**20)]
                else:
                    opts += ["--mount", f"type=tmpfs,destination={path}" + (f",tmpfs-size={size}" if size else "")]
                continue
            folder = pod_dir / "volumes" / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o777)  # the kubelet's emptyDir mode: any uid of the pod writes
            opts += ["--mount", f"type=bind,source={folder},destination={path}{read_only}"]
        elif "configMap" in volume:
            ref = volume["configMap"]
            obj = lookup("ConfigMap", namespace, ref.get("name"))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(f'configmap "{ref.get("name")}" not found')
            folder = pod_dir / "volumes" / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            data = obj.get("data") or {}
            items = ref.get("items") or [{"key": key, "path": key} for key in sorted(data)]
            for item in items:
                target = (folder / item["path"]).resolve()
                if not str(target).startswith(str(folder.resolve()) + "/"):
                    raise ContainerConfigError(f"configMap item path {item['path']!r} leaves the volume")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(str(data[item["key"]]))
                target.chmod(0o444)
            opts += ["--mount", f"type=bind,source={folder},destination={path},ro"]
        else:
            raise ContainerConfigError(f"volume mount {path}: the drill provides emptyDir and configMap volumes only (use checkpoint.uri)")
    return opts


def container_argv(
    pod: Mapping[str, Any], container: Mapping[str, Any], env: Mapping[str, str], *, name: str, image: str, image_user: str,
    pod_dir: Path, termination_log: Path, hosts: Rewrites, lookup, peers: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    """`podman run ...` for one pod's container (see the module doc); env values are not in it."""
    opts = ["run", "--rm", "--name", name, "--pull=never", "--network=host"]
    hostname = (pod.get("spec") or {}).get("hostname")
    if hostname:  # the pod's own: torchrun's rendezvous tells nodes apart by host name and pid (1 in each container)
        opts += ["--hostname", str(hostname)]
    # the gang's names (its own, the peers' host names and DNS names) resolve to this machine, as the
    # pod's /etc/hosts and the headless Service's DNS would resolve them to the pods' IPs
    for host in dict.fromkeys([*([str(hostname)] if hostname else []), *peers, *hosts.hosts]):
        opts += ["--add-host", f"{host}:127.0.0.1"]
    opts += _security(pod, container, image_user)
    opts += _volumes(pod, container, pod_dir, lookup)
    termination_log.chmod(0o666)
    opts += ["--mount", f"type=bind,source={termination_log},destination={container.get('terminationMessagePath') or '/dev/termination-log'}"]
    cpu = str(((container.get("resources") or {}).get("limits") or {}).get("cpu", ""))
    if cpu.isdigit():
        opts += ["--cpus", cpu]
    for key in env:
        opts += ["--env", key]
    if container.get("workingDir"):
        opts += ["--workdir", str(container["workingDir"])]
    command = [hosts.apply(expand(str(c), env)) for c in container.get("command") or []]
    args = [hosts.apply(expand(str(a), env)) for a in container.get("args") or []]
    if command:
        opts += ["--entrypoint", json.dumps(command)]
    return [*opts, image, *args]


class PodmanRuntime:
    """Runs pods as containers of one image; `image_digest` is the digest of that image."""

    name = "podman"

    def __init__(self, image: str = IMAGE):
        from operators.cli import images

        if shutil.which("podman") is None:
            raise PodmanError(f"podman not found: {images.DEPS_HINT}, then `make images`")
        try:
            info = images.inspect(image)
        except images.ImagesError:
            raise PodmanError(f"the training image {image} is not in podman's storage: run `make images`") from None
        self.env = images.podman_env()
        self.executable = shutil.which("podman")
        self.image_id = info["id"]
        self.image_digest = info["digest"]
        self.reference = image.rsplit(":", 1)[0] + "@" + info["digest"]
        out = images.podman("image", "inspect", "--format", "{{.Config.User}}", self.image_id, capture=True)
        self.image_user = out.stdout.strip()

    def client_env(self, container_env: Mapping[str, str], marker_env: Mapping[str, str]) -> dict[str, str]:
        """The podman client's environment: what `--env NAME` reads the values from."""
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CONTAINERS_CONF": self.env["CONTAINERS_CONF"], **container_env, **marker_env}

    def remove(self, drill_id: str) -> None:
        """Remove every container of this drill that is left (normally none: `--rm`)."""
        from operators.cli import images

        out = images.podman("ps", "--all", "--quiet", "--filter", f"name=^{drill_id}-", capture=True, check=False)
        ids = out.stdout.split()
        if ids:
            images.podman("rm", "--force", "--time", "0", *ids, capture=True, check=False)

    @staticmethod
    def run(argv: list[str], env: dict[str, str], executable: str) -> subprocess.Popen:
        return subprocess.Popen([executable, *argv], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


AIRFLOW_IMAGE = "localhost/gangflow/airflow:local"
WORKER_STATE = "/gangflow-state"  # the worker container's GANGFLOW_HOME, a folder of the drill's


class PodmanWorker:
    """The drill's Airflow worker as a container of the Airflow image (operators/cli/drill/worker.py),
    run as the official chart runs task pods: the image's user, the host's network in place of
    the cluster's, env by name only; `image_digest` is the digest of the image that ran."""

    def __init__(self, image: str = AIRFLOW_IMAGE):
        from operators.cli import images

        try:
            info = images.inspect(image)
        except images.ImagesError:
            raise PodmanError(f"the Airflow image {image} is not in podman's storage: run `make images`") from None
        self.env = images.podman_env()
        self.image_digest = info["digest"]
        self.reference = image.rsplit(":", 1)[0] + "@" + info["digest"]

    def argv(self, *, name: str, state: Path, env_names: Sequence[str], dag_id: str, conf: Mapping[str, Any]) -> list[str]:
        """`podman run ...` of the worker; env values are not in it."""
        from operators.cli.drill.worker import IMAGE_DAGS

        opts = ["run", "--rm", "--name", name, "--pull=never", "--network=host", "--user", "50000:0",
                "--mount", f"type=bind,source={state},destination={WORKER_STATE}", "--env", "GANGFLOW_HOME"]  # fmt: skip
        for key in env_names:
            opts += ["--env", key]
        return [*opts, "--entrypoint", "python", self.reference, "-m", "operators.cli.drill.worker",
                "--dag-id", dag_id, "--conf", json.dumps(dict(conf)), "--dags", IMAGE_DAGS]  # fmt: skip

    def run(self, argv: list[str], env: Mapping[str, str], echo) -> tuple[int, list[str]]:
        """Run the worker, each output line echoed as it comes; (exit code, its last lines)."""
        client_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CONTAINERS_CONF": self.env["CONTAINERS_CONF"],
                      **env, "GANGFLOW_HOME": WORKER_STATE}  # fmt: skip
        proc = subprocess.Popen([shutil.which("podman") or "podman", *argv], env=client_env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")  # fmt: skip
        last: collections.deque[str] = collections.deque(maxlen=20)
        for line in proc.stdout:
            last.append(line.rstrip("\n"))
            echo("airflow-worker| " + last[-1])
        return proc.wait(), list(last)
