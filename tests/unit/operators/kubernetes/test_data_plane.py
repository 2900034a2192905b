"""What a rendered pod gets (issue 9 items 4, 5, 7, 10; issue 12 item 5): processes per pod, the
pinned dataset by version from the runtime's DVC remote, no path of the Airflow worker, the
runtime's MLflow URI and never credentials in values, no fault injection, lineage on the gang and
on the MLflow run."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from operators.config import settings
from operators.backends.base import GangSpec
from operators.backends.kubernetes import KubernetesBackend
from operators.exceptions import GangConfigError
from operators.cli.render import main, render_documents
from operators.kubernetes.builders import DatasetRequiredError, GangSizeError, WorkerPathError, build_gang
from operators.kubernetes.runtime import RuntimeConfigError, RuntimeDefaults, example_runtime_mapping, merge_runtime

from gangflow_tests_k8s_support import CONN_ID, RUNTIME  # loaded by conftest.py

VERSION = "5d41402abc4b2a76b9719d911017c592"
KINDS = [{"scheduler": "kueue", "api": "jobset"}, {"scheduler": "volcano", "api": "jobset"}, {"scheduler": "kueue", "api": "trainjob"}]


def _runtime(**changes) -> RuntimeDefaults:
    return RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), changes))


def _containers(obj: dict) -> list[dict]:
    """(args, env) holders of a rendered gang object: containers, or a TrainJob's trainer."""
    if obj["kind"] == "TrainJob":
        return [obj["spec"]["trainer"]]
    if obj["kind"] == "JobSet":
        return [c for rj in obj["spec"]["replicatedJobs"] for c in rj["template"]["spec"]["template"]["spec"]["containers"]]
    return [c for task in obj["spec"]["tasks"] for c in task["template"]["spec"]["containers"]]


def _set_values(args: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for flag, item in zip(args, args[1:]) if flag == "--set")


def _worker_spec(**extra) -> GangSpec:
    """A spec as the training operator builds it on the Airflow worker today: the worker's run dir,
    params.yaml, data paths under its DVC cache and its own (SQLite) MLflow URI."""
    state = settings.state_dir()
    overrides = (
        f"data.train_path={state}/dvc-cache/files/md5/ab/cdef",
        f"data.test_path={settings.PROJECT_ROOT}/data/digits/test.parquet",
        "train.max_steps=50",
        f"data.version={VERSION}",
    )
    env = {
        "GANGFLOW_DAG_ID": "train_pipeline",
        "GANGFLOW_DAG_RUN_ID": "manual__1",
        "GANGFLOW_TRY_NUMBER": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{state}/mlflow.db",
        "MLFLOW_RUN_ID": "0123abcd",
        "GANGFLOW_FAULT": "kill@step=3,rank=1",
        "GANGFLOW_ALLOW_FAULTS": "1",
    }
    kwargs = dict(name="train-pipeline-1", run_dir=str(settings.run_dir("train_pipeline", "manual__1")), world_size=2,
                  config_path=str(settings.trainer_config_path()), overrides=overrides, env=env)
    kwargs.update(extra)
    return GangSpec(**kwargs)


# --- 9.4 processes per pod -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_nproc_per_node_follows_gpus_and_world_size_is_pods_times_procs(kind, crd_registry):
    from operators.kubernetes.validation import validate_object

    runtime = merge_runtime(example_runtime_mapping(), {"resources": {"gpu": 8}, **kind})
    (obj,) = render_documents(world_size=16, runtime=runtime, dataset_version=VERSION)
    validate_object(obj, crd_registry)
    (container,) = _containers(obj)
    args = container["args"]
    assert "--nproc-per-node=8" in args
    if obj["kind"] == "TrainJob":
        assert obj["spec"]["trainer"]["numNodes"] == 2 and obj["spec"]["trainer"]["numProcPerNode"] == 8
    elif obj["kind"] == "JobSet":
        assert "--nnodes=2" in args
        job = obj["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert job["completions"] == job["parallelism"] == 2
    else:
        assert "--nnodes=2" in args
        assert obj["spec"]["minAvailable"] == 2 and obj["spec"]["tasks"][0]["replicas"] == 2
    assert obj["metadata"]["annotations"]["gangflow.io/world-size"] == "16"
    assert obj["metadata"]["annotations"]["gangflow.io/processes-per-pod"] == "8"


def test_cpu_pods_take_procs_per_pod():
    (js,) = render_documents(world_size=8, runtime=merge_runtime(example_runtime_mapping(), {"resources": {"gpu": 0}, "procsPerPod": 4}), dataset_version=VERSION)
    (container,) = _containers(js)
    assert "--nnodes=2" in container["args"] and "--nproc-per-node=4" in container["args"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_world_size_must_divide_into_pods():
    with pytest.raises(GangSizeError) as exc:
        build_gang(_worker_spec(world_size=12), _runtime(resources={"gpu": 8}))
    assert "world_size=12 is not a multiple of the processes per pod, 8 from runtime resources.gpu=8" in str(exc.value)
    with pytest.raises(RuntimeConfigError, match=r"runtime procsPerPod=4: with resources.gpu=8 the pod runs one process per GPU"):
        _runtime(resources={"gpu": 8}, procsPerPod=4)


def test_cli_summary_says_which_number_is_which(capsys):
    assert main(["render", "--dataset-version", VERSION, "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "world size 2 = 2 pod(s) (--nnodes) x 1 process(es) per pod (--nproc-per-node)" in captured.err
    assert captured.out.startswith("# gangflow:") and "# " + "  world size 2 = 2 pod(s)" in captured.out


# --- 9.5 render for a pinned dataset version, no worker path --------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_render_names_the_version_and_where_pods_fetch_it(kind):
    (obj,) = render_documents(world_size=2, runtime=merge_runtime(example_runtime_mapping(), kind), dataset_version=VERSION)
    assert obj["metadata"]["labels"]["gangflow.io/dataset-version"] == VERSION
    assert obj["metadata"]["annotations"]["gangflow.io/dataset-remote"] == "s3://gangflow-data/dvc"
    (container,) = _containers(obj)
    sets = _set_values(container["args"])
    assert sets["data.remote"] == "s3://gangflow-data/dvc" and sets["data.version"] == VERSION
    env = {e["name"]: e for e in container["env"]}
    # object-storage keys by Secret reference only, never values
    assert env["AWS_SECRET_ACCESS_KEY"] == {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "gangflow-object-storage", "key": "AWS_SECRET_ACCESS_KEY"}}}


@pytest.mark.parametrize("kind", KINDS)
def test_no_worker_path_reaches_a_pod(kind):
    """The spec the operator builds on the worker names its run dir, params.yaml, DVC cache and
    SQLite MLflow store: none of it may appear anywhere in what is submitted."""
    plan = build_gang(_worker_spec(), RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), kind)))
    text = yaml.safe_dump(plan.body)
    for local in (str(settings.PROJECT_ROOT), str(settings.state_dir())):
        assert local not in text
    (container,) = _containers(plan.body)
    args = container["args"]
    assert args[args.index("--config") + 1] == "/app/params.yaml"
    assert args[args.index("--run-dir") + 1] == "/checkpoints/train-pipeline-1"
    sets = _set_values(args)
    assert "data.train_path" not in sets and "data.test_path" not in sets  # the rank fetches the version
    assert sets["train.max_steps"] == "50" and sets["data.version"] == VERSION


def test_cli_render_output_has_no_project_or_state_path(project_root, tmp_path):
    home = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, "-m", "operators.cli.render", "render", "--dataset-version", VERSION, "--world-size", "2"],
        cwd=project_root, capture_output=True, text=True, timeout=60, env={**__import__("os").environ, "GANGFLOW_HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stderr
    for local in (str(project_root), str(home), "/.gangflow"):
        assert local not in proc.stdout and local not in proc.stderr
    assert f"data.version={VERSION}" in proc.stdout and "gangflow.io/dataset-version" in proc.stdout


def test_render_without_a_dataset_is_refused_unless_the_image_carries_it(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["render", "--world-size", "2"])
    assert exc.value.code == 2
    assert "no dataset version; a gang with no dataset cannot train" in capsys.readouterr().err
    carried = tmp_path / "runtime.yaml"
    carried.write_text(yaml.safe_dump(merge_runtime(example_runtime_mapping(), {"dataset": {"remote": None, "imageCarriesData": True}})))
    assert main(["render", "--world-size", "2", "--runtime", str(carried)]) == 0
    assert "dataset carried by the image" in capsys.readouterr().err


def test_a_version_needs_the_runtime_remote():
    with pytest.raises(DatasetRequiredError, match="runtime dataset.remote is unset"):
        build_gang(_worker_spec(), RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), {"dataset": None})))


def test_other_worker_paths_are_refused_naming_them():
    spec = _worker_spec(overrides=(f"data.version={VERSION}", "model.init=/home/airflow/weights.safetensors"))
    with pytest.raises(WorkerPathError, match=r"override model.init='/home/airflow/weights.safetensors' is a path on the Airflow worker"):
        build_gang(spec, _runtime())
    with pytest.raises(WorkerPathError, match="config_path='/srv/team/custom.yaml' is a file on the Airflow worker"):
        build_gang(_worker_spec(config_path="/srv/team/custom.yaml"), _runtime())
    # /tmp is a pod's own empty scratch: a worker path there is refused too (a clone under /tmp found it)
    with pytest.raises(WorkerPathError, match="override data.extra='/tmp/airflow/x.parquet'"):
        build_gang(_worker_spec(overrides=(f"data.version={VERSION}", "data.extra=/tmp/airflow/x.parquet")), _runtime())
    with pytest.raises(WorkerPathError, match="config_path='/tmp/work/custom.yaml'"):
        build_gang(_worker_spec(config_path="/tmp/work/custom.yaml"), _runtime())
    spec = _worker_spec(config_path="/tmp/k2-clone/params.yaml")
    (container,) = _containers(build_gang(spec, _runtime()).body)
    assert container["args"][container["args"].index("--config") + 1] == "/app/params.yaml"
    with pytest.raises(ValueError, match="must be the DVC md5"):
        build_gang(_worker_spec(overrides=("data.version=latest",)), _runtime())


@pytest.mark.parametrize("remote", ["/srv/dvc-remote", "file:///srv/dvc", "s3://AKIA:secret@bucket/dvc"])
def test_dataset_remote_must_be_a_remote(remote):
    with pytest.raises(RuntimeConfigError) as exc:
        _runtime(dataset={"remote": remote})
    assert "runtime dataset.remote=" in str(exc.value) and "secret" not in str(exc.value)


# --- 9.10 MLflow credentials; the runtime's URI wins ------------------------------------------------


def test_tracking_uri_with_credentials_is_refused_and_redacted(capsys, tmp_path):
    bad = merge_runtime(example_runtime_mapping(), {"mlflowTrackingUri": "https://bob:s3cr3t-pw@mlflow.example.com"})
    with pytest.raises(RuntimeConfigError) as exc:
        RuntimeDefaults.from_mapping(bad)
    assert "s3cr3t-pw" not in str(exc.value)
    assert "runtime mlflowTrackingUri='https://bob:***@mlflow.example.com': must not carry credentials" in str(exc.value)
    assert "mlflowSecretRef" in str(exc.value)
    path = tmp_path / "runtime.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(SystemExit):
        main(["render", "--dataset-version", VERSION, "--runtime", str(path)])
    captured = capsys.readouterr()
    assert "s3cr3t-pw" not in captured.err + captured.out and "bob:***@" in captured.err


def test_backend_refusal_is_redacted(fake_k8s):
    runtime = copy.deepcopy(RUNTIME)
    runtime["mlflowTrackingUri"] = "http://svc:hunter22@mlflow.ml.svc:5000"
    with pytest.raises(GangConfigError) as exc:
        KubernetesBackend(kubernetes_conn_id=CONN_ID, runtime_configmap=None, runtime=runtime).runtime()
    assert "hunter22" not in str(exc.value) and "svc:***@" in str(exc.value)


def test_the_workers_uri_never_reaches_a_pod():
    spec = _worker_spec(env={"MLFLOW_TRACKING_URI": "http://worker:pw@mlflow.internal", "MLFLOW_RUN_ID": "r1"})
    (container,) = _containers(build_gang(spec, _runtime()).body)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.gangflow.svc:5000" and env["MLFLOW_RUN_ID"] == "r1"
    (container,) = _containers(build_gang(spec, _runtime(mlflowTrackingUri=None)).body)
    assert "MLFLOW_TRACKING_URI" not in {e["name"] for e in container["env"]}
    assert "pw@" not in yaml.safe_dump(container)


# --- 12.5 ncclEnv is for NCCL; faults never reach a cluster ------------------------------------------


@pytest.mark.parametrize("name", ["GANGFLOW_FAULT", "GANGFLOW_ALLOW_FAULTS", "LD_PRELOAD", "PYTHONPATH", "MLFLOW_TRACKING_URI"])
def test_nccl_env_refuses_other_names(name):
    with pytest.raises(RuntimeConfigError) as exc:
        _runtime(ncclEnv={"NCCL_DEBUG": "INFO", name: "x"})
    assert f"runtime ncclEnv.{name}='x': ncclEnv takes collective-library settings only" in str(exc.value)


def test_nccl_env_accepts_the_documented_names():
    runtime = _runtime(ncclEnv={"NCCL_IB_HCA": "mlx5", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert set(runtime.nccl_env) == {"NCCL_IB_HCA", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG"}


@pytest.mark.parametrize("kind", KINDS)
def test_fault_injection_is_never_forwarded(kind):
    plan = build_gang(_worker_spec(), RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), kind)))
    text = yaml.safe_dump(plan.body)
    assert "GANGFLOW_FAULT" not in text and "GANGFLOW_ALLOW_FAULTS" not in text and "kill@step" not in text


# --- 9.7 lineage ---------------------------------------------------------------------------------


def test_image_digest_tag_prefers_the_digest():
    from operators.backends.kubernetes import image_digest

    assert image_digest("r.example/t@sha256:" + "ab" * 32) == ("sha256:" + "ab" * 32, None)
    value, warning = image_digest("r.example/t:v1")
    assert value == "r.example/t:v1" and "not pinned by digest" in warning


def test_submit_tags_the_mlflow_run_and_annotates_the_gang(fake_k8s, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("lineage")).info.run_id
    spec = GangSpec(name="train-demo", run_dir="/runs/train-demo", world_size=16, overrides=(f"data.version={VERSION}",), env={"MLFLOW_RUN_ID": run_id})
    logs: list[str] = []
    handle = KubernetesBackend(kubernetes_conn_id=CONN_ID, log=logs.append).submit(spec)
    created = fake_k8s.get("jobset.x-k8s.io", "jobsets", handle["namespace"], handle["name"])
    assert created["metadata"]["annotations"]["gangflow.io/mlflow-run-id"] == run_id
    tags = client.get_run(run_id).data.tags
    assert tags["gangflow.gang"] == "train-demo"
    assert tags["gangflow.job_uid"] == created["metadata"]["uid"] == handle["uid"]
    assert tags["gangflow.image_digest"] == "sha256:" + "ab" * 32
    assert tags["gangflow.dataset_version"] == VERSION
    assert handle["pods"] == 2 and handle["processes_per_pod"] == 8


def test_a_checkpoint_uri_with_credentials_is_refused_and_redacted():
    """Issue 28: `checkpoint.uri` with user:pass@ was accepted (it went into pod args and an MLflow tag)."""
    with pytest.raises(RuntimeConfigError) as exc:
        _runtime(checkpoint={"uri": "s3://AKIAEXAMPLE:wJalr-secret@bucket/ckpt", "pvc": None})
    assert "runtime checkpoint.uri=" in str(exc.value) and "must not carry credentials" in str(exc.value)
    assert "wJalr-secret" not in str(exc.value)


# --- issue 28.5: ncclEnv is an allow-list of NCCL settings; no library, plugin or file paths ---------


@pytest.mark.parametrize("name, value", [
    ("NCCL_NET_PLUGIN", "/shared/evil/libnccl-net.so"),  # NCCL dlopens it: the reproduction of issue 28
    ("NCCL_TUNER_PLUGIN", "/tmp/libtuner.so"),
    ("NCCL_PROFILER_PLUGIN", "evil"),
    ("NCCL_DEBUG_FILE", "/checkpoints/other-team/log.%h"),
    ("NCCL_TOPO_FILE", "/etc/shadow"),
    ("NCCL_GRAPH_DUMP_FILE", "/checkpoints/x"),
    ("NCCL_CONF_FILE", "/checkpoints/nccl.conf"),
    ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/checkpoints/x"),
])
def test_nccl_env_refuses_plugin_and_file_settings(name, value):
    with pytest.raises(RuntimeConfigError) as exc:
        _runtime(ncclEnv={"NCCL_DEBUG": "WARN", name: value})
    assert f"runtime ncclEnv.{name}=" in str(exc.value) and "ncclEnv takes collective-library settings only" in str(exc.value)


@pytest.mark.parametrize("name, value", [("NCCL_DEBUG", "LOUD"), ("NCCL_SOCKET_IFNAME", "/lib/x.so"),
                                         ("NCCL_IB_HCA", "mlx5 ; rm"), ("NCCL_BUFFSIZE", "big"),
                                         ("TORCH_DISTRIBUTED_DEBUG", "EVERYTHING"), ("NCCL_IB_DISABLE", "yes")])
def test_nccl_env_values_are_validated_naming_the_setting(name, value):
    with pytest.raises(RuntimeConfigError) as exc:
        _runtime(ncclEnv={name: value})
    assert f"runtime ncclEnv.{name}={value!r}: accepted values match" in str(exc.value)


def test_nccl_env_accepts_common_tuning():
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_SOCKET_IFNAME": "^docker,lo", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1",
           "NCCL_IB_DISABLE": "1", "NCCL_BUFFSIZE": "8388608", "NCCL_P2P_LEVEL": "NVL", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert _runtime(ncclEnv=env).nccl_env == env


def test_a_run_id_starting_with_a_slash_reaches_the_pods_as_it_is():
    """Identities are not paths: a run id `/nightly/...` (a deployment's allowed_run_id_pattern may allow
    it) was refused as "a path on the Airflow worker", failing the try as a user error."""
    spec = _worker_spec(env={"GANGFLOW_DAG_ID": "train_pipeline", "GANGFLOW_DAG_RUN_ID": "/nightly/2026-12-08",
                             "MLFLOW_RUN_ID": "0123abcd"})
    for container in _containers(build_gang(spec, _runtime()).body):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["GANGFLOW_DAG_RUN_ID"] == "/nightly/2026-12-08"
