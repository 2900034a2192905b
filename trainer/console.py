"""Lines for the task log, each written whole.

torchrun's `--tee` forwards a rank's output as it finds it, partial lines included, and `print()`
writes the text and the newline in two writes when output is unbuffered, so a read between them
splits the line: `say` writes the line and its newline at once.
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
