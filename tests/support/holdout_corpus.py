"""A small failure corpus for the hold-out tools' tests: train, dev and test of one case each, an
old hold-out, and harvested rows whose evidence must never be printed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SECRET_LOG = "Xid 79: GPU has fallen off the bus (only in the case file)"


def case(project: str, number: int = 7, **change) -> dict:
    """A harvested row of the brief's shape: infra, not hard, the secret log as its evidence."""
    row = {"id": f"{project.replace('/', '__')}-{number}", "project": project,
           "url": f"https://github.com/{project}/issues/{number}", "label": "infra", "hard": False,
           "why": "the node's GPU was replaced", "evidence": {"log_tail": SECRET_LOG, "exit_code": 1}}  # fmt: skip
    return row | change


def small_corpus(folder: Path) -> Path:
    """Write the corpus under `folder` (train, dev and test one user case each; holdout3 frozen)."""
    folder.mkdir()
    for project in ("own/train", "own/dev", "own/test"):
        base = case(project) | {"label": "user"}
        (folder / f"{project.replace('/', '__')}.jsonl").write_text(json.dumps(base) + "\n")
    test_hash = hashlib.sha256((folder / "own__test.jsonl").read_bytes()).hexdigest()
    split = {"seed": 1, "train": ["own/train"], "dev": ["own/dev"], "test": ["own/test"], "test_sha256": test_hash,
             "holdout3": ["Old/Holdout"], "holdout3_sha256": "0" * 64}  # fmt: skip
    (folder / "split.json").write_text(json.dumps(split, indent=2) + "\n")
    return folder
