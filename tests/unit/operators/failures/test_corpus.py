"""The corpus loader, the frozen split, the precedent matcher and the classifier benchmark.

Synthetic corpora exercise the machinery; the real corpus is checked only through its train and
dev files (the test split's cases are never read by tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
from pathlib import Path

import pytest
from benchmark_modules import benchmark_module

from operators.failures import cases as corpus
from operators.failures.cases import CorpusError, load_cases, load_split, load_split_cases, test_sha256
from operators.failures.evidence import Evidence
from operators.failures.precedent import PrecedentBase

PROJECT_ROOT = Path(__file__).resolve().parents[4]
classifier_benchmark = benchmark_module("classifier")


def case(i: int, label: str, log: str, project: str = "acme/train", hard: bool = False) -> dict:
    return {
        "id": f"{project.replace('/', '__')}-{i}",
        "project": project,
        "url": f"https://github.com/{project}/issues/{i}",
        "label": label,
        "hard": hard,
        "why": f"case {i} is {label}",
        "evidence": {"exit_code": 1, "log_tail": log},
    }


def write(folder: Path, project: str, rows: list[dict]) -> Path:
    path = folder / f"{project.replace('/', '__')}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def synthetic(tmp_path) -> Path:
    write(tmp_path, "acme/train", [
        case(1, "infra", "quux frobnicator lost its lease on the widget bus", "acme/train"),
        case(2, "user", "zorp config field wibble has no value for the plumbus", "acme/train"),
        case(3, "infra", "RuntimeError: NCCL watchdog timed out", "acme/train"),
    ])  # fmt: skip
    write(tmp_path, "acme/dev", [case(1, "infra", "quux frobnicator lost its lease on the widget bus again", "acme/dev")])
    test = write(tmp_path, "acme/test", [case(1, "user", "zorp config field wibble has no value", "acme/test")])
    split = {"train": ["acme/train"], "dev": ["acme/dev"], "test": ["acme/test"],
             "test_sha256": hashlib.sha256(test.read_bytes()).hexdigest()}  # fmt: skip
    (tmp_path / "split.json").write_text(json.dumps(split))
    return tmp_path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.pop("label"), "missing field 'label'"),
        (lambda c: c.update(label="maybe"), "field 'label' must be one of infra, user"),
        (lambda c: c.update(hard="yes"), "field 'hard' must be a bool"),
        (lambda c: c.update(evidence="exit 1"), "field 'evidence' must be a dict"),
        (lambda c: c.update(url="github.com/x"), "field 'url' must be an https:// URL"),
    ],
)
def test_loader_names_file_line_and_field(tmp_path, mutate, message):
    rows = [case(1, "infra", "a"), case(2, "user", "b")]
    mutate(rows[1])
    path = write(tmp_path, "acme/train", rows)
    with pytest.raises(CorpusError) as info:
        load_cases([path])
    assert str(info.value) == f"acme__train.jsonl:2: {message}"


def test_loader_rejects_duplicate_ids_and_non_json(tmp_path):
    with pytest.raises(CorpusError, match="duplicate case ids: acme__train-1"):
        load_cases([write(tmp_path, "acme/train", [case(1, "infra", "a"), case(1, "user", "b")])])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": \n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: not a JSON object"):
        load_cases([bad])


def test_split_hash_is_verified_before_test_cases_load(synthetic):
    split = load_split(synthetic)
    assert test_sha256(split, synthetic) == split.test_sha256
    assert [c.label for c in load_split_cases(split, "test", synthetic)] == ["user"]
    with (synthetic / "acme__test.jsonl").open("a") as fh:
        fh.write(json.dumps(case(2, "infra", "x", "acme/test")) + "\n")
    with pytest.raises(CorpusError, match="the test split changed"):
        load_split_cases(split, "test", synthetic)
    assert load_split_cases(split, "train", synthetic)  # the other splits do not depend on it


def test_split_rejects_a_project_in_two_splits(synthetic):
    split = json.loads((synthetic / "split.json").read_text())
    split["dev"].append("acme/train")
    (synthetic / "split.json").write_text(json.dumps(split))
    with pytest.raises(CorpusError, match="more than one split"):
        load_split(synthetic)


def test_precedent_decides_above_the_threshold_and_cites_the_case(synthetic):
    split = load_split(synthetic)
    base = PrecedentBase(load_split_cases(split, "train", synthetic))
    similar = Evidence.parse({"log_tail": "the quux frobnicator lost its lease"})
    verdict = base.verdict(similar, threshold=0.2)
    assert (verdict.kind, verdict.retryable, verdict.rule) == ("infra", True, "precedent")
    assert verdict.reason.startswith("infra: like https://github.com/acme/train/issues/1: case 1 is infra (similarity ")
    assert base.verdict(Evidence.parse({"log_tail": "completely unrelated words here"}), threshold=0.2) is None
    assert base.verdict(similar, threshold=0.99) is None
    assert base.verdict(similar, threshold=0.2, exclude={"acme__train-1"}) is None  # leave-one-out


def test_the_model_decides_the_kind_and_the_nearest_case_of_that_kind_is_cited(tmp_path):
    """The nearest case alone would say user (three rare words shared); the words that recur across
    the corpus say infra, and the verdict cites the nearest infra case."""
    rows = [case(i, "infra", f"connection reset by peer {where}", "acme/a") for i, where in enumerate(
        ("while reading shard one", "while writing shard two", "during the allreduce", "at the barrier",
         "in the data loader", "on upload"), start=1)]  # fmt: skip
    rows += [case(7, "user", "gamma delta epsilon: config value missing", "acme/a"),
             case(8, "user", "config value missing for the loader", "acme/a"),
             case(9, "user", "config value missing for the optimizer", "acme/a")]  # fmt: skip
    base = PrecedentBase(load_cases([write(tmp_path, "acme/a", rows)]))
    mixed = Evidence.parse({"log_tail": "connection reset by peer gamma delta epsilon"})
    assert base.nearest(mixed, 1)[0].case.id == "acme__a-7"  # the nearest case is the user's
    verdict = base.verdict(mixed, threshold=0.05, c=10.0)
    assert (verdict.kind, verdict.rule) == ("infra", "precedent"), verdict.reason
    assert "is infra (similarity" in verdict.reason and "the corpus's model: infra 0.6" in verdict.reason
    config = base.verdict(Evidence.parse({"log_tail": "config value missing for the scheduler"}), threshold=0.05, c=10.0)
    assert config.kind == "user" and not config.retryable
    # a base of one label has no model: no precedent, whatever the similarity
    one_label = PrecedentBase(load_cases([write(tmp_path, "acme/b", rows[:6])]))
    assert one_label.verdict(Evidence.parse({"log_tail": "connection reset by peer"}), threshold=0.05) is None


def run_benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/classifier.py's command line, run in this process (an interpreter and its imports
    for each run cost more than the runs): exit status, stdout and stderr as the shell sees them."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = classifier_benchmark.main(list(args))
        except SystemExit as exc:  # argparse's refusals
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["benchmarks/classifier.py", *args], code, out.getvalue(), err.getvalue())


def test_benchmark_reports_each_split_and_refuses_a_changed_test_split(synthetic):
    proc = run_benchmark("--corpus", str(synthetic), "--test")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["splits"]) == {"train", "dev", "test"}
    test = result["splits"]["test"]
    assert test["n"] == 1 and set(test["confusion"]) == {"infra", "user"}
    assert {"accuracy", "unknown_rate", "user_bugs_retried", "per_class"} <= set(test)
    assert test["user_bugs_retried"] == test["user_bugs_retried_as_infra"] + test["user_bugs_retried_once_as_unknown"]
    assert "MISS [test]" not in proc.stderr
    (synthetic / "acme__test.jsonl").write_text("")
    proc = run_benchmark("--corpus", str(synthetic), "--test")
    assert proc.returncode == 2 and "the test split changed" in proc.stderr and proc.stdout == ""


def test_benchmark_can_score_train_without_a_cases_own_project_as_precedent(synthetic):
    proc = run_benchmark("--corpus", str(synthetic), "--leave-project-out")
    assert proc.returncode == 0, proc.stderr
    splits = json.loads(proc.stdout.strip().splitlines()[-1])["splits"]
    assert set(splits) == {"train", "train_leave_project_out", "dev"}
    assert splits["train_leave_project_out"]["n"] == splits["train"]["n"] == 3


# -- the real corpus (train and dev only) ---------------------------------------------------------

REAL_SPLIT = corpus.CORPUS_DIR / corpus.SPLIT_FILE
needs_split = pytest.mark.skipif(not REAL_SPLIT.is_file(), reason="the corpus split is not frozen yet")


@needs_split
def test_real_train_and_dev_files_are_valid():
    split = load_split()
    for name in ("train", "dev"):
        cases = load_split_cases(split, name)
        assert cases, name
        assert {c.label for c in cases} == {"infra", "user"}


@needs_split
def test_the_shipped_precedent_base_holds_the_spent_holdouts_and_never_test_or_an_unscored_one():
    from operators.failures import precedent

    split = load_split()
    base = precedent.default_base()
    held_out = {p.name for name in split.names if name not in ("train", "dev", *split.spent) for p in split.files(name)}
    spent = {p.name for name in split.spent for p in split.files(name)}
    assert base is not None and base.cases and spent
    assert {p.name for p in split.files("test")} <= held_out
    assert not {c.file for c in base.cases} & held_out
    assert spent <= {c.file for c in base.cases}


def test_the_corpus_ships_with_the_package():
    import tomllib

    data = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["operators.failures"]
    assert "corpus/*.jsonl" in patterns and "corpus/*.json" in patterns


# -- a later hold-out (holdout2): frozen like test, never a precedent ------------------------------


def with_holdout(folder: Path) -> Path:
    held = write(folder, "acme/held", [case(1, "infra", "quux frobnicator lost its lease", "acme/held")])
    split = json.loads((folder / "split.json").read_text())
    split |= {"holdout2": ["acme/held"], "holdout2_sha256": hashlib.sha256(held.read_bytes()).hexdigest()}
    (folder / "split.json").write_text(json.dumps(split))
    return held


def test_holdout2_hash_is_verified_before_its_cases_load(synthetic):
    held = with_holdout(synthetic)
    split = load_split(synthetic)
    assert [c.label for c in load_split_cases(split, "holdout2", synthetic)] == ["infra"]
    with held.open("a") as fh:
        fh.write(json.dumps(case(2, "user", "x", "acme/held")) + "\n")
    with pytest.raises(CorpusError, match="the holdout2 split changed"):
        load_split_cases(split, "holdout2", synthetic)
    assert load_split_cases(split, "test", synthetic)  # the test split does not depend on it


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.pop("holdout2_sha256"), "holdout2_sha256"),
    (lambda s: s.update(holdout2=[]), "non-empty list"),
    (lambda s: s["holdout2"].append("acme/test"), "more than one split"),
])  # fmt: skip
def test_split_rejects_a_malformed_holdout2(synthetic, mutate, message):
    with_holdout(synthetic)
    split = json.loads((synthetic / "split.json").read_text())
    mutate(split)
    (synthetic / "split.json").write_text(json.dumps(split))
    with pytest.raises(CorpusError, match=message):
        load_split(synthetic)


def test_a_split_without_holdout2_refuses_to_load_it(synthetic):
    with pytest.raises(CorpusError, match="accepted values are train, dev, test$"):
        load_split_cases(load_split(synthetic), "holdout2", synthetic)


def test_holdouts_are_frozen_in_number_order_and_each_checked_by_its_own_hash(synthetic):
    with_holdout(synthetic)
    later = write(synthetic, "acme/later", [case(1, "user", "zorp config wibble", "acme/later")])
    raw = json.loads((synthetic / "split.json").read_text())
    raw |= {"holdout10": ["acme/later"], "holdout10_sha256": hashlib.sha256(later.read_bytes()).hexdigest()}
    (synthetic / "split.json").write_text(json.dumps(raw))
    split = load_split(synthetic)
    assert split.names == ("train", "dev", "test", "holdout2", "holdout10")
    assert split.frozen == ("test", "holdout2", "holdout10")
    later.write_text("")
    with pytest.raises(CorpusError, match="the holdout10 split changed"):
        load_split_cases(split, "holdout10", synthetic)
    assert load_split_cases(split, "holdout2", synthetic)


def spend(folder: Path, name: str) -> None:
    raw = json.loads((folder / "split.json").read_text())
    raw.setdefault("spent", {})[name] = {"look": "scored once"}
    (folder / "split.json").write_text(json.dumps(raw))


def test_a_holdout_is_a_precedent_only_once_its_look_is_recorded(synthetic):
    from operators.failures.precedent import base_splits

    with_holdout(synthetic)
    assert base_splits(load_split(synthetic)) == ("train", "dev")
    spend(synthetic, "holdout2")
    assert base_splits(load_split(synthetic)) == ("train", "dev", "holdout2")


def test_benchmark_scores_spent_holdouts_with_each_other_as_precedents_never_themselves(synthetic):
    """Spent, holdout2 and holdout3 are in the shipped base: each finds the other's case, alike in
    words, as its precedent; holdout3's case unlike every other stays unknown rather than find itself."""
    raw = json.loads((synthetic / "split.json").read_text())
    for name, project, rows in (("holdout2", "acme/h2", [case(1, "infra", "xyzzy gronk blorfle snark", "acme/h2")]),
                                ("holdout3", "acme/h3", [case(1, "infra", "xyzzy gronk blorfle snark again", "acme/h3"),
                                                         case(2, "user", "plonk wazoo fizzbin", "acme/h3")])):
        path = write(synthetic, project, rows)
        raw |= {name: [project], f"{name}_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (synthetic / "split.json").write_text(json.dumps(raw))
    spend(synthetic, "holdout2")
    spend(synthetic, "holdout3")
    proc = run_benchmark("--corpus", str(synthetic), "--holdout", "holdout2", "--holdout", "holdout3")
    assert proc.returncode == 0, proc.stderr
    splits = json.loads(proc.stdout.strip().splitlines()[-1])["splits"]
    assert splits["holdout2"]["by_source"]["precedent"] == {"n": 1, "correct": 1}
    assert splits["holdout3"]["by_source"]["precedent"] == {"n": 1, "correct": 1}
    assert splits["holdout3"]["by_source"]["none"]["n"] == 1


def test_benchmark_scores_holdout2_with_the_shipped_base_and_refuses_a_changed_one(synthetic):
    held = with_holdout(synthetic)
    proc = run_benchmark("--corpus", str(synthetic), "--holdout", "holdout2", "--show-errors")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["splits"]) == {"train", "dev", "holdout2"}
    assert result["splits"]["holdout2"]["n"] == 1 and "goals_met_on_holdout2" in result
    assert result["holdout2_sha256"] == hashlib.sha256(held.read_bytes()).hexdigest()
    assert "[holdout2]" not in proc.stderr  # its misses are never printed
    held.write_text(held.read_text().replace("lease", "lease!"))
    proc = run_benchmark("--corpus", str(synthetic), "--holdout", "holdout2")
    assert proc.returncode == 2 and "the holdout2 split changed" in proc.stderr and proc.stdout == ""


def test_benchmark_scores_two_holdouts_as_one_set_each_checked_by_its_own_hash(synthetic):
    """`--holdout holdout2+holdout3` pools two unspent hold-outs: one table, their reader labels
    merged, both hashes reported, and a changed file in either refuses the run."""
    raw = json.loads((synthetic / "split.json").read_text())
    paths = {}
    for name, project, label in (("holdout2", "acme/h2", "infra"), ("holdout3", "acme/h3", "user")):
        row = case(1, label, f"glorp {name} wibble", project) | {"reader": {"label": "infra", "confidence": 0.9}}
        paths[name] = write(synthetic, project, [row])
        raw |= {name: [project], f"{name}_sha256": hashlib.sha256(paths[name].read_bytes()).hexdigest()}
    (synthetic / "split.json").write_text(json.dumps(raw))
    proc = run_benchmark("--corpus", str(synthetic), "--holdout", "holdout2+holdout3")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    pooled = result["splits"]["holdout2+holdout3"]
    assert pooled["n"] == 2 and pooled["per_class"]["infra"]["n"] == pooled["per_class"]["user"]["n"] == 1
    assert pooled["blind_reader"]["n"] == 2 and pooled["blind_reader"]["accuracy"] == 0.5
    assert result["holdout2+holdout3_sha256"] == f"{raw['holdout2_sha256']}+{raw['holdout3_sha256']}"
    paths["holdout3"].write_text(paths["holdout3"].read_text().replace("wibble", "wobble"))
    proc = run_benchmark("--corpus", str(synthetic), "--holdout", "holdout2+holdout3")
    assert proc.returncode == 2 and "the holdout3 split changed" in proc.stderr


@needs_split
def test_the_blind_reader_saw_train_and_dev_cases_only():
    """The blind reader's labels (benchmarks/data/classifier_blind_reader.jsonl) cover train and
    dev cases, never a test or hold-out one, each line of the shape --blind-reader reads."""
    split = load_split()
    seen = set(classifier_benchmark.load_blind_reader(classifier_benchmark.BLIND_READER))
    train_dev = {c.id for name in ("train", "dev") for c in load_split_cases(split, name)}
    assert seen and seen <= train_dev


def test_benchmark_scores_the_blind_reader_beside_the_classifier_on_the_same_cases(synthetic, tmp_path, monkeypatch):
    """--blind-reader: the reader's label and the classifier's verdict on each labelled train and
    dev case, hard and not hard apart; an unlabelled case is left out, a malformed line refused."""
    reader = tmp_path / "reader.jsonl"
    reader.write_text("".join(json.dumps({"id": i, "label": label, "confidence": 0.8, "signal": "s"}) + "\n" for i, label in (
        ("acme__train-1", "user"), ("acme__train-2", "user"), ("acme__dev-1", "infra"))))  # fmt: skip
    monkeypatch.setattr(classifier_benchmark, "BLIND_READER", reader)
    proc = run_benchmark("--corpus", str(synthetic), "--blind-reader")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])["blind_reader"]
    assert set(result) == {"train", "dev"} and (result["train"]["n"], result["dev"]["n"]) == (2, 1)
    assert result["train"]["reader"]["accuracy"] == 0.5 and result["dev"]["reader"]["accuracy"] == 1.0
    for r in result.values():
        assert sum(r["agreement"].values()) == r["n"]
        for who in ("reader", "classifier"):
            assert r[who]["hard"]["n"] + r[who]["not_hard"]["n"] == r["n"]
    assert result["train"]["reader"]["user_bugs_retried"] == 0
    reader.write_text('{"id": "acme__train-1", "label": "maybe"}\n')
    proc = run_benchmark("--corpus", str(synthetic), "--blind-reader")
    assert proc.returncode == 2 and "expected {id, label: infra|user" in proc.stderr


def test_benchmark_fallback_scores_each_spent_holdout_without_itself_on_the_cases_no_rule_decides(synthetic):
    """holdout2's case finds holdout3's as its precedent (and the reverse); the NCCL case a rule decides is not counted."""
    raw = json.loads((synthetic / "split.json").read_text())
    for name, project, rows in (("holdout2", "acme/h2", [case(1, "user", "xyzzy gronk blorfle snark", "acme/h2"),
                                                         case(2, "infra", "RuntimeError: NCCL watchdog timed out", "acme/h2")]),
                                ("holdout3", "acme/h3", [case(1, "user", "xyzzy gronk blorfle snark again", "acme/h3")])):
        path = write(synthetic, project, rows)
        raw |= {name: [project], f"{name}_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (synthetic / "split.json").write_text(json.dumps(raw))
    spend(synthetic, "holdout2")
    spend(synthetic, "holdout3")
    proc = run_benchmark("--corpus", str(synthetic), "--fallback")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])["fallback"]
    assert found["holdout2"] == {"n": 1, "precedents": 1, "always_user": 1}
    assert found["all"] == {"n": 2, "precedents": 2, "always_user": 2}
