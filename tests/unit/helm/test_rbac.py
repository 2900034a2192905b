"""RBAC for the Airflow workers: namespace-scoped, least privilege, no wildcards; the only
cluster-scoped grant is `get` on the chart's own ClusterQueue."""

from __future__ import annotations

import pytest

READ = {"get", "list", "watch"}
SUBMIT = READ | {"create", "delete"}

BASE = {
    ("jobset.x-k8s.io", "jobsets"): SUBMIT,
    ("batch", "jobs"): READ,
    ("", "pods"): READ,
    ("", "pods/log"): {"get"},
    ("", "services"): READ,
    ("", "events"): READ,
    ("events.k8s.io", "events"): READ,
    ("", "configmaps"): {"get"},
}
KUEUE = {("kueue.x-k8s.io", "workloads"): READ, ("kueue.x-k8s.io", "localqueues"): {"get"}}
VOLCANO = {("batch.volcano.sh", "jobs"): SUBMIT, ("scheduling.volcano.sh", "podgroups"): READ}
TRAINJOB = {("trainer.kubeflow.org", "trainjobs"): SUBMIT}


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def all_rules(objects):
    return [rule for o in objects if o["kind"] in ("Role", "ClusterRole") for rule in o["rules"]]


@pytest.mark.parametrize("values, expected", [
    ({}, BASE | KUEUE),
    ({"kueue": {"enabled": False}, "volcano": {"enabled": True}}, BASE | VOLCANO),
    ({"trainjob": {"enabled": True}}, BASE | KUEUE | TRAINJOB),
    ({"kueue": {"enabled": False}, "volcano": {"enabled": True}, "trainjob": {"enabled": True}},
     BASE | VOLCANO | TRAINJOB),
], ids=["kueue", "volcano", "kueue+trainjob", "volcano+trainjob"])
def test_worker_role_grants_exactly_the_contract(render, kinds, values, expected):
    (role,) = kinds(render(values), "Role")
    assert grants(role) == expected


@pytest.mark.parametrize("values", [{}, {"kueue": {"enabled": False}, "volcano": {"enabled": True},
                                         "trainjob": {"enabled": True}}])
def test_no_wildcards_anywhere(render, values):
    for rule in all_rules(render(values)):
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert not any("*" in item for item in rule.get(field, [])), rule
        assert "nonResourceURLs" not in rule


def test_localqueue_read_is_limited_to_the_teams_queue_and_follows_the_toggle(render, kinds):
    teams = [{"name": "vision", "namespace": "team-vision"}]
    (role,) = kinds(render({"kueue": {"teams": teams}}), "Role")
    (rule,) = [r for r in role["rules"] if "localqueues" in r["resources"]]
    assert rule["resourceNames"] == ["vision"] and rule["verbs"] == ["get"]
    (role,) = kinds(render({"rbac": {"clusterQueueReader": {"enabled": False}}}), "Role")
    assert ("kueue.x-k8s.io", "localqueues") not in grants(role)


def test_configmap_access_is_limited_to_the_runtime_configmap(render, kinds):
    (role,) = kinds(render({"runtime": {"configMapName": "team-defaults"}}), "Role")
    (rule,) = [r for r in role["rules"] if "configmaps" in r["resources"]]
    assert rule["resourceNames"] == ["team-defaults"] and rule["verbs"] == ["get"]


def test_no_access_to_secrets_or_escalation(render):
    for rule in all_rules(render({"trainjob": {"enabled": True}})):
        assert not {"secrets", "roles", "rolebindings", "clusterroles", "serviceaccounts/token",
                    "pods/exec", "pods/attach", "nodes"} & set(rule["resources"])
        assert not {"update", "patch", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_role_is_bound_to_the_airflow_worker_service_account_in_each_team(render, kinds):
    values = {"airflow": {"namespace": "orchestration", "serviceAccountName": "workers"},
              "kueue": {"teams": [{"name": "a", "namespace": "team-a"}, {"name": "b", "namespace": "team-b"}]}}
    objects = render(values)
    bindings = kinds(objects, "RoleBinding")
    assert {b["metadata"]["namespace"] for b in bindings} == {"team-a", "team-b"}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in kinds(objects, "Role")}
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert (binding["metadata"]["namespace"], binding["roleRef"]["name"]) in roles
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "workers", "namespace": "orchestration"},
                                       {"kind": "ServiceAccount", "name": "gangflow-airflow-triggerer", "namespace": "orchestration"}]


def test_only_cluster_wide_grant_is_get_on_the_charts_clusterqueue(render, kinds):
    objects = render({"kueue": {"clusterQueue": {"name": "gpu-queue"}}})
    (cluster_role,) = kinds(objects, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["clusterqueues"],
                                      "resourceNames": ["gpu-queue"], "verbs": ["get"]}]
    (binding,) = kinds(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": cluster_role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gangflow-airflow-worker", "namespace": "airflow"},
                                   {"kind": "ServiceAccount", "name": "gangflow-airflow-triggerer", "namespace": "airflow"}]


def test_training_service_account_mounts_no_token(render, kinds):
    (sa,) = [s for s in kinds(render(), "ServiceAccount") if s["metadata"]["name"] == "gangflow-training"]
    assert sa["automountServiceAccountToken"] is False
    # No Role is bound to the training ServiceAccount.
    for binding in kinds(render(), "RoleBinding") + kinds(render(), "ClusterRoleBinding"):
        assert all(s["name"] != "gangflow-training" for s in binding["subjects"])
