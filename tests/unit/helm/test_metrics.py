"""The chart's Prometheus scrape configuration and Grafana dashboard (issue 26 item 1,
docs/observability.md): both validated (core schemas; the scrape configuration by Debian's
`promtool check config`, `make prometheus-deps`); the relabelling keeps rank 0's pod only and names
its job uid; the dashboard queries only series gangflow exports; the NetworkPolicy admits Prometheus."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from operators.kubernetes.builders import METRICS_PORT_ANNOTATION
from trainer.prometheus import GangMetrics

PROMTOOL = shutil.which("promtool")


def _one(objects, name):
    found = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    assert len(found) == 1, [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"]
    return found[0]


def scrape_configs(objects) -> list[dict]:
    return yaml.safe_load(_one(objects, "gangflow-scrape-config")["data"]["scrape-configs.yaml"])


def test_the_scrape_configuration_is_valid_for_prometheus(render, validate, tmp_path):
    objects = render({"kueue": {"teams": [{"name": "vision", "namespace": "team-vision"}, {"name": "nlp", "namespace": "team-nlp"}]}})
    cm = _one(objects, "gangflow-scrape-config")
    validate(cm)
    configs = scrape_configs(objects)
    assert [c["job_name"] for c in configs] == ["gangflow-gangs"]
    assert configs[0]["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["team-vision", "team-nlp"]
    if PROMTOOL is None:
        pytest.fail("Debian's promtool (package prometheus) is not installed: run `make prometheus-deps`")
    # Debian builds Prometheus without Kubernetes discovery: promtool checks the rest (relabel
    # regexes, label names, durations) with the discovery swapped for a static target, and the
    # discovery block is checked against Prometheus' documented fields here.
    (sd,) = configs[0]["kubernetes_sd_configs"]
    assert set(sd) == {"role", "namespaces", "selectors"} and sd["role"] == "pod" and set(sd["namespaces"]) == {"names"}
    assert sd["selectors"] == [{"role": "pod", "label": "app.kubernetes.io/name=gangflow,app.kubernetes.io/component=training"}]
    checked = [{**{k: v for k, v in c.items() if k != "kubernetes_sd_configs"}, "static_configs": [{"targets": ["127.0.0.1:9400"]}]}
               for c in configs]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": checked}))
    done = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _relabel(configs: list[dict], meta: dict[str, str]) -> dict[str, str] | None:
    """Prometheus' keep/replace relabelling (RE2, anchored) of one discovered target."""
    labels = dict(meta)
    for rule in configs:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            if not match:
                return None
        elif match:
            replaced = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
            if replaced:
                labels[rule["target_label"]] = replaced
            else:
                labels.pop(rule["target_label"], None)
    return {k: v for k, v in labels.items() if not k.startswith("__meta_")}


def test_only_rank_zeros_pod_is_scraped_at_its_metrics_port_with_the_job_uid(render):
    rules = scrape_configs(render())[0]["relabel_configs"]
    pod = {"__address__": "10.0.0.7:29500", "__meta_kubernetes_pod_ip": "10.0.0.7", "__meta_kubernetes_namespace": "gangflow-system",
           "__meta_kubernetes_pod_name": "train-pipeline-0-node-0-0-abcde",
           f"__meta_kubernetes_pod_annotation_{re.sub(r'[^a-z0-9]', '_', METRICS_PORT_ANNOTATION)}": "9400",
           "__meta_kubernetes_pod_label_batch_kubernetes_io_controller_uid": "job-uid",
           "__meta_kubernetes_pod_label_jobset_sigs_k8s_io_jobset_uid": "jobset-uid"}
    rank0 = _relabel(rules, {**pod, "__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index": "0"})
    assert rank0 == {"__address__": "10.0.0.7:9400", "job_uid": "jobset-uid", "namespace": "gangflow-system",
                     "pod": "train-pipeline-0-node-0-0-abcde"}
    assert _relabel(rules, {**pod, "__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index": "1"}) is None
    volcano = {k: v for k, v in pod.items() if "jobset" not in k} | {"__meta_kubernetes_pod_annotation_volcano_sh_task_index": "0"}
    assert _relabel(rules, volcano)["job_uid"] == "job-uid"
    unannotated = {k: v for k, v in pod.items() if "metrics_port" not in k}
    assert _relabel(rules, {**unannotated, "__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index": "0"}) is None


def test_the_dashboard_is_a_sidecar_configmap_querying_gangflow_series(render, validate):
    cm = _one(render(), "gangflow-dashboard")
    validate(cm)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "gangflow-system"
    dashboard = json.loads(cm["data"]["gangflow-gangs.json"])
    assert dashboard["uid"] == "gangflow-gangs"
    assert "mlflow_run_id" in [v["name"] for v in dashboard["templating"]["list"]]
    exported = {m.name for m in GangMetrics({}).registry.collect()}
    exported |= {f"{m.name}_{suffix}" for m in GangMetrics({}).registry.collect() for suffix in ("bucket", "total", "sum", "count")}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bgangflow_[a-z_]+", expr)}
    assert used and used <= exported, used - exported
    assert all('mlflow_run_id=~"$mlflow_run_id"' in expr for expr in exprs)
    for figure in ("gangflow_loss", "gangflow_step_seconds", "gangflow_checkpoint_save_seconds_bucket",
                   "gangflow_rank_exit_code", "gangflow_failure", "gangflow_queue_wait_seconds"):
        assert figure in used, figure


def test_prometheus_may_reach_the_metrics_port_and_nothing_is_rendered_when_off(render):
    [policy] = [o for o in render() if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "gangflow-training"]
    metrics_rules = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 9400}]]
    assert metrics_rules and metrics_rules[0]["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    off = render({"training": {"metricsPort": 0}, "metrics": {"dashboard": {"enabled": False}}})
    assert not [o for o in off if o["metadata"]["name"] in ("gangflow-scrape-config", "gangflow-dashboard")]
    [policy] = [o for o in off if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "gangflow-training"]
    assert all(r["ports"] != [{"protocol": "TCP", "port": 9400}] for r in policy["spec"]["ingress"])
