"""gangflow's trainer: the code that runs inside every rank (DDP loop, data, checkpoints, tracking).

Run it with torchrun (see docs/trainer.md):

    torchrun --standalone --nproc-per-node 2 -m trainer --run-dir runs/demo --config params.yaml

Importing this package is cheap: it does not import torch. The exit codes are part of the
contract with the failure classifier (operators.failures).
"""

from __future__ import annotations

EXIT_OK = 0
#: The training raised (user code, bad data, or an unexpected error): see the error record's `source`.
EXIT_USER_ERROR = 1
#: Bad command line, params file, `--set` override or GANGFLOW_FAULT; nothing was started.
EXIT_CONFIG_ERROR = 2
#: Stopped on SIGTERM (preemption) after committing a final checkpoint: retry and it resumes.
EXIT_PREEMPTED = 75  # EX_TEMPFAIL

__all__ = ["EXIT_OK", "EXIT_USER_ERROR", "EXIT_CONFIG_ERROR", "EXIT_PREEMPTED"]
