"""Controllers compared on one task, through one code path (issue 37, controllers on what the model can do).

* ``screen_task``: keep a task only where the base model is above chance by a margin on the validation split
  (one-sided binomial) and the choice prior does not beat it there — a task the model can do, where a
  context-free per-answer bias is not the whole story;
* ``baselines``: the base model and the choice prior on the test split (the held-out split: no fit sees it);
* ``fit_side``: one controller (prototype, TopK SAE or dense-residual code) fitted on train with λ chosen
  on validation by ``prismlm.control.surrogate`` and scored exactly on test; ``fit_dense_side`` builds the
  dense basis (``prismlm.control.dense``) from the training hidden states and fits it the same way;
* ``side_row``: a side's JSON row with paired McNemar and bootstrap intervals (``prismlm.eval.stats``)
  against the base model and the choice prior; ``paired_stats(baseline, controller)`` compares two sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

import torch

from prismlm.control.controller import Controller, Encoder, accuracy, correct, fit_choice_prior
from prismlm.control.dense import DenseBasis, DenseControlConfig, dense_basis, matched_directions
from prismlm.control.surrogate import TaskFeatures, chance, encoded, exact_scores, fit_surrogate_controller
from prismlm.errors import ConfigError, DataError
from prismlm.eval.stats import binomial_p_above, paired_stats, wilson


# ----- screening ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScreenConfig:
    """When a candidate task is kept (all on its validation split, before any controller is fitted)."""

    min_margin: float = 0.05
    """The base model's accuracy minus chance must be at least this (and above 0)."""
    max_p: float = 0.01
    """The one-sided binomial p of that accuracy against chance must be at most this."""
    max_prior_gain: float = 0.0
    """The choice prior (base scores + a per-answer-string bias fitted on train) may beat the base model's
    validation accuracy by at most this: 0 keeps a task only where the model is at or above the prior; 1
    turns the check off."""
    max_acc: float = 1.0
    """A base accuracy above this leaves a controller no room (1: no ceiling)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_margin < 1:
            raise ConfigError(f"`min_margin` must be in [0, 1), got {self.min_margin}", param="min_margin")
        if not 0 < self.max_p <= 1:
            raise ConfigError(f"`max_p` must be in (0, 1], got {self.max_p}", param="max_p")
        if not 0 <= self.max_prior_gain <= 1:
            raise ConfigError(f"`max_prior_gain` must be in [0, 1], got {self.max_prior_gain}", param="max_prior_gain")
        if not 0 < self.max_acc <= 1:
            raise ConfigError(f"`max_acc` must be in (0, 1], got {self.max_acc}", param="max_acc")


class ScreenRow(TypedDict):
    """``screen_task``'s verdict on one candidate."""

    task: str
    validation_acc: float
    chance: float
    n: int
    binomial_p: float
    prior_validation_acc: float
    """The choice prior's validation accuracy (fitted on the train split)."""
    kept: bool
    reason: str
    """"kept", or the first test it failed: "not above chance", "p", "prior", "ceiling"."""


def screen_task(
    task: str,
    train: TaskFeatures,
    train_scores: torch.Tensor,
    val: TaskFeatures,
    val_scores: torch.Tensor,
    cfg: ScreenConfig,
) -> ScreenRow:
    """The screen of ``cfg`` on one task: ``*_scores`` (R,) are the base model's request scores of each split
    (train only fits the choice prior; the verdict is read on validation)."""
    acc = accuracy(val, val_scores)["acc"]
    n, ch = len(val.gold), chance(val)
    if n == 0:
        raise DataError(f"task {task!r} has an empty validation split")
    p = binomial_p_above(round(acc * n), n, ch)
    prior = fit_choice_prior(train, train_scores)
    prior_acc = accuracy(val, prior.scores(val, val_scores))["acc"]
    checks = (
        ("not above chance", acc > ch and acc - ch >= cfg.min_margin),
        ("p", p <= cfg.max_p),
        ("prior", prior_acc - acc <= cfg.max_prior_gain),
        ("ceiling", acc <= cfg.max_acc),
    )
    failed = next((name for name, ok in checks if not ok), None)
    return {"task": task, "validation_acc": acc, "chance": ch, "n": n, "binomial_p": p,
            "prior_validation_acc": prior_acc, "kept": failed is None, "reason": failed or "kept"}  # fmt: skip


# ----- baselines and sides --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Baselines:
    """The base model and the choice prior on a task's test split."""

    base_scores: torch.Tensor
    """(R,) float64 test request scores at c = 0."""
    prior_scores: torch.Tensor
    """(R,) the choice prior's test scores (the bias fitted on train)."""
    base: dict[str, float]
    """``accuracy`` of the base model on test."""
    prior: dict[str, float]
    """``accuracy`` of the choice prior on test."""
    base_correct: torch.Tensor
    """(D,) bool."""
    prior_correct: torch.Tensor
    """(D,) bool."""


def base_scores(f: TaskFeatures, W: torch.Tensor) -> torch.Tensor:
    """(R,) the base model's exact request scores (c = 0: the stored base pass; no code is read)."""
    return exact_scores(f, W, W[:1], None)


def baselines(feats: Mapping[str, TaskFeatures], W: torch.Tensor) -> Baselines:
    """The base model on ``feats["test"]`` and the choice prior fitted on ``feats["train"]``."""
    test = feats["test"]
    s0 = base_scores(test, W)
    prior = fit_choice_prior(feats["train"], base_scores(feats["train"], W)).scores(test, s0)
    return Baselines(s0, prior, accuracy(test, s0), accuracy(test, prior), correct(test, s0), correct(test, prior))


@dataclass(frozen=True)
class FitProtocol:
    """How every side's controller is fitted (the same for all of them)."""

    l1_grid: tuple[float, ...]
    """λ values tried; the one with the best surrogate validation accuracy is kept (ties: fewer non-zero)."""
    steps: int
    """Proximal Adam steps per fit."""
    lr: float
    """Adam's learning rate."""
    surrogate_vocab: int
    """|S| of the fitting surrogate besides the targets (``prismlm.control.surrogate``)."""

    def __post_init__(self) -> None:
        if not self.l1_grid or any(x < 0 for x in self.l1_grid):
            raise ConfigError(f"`l1_grid` must be non-empty and >= 0, got {self.l1_grid}", param="l1_grid")
        if self.steps < 1 or self.lr <= 0 or self.surrogate_vocab < 1:
            raise ConfigError(
                f"`steps`, `lr` and `surrogate_vocab` must be positive, got {self.steps}, {self.lr}, "
                f"{self.surrogate_vocab}",
                param=("steps", "lr", "surrogate_vocab"),
            )


@dataclass
class SideFit:
    """One side's controller fitted on train (λ on validation) and scored exactly on test."""

    controller: Controller
    trials: list[dict[str, object]]
    """Per λ: surrogate validation accuracy, non-zero count, fit history."""
    fidelity: dict[str, float]
    """The chosen controller's validation accuracy, exact and by the surrogate."""
    test_scores: torch.Tensor
    """(R,) float64 exact test request scores under the controller."""
    test_correct: torch.Tensor
    """(D,) bool."""
    after: dict[str, float]
    """``accuracy`` on test under the controller."""
    num_parameters: int
    """Trainable coefficients (the code's units: K, or the dense controller's K')."""
    features: dict[str, TaskFeatures]
    """Each split with this side's code (for tracing)."""

    @property
    def support(self) -> int:
        """Non-zero coefficients of the chosen controller."""
        return len(self.controller.nonzero)


def fit_side(
    feats: Mapping[str, TaskFeatures], encoder: Encoder, directions: torch.Tensor, W: torch.Tensor, p: FitProtocol
) -> SideFit:
    """Encode every split with ``encoder``, fit on train with λ chosen on validation (``fit_surrogate_controller``),
    score test exactly (``exact_scores``). ``feats``: the splits' ``TaskFeatures`` (their code is ignored)."""
    enc = {s: encoded(f, encoder) for s, f in feats.items()}
    fit = fit_surrogate_controller(
        enc["train"], enc["validation"], W, directions,
        l1_grid=p.l1_grid, steps=p.steps, lr=p.lr, vocab=p.surrogate_vocab,
    )  # fmt: skip
    test = enc["test"]
    s1 = exact_scores(test, W, directions, fit.controller.coefficients)
    return SideFit(fit.controller, fit.trials, fit.fidelity, s1, correct(test, s1), accuracy(test, s1),
                   int(directions.shape[0]), enc)  # fmt: skip


def fit_dense_side(
    feats: Mapping[str, TaskFeatures], W: torch.Tensor, support: int, cfg: DenseControlConfig, p: FitProtocol
) -> tuple[SideFit, DenseBasis]:
    """The dense-residual controller of ``cfg`` with K' = ``matched_directions(support, …)`` (``support``: the
    prototype controller's non-zero count), its basis from the training hidden states, fitted by ``fit_side``."""
    train_z = feats["train"].z
    basis = dense_basis(train_z, matched_directions(support, train_z.shape[1], cfg), cfg)
    return fit_side(feats, basis.encode, basis.directions, W, p), basis


def side_row(fit: SideFit, base: Baselines, seed: int) -> dict[str, object]:
    """A side's JSON row: test accuracy (Wilson interval), its change over the base model, paired McNemar and
    bootstrap intervals against the base model and the choice prior, its size and λ selection."""
    after = fit.after
    return {
        "test_after": after,
        "test_after_ci95": wilson(after["acc"], int(after["n"])),
        "delta_acc": after["acc"] - base.base["acc"],
        "paired_vs_base": paired_stats(base.base_correct, fit.test_correct, seed=seed),
        "paired_vs_prior": paired_stats(base.prior_correct, fit.test_correct, seed=seed),
        "nonzero": fit.support,
        "parameters": fit.num_parameters,
        "l1": fit.controller.l1,
        "selection": fit.trials,
        "surrogate_fidelity": fit.fidelity,
    }


__all__ = [
    "Baselines",
    "FitProtocol",
    "ScreenConfig",
    "ScreenRow",
    "SideFit",
    "base_scores",
    "baselines",
    "fit_dense_side",
    "fit_side",
    "screen_task",
    "side_row",
]
