"""Rank 0 of a pod serves its Prometheus metrics (issue 26 item 1): the rendered pods carry the port,
the annotation the chart's scrape configuration keeps and GANGFLOW_METRICS_PORT; metricsPort 0 is
off; a port that is the rendezvous port is refused naming the field."""

from __future__ import annotations

import pytest

from operators.cli.render import render_documents
from operators.kubernetes.runtime import RuntimeConfigError, RuntimeDefaults, example_runtime_mapping, merge_runtime

VERSION = "5d41402abc4b2a76b9719d911017c592"


def _pod(runtime: dict | None = None) -> dict:
    [jobset] = [o for o in render_documents(dataset_version=VERSION, runtime=runtime) if o["kind"] == "JobSet"]
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def test_pods_serve_metrics_on_the_runtime_port():
    pod = _pod()
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GANGFLOW_METRICS_PORT"] == "9400" and env["GANGFLOW_GANG"]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    assert pod["metadata"]["annotations"]["gangflow.io/metrics-port"] == "9400"


def test_metrics_port_zero_is_off():
    pod = _pod(merge_runtime(example_runtime_mapping(), {"metricsPort": 0}))
    [container] = pod["spec"]["containers"]
    assert "GANGFLOW_METRICS_PORT" not in {e["name"] for e in container["env"]}
    assert [p["name"] for p in container["ports"]] == ["c10d"]
    assert "gangflow.io/metrics-port" not in (pod["metadata"].get("annotations") or {})


@pytest.mark.parametrize("port", [29500, 80, 70000])
def test_a_bad_metrics_port_is_refused_naming_the_field(port):
    with pytest.raises(RuntimeConfigError, match="metricsPort"):
        RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), {"metricsPort": port}))
