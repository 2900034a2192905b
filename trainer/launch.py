"""`python -m trainer.launch [torchrun options] -m trainer [trainer arguments]`: torchrun, with the
ranks forked from an interpreter that has already imported what they need (contract 1).

torchrun's own agent and options; torch, torch._dynamo, pyarrow and the trainer are imported once
and the ranks start with the `fork` method. Safe because this process never touches CUDA and
starts no thread before the ranks exist. Only `-m trainer` and `-m trainer.user` (training code of
one's own) are accepted.
"""

from __future__ import annotations

import sys
import uuid

# Imported here, before the fork, so that the ranks inherit them instead of importing them each.
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (what every torch.optim optimizer imports on its first call)
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

import trainer.data  # noqa: F401  (pyarrow, numpy)
import trainer.loop  # noqa: F401  (the rest of the trainer)
import trainer.user  # noqa: F401  (trainer.runtime)
from trainer import EXIT_CONFIG_ERROR, EXIT_OK
from trainer.__main__ import exit_code, exit_process
from trainer.console import say

ENTRY_MODULE = "trainer"
ENTRY_MODULES = (ENTRY_MODULE, "trainer.user")


class LaunchError(ValueError):
    """The command line asks for something this launcher does not run."""


def rank_main(module: str, *argv: str) -> None:
    """One rank, in a forked child: `python -m trainer`'s (or `-m trainer.user`'s) main and exit
    code. A failed rank exits with its code, as under torchrun (the classifier reads it); a rank
    that succeeded returns, and TorchElastic ends the process."""
    code = (trainer.user.exit_code if module == "trainer.user" else exit_code)(list(argv))
    if code != EXIT_OK:
        exit_process(code)


def parse(argv: list[str]):
    """torchrun's own options; (LaunchConfig, [entry module, *its arguments]). LaunchError when the
    entry point is not `-m trainer` / `-m trainer.user` or its own options name a start method
    (the ranks are always forked)."""
    parser = torchrun.get_args_parser()
    # None unless given: only the launcher's own options, before the entry module, can give it
    # (in any spelling argparse accepts); the training program's arguments after it are its own.
    parser.set_defaults(start_method=None)
    args = parser.parse_args(argv)
    if not args.module or args.training_script not in ENTRY_MODULES or args.no_python or args.run_path:
        given = " ".join(filter(None, ["-m" if args.module else "", args.training_script]))
        raise LaunchError(f"trainer.launch runs `-m {ENTRY_MODULE}` or `-m trainer.user` only, got {given!r}: "
                          "use torchrun for other entry points")
    if args.start_method is not None:
        raise LaunchError("--start-method: trainer.launch always forks the ranks; use torchrun to choose another")
    args.start_method = "fork"
    # The rendezvous defaults of torchrun's run(): a local c10d store on a free port for one node.
    one_node_default = (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                        and torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1)
    if args.standalone or one_node_default:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _cmd, _cmd_args = torchrun.config_from_args(args)
    return config, [args.training_script, *args.training_script_args]


@record
def main(argv: list[str] | None = None) -> int:
    try:
        config, trainer_args = parse(sys.argv[1:] if argv is None else argv)
    except LaunchError as exc:
        say(f"gangflow: config error: {exc}", stream=sys.stderr)
        return EXIT_CONFIG_ERROR
    # A rank that fails raises ChildFailedError here: @record prints torchrun's failure summary
    # (rank, exit code, error file) and the exit status is 1, as torchrun's.
    elastic_launch(config=config, entrypoint=rank_main)(*trainer_args)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
