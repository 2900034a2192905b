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

from gangflow_tests_k8s_support import CONN_ID, NAMESPACE, Fixtures  # loaded by conftest.py

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
