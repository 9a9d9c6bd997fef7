"""``bench/real_retrofit.py --stage frontier``: issue 26 item 3's coverage frontier of the frozen bank.

Every point trains one bank on the stored z of SmolLM2-135M-Instruct (``train_bank_config``: AdamW at
``--lr``, warm-up then cosine to 0.1×, minibatches of ``--batch-size`` whole stored sequences) and measures
it on every held-out token of the 40-document anchor set's val split (``coverage``): residual share
‖r‖/‖z‖, centred residual share ‖r‖/‖z − μ‖ (the honest one), R̄1, R2, dead. The axes:

    * **init**: ``kpp`` — ``seed_prototypes`` (k-means++ picks in cosine distance among 16·K stored rows,
      one least-squares scale: what a retrofit does today); ``rows`` — K random stored rows, same scale (the
      naive baseline); ``kmeans`` — ``kpp`` then ``--kmeans-iters`` spherical Lloyd iterations (float32) on the same
      rows (each prototype the mean direction of its cluster at its cluster's mean norm, then the same scale).
    * **resample** (``rs``): after 1/5, 2/5 and 3/5 of the steps, the prototypes never active on 16,384
      training rows are re-seeded from the rows the bank reconstructs worst (‖r‖/‖z‖), at the median
      prototype norm, their AdamW state cleared (the "seed from the worst-reconstructed rows" idea).
    * **loss**: ``r=0.5`` — REC + 0.5·R1 + 0.5·R2 (the frozen stage's weights); ``r=0`` — REC only.
    * **k**, **K**, **steps**, and **docs**: the anchor set's size — 40 documents (61,440 training tokens) or
      more (``--frontier-docs``; the held-out tokens stay the 40-document val split: the split is per document
      by a hash of its id, so those documents are held out of the larger training split too — checked).

A point is ``buildable`` when ``prism retrofit`` can make that bank today: K, k, steps, the loss weights and
the anchor set are its options and its seeding is ``kpp``; ``kmeans`` and ``rs`` are not (yet) in the
library. The JSON is written after every point and points already in it are skipped (resumable).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from prismlm.data.shards import ShardSet
from prismlm.model.prototypes import PrototypeLayer, seed_prototypes

# the order the points run in (cheapest questions first); ``--points`` replaces it
DEFAULT_POINTS = (
    "K=2048,k=8,init=kpp,steps=300",
    "K=2048,k=32,init=kpp,steps=300",
    "K=2048,k=8,init=kpp,r=0,steps=300",
    "K=2048,k=8,init=kmeans,steps=300",
    "K=2048,k=8,init=kpp,rs=1,steps=300",
    "K=2048,k=64,init=kpp,steps=300",
    "K=2048,k=16,init=kpp,steps=300",
    "K=2048,k=8,init=rows,steps=300",
)


@dataclasses.dataclass(frozen=True)
class Point:
    """One bank configuration of the frontier."""

    K: int = 2048
    k: int = 8
    init: str = "kpp"  # kpp | rows | kmeans
    r: float = 0.5  # weight of R1 and of R2 beside REC
    rs: int = 0  # 1: resample dead prototypes from the worst-reconstructed rows
    steps: int = 300
    docs: int = 40  # documents of the anchor set the bank trains on

    @classmethod
    def parse(cls, spec: str) -> Point:
        """``"K=2048,k=8,init=kmeans"`` → Point (unnamed fields keep their defaults)."""
        kw: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for item in spec.split(","):
            key, val = item.split("=")
            kw[key] = {"int": int, "float": float, "str": str}[str(types[key])](val)
        if kw.get("init", "kpp") not in ("kpp", "rows", "kmeans"):
            raise SystemExit(f"unknown init in {spec!r}")
        return cls(**kw)

    @property
    def name(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @property
    def buildable(self) -> bool:
        """Whether ``prism retrofit`` builds this bank today (see the module docstring)."""
        return self.init == "kpp" and not self.rs


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
    """``train_bank_config``'s ``on_step``: at the given steps, re-seed the prototypes never active on a
    sample of training rows from the sample's worst-reconstructed rows (‖r‖/‖z‖), at the median prototype
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


def seed_fn_of(point: Point, kmeans_iters: int) -> Callable[..., torch.Tensor]:
    if point.init == "rows":
        return seed_rows
    if point.init == "kmeans":
        return lambda rows, K, k, generator=None: seed_kmeans(rows, K, k, generator=generator, iters=kmeans_iters)
    return seed_prototypes


def heldout_disjoint(val: ShardSet, train: ShardSet, T: int) -> bool:
    """No held-out sequence (T + 1 tokens) of ``val``'s val split appears among ``train``'s training
    sequences: the larger anchor set does not train on the tokens the frontier measures on."""
    v = val.val.sequences(np.arange(val.val.num_sequences(T)), T)
    t = train.train.sequences(np.arange(train.train.num_sequences(T)), T)
    seen = {row.tobytes() for row in t}
    return not any(row.tobytes() in seen for row in v)


def load_points(path: Path) -> list[dict[str, Any]]:
    """The points of an earlier (partial) run of the same file, to resume."""
    if not path.exists():
        return []
    return list(json.loads(path.read_text()).get("points", []))


def merged(path: Path, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mine`` and the points another run wrote to ``path`` meanwhile (two runs may share the file: each
    writes the union, its own record of a point first)."""
    names = {p["point"] for p in mine}
    return mine + [p for p in load_points(path) if p["point"] not in names]


def run_point(
    point: Point,
    z_train: torch.Tensor,
    T: int,
    z_val: torch.Tensor,
    *,
    batch_seqs: int,
    lr: float,
    kmeans_iters: int,
    train_bank_config: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """Train and measure one point; the record the JSON keeps."""
    hook = Resampler(point.steps) if point.rs else None
    t0 = time.perf_counter()
    res = train_bank_config(
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
        seed_fn=seed_fn_of(point, kmeans_iters),
        r_weight=point.r,
        on_step=hook,
    )
    return {
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
        **({"resampled": hook.log} if hook is not None else {}),
    }


def best_point(points: list[dict[str, Any]], buildable: bool | None = None) -> dict[str, Any] | None:
    """The point of lowest centred residual share (among the buildable ones when asked)."""
    pool = [p for p in points if buildable is None or p["buildable"] == buildable]
    return min(pool, key=lambda p: p["centred_residual_share"], default=None)


def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a`` is at least as good as ``b`` on every coverage number (centred residual share and dead lower,
    R̄1 and R2 higher) and better on one."""
    ge = (
        a["centred_residual_share"] <= b["centred_residual_share"]
        and a["dead"] <= b["dead"]
        and a["r1_bar"] >= b["r1_bar"]
        and a["r2"] >= b["r2"]
    )
    keys = ("centred_residual_share", "dead", "r1_bar", "r2")
    return ge and any(a[key] != b[key] for key in keys)


def pareto(points: list[dict[str, Any]]) -> list[str]:
    """The frontier: the points no other point dominates."""
    return [p["point"] for p in points if not any(dominates(q, p) for q in points)]
