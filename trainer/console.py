"""Lines for the task log, each written whole.

A rank's output reaches the Airflow task log through torchrun's `--tee`: its agent tails the
rank's log file a line at a time and forwards what it finds, a partial line included, with a
`[defaultN]:` prefix. `print()` writes the text and the newline in two writes when output is
unbuffered (PYTHONUNBUFFERED, as the backends run ranks), so a tail reading between them splits
the line, and the next prefix lands on its end. `say` writes the line and its newline at once.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["say"]


def say(message: str, *, stream: TextIO | None = None) -> None:
    """Write `message` and a newline to `stream` (default stdout) in one write, then flush."""
    out = sys.stdout if stream is None else stream
    out.write(message + "\n")
    out.flush()
