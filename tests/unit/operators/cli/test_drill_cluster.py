"""The drill's emulated cluster (Kueue, Job controller, kubelet) on the API test double, with tiny
Python containers instead of the trainer: seconds, not minutes."""

from __future__ import annotations

import base64
import json
import sys
import time
import uuid

import pytest

from operators.kubernetes import status as st
from operators.cli.drill.api_double import InMemoryKubernetesApi
from operators.cli.drill.cluster import JS, KQ, EmulatedCluster, processes_with_marker
from operators.cli.drill.image import Image

NS = "ml"
# index 0 writes its error record and fails with 3; index 1 would run for a minute
SCRIPT = """
import json, os, sys, tempfile, time
index = sys.argv[1]
print("rank", index, "token", os.environ["TOKEN"], "home", os.environ["HOME"], "cwd", os.getcwd(), "temp", tempfile.gettempdir(), flush=True)
if index == "0":
    time.sleep(1.5)
    with open(os.environ["GANGFLOW_TERMINATION_LOG"], "w") as fh:
        json.dump({"type": "ValueError", "message": "bad value"}, fh)
    sys.exit(3)
time.sleep(60)
"""


def jobset(name: str, script: str = SCRIPT, completions: int = 2) -> dict:
    container = {
        "name": "trainer",
        "image": "example.com/t@sha256:" + "0" * 64,
        "command": ["python", "-c", script],
        "args": ["$(JOB_COMPLETION_INDEX)"],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "GANGFLOW_TERMINATION_LOG", "value": "/dev/termination-log"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        ],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"limits": {"cpu": "1"}},
    }
    pod_spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}]}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NS, "labels": {"kueue.x-k8s.io/queue-name": "q", "gangflow.io/gang": name, "gangflow.io/attempt": "1"}},
        "spec": {
            "suspend": True,
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "replicatedJobs": [{"name": "rank", "replicas": 1, "template": {
                "metadata": {"labels": {"gangflow.io/gang": name, "gangflow.io/attempt": "1"}},
                "spec": {"completions": completions, "parallelism": completions, "completionMode": "Indexed", "backoffLimit": 0,
                         "template": {"metadata": {"labels": {"gangflow.io/gang": name, "gangflow.io/attempt": "1"}}, "spec": pod_spec}}}}],
        },
    }  # fmt: skip


def start_cluster(tmp_path, prefix: str = "test-drill", **options) -> tuple[InMemoryKubernetesApi, EmulatedCluster]:
    """An API double holding the pods' Secret, and an emulated cluster on it (`options`: its own)."""
    api = InMemoryKubernetesApi().start()
    api.put("", "secrets", {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds", "namespace": NS}, "data": {"token": base64.b64encode(b"s3cr3t").decode()}})
    image = Image(env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"}, mounts={})
    emu = EmulatedCluster(api, workdir=tmp_path / "pods", image=image, audit_dir=tmp_path / "audit", drill_id=f"{prefix}-{uuid.uuid4().hex[:8]}",
                          period=0.05, **options).start()
    return api, emu


@pytest.fixture
def cluster(tmp_path):
    api, emu = start_cluster(tmp_path)
    yield api, emu
    emu.stop(grace=1)
    api.stop()
    assert processes_with_marker(emu.drill_id + "/") == []  # its own pods only: other tests may run clusters meanwhile


def wait(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def pods(api):
    return sorted(api.items("", "pods", NS), key=lambda p: p["metadata"]["name"])


def test_admission_pods_from_processes_failure_and_teardown(cluster):
    api, emu = cluster
    api.put(*JS, jobset("g-t1"))
    wait(lambda: len(pods(api)) == 2 and all(st.pod_view(p).ready for p in pods(api)))
    # Kueue admitted and unsuspended; the Workload points at the JobSet
    js = api.get(*JS, NS, "g-t1")
    assert js["spec"]["suspend"] is False
    workload = api.items(*KQ)[0]
    assert workload["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] == js["metadata"]["uid"]
    assert st.workload_state(workload).admitted
    # the indexed pods: index annotation, JOB_COMPLETION_INDEX expanded in args, Secret resolved
    runs = sorted(emu.history, key=lambda r: r.name)
    assert [r.rendered_argv[-1] for r in runs] == ["0", "1"]
    assert all(r.rendered_env["TOKEN"] == "s3cr3t" for r in runs)
    assert [st.pod_rank(p) for p in pods(api)] == [0, 1]
    # index 0 fails with its termination message; the Job fails; index 1 is deleted and killed
    wait(lambda: st.gang_state("JobSet", api.get(*JS, NS, "g-t1")).state == "failed")
    # index 0's pod (index 1, deleted and killed, may fail too on a loaded machine before it is gone)
    failed = wait(lambda: [p for p in pods(api) if p["status"]["phase"] == "Failed" and st.pod_rank(p) == 0])
    evidence = st.pod_evidence(failed[0])
    assert evidence["exit_code"] == 3 and evidence["termination_reason"] == "Error" and evidence["rank"] == 0
    assert evidence["error_file"] == {"type": "ValueError", "message": "bad value"}
    wait(lambda: len(pods(api)) == 1)  # the deleted pod is gone once its process ended
    wait(lambda: processes_with_marker(emu.drill_id + "/") == [])  # and its process reaped
    log = api.logs[(NS, failed[0]["metadata"]["name"])]
    run0 = runs[0]
    # its own empty /tmp as HOME, cwd and the temp folder of tempfile (torchrun's error files go there)
    assert f"home {run0.dir / 'tmp'} cwd {run0.dir / 'tmp'} temp {run0.dir / 'tmp'}" in log
    # teardown of the gang object removes the rest
    api.handle("DELETE", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/g-t1", None)
    assert pods(api) == [] and api.items(*KQ) == []


def test_success_and_fallback_message_and_signal_exit_code(cluster):
    api, emu = cluster
    api.put(*JS, jobset("ok-t1", script="import sys; print('fine', sys.argv[1])"))
    wait(lambda: st.gang_state("JobSet", api.get(*JS, NS, "ok-t1")).state == "succeeded")
    assert {p["status"]["phase"] for p in pods(api)} == {"Succeeded"}
    api.handle("DELETE", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/ok-t1", None)
    # killed by a signal, nothing in the termination file: exit 128+9 and the log's tail as message
    api.put(*JS, jobset("kill-t1", script="import os, signal; print('about to die', flush=True); os.kill(os.getpid(), signal.SIGKILL)", completions=1))
    failed = wait(lambda: [p for p in pods(api) if p["status"]["phase"] == "Failed"])
    term = failed[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 137 and "about to die" in term["message"]
    assert st.pod_evidence(failed[0])["signal"] == 9


def test_missing_secret_is_create_container_config_error(cluster):
    api, emu = cluster
    api.remove("", "secrets", NS, "creds")
    api.put(*JS, jobset("nosecret-t1", completions=1))
    pod = wait(lambda: [p for p in pods(api) if (p["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("waiting")])[0]
    view = st.pod_view(pod)
    assert view.waiting_reason == "CreateContainerConfigError" and 'secret "creds" not found' in view.waiting_message
    assert json.dumps(emu.history[0].argv) == "[]"  # nothing was started


# a rank that stops on SIGTERM as the trainer does: exit 75 after its "final checkpoint"
TERM_SCRIPT = """
import signal, sys, time
def stop(*_):
    print("final checkpoint, exiting 75", flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
print("running", sys.argv[1], flush=True)
time.sleep(60)
"""


def test_the_preempt_event_evicts_the_running_gang_and_admits_only_a_new_one(tmp_path):
    from operators.cli.drill.cluster import parse_drill_event
    from operators.failures.preemption import preemption_reason

    committed = {"step": None}
    api, emu = start_cluster(tmp_path, "test-preempt", event=parse_drill_event("preempt@step=30"), committed_step=lambda: committed["step"])
    try:
        api.put(*JS, jobset("p-t1", script=TERM_SCRIPT))
        wait(lambda: len(pods(api)) == 2 and all(st.pod_view(p).ready for p in pods(api)))
        committed["step"] = 20
        time.sleep(0.6)
        assert not emu.event.fired
        committed["step"] = 30
        wait(lambda: emu.event.fired)
        workload = api.items(*KQ)[0]
        evicted = st.workload_state(workload).evicted
        assert evicted["reason"] == "Preempted"
        assert preemption_reason({"pod_conditions": [evicted], "ranks": []}).startswith("Kueue evicted the Workload (Preempted)")
        assert api.get(*JS, NS, "p-t1")["spec"]["suspend"] is True
        wait(lambda: pods(api) == [])  # SIGTERM, exit 75, then gone
        assert sorted(r.exit_code for r in emu.history) == [75, 75]
        time.sleep(0.5)
        assert api.get(*JS, NS, "p-t1")["spec"]["suspend"] is True  # the evicted JobSet is not admitted again
        api.handle("DELETE", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/p-t1", None)
        api.put(*JS, jobset("p-t1", script=TERM_SCRIPT))  # the task re-submits it: admitted
        wait(lambda: len(pods(api)) == 2 and all(st.pod_view(p).ready for p in pods(api)))
        assert sum("Kueue admitted JobSet" in e for e in emu.events) == 2
    finally:
        emu.stop(grace=1)
        api.stop()
    assert processes_with_marker(emu.drill_id + "/") == []


@pytest.mark.parametrize("text", ["preempt", "preempt@step=0", "pause@time=3", "evict@step=30"])
def test_a_bad_drill_event_is_refused_naming_the_variable(text):
    from operators.cli.drill.cluster import parse_drill_event

    with pytest.raises(ValueError, match=r"GANGFLOW_DRILL_EVENT=.*accepted values: preempt@step=N, pause@step=N, lose-worker@step=N .* or no-quota"):
        parse_drill_event(text)


@pytest.mark.parametrize("event,multikueue,message", [
    ("lose-worker@step=30", 0, "lose-worker needs --multikueue N"),
    ("pause@step=30", 2, "with --multikueue the drill's event is lose-worker@step=N"),
])  # fmt: skip
def test_an_event_the_drill_layout_cannot_play_is_refused(event, multikueue, message):
    from operators.cli.drill.cluster import parse_drill_event
    from operators.cli.drill.run import Drill, DrillError

    with pytest.raises(DrillError, match=message):
        Drill(event=parse_drill_event(event), multikueue=multikueue)
    with pytest.raises(DrillError, match="needs 2 or more worker clusters"):
        Drill(multikueue=1)


def test_the_drill_events_it_knows():
    from operators.cli.drill.cluster import parse_drill_event

    assert (parse_drill_event("pause@step=30").action, parse_drill_event("pause@step=30").step) == ("pause", 30)
    assert parse_drill_event(" preempt@step=10 ").spec == "preempt@step=10" and parse_drill_event("") is None


def test_a_pod_past_its_active_deadline_is_stopped_and_failed_deadline_exceeded_as_the_kubelet_does(cluster):
    """issue 25.3: the drill enforces the activeDeadlineSeconds the builders render (training.max_run_time_seconds)."""
    from operators.failures import classify

    api, emu = cluster
    gang = jobset("late-t1", script=TERM_SCRIPT, completions=1)
    pod_spec = gang["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod_spec["activeDeadlineSeconds"] = 1
    api.put(*JS, gang)
    failed = wait(lambda: [p for p in pods(api) if p["status"]["phase"] == "Failed"])
    assert failed[0]["status"]["reason"] == "DeadlineExceeded"
    assert failed[0]["status"]["message"] == "Pod was active on the node longer than the specified deadline"
    assert emu.history[0].exit_code == 75  # SIGTERM first: the rank's final checkpoint
    assert "final checkpoint, exiting 75" in api.logs[(NS, failed[0]["metadata"]["name"])]
    wait(lambda: st.gang_state("JobSet", api.get(*JS, NS, "late-t1")).state == "failed")
    verdict = classify({"ranks": [st.pod_evidence(failed[0])]}, precedents=False)
    assert verdict.kind == "user" and "DeadlineExceeded" in verdict.reason, verdict


# TERM_SCRIPT's rank, its final checkpoint taking 2 s; a second SIGTERM (torchrun's agent raises
# SignalException out of its wait for the rank) ends it unsaved
SLOW_TERM_SCRIPT = TERM_SCRIPT.replace("def stop(*_):\n", """def stop(*_):
    signal.signal(signal.SIGTERM, lambda *_: (print("interrupted before its checkpoint", flush=True), sys.exit(1)))
    time.sleep(2)
""")


def test_stopping_the_drill_leaves_a_deleted_pod_the_rest_of_its_grace_period(tmp_path):
    """A TrainJob past its deadline fails (and the DAG run ends) while its pods still commit:
    the drill's end signals them no second time and waits out their grace, as a kubelet would."""
    api, emu = start_cluster(tmp_path, "test-grace")
    try:
        gang = jobset("slow-t1", script=SLOW_TERM_SCRIPT, completions=1)
        gang["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
        api.put(*JS, gang)
        wait(lambda: any("running" in api.logs.get((NS, pod["metadata"]["name"]), "") for pod in pods(api)))
        api.handle("DELETE", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/slow-t1", None)
        wait(lambda: any("deleted: SIGTERM" in e for e in emu.events))
    finally:
        emu.stop(grace=0.2)
        api.stop()
    log = emu.history[0].log_path.read_text()
    assert "final checkpoint, exiting 75" in log and "interrupted" not in log, log
    assert processes_with_marker(emu.drill_id + "/") == []


# a container that answers its readiness probe 503 until a file `ready` exists in its /tmp (its cwd), then 200
PROBED_SCRIPT = """
import http.server, os, sys
flag, port = "ready", int(sys.argv[2])
class Probe(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if os.path.exists(flag) else 503)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Probe).serve_forever()
"""


def probed_jobset(name: str, probe: dict) -> dict:
    from operators.utils.ports import free_port

    gang = jobset(name, script=PROBED_SCRIPT, completions=1)
    container = gang["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    container["args"] = ["$(JOB_COMPLETION_INDEX)", str(port)]
    container["ports"] = [{"name": "health", "containerPort": port}]
    container["readinessProbe"] = probe
    return gang


def test_a_pod_is_ready_only_once_its_readiness_probe_passes_and_not_ready_when_it_fails_again(cluster):
    """The kubelet runs a container's httpGet readinessProbe (KubeRay injects one into every Ray
    node): Running is not Ready until it answers 2xx, and failureThreshold misses make it not Ready."""
    api, emu = cluster
    probe = {"httpGet": {"path": "/healthz", "port": "health"}, "periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 2}
    api.put(*JS, probed_jobset("probed-t1", probe))
    (pod,) = wait(lambda: [p for p in pods(api) if p["status"]["phase"] == "Running"])
    flag = emu.history[0].dir / "tmp" / "ready"
    time.sleep(2.5)  # two probe periods answered 503
    (pod,) = pods(api)
    view = st.pod_view(pod)
    assert pod["status"]["phase"] == "Running" and not view.ready
    ready = {c["type"]: c for c in pod["status"]["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ContainersNotReady"
    assert pod["status"]["containerStatuses"][0]["ready"] is False
    flag.touch()
    wait(lambda: st.pod_view(pods(api)[0]).ready, timeout=10)
    assert pods(api)[0]["status"]["containerStatuses"][0]["ready"] is True
    flag.unlink()
    wait(lambda: not st.pod_view(pods(api)[0]).ready, timeout=10)
    assert any("not Ready (readiness probe): Readiness probe failed: HTTP probe failed with statuscode: 503" in e for e in emu.events)
    # the kubelet's Unhealthy event, as `kubectl describe pod` and gangflow's start-up timeout read it
    (event,) = [e for e in api.items("", "events", NS) if e["involvedObject"]["name"] == pod["metadata"]["name"]]
    assert event["reason"] == "Unhealthy" and event["type"] == "Warning" and event["count"] >= 2  # the misses that made it not Ready
    assert event["message"] == "Readiness probe failed: HTTP probe failed with statuscode: 503"


def test_a_readiness_probe_the_drill_cannot_run_is_refused_naming_it(cluster):
    api, emu = cluster
    api.put(*JS, probed_jobset("exec-t1", {"exec": {"command": ["cat", "/tmp/ready"]}}))
    (pod,) = wait(lambda: [p for p in pods(api) if p["status"].get("containerStatuses")])
    waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError"
    assert waiting["message"] == "readinessProbe: the drill's kubelet runs httpGet and tcpSocket probes, not exec"
