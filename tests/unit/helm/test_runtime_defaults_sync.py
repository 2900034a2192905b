"""One source of runtime defaults (issue 9 item 9): the runtime.yaml the chart renders from its
default values must mean exactly `RuntimeDefaults`' own defaults, except the keys that name objects
the chart itself creates (image, namespace, ServiceAccount, queue, PriorityClasses, checkpoint PVC,
its MLflow Service). A default changed on one side only fails here."""

from __future__ import annotations

import dataclasses

import yaml

from operators.kubernetes.runtime import Checkpoint, RuntimeDefaults, default_runtime_mapping

# Fields whose chart value names something the chart creates or derives, not a default.
CHART_OWNED = {
    "image", "namespace", "service_account_name", "queue", "priority_class_name",
    "workload_priority_class", "checkpoint", "mlflow_tracking_uri",
}


def _chart_runtime(render) -> dict:
    (cm,) = [o for o in render() if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gangflow-runtime"]
    return yaml.safe_load(cm["data"]["runtime.yaml"])


def test_chart_defaults_are_runtime_defaults(render):
    chart = RuntimeDefaults.from_mapping(_chart_runtime(render))
    code = RuntimeDefaults(image=chart.image, checkpoint=Checkpoint(pvc="x"))
    drift = {
        f.name: (getattr(chart, f.name), getattr(code, f.name))
        for f in dataclasses.fields(RuntimeDefaults)
        if f.name not in CHART_OWNED and getattr(chart, f.name) != getattr(code, f.name)
    }
    assert drift == {}, f"chart values.yaml (left) and RuntimeDefaults (right) disagree: {drift}"
    assert chart.checkpoint.mount_path == code.checkpoint.mount_path


def test_values_yaml_training_section_matches(project_root):
    """The same check on values.yaml itself, key by key (what users read and override)."""
    training = yaml.safe_load((project_root / "helm" / "gangflow" / "values.yaml").read_text())["training"]
    defaults = default_runtime_mapping()
    for key in ("shmSize", "ncclEnv", "nodeSelector", "tolerations", "terminationGracePeriodSeconds", "rendezvousPort",
                "admissionTimeoutSeconds", "startupTimeoutSeconds", "trainingRuntime", "runAsUser", "runAsGroup", "fsGroup", "api", "metricsPort"):
        assert training[key] == defaults[key], key
    assert {k: str(v) if k != "gpu" else v for k, v in training["resources"].items()} == defaults["resources"]
    assert (training["procsPerPod"] or None) == RuntimeDefaults.__dataclass_fields__["procs_per_pod"].default
    assert training["dataset"]["imageCarriesData"] == defaults["dataset"]["imageCarriesData"]
    assert training["checkpoint"]["mountPath"] == Checkpoint.__dataclass_fields__["mount_path"].default
