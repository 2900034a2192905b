"""Other text models for the cases no rule decides, against the shipped precedent model.

    python benchmarks/fallback_models.py

Each spent hold-out is left out of the base in turn, as at its look; of its cases no rule decides,
prints how many each model gets right and on how many hold-outs it beats or trails the shipped
model (docs/design/classifier-evaluation.md has the table and the bar a model had to clear).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from scipy.sparse import hstack  # noqa: E402
from sklearn.base import clone  # noqa: E402
from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402

from operators.failures import classify  # noqa: E402
from operators.failures import precedent as pm  # noqa: E402
from operators.failures.cases import CORPUS_DIR, Case, load_split, load_split_cases  # noqa: E402
from operators.failures.evidence import Evidence  # noqa: E402

MODELS = ("shipped", "C 0.1", "C 1.0", "classes not balanced", "hold-outs weighted x3", "char 3-5 grams",
          "word and char grams", "10 nearest, weighted vote")


def chars() -> TfidfVectorizer:
    return TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), sublinear_tf=True, min_df=2)


def predict(model: str, base: pm.PrecedentBase, test: list[Case], from_holdout: np.ndarray) -> np.ndarray:
    """True where `model`, fitted on the cases of `base`, says infra for a case of `test`."""
    if model in ("shipped", "C 0.1", "C 1.0"):  # the shipped precedent verdict itself, with its C or another
        c_value = {"C 0.1": 0.1, "C 1.0": 1.0}.get(model, pm.C)
        return np.array([getattr(base.verdict(Evidence.parse(c.evidence), c=c_value), "kind", None) == "infra" for c in test])
    train, texts = base.texts, [pm.case_text(Evidence.parse(c.evidence)) for c in test]
    labels = np.array([c.label == "infra" for c in base.cases])
    if model == "10 nearest, weighted vote":
        vectorizer = TfidfVectorizer(token_pattern=pm._TOKENS, sublinear_tf=True)
        similarity = (vectorizer.fit_transform(train) @ vectorizer.transform(texts).T).toarray().T
        prior = labels.mean()
        votes = []
        for row in similarity:
            near = row.argsort()[::-1][:10]
            votes.append(row[near][labels[near]].sum() / prior > row[near][~labels[near]].sum() / (1 - prior))
        return np.array(votes)
    words = clone(base._model((), pm.C)[0])  # the shipped model's word grams, unfitted
    if model == "word and char grams":
        c = chars()
        x, xt = hstack([words.fit_transform(train), c.fit_transform(train)]).tocsr(), hstack([words.transform(texts), c.transform(texts)]).tocsr()
    else:
        vectorizer = chars() if model == "char 3-5 grams" else words
        x, xt = vectorizer.fit_transform(train), vectorizer.transform(texts)
    weights = np.where(from_holdout, 3.0, 1.0) if model == "hold-outs weighted x3" else None
    balance = None if model == "classes not balanced" else "balanced"
    fitted = LogisticRegression(C=pm.C, class_weight=balance, max_iter=3000).fit(x, labels, sample_weight=weights)
    return fitted.predict_proba(xt)[:, 1] > 0.5


def main() -> int:
    split = load_split(CORPUS_DIR)
    parts = {name: load_split_cases(split, name, CORPUS_DIR) for name in pm.base_splits(split)}
    right = {model: {} for model in MODELS}
    always_user = n = 0
    for left_out in split.spent:
        test = [c for c in parts[left_out] if classify(c.evidence, precedents=False).kind == "unknown"]
        if not test:
            continue
        kept = [name for name in parts if name != left_out]
        base = pm.PrecedentBase([c for name in kept for c in parts[name]])
        from_holdout = np.array([name.startswith("holdout") for name in kept for _ in parts[name]])
        truth = np.array([c.label == "infra" for c in test])
        n, always_user = n + len(test), always_user + int((~truth).sum())
        for model in MODELS:
            right[model][left_out] = int((predict(model, base, test, from_holdout) == truth).sum())
    print(f"{n} cases no rule decides, over {len(right['shipped'])} spent hold-outs; always user: {always_user}")
    shipped = right["shipped"]
    for model in MODELS:
        won = sum(right[model][h] > shipped[h] for h in shipped)
        lost = sum(right[model][h] < shipped[h] for h in shipped)
        print(f"{model:28} {sum(right[model].values()):4}   won {won:2} / lost {lost:2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
