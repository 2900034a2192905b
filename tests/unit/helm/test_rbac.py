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


# --- issue 28.5: gangs run apart from the platform's Secrets; the docs' can-i table is the rendered RBAC -


import re  # noqa: E402
from pathlib import Path  # noqa: E402

import helm_python  # noqa: E402

RELEASE_NAMESPACE = "gangflow-system"  # conftest's NAMESPACE
HELM_MD = Path(__file__).resolve().parents[3] / "docs" / "helm.md"


def test_default_gangs_run_outside_the_namespaces_that_hold_the_platforms_secrets(render, kinds):
    """Issue 28: with the default layout, team gangs ran in the release namespace, beside MLflow's
    backend and S3 Secrets, which a JobSet's pod can mount by secretKeyRef."""
    objects = render()
    teams = {r["metadata"]["namespace"] for r in kinds(objects, "Role")}
    assert teams and RELEASE_NAMESPACE not in teams and "airflow" not in teams
    runtime = [o for o in kinds(objects, "ConfigMap") if o["metadata"]["name"] == "gangflow-runtime"]
    assert {o["metadata"]["namespace"] for o in runtime} == teams


@pytest.mark.parametrize("teams, where", [([{"name": "core", "namespace": ""}], "release namespace"),
                                          ([{"name": "core", "namespace": RELEASE_NAMESPACE}], "release namespace"),
                                          ([{"name": "core", "namespace": "airflow"}], "Airflow namespace")])
def test_a_team_namespace_that_holds_the_platforms_secrets_is_refused(render, teams, where):
    with pytest.raises(helm_python.HelmRenderError) as err:
        render({"kueue": {"teams": teams}})
    assert "kueue.teams" in str(err.value) and where in str(err.value)


@pytest.mark.parametrize("namespace, where", [("kueue-system", "Kueue's namespace"), ("kube-system", "system namespace"),
                                              ("volcano-system", "system namespace")])
def test_a_team_in_a_namespace_of_the_clusters_own_controllers_is_refused(render, namespace, where):
    """Kueue's namespace holds MultiKueue's kubeconfig Secrets (every worker cluster's credentials):
    a team there could mount them, or run a pod as Kueue's controller."""
    on = {"kueue": {"teams": [{"name": "core", "namespace": namespace}], "multiKueue": {
        "enabled": True, "clusters": [{"name": "w1", "kubeconfigSecret": "w1-kubeconfig"}]}}}
    with pytest.raises(helm_python.HelmRenderError) as err:
        render(on)
    assert "kueue.teams" in str(err.value) and where in str(err.value)


def test_a_team_in_the_release_namespace_is_told_how_to_label_it(notes):
    """The chart never creates (or labels) the release namespace: with createNamespaces on, a team
    there got the workers' Role and neither the labels nor the command that sets them."""
    text = notes({"mlflow": {"enabled": False}, "podSecurity": {"createNamespaces": True},
                  "kueue": {"teams": [{"name": "vision", "namespace": "team-vision"}, {"name": "core"}]}})
    assert f"kubectl label namespace {RELEASE_NAMESPACE} --overwrite pod-security.kubernetes.io/enforce=restricted" in text
    assert "kubectl label namespace team-vision" not in text  # the chart labels the ones it creates


def _binding_rules(objects, kinds, who: tuple[str, str], namespace: str) -> list[dict]:
    """The rules the ServiceAccount `who` (namespace, name) holds in `namespace`, from the rendered
    RoleBindings (to Roles of that namespace) and ClusterRoleBindings, as the API server reads them."""
    subject = {"kind": "ServiceAccount", "namespace": who[0], "name": who[1]}
    roles = {(o["metadata"].get("namespace"), o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    rules = []
    for binding in kinds(objects, "RoleBinding") + kinds(objects, "ClusterRoleBinding"):
        bound_ns = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        if subject not in binding.get("subjects", []) or (bound_ns is not None and bound_ns != namespace):
            continue
        ref = binding["roleRef"]
        role = roles.get((bound_ns if ref["kind"] == "Role" else None, ref["kind"], ref["name"]))
        rules += role["rules"] if role else []
    return rules


def can_i(objects, kinds, who, verb: str, target: str, namespace: str) -> bool:
    """`kubectl auth can-i VERB TARGET -n NAMESPACE --as=system:serviceaccount:WHO` on the rendered
    objects. TARGET as kubectl takes it: resource[.group][/name] [--subresource=SUB] (with a name,
    resourceNames rules count)."""
    target, _, sub = target.partition(" --subresource=")
    target, _, name = target.partition("/")
    resource, _, group = target.partition(".")
    full = f"{resource}/{sub}" if sub else resource
    for rule in _binding_rules(objects, kinds, who, namespace):
        if group in rule["apiGroups"] and full in rule["resources"] and verb in rule["verbs"]:
            names = rule.get("resourceNames")
            if not names or name in names:
                return True
    return False


def _doc_table() -> tuple[list[str], list[tuple[str, str, str, list[str]]]]:
    text = HELM_MD.read_text()
    block = text.split("<!-- can-i table: checked by tests/unit/helm/test_rbac.py -->", 1)[1].strip().split("\n\n", 1)[0]
    lines = [line.strip().strip("|").split("|") for line in block.splitlines()]
    header = [c.strip().strip("`") for c in lines[0]]
    rows = []
    for cells in lines[2:]:
        cells = [c.strip() for c in cells]
        who, verb, target = cells[0].strip("`"), *cells[1].strip("`").split(" ", 1)
        rows.append((who, verb, target, [c.strip("*") for c in cells[2:]]))
    return header, rows


def test_the_docs_can_i_table_is_what_the_rendered_rbac_allows(render, kinds):
    """docs/helm.md's `kubectl auth can-i` table, rendered with its own values (teams team-vision and
    team-nlp, Airflow in `airflow`, the release in gangflow-system), answer by answer."""
    objects = render({"kueue": {"teams": [{"name": "vision", "namespace": "team-vision"}, {"name": "nlp", "namespace": "team-nlp"}]}})
    header, rows = _doc_table()
    namespaces = header[2:]
    assert namespaces == ["team-vision", "gangflow-system", "airflow"], header
    assert len(rows) >= 10
    identities = {"airflow worker": ("airflow", "gangflow-airflow-worker"), "training pod": ("team-vision", "gangflow-training")}
    for who, verb, target, answers in rows:
        for namespace, answer in zip(namespaces, answers):
            got = "yes" if can_i(objects, kinds, identities[who], verb, target, namespace) else "no"
            assert got == answer, f"can-i {verb} {target} -n {namespace} as {who}: the doc says {answer}, the chart gives {got}"
    denied = {(v, t) for who, v, t, a in rows if who == "airflow worker" and a[0] == "no"}
    assert {("get", "secrets"), ("list", "secrets"), ("create", "pods"), ("create", "pods --subresource=exec")} <= denied


RAYJOB = {("ray.io", "rayjobs"): SUBMIT}
MPIJOB = {("kubeflow.org", "mpijobs"): SUBMIT}


@pytest.mark.parametrize("api, extra", [("rayjob", RAYJOB), ("mpijob", MPIJOB)])
def test_rayjobs_and_mpijobs_are_granted_only_when_training_api_selects_them(render, kinds, api, extra):
    (role,) = kinds(render({"training": {"api": api, "resources": {"gpu": 0}}}), "Role")
    assert grants(role) == BASE | KUEUE | extra
    (role,) = kinds(render({}), "Role")
    assert not {("ray.io", "rayjobs"), ("kubeflow.org", "mpijobs")} & set(grants(role))


@pytest.mark.parametrize("api", ["rayjob", "mpijob"])
def test_rayjob_and_mpijob_with_volcano_are_refused_naming_both(render, api):
    with pytest.raises(Exception, match=f"training.api={api} needs Kueue; with volcano.enabled"):
        render({"training": {"api": api}, "kueue": {"enabled": False}, "volcano": {"enabled": True}})
