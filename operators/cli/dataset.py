"""A pipeline's dataset from the command line: publish a version, or validate one with the
pipeline's Great Expectations suite (as its `validate_dataset` task does, outside Airflow).

    python -m operators.cli.dataset publish --pipeline NAME                  # dvc repro <stage> + dvc push; prints the version
    python -m operators.cli.dataset validate --pipeline NAME [--version MD5]  # fetch, verify hashes, run the suite; prints the manifest

(`python -m operators.hooks.dvc resolve` checks a version's hashes only.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from operators.config.pipelines import DEFAULT_PIPELINE, PipelineConfigError, pipeline
from operators.exceptions import GangflowError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m operators.cli.dataset", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("publish", "dvc repro the pipeline's stage, dvc push its output; print the version"),
                       ("validate", "fetch a version, verify its hashes, run the pipeline's suite; print its manifest")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--pipeline", default=DEFAULT_PIPELINE, help=f"a file pipelines/<name>.yaml (default {DEFAULT_PIPELINE})")
        if name == "validate":
            command.add_argument("--version", default="pinned", help="32 hex digits, or 'pinned' (dvc.lock's; the default)")
    args = parser.parse_args(argv)
    try:
        config = pipeline(args.pipeline)
    except PipelineConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    out = os.fdopen(os.dup(1), "w")  # the result; every log line (Airflow's logging writes to fd 1) goes to stderr
    os.dup2(2, 1)
    try:
        if args.command == "publish":
            from operators.hooks import dvc

            print(dvc.publish(stage=config.dataset_stage, out=config.dataset_out), file=out, flush=True)
            return 0
        from operators.config.pipelines import add_package_roots
        from operators.validation import DatasetValidationOperator

        add_package_roots(config.package_roots)  # the suite may live in the user's package
        task = DatasetValidationOperator(task_id="validate_dataset", dataset_version=args.version, suite=config.suite,
                                         dvc_out=config.dataset_out)  # fmt: skip
        print(json.dumps(task.validate_version(run_name="cli"), indent=2, default=str), file=out, flush=True)
        return 0
    except GangflowError as exc:
        print(f"gangflow: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
