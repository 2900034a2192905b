"""The shell commands of README.md and the code blocks of docs/extending.md, as the docs tests read them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
README = PROJECT_ROOT / "README.md"
GUIDE = PROJECT_ROOT / "docs" / "extending.md"
FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```$", re.S | re.M)
BLOCK = re.compile(r"^```(\w+) (file|append)=(\S+)\n(.*?)^```$", re.S | re.M)


def canonical(line: str) -> str:
    """One command as shell words, its comment dropped: quoting differences do not matter."""
    return shlex.join(shlex.split(line, comments=True))


def readme_commands() -> dict[str, list[str]]:
    """{canonical command: its words} of every line of README's shell blocks."""
    found = {}
    for body in FENCE.findall(README.read_text()):
        for line in body.splitlines():
            if words := shlex.split(line, comments=True):
                found[shlex.join(words)] = words
    assert found, "no ```bash blocks in README.md"
    return found


def blocks() -> list[tuple[str, str, str]]:
    """(kind, path, body) of docs/extending.md's `file=` and `append=` blocks."""
    found = [(kind, path, body) for _, kind, path, body in BLOCK.findall(GUIDE.read_text())]
    assert found, "no file= blocks in docs/extending.md"
    return found
