"""Issue 25.4: kueue.multiKueue renders a MultiKueue manager setup (a MultiKueueCluster per worker, its
kubeconfig read from a Secret reference; a MultiKueueConfig listing them; the AdmissionCheck the
ClusterQueue requires), every object valid against the vendored Kueue CRDs; bad values are refused
with a message that names the value. The dispatch itself needs clusters and is not exercised here."""

from __future__ import annotations

import copy

import helm_python
import pytest

WORKERS = [
    {"name": "worker1", "kubeconfigSecret": "worker1-kubeconfig"},
    {"name": "gpu-east", "kubeconfigSecret": "multikueue.gpu-east"},
]
ON = {"kueue": {"multiKueue": {"enabled": True, "clusters": WORKERS}}}
MULTIKUEUE_KINDS = ("MultiKueueCluster", "MultiKueueConfig", "AdmissionCheck")


def with_multikueue(**overrides):
    values = copy.deepcopy(ON)
    values["kueue"]["multiKueue"].update(overrides)
    return values


@pytest.fixture(scope="module")
def objects(render):
    return render(ON)


def test_the_three_kinds_render_and_match_their_crds(objects, kinds, validate):
    assert len(kinds(objects, "MultiKueueCluster")) == len(WORKERS)
    assert len(kinds(objects, "MultiKueueConfig")) == 1
    assert len(kinds(objects, "AdmissionCheck")) == 1
    for obj in objects:
        if obj["kind"] in MULTIKUEUE_KINDS or obj["kind"] == "ClusterQueue":
            assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta2"
            validate(obj)  # the vendored CRD's openAPIV3Schema, unknown fields refused
    for obj in objects:  # and everything else the chart renders alongside
        validate(obj)


def test_the_clusterqueue_requires_the_admission_check(objects, kinds):
    (cq,) = kinds(objects, "ClusterQueue")
    (check,) = kinds(objects, "AdmissionCheck")
    assert cq["spec"]["admissionChecksStrategy"] == {"admissionChecks": [{"name": check["metadata"]["name"]}]}
    assert check["metadata"]["name"] == "gangflow-multikueue"


def test_the_admission_check_points_at_the_config(objects, kinds):
    (check,) = kinds(objects, "AdmissionCheck")
    (config,) = kinds(objects, "MultiKueueConfig")
    assert check["spec"] == {
        "controllerName": "kueue.x-k8s.io/multikueue",
        "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "MultiKueueConfig", "name": config["metadata"]["name"]},
    }


def test_the_config_lists_every_cluster_in_order(objects, kinds):
    (config,) = kinds(objects, "MultiKueueConfig")
    assert config["spec"] == {"clusters": [w["name"] for w in WORKERS]}
    assert [c["metadata"]["name"] for c in kinds(objects, "MultiKueueCluster")] == [w["name"] for w in WORKERS]


def test_each_cluster_reads_its_kubeconfig_from_the_secret_given(objects, kinds):
    clusters = {c["metadata"]["name"]: c for c in kinds(objects, "MultiKueueCluster")}
    for worker in WORKERS:
        assert clusters[worker["name"]]["spec"] == {
            "clusterSource": {"kubeConfig": {"locationType": "Secret", "location": worker["kubeconfigSecret"]}}}
        assert "namespace" not in clusters[worker["name"]]["metadata"]  # cluster-scoped


def test_the_chart_never_renders_the_kubeconfig_secrets(objects, notes):
    secrets = {w["kubeconfigSecret"] for w in WORKERS}
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] in secrets]
    text = notes(ON)
    for worker in WORKERS:
        assert (f"kubectl create secret generic {worker['kubeconfigSecret']} -n kueue-system "
                f"--from-file=kubeconfig=") in text


def test_a_dotted_clusterqueue_name_still_gives_a_label_for_the_config(render, kinds, validate):
    objects = render({"kueue": {"clusterQueue": {"name": "team.gpu"}, "multiKueue": ON["kueue"]["multiKueue"]}})
    (check,) = kinds(objects, "AdmissionCheck")
    assert check["spec"]["parameters"]["name"] == "team-gpu-multikueue"
    validate(check)


def test_off_by_default(render, kinds):
    objects = render()
    assert not [o for o in objects if o["kind"] in MULTIKUEUE_KINDS]
    (cq,) = kinds(objects, "ClusterQueue")
    assert "admissionChecksStrategy" not in cq["spec"]


REFUSED_BY_THE_TEMPLATES = [
    ({"kueue": {"enabled": False, "multiKueue": ON["kueue"]["multiKueue"]}, "volcano": {"enabled": True}},
     "kueue.multiKueue.enabled needs kueue.enabled=true"),
    (with_multikueue(clusters=[]),
     "kueue.multiKueue.enabled needs at least one entry in kueue.multiKueue.clusters"),
    (with_multikueue(clusters=[WORKERS[0], {"name": "worker1", "kubeconfigSecret": "other"}]),
     'kueue.multiKueue.clusters lists the name "worker1" twice'),
    (with_multikueue(clusters=[WORKERS[0], {"name": "worker2", "kubeconfigSecret": "worker1-kubeconfig"}]),
     'kubeconfigSecret "worker1-kubeconfig" is used by both "worker1" and "worker2"'),
]


@pytest.mark.parametrize("bad, message", REFUSED_BY_THE_TEMPLATES, ids=["no-kueue", "no-clusters", "duplicate-name", "shared-secret"])
def test_bad_combinations_fail_with_a_clear_message(render, bad, message):
    with pytest.raises(helm_python.HelmRenderError) as err:
        render(bad)
    assert message in str(err.value)


REFUSED_BY_THE_SCHEMA = [
    (with_multikueue(clusters=[{"kubeconfigSecret": "s"}]), "/kueue/multiKueue/clusters/0", "missing property 'name'"),
    (with_multikueue(clusters=[{"name": "worker1"}]), "/kueue/multiKueue/clusters/0", "missing property 'kubeconfigSecret'"),
    (with_multikueue(clusters=[{"name": "", "kubeconfigSecret": "s"}]), "/kueue/multiKueue/clusters/0/name", "minLength: got 0"),
    (with_multikueue(clusters=[{"name": "Worker_1", "kubeconfigSecret": "s"}]), "/kueue/multiKueue/clusters/0/name", "'Worker_1' does not match"),
    (with_multikueue(clusters=[{"name": "w.1", "kubeconfigSecret": "s"}]), "/kueue/multiKueue/clusters/0/name", "'w.1' does not match"),
    (with_multikueue(clusters=[{"name": "w", "kubeconfigSecret": "My Secret"}]),
     "/kueue/multiKueue/clusters/0/kubeconfigSecret", "'My Secret' does not match"),
    (with_multikueue(clusters=[{"name": "w", "kubeconfigSecret": "s", "kubeconfig": "apiVersion: v1"}]),
     "/kueue/multiKueue/clusters/0", "additional properties 'kubeconfig' not allowed"),
    (with_multikueue(clusters=[{"name": f"w{i}", "kubeconfigSecret": f"s{i}"} for i in range(21)]),
     "/kueue/multiKueue/clusters", "maxItems: got 21, want 20"),
    (with_multikueue(kueueNamespace="Kueue System"), "/kueue/multiKueue/kueueNamespace", "'Kueue System' does not match"),
]


@pytest.mark.parametrize("bad, where, problem", REFUSED_BY_THE_SCHEMA,
                         ids=["no-name", "no-secret", "empty-name", "not-dns-1123", "dotted-name", "bad-secret-name",
                              "inline-kubeconfig", "over-20", "bad-namespace"])
def test_the_schema_refuses_bad_clusters(chart, render, bad, where, problem):
    for attempt in (lambda: chart.validate_schema(bad), lambda: render(bad)):
        with pytest.raises(helm_python.HelmValuesError) as err:
            attempt()
        assert f"at '{where}': {problem}" in str(err.value)
