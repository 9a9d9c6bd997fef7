"""The PRISM objective (spec §2) as pure functions of tensors.

L = CE + λ_rec·REC + λ₁·R1 + λ₂·R2. The R1/R2 functions take the already-reduced maxima that the
prototype layer computes from its single similarity pass, so no second N × K matrix is ever built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1) -> torch.Tensor:
    """Mean next-token cross-entropy. logits (..., V), targets (...) int64."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 → fp32, fp64 stays
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


def reconstruction_loss(residual: torch.Tensor, hidden: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """REC = mean over tokens of ‖r_t‖² / ‖z_t‖². residual, hidden: (N, d)."""
    hidden = hidden.to(torch.promote_types(hidden.dtype, torch.float32))  # bf16 → fp32, fp64 stays fp64
    return (residual.pow(2).sum(-1) / hidden.pow(2).sum(-1).clamp_min(eps)).mean()


def r1_loss(proto_max_cos: torch.Tensor) -> torch.Tensor:
    """R1 (prototype → data) = mean_i min_t (1 − cos(p_i, z_t)) = mean_i (1 − max_t cos). Input (K,)."""
    return (1.0 - proto_max_cos).mean()


def r2_loss(token_max_cos: torch.Tensor) -> torch.Tensor:
    """R2 (data → prototype) = mean_t min_i (1 − cos(z_t, p_i)) = mean_t (1 − max_i cos). Input (N,)."""
    return (1.0 - token_max_cos).mean()


def kl_to_reference(reference_log_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(p_ref ‖ softmax(logits)) = Σ_v p_ref,v (log p_ref,v − log q_v).

    reference_log_probs (N, V): log p_ref, already normalised and detached by the caller (the distribution
    to match: the source model's, or the model's own); logits (N, V). Used for distillation: the full
    model toward its source in stage 2, and the prototype-only prediction softmax(W ẑ) toward the model."""
    log_q = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (N, V)
    ref = reference_log_probs.to(log_q.dtype)
    return (ref.exp() * (ref - log_q)).sum(-1).mean()


def candidate_unembedding(
    lm_head: torch.nn.Linear, reference_logits: torch.Tensor, candidates: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The unembedding restricted to the union of every row's ``candidates`` most likely tokens under
    ``reference_logits`` (N, V) — a KL over its outputs is the KL of both distributions renormalised on that
    union — or the whole ``lm_head`` when ``candidates`` is 0 (``loss.kl_candidates``)."""
    if not candidates:
        return lm_head
    k = min(candidates, reference_logits.shape[-1])
    return restricted_unembedding(lm_head, reference_logits.detach().topk(k, dim=-1).indices, k)


def restricted_unembedding(
    lm_head: torch.nn.Linear, top_ids: torch.Tensor, candidates: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The unembedding restricted to U, the union of the first ``candidates`` columns of ``top_ids`` (N, ≥ c)
    — each row's most likely tokens, most likely first (ranked on the fly, or stored once:
    ``prismlm.model.stored_activations.build_stored_candidates``). U's ids are sorted, so the restriction
    is a plain (|U|, d) matrix product. W is frozen where this is used: no gradient reaches it."""
    ids = top_ids[:, :candidates].reshape(-1).unique()  # (|U|,) sorted
    weight = lm_head.weight[ids]  # (|U|, d)
    bias = lm_head.bias[ids] if lm_head.bias is not None else None
    return lambda x: F.linear(x, weight, bias)


def prototype_kl(logits: torch.Tensor, prototype_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ p̂) with p = softmax(logits) the model's own prediction (detached: the target, not moved by this
    term) and p̂ = softmax(prototype_logits), the prediction of the prototypes alone (W ẑ). (N, V) each."""
    return kl_to_reference(
        F.log_softmax(logits.detach().to(torch.promote_types(logits.dtype, torch.float32)), -1), prototype_logits
    )


def total_loss(terms: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """Weighted sum of the loss terms present in ``terms`` (a dense model only has ``ce``)."""
    total = terms["ce"] * weights.get("ce", 1.0)
    for name, value in terms.items():
        if name != "ce" and weights.get(name, 0.0) != 0.0:
            total = total + weights[name] * value
    return total
