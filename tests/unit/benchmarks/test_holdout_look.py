"""benchmarks/holdout_look.py on a small corpus: the look prints counts only, and the misses wait
until split.json records the look."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmark_modules import benchmark_module
from holdout_corpus import SECRET_LOG, case, small_corpus

ROOT = Path(__file__).resolve().parents[3]
harvest = benchmark_module("holdout_harvest")
holdout_look = benchmark_module("holdout_look")


@pytest.fixture
def corpus(tmp_path) -> Path:
    return small_corpus(tmp_path / "corpus")


def frozen(corpus: Path, tmp_path: Path) -> None:
    """holdout9: an infra case (the Xid log) labelled infra and one labelled user; the reader says infra."""
    workspace = tmp_path / "ws"
    harvest.start("holdout9", workspace, corpus)
    rows = [case("new/one"), case("new/two", label="user", hard=True)]
    (workspace / "part1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    harvest.prepare("holdout9", workspace, seed=5)
    keys = json.loads((workspace / "keys.json").read_text())
    (workspace / "reader-output.jsonl").write_text(
        "".join(json.dumps({"key": k, "label": "infra", "confidence": 0.8, "why": "xid"}) + "\n" for k in keys))
    harvest.freeze("holdout9", workspace, corpus)


def test_the_look_prints_counts_only(corpus, tmp_path, capsys):
    frozen(corpus, tmp_path)
    assert holdout_look.main(["holdout9", "--corpus", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert SECRET_LOG not in out and "new/one" not in out and "new__one" not in out
    assert "accuracy 0.500 (1 of 2), hard 0 of 1, not hard 1 of 1" in out  # the classifier: infra twice
    assert "blind reader: accuracy 0.500 (1 of 2)" in out
    assert "rules decided 2 (right 1; the reader 1 of the same)" in out


def test_the_misses_wait_for_the_look_to_be_recorded(corpus, tmp_path, capsys):
    frozen(corpus, tmp_path)
    assert holdout_look.main(["holdout9", "--misses", "--corpus", str(corpus)]) == 2
    said = capsys.readouterr()
    assert "holdout9: no look recorded in split.json's spent" in said.err and SECRET_LOG not in said.out + said.err
    split = json.loads((corpus / "split.json").read_text())
    split["spent"] = {"holdout9": {"look": "scored once"}}
    (corpus / "split.json").write_text(json.dumps(split))
    assert holdout_look.main(["holdout9", "--misses", "--corpus", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert "=== holdout9 new__two-7 label=user hard=True said=infra rule=gpu-hardware" in out and "new__one" not in out


def test_an_older_classifier_is_compared_case_by_case():
    cases = [SimpleNamespace(id=i, label=label, hard=False) for i, label in (("a", "infra"), ("b", "user"), ("c", "user"))]
    mine = {"a": {"kind": "infra", "rule": "gpu-hardware"}, "b": {"kind": "user", "rule": "cuda-oom"}, "c": {"kind": "infra", "rule": "precedent"}}
    theirs = mine | {"b": {"kind": "user", "rule": "precedent"}, "c": {"kind": "user", "rule": "precedent"}}
    assert holdout_look.differences(cases, mine, theirs) == {"n": 2, "kind": 1, "right_here": 1, "right_there": 2}


def test_a_commit_is_unpacked_from_git(tmp_path):
    folder = holdout_look.archive("HEAD", tmp_path)
    assert (folder / "benchmarks" / "classifier.py").is_file() and (folder / "operators" / "failures" / "rules.py").is_file()
