"""The scripts of benchmarks/ as modules, for the tests of their functions."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """Import benchmarks/<name>.py; benchmarks/ goes after the project on sys.path, because its
    trainer.py must not shadow the project's trainer package (here or in the processes a test spawns)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module(name)
