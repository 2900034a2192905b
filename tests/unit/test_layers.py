"""The import graph runs one way: dags -> cli -> operators -> backends -> hooks -> trainer.

Every `import` in product code, lazy ones inside functions included, is checked against the
layer table below (docs/design/layout.md explains it); a module may import its own layer or
any layer below, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (module prefix, layer): the longest matching prefix decides.
LAYERS: list[tuple[str, int]] = [
    ("trainer", 0),
    ("operators.failures", 1),
    ("operators.config.settings", 1),
    ("operators.utils", 1),
    ("operators.expectations", 1),
    ("operators.backends.base", 1),
    ("operators.exceptions", 2),
    ("operators.hooks", 3),
    ("operators.kubernetes", 4),
    ("operators.config", 4),
    ("operators.registry", 4),
    ("operators.triggers", 5),
    ("operators.backends", 6),
    ("operators", 7),  # the operators a DAG imports, retry, callbacks
    ("operators.cli", 8),
    ("data", 9),
    ("dags", 9),
]


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > best[0]:
                best = (len(prefix), layer)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")[: len(module.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


PRODUCT_FILES = sorted(p for folder in ("trainer", "operators", "dags", "data") for p in (ROOT / folder).rglob("*.py"))


def test_every_product_module_has_a_layer():
    assert [module_name(p) for p in PRODUCT_FILES if layer_of(module_name(p)) is None] == []


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_reaches_a_layer_above(path: Path):
    module = module_name(path)
    own = layer_of(module)
    upward = []
    for line, name in imported_modules(path, module):
        target = layer_of(name)
        if target is not None and target > own:
            upward.append(f"{path.relative_to(ROOT)}:{line} imports {name} (layer {target} > {own})")
    assert upward == []


@pytest.mark.parametrize("module", ["trainer.runtime", "trainer.identity"])
def test_the_runtime_is_below_gangflows_own_loop(module: str):
    """Inside layer 0, gangflow's loop (trainer.loop) is one user of the runtime API: the runtime
    and the identity rules both use never import it, lazily included (issue 22)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    assert [f"{module}:{line} imports {name}" for line, name in imported_modules(path, module)
            if name == "trainer.loop" or name.startswith("trainer.loop.")] == []
