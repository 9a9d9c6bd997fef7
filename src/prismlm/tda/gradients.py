"""Prototype-space gradients (spec §3.2): the one copy of the output-side factor
``u_t = Wᵀ(softmax(ℓ_t) − e_{y_t})`` (``output_gradients``), the block gradients
``G_{j,i} = Σ_t a_{t,i} u_t`` (``block_gradients``) and the preconditioned query table ``H_i⁻¹ G_{q,i}``
(``query_table``), used by the full-gradient reference, the postings cache and ``attribute``.

Invariant: residuals and activations are held fixed, so a block gradient needs only the model's one
forward output, no backward pass. Derivation: docs/attribution.md ("Gradients").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F_

from prismlm.errors import ModelError

if TYPE_CHECKING:
    from prismlm.model import PrismLM, PrismOutput

__all__ = [
    "BlockGradients",
    "Preconditioner",
    "block_gradients",
    "output_gradients",
    "precondition",
    "query_table",
    "softmax_products",
]


@dataclass
class BlockGradients:
    """Sparse block gradients: one row per (sequence, active prototype), ordered by (sequence, prototype)."""

    seq: torch.Tensor
    """(R,) int64: sequence id of each row (a training sequence id, or a query's position in its batch)."""
    proto: torch.Tensor
    """(R,) int64: prototype id of each row."""
    grad: torch.Tensor
    """(R, d): G_{seq, proto} = Σ_t a_{t,proto} u_t over the sequence's measured tokens."""
    loss: torch.Tensor | None = None
    """(n_seq,) summed cross-entropy of each sequence's measured tokens (for reporting)."""

    @property
    def rows(self) -> int:
        return int(self.seq.shape[0])

    def select(self, mask: torch.Tensor) -> BlockGradients:
        return BlockGradients(self.seq[mask], self.proto[mask], self.grad[mask], self.loss)

    @staticmethod
    def cat(parts: list[BlockGradients]) -> BlockGradients:
        losses = [p.loss for p in parts if p.loss is not None]
        return BlockGradients(
            torch.cat([p.seq for p in parts]),
            torch.cat([p.proto for p in parts]),
            torch.cat([p.grad for p in parts]),
            torch.cat(losses) if losses else None,
        )


SOFTMAX_BLOCK = 1 << 21
"""Entries of the logits softmaxed at once in ``output_gradients`` (256 rows of an 8,192-token vocabulary:
8 MiB in float32)."""


def softmax_products(
    logits: torch.Tensor,
    W: torch.Tensor,
    rows: int | None = None,
    on_block: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """μ_t = Wᵀ softmax(ℓ_t) for every row of ``logits`` (N, V): (N, d) in ``W``'s dtype (W: (V, d)).

    π never exists whole: ``rows`` rows at a time (default ≤ ``SOFTMAX_BLOCK`` entries) are softmaxed and
    multiplied while they are still in cache — 1.7× faster than softmax-then-matmul on (2048 × 8192) logits
    on one CPU thread, and the memory is one block instead of a second (N, V) tensor. ``on_block(π, μ)``
    sees each block (the curvature's sums). The one copy of this product: the postings pass and the
    curvature pass get the same μ, bit for bit, from the same blocks."""
    N, V = logits.shape
    rows = rows or max(1, SOFTMAX_BLOCK // V)
    out = torch.empty(N, W.shape[1], dtype=W.dtype, device=logits.device)  # (N, d)
    for a in range(0, N, rows):
        pi = torch.softmax(logits[a : a + rows].to(W.dtype), dim=-1)  # (n, V)
        torch.mm(pi, W, out=out[a : a + rows])
        if on_block is not None:
            on_block(pi, out[a : a + rows])
    return out


def output_gradients(
    model: PrismLM, logits: torch.Tensor, targets: torch.Tensor, mu: torch.Tensor | None = None
) -> torch.Tensor:
    """u_t = Wᵀ(π_t − e_{y_t}) for every token: (B, T, d) from ``logits`` (B, T, V) and ``targets`` (B, T).

    Computed in ``promote(logits.dtype, float32)`` (float64 for a float64 model); W is the model's
    ``lm_head.weight``, detached. ``mu``: Wᵀπ_t (B·T, d) already computed by ``softmax_products`` from these
    logits (the curvature pass's), else computed here."""
    dt = torch.promote_types(logits.dtype, torch.float32)
    W = model.lm_head.weight.detach().to(dt)  # (V, d)
    *lead, V = logits.shape
    if mu is None:
        mu = softmax_products(logits.detach().reshape(-1, V), W)  # (N, d)
    return mu.view(*lead, W.shape[1]) - W[targets]  # (B, T, d): Wᵀ(π − e_y)


def block_gradients(
    model: PrismLM,
    out: PrismOutput,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
) -> BlockGradients:
    """Exact prototype-space block gradients of a batch from its forward output.

    ``out``: the model's ``PrismOutput`` for inputs (B, T); ``targets`` (B, T) next tokens; ``mask``
    (B, T) bool: tokens whose loss is measured (default all); ``seq_ids`` (B,) the ids written to the rows
    (default 0..B-1). Vectorised: one ``index_add_`` over the (token, active prototype) pairs.
    """
    if out.indices is None or out.activations is None or model.prototypes is None:
        raise ModelError("prototype-space gradients need a PRISM model (the dense baseline has no prototypes)")
    B, T, k = out.indices.shape
    K = model.prototypes.num_prototypes
    dt = torch.promote_types(out.logits.dtype, torch.float32)
    logits = out.logits.detach().to(dt)  # (B, T, V)
    u = output_gradients(model, logits, targets)  # (B, T, d)
    ce = F_.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1), reduction="none").view(B, T)  # (B, T)
    if mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=logits.device)
    ids = torch.arange(B, device=logits.device) if seq_ids is None else seq_ids.to(logits.device)
    a = out.activations.detach().to(dt)  # (B, T, k)
    on = (a > 0) & mask[:, :, None]  # (B, T, k): measured (token, active prototype) pairs
    keys = (torch.arange(B, device=a.device)[:, None, None] * K + out.indices)[on]  # (P,)
    vals = (a[:, :, :, None] * u[:, :, None, :])[on]  # (P, d)
    uniq, inv = torch.unique(keys, return_inverse=True)  # sorted: rows ordered by (sequence, prototype)
    G = torch.zeros(uniq.shape[0], u.shape[-1], dtype=dt, device=a.device).index_add_(0, inv, vals)  # (R, d)
    loss = (ce * mask).sum(1)  # (B,)
    return BlockGradients(seq=ids[uniq // K], proto=uniq % K, grad=G, loss=loss)


class Preconditioner(Protocol):
    """A block-diagonal curvature H (``prismlm.tda.influence.Curvature``): ``apply(proto, G, power)`` is
    H_i^power G for rows ``G`` (n, d) of prototypes ``proto`` (n,). Declared here so that the gradients
    depend on no curvature implementation (influence builds on gradients, not the other way)."""

    def apply(self, proto: torch.Tensor, G: torch.Tensor, power: float) -> torch.Tensor: ...


def precondition(
    query: BlockGradients, curvature: Preconditioner | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """(R, d): H_i⁻¹ G_{q,i} for each row of ``query`` (its gradient itself when ``curvature`` is None,
    i.e. H_i = I), in ``dtype`` (default the gradients' dtype)."""
    G = query.grad if dtype is None else query.grad.to(dtype)
    return G if curvature is None else curvature.apply(query.proto, G, -1.0)


def query_table(
    query: BlockGradients,
    curvature: Preconditioner | None,
    num_prototypes: int,
    num_queries: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """(K, Q, d): ``table[i, q] = H_i⁻¹ G_{q,i}`` for every prototype i active in query q, zeros elsewhere.

    The influence of a training block (j, i) on query q is then ``G_{j,i} · table[i, q]``."""
    P = precondition(query, curvature, dtype)  # (Rq, d)
    dev = P.device if device is None else device
    table = torch.zeros(num_prototypes, num_queries, P.shape[1], dtype=P.dtype, device=dev)
    table[query.proto.to(dev), query.seq.to(dev)] = P.to(dev)
    return table
