"""Pods of training code of one's own (issue 22 item 1): `-m trainer.user ... TARGET`, the package
roots below the image's /app, every object valid against the vendored schemas."""

from __future__ import annotations

import json

import pytest

from operators.backends.base import GangSpec

VERSION = "5d41402abc4b2a76b9719d911017c592"


def _k8s_spec(**extra) -> GangSpec:
    return GangSpec(name="train-digits-cnn-1", run_dir="/worker/run", world_size=2, config_path="pipelines/trainer/digits-cnn.yaml",
                    dataset_version=VERSION, user_code=("--module", "digits_cnn.train", "--", "--epochs", "3"),
                    package_roots=("examples",), **extra)


@pytest.mark.parametrize("kind", [{"scheduler": "kueue", "api": "jobset"}, {"scheduler": "volcano", "api": "jobset"},
                                  {"scheduler": "kueue", "api": "trainjob"}])
def test_pods_run_trainer_user_with_the_package_roots_below_app_and_validate(kind, crd_registry):
    from operators.kubernetes.builders import build_gang
    from operators.kubernetes.runtime import RuntimeDefaults, example_runtime_mapping, merge_runtime
    from operators.kubernetes.validation import validate_object

    runtime = RuntimeDefaults.from_mapping(merge_runtime(example_runtime_mapping(), kind))
    plan = build_gang(_k8s_spec(), runtime, "ns")
    gang = [obj for obj in plan.objects() if obj["kind"] in ("JobSet", "Job", "TrainJob")]
    assert gang
    for obj in plan.objects():
        validate_object(obj, crd_registry)
    text = json.dumps(gang)
    obj = gang[0]
    holders = ([obj["spec"]["trainer"]] if obj["kind"] == "TrainJob" else
               [c for rj in obj["spec"]["replicatedJobs"] for c in rj["template"]["spec"]["template"]["spec"]["containers"]]
               if obj["kind"] == "JobSet" else [c for t in obj["spec"]["tasks"] for c in t["template"]["spec"]["containers"]])
    for holder in holders:
        args = holder.get("args") or holder.get("command")
        at = args.index("trainer.user")
        assert args[at - 1] == "-m" and args[-5:] == ["--module", "digits_cnn.train", "--", "--epochs", "3"]
        assert f"--set" in args and f"data.version={VERSION}" in args  # the data arguments precede the target
        env = {e["name"]: e.get("value") for e in holder["env"]}
        assert env["PYTHONPATH"] == "/app/examples"
    assert "/worker/" not in text  # contract 6: no path of the worker's disk
