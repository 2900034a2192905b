"""Verdict by precedent: when no rule speaks, the public corpus decides.

A logistic regression over the evidence's TF-IDF word 1-2 grams, trained on the corpus's train and
dev cases and the spent hold-outs (never test, never a hold-out not yet scored), says infra or user;
the reason cites the nearest case of that kind by cosine similarity. Evidence unlike every case
(below `THRESHOLD`) stays unknown. `C` and `THRESHOLD` are chosen by `benchmarks/classifier.py
--calibrate` (figures: docs/design/classifier-evaluation.md). scikit-learn is imported only on the
first lookup.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from operators.failures.cases import CORPUS_DIR, Case, CorpusError, Split, load_split, load_split_cases
from operators.failures.evidence import Evidence, one_line
from operators.failures.verdict import Verdict, clip

__all__ = ["C", "THRESHOLD", "PrecedentBase", "base_splits", "default_base", "lookup"]

THRESHOLD = 0.10  # the nearest case's cosine similarity below which no precedent speaks
C = 0.3  # the model's inverse regularisation; with THRESHOLD, chosen by leave-project-out CV
MAX_TEXT = 16 * 1024
_TOKENS = r"(?u)\b[a-z_][a-z0-9_]+\b"
_MODELS_KEPT = 8  # fitted models kept per base, by the case ids left out (leave-one-out scoring refits)

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
    """Labelled cases: a TF-IDF index of their text (the nearest case, cited) and a logistic
    regression over the same text (the kind)."""

    def __init__(self, cases: Sequence[Case]):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.cases = list(cases)
        self.texts = [case_text(Evidence.parse(c.evidence)) for c in self.cases]
        self.vectorizer = TfidfVectorizer(token_pattern=_TOKENS, ngram_range=(1, 1), sublinear_tf=True, min_df=1)
        self.matrix = self.vectorizer.fit_transform(self.texts) if self.cases else None
        self._models: dict[tuple[frozenset[str], float], Any] = {}

    def nearest(self, evidence: Evidence, k: int = 5, exclude: Collection[str] = ()) -> list[Precedent]:
        return self._nearest(case_text(evidence), k, exclude)

    def _nearest(self, text: str, k: int, exclude: Collection[str]) -> list[Precedent]:
        if self.matrix is None:
            return []
        query = self.vectorizer.transform([text])
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

    def _model(self, exclude: Collection[str], c: float):
        """(vectorizer, classifier) fitted on the cases not in `exclude`; None when one label is missing."""
        key = (frozenset(exclude), c)
        if key not in self._models:
            from sklearn.feature_extraction.text import TfidfVectorizer
            from sklearn.linear_model import LogisticRegression

            kept = [i for i, case in enumerate(self.cases) if case.id not in key[0]]
            labels = [self.cases[i].label == "infra" for i in kept]
            fitted = None
            if len(set(labels)) == 2:
                # words seen once are noise at this corpus size; a tiny base keeps them
                vectorizer = TfidfVectorizer(token_pattern=_TOKENS, ngram_range=(1, 2), sublinear_tf=True,
                                             min_df=2 if len(kept) >= 50 else 1)
                features = vectorizer.fit_transform([self.texts[i] for i in kept])
                model = LogisticRegression(C=c, class_weight="balanced", max_iter=2000).fit(features, labels)
                fitted = (vectorizer, model)
            if len(self._models) >= _MODELS_KEPT:
                self._models.pop(next(iter(self._models)))
            self._models[key] = fitted
        return self._models[key]

    def verdict(
        self, evidence: Evidence, threshold: float = THRESHOLD, exclude: Collection[str] = (), *, c: float = C
    ) -> Verdict | None:
        text = case_text(evidence)
        near = self._nearest(text, len(self.cases), exclude)  # all of them: the nearest of the model's kind is cited
        if not near or near[0].similarity < threshold:
            return None  # unlike every case: no precedent
        fitted = self._model(exclude, c)
        if fitted is None:
            return None
        vectorizer, model = fitted
        infra = float(model.predict_proba(vectorizer.transform([text]))[0][list(model.classes_).index(True)])
        if infra == 0.5:
            return None
        kind = "infra" if infra > 0.5 else "user"
        best = next(p for p in near if p.case.label == kind)  # the model saw both labels: one exists
        reason = (f"{kind}: like {best.case.url}: {one_line(best.case.why, 200)} (similarity {best.similarity:.2f}; "
                  f"the corpus's model: infra {infra:.2f})")
        return Verdict(kind, kind != "user", clip(reason), rule="precedent")


def base_splits(split: Split) -> tuple[str, ...]:
    """The splits precedents come from: train, dev, and every hold-out already scored once (spent as a
    test, it is training data); never test, never a hold-out still waiting for its one look."""
    return ("train", "dev", *split.spent)


@functools.lru_cache(maxsize=1)
def default_base() -> PrecedentBase | None:
    """The shipped base: the corpus's train, dev and spent hold-out cases; None without a corpus split."""
    try:
        split = load_split(CORPUS_DIR)
        cases = [c for name in base_splits(split) for c in load_split_cases(split, name, CORPUS_DIR)]
    except (CorpusError, OSError):
        return None
    return PrecedentBase(cases) if cases else None


def lookup(evidence: Evidence, *, exclude: Collection[str] = ()) -> Verdict | None:
    """The precedent verdict for `evidence`, or None (no corpus, or nothing similar enough)."""
    base = default_base()
    return base.verdict(evidence, THRESHOLD, exclude) if base is not None else None
