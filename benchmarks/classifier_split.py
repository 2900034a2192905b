"""Split the failure corpus by source project into train / dev / test, once, and freeze test.

    python benchmarks/classifier_split.py [--seed 20261130] [--write]

The split is made before any rule is tuned to the corpus, by project (one tracker's cases never
straddle two splits), so the test figure measures generalization to projects the rules never saw.
Projects are shuffled with a fixed seed and taken into test until it holds >= 20 % of the cases,
then into dev until >= 20 %; the rest is train. `--write` records the assignment and the sha256 of
the test projects' files (concatenated in sorted file-name order) in corpus/split.json;
benchmarks/classifier.py refuses to run when that hash no longer matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "operators" / "failures" / "corpus"


def project_files() -> dict[str, Path]:
    return {path.stem.replace("__", "/", 1): path for path in sorted(CORPUS.glob("*.jsonl"))}


def count(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def files_sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def split(seed: int, share: float = 0.2) -> dict[str, list[str]]:
    files = project_files()
    sizes = {project: count(path) for project, path in files.items()}
    total = sum(sizes.values())
    order = sorted(files)
    random.Random(seed).shuffle(order)
    out: dict[str, list[str]] = {"test": [], "dev": [], "train": []}
    taken = {"test": 0, "dev": 0}
    for project in order:
        target = next((name for name in ("test", "dev") if taken[name] < share * total), "train")
        out[target].append(project)
        if target in taken:
            taken[target] += sizes[project]
    return {name: sorted(projects) for name, projects in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--write", action="store_true", help="write corpus/split.json")
    args = parser.parse_args()
    files = project_files()
    result = split(args.seed)
    record = {
        "seed": args.seed,
        "method": "projects shuffled with the seed; test then dev take projects until each holds >= 20% of cases; rest train",
        **result,
        "cases": {name: sum(count(files[p]) for p in projects) for name, projects in result.items()},
        "test_sha256": files_sha256([files[p] for p in result["test"]]),
    }
    text = json.dumps(record, indent=2) + "\n"
    if args.write:
        (CORPUS / "split.json").write_text(text)
    print(json.dumps({k: record[k] for k in ("seed", "cases", "test_sha256")}))


if __name__ == "__main__":
    main()
