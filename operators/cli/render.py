"""`python -m operators.cli.render render|validate`: gangflow's Kubernetes objects, offline.

`render --dataset-version MD5 ...` prints every object the Kubernetes backend would submit
(contract 6, docs/contracts.md); `validate FILE...` checks YAML objects against the upstream
schemas, strictly, like the API server. `--help` lists the options.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _default_crds() -> str:
    """$GANGFLOW_CRDS, else the upstream CRDs vendored in the package (crds/README.md)."""
    return os.environ.get("GANGFLOW_CRDS") or str(Path(__file__).resolve().parents[1] / "kubernetes" / "crds")


def _read_runtime(path: str) -> dict:
    from operators.kubernetes.runtime import RUNTIME_CONFIGMAP_KEY

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if isinstance(data, dict) and data.get("kind") == "ConfigMap":
        data = yaml.safe_load((data.get("data") or {}).get(RUNTIME_CONFIGMAP_KEY) or "") or {}
    if not isinstance(data, dict):
        raise ValueError(f"--runtime {path}: expected a runtime.yaml mapping or a ConfigMap with key {RUNTIME_CONFIGMAP_KEY}")
    return data


def _parser() -> argparse.ArgumentParser:
    from operators.kubernetes.runtime import APIS, SCHEDULERS

    parser = argparse.ArgumentParser(prog="python -m operators.cli.render", description="gangflow's Kubernetes objects, offline.")
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="print every object the backend would submit, as multi-document YAML")
    render.add_argument(
        "--world-size", type=_world_size, default=2, metavar="N",
        help="training processes (ranks), >= 1 (default 2); pods = N / processes per pod (resources.gpu, or procsPerPod on CPU)",
    )
    render.add_argument("--dataset-version", metavar="MD5", help="the pinned dataset version (DVC md5) the ranks fetch from the runtime's dataset.remote")
    render.add_argument("--queue", help="Kueue LocalQueue or Volcano queue (overrides runtime queue)")
    render.add_argument("--scheduler", choices=SCHEDULERS, help="admission: kueue or volcano (overrides runtime scheduler)")
    render.add_argument("--api", choices=APIS, help="gang object under Kueue: jobset, trainjob, rayjob or mpijob (overrides runtime api)")
    render.add_argument("--runtime", metavar="FILE", help="runtime.yaml (or the gangflow-runtime ConfigMap manifest); default: built-in example")
    render.add_argument("--name", default="example-gang", help="gang name, a DNS-1123 label (default example-gang)")
    render.add_argument("--attempt", type=_world_size, default=1, metavar="N", help="Airflow try number (default 1)")
    render.add_argument("--namespace", help="namespace (overrides runtime namespace)")
    render.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="trainer --set override, repeatable")
    render.add_argument("--validate", action="store_true", help="also validate the output against the upstream schemas")
    render.add_argument("--crds", default=None, help="folder of upstream CRD manifests (default: $GANGFLOW_CRDS or the vendored operators/kubernetes/crds)")
    validate = sub.add_parser("validate", help="validate YAML objects against the upstream schemas")
    validate.add_argument("files", nargs="+", metavar="FILE", help="YAML files ('-' for stdin)")
    validate.add_argument("--crds", default=None, help="folder of upstream CRD manifests (default: $GANGFLOW_CRDS or the vendored operators/kubernetes/crds)")
    validate.add_argument("--kubernetes-version", default="1.33", help="schema version for core kinds (default 1.33)")
    return parser


def render_documents(**kwargs) -> list[dict]:
    """The objects `render` prints (importable for tests and other tools); takes `render_plan`'s
    keyword arguments."""
    return render_plan(**kwargs).objects()


def render_plan(
    *,
    world_size: int = 2,
    queue: str | None = None,
    scheduler: str | None = None,
    api: str | None = None,
    runtime: dict | None = None,
    name: str = "example-gang",
    attempt: int = 1,
    namespace: str | None = None,
    overrides: tuple[str, ...] = (),
    dataset_version: str | None = None,
):
    """The `GangPlan` behind `render` (objects plus pods, processes per pod and run dir)."""
    import dataclasses

    from operators.backends.base import GangSpec
    from operators.kubernetes.builders import DATA_VERSION_KEY, build_gang
    from operators.kubernetes.runtime import RuntimeDefaults, example_runtime_mapping, merge_runtime

    flags = {k: v for k, v in {"queue": queue, "scheduler": scheduler, "api": api}.items() if v is not None}
    mapping = merge_runtime(runtime if runtime is not None else example_runtime_mapping(), flags)
    defaults = RuntimeDefaults.from_mapping(mapping)
    items = tuple(overrides)
    extra = {}
    if dataset_version:
        items += (f"{DATA_VERSION_KEY}={dataset_version}",)
        if "dataset_version" in {f.name for f in dataclasses.fields(GangSpec)}:
            extra["dataset_version"] = dataset_version
    # the spec's run dir is the worker's; the pods get the runtime's checkpoint location instead
    spec = GangSpec(name=name, run_dir=defaults.checkpoint.run_dir(name), world_size=world_size, overrides=items, attempt=attempt, **extra)
    return build_gang(spec, defaults, namespace=namespace)


def plan_summary(plan, dataset_version: str | None) -> str:
    """Which number is which: pods, processes per pod, world size; what data, where it runs."""
    from operators.kubernetes.builders import DATA_REMOTE_KEY, trainer_arg_value

    body = plan.body
    remote = trainer_arg_value(body, DATA_REMOTE_KEY)
    data = f"dataset version {dataset_version}, fetched and md5-verified by each rank from {remote}" if dataset_version else "dataset carried by the image"
    return (
        f"gangflow: {plan.kind} {plan.namespace}/{plan.name} for gang {plan.gang!r}\n"
        f"  world size {plan.world_size} = {plan.pods} pod(s) (--nnodes) x {plan.processes_per_pod} process(es) per pod (--nproc-per-node)\n"
        f"  {data}\n"
        f"  run dir (checkpoints) {plan.run_dir}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from operators.kubernetes.runtime import RuntimeConfigError
    from operators.kubernetes.validation import CrdRegistry, SchemaValidationError, validate_documents

    def crds() -> CrdRegistry | None:
        folder = args.crds or _default_crds()
        return CrdRegistry(folder) if folder else None

    if args.command == "render":
        try:
            runtime = _read_runtime(args.runtime) if args.runtime else None
            plan = render_plan(
                world_size=args.world_size,
                queue=args.queue,
                scheduler=args.scheduler,
                api=args.api,
                runtime=runtime,
                name=args.name,
                attempt=args.attempt,
                namespace=args.namespace,
                overrides=tuple(args.overrides),
                dataset_version=args.dataset_version,
            )
            docs = plan.objects()
            if args.validate:
                validate_documents(docs, crds())
        except (RuntimeConfigError, SchemaValidationError, ValueError, OSError) as exc:
            parser.exit(2, f"{parser.prog} render: error: {exc}\n")
        summary = plan_summary(plan, args.dataset_version)
        sys.stderr.write(summary + "\n")
        header = "".join(f"# {line}\n" for line in summary.splitlines())
        sys.stdout.write(header + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True))
        return 0

    docs = []
    for path in args.files:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    try:
        count = validate_documents(docs, crds(), args.kubernetes_version)
    except SchemaValidationError as exc:
        parser.exit(1, f"{parser.prog} validate: invalid: {exc}\n")
    print(f"{count} object(s) valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
