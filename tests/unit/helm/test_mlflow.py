"""The MLflow tracking server: argv, Secret references, probes and pod hardening."""

from __future__ import annotations

import pytest

PVC = {"mlflow": {"artifacts": {"type": "pvc"}}}


def mlflow_pod(objects):
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment, deployment["spec"]["template"]["spec"]


def env_of(container):
    return {e["name"]: e for e in container["env"]}


def test_server_argv_uses_secret_backend_store_and_proxied_s3_artifacts(render):
    _, pod = mlflow_pod(render())
    (container,) = pod["containers"]
    assert container["command"] == ["mlflow"]
    args = container["args"]
    assert args[0] == "server"
    assert "--backend-store-uri=$(MLFLOW_BACKEND_STORE_URI)" in args
    assert "--serve-artifacts" in args
    assert "--artifacts-destination=s3://gangflow-mlflow/artifacts" in args
    assert "--host=0.0.0.0" in args and "--port=5000" in args
    env = env_of(container)
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"] == {
        "secretKeyRef": {"name": "gangflow-mlflow-backend", "key": "uri"}}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "gangflow-mlflow-s3"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "AWS_SECRET_ACCESS_KEY"
    # No credential is ever a literal value.
    for name in ("MLFLOW_BACKEND_STORE_URI", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name]


def test_the_server_runs_no_job_runner(render):
    """MLflow 3's job runner (seven huey consumers, for GenAI jobs) is off: tracking and artifacts need none."""
    _, pod = mlflow_pod(render())
    assert env_of(pod["containers"][0])["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == {
        "name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "false"}
    wanted = {"mlflow": {"extraEnv": [{"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "true"}]}}
    _, pod = mlflow_pod(render(wanted))
    env = [e for e in pod["containers"][0]["env"] if e["name"] == "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]
    assert env == [{"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "true"}]  # the user's, once


def test_allowed_hosts_cover_the_service_names(render):
    _, pod = mlflow_pod(render({"mlflow": {"allowedHosts": ["mlflow.example.com"]}}))
    (arg,) = [a for a in pod["containers"][0]["args"] if a.startswith("--allowed-hosts=")]
    hosts = arg.split("=", 1)[1].split(",")
    for host in ("gangflow-mlflow", "gangflow-mlflow.gangflow-system.svc.cluster.local:5000", "localhost",
                 "mlflow.example.com"):
        assert host in hosts


def test_pvc_artifact_store(render):
    objects = render(PVC)
    deployment, pod = mlflow_pod(objects)
    (container,) = pod["containers"]
    assert "--artifacts-destination=/mlartifacts" in container["args"]
    assert {"name": "artifacts", "mountPath": "/mlartifacts"} in container["volumeMounts"]
    assert {"name": "artifacts", "persistentVolumeClaim": {"claimName": "gangflow-mlflow-artifacts"}} in pod["volumes"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "AWS_ACCESS_KEY_ID" not in env_of(container)
    pvcs = [o for o in objects if o["kind"] == "PersistentVolumeClaim"
            and o["metadata"]["name"] == "gangflow-mlflow-artifacts"]
    assert len(pvcs) == 1 and pvcs[0]["metadata"]["namespace"] == "gangflow-system"


def test_minio_endpoint_and_workload_identity(render):
    values = {"mlflow": {"artifacts": {"s3": {"endpointUrl": "http://minio:9000", "credentialsSecretName": ""}}}}
    _, pod = mlflow_pod(render(values))
    env = env_of(pod["containers"][0])
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == "http://minio:9000"
    assert "AWS_ACCESS_KEY_ID" not in env


@pytest.mark.parametrize("values", [{}, PVC], ids=["s3", "pvc"])
def test_pod_is_hardened(render, values):
    _, pod = mlflow_pod(render(values))
    assert pod["automountServiceAccountToken"] is False
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0 and psc["runAsGroup"] != 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    for container in pod["containers"] + pod.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc.get("runAsUser", psc["runAsUser"]) != 0
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["privileged"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert "@sha256:" in container["image"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    assert all("hostPath" not in v for v in pod["volumes"])


def test_probes_hit_health(render):
    _, pod = mlflow_pod(render())
    (container,) = pod["containers"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/health" and http["port"] == "http"
        assert {"name": "Host", "value": "localhost"} in http["httpHeaders"]


def test_service_selects_the_server_pods(render, kinds):
    objects = render()
    (service,) = kinds(objects, "Service")
    deployment, _ = mlflow_pod(objects)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"] == [{"name": "http", "port": 5000, "targetPort": "http", "protocol": "TCP"}]
