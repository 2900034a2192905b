"""`make cluster-drill API=rayjob` (issue 24): the RayJob run as KubeRay would
(operators/cli/drill/ray_controller.py): a real Ray cluster (a head and two worker nodes, each
`ray start --block` in its pod), the submitter pod's real `ray job submit` to the head's dashboard,
Ray Train's gloo ranks on the worker nodes, checkpoints on the drill's PVC. One run with a killed
rank shows both paths (CI time): the first try's RayJob fails (AppFailed), the classified retry's
new RayCluster completes it, resumed from the committed checkpoint, and the model is promoted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from drill_runs import processes_touching, report_pods, run_drill, run_folder

from operators.cli.drill.run import RAY_TEMP_PREFIX, ray_temp_base

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rayjob_run(drill_home, tmp_path_factory) -> dict:
    def ray_temps() -> set[Path]:
        return set(ray_temp_base().glob(f"{RAY_TEMP_PREFIX}*"))

    before = ray_temps()  # a drill killed earlier may have left its own
    run = run_drill(drill_home, tmp_path_factory, "rayjob", api="rayjob", GANGFLOW_FAULT="kill@step=30,rank=1",
                    GANGFLOW_RETRY_BASE_DELAY="1")
    return run | {"ray_temp_left": sorted(ray_temps() - before)}


def test_rayjob_killed_rank_is_retried_once_on_a_new_ray_cluster_and_resumes(rayjob_run):
    summary, output = rayjob_run["summary"], rayjob_run["output"]
    assert rayjob_run["code"] == 0, output[-8000:]
    assert summary["state"] == "success" and summary["backend"] == "kubernetes" and summary["api"] == "rayjob"
    assert summary["train_attempts"] == 2 and summary["resumed_from_step"] == 30, summary
    assert summary["promoted"] and summary["accuracy"] > 0.5
    assert summary["checkpoint_uri"].startswith("/checkpoints/")  # the run dir on the PVC, as rendered
    events = rayjob_run["report"]["events"]
    assert any("Kueue admitted RayJob" in e and "-t1 " in e for e in events)
    failed = [e for e in events if "KubeRay: RayJob" in e and "-> Failed" in e]
    assert len(failed) == 1 and "-t1 " in failed[0] and "jobStatus FAILED (AppFailed" in failed[0], failed
    assert any("KubeRay: RayJob" in e and "-t2 Running -> Complete, jobStatus SUCCEEDED" in e for e in events)
    # the first try's failure: Ray's words about the killed worker, read as infra (retryable)
    verdicts = re.findall(r"gangflow: (\S+) failure \((retryable|not retryable)\)", output)
    assert verdicts == [("infra", "retryable")], verdicts
    verdict = json.loads((run_folder(rayjob_run) / "failures" / "try-1.json").read_text())["verdict"]
    # judged on the driver's output in KubeRay's message: Ray's words about the killed worker
    assert verdict["kind"] == "infra" and "the node died or was removed under the job at rank 1" in verdict["reason"], verdict
    assert processes_touching(rayjob_run["keep"]) == [] and rayjob_run["ray_temp_left"] == []
    assert rayjob_run["report"]["left_in_cluster"]["pods"] == [] and rayjob_run["report"]["left_in_cluster"]["rayjobs"] == []


def test_rayjob_pods_ran_kuberays_commands_as_rendered(rayjob_run):
    pods = report_pods(rayjob_run["report"])
    for attempt in ("-t1-", "-t2-"):
        tried = [p for p in pods if attempt in p["pod"]]
        heads = [p for p in tried if re.search(r"-head-\w{5}$", p["pod"])]
        workers = [p for p in tried if "-rank-worker-" in p["pod"]]
        submitters = [p for p in tried if p not in heads + workers]
        assert len(heads) == 1 and len(workers) == 2 and len(submitters) == 1, [p["pod"] for p in pods]
        (head,), (submitter,) = heads, submitters
        shell, script = head["rendered_argv"][:3], head["rendered_argv"][3]
        assert shell == ["/bin/bash", "-c", "--"] and script.startswith("ulimit -n 65536; ray start --head ") and "--num-cpus=0" in script
        for worker in workers:
            args = worker["rendered_argv"][3].split()
            assert "--num-cpus=1" in args and any(a.startswith("--address=") and ".svc.cluster.local:" in a for a in args)
            assert "--address=127.0.0.1:" in worker["argv"][3]  # the head Service's name is this machine
        assert submitter["rendered_argv"][:3] == ["/bin/bash", "-ce", "--"]
        submit = submitter["rendered_argv"][3]
        assert "ray job submit --address http://" in submit and " -- python -m operators.backends.ray " in submit
        assert "--run-dir /checkpoints/" in submit and "--run-dir /checkpoints/" not in submitter["argv"][3]  # the PVC, mapped
    no_state = [p for p in pods if any(str(rayjob_run["report"]["state_dir"]) in v for v in p["env"].values())]
    assert no_state == []
