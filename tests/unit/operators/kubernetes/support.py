"""Shared helpers of the Kubernetes backend tests: realistic object fixtures (JSON under
fixtures/, in the shapes the API server, Kueue, JobSet and Volcano write, with messages taken from
upstream sources) and the runtime defaults the tests install. Loaded by conftest.py as the module
`gangflow_tests_k8s_support`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"

NAMESPACE = "ml"
GANG = "train-demo"
CONN_ID = "kubernetes_test"


class Fixtures:
    """Realistic object JSON with the gang's names filled in."""

    def __init__(self, *, gang: str = GANG, attempt: int = 1, namespace: str = NAMESPACE, name: str | None = None, uid: str = "7f3c1c9e-5b2a-4c1e-9d3a-2f6b8e0a1c01"):
        self.gang = gang
        self.attempt = attempt
        self.namespace = namespace
        self.name = name or f"{gang}-t{attempt}"
        self.uid = uid

    def raw(self, filename: str) -> Any:
        return json.loads((FIXTURES / filename).read_text())

    def _fill(self, data: Any, **extra: str) -> Any:
        text = json.dumps(data)
        values = {"GANG": self.gang, "ATTEMPT": str(self.attempt), "NAMESPACE": self.namespace, "JOBSET": self.name, "UID": self.uid, **extra}
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", value)
        return json.loads(text)

    def pod(self, state: str, rank: int = 0, suffix: str | None = None) -> dict[str, Any]:
        return self._fill(self.raw(f"pod_{state}.json"), RANK=str(rank), SUFFIX=suffix or f"q{rank}x7k")

    def pod_name(self, rank: int = 0, suffix: str | None = None) -> str:
        return f"{self.name}-rank-0-{rank}-{suffix or f'q{rank}x7k'}"

    def workload(self, state: str) -> dict[str, Any]:
        return self._fill(self.raw(f"workload_{state}.json"))

    def events(self, state: str, pod: str) -> list[dict[str, Any]]:
        return self._fill(self.raw(f"events_{state}.json"), POD=pod)["items"]

    def jobset_status(self, state: str) -> dict[str, Any]:
        return self._fill(self.raw(f"jobset_status_{state}.json"))

    def volcano_status(self, state: str) -> dict[str, Any]:
        return self._fill(self.raw(f"volcano_status_{state}.json"))

    def podgroup(self, state: str) -> dict[str, Any]:
        return self._fill(self.raw(f"podgroup_{state}.json"))


RUNTIME = {
    "image": "registry.example.com/ml/gangflow-trainer@sha256:" + "ab" * 32,
    "namespace": NAMESPACE,
    "serviceAccountName": "gangflow-training",
    "scheduler": "kueue",
    "api": "jobset",
    "queue": "gangflow",
    "resources": {"cpu": "8", "memory": "64Gi", "gpu": 8},
    "shmSize": "8Gi",
    "ncclEnv": {"NCCL_DEBUG": "WARN"},
    "checkpoint": {"pvc": "gangflow-checkpoints", "mountPath": "/checkpoints"},
    "dataset": {"remote": "s3://gangflow-data/dvc", "credentialsSecret": "gangflow-object-storage"},
    "mlflowTrackingUri": "http://mlflow.ml.svc:5000",
    "admissionTimeoutSeconds": 3600,
    "startupTimeoutSeconds": 900,
}


def merged_again(snapshot: dict[str, Any], kind: str) -> dict[str, Any]:
    """What the training task makes of the trigger's evidence `snapshot` when it gathers the same
    evidence again (`KubernetesBackend._merge_evidence`, the gang object and its Workload read as empty)."""
    import asyncio

    from operators.backends.kubernetes import KubernetesBackend

    class Api:
        async def get_custom(self, *args):
            return {}

        async def list_workloads(self, uid):
            return []

    async def gather(api, handle, **kwargs):
        return dict(snapshot)

    handle = {"group": "g", "version": "v", "plural": "p", "kind": kind, "name": "x", "uid": "u"}
    return asyncio.run(KubernetesBackend(runtime_configmap=None)._merge_evidence(Api(), handle, snapshot, gather))
