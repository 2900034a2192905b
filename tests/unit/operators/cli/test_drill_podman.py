"""`make cluster-drill RUNTIME=podman` and `make images`: the `podman run` / `podman build` argument
lists, from a pod the real builder renders (no podman needed here; tests/system/images runs them)."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from operators.backends.base import GangSpec
from operators.cli.drill.pods import ContainerConfigError, Rewrites, resolve_env
from operators.cli.drill.podman import container_argv, quantity_bytes
from operators.kubernetes.builders import build_container, build_pod_template
from operators.kubernetes.runtime import RuntimeDefaults, example_runtime_mapping

IMAGE = "localhost/gangflow/training@sha256:" + "ab" * 32
SECRET = "s3cr3t-value-never-in-argv"


def rendered_pod(**runtime_changes) -> dict:
    """A rank pod as the Kubernetes backend renders it (the builders), with a Secret-backed env."""
    mapping = example_runtime_mapping() | {"checkpoint": {"uri": "s3://b/checkpoints"}, "shmSize": "256Mi", **runtime_changes}
    runtime = RuntimeDefaults.from_mapping(mapping)
    spec = GangSpec(name="g-1", run_dir="s3://b/runs/g-1", world_size=2, config_path="/app/params.yaml", env={"MLFLOW_RUN_ID": "r1"})
    args = ["--nnodes=2", "--rdzv-endpoint=g-1-rank-0-0.g-1:29400", "-m", "trainer", "--config", "/app/params.yaml"]
    template = build_pod_template(spec, runtime, args=args)
    template.spec.containers = [build_container(spec, runtime, args=args)]
    pod = ApiClient().sanitize_for_serialization(template)
    pod["metadata"] = {"name": "g-1-rank-0-0-abcde", "namespace": "ml"}
    pod["spec"] |= {"hostname": "g-1-rank-0-0", "subdomain": "g-1"}  # what the Job controller sets
    pod["spec"]["containers"][0]["env"].append({"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}})
    return pod


def lookup(kind, namespace, name):
    if kind == "Secret":  # creds, and the runtime's S3 and MLflow Secrets
        value = base64.b64encode(SECRET.encode()).decode()
        return {"data": {key: value for key in ("token", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}
    if kind == "ConfigMap" and name == "params":
        return {"data": {"params.yaml": "train:\n  max_steps: 3\n"}}
    return None


def argv_for(pod: dict, tmp_path: Path, image_user: str = "10001:10001") -> tuple[list[str], dict]:
    container = pod["spec"]["containers"][0]
    env = resolve_env(container, pod, lookup)
    log = tmp_path / "termination-log"
    log.touch()
    hosts = Rewrites(hosts={"g-1-rank-0-0.g-1": "127.0.0.1"})
    argv = container_argv(pod, container, env, name="drill-x-g-1", image=IMAGE, image_user=image_user, pod_dir=tmp_path,
                          termination_log=log, hosts=hosts, lookup=lookup)  # fmt: skip
    return argv, env


def option_values(argv: list[str], flag: str) -> list[str]:
    return [b for a, b in zip(argv, argv[1:]) if a == flag]


def test_the_rendered_pod_runs_as_its_user_on_a_read_only_root_with_its_mounts(tmp_path):
    pod = rendered_pod()
    argv, env = argv_for(pod, tmp_path)
    assert argv[:2] == ["run", "--rm"] and "--network=host" in argv and "--pull=never" in argv
    assert option_values(argv, "--hostname") == ["g-1-rank-0-0"]  # torchrun tells the ranks apart by host name
    assert set(option_values(argv, "--add-host")) == {"g-1-rank-0-0:127.0.0.1", "g-1-rank-0-0.g-1:127.0.0.1"}
    assert option_values(argv, "--user") == ["10001:10001"]
    assert "--read-only" in argv and "--read-only-tmpfs=false" in argv  # only the pod's volumes are writable
    assert option_values(argv, "--security-opt") == ["no-new-privileges"]
    assert option_values(argv, "--cap-drop") == ["ALL"]
    assert option_values(argv, "--shm-size") == [str(256 * 2**20)]  # the Memory emptyDir's sizeLimit (example runtime: 256Mi)
    mounts = option_values(argv, "--mount")
    (tmp_mount,) = [m for m in mounts if m.endswith("destination=/tmp")]
    folder = Path(tmp_mount.split("source=")[1].split(",")[0])
    assert folder.is_dir() and folder.is_relative_to(tmp_path) and stat.S_IMODE(folder.stat().st_mode) == 0o777
    assert any(m.endswith("destination=/dev/termination-log") for m in mounts)
    # command -> entrypoint, args after the image, the gang's rank-0 name -> 127.0.0.1
    assert json.loads(option_values(argv, "--entrypoint")[0]) == ["torchrun"]
    image_at = argv.index(IMAGE)
    assert argv[image_at + 1 :] == ["--nnodes=2", "--rdzv-endpoint=127.0.0.1:29400", "-m", "trainer", "--config", "/app/params.yaml"]
    # every env variable by name only: the values (the Secret's included) never reach an argv
    assert set(option_values(argv, "--env")) == set(env) and env["TOKEN"] == SECRET
    assert not any(SECRET in a for a in argv)


def test_run_as_non_root_with_a_root_user_is_a_create_container_config_error(tmp_path):
    pod = rendered_pod()
    pod["spec"]["securityContext"]["runAsUser"] = 0
    with pytest.raises(ContainerConfigError, match="runAsNonRoot"):
        argv_for(pod, tmp_path)
    pod = rendered_pod()
    del pod["spec"]["securityContext"]["runAsUser"]
    with pytest.raises(ContainerConfigError, match="runAsNonRoot"):
        argv_for(pod, tmp_path, image_user="")  # the image's own user is root
    argv, _ = argv_for(pod, tmp_path, image_user="10001:10001")
    assert option_values(argv, "--user") == []  # the image's USER applies


def test_a_config_map_volume_is_mounted_read_only_with_its_keys_as_files(tmp_path):
    pod = rendered_pod()
    pod["spec"]["volumes"].append({"name": "params", "configMap": {"name": "params"}})
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "params", "mountPath": "/etc/gangflow", "readOnly": True})
    argv, _ = argv_for(pod, tmp_path)
    (mount,) = [m for m in option_values(argv, "--mount") if "destination=/etc/gangflow" in m]
    assert mount.endswith(",ro")
    source = Path(mount.split("source=")[1].split(",")[0])
    assert (source / "params.yaml").read_text() == "train:\n  max_steps: 3\n"
    pod["spec"]["volumes"][-1]["configMap"]["items"] = [{"key": "params.yaml", "path": "../../escape.yaml"}]
    with pytest.raises(ContainerConfigError, match="leaves the volume"):
        argv_for(pod, tmp_path)


def test_a_volume_the_drill_cannot_provide_is_refused_by_name(tmp_path):
    pod = rendered_pod()
    pod["spec"]["volumes"].append({"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}})
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "ckpt", "mountPath": "/ckpt"})
    with pytest.raises(ContainerConfigError, match="/ckpt"):
        argv_for(pod, tmp_path)


def test_quantities():
    assert quantity_bytes("256Mi") == 256 * 2**20 and quantity_bytes("1G") == 10**9 and quantity_bytes("512") == 512
    with pytest.raises(ContainerConfigError):
        quantity_bytes("1.5Gi")


def test_image_builds_mount_the_ca_as_a_secret_and_the_wheelhouse_read_only(tmp_path):
    from operators.cli.images import IMAGES, build_argv

    ca = tmp_path / "ca.crt"
    argv = build_argv(IMAGES["training"], base="localhost/gangflow/base:bookworm", tags=["localhost/gangflow/training:x"], wheels=tmp_path / "wh",
                      ca=ca, build_args={}, iidfile=tmp_path / "iid", project=Path("/src"))  # fmt: skip
    assert option_values(argv, "--secret") == [f"id=ca,src={ca}"]
    assert option_values(argv, "--volume") == [f"{tmp_path / 'wh'}:/wheelhouse:ro"]
    assert set(option_values(argv, "--build-arg")) == {"PYTHON_IMAGE=localhost/gangflow/base:bookworm", "WHEELHOUSE=/wheelhouse"}
    assert option_values(argv, "--ignorefile") == ["/src/docker/training.Dockerfile.dockerignore"]
    assert "--pull=never" in argv and argv[-1] == "/src"


def test_the_drill_refuses_an_unknown_runtime():
    from operators.cli.drill.run import Drill, DrillError

    with pytest.raises(DrillError, match="process, podman"):
        Drill(runtime="docker")


def test_without_podman_both_commands_say_what_to_install(monkeypatch, tmp_path, capsys):
    from operators.cli import images
    from operators.cli.drill.podman import PodmanError, PodmanRuntime

    monkeypatch.setenv("PATH", str(tmp_path))  # no podman, no mmdebstrap
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    assert images.main(["--image", "training"]) == 1
    failure = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert failure["state"] == "failed" and "make podman-deps" in failure["reason"] and "podman" in failure["reason"]
    with pytest.raises(PodmanError, match="make podman-deps"):
        PodmanRuntime()


def test_the_airflow_worker_runs_as_the_image_user_from_the_image_by_digest_with_env_by_name(monkeypatch, tmp_path):
    from operators.cli import images
    from operators.cli.drill.podman import WORKER_STATE, PodmanWorker
    from operators.cli.drill.run import worker_env

    digest = "sha256:" + "ab" * 32
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(images, "inspect", lambda ref: {"id": "sha256:" + "cd" * 32, "digest": digest, "size_bytes": 1})
    environ = {"AWS_SECRET_ACCESS_KEY": "s3-secret-value", "AWS_ACCESS_KEY_ID": "drillkey", "MLFLOW_TRACKING_URI": "http://127.0.0.1:5001",
               "AIRFLOW_CONN_KUBERNETES_DEFAULT": '{"conn_type": "kubernetes"}', "GANGFLOW_RETRY_BASE_DELAY": "1",
               "GANGFLOW_DVC_REMOTE": "s3://b/dvc", "GANGFLOW_HOME": "/host/state", "GANGFLOW_PROJECT": "/host/clone",
               "GANGFLOW_GIT_COMMIT": "host-commit", "AIRFLOW__CORE__DAGS_FOLDER": "/host/clone/dags", "HOME": "/root"}  # fmt: skip
    env = worker_env(environ)
    # this machine's paths and commit stay here: the image has its own
    assert set(env) == {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_URI", "AIRFLOW_CONN_KUBERNETES_DEFAULT",
                        "GANGFLOW_RETRY_BASE_DELAY", "GANGFLOW_DVC_REMOTE"}  # fmt: skip
    worker = PodmanWorker()
    argv = worker.argv(name="drill-x-airflow-worker", state=tmp_path / "w", env_names=sorted(env), dag_id="train_pipeline", conf={"world_size": 2})
    assert f"localhost/gangflow/airflow@{digest}" in argv and worker.image_digest == digest
    assert argv[argv.index("--user") + 1] == "50000:0"  # the official image's airflow user
    assert f"type=bind,source={tmp_path / 'w'},destination={WORKER_STATE}" in argv
    assert argv[argv.index("--entrypoint") + 1] == "python" and argv[-8:-6] == ["-m", "operators.cli.drill.worker"]
    assert argv[argv.index("--dags") + 1] == "/opt/airflow/dags"
    assert not any("s3-secret-value" in a or "/host/" in a for a in argv)  # values go by name only
    assert {argv[i + 1] for i, a in enumerate(argv) if a == "--env"} == set(env) | {"GANGFLOW_HOME"}


def test_without_the_airflow_image_the_drill_says_to_build_it(monkeypatch, tmp_path):
    from operators.cli import images
    from operators.cli.drill.podman import PodmanError, PodmanWorker

    def missing(ref):
        raise images.ImagesError(f"image {ref} is not in podman's storage: run `make images`")

    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(images, "inspect", missing)
    with pytest.raises(PodmanError, match=r"Airflow image localhost/gangflow/airflow:local .*make images"):
        PodmanWorker()
