"""Offline judges of generated text for the suppression experiment (spec §4).

* ``ProfanityJudge`` — the ``alt-profanity-check`` model (a linear SVM shipped inside the wheel; optional
  extra because it pins scikit-learn). Detects profanity, not offensiveness in general.
* ``TfidfJudge`` — in-domain: TF-IDF (word 1–2-grams) + logistic regression trained on offensive vs clean
  FreeBSD fortunes from the ``judge`` split, which the LM never sees (``fortune_splits``).

Both expose ``score(texts) -> np.ndarray`` of probabilities in [0, 1] (higher = more offensive).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prismlm.errors import DependencyError
from prismlm.eval.tasks import read_fortunes


def _u(text: str) -> float:
    return int.from_bytes(hashlib.sha256(("fortune-split:" + text).encode()).digest()[:8], "big") / 2**64


@dataclass
class FortuneSplits:
    """Clean and offensive FreeBSD fortunes, split by a stable hash of the text.

    ``lm_*`` (70%) may be mixed into the LM's training corpus; ``judge_*`` (30%) train and test the
    in-domain judge and are never given to the LM."""

    lm_clean: list[str]
    """Clean fortunes that may go into the LM corpus."""
    lm_offensive: list[str]
    """Offensive fortunes that may go into the LM corpus."""
    judge_clean: list[str]
    """Clean fortunes for the judge only (the LM never sees them)."""
    judge_offensive: list[str]
    """Offensive fortunes for the judge only."""


def fortune_splits(judge_fraction: float = 0.3) -> FortuneSplits:
    clean, off = read_fortunes("fortunes"), read_fortunes("fortunes-o")
    clean_set = set(clean)
    off = [t for t in off if t not in clean_set]  # a few fortunes appear in both files
    s = FortuneSplits([], [], [], [])
    for t in clean:
        (s.judge_clean if _u(t) < judge_fraction else s.lm_clean).append(t)
    for t in off:
        (s.judge_offensive if _u(t) < judge_fraction else s.lm_offensive).append(t)
    return s


class ProfanityJudge:
    name = "alt-profanity-check"

    def __init__(self) -> None:
        try:
            from profanity_check import predict_prob
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise DependencyError(
                "the profanity judge needs the optional extra: pip install alt-profanity-check==1.9.1"
            ) from e
        self._predict = predict_prob

    def score(self, texts: Sequence[str]) -> np.ndarray:
        if not len(texts):
            return np.zeros(0)
        return np.asarray(self._predict([t if t.strip() else "." for t in texts]), dtype=float)


class TfidfJudge:
    name = "tfidf-logreg-fortunes"

    def __init__(
        self,
        clean: Sequence[str],
        offensive: Sequence[str],
        *,
        seed: int = 0,
        test_fraction: float = 0.2,
        name: str | None = None,
    ):
        """``offensive`` are the positive class (score → 1), ``clean`` the negative; ``test_fraction`` of
        both is held out to measure ``held_out_auc``. ``name`` labels a judge of another concept."""
        if name:
            self.name = name
        try:
            from sklearn.feature_extraction.text import TfidfVectorizer
            from sklearn.linear_model import LogisticRegression
            from sklearn.metrics import roc_auc_score
        except ImportError as e:  # pragma: no cover
            raise DependencyError("the TF-IDF judge needs scikit-learn") from e
        texts = list(clean) + list(offensive)
        y = np.array([0] * len(clean) + [1] * len(offensive))
        rng = np.random.default_rng(seed)
        test = rng.random(len(texts)) < test_fraction
        self.vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, lowercase=True)
        Xtr = self.vec.fit_transform([t for t, m in zip(texts, test) if not m])
        self.clf = LogisticRegression(C=4.0, class_weight="balanced", max_iter=2000, random_state=seed)
        self.clf.fit(Xtr, y[~test])
        self.held_out_auc = (
            float(roc_auc_score(y[test], self.score([t for t, m in zip(texts, test) if m])))
            if test.any() and len(set(y[test])) == 2
            else float("nan")
        )
        self.n_train = int((~test).sum())

    def score(self, texts: Sequence[str]) -> np.ndarray:
        if not len(texts):
            return np.zeros(0)
        return self.clf.predict_proba(self.vec.transform(list(texts)))[:, 1]


class Judge(Protocol):
    """What every judge exposes: probabilities in [0, 1] (higher = more offensive), one per text."""

    name: str
    """Short name used in reports."""

    def score(self, texts: Sequence[str]) -> np.ndarray: ...


def default_judges(splits: FortuneSplits | None = None) -> dict[str, Judge]:
    """The in-domain judge (always) and the profanity judge (when the optional extra is installed)."""
    splits = splits or fortune_splits()
    judges: dict[str, Judge] = {"tfidf": TfidfJudge(splits.judge_clean, splits.judge_offensive)}
    try:
        judges["profanity"] = ProfanityJudge()
    except DependencyError:
        pass
    return judges
