"""Build the text corpus of the `charlm` pipeline (DVC stage `prepare_corpus`).

The corpus is a fixed list of the Python standard library's own source files, read from the
interpreter that runs the stage (offline, nothing downloaded): one row per file (`path`, `text`)
in train.parquet and test.parquet, split by file so that no test text is seen in training.
The bytes, hence the DVC version, are those of the interpreter's standard library: dvc.lock pins
the corpus of CPython 3.11.7; another interpreter publishes a new version (setup says so).

    python data/prepare_corpus.py --out data/corpus
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError as exc:  # e.g. `dvc repro` found the system python first on PATH
    sys.exit(f"data/prepare_corpus.py: {exc} in {sys.executable}; run it with the project's interpreter: "
             "`make data`, or `PATH=$PWD/.venv/bin:$PATH dvc repro`")

# Small, long-lived modules (rarely touched by a patch release), about 420 KB to train on.
TRAIN_MODULES = (
    "abc", "bisect", "colorsys", "contextlib", "copy", "difflib", "fnmatch", "fractions", "functools",
    "graphlib", "heapq", "numbers", "operator", "pprint", "queue", "random", "reprlib", "sched", "shlex",
    "statistics", "string", "textwrap",
)  # fmt: skip
# Held out: the test split the evaluation's perplexity is measured on (about 47 KB).
TEST_MODULES = ("calendar", "cmd", "getopt")


def source(module: str, stdlib: Path) -> str:
    """The text of one standard-library module; refuses anything that is not a plain file in it."""
    path = stdlib / f"{module}.py"
    if path.is_symlink() or not path.is_file():
        raise FileNotFoundError(f"{path}: not a regular file of the standard library {stdlib}")
    return path.read_text(encoding="utf-8")


def _write(table: pa.Table, path: Path) -> None:
    # Pinned writer options: identical text gives identical bytes (the same DVC hash).
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp, compression="zstd", use_dictionary=False, write_statistics=True)
    tmp.replace(path)


def prepare(out: Path, stdlib: Path | None = None) -> dict:
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split, modules in (("train", TRAIN_MODULES), ("test", TEST_MODULES)):
        texts = [source(m, stdlib) for m in modules]
        table = pa.table({"path": pa.array([f"{m}.py" for m in modules], pa.string()), "text": pa.array(texts, pa.string())})
        _write(table, out / f"{split}.parquet")
        sizes[f"{split}_chars"] = sum(map(len, texts))
    return {**sizes, "out": str(out), "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder for train.parquet and test.parquet")
    args = parser.parse_args(argv)
    print(prepare(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
