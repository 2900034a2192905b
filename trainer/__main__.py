"""Entry point: `[torchrun ...] python -m trainer --run-dir DIR [--config F] [--set k=v ...]`.

Everything that can be rejected is rejected here, before any process group starts: the
command line, the params file and overrides, GANGFLOW_FAULT, the factories, the batch split
and the data file's md5. Then `trainer.loop.run` trains.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import traceback

from torch.distributed.elastic.multiprocessing.errors import record

from trainer import EXIT_CONFIG_ERROR, EXIT_OK, EXIT_USER_ERROR, cli, errors
from trainer.urls import credentials_refusal, has_credentials
from trainer.console import install_log_format, say
from trainer.config import load_config
from trainer.distributed import check_device, detect
from trainer.errors import ConfigError, UserError
from trainer.faults import ENV as FAULT_ENV
from trainer.faults import fault_from_env
from trainer.preemption import Preemption


def _refuse(exc: Exception, code: int, run_dir, rank: int, handler) -> int:
    kind = "config error" if code == EXIT_CONFIG_ERROR else "error"
    say(f"gangflow: {kind}: {exc}", stream=sys.stderr)
    errors.write_records(exc, rank=rank, step=None, run_dir=run_dir)
    handler.record_exception(exc)  # TorchElastic's error file, when torchrun set one
    return code


_ERROR_HANDLER = errors.make_error_handler()


@functools.partial(record, error_handler=_ERROR_HANDLER)
def main(argv: list[str] | None = None) -> int:
    args = cli.parse_args(argv)
    # A SIGTERM from now on is a preemption request (the loop stops at the next step boundary).
    preemption = Preemption()
    preemption.install()
    rank = 0
    if has_credentials(args.run_dir):  # before anything is written there (argv is seen by every process lister)
        exc = ConfigError(credentials_refusal("--run-dir", args.run_dir))
        return _refuse(exc, EXIT_CONFIG_ERROR, None, rank, _ERROR_HANDLER)
    try:
        launch = detect()
        rank = errors.context.rank = launch.rank
        cfg = load_config(args.config, args.overrides)
        fault = fault_from_env(rank=rank)
        if fault is not None and fault.rank is not None and fault.rank >= launch.world_size:
            raise ConfigError(f"{FAULT_ENV}={fault.spec!r} is invalid: rank={fault.rank} but the world size is {launch.world_size}")
        check_device(cfg.train.device, launch)
        cfg.check_factories()
        if cfg.train.batch_size % launch.world_size:
            raise ConfigError(f"train.batch_size={cfg.train.batch_size} is invalid: it is the global batch and must "
                              f"divide evenly over the world size {launch.world_size}")
    except ConfigError as exc:
        return _refuse(exc, EXIT_CONFIG_ERROR, args.run_dir, rank, _ERROR_HANDLER)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return EXIT_OK
    try:
        from trainer.data import resolve_data

        data = resolve_data(cfg.data, args.run_dir)  # fetched by version and md5-verified, before any process group
    except UserError as exc:
        return _refuse(exc, EXIT_USER_ERROR, args.run_dir, rank, _ERROR_HANDLER)
    from trainer.loop import run

    preemption.grace_s = cfg.checkpoint.grace_period_s
    return run(cfg, fault, launch, args.run_dir, preemption, data)


def exit_process(code: int) -> None:
    """Exit with `code`; non-zero codes skip interpreter teardown, during which a SIGTERM from
    torchrun (tearing down the rest of the gang) would turn the code into -15."""
    if code == EXIT_OK:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _import_dynamo() -> None:
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - the optimizer imports it again and reports any error
        pass


def exit_code(argv: list[str] | None = None, entry=None) -> int:
    """`main` (or `entry`: trainer.user's), with whatever escapes it turned into the rank's exit
    code (as `python -m trainer` and trainer.launch's forked ranks end)."""
    try:
        install_log_format()  # GANGFLOW_LOG_FORMAT=json: every line of this rank as JSON
    except ValueError as exc:
        say(f"gangflow: config error: {exc}", stream=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        return (entry or main)(argv) or EXIT_OK
    except SystemExit as exc:  # argparse errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return 130
    except BaseException:  # noqa: BLE001 - already recorded (error files); print it as Python would
        traceback.print_exc()
        return EXIT_USER_ERROR


if __name__ == "__main__":
    # torch.optim imports torch._dynamo when the first optimizer is built (seconds); importing it
    # beside the data md5 and the checkpoint load takes it off rank 0's path to its first step
    # (measured: 0.4-0.7 s of a 2-rank restart here, benchmarks/README.md).
    threading.Thread(target=_import_dynamo, name="gangflow-dynamo-import", daemon=True).start()
    exit_process(exit_code())
