"""The public corpus of labelled failures (`corpus/*.jsonl`) and its frozen split.

One JSONL file per source project, one case per line with contract 4's evidence.
`corpus/split.json` assigns whole projects to train, dev and test (and later hold-outs), each
frozen by a sha256 that `load_split_cases` checks before it returns a held-out split.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CORPUS_DIR", "Case", "CorpusError", "Split", "load_cases", "load_split", "load_split_cases", "split_sha256",
           "test_sha256"]

CORPUS_DIR = Path(__file__).with_name("corpus")
SPLIT_FILE = "split.json"
LABELS = ("infra", "user")
SPLITS = ("train", "dev", "test")
HOLDOUT = re.compile(r"^holdout[0-9]+$")  # later hold-outs; like test, hashed in split.json and checked on load
_FIELDS = {"id": str, "project": str, "url": str, "label": str, "hard": bool, "why": str, "evidence": dict}


def _holdout_number(name: str) -> int:
    """holdout10 after holdout9: hold-outs in the order they were frozen."""
    return int(name.removeprefix("holdout"))


class CorpusError(ValueError):
    """A corpus file or the split does not have the documented shape."""


@dataclass(frozen=True)
class Case:
    id: str
    project: str
    url: str
    label: str  # "infra" | "user"
    hard: bool
    why: str
    evidence: Mapping[str, Any]
    file: str  # the corpus file it came from


@dataclass(frozen=True)
class Split:
    train: tuple[str, ...]
    dev: tuple[str, ...]
    test: tuple[str, ...]
    test_sha256: str
    holdouts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> projects
    holdout_sha256: Mapping[str, str] = field(default_factory=dict)
    spent: tuple[str, ...] = ()  # hold-outs already scored once (split.json's `spent` has their look)

    @property
    def names(self) -> tuple[str, ...]:
        return SPLITS + tuple(sorted(self.holdouts, key=_holdout_number))

    @property
    def frozen(self) -> tuple[str, ...]:
        """The splits loaded only after their hash is checked: test and the later hold-outs."""
        return ("test", *self.names[len(SPLITS):])

    def projects(self, name: str) -> tuple[str, ...]:
        return self.holdouts[name] if name in self.holdouts else getattr(self, name)

    def frozen_sha256(self, name: str) -> str:
        return self.test_sha256 if name == "test" else self.holdout_sha256[name]

    def files(self, name: str, corpus_dir: Path = CORPUS_DIR) -> list[Path]:
        if name not in self.names:
            raise CorpusError(f"split={name!r}: accepted values are {', '.join(self.names)}")
        return sorted((corpus_dir / project_file(p) for p in self.projects(name)), key=lambda p: p.name)


def project_file(project: str) -> str:
    """`owner/repo`, `owner__repo` or `owner__repo.jsonl` -> `owner__repo.jsonl`."""
    name = project.strip().replace("/", "__")
    return name if name.endswith(".jsonl") else f"{name}.jsonl"


def load_cases(paths: Iterable[Path]) -> list[Case]:
    """Parse and validate corpus files; errors name the file, the line and the field.

    Error messages never quote a case's content (the test split must stay unread)."""
    cases: list[Case] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise CorpusError(f"{path}: corpus file not found")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path.name}:{number}"
            try:
                raw = json.loads(line)
            except ValueError as exc:
                raise CorpusError(f"{where}: not a JSON object (JSON error at column {exc.colno})") from None
            cases.append(_case(raw, where, path.name))
    ids = [c.id for c in cases]
    if len(ids) != len(set(ids)):
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        raise CorpusError(f"duplicate case ids: {', '.join(dupes[:5])}")
    return cases


def _case(raw: Any, where: str, file: str) -> Case:
    if not isinstance(raw, dict):
        raise CorpusError(f"{where}: a case must be a JSON object with keys {', '.join(_FIELDS)}")
    for key, kind in _FIELDS.items():
        if key not in raw:
            raise CorpusError(f"{where}: missing field {key!r}")
        if not isinstance(raw[key], kind):
            raise CorpusError(f"{where}: field {key!r} must be a {kind.__name__}")
    if raw["label"] not in LABELS:
        raise CorpusError(f"{where}: field 'label' must be one of {', '.join(LABELS)}")
    if not raw["url"].startswith("https://"):
        raise CorpusError(f"{where}: field 'url' must be an https:// URL")
    if not raw["why"].strip() or not raw["evidence"]:
        raise CorpusError(f"{where}: fields 'why' and 'evidence' must not be empty")
    return Case(raw["id"], raw["project"], raw["url"], raw["label"], raw["hard"], raw["why"].strip(), raw["evidence"], file)


def load_split(corpus_dir: Path = CORPUS_DIR) -> Split:
    path = corpus_dir / SPLIT_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(f"{path}: the split does not exist yet") from None
    except ValueError as exc:
        raise CorpusError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CorpusError(f"{path}: must be an object with keys {', '.join(SPLITS)}, test_sha256")
    for name in SPLITS:
        value = raw.get(name)
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise CorpusError(f"{path}: field {name!r} must be a list of project names")
    holdouts = sorted(key for key in raw if HOLDOUT.match(key))
    for name in holdouts:
        value = raw[name]
        if not isinstance(value, list) or not value or not all(isinstance(p, str) for p in value):
            raise CorpusError(f"{path}: field {name!r} must be a non-empty list of project names")
    for name in ("test", *holdouts):
        if not isinstance(raw.get(f"{name}_sha256"), str) or len(raw[f"{name}_sha256"]) != 64:
            raise CorpusError(f"{path}: field '{name}_sha256' must be a sha256 hex digest")
    files = [project_file(p) for name in (*SPLITS, *holdouts) for p in raw[name]]
    if len(files) != len(set(files)):
        raise CorpusError(f"{path}: a project is in more than one split")
    looks = raw.get("spent") if isinstance(raw.get("spent"), dict) else {}
    spent = tuple(name for name in sorted(holdouts, key=_holdout_number)
                  if isinstance(looks.get(name), dict) and looks[name].get("look"))
    return Split(tuple(raw["train"]), tuple(raw["dev"]), tuple(raw["test"]), raw["test_sha256"].lower(),
                 {name: tuple(raw[name]) for name in holdouts}, {name: raw[f"{name}_sha256"].lower() for name in holdouts},
                 spent)


def split_sha256(split: Split, name: str, corpus_dir: Path = CORPUS_DIR) -> str:
    """sha256 of a split's project files, concatenated in sorted file-name order."""
    digest = hashlib.sha256()
    for path in split.files(name, corpus_dir):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def test_sha256(split: Split, corpus_dir: Path = CORPUS_DIR) -> str:
    """sha256 of the test projects' files, concatenated in sorted file-name order."""
    return split_sha256(split, "test", corpus_dir)


test_sha256.__test__ = False  # not a pytest test, despite its name


def load_split_cases(split: Split, name: str, corpus_dir: Path = CORPUS_DIR) -> list[Case]:
    """The cases of one split; for a frozen one (test, a hold-out), only after checking its hash."""
    if name in split.frozen:
        actual, frozen = split_sha256(split, name, corpus_dir), split.frozen_sha256(name)
        if actual != frozen:
            raise CorpusError(
                f"the {name} split changed: sha256 of its files is {actual}, split.json froze {frozen}; "
                f"refusing to evaluate on a {name} set that is not the frozen one"
            )
    return load_cases(split.files(name, corpus_dir))
