"""The watch's evidence of a failed RayJob: KubeRay's `AppFailed` message is Ray's job message,
which ends with the driver's output (the ranks' failures, the driver's result line); it is judged as
the local ray backend judges its driver, not on the message's first KiB nor on the Ray pods that
KubeRay shuts down with the RayCluster (the cluster drill found both: the same killed rank got
`node-gone` or a weak `user` precedent depending on where Ray's 20,000-character tail began)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from operators.failures import classify
from operators.kubernetes.watch import gather_evidence

from gangflow_tests_k8s_support import CONN_ID, NAMESPACE, Fixtures, merged_again  # loaded by conftest.py

# the real RayJob message of the cluster drill's first try (rank 1 SIGKILLed at step 30)
MESSAGE = (Path(__file__).with_name("fixtures") / "rayjob_appfailed_kill_rank_1.txt").read_text()


def _rayjob_evidence(fx, message: str) -> dict:
    from operators.hooks.kubernetes import open_api

    rayjob = {"kind": "RayJob", "metadata": {"name": fx.name}, "spec": {},
              "status": {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed", "message": message}}  # fmt: skip
    handle = {"kind": "RayJob", "name": fx.name, "namespace": NAMESPACE, "pod_selector": f"gangflow.io/gang={fx.gang}"}

    async def gather():
        async with open_api(CONN_ID, NAMESPACE) as gang_api:
            return await gather_evidence(gang_api, handle, obj=rayjob)

    return asyncio.run(gather())


def test_a_failed_rayjob_is_judged_on_the_drivers_output_in_its_message(fake_k8s):
    assert "crashed unexpectedly" not in MESSAGE[:1024]  # the part of a condition's message the classifier reads
    evidence = _rayjob_evidence(Fixtures(), MESSAGE)
    assert evidence["rank"] == 1 and evidence["pod_conditions"][0]["reason"] == "AppFailed"
    verdict = classify(evidence)
    assert (verdict.kind, verdict.rule) == ("infra", "node-gone") and "rank 1" in verdict.reason, verdict.reason


def test_a_rayjob_message_without_the_drivers_output_keeps_the_gang_level_evidence(fake_k8s):
    evidence = _rayjob_evidence(Fixtures(), "The RayJob has passed the activeDeadlineSeconds. StartTime: x. ActiveDeadlineSeconds: 60")
    assert "rank" not in evidence and evidence["pod_reason"] == "AppFailed"


def test_the_killed_ranks_verdict_survives_the_merge_of_the_triggers_snapshot_with_fresh_evidence(fake_k8s):
    """The training task merges the trigger's snapshot with what it gathers again: Ray's own order
    (the rank whose worker died first) stays, not the lowest rank (the drill said "at rank 0")."""
    snapshot = _rayjob_evidence(Fixtures(), MESSAGE)

    merged = merged_again(snapshot, "RayJob")
    assert merged["rank"] == 1, [r.get("rank") for r in merged["ranks"]]
    verdict = classify(merged)
    assert (verdict.kind, verdict.rule) == ("infra", "node-gone") and "rank 1" in verdict.reason, verdict.reason


def test_when_ray_reports_both_ranks_the_one_whose_worker_died_stays_first_through_the_merge():
    from operators.failures.evidence import ray_evidence

    failures = {"0": {"type": "RuntimeError", "message": "rank 0: the trainer exited with code 1",
                      "traceback": "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"},
                "1": {"type": "ray.exceptions.ActorDiedError", "message": "The actor died unexpectedly before finishing this task.",
                      "traceback": "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."}}  # fmt: skip
    snapshot = ray_evidence({"worker_failures": failures}, 1, "", {}, {})
    assert snapshot["rank"] == 1  # Ray's own order: the worker that died

    merged = merged_again(snapshot, "RayJob")
    assert merged["rank"] == 1 and [r["rank"] for r in merged["ranks"]] == [0, 1]
