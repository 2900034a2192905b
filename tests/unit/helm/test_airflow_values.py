"""helm/airflow-values.yaml (for the official Apache Airflow chart) uses keys that chart has, and
agrees with the gangflow chart on the ServiceAccount, the MLflow URI, the pool and the image."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

# Every key path airflow-values.yaml sets, each checked by hand against apache/airflow
# chart/values.yaml + chart/values.schema.json at 002e5532d7d55a375bbf71bd4e72d7e008635073.
# A new key goes here only after the same check.
OFFICIAL_CHART_KEYS = {
    "defaultAirflowRepository", "defaultAirflowTag", "airflowVersion",
    "images", "images.airflow", "images.airflow.repository", "images.airflow.tag", "images.airflow.digest",
    "images.airflow.pullPolicy",
    "executor",
    "postgresql", "postgresql.enabled",
    "data", "data.metadataSecretName",
    "dags", "dags.persistence", "dags.persistence.enabled",
    "dags.gitSync", "dags.gitSync.enabled", "dags.gitSync.repo", "dags.gitSync.branch", "dags.gitSync.ref",
    "dags.gitSync.subPath", "dags.gitSync.depth", "dags.gitSync.period",
    "env",  # list of {name, value}
    "config", "config.core",  # free-form airflow.cfg sections
    "workers", "workers.serviceAccount", "workers.serviceAccount.create", "workers.serviceAccount.name",
    "workers.serviceAccount.automountServiceAccountToken", "workers.resources",
    "triggerer", "triggerer.serviceAccount", "triggerer.serviceAccount.create", "triggerer.serviceAccount.name",
    # checked against chart/values.yaml at 001394a91d3fb507eff58cc73ca8b3baa72e685e (every component's
    # serviceAccount has automountServiceAccountToken; airflowLocalSettings is a templated string)
    "triggerer.serviceAccount.automountServiceAccountToken", "airflowLocalSettings",
    "scheduler", "scheduler.extraInitContainers",  # list of Kubernetes Containers (templated)
    # chart/values.yaml: "Extra volumes for workers, including pod_template_file" (lists of Volumes/VolumeMounts)
    "workers.extraVolumes", "workers.extraVolumeMounts",
}
# Below these paths the official chart takes free-form content (airflow.cfg options, ResourceRequirements).
FREE_FORM = ("config.core.", "workers.resources.")


@pytest.fixture(scope="module")
def airflow_values(project_root):
    return yaml.safe_load((project_root / "helm" / "airflow-values.yaml").read_text())


def key_paths(mapping, prefix=""):
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from key_paths(value, f"{path}.")


def test_only_keys_of_the_official_chart(airflow_values):
    unknown = [p for p in key_paths(airflow_values) if p not in OFFICIAL_CHART_KEYS and not p.startswith(FREE_FORM)]
    assert unknown == []


def test_env_items_are_name_value_pairs(airflow_values):
    for item in airflow_values["env"]:
        assert set(item) == {"name", "value"} and isinstance(item["value"], str)


def test_image_is_airflow_3_3_pinned_by_digest(airflow_values):
    image = airflow_values["images"]["airflow"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", image["digest"])
    assert airflow_values["airflowVersion"] == "3.3.2"
    assert image["repository"] == airflow_values["defaultAirflowRepository"]


def test_workers_and_triggerer_use_the_service_accounts_the_chart_binds(airflow_values, chart):
    chart_values = chart.values["airflow"]
    workers = airflow_values["workers"]["serviceAccount"]
    triggerer = airflow_values["triggerer"]["serviceAccount"]
    assert workers["create"] is True and workers["name"] == chart_values["serviceAccountName"]
    assert triggerer["create"] is True and triggerer["name"] == chart_values["triggererServiceAccountName"]
    assert airflow_values["executor"] in ("KubernetesExecutor", "CeleryExecutor")


def test_only_the_gang_task_pod_and_the_triggerer_get_an_api_token(airflow_values):
    """Task pods run without a Kubernetes token; the pod mutation hook gives it to the task that
    submits the gang alone (issue 12 item 9)."""
    from kubernetes.client import V1ObjectMeta, V1Pod, V1PodSpec

    assert airflow_values["workers"]["serviceAccount"]["automountServiceAccountToken"] is False
    assert airflow_values["triggerer"]["serviceAccount"]["automountServiceAccountToken"] is True
    settings: dict = {}
    exec(compile(airflow_values["airflowLocalSettings"], "airflow_local_settings.py", "exec"), settings)  # noqa: S102 - our own file

    def task_pod(task_id):
        pod = V1Pod(metadata=V1ObjectMeta(annotations={"dag_id": "train_pipeline", "task_id": task_id}), spec=V1PodSpec(containers=[]))
        settings["pod_mutation_hook"](pod)
        return pod.spec.automount_service_account_token

    assert task_pod("train_kubernetes") is True
    for task_id in ("validate_dataset", "train_local_2", "evaluate", "promote", "admit_gang"):
        assert task_pod(task_id) is None  # the ServiceAccount's false applies
    bare = V1Pod(metadata=None, spec=V1PodSpec(containers=[]))
    settings["pod_mutation_hook"](bare)
    assert bare.spec.automount_service_account_token is None


def test_the_gang_task_id_is_the_dags(airflow_values, project_root):
    """The hook names the pipeline's Kubernetes gang task; a rename in the DAG must follow here."""
    from operators.training import gang_task_id

    assert gang_task_id(backend="kubernetes", world_size=2, local_world_sizes=(1, 2)) == "train_kubernetes"
    assert 'task_id=f"train_{backend}"' in (project_root / "dags" / "train_pipeline.py").read_text()


def test_mlflow_uri_is_the_gangflow_charts_service(airflow_values, render):
    (env,) = [e for e in airflow_values["env"] if e["name"] == "MLFLOW_TRACKING_URI"]
    runtime_maps = [o for o in render() if o["kind"] == "ConfigMap" and "runtime.yaml" in o["data"]]
    runtime = yaml.safe_load(runtime_maps[0]["data"]["runtime.yaml"])
    assert env["value"] == runtime["mlflowTrackingUri"]


def test_scheduler_init_container_creates_the_training_pool(airflow_values, validate):
    (init,) = airflow_values["scheduler"]["extraInitContainers"]
    assert init["command"] == ["airflow"]
    assert init["args"][:3] == ["pools", "set", "gangflow_training"]
    assert int(init["args"][3]) >= 1
    (conn,) = init["env"]
    assert conn["name"] == "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
    assert conn["valueFrom"]["secretKeyRef"] == {"name": airflow_values["data"]["metadataSecretName"],
                                                 "key": "connection"}
    assert init["image"] == "{{ .Values.images.airflow.repository }}@{{ .Values.images.airflow.digest }}"
    # The container (its template rendered) is a valid Kubernetes Container.
    container = copy.deepcopy(init)
    images = airflow_values["images"]["airflow"]
    container["image"] = f"{images['repository']}@{images['digest']}"
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "scheduler"},
              "spec": {"initContainers": [container], "containers": [{"name": "scheduler", "image": container["image"]}]}})


def test_every_task_pod_reads_the_same_registry_key_from_a_secret(airflow_values):
    """Models are signed by the training task and checked by evaluate/promote (docs/registry.md):
    every task pod mounts one Secret's key read-only and names it by GANGFLOW_REGISTRY_KEY_FILE."""
    env = {item["name"]: item["value"] for item in airflow_values["env"]}
    (volume,) = [v for v in airflow_values["workers"]["extraVolumes"] if v["name"] == "registry-key"]
    (mount,) = [m for m in airflow_values["workers"]["extraVolumeMounts"] if m["name"] == "registry-key"]
    assert volume["secret"]["secretName"] == "gangflow-registry-key" and mount["readOnly"] is True
    path = f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    assert env["GANGFLOW_REGISTRY_KEY_FILE"] == path
