"""Framework integrations of the runtime API (trainer/runtime.py) for user training code.

`trainer.integrations.huggingface` (a `transformers` TrainerCallback) and
`trainer.integrations.lightning` (a Lightning callback and logger) make a framework's own
checkpoints follow contract 2 (docs/contracts.md), resume from gangflow's last committed one after
an infrastructure retry, and send the framework's logged metrics to `run.report`. Each imports its
framework; nothing in trainer/ imports them, so a rank without the framework never loads it.
docs/extending.md, "Bring your own training script", shows both in use.
"""
