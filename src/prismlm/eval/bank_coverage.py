"""How well a prototype bank covers held-out hidden states, and the comparison of banks by those numbers.

``bank_coverage`` measures a bank on rows z (N, d): residual share ‖r‖/‖z‖, centred residual share
‖r‖/‖z − μ‖ (the honest one: how much of the token-specific part the bank leaves), R̄1 (mean over prototypes of
the best cosine to a row), R2 (mean over rows of the best cosine to a prototype) and dead prototypes (never
active). ``heldout_coverage`` adds a model's held-out cross-entropy. ``dominates``, ``pareto`` and
``best_point`` compare measured banks (the coverage frontier of ``bench/real_retrofit.py --stage frontier``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from prismlm.data.shards import ShardSet
from prismlm.model import PrismLM
from prismlm.model.prototypes import PrototypeLayer


class Coverage(TypedDict):
    """Coverage of a bank on held-out rows (``bank_coverage``)."""

    residual_share: float
    """Mean over rows of ‖r‖/‖z‖."""
    centred_residual_share: float
    """Mean over rows of ‖r‖/‖z − μ‖ (μ: the training rows' mean)."""
    r1_bar: float
    """Mean over prototypes of the best cosine to a row."""
    r2: float
    """Mean over rows of the best cosine to a prototype."""
    dead: int
    """Prototypes never active on the rows."""


class HeldoutCoverage(Coverage):
    """``heldout_coverage``: a model's held-out cross-entropy beside its bank's coverage."""

    ce: float
    """Mean held-out cross-entropy per token (nats)."""
    tokens: int
    """Held-out tokens measured."""
    mu_sequences: int
    """Training sequences μ was averaged over."""


class MeasuredBank(Coverage, total=False):
    """A measured bank as a frontier records it: its name, whether a retrofit builds it today, and more."""

    point: str
    buildable: bool


P = TypeVar("P", bound=MeasuredBank)


def bank_coverage(
    bank: PrototypeLayer, z: torch.Tensor, mu: torch.Tensor, centred: bool, chunk: int = 4096
) -> Coverage:
    """Coverage of ``bank`` on z (N, d); ``mu`` (d,): the training rows' mean; ``centred``: the bank
    reconstructs z − μ (else z). Sums in float64, ``chunk`` rows at a time."""
    K = bank.num_prototypes
    best = torch.full((K,), -2.0, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.long)
    r2 = share = cshare = 0.0
    with torch.no_grad():
        for s in range(0, z.shape[0], chunk):
            zc = z[s : s + chunk]  # (n, d)
            x = zc - mu if centred else zc
            po = bank(x)
            r = po.residual.double()  # (n, d)
            share += float((r.norm(dim=-1) / zc.double().norm(dim=-1)).sum())
            cshare += float((r.norm(dim=-1) / (zc - mu).double().norm(dim=-1)).sum())
            r2 += float(po.token_max_cos.double().sum())
            best = torch.maximum(best, po.proto_max_cos.double())
            counts += torch.bincount(po.indices[po.activations > 0], minlength=K)
    n = z.shape[0]
    return {
        "residual_share": share / n,
        "centred_residual_share": cshare / n,
        "r1_bar": float(best.mean()),
        "r2": r2 / n,
        "dead": int((counts == 0).sum()),
    }


def _ids(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int64))


@torch.inference_mode()
def heldout_coverage(model: PrismLM, shards: ShardSet, T: int, mu_sequences: int, batch: int = 4) -> HeldoutCoverage:
    """Held-out CE and (uncentred) bank coverage of ``model`` on every validation sequence of T + 1 tokens;
    μ from the model's own z over the first ``mu_sequences`` training sequences."""
    model.eval()
    zs = [
        model.backbone(_ids(shards.train.sequences(np.arange(s, min(s + batch, mu_sequences)), T)[:, :-1]))
        for s in range(0, mu_sequences, batch)
    ]
    mu = torch.cat(zs).reshape(-1, model.config.n_embd).mean(0)  # (d,)
    n_val = shards.val.num_sequences(T)
    ce_sum, z_val = 0.0, []
    V = model.config.vocab_size
    for s in range(0, n_val, batch):
        seq = _ids(shards.val.sequences(np.arange(s, min(s + batch, n_val)), T))  # (b, T + 1)
        z = model.backbone(seq[:, :-1])  # (b, T, d)
        logits = model.lm_head(z)[..., :V]  # (b, T, V)
        ce_sum += float(F.cross_entropy(logits.reshape(-1, V), seq[:, 1:].reshape(-1), reduction="sum"))
        z_val.append(z.reshape(-1, z.shape[-1]))
    zv = torch.cat(z_val)
    cov = bank_coverage(model.require_prototypes(), zv, mu, centred=False)
    return {"ce": ce_sum / zv.shape[0], "tokens": zv.shape[0], "mu_sequences": mu_sequences, **cov}


def heldout_disjoint(val: ShardSet, train: ShardSet, T: int) -> bool:
    """No held-out sequence (T + 1 tokens) of ``val``'s val split appears among ``train``'s training
    sequences: a larger anchor set does not train on the tokens a bank is measured on."""
    v = val.val.sequences(np.arange(val.val.num_sequences(T)), T)
    t = train.train.sequences(np.arange(train.train.num_sequences(T)), T)
    seen = {row.tobytes() for row in t}
    return not any(row.tobytes() in seen for row in v)


def dominates(a: Coverage, b: Coverage) -> bool:
    """``a`` is at least as good as ``b`` on every coverage number (centred residual share and dead lower,
    R̄1 and R2 higher) and better on one."""
    ge = (
        a["centred_residual_share"] <= b["centred_residual_share"]
        and a["dead"] <= b["dead"]
        and a["r1_bar"] >= b["r1_bar"]
        and a["r2"] >= b["r2"]
    )
    return ge and (
        a["centred_residual_share"] != b["centred_residual_share"]
        or a["dead"] != b["dead"]
        or a["r1_bar"] != b["r1_bar"]
        or a["r2"] != b["r2"]
    )


def pareto(points: Sequence[MeasuredBank]) -> list[str]:
    """The frontier: the names of the points no other point dominates."""
    return [p["point"] for p in points if not any(dominates(q, p) for q in points)]


def best_point(points: Sequence[P], buildable: bool | None = None) -> P | None:
    """The point of lowest centred residual share (among those with that ``buildable`` when given)."""
    pool = [p for p in points if buildable is None or p["buildable"] == buildable]
    return min(pool, key=lambda p: p["centred_residual_share"], default=None)
