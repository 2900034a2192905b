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
from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402

from operators.failures import classify  # noqa: E402
from operators.failures import precedent as pm  # noqa: E402
from operators.failures.cases import CORPUS_DIR, load_split, load_split_cases  # noqa: E402
from operators.failures.evidence import Evidence  # noqa: E402

MODELS = ("shipped", "C 0.1", "C 1.0", "classes not balanced", "hold-outs weighted x3", "char 3-5 grams",
          "word and char grams", "10 nearest, weighted vote")


def words() -> TfidfVectorizer:
    return TfidfVectorizer(token_pattern=pm._TOKENS, ngram_range=(1, 2), sublinear_tf=True, min_df=2)


def chars() -> TfidfVectorizer:
    return TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), sublinear_tf=True, min_df=2)


def predict(model: str, train: list[str], labels: np.ndarray, test: list[str], from_holdout: np.ndarray) -> np.ndarray:
    """True where `model`, fitted on `train`, says infra for a text of `test`."""
    if model == "10 nearest, weighted vote":
        vectorizer = TfidfVectorizer(token_pattern=pm._TOKENS, sublinear_tf=True)
        similarity = (vectorizer.fit_transform(train) @ vectorizer.transform(test).T).toarray().T
        prior = labels.mean()
        votes = []
        for row in similarity:
            near = row.argsort()[::-1][:10]
            votes.append(row[near][labels[near]].sum() / prior > row[near][~labels[near]].sum() / (1 - prior))
        return np.array(votes)
    if model == "word and char grams":
        w, c = words(), chars()
        x, xt = hstack([w.fit_transform(train), c.fit_transform(train)]).tocsr(), hstack([w.transform(test), c.transform(test)]).tocsr()
    else:
        vectorizer = chars() if model == "char 3-5 grams" else words()
        x, xt = vectorizer.fit_transform(train), vectorizer.transform(test)
    c_value = {"C 0.1": 0.1, "C 1.0": 1.0}.get(model, pm.C)
    weights = np.where(from_holdout, 3.0, 1.0) if model == "hold-outs weighted x3" else None
    balance = None if model == "classes not balanced" else "balanced"
    fitted = LogisticRegression(C=c_value, class_weight=balance, max_iter=3000).fit(x, labels, sample_weight=weights)
    return fitted.predict_proba(xt)[:, 1] > 0.5


def main() -> int:
    split = load_split(CORPUS_DIR)
    parts = {name: load_split_cases(split, name, CORPUS_DIR) for name in pm.base_splits(split)}
    text = {c.id: pm.case_text(Evidence.parse(c.evidence)) for cases in parts.values() for c in cases}
    right = {model: {} for model in MODELS}
    always_user = n = 0
    for left_out in split.spent:
        test = [c for c in parts[left_out] if classify(c.evidence, precedents=False).kind == "unknown"]
        if not test:
            continue
        train = [(name, c) for name, cases in parts.items() if name != left_out for c in cases]
        labels = np.array([c.label == "infra" for _, c in train])
        from_holdout = np.array([name.startswith("holdout") for name, _ in train])
        truth = np.array([c.label == "infra" for c in test])
        n, always_user = n + len(test), always_user + int((~truth).sum())
        for model in MODELS:
            said = predict(model, [text[c.id] for _, c in train], labels, [text[c.id] for c in test], from_holdout)
            right[model][left_out] = int((said == truth).sum())
    print(f"{n} cases no rule decides, over {len(right['shipped'])} spent hold-outs; always user: {always_user}")
    shipped = right["shipped"]
    for model in MODELS:
        won = sum(right[model][h] > shipped[h] for h in shipped)
        lost = sum(right[model][h] < shipped[h] for h in shipped)
        print(f"{model:28} {sum(right[model].values()):4}   won {won:2} / lost {lost:2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
