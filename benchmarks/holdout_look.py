"""Look once at a frozen hold-out set: this checkout's classifier beside older commits', and the
blind reader, on the same cases.

    python benchmarks/holdout_look.py holdout40+holdout41 --beside 7b73516 7a3e323
    python benchmarks/holdout_look.py holdout40+holdout41 --misses

Each older classifier runs from `git archive COMMIT` in a scratch folder, on this checkout's corpus:
the same frozen cases and the same precedent base. The look prints counts only: each classifier's
figures (from its own `benchmarks/classifier.py --holdout`), how many verdicts each older one gives
differently, each part apart, and what the rules and the precedents decided beside the reader; no
case, label or evidence. `--misses` prints the cases this checkout's classifier gets wrong, and
refuses until split.json records every part as spent (its look written down first).
docs/design/classifier-evaluation.md has the procedure.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from classifier import holdout_reader  # noqa: E402  (benchmarks/ is this script's folder)
from operators.failures.cases import CORPUS_DIR, CorpusError, load_split, load_split_cases  # noqa: E402

# Run with a classifier's checkout first on sys.path: one line per case of the set, as that
# checkout's benchmark judges it (rules, then the shipped base less the set's own parts).
_VERDICTS = """
import json, sys
from pathlib import Path
root, corpus, parts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split("+")
sys.path[:0] = [str(root), str(root / "benchmarks")]
import classifier as bench
from operators.failures import precedent
from operators.failures.cases import load_split, load_split_cases
split = load_split(corpus)
base = precedent.PrecedentBase([c for name in precedent.base_splits(split) if name not in parts
                                for c in load_split_cases(split, name, corpus)])
for part in parts:
    for case in load_split_cases(split, part, corpus):
        verdict, source = bench.judge(case, base, precedent.THRESHOLD)
        print(json.dumps({"id": case.id, "kind": verdict.kind, "rule": verdict.rule, "source": source,
                          "reason": verdict.reason}))
"""


class LookError(Exception):
    """The look cannot be taken as asked (a part not frozen, misses before the look is recorded)."""


def verdicts(root: Path, corpus: Path, name: str) -> dict[str, dict]:
    """Each case's verdict by the classifier of `root`, keyed by case id."""
    out = subprocess.run([sys.executable, "-c", _VERDICTS, str(root), str(corpus), name], cwd=root,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {row["id"]: row for row in map(json.loads, out.splitlines())}


def benchmark(root: Path, corpus: Path, name: str) -> dict:
    """`benchmarks/classifier.py --holdout NAME` of `root`: its figures for the set."""
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "classifier.py"), "--holdout", name, "--corpus", str(corpus)],
                         cwd=root, capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])["splits"][name]


def archive(commit: str, into: Path) -> Path:
    """A commit's files (`git archive`), unpacked under `into`."""
    folder = into / commit
    folder.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as files:
        files.extractall(folder, filter="data")
    return folder


def tally(cases, said: dict[str, str]) -> dict:
    """Right answers over all cases, the hard ones and the others."""
    right = {c.id: said[c.id] == c.label for c in cases}
    hard = [c for c in cases if c.hard]
    easy = [c for c in cases if not c.hard]
    return {"n": len(cases), "right": sum(right.values()), "hard": (sum(right[c.id] for c in hard), len(hard)),
            "not_hard": (sum(right[c.id] for c in easy), len(easy))}  # fmt: skip


def by_source(cases, mine: dict[str, dict], reader: dict[str, str]) -> dict:
    """What the rules and the precedents decided: right, the reader on the same, always `user`."""
    rows = {}
    for source in ("rule", "precedent", "none"):
        decided = [c for c in cases if mine[c.id]["source"] == source]
        rows[source] = {"n": len(decided), "right": sum(mine[c.id]["kind"] == c.label for c in decided),
                        "reader": sum(reader.get(c.id) == c.label for c in decided),
                        "always_user": sum(c.label == "user" for c in decided)}  # fmt: skip
    return rows


def differences(cases, mine: dict[str, dict], theirs: dict[str, dict]) -> dict:
    """How many cases an older classifier judges otherwise, and how many each gets right among them."""
    changed = [c for c in cases if (mine[c.id]["kind"], mine[c.id]["rule"]) != (theirs[c.id]["kind"], theirs[c.id]["rule"])]
    return {"n": len(changed), "kind": sum(mine[c.id]["kind"] != theirs[c.id]["kind"] for c in changed),
            "right_here": sum(mine[c.id]["kind"] == c.label for c in changed),
            "right_there": sum(theirs[c.id]["kind"] == c.label for c in changed)}  # fmt: skip


def _figures(label: str, t: dict, result: dict | None = None) -> str:
    line = (f"{label}: accuracy {t['right'] / t['n']:.3f} ({t['right']} of {t['n']}), hard {t['hard'][0]} of {t['hard'][1]}, "
            f"not hard {t['not_hard'][0]} of {t['not_hard'][1]}")  # fmt: skip
    if result is not None:
        line += (f", user bugs retried as infra {result['user_bugs_retried_as_infra']} "
                 f"(+{result['user_bugs_retried_once_as_ambiguous']} once as ambiguous, "
                 f"+{result['user_bugs_retried_once_as_unknown']} once as unknown)")  # fmt: skip
    return line


def look(name: str, beside: list[str], corpus: Path) -> list[str]:
    """The look's lines: counts only."""
    split = load_split(corpus)
    parts = name.split("+")
    cases = {part: load_split_cases(split, part, corpus) for part in parts}  # verifies each part's hash
    every = [c for part in parts for c in cases[part]]
    reader = {i: r["label"] for part in parts for i, r in holdout_reader(split, part, corpus).items()}
    if len(reader) != len(every):
        raise LookError(f"{name}: {len(every) - len(reader)} of {len(every)} cases carry no blind reader's label")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "operators", "benchmarks"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    mine = verdicts(ROOT, corpus, name)
    lines = [f"{name}: {len(every)} cases, sha256 " + "+".join(split.frozen_sha256(p) for p in parts),
             _figures(f"classifier of {commit or 'this checkout'}{' (with uncommitted changes)' if dirty else ''}",
                      tally(every, {i: v["kind"] for i, v in mine.items()}), benchmark(ROOT, corpus, name))]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gangflow-look-") as scratch:
        for older in beside:
            root = archive(older, Path(scratch))
            theirs = verdicts(root, corpus, name)
            d = differences(every, mine, theirs)
            lines.append(_figures(f"classifier of {older}", tally(every, {i: v["kind"] for i, v in theirs.items()}),
                                  benchmark(root, corpus, name))
                         + f"; verdicts unlike this checkout's: {d['n']} ({d['kind']} of another kind; right here {d['right_here']}, "
                           f"there {d['right_there']})")  # fmt: skip
    lines.append(_figures("blind reader", tally(every, reader)))
    for part in parts:
        lines.append(_figures(f"{part} apart", tally(cases[part], {c.id: mine[c.id]["kind"] for c in cases[part]})))
    s = by_source(every, mine, reader)
    lines.append(f"rules decided {s['rule']['n']} (right {s['rule']['right']}; the reader {s['rule']['reader']} of the same); "
                 f"precedents {s['precedent']['n']} (right {s['precedent']['right']}; always user {s['precedent']['always_user']}; "
                 f"the reader {s['precedent']['reader']}); none {s['none']['n']}")  # fmt: skip
    return lines


def misses(name: str, corpus: Path) -> list[str]:
    """The cases this checkout's classifier gets wrong, once the look is recorded."""
    split = load_split(corpus)
    parts = name.split("+")
    unrecorded = [p for p in parts if p not in split.spent]
    if unrecorded:
        raise LookError(f"{', '.join(unrecorded)}: no look recorded in split.json's spent; take the look "
                        f"(without --misses) and record it first")  # fmt: skip
    mine = verdicts(ROOT, corpus, name)
    reader = {i: r["label"] for part in parts for i, r in holdout_reader(split, part, corpus).items()}
    lines = []
    for part in parts:
        for c in load_split_cases(split, part, corpus):
            v = mine[c.id]
            if v["kind"] != c.label:
                lines.append(f"\n=== {part} {c.id} label={c.label} hard={c.hard} said={v['kind']} rule={v['rule']} "
                             f"source={v['source']} reader={reader.get(c.id)} {c.url}\n"
                             f"why: {c.why}\nreason: {v['reason'][:300]}\nevidence: {json.dumps(dict(c.evidence))[-1500:]}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", help="the set, its parts joined by '+', e.g. holdout40+holdout41")
    parser.add_argument("--beside", nargs="*", default=[], metavar="COMMIT", help="older commits whose classifier to score beside")
    parser.add_argument("--misses", action="store_true", help="print the misses (only once split.json records the look)")
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="corpus folder (default: the package's)")
    args = parser.parse_args(argv)
    try:
        lines = misses(args.name, args.corpus) if args.misses else look(args.name, args.beside, args.corpus)
    except (LookError, CorpusError) as exc:
        print(f"benchmarks/holdout_look.py: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
