"""benchmarks/holdout_harvest.py on a small corpus: what it keeps, what it freezes, and that it
prints counts and the hash only."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from benchmark_modules import benchmark_module
from holdout_corpus import SECRET_LOG, case, small_corpus

from operators.failures.cases import load_split, load_split_cases

ROOT = Path(__file__).resolve().parents[3]
harvest = benchmark_module("holdout_harvest")


@pytest.fixture
def corpus(tmp_path) -> Path:
    return small_corpus(tmp_path / "corpus")


def test_start_excludes_every_project_of_the_corpus_and_the_split(corpus, tmp_path):
    workspace = tmp_path / "ws"
    harvest.start("holdout9", workspace, corpus)
    excluded = (workspace / "excluded.txt").read_text().split()
    assert excluded == ["old/holdout", "own/dev", "own/test", "own/train"]
    brief = (workspace / "brief.md").read_text()
    assert f"{workspace}/claimed.txt" in brief and "(holdout9)" in brief
    assert "never cut lines at the end" in brief and "not even in general words" in brief
    assert f"{workspace}/reader-input.jsonl" in (workspace / "READER.md").read_text()


def test_start_writes_each_helpers_prompt_and_a_project_check_that_reads_names_literally(corpus, tmp_path):
    workspace = tmp_path / "ws"
    harvest.start("holdout9", workspace, corpus)
    brief = (workspace / "brief.md").read_text()
    prompts = sorted(workspace.glob("prompt*.md"))
    assert [p.name for p in prompts] == [f"prompt{i}.md" for i in range(1, 9)]
    third = (workspace / "prompt3.md").read_text()
    assert third.startswith(brief) and "**cloud storage and networking; dataset and model downloads**" in third
    assert f"{workspace}/part3.jsonl" in third and f"{workspace}/chk.sh owner/repo" in third
    (workspace / "claimed.txt").write_text("new/one\n")
    check = subprocess.run(["bash", str(workspace / "chk.sh"), "OWN/train", "new/one", "new/two", "own/tra.n", "-x"],
                           capture_output=True, text=True)  # fmt: skip
    assert check.stdout.split("\n")[:5] == ["OWN/train EXCLUDED", "new/one CLAIMED", "new/two ok", "own/tra.n ok", "-x ok"]
    assert check.returncode == 1


def test_start_gives_the_helpers_the_look_up_cap_the_plan_names(corpus, tmp_path, capsys):
    assert harvest.main(["start", "holdout9", "--workspace", str(tmp_path / "ws"), "--corpus", str(corpus),
                         "--lookups", "50"]) == 0  # fmt: skip
    brief = (tmp_path / "ws" / "brief.md").read_text()
    assert "no more than 50 look-ups" in brief and "70" not in brief
    with pytest.raises(SystemExit):
        harvest.main(["start", "holdout9", "--workspace", str(tmp_path / "ws"), "--lookups", "0"])
    assert "--lookups must be a positive number" in capsys.readouterr().err


def test_prepare_keeps_the_briefs_shape_and_shows_the_reader_evidence_only(corpus, tmp_path):
    workspace = tmp_path / "ws"
    harvest.start("holdout9", workspace, corpus)
    lines = [case("new/one"), case("new/two", 12, label="user", hard=True),
             case("Own/Train"),  # an excluded project, in other letters
             case("new/one", 8),  # the same project twice
             case("new/three", url="https://gitlab.com/new/three/issues/7"),
             case("new/four") | {"comment": "extra key"},
             case("new/five", id="new__five-99"),
             case("new/six", evidence={"log_tail": SECRET_LOG, "exit_code": "1"})]  # fmt: skip
    (workspace / "part1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "{not json\n")
    said = harvest.prepare("holdout9", workspace, seed=5)
    assert said.startswith("holdout9: kept 2 (1 infra / 1 user, 1 hard); dropped 7")
    assert SECRET_LOG not in said and "new/one" not in said
    shown = [json.loads(line) for line in (workspace / "reader-input.jsonl").read_text().splitlines()]
    assert [set(row) for row in shown] == [{"key", "evidence"}] * 2
    keys = json.loads((workspace / "keys.json").read_text())
    assert sorted(keys.values()) == ["new__one-7", "new__two-12"]
    again = tmp_path / "again"
    harvest.start("holdout9", again, corpus)
    (again / "part1.jsonl").write_text((workspace / "part1.jsonl").read_text())
    harvest.prepare("holdout9", again, seed=5)
    assert json.loads((again / "keys.json").read_text()) == keys  # the seed fixes the order


def test_freeze_writes_the_set_with_the_readers_labels_under_a_hash_the_loader_checks(corpus, tmp_path):
    workspace = tmp_path / "ws"
    harvest.start("holdout9", workspace, corpus)
    (workspace / "part1.jsonl").write_text(json.dumps(case("new/one")) + "\n" + json.dumps(case("new/two", label="user")) + "\n")
    harvest.prepare("holdout9", workspace, seed=5)
    keys = json.loads((workspace / "keys.json").read_text())
    (workspace / "reader-output.jsonl").write_text(
        "".join(json.dumps({"key": k, "label": "infra", "confidence": 0.8, "why": "xid"}) + "\n" for k in keys))
    said = harvest.freeze("holdout9", workspace, corpus)
    split = load_split(corpus)
    assert split.holdouts["holdout9"] == ("new/one", "new/two")
    assert said.endswith(f"sha256 {split.holdout_sha256['holdout9']}") and SECRET_LOG not in said
    assert "2 cases (1 infra / 1 user, 0 hard); reader 2 infra / 0 user" in said
    frozen = load_split_cases(split, "holdout9", corpus)  # raises if the hash does not match the files
    assert [c.id for c in frozen] == ["new__one-7", "new__two-7"]
    row = json.loads((corpus / "new__one.jsonl").read_text())
    assert row["reader"] == {"label": "infra", "confidence": 0.8}
    with pytest.raises(harvest.HarvestError, match="holdout9 is in split.json already"):
        harvest.freeze("holdout9", workspace, corpus)


def test_freeze_refuses_a_reader_that_skipped_a_case_and_writes_nothing(corpus, tmp_path):
    workspace = tmp_path / "ws"
    harvest.start("holdout9", workspace, corpus)
    (workspace / "part1.jsonl").write_text(json.dumps(case("new/one")) + "\n" + json.dumps(case("new/two")) + "\n")
    harvest.prepare("holdout9", workspace, seed=5)
    first = next(iter(json.loads((workspace / "keys.json").read_text())))
    (workspace / "reader-output.jsonl").write_text(json.dumps({"key": first, "label": "user", "confidence": 0.6}) + "\n")
    split_before = (corpus / "split.json").read_text()
    with pytest.raises(harvest.HarvestError, match="answers 1 of 2 keys"):
        harvest.freeze("holdout9", workspace, corpus)
    assert (corpus / "split.json").read_text() == split_before
    assert not (corpus / "new__one.jsonl").exists()
    assert harvest.main(["freeze", "holdout9", "--workspace", str(workspace), "--corpus", str(corpus)]) == 2
