"""A pattern that checks a whole value is matched with `fullmatch`: with `match` or `search`, its
`$` also matches before a final newline, so `"s3://bucket\\n"` or `"4Gi\\n"` passed checks
meant to refuse anything but the accepted shape.

Every module-level `NAME = re.compile(r"^...$")` in product code is checked: no `NAME.match(` or
`NAME.search(` in its module or in a module that imports it by name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("dags", "operators", "trainer")
# Not value checks: split.json's own keys (its hash covers them), and patterns that parse one line of
# a log (from splitlines: no final newline to let through).
NOT_VALUES = {"HOLDOUT", "_FAILURE_FIELD", "_RANK_LINE", "MPI_RANK_LINE", "_WORKER_LINE"}


def _sources() -> list[Path]:
    return [p for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))]


def _anchored(tree: ast.Module) -> set[str]:
    """Names bound at module level to re.compile of a literal that starts with ^ and ends with $
    (without re.MULTILINE: such a pattern finds lines in a text, with search, as it should)."""
    names = set()
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        if not (call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
            continue
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == "compile"):
            continue
        if "MULTILINE" in ast.dump(call) or "re.M" in ast.unparse(call):
            continue
        text = call.args[0].value
        if text.startswith("^") and text.endswith("$"):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


TREES = {_module(path): ast.parse(path.read_text()) for path in _sources()}
DEFINED = {module: _anchored(tree) - NOT_VALUES for module, tree in TREES.items()}


def _in_scope(module: str) -> set[str]:
    """The module's own anchored patterns and those it imports by name."""
    names = set(DEFINED[module])
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom) and node.module in DEFINED:
            names |= {alias.asname or alias.name for alias in node.names if alias.name in DEFINED[node.module]}
    return names


def test_the_scan_finds_the_value_checks():
    found = set().union(*DEFINED.values())
    assert {"_DNS_SUBDOMAIN", "_URI", "_QUANTITY", "FACTORY_RE", "PLAIN_FILE", "GANG_NAME"} <= found
    assert "FACTORY_RE" in _in_scope("trainer.allowlist")  # imported from trainer.config


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_value_checks_use_fullmatch(path):
    text, anchored = path.read_text(), _in_scope(_module(path))
    found = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for m in re.finditer(r"\b(\w+)\.(?:match|search)\(", text) if m.group(1) in anchored]
    assert not found, "use fullmatch ('$' lets a final newline through): " + "; ".join(found)
