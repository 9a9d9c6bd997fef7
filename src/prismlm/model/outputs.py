"""``PrismOutput``: the one structured forward output of ``PrismLM`` (``prismlm.model.gpt``).

Training, attribution, control, evaluation and the explorer all read this one value; the decode loop
(``prismlm.model.generation``) yields it per step. Its prototype fields are None for the dense baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PrismOutput"]


@dataclass
class PrismOutput:
    """The one structured forward output that training, attribution, control, evaluation and the
    explorer all read. Prototype fields are ``None`` for the dense baseline.

    B batch, T tokens of this forward (the new ones with a cache), V vocabulary, d width, k active
    prototypes per token, K prototypes, L layers, H heads, P cached positions.

    Fields:
        logits (B, T, V) — or (B, 1, V) with ``last_only`` — next-token logits; under ``suppress``/
            ``control``/``intervene`` the modified ones.
        hidden (B, T, d): z, the final-norm hidden states the head reads (logits = lm_head(z) unmodified).
        indices (B, T, k) int64: each token's top-k prototype ids, by decreasing cosine.
        activations (B, T, k): their non-negative activations a_i.
        residual (B, T, d): r = z − Σ_i a_i p_i; under ``Suppress(ids, residual="project"|"mean"|"contrast")`` the
            edited r' = r − Q Qᵀ r the logits were made of.
        residual_removed (B, T, d): Q Qᵀ r, what that projection took out (r = residual + residual_removed);
            else None. residual_projected_ids: the prototypes Q comes from; residual_projection_mode:
            ``project`` (Q spans them), ``mean`` (Q = their unit mean u) or ``contrast`` (Q = v, their mean
            minus the bank's, made unit); else None.
        token_max_cos (B, T): max_i cos(z_t, p_i), how well each token is covered.
        proto_max_cos (K,): max over this batch's tokens of cos(p_i, z_t).
        losses {name: scalar}: unweighted ``ce`` (with targets), ``rec``, ``r1``, ``r2`` (PRISM).
        loss scalar: the weighted total (with targets), else None.
        prototype_multipliers (K,): the multipliers m the logits were computed with, or None.
        hidden_states L + 1 × (B, T, d): with ``output_hidden_states``, the embedding output then each
            block's output, the last one after the final norm (= hidden); else None.
        attentions L × (B, H, T, P + T): with ``output_attentions``, the attention weights; else None.
    """

    logits: torch.Tensor
    """(B, T, V) next-token logits (or (B, 1, V) with ``last_only``); inside ``model.suppress(...)`` /
    ``model.control(...)`` these are the suppressed/controlled logits (there is no second output)."""
    hidden: torch.Tensor
    """(B, T, d) z: final-LayerNorm hidden states."""
    indices: torch.Tensor | None = None
    """(B, T, k) int64 top-k prototype ids per token."""
    activations: torch.Tensor | None = None
    """(B, T, k) non-negative activations of those prototypes."""
    residual: torch.Tensor | None = None
    """(B, T, d) r = z − Σ a_i p_i; under a residual-projecting suppression the edited r' = r − Q Qᵀ r, so
    logits = W r' + Σ m_i a_i W p_i (+ b) still holds (``decompose`` reads it)."""
    token_max_cos: torch.Tensor | None = None
    """(B, T) max_i cos(z_t, p_i): how well each token is covered by its nearest prototype."""
    proto_max_cos: torch.Tensor | None = None
    """(K,) max over this batch's tokens of cos(p_i, z_t): how close each prototype is to real data."""
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Unweighted loss terms: ``ce`` (when targets are given), and ``rec``, ``r1``, ``r2`` for PRISM."""
    loss: torch.Tensor | None = None
    """Weighted total loss (when targets and loss weights are given)."""
    prototype_multipliers: torch.Tensor | None = None
    """(K,) the multipliers m the logits were computed with (suppression: 0, controller: 1 + c), or None
    for the unmodified model; ``decompose`` scales the slices by them, so it stays exact."""
    hidden_states: tuple[torch.Tensor, ...] | None = None
    """With ``output_hidden_states=True``: n_layer + 1 tensors (B, T, d) — the embedding output (token +
    position embeddings), then each block's output, the last one after the final norm, i.e. ``hidden``
    (transformers' convention). Otherwise None."""
    attentions: tuple[torch.Tensor, ...] | None = None
    """With ``output_attentions=True``: n_layer tensors (B, n_head, T, P + T) of attention weights (each
    row sums to 1; P cached positions). Otherwise None."""
    residual_removed: torch.Tensor | None = None
    """(B, T, d) Q Qᵀ r: the part of the residual ``Suppress(ids, residual="project"|"mean"|"contrast")`` took out (Q an
    orthonormal basis of the suppressed prototypes' span, or their unit mean u); None without that edit."""
    residual_projected_ids: tuple[int, ...] | None = None
    """The prototype ids whose span (or mean) was projected out of the residual (the edit's provenance);
    else None."""
    residual_projection_mode: str | None = None
    """``project`` or ``mean``: how ``residual_projected_ids`` made Q; None without the edit."""
