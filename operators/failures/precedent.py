"""Verdict by precedent: when no rule speaks, the nearest corpus cases by text similarity decide.

TF-IDF cosine similarity over the corpus's train and dev cases (never test); the `K` nearest at or
above `THRESHOLD` vote. The constants are calibrated by `benchmarks/classifier.py --calibrate`
(figures: docs/design/classifier-evaluation.md). scikit-learn is imported only on the first lookup.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from operators.failures.cases import CORPUS_DIR, Case, CorpusError, load_split, load_split_cases
from operators.failures.evidence import Evidence, one_line
from operators.failures.verdict import Verdict, clip

__all__ = ["INFRA_MARGIN", "K", "THRESHOLD", "PrecedentBase", "default_base", "lookup"]

THRESHOLD = 0.10  # chosen with K and INFRA_MARGIN by leave-project-out CV (docs/design/classifier-evaluation.md)
K = 5
# An infra verdict by precedent needs this many times the similarity weight of the user votes
# among the K nearest; a closer contest stays `unknown` (retried once). 1 is a plain majority:
# a margin of 2 chosen on dev alone cut user bugs called infra there but, across all 69 train
# and dev projects held out one at a time, cost accuracy and added unknowns for no fewer retries.
INFRA_MARGIN = 1.0
BASE_SPLITS = ("train", "dev")
MAX_TEXT = 16 * 1024

_HEX = re.compile(r"\b0x[0-9a-f]+\b|\b[0-9a-f]{12,}\b")
_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")
_PATH_DIRS = re.compile(r"(?:/[\w.@+-]+){1,64}/")  # keep a path's file name, drop its folders


def normalize(text: str) -> str:
    """Lower-cased evidence text with ids, numbers and folders masked: what generalizes."""
    text = text[-MAX_TEXT:].lower()
    text = _PATH_DIRS.sub(" / ", text)
    text = _HEX.sub(" hexid ", text)
    return _NUMBER.sub(" num ", text)


def case_text(evidence: Evidence) -> str:
    return normalize(evidence.all_text)


@dataclass(frozen=True)
class Precedent:
    case: Case
    similarity: float


class PrecedentBase:
    """A TF-IDF index over labelled cases."""

    def __init__(self, cases: Sequence[Case]):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.cases = list(cases)
        self.vectorizer = TfidfVectorizer(
            token_pattern=r"(?u)\b[a-z_][a-z0-9_]+\b", ngram_range=(1, 1), sublinear_tf=True, min_df=1
        )
        texts = [case_text(Evidence.parse(c.evidence)) for c in self.cases]
        self.matrix = self.vectorizer.fit_transform(texts) if self.cases else None

    def nearest(self, evidence: Evidence, k: int = K, exclude: Collection[str] = ()) -> list[Precedent]:
        if self.matrix is None:
            return []
        query = self.vectorizer.transform([case_text(evidence)])
        scores = (self.matrix @ query.T).toarray().ravel()  # rows are l2-normalized: cosine
        order = scores.argsort()[::-1]
        found: list[Precedent] = []
        for i in order:
            if self.cases[i].id in exclude:
                continue
            found.append(Precedent(self.cases[i], float(scores[i])))
            if len(found) == k:
                break
        return found

    def verdict(
        self,
        evidence: Evidence,
        threshold: float = THRESHOLD,
        exclude: Collection[str] = (),
        *,
        k: int = K,
        infra_margin: float = INFRA_MARGIN,
    ) -> Verdict | None:
        near = [p for p in self.nearest(evidence, k, exclude) if p.similarity >= threshold]
        if not near:
            return None
        votes = {"infra": 0.0, "user": 0.0}
        for p in near:
            votes[p.case.label] = votes.get(p.case.label, 0.0) + p.similarity
        if votes["infra"] == votes["user"]:
            return None  # a tie is no precedent
        kind = "infra" if votes["infra"] > votes["user"] else "user"
        if kind == "infra" and votes["infra"] < infra_margin * votes["user"]:
            return None  # the user precedents are too close to call it infra: stays unknown (retried once)
        best = next(p for p in near if p.case.label == kind)
        reason = f"{kind}: like {best.case.url}: {one_line(best.case.why, 200)} (similarity {best.similarity:.2f})"
        return Verdict(kind, kind != "user", clip(reason), rule="precedent")


@functools.lru_cache(maxsize=1)
def default_base() -> PrecedentBase | None:
    """The shipped base: the corpus's train and dev cases; None without a corpus split."""
    try:
        split = load_split(CORPUS_DIR)
        cases = [c for name in BASE_SPLITS for c in load_split_cases(split, name, CORPUS_DIR)]
    except (CorpusError, OSError):
        return None
    return PrecedentBase(cases) if cases else None


def lookup(evidence: Evidence, *, exclude: Collection[str] = ()) -> Verdict | None:
    """The precedent verdict for `evidence`, or None (no corpus, or nothing similar enough)."""
    base = default_base()
    return base.verdict(evidence, THRESHOLD, exclude) if base is not None else None
