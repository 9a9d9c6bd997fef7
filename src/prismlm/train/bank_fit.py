"""One prototype bank fitted on stored rows and measured on held-out rows: the coverage frontier's recipe.

``fit_bank`` seeds a bank (``seed_prototypes``'s k-means++ picks, random rows or spherical k-means), trains it
with ``bank_losses`` (REC + r·(R1 + R2), AdamW, warm-up then cosine to 0.1×, minibatches of whole stored
sequences) and measures it with ``bank_coverage``. ``BankPoint`` names one configuration (K, k, seeding,
loss weight, dead-prototype resampling, steps, anchor documents); ``fit_point`` fits and records it.
A point is ``buildable`` when ``prism retrofit`` makes that bank today (``kpp`` seeding, no resampling).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from prismlm.config import PrototypeConfig
from prismlm.eval.bank_coverage import Coverage, MeasuredBank, bank_coverage
from prismlm.model.prototypes import PrototypeLayer, seed_prototypes
from prismlm.train.bank_stage import bank_losses


class SeedFn(Protocol):
    """A seeding: (rows (N, d), K, k, *, generator) → prototypes (K, d)."""

    def __call__(
        self, rows: torch.Tensor, K: int, k: int, /, *, generator: torch.Generator | None = None
    ) -> torch.Tensor: ...


StepHook = Callable[[int, PrototypeLayer, torch.Tensor, torch.optim.Optimizer], None]


class FittedBank(Coverage):
    """``fit_bank``'s record: the configuration, the training's size and time, the held-out coverage."""

    K: int
    k: int
    centred: bool
    steps: int
    tokens_per_step: int
    epochs: float
    seconds: float


class _BankOnly(torch.nn.Module):
    """What ``bank_losses`` reads of a model: ``require_prototypes()``."""

    def __init__(self, bank: PrototypeLayer) -> None:
        super().__init__()
        self.bank = bank

    def require_prototypes(self) -> PrototypeLayer:
        return self.bank


def _lr_at(step: int, steps: int, warm: int, lr: float) -> tuple[float, float]:
    """(ramp of the R weights, learning rate) at ``step``: linear warm-up, then cosine down to 0.1 × lr."""
    ramp = min(1.0, (step + 1) / max(warm, 1))
    if step < warm:
        return ramp, lr * ramp
    return ramp, lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))


def fit_bank(
    z_train: torch.Tensor,
    T: int,
    z_val: torch.Tensor,
    *,
    K: int,
    k: int,
    centred: bool,
    steps: int,
    batch_seqs: int,
    lr: float,
    seed: int,
    seed_fn: SeedFn = seed_prototypes,
    r_weight: float = 0.5,
    on_step: StepHook | None = None,
) -> FittedBank:
    """Seed and train one bank on stored rows z_train (sequences of T rows), measure it on held-out z_val.

    ``seed_fn``: the seeding; ``r_weight``: the weight of R1 and of R2 beside REC (ramped in with the warm-up);
    ``on_step(step, bank, x, optimizer)``: called after each step (the frontier's resampling of dead
    prototypes). Seeded by ``seed``: the seed rows, the seeding and the order of the minibatches."""
    mu = z_train.mean(0)
    x = z_train - mu if centred else z_train
    g = torch.Generator().manual_seed(seed)
    n_seq = x.shape[0] // T
    seed_rows = x[torch.randperm(x.shape[0], generator=g)[: max(16 * K, 8192)]]
    bank = PrototypeLayer(x.shape[1], PrototypeConfig(num_prototypes=K, top_k=k))
    with torch.no_grad():
        bank.weight.copy_(seed_fn(seed_rows, K, k, generator=g))
    model = _BankOnly(bank)
    opt = torch.optim.AdamW(bank.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = min(20, steps // 10)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(n_seq) for _ in range(math.ceil(steps * batch_seqs / n_seq) + 1)])
    t0 = time.perf_counter()
    for step in range(steps):
        ramp, lr_now = _lr_at(step, steps, warm, lr)
        for group in opt.param_groups:
            group["lr"] = lr_now
        ids = order[step * batch_seqs : (step + 1) * batch_seqs]
        rows = (ids[:, None] * T + np.arange(T)[None, :]).reshape(-1)
        terms = bank_losses(model, x[torch.from_numpy(rows)])  # type: ignore[arg-type]  # duck-typed model
        loss = terms["rec"] + r_weight * ramp * (terms["r1"] + terms["r2"])
        (loss * 1.0).backward()
        torch.nn.utils.clip_grad_norm_(bank.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, bank, x, opt)
    seconds = time.perf_counter() - t0
    res = bank_coverage(bank, z_val, mu, centred)
    return {
        "K": K,
        "k": k,
        "centred": centred,
        "steps": steps,
        "tokens_per_step": batch_seqs * T,
        "epochs": steps * batch_seqs / n_seq,
        "seconds": round(seconds, 1),
        **res,
    }


def _scaled(rows: torch.Tensor, protos: torch.Tensor, k: int) -> torch.Tensor:
    """One least-squares scale s of the (K, d) prototypes so that their k-sparse reconstruction of the
    (N, d) rows matches them (``seed_prototypes``'s fit), applied: → s · protos."""
    x, p = rows.double(), protos.double()
    cos = F.normalize(x, dim=-1) @ F.normalize(p, dim=-1).T  # (N, K)
    top = cos.topk(min(k, p.shape[0]), dim=-1)
    recon = torch.einsum("nk,nkd->nd", F.relu(top.values), p[top.indices])  # (N, d)
    s = (x * recon).sum() / (recon * recon).sum().clamp_min(1e-30)
    return (s * p).to(rows.dtype)


def seed_rows(rows: torch.Tensor, K: int, k: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """K distinct random rows of (N, d), scaled as ``seed_prototypes`` scales its picks."""
    return _scaled(rows, rows[torch.randperm(rows.shape[0], generator=generator)[:K]], k)


def seed_kmeans(
    rows: torch.Tensor, K: int, k: int, *, generator: torch.Generator | None = None, iters: int = 5
) -> torch.Tensor:
    """Spherical k-means from ``seed_prototypes``'s k-means++ picks: ``iters`` Lloyd steps on the unit rows
    (assign each to its nearest centre by cosine; a centre becomes its cluster's mean direction, an empty
    cluster keeps its centre); each prototype then gets its cluster's mean ‖z‖ and one shared LS scale."""
    unit = F.normalize(rows.float(), dim=-1)  # (N, d): float32, the Lloyd steps are the cost (N·K·d each)
    centres = F.normalize(seed_prototypes(rows, K, k, generator=generator).float(), dim=-1)  # (K, d)
    for _ in range(iters):
        assign = (unit @ centres.T).argmax(dim=-1)  # (N,)
        sums = torch.zeros_like(centres).index_add_(0, assign, unit)  # (K, d)
        filled = sums.norm(dim=-1) > 0
        centres = torch.where(filled[:, None], F.normalize(sums, dim=-1), centres)
    assign = (unit @ centres.T).argmax(dim=-1)
    norms = rows.float().norm(dim=-1)  # (N,)
    count = torch.bincount(assign, minlength=K).float()
    mean_norm = torch.zeros(K).index_add_(0, assign, norms) / count.clamp_min(1)
    mean_norm = torch.where(count > 0, mean_norm, norms.mean())
    return _scaled(rows, (centres * mean_norm[:, None]).to(rows.dtype), k)


class Resampler:
    """``fit_bank``'s ``on_step``: after 1/5, 2/5 and 3/5 of ``steps``, re-seed the prototypes never active on
    a sample of training rows from the sample's worst-reconstructed rows (‖r‖/‖z‖), at the median prototype
    norm, and clear their AdamW moments."""

    def __init__(self, steps: int, sample: int = 16384, seed: int = 0) -> None:
        self.at = {steps * i // 5 for i in (1, 2, 3)}
        self.sample, self.g = sample, torch.Generator().manual_seed(seed)
        self.log: list[dict[str, int]] = []

    def __call__(self, step: int, bank: PrototypeLayer, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        if step + 1 not in self.at:
            return
        rows = x[torch.randperm(x.shape[0], generator=self.g)[: self.sample]]  # (n, d)
        with torch.no_grad():
            po = bank(rows)
            used = torch.bincount(po.indices[po.activations > 0], minlength=bank.num_prototypes)  # (K,)
            dead = (used == 0).nonzero().squeeze(1)
            if dead.numel():
                worst = (po.residual.norm(dim=-1) / rows.norm(dim=-1)).topk(dead.numel()).indices
                target = bank.weight.norm(dim=-1).median()
                bank.weight[dead] = F.normalize(rows[worst], dim=-1) * target
                state = opt.state[bank.weight]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key][dead] = 0.0
        self.log.append({"step": step + 1, "resampled": int(dead.numel())})


@dataclasses.dataclass(frozen=True)
class BankPoint:
    """One bank configuration of the coverage frontier."""

    K: int = 2048
    k: int = 8
    init: str = "kpp"  # kpp | rows | kmeans
    r: float = 0.5  # weight of R1 and of R2 beside REC
    rs: int = 0  # 1: resample dead prototypes from the worst-reconstructed rows
    steps: int = 300
    docs: int = 40  # documents of the anchor set the bank trains on

    @classmethod
    def parse(cls, spec: str) -> BankPoint:
        """``"K=2048,k=8,init=kmeans"`` → BankPoint (unnamed fields keep their defaults)."""
        kw: dict[str, int | float | str] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for item in spec.split(","):
            key, val = item.split("=")
            kw[key] = {"int": int, "float": float, "str": str}[str(types[key])](val)
        if kw.get("init", "kpp") not in ("kpp", "rows", "kmeans"):
            raise ValueError(f"unknown init in {spec!r} (kpp, rows or kmeans)")
        return cls(**kw)  # type: ignore[arg-type]  # each value parsed to its field's type above

    @property
    def name(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @property
    def buildable(self) -> bool:
        """Whether ``prism retrofit`` builds this bank today (``kpp`` seeding, no resampling)."""
        return self.init == "kpp" and not self.rs

    def seed_fn(self, kmeans_iters: int) -> SeedFn:
        """The seeding of ``init``."""
        if self.init == "rows":
            return seed_rows
        if self.init == "kmeans":

            def kmeans(rows: torch.Tensor, K: int, k: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
                return seed_kmeans(rows, K, k, generator=generator, iters=kmeans_iters)

            return kmeans
        return seed_prototypes


class PointRecord(MeasuredBank, total=False):
    """``fit_point``'s record of one frontier point (what the frontier JSON keeps)."""

    config: dict[str, int | float | str]
    anchor_train_tokens: int
    epochs: float
    train_seconds: float
    seconds: float
    resampled: list[dict[str, int]]
    heldout_disjoint: bool
    git_revision: str | None
    load_average: list[float] | None


def fit_point(
    point: BankPoint,
    z_train: torch.Tensor,
    T: int,
    z_val: torch.Tensor,
    *,
    batch_seqs: int,
    lr: float,
    kmeans_iters: int,
) -> PointRecord:
    """Fit and measure one point (seed 0, uncentred)."""
    hook = Resampler(point.steps) if point.rs else None
    t0 = time.perf_counter()
    res = fit_bank(
        z_train,
        T,
        z_val,
        K=point.K,
        k=point.k,
        centred=False,
        steps=point.steps,
        batch_seqs=batch_seqs,
        lr=lr,
        seed=0,
        seed_fn=point.seed_fn(kmeans_iters),
        r_weight=point.r,
        on_step=hook,
    )
    rec: PointRecord = {
        "point": point.name,
        "config": dataclasses.asdict(point),
        "buildable": point.buildable,
        "anchor_train_tokens": int(z_train.shape[0]),
        "residual_share": res["residual_share"],
        "centred_residual_share": res["centred_residual_share"],
        "r1_bar": res["r1_bar"],
        "r2": res["r2"],
        "dead": res["dead"],
        "epochs": res["epochs"],
        "train_seconds": res["seconds"],
        "seconds": round(time.perf_counter() - t0, 1),  # seeding + training + held-out measurement
    }
    if hook is not None:
        rec["resampled"] = hook.log
    return rec
