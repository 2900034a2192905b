"""The drill's emulation of the MPI Operator (v2): gangflow's MPIJob run on the emulated cluster with
a tiny rank program; the launcher's real `mpirun` reaches the worker pods through the drill's ssh
(operators/cli/drill/mpi_ssh.py), so each rank is a process of its worker pod."""

from __future__ import annotations

import sys
import time

import pytest

from operators.backends.base import GangSpec
from operators.cli.drill import mpi_ssh
from operators.cli.drill.api_double import InMemoryKubernetesApi
from operators.cli.drill.cluster import KQ, EmulatedCluster, processes_with_marker
from operators.cli.drill.image import Image
from operators.cli.drill.mpi_controller import MPIJOBS, MPIController, drill_launcher_env, hostfile
from operators.kubernetes import status as st
from operators.kubernetes.builders import build_gang
from operators.kubernetes.runtime import RuntimeDefaults, example_runtime_mapping, merge_runtime

# each rank says who it is, where it runs (its pod's marker) and where rank 0 listens
SCRIPT = ("import os, sys; r = os.environ['OMPI_COMM_WORLD_RANK']; print('RANK', r, os.environ['GANGFLOW_DRILL_POD'].rsplit('/', 1)[1], "
          "os.environ['MASTER_ADDR'], flush=True); sys.exit(int(os.environ.get('FAIL_RANK', '-1') == r) * 3)")  # fmt: skip


def gangflow_mpijob(world_size: int = 2) -> dict:
    """What gangflow's backend submits with api=mpijob (one slot a worker), its ranks running SCRIPT."""
    mapping = merge_runtime(example_runtime_mapping(), {"api": "mpijob", "resources": {"cpu": "1", "memory": "2Gi", "gpu": 0},
                                                           "checkpoint": {"pvc": None, "uri": "s3://bucket/checkpoints"}})  # fmt: skip
    spec = GangSpec(name="mpi-gang", run_dir="/tmp/worker-run", world_size=world_size, launcher="mpirun", dataset_version="5d41402abc4b2a76b9719d911017c592")
    body = build_gang(spec, RuntimeDefaults.from_mapping(mapping)).body
    (container,) = body["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    secret = {e["name"] for e in container["env"] if "valueFrom" in e}  # no Secrets in this API
    container["env"] = [e for e in container["env"] if e["name"] not in secret]
    argv = container["command"]
    rank_at = argv.index("python")
    options, i = [], 0
    while i < rank_at:  # `-x NAME` of a Secret's variable goes with it
        if argv[i] == "-x" and argv[i + 1] in secret:
            i += 2
            continue
        options.append(argv[i])
        i += 1
    container["command"] = [*options, "python", "-c", SCRIPT]
    for role in ("Launcher", "Worker"):
        (c,) = body["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]
        c["env"] = [e for e in c["env"] if "valueFrom" not in e]
    return body


def run_mpijob(tmp_path, drill_id: str, **launcher_env: str):
    api = InMemoryKubernetesApi().start()
    image = Image(env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"}, mounts={})
    agent = mpi_ssh.install(tmp_path / "mpi", image)
    controller = MPIController(api, launcher_env={**drill_launcher_env(agent), **launcher_env})
    emu = EmulatedCluster(api, workdir=tmp_path / "pods", image=image, audit_dir=tmp_path / "audit", drill_id=drill_id,
                          period=0.05, controllers=[controller]).start()  # fmt: skip
    mpijob = gangflow_mpijob()
    (container,) = mpijob["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    for name in launcher_env:  # the ranks get what mpirun forwards, nothing else of the launcher's
        container["command"][1:1] = ["-x", name]
    mpijob = api.put(*MPIJOBS, mpijob)
    return api, emu, mpijob


def wait_for(api, ns: str, name: str, state: str, timeout: float = 30) -> st.GangState:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and st.gang_state("MPIJob", api.get(*MPIJOBS, ns, name)).state != state:
        time.sleep(0.05)
    return st.gang_state("MPIJob", api.get(*MPIJOBS, ns, name))


def test_hostfile_is_mpi_operators():
    assert hostfile("j", "ns", 2, 3) == "j-worker-0.j.ns.svc slots=3\nj-worker-1.j.ns.svc slots=3\n"


def test_an_mpijob_runs_its_ranks_on_the_worker_pods(tmp_path):
    api, emu, mpijob = run_mpijob(tmp_path, "test-mpi-ok")
    name, ns, uid = mpijob["metadata"]["name"], mpijob["metadata"]["namespace"], mpijob["metadata"]["uid"]
    try:
        state = wait_for(api, ns, name, "succeeded")
        assert state.state == "succeeded" and state.reason == "MPIJobSucceeded", emu.events
        (workload,) = api.items(*KQ)
        assert workload["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] == uid
        assert [p["count"] for p in workload["spec"]["podSets"]] == [1, 2]
        assert api.get(*MPIJOBS, ns, name)["spec"]["runPolicy"]["suspend"] is False
        config = api.get("", "configmaps", ns, f"{name}-config")
        assert config["data"]["hostfile"] == hostfile(name, ns, 2, 1)
        runs = {run.name: run for run in emu.history}
        (launcher,) = [r for n, r in runs.items() if n.startswith(f"{name}-launcher-")]
        lines = sorted(line.split("<stdout>: ", 1)[1].strip() for line in launcher.log_lines if "RANK" in line)
        # rank i ran in worker pod i (one slot each), and reached rank 0's host as 127.0.0.1
        assert lines == [f"RANK 0 {name}-worker-0 127.0.0.1", f"RANK 1 {name}-worker-1 127.0.0.1"], "".join(launcher.log_lines)
        assert launcher.rendered_argv[0] == "mpirun" and launcher.rendered_env["OMPI_MCA_orte_default_hostfile"] == "/etc/mpi/hostfile"
        assert launcher.env["PRTE_MCA_prte_default_hostfile"] == str(launcher.dir / "volumes" / "mpi-job-config" / "hostfile")
        for index in range(2):
            assert (runs[f"{name}-worker-{index}"].dir / "ssh.log").read_text().count("/prted ") == 1  # one session: its daemon
        # cleanPodPolicy Running: the workers go once the launcher succeeded
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any("-worker-" in p["metadata"]["name"] for p in api.items("", "pods", ns)):
            time.sleep(0.05)
        assert not any("-worker-" in p["metadata"]["name"] for p in api.items("", "pods", ns)), emu.events
    finally:
        emu.stop(grace=1)
        api.stop()
    assert processes_with_marker("test-mpi-ok/") == []


def test_a_failed_rank_fails_the_mpijob_with_the_launcher_jobs_reason(tmp_path):
    api, emu, mpijob = run_mpijob(tmp_path, "test-mpi-fail", FAIL_RANK="1")
    name, ns = mpijob["metadata"]["name"], mpijob["metadata"]["namespace"]
    try:
        launcher = None
        state = wait_for(api, ns, name, "failed")
        assert state.state == "failed" and state.reason.startswith("BackoffLimitExceeded"), emu.events
        assert state.message.startswith("Job has reached the specified backoff limit")
        (launcher,) = [r for r in emu.history if r.name.startswith(f"{name}-launcher-")]
        assert launcher.exit_code not in (0, None)
    finally:
        emu.stop(grace=1)
        api.stop()
    assert processes_with_marker("test-mpi-fail/") == []


def test_without_prrtes_hostfile_name_mpirun_runs_every_rank_on_the_launcher_and_the_drill_says_so(tmp_path):
    """The MPI Operator's ORTE-era OMPI_MCA_orte_default_hostfile alone: Open MPI 5 ignores it
    (kubeflow/mpi-operator#842), the job "succeeds" with idle workers; the drill fails such a run."""
    from operators.cli.drill.run import mpi_placement_findings

    api = InMemoryKubernetesApi().start()
    image = Image(env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"}, mounts={})
    controller = MPIController(api, launcher_env=drill_launcher_env(mpi_ssh.install(tmp_path / "mpi", image)))
    emu = EmulatedCluster(api, workdir=tmp_path / "pods", image=image, audit_dir=tmp_path / "audit", drill_id="test-mpi-orte",
                          period=0.05, controllers=[controller]).start()  # fmt: skip
    mpijob = gangflow_mpijob()
    (container,) = mpijob["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    container["env"] = [e for e in container["env"] if e["name"] != "PRTE_MCA_prte_default_hostfile"]
    mpijob = api.put(*MPIJOBS, mpijob)
    name, ns = mpijob["metadata"]["name"], mpijob["metadata"]["namespace"]
    try:
        assert wait_for(api, ns, name, "succeeded").state == "succeeded", emu.events
        (launcher,) = [r for r in emu.history if r.name.startswith(f"{name}-launcher-")]
        assert sorted(line.split()[3] for line in launcher.log_lines if "RANK" in line) == [launcher.name] * 2
        (finding,) = mpi_placement_findings(list(emu.history))
        assert launcher.name in finding and "no rank on a worker pod" in finding
    finally:
        emu.stop(grace=1)
        api.stop()
    assert processes_with_marker("test-mpi-orte/") == []


@pytest.mark.parametrize("argv, expected", [
    (["-x", "-o", "ConnectionAttempts=10", "host.a", "prted", "--x"], ("host.a", ["prted", "--x"])),
    (["user@h", "sh", "-c", "true"], ("h", ["sh", "-c", "true"])),
])  # fmt: skip
def test_the_drills_ssh_reads_an_ssh_command_line(argv, expected):
    assert mpi_ssh.parse(argv) == expected
