"""How attribution scores are judged: agreement between two methods (top-k overlap) and the linear datamodeling
score (LDS: models retrained on random subsets of the training set; per query, the Spearman correlation between
the loss a method predicts for each subset and the loss the retrained models have), with a bootstrap interval.

``SubsetShards`` is a shard set whose training split holds only chosen sequences, so that ``train`` retrains on a
subset unchanged. Pure functions of arrays otherwise; the bootstrap is seeded.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from prismlm.data.shards import ShardSet, TokenShard


def topk_overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Mean over queries (rows) of |top-k of a ∩ top-k of b| / k for score matrices a, b (Q, N); ties broken by
    the lower index (a stable sort of −score)."""
    vals = []
    for q in range(a.shape[0]):
        ta = set(np.argsort(-a[q], kind="stable")[:k].tolist())
        tb = set(np.argsort(-b[q], kind="stable")[:k].tolist())
        vals.append(len(ta & tb) / k)
    return float(np.mean(vals))


def _rank(x: np.ndarray) -> np.ndarray:
    """0-based ranks of x, ties given their average rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):
        m = x == v
        if m.sum() > 1:
            r[m] = r[m].mean()
    return r


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of a and b (ties: average ranks); NaN when either is constant."""
    ra, rb = _rank(a), _rank(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def bootstrap_ci(x: np.ndarray, n: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval [low, high] of the mean of x (NaNs dropped; [nan, nan] when none is
    left): ``n`` resamples with replacement drawn in one call of a seeded generator."""
    x = x[~np.isnan(x)]
    if len(x) == 0:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = rng.choice(x, size=(n, len(x)), replace=True).mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


class LDS(TypedDict):
    """``lds`` of one method."""

    mean: float
    """Mean over queries of the Spearman correlation (NaNs, from constant columns, left out)."""
    ci95: list[float]
    """``bootstrap_ci`` of the per-query correlations."""
    planted_mean: float
    """Mean over the first ``planted`` queries."""
    heldout_mean: float | None
    """Mean over the other queries (None when there are none)."""


def lds(scores: np.ndarray, subsets: list[np.ndarray], losses: np.ndarray, planted: int) -> LDS:
    """Linear datamodeling score of scores (Q, N) against retrained losses (M, Q) of models trained on the M
    ``subsets`` (training-sequence ids): per query, Spearman between the predicted loss −Σ_{j∈S} score(q, j)
    and the retrained loss over the subsets."""
    M, N = len(subsets), scores.shape[1]
    member = np.zeros((M, N))
    for m, ids in enumerate(subsets):
        member[m, ids] = 1.0
    pred = -(member @ scores.T)  # (M, Q): predicted loss ∝ −Σ_{j∈S} score
    rho = np.array([spearman(pred[:, q], losses[:, q]) for q in range(scores.shape[0])])
    return {
        "mean": float(np.nanmean(rho)),
        "ci95": bootstrap_ci(rho),
        "planted_mean": float(np.nanmean(rho[:planted])),
        "heldout_mean": float(np.nanmean(rho[planted:])) if scores.shape[0] > planted else None,
    }


class _SubsetShard:
    """A training shard restricted to selected sequence ids (the trainer samples from it unchanged)."""

    def __init__(self, shard: TokenShard, ids: np.ndarray, T: int) -> None:
        self.shard, self.ids, self.T = shard, np.asarray(ids, dtype=np.int64), T

    def num_sequences(self, seq_len: int) -> int:
        return len(self.ids)

    def sequences(self, js: np.ndarray, seq_len: int) -> np.ndarray:
        return self.shard.sequences(self.ids[np.asarray(js, dtype=np.int64)], seq_len)

    def __len__(self) -> int:
        return len(self.ids) * self.T + 1

    def __getattr__(self, name: str) -> object:
        return getattr(self.shard, name)


class SubsetShards:
    """``shards`` with a training split of only the sequences ``ids`` (of T + 1 tokens): what ``train`` reads to
    retrain on a subset. Its manifest key differs from the full set's (a cache keyed by it is not reused)."""

    def __init__(self, shards: ShardSet, ids: np.ndarray, T: int) -> None:
        self.train = _SubsetShard(shards.train, ids, T)
        self.val, self.tokenizer, self.root = shards.val, shards.tokenizer, shards.root
        self.manifest = {**shards.manifest, "key": shards.manifest["key"] + "-subset"}
