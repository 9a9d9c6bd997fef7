"""The statistics the claims rest on: paired comparisons of per-example correctness (Δ accuracy, a bootstrap
interval, the exact McNemar test), intervals of an accuracy (Wilson) and of a relative drop (paired bootstrap),
the one-sided binomial test a task screen uses, and the relative and excess drops of a judged score.

Pure functions of tensors or arrays; each seeded bootstrap draws its resamples in one call, so a result is fixed
by (inputs, n_boot, seed).
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np
import torch


class PairedStats(TypedDict):
    """``paired_stats`` of per-example correctness before and after (D,) each."""

    delta: float
    """Mean accuracy after − before."""
    ci95: list[float]
    """[low, high] bootstrap 95% interval of delta."""
    gained: int
    """Examples wrong before and right after."""
    lost: int
    """Examples right before and wrong after."""
    mcnemar_p: float
    """Exact two-sided McNemar p-value over the discordant pairs."""


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value: twice the smaller binomial tail of the discordant pairs under
    Binomial(gained + lost, 1/2), capped at 1 (1 when there is no discordant pair)."""
    m = gained + lost
    if m == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2 * tail)


def paired_stats(before: torch.Tensor, after: torch.Tensor, *, n_boot: int = 2000, seed: int = 0) -> PairedStats:
    """Paired comparison of per-example correctness (D,) before and after: Δ accuracy, a bootstrap 95%
    interval (examples resampled with replacement, paired), and the exact two-sided McNemar p-value."""
    b, a = before.double(), after.double()
    n = len(b)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (n_boot, n), generator=g)
    deltas = (a[idx] - b[idx]).mean(1)
    lo, hi = torch.quantile(deltas, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    gained, lost = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    p = mcnemar_exact_p(gained, lost)
    return {"delta": float((a - b).mean()), "ci95": [lo, hi], "gained": gained, "lost": lost, "mcnemar_p": p}


def wilson(acc: float, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval [low, high] of an accuracy over n examples ([0, 1] when n = 0)."""
    if n == 0:
        return [0.0, 1.0]
    centre = (acc + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(acc * (1 - acc) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [centre - half, centre + half]


def binomial_p_above(k: int, n: int, p: float) -> float:
    """One-sided P(X ≥ k) for X ~ Binomial(n, p): is an accuracy of k / n above chance p?"""
    return float(sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def relative_drop(before: float, after: float) -> float:
    """1 − after / before: the share of a (positive) score that an intervention removed."""
    return 1 - after / before


def excess_drop(before: float, after: float, neutral: float) -> float:
    """1 − (after − neutral) / (before − neutral): the share of the score's excess over its level on neutral
    text that an intervention removed (1 = down to the neutral level)."""
    return 1 - (after - neutral) / (before - neutral)


def drop_ci(before: np.ndarray, after: np.ndarray, n_boot: int, seed: int) -> list[float]:
    """95% bootstrap interval of ``relative_drop`` of the means of per-prompt scores (prompts,) each, the
    prompts resampled paired (one index draw for both)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(before), (n_boot, len(before)))  # (n_boot, prompts)
    drops = 1 - after[idx].mean(1) / np.maximum(before[idx].mean(1), 1e-12)
    return [float(np.percentile(drops, 2.5)), float(np.percentile(drops, 97.5))]


def gap_ci(a: np.ndarray, b: np.ndarray, n_boot: int, seed: int) -> list[float]:
    """95% bootstrap interval of mean(a) − mean(b) for two independent samples, each resampled on its own
    (a's indices drawn first, then b's, from one generator)."""
    rng = np.random.default_rng(seed)
    gaps = a[rng.integers(0, len(a), (n_boot, len(a)))].mean(1) - b[rng.integers(0, len(b), (n_boot, len(b)))].mean(1)
    return [float(np.percentile(gaps, 2.5)), float(np.percentile(gaps, 97.5))]
