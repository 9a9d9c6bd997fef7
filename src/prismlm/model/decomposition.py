"""The exact additive decomposition of logits into prototype slices and a residual slice (spec §1.5).

``PrismLM.forward`` makes every logit W r + Σ_i m_i a_i W p_i (+ b); ``decompose`` reads those terms back from
the same ``PrismOutput`` (under a residual-projecting suppression its ``residual`` is the edited r').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from prismlm.errors import ModelError
from prismlm.model.outputs import PrismOutput
from prismlm.model.prototypes import PrototypeLayer


class PrototypeHead(Protocol):
    """What ``decompose`` reads of a ``PrismLM`` (a protocol, so this module does not import the model's)."""

    lm_head: nn.Linear

    def require_prototypes(self, what: str = ...) -> PrototypeLayer: ...


@dataclass
class LogitDecomposition:
    """The exact additive decomposition of selected logits (spec §1.5): for token t and chosen token y,
    ``logit = prototype_slices.sum(-1) + residual_slice + bias_slice`` (to float rounding).

    Fields (B batch, T positions, k active prototypes per position):
        prototype_slices (B, T, k): a_{t,i} (W p_i)_y for each of the k active prototypes of position t, in
            the order of ``PrismOutput.indices`` (scaled by the multipliers under an intervention).
        residual_slice (B, T): (W r_t)_y, what no prototype carries (r' = r − Q Qᵀ r, the edited residual,
            under ``Suppress(ids, residual="project"|"mean"|"contrast")``).
        logit (B, T): ℓ_{t,y} as the forward computed it.
        bias_slice (B, T): b_y, the unembedding's bias (zeros without one).
    """

    prototype_slices: torch.Tensor
    """(B, T, k): a_{t,i} (W p_i)_y for each active prototype i of token t and chosen token y."""
    residual_slice: torch.Tensor
    """(B, T): (W r_t)_y."""
    logit: torch.Tensor
    """(B, T): ℓ_{t,y} from the forward pass; equals slices.sum(-1) + residual_slice + bias_slice to float
    tolerance."""
    bias_slice: torch.Tensor
    """(B, T): b_y, the unembedding's bias for the chosen token (zeros when W has none, as in GPT-2 and
    Llama): a constant per token that no prototype or residual carries."""


def decompose(model: PrototypeHead, out: PrismOutput, tokens: torch.Tensor) -> LogitDecomposition:
    """Split the logit of ``tokens`` (B, T) at every position into prototype slices plus a residual slice.

    The slices track gradients exactly when ``out`` does: after a no-grad (or inference-mode) forward they are
    plain detached values, although they are computed with the weights ``W`` and ``P``, which require grad."""
    if out.indices is None or out.activations is None or out.residual is None:
        raise ModelError("decompose needs a PRISM forward output (the dense baseline has no prototypes)")
    with torch.set_grad_enabled(torch.is_grad_enabled() and out.logits.requires_grad):
        return _decompose(model, out, tokens)


def _decompose(model: PrototypeHead, out: PrismOutput, tokens: torch.Tensor) -> LogitDecomposition:
    assert out.indices is not None and out.activations is not None and out.residual is not None
    W = model.lm_head.weight  # (V, d)
    w_y = W[tokens].to(out.residual.dtype)  # (B, T, d): the output row of each chosen token
    p_sel = model.require_prototypes().weight[out.indices].to(out.residual.dtype)  # (B, T, k, d)
    proto_slices = out.activations * torch.einsum("btkd,btd->btk", p_sel, w_y)  # (B, T, k)
    residual_slice = (out.residual * w_y).sum(-1)  # (B, T)
    if out.prototype_multipliers is not None:  # suppressed/controlled forward: slices scaled by m_i, as there
        proto_slices = proto_slices * out.prototype_multipliers[out.indices].to(proto_slices.dtype)
    logit = out.logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    bias = model.lm_head.bias
    bias_slice = bias[tokens].to(residual_slice.dtype) if bias is not None else torch.zeros_like(residual_slice)
    return LogitDecomposition(
        prototype_slices=proto_slices, residual_slice=residual_slice, logit=logit, bias_slice=bias_slice
    )
