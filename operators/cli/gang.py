"""Pause and resume a running gang from outside its DAG (docs/kubernetes.md, "Pause and resume").

    python -m operators.cli.gang pause GANG --namespace NS [--reason TEXT] [--kubeconfig FILE | --conn-id ID]
    python -m operators.cli.gang resume GANG --namespace NS [--wait-seconds 600] [...]
    python -m operators.cli.gang pause|resume GANG --local [--reason TEXT]

GANG is the gang's name (the label `gangflow.io/gang`). Pause annotates the gang object and
deactivates its Kueue Workload (or suspends the object without Kueue): the ranks commit a final
checkpoint and stop, the training task waits. Resume activates it again, waits for the paused pods
to be gone and removes the annotation. `--local`: a gang of backend local, paused through its task
(`operators.backends.local_control`). The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from operators.exceptions import GangControlError
from operators.hooks.kubernetes import KUEUE_GROUP, KUEUE_VERSIONS

# (group, version, plural, kind) of the gang objects a pause applies to
GANG_KINDS = (
    ("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet"),
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"),
    ("ray.io", "v1", "rayjobs", "RayJob"),
    ("kubeflow.org", "v2beta1", "mpijobs", "MPIJob"),
)
# granted by the chart only when training.api selects them: a 403 there means "not this gang's kind"
_GRANTED_BY_API = ("RayJob", "MPIJob")


async def _running_gang(api, gang: str) -> tuple[tuple[str, str, str, str], dict[str, Any]]:
    from operators.exceptions import KubernetesRequestError
    from operators.kubernetes.builders import GANG_LABEL
    from operators.kubernetes.status import gang_state

    found = []
    for kind in GANG_KINDS:
        try:
            found += [(kind, obj) for obj in await api.list_custom(*kind, f"{GANG_LABEL}={gang}")]
        except KubernetesRequestError as exc:
            status = getattr(exc, "status", None)
            if status != 404 and not (status == 403 and kind[3] in _GRANTED_BY_API):  # not installed / not granted
                raise
    live = [(kind, obj) for kind, obj in found
            if gang_state(kind[3], obj).state not in ("succeeded", "failed") and not (obj.get("metadata") or {}).get("deletionTimestamp")]
    if not live:
        raise GangControlError(f"gang {gang!r}: no running JobSet, TrainJob, RayJob or MPIJob labelled {GANG_LABEL}={gang} in namespace {api.namespace}"
                               + (f" ({len(found)} finished)" if found else ""))  # fmt: skip
    return max(live, key=lambda item: int((item[1]["metadata"].get("labels") or {}).get("gangflow.io/attempt", 0)))


async def set_paused(api, gang: str, paused: bool, *, reason: str = "", wait_seconds: float = 600, poll: float = 1.0) -> dict[str, Any]:
    """Pause (or resume) the running object of `gang`; what was done, as a JSON-able dict."""
    from operators.kubernetes.builders import ATTEMPT_LABEL, GANG_LABEL, PAUSED_ANNOTATION, PAUSES_ANNOTATION, pause_count
    from operators.kubernetes.status import timestamp

    (group, version, plural, kind), obj = await _running_gang(api, gang)
    meta = obj["metadata"]
    name, uid, annotations = meta["name"], meta.get("uid", ""), meta.get("annotations") or {}
    workloads = await api.list_workloads(uid) if uid else []
    stamp = timestamp()
    if paused:  # the annotations first: the watch must know it is a pause before it sees the eviction
        if PAUSED_ANNOTATION in annotations:
            raise GangControlError(f"gang {gang!r}: {kind} {name} is already paused ({annotations[PAUSED_ANNOTATION]})")
        note = f"paused at {stamp}" + (f": {reason}" if reason else "")
        await api.patch_custom(group, version, plural, kind, name, {"metadata": {"annotations": {
            PAUSED_ANNOTATION: note, PAUSES_ANNOTATION: str(pause_count(annotations) + 1)}}})
    elif PAUSED_ANNOTATION not in annotations:
        raise GangControlError(f"gang {gang!r}: {kind} {name} is not paused")
    for wl in workloads:
        wl_version = wl.get("apiVersion", "").split("/")[-1] or KUEUE_VERSIONS[0]
        await api.patch_custom(KUEUE_GROUP, wl_version, "workloads", "Workload", wl["metadata"]["name"], {"spec": {"active": not paused}})
    if not workloads:  # not managed by Kueue: suspend the object itself (its controller deletes and recreates the pods)
        # an MPIJob keeps its suspend under runPolicy (kubeflow's RunPolicy); the others at spec.suspend
        patch = {"runPolicy": {"suspend": paused}} if kind == "MPIJob" else {"suspend": paused}
        await api.patch_custom(group, version, plural, kind, name, {"spec": patch})
    if not paused:
        # the annotation last, once the paused pods are gone: a pod stopped by the pause must never
        # look like a failed rank of the resumed gang
        selector = f"{GANG_LABEL}={gang},{ATTEMPT_LABEL}={(meta.get('labels') or {}).get(ATTEMPT_LABEL, '1')}"
        deadline = time.monotonic() + wait_seconds
        while stopping := [p for p in await api.list_pods(selector) if (p.get("metadata") or {}).get("deletionTimestamp")]:
            if time.monotonic() > deadline:
                raise GangControlError(f"gang {gang!r}: {len(stopping)} paused pod(s) still terminating after {wait_seconds:.0f} s "
                                       f"(e.g. {stopping[0]['metadata']['name']}); the Workload is active again, run resume again")  # fmt: skip
            await asyncio.sleep(poll)
        await api.patch_custom(group, version, plural, kind, name, {"metadata": {"annotations": {PAUSED_ANNOTATION: None}}})
    return {"gang": gang, "kind": kind, "name": name, "namespace": api.namespace, "paused": paused,
            "workloads": [wl["metadata"]["name"] for wl in workloads], "time": stamp}  # fmt: skip


async def _control(args: argparse.Namespace, kubeconfig: dict[str, Any] | None) -> dict[str, Any]:
    from operators.hooks.kubernetes import GangApi, open_api

    paused = args.action == "pause"
    if kubeconfig is None:  # the Airflow connection, as the training task uses it
        async with open_api(args.conn_id, args.namespace) as api:
            return await set_paused(api, args.gang, paused, reason=args.reason, wait_seconds=args.wait_seconds)
    from kubernetes_asyncio.config import new_client_from_config_dict

    async with await new_client_from_config_dict(kubeconfig) as client:
        return await set_paused(GangApi(client, args.namespace), args.gang, paused, reason=args.reason, wait_seconds=args.wait_seconds)


def main(argv: list[str] | None = None) -> int:
    code, result = control(argv)
    print(json.dumps(result), flush=True)
    return code


def control(argv: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    """The command without its printing: (exit code, the JSON object it prints)."""

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("pause", "resume"))
    parser.add_argument("gang", help="the gang's name (label gangflow.io/gang)")
    parser.add_argument("--namespace", help="the gang's namespace (the runtime's): a Kubernetes gang")
    parser.add_argument("--local", action="store_true",
                        help="a gang of backend local on this machine (run with the Airflow worker's GANGFLOW_HOME)")
    parser.add_argument("--reason", default="", help="why (pause only): kept in the annotation and the task log")
    parser.add_argument("--conn-id", default="kubernetes_default", help="the Airflow Kubernetes connection to use (default kubernetes_default)")
    parser.add_argument("--kubeconfig", help="a kubeconfig file instead of the Airflow connection")
    parser.add_argument("--wait-seconds", type=float, default=600,
                        help="resume: how long to wait for the paused pods to be gone (default 600)")
    args = parser.parse_args(argv)
    if not args.wait_seconds > 0:
        parser.error(f"--wait-seconds {args.wait_seconds}: must be > 0")
    if args.local == bool(args.namespace):
        parser.error("say where the gang runs: --namespace NS (a Kubernetes gang) or --local (backend local), one of them")
    from operators.exceptions import GangflowError

    if args.local:
        from operators.backends import local_control

        try:
            return 0, (local_control.pause(args.gang, args.reason) if args.action == "pause" else local_control.resume(args.gang))
        except GangflowError as exc:
            return 1, {"gang": args.gang, "action": args.action, "error": str(exc)}
    kubeconfig = None
    if args.kubeconfig:
        import yaml

        try:
            with open(args.kubeconfig) as fh:
                kubeconfig = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError) as exc:
            parser.error(f"--kubeconfig {args.kubeconfig}: {exc}")
        if not isinstance(kubeconfig, dict):
            parser.error(f"--kubeconfig {args.kubeconfig}: not a kubeconfig (a YAML mapping)")
    try:
        return 0, asyncio.run(_control(args, kubeconfig))
    except GangflowError as exc:
        return 1, {"gang": args.gang, "action": args.action, "error": str(exc)}


if __name__ == "__main__":
    sys.exit(main())
