"""prismlm.eval.stats against independent references: exact binomial sums written out by hand, scipy's
binomtest where installed, textbook Wilson intervals, and bootstrap intervals that must cover a known value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from prismlm.eval.stats import (
    binomial_p_above,
    drop_ci,
    excess_drop,
    gap_ci,
    mcnemar_exact_p,
    paired_stats,
    relative_drop,
    wilson,
)


@pytest.mark.parametrize(
    ("gained", "lost", "p"),
    [
        (6, 0, 2 / 64),  # 2 · P(X ≤ 0), X ~ Bin(6, 1/2)
        (6, 1, 2 * (1 + 7) / 128),  # 2 · (C(7,0) + C(7,1)) / 2^7
        (1, 6, 2 * (1 + 7) / 128),  # symmetric in gained and lost
        (3, 3, 1.0),  # capped at 1
        (0, 0, 1.0),  # no discordant pair
        (10, 2, 2 * (1 + 12 + 66) / 4096),
    ],
)
def test_mcnemar_is_the_exact_two_sided_binomial(gained, lost, p):
    assert mcnemar_exact_p(gained, lost) == pytest.approx(p, rel=1e-12)


def test_mcnemar_matches_scipy_binomtest():
    binomtest = pytest.importorskip("scipy.stats").binomtest
    for gained, lost in [(9, 4), (2, 15), (20, 21), (0, 5)]:
        ref = binomtest(min(gained, lost), gained + lost, 0.5).pvalue
        assert mcnemar_exact_p(gained, lost) == pytest.approx(ref, rel=1e-9)


def test_paired_stats_counts_and_delta():
    before = torch.tensor([1, 1, 0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    after = torch.tensor([1, 0, 1, 1, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    s = paired_stats(before, after, n_boot=500, seed=3)
    assert (s["gained"], s["lost"]) == (4, 1)  # positions 2, 3, 5, 9 gained; 1 lost
    assert s["delta"] == pytest.approx(0.3)
    assert s["mcnemar_p"] == pytest.approx(2 * (1 + 5) / 32)
    assert s["ci95"][0] <= 0.3 <= s["ci95"][1]
    assert paired_stats(before, after, n_boot=500, seed=3) == s  # seeded: reproducible


def test_paired_bootstrap_interval_covers_the_true_delta_at_the_normal_width():
    g = torch.Generator().manual_seed(0)
    n = 4000
    before = torch.rand(n, generator=g) < 0.5
    after = torch.rand(n, generator=g) < 0.6  # true delta 0.1
    s = paired_stats(before, after, n_boot=2000, seed=1)
    lo, hi = s["ci95"]
    assert lo < 0.1 < hi
    d = (after.double() - before.double()).numpy()
    half = 1.96 * d.std() / math.sqrt(n)  # the normal approximation of the bootstrap's spread
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    assert s["delta"] == pytest.approx(d.mean(), abs=1e-12)


@pytest.mark.parametrize(
    ("acc", "n", "ref"),
    [
        (0.5, 100, (0.40383, 0.59617)),  # textbook Wilson values
        (0.0, 10, (0.0, 0.27753)),
        (0.9, 50, (0.78638, 0.95655)),
    ],
)
def test_wilson_interval(acc, n, ref):
    lo, hi = wilson(acc, n)
    assert lo == pytest.approx(ref[0], abs=1e-4) and hi == pytest.approx(ref[1], abs=1e-4)


def test_wilson_without_examples_is_uninformative():
    assert wilson(0.3, 0) == [0.0, 1.0]


def test_binomial_tail():
    assert binomial_p_above(10, 10, 0.5) == pytest.approx(1 / 1024)
    assert binomial_p_above(0, 10, 0.3) == pytest.approx(1.0)
    assert binomial_p_above(2, 3, 0.25) == pytest.approx(3 * 0.25**2 * 0.75 + 0.25**3)
    binomtest = pytest.importorskip("scipy.stats").binomtest
    assert binomial_p_above(31, 100, 0.25) == pytest.approx(
        binomtest(31, 100, 0.25, alternative="greater").pvalue, rel=1e-9
    )


def test_drops():
    assert relative_drop(0.4, 0.3) == pytest.approx(0.25)
    assert excess_drop(0.4, 0.3, 0.2) == pytest.approx(0.5)  # half of the 0.2 excess removed
    assert excess_drop(0.4, 0.2, 0.2) == pytest.approx(1.0)


def test_drop_interval_is_exact_on_a_constant_ratio_and_covers_the_mean_ratio():
    before = np.linspace(0.2, 0.8, 12)
    lo, hi = drop_ci(before, 0.75 * before, n_boot=300, seed=0)  # every resample drops exactly 25%
    assert lo == pytest.approx(0.25) and hi == pytest.approx(0.25)
    rng = np.random.default_rng(5)
    before = rng.uniform(0.3, 0.7, 200)
    after = before * rng.uniform(0.4, 0.8, 200)
    lo, hi = drop_ci(before, after, n_boot=1000, seed=1)
    assert lo < 1 - after.mean() / before.mean() < hi and hi - lo < 0.1


def test_gap_interval_covers_the_known_gap():
    rng = np.random.default_rng(2)
    a, b = rng.normal(1.0, 1.0, 500), rng.normal(0.7, 1.0, 400)
    lo, hi = gap_ci(a, b, n_boot=1000, seed=0)
    assert lo < 0.3 < hi
    half = 1.96 * math.sqrt(a.var() / len(a) + b.var() / len(b))
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)
    assert gap_ci(np.full(5, 2.0), np.full(7, 0.5), n_boot=50, seed=0) == [1.5, 1.5]
