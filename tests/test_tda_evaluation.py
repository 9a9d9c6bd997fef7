"""``prismlm.tda.evaluation``: top-k overlap, Spearman (against scipy), the bootstrap interval, LDS on scores
whose ordering is known, and the subset shard set a retrained LDS model reads."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import spearmanr

from prismlm.tda.evaluation import SubsetShards, bootstrap_ci, lds, spearman, topk_overlap


def test_topk_overlap_on_hand_made_rankings():
    a = np.array([[4.0, 3, 2, 1, 0], [0, 1, 2, 3, 4]])
    assert topk_overlap(a, a, 2) == 1.0
    assert topk_overlap(a, -a, 2) == 0.0  # the top two become the bottom two
    b = np.array([[4.0, 0, 3, 1, 2], [0, 1, 2, 4, 3]])  # query 0: {0, 2} vs {0, 1}; query 1: {3, 4} vs {4, 3}
    assert topk_overlap(a, b, 2) == pytest.approx((0.5 + 1.0) / 2)
    ties = np.zeros((1, 4))
    assert topk_overlap(ties, np.array([[0.0, 0, 0, 1]]), 1) == 0.0  # ties: the lowest index (0) vs 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spearman_agrees_with_scipy_including_ties(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 5, size=30).astype(float)  # many ties
    b = a + rng.normal(size=30)
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert math.isnan(spearman(np.ones(5), np.arange(5.0)))


def test_bootstrap_interval_brackets_the_mean_is_seeded_and_narrows_with_data():
    rng = np.random.default_rng(3)
    x = rng.normal(1.0, 1.0, size=40)
    lo, hi = bootstrap_ci(x)
    assert lo < x.mean() < hi
    assert bootstrap_ci(x) == [lo, hi] and bootstrap_ci(x, seed=1) != [lo, hi]
    big = rng.normal(1.0, 1.0, size=4000)
    lo2, hi2 = bootstrap_ci(big)
    assert hi2 - lo2 < (hi - lo) / 5  # ~1/√100 of the width
    with_nan = np.concatenate([x, [np.nan, np.nan]])
    assert bootstrap_ci(with_nan) == [lo, hi]  # NaNs are dropped before resampling
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([np.nan])))


def test_lds_is_one_when_the_scores_order_the_subsets_as_the_retrained_losses_do():
    rng = np.random.default_rng(4)
    N, Q, M = 12, 3, 10
    S = rng.normal(size=(Q, N))
    subsets = [np.sort(rng.choice(N, size=N // 2, replace=False)) for _ in range(M)]
    member = np.zeros((M, N))
    for m, ids in enumerate(subsets):
        member[m, ids] = 1
    pred = -(member @ S.T)  # (M, Q): the loss these scores predict
    exact = lds(S, subsets, 2.0 * pred + 1.0, planted=2)  # any increasing function of it
    assert exact["mean"] == pytest.approx(1.0) and exact["planted_mean"] == pytest.approx(1.0)
    assert exact["heldout_mean"] == pytest.approx(1.0)
    assert lds(S, subsets, -pred, planted=3)["mean"] == pytest.approx(-1.0)
    assert lds(S, subsets, -pred, planted=3)["heldout_mean"] is None  # no held-out query
    noisy = lds(S, subsets, pred + rng.normal(scale=5.0, size=pred.shape), planted=2)
    assert -1.0 <= noisy["mean"] < 1.0 and noisy["ci95"][0] <= noisy["mean"] <= noisy["ci95"][1]


def test_subset_shards_serve_only_the_chosen_sequences(tiny_shards):
    T = 32
    ids = np.array([5, 2, 9])
    sub = SubsetShards(tiny_shards, ids, T)
    assert sub.train.num_sequences(T) == 3 and len(sub.train) == 3 * T + 1
    got = sub.train.sequences(np.array([0, 2]), T)
    assert np.array_equal(got, tiny_shards.train.sequences(np.array([5, 9]), T))
    assert sub.val is tiny_shards.val and sub.manifest["key"] == tiny_shards.manifest["key"] + "-subset"
