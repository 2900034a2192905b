"""`[torchrun ...] python -m trainer.user --run-dir DIR [--config F] [--set k=v ...] TARGET`: one rank
of training code of one's own, with gangflow's options, error files and exit codes (contract 1).

TARGET is one of
    --entrypoint pkg.mod:func [--kwargs JSON]   func(**kwargs) is called in every rank
    --module pkg.mod [-- ARGS...]               run as `python -m pkg.mod ARGS...`
    --script path/train.py [-- ARGS...]         run as `python path/train.py ARGS...` (a path inside the working directory)

The options are `python -m trainer`'s: the run dir, data.remote/data.version, checkpoint.keep_last,
checkpoint.grace_period_s and tracking.progress_every_s reach the code through the environment that
`trainer.runtime.init()` reads. An exception escaping the code is recorded (TorchElastic's error
file with the traceback, DIR/errors/rank-R.json, the termination log) with `source: "user"` unless
the failure catalogue calls it infrastructure, and the rank exits 1; a bad option exits 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from trainer import EXIT_CONFIG_ERROR, EXIT_OK, EXIT_PREEMPTED, EXIT_USER_ERROR, errors, runtime
from trainer.cli import build_parser as trainer_parser
from trainer.config import AUTO, load_config
from trainer.console import say
from trainer.errors import ConfigError, UserError, user_code
from trainer.preemption import Preemption
from trainer.checks import is_integer

ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MODULE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*$")


def build_parser() -> argparse.ArgumentParser:
    parser = trainer_parser()
    parser.prog = "python -m trainer.user"
    parser.description = ("Run one rank of your own training code under gangflow (trainer.runtime gives it the data, "
                          "checkpoints, metrics and the final model).")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--entrypoint", metavar="MODULE:FUNCTION", help="a function called in every rank")
    target.add_argument("--module", metavar="MODULE", help="a module run as `python -m MODULE ARGS...`")
    target.add_argument("--script", metavar="PATH", help="a script run as `python PATH ARGS...` (inside the working directory)")
    parser.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments of --entrypoint's function (a JSON object)")
    parser.add_argument("args", nargs="*", metavar="ARGS", help="after `--`: the arguments of --module or --script")
    return parser


def describe(args: argparse.Namespace) -> str:
    """What runs, as recorded in every checkpoint (GANGFLOW_CODE): a resume needs the same."""
    if args.entrypoint:
        return f"{args.entrypoint} {args.kwargs}" if args.kwargs.strip() not in ("", "{}") else args.entrypoint
    head = ["-m", args.module] if args.module else [args.script]
    return " ".join([*head, *args.args])


def _check(args: argparse.Namespace) -> dict[str, Any]:
    """The target's form (nothing imported yet); the entry point's keyword arguments."""
    if args.entrypoint is not None and not ENTRYPOINT.fullmatch(args.entrypoint):
        raise ConfigError(f"--entrypoint {args.entrypoint!r} is invalid: expected module:function, e.g. mypkg.train:main")
    if args.module is not None and not MODULE.fullmatch(args.module):
        raise ConfigError(f"--module {args.module!r} is invalid: expected a dotted module name, e.g. mypkg.train")
    if args.entrypoint is not None and args.args:
        raise ConfigError(f"--entrypoint takes --kwargs (a JSON object), not arguments: {args.args!r}")
    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as exc:
        raise ConfigError(f"--kwargs {args.kwargs!r} is invalid: not JSON ({exc})") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--kwargs {args.kwargs!r} is invalid: must be a JSON object of keyword arguments")
    if args.script is not None:
        script_path(args.script)
    return kwargs


def script_path(text: str) -> Path:
    """A script inside the working directory (no absolute path, no `..`, no link out of it)."""
    rel = Path(text)
    if rel.is_absolute() or ".." in rel.parts:
        raise ConfigError(f"--script {text!r} is invalid: a path relative to the project, without '..'")
    root = Path.cwd().resolve()
    path = (root / rel).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise ConfigError(f"--script {text!r} is invalid: no such file inside {root}")
    return path


def export_runtime_env(args: argparse.Namespace) -> None:
    """What trainer.runtime.init() reads, from the options (contract 1's names)."""
    cfg = load_config(args.config, args.overrides)
    if cfg.checkpoint.every_steps == AUTO:
        raise ConfigError(f"checkpoint.every_steps={AUTO!r} is invalid here: training code of one's own saves when it calls "
                          "run.save_checkpoint and reads run.params['checkpoint.every_steps'] as an integer; "
                          "give an integer >= 1 (auto is for gangflow's own loop)")
    os.environ[runtime.ENV_RUN_DIR] = str(args.run_dir)
    os.environ[runtime.ENV_CODE] = describe(args)
    os.environ[runtime.ENV_KEEP_LAST] = str(cfg.checkpoint.keep_last)
    os.environ[runtime.ENV_GRACE] = str(cfg.checkpoint.grace_period_s)
    os.environ[runtime.ENV_PROGRESS] = str(cfg.tracking.progress_every_s)
    settings = cfg.to_dict()
    params = {f"{section}.{key}": value for section in ("train", "checkpoint") for key, value in settings[section].items()}
    os.environ[runtime.ENV_PARAMS] = json.dumps(params)
    for name, value in ((runtime.ENV_DATA_REMOTE, cfg.data.remote), (runtime.ENV_DATA_VERSION, cfg.data.version)):
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)


def call_target(args: argparse.Namespace, kwargs: dict[str, Any]) -> Any:
    """Run the user's code in this process, as `python -m`/`python script` would."""
    if args.entrypoint:
        module_name, _, attr = args.entrypoint.partition(":")
        sys.argv = [args.entrypoint]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise UserError(f"--entrypoint {args.entrypoint!r}: no module {exc.name!r} on the rank's path "
                                f"(the pipeline's package_roots; sys.path: {sys.path[:4]}...)") from None
            raise
        func = getattr(module, attr, None)
        if not callable(func):
            raise UserError(f"--entrypoint {args.entrypoint!r}: module {module_name!r} has no function {attr!r}")
        try:
            inspect.signature(func).bind(**kwargs)
        except TypeError as exc:
            raise UserError(f"--entrypoint {args.entrypoint!r} does not take the keyword arguments {sorted(kwargs)}: {exc}") from None
        return func(**kwargs)
    if args.module:
        sys.argv = [args.module, *args.args]
        if importlib.util.find_spec(args.module.split(".")[0]) is None:
            raise UserError(f"--module {args.module!r}: no module {args.module.split('.')[0]!r} on the rank's path "
                            f"(the pipeline's package_roots; sys.path: {sys.path[:4]}...)")
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return None
    path = script_path(args.script)
    sys.argv = [str(path), *args.args]
    sys.path.insert(0, str(path.parent))  # as `python path/script.py` does
    runpy.run_path(str(path), run_name="__main__")
    return None


def _refuse(exc: Exception, code: int, run_dir, handler) -> int:
    kind = "config error" if code == EXIT_CONFIG_ERROR else "error"
    say(f"gangflow: {kind}: {exc}", stream=sys.stderr)
    errors.write_records(exc, rank=errors.context.rank, step=errors.context.step, run_dir=run_dir)
    handler.record_exception(exc)  # TorchElastic's error file, when torchrun set one
    return code


def _finished_without_model(run_dir: str) -> bool:
    from trainer.storage import Storage
    from trainer.tracking import FINAL_ARTIFACT_PATH

    return not Storage(run_dir).exists(FINAL_ARTIFACT_PATH, runtime.CARD)


_ERROR_HANDLER = errors.make_error_handler()


@functools.partial(record, error_handler=_ERROR_HANDLER)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    errors.context.rank = int(os.environ.get("RANK", "0") or 0)
    try:
        kwargs = _check(args)
        export_runtime_env(args)
    except ConfigError as exc:
        return _refuse(exc, EXIT_CONFIG_ERROR, args.run_dir, _ERROR_HANDLER)
    if args.print_config:
        print(json.dumps({"run_dir": str(args.run_dir), "code": describe(args)}, indent=2))
        return EXIT_OK
    rank_pid = os.getpid()
    try:
        with user_code():  # whatever escapes it is the user's, unless the catalogue says infrastructure
            result = call_target(args, kwargs)
    except SystemExit as exc:  # the code's own sys.exit (exit_preempted: 75)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USER_ERROR)
        _leave_if_forked(rank_pid, code)
        if code == EXIT_PREEMPTED and runtime.stopped_by_sigterm():
            _close(None)
            return code
        if code != EXIT_OK:  # the code's own failure: recorded as the user's, with its message
            _close("FAILED")
            said = f"code {code}" if isinstance(exc.code, int) else repr(str(exc.code))
            why = (" (75 is the preemption exit, for run.exit_preempted() after a SIGTERM; none was received)"
                   if code == EXIT_PREEMPTED else "")
            return _refuse(UserError(f"{describe(args)} exited with {said}{why}{_replaced_sigterm_note()}"),
                           EXIT_USER_ERROR if code == EXIT_PREEMPTED else code, args.run_dir, _ERROR_HANDLER)
        result = None
    except ConfigError as exc:  # from trainer.runtime: a bad GANGFLOW_* value or GANGFLOW_FAULT
        _close("FAILED")
        return _refuse(exc, EXIT_CONFIG_ERROR, args.run_dir, _ERROR_HANDLER)
    except BaseException as exc:
        _leave_if_forked(rank_pid, EXIT_USER_ERROR)
        if not isinstance(exc, KeyboardInterrupt):
            errors.write_records(exc, rank=errors.context.rank, step=errors.context.step, run_dir=args.run_dir)
        _close("FAILED")
        raise  # @record writes the error file; the rank exits 1
    _leave_if_forked(rank_pid, EXIT_OK)
    _close("FINISHED")
    if is_integer(result) and result != EXIT_OK:
        return result
    if errors.context.rank == 0 and _finished_without_model(args.run_dir):
        return _refuse(UserError(f"{describe(args)} returned without logging a model: call run.log_model(folder) "
                                 f"(trainer.runtime) with the trained model before returning{_replaced_sigterm_note()}"),
                       EXIT_USER_ERROR, args.run_dir, _ERROR_HANDLER)
    return EXIT_OK


def _replaced_sigterm_note() -> str:
    """What to add to a failure's message when the code replaced gangflow's SIGTERM handler: a
    preemption then ends the code its own way instead of committing and exiting 75."""
    handler = signal.getsignal(signal.SIGTERM)
    if handler in (signal.SIG_DFL, signal.SIG_IGN, None) or isinstance(getattr(handler, "__self__", None), Preemption):
        return ""
    name = getattr(handler, "__qualname__", repr(handler))
    return (f"; note: the code replaced gangflow's SIGTERM handler (with {name}), so a preemption or a stop ends "
            "it that way instead of saving and exiting 75: remove it and poll run.should_stop")


def _leave_if_forked(rank_pid: int, code: int) -> None:
    """A child the code forked that got back here ends at once: the rank's records, its run and its
    process group are its parent's."""
    if os.getpid() != rank_pid:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _close(status: str | None) -> None:
    run = runtime.current()
    if run is not None:
        try:
            run.close(status=status)
        except BaseException:  # noqa: BLE001 - the code's own outcome matters more
            traceback.print_exc()


def exit_code(argv: list[str] | None = None) -> int:
    """`main`, with whatever escapes it turned into the rank's exit code (as `python -m trainer`'s)."""
    from trainer.__main__ import exit_code as trainer_exit_code

    return trainer_exit_code(argv, entry=main)


if __name__ == "__main__":
    from trainer.__main__ import exit_process

    exit_process(exit_code())
