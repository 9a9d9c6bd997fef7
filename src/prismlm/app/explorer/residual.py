"""Beyond the top-5 alternatives: "why this token and not *that* one" for any token typed in (``contrast_view``),
and the residual slice as an object of its own (``residual_view``): what the residual vector r_t pushes, the
prototypes (anchors) nearest to it with their training contexts, and its share over an answer.

Invariant: every number is read off one forward of the given tokens (``decompose`` / the waterfalls of the
Explain view), so a contrast's split adds up to its logit exactly, like the view's own alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

from prismlm.app.explorer.explain import PositionView, waterfalls
from prismlm.app.explorer.limits import check_limit
from prismlm.app.explorer.plain import Plain
from prismlm.app.explorer.session import Session
from prismlm.app.explorer.steer import Steering, interventions
from prismlm.errors import ConfigError
from prismlm.model import decompose

__all__ = ["Anchor", "ContrastView", "ResidualView", "contrast_view", "residual_view"]


@dataclass
class ContrastView(Plain):
    """What ``Explorer.contrast`` returns: the typed token's logit at ``token_index``, split exactly."""

    token_index: int
    """Index of the explained token (the prediction OF it is made at ``token_index − 1``)."""
    view: PositionView
    """The position with the typed token as its ``chosen`` (rank and probability among all tokens), its
    slices aligned to ``view.active`` (ordered by that token's |slice|: match them by prototype id)."""


class Anchor(TypedDict):
    """A prototype near the residual vector, with its nearest training context."""

    id: int
    cosine: float
    label: str | None
    before: str
    target: str
    after: str


@dataclass
class ResidualView(Plain):
    """What ``Explorer.residual`` returns: the residual slice of one position as an object of its own."""

    token_index: int
    token: str
    """The explained token (the text's token at ``token_index``)."""
    residual_slice: float
    """(W r_t)_y: the residual's part of that token's logit."""
    residual_share: float
    """|residual slice| / (Σ |prototype slices| + |residual slice|) at that position."""
    norm_share: float
    """‖r_t‖ / ‖z_t‖: how much of the hidden state the prototypes leave out."""
    pushes_up: list[tuple[str, float]]
    """The tokens W r_t raises most."""
    pushes_down: list[tuple[str, float]]
    anchors: list[Anchor]
    """The prototypes whose direction is nearest to r_t (cosine), with their nearest training contexts."""
    answer_share: float
    """Mean residual share over the tokens from ``answer_from`` on (an answer or a generation)."""
    answer_from: int
    answer_tokens: int


def _checked(s: Session, token_ids: list[int], token_index: int) -> None:
    check_limit(
        len(token_ids) <= s.model.config.block_size, "token_ids", f"{s.model.config.block_size} tokens", len(token_ids)
    )
    if not 1 <= token_index < len(token_ids) + 1:
        raise ConfigError(f"token_index must be in [1, {len(token_ids)}] (a token after the first), got {token_index}")
    vocab = s.run.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in token_ids):
        raise ConfigError(f"token_ids must be ids in [0, {vocab})")


def contrast_view(s: Session, token_ids: list[int], token_index: int, token: str, steering: Steering) -> ContrastView:
    """``Explorer.contrast``: the logit of ``token`` (one token of the vocabulary, typed) as the prediction at
    ``token_index`` of ``token_ids``, under ``steering``, split into the active prototypes' slices + residual."""
    _checked(s, token_ids, token_index)
    ids = s.run.tokenizer.encode(token)
    if len(ids) != 1:
        raise ConfigError(
            f"token {token!r} is {len(ids)} tokens {ids}; type one token", fix="e.g. ' Rome' with its leading space"
        )
    ctx = token_ids[:token_index]  # position token_index − 1 predicts the token at token_index
    chosen = ctx[1:] + ids
    ivs = interventions(s, steering)
    with s.lock, s.run.intervened(*ivs) as model, torch.no_grad():
        out = model(torch.tensor([ctx], dtype=torch.long, device=s.run.device))
        views, _ = waterfalls(s, model, out, chosen, ["text"] * (len(ctx) - 1) + ["typed"], 0)
    return ContrastView(token_index=token_index, view=views[-1])


def residual_view(
    s: Session, token_ids: list[int], token_index: int, *, answer_from: int = 1, top: int = 8
) -> ResidualView:
    """``Explorer.residual``: the residual vector r_t of the position predicting ``token_ids[token_index]``:
    its slice and share, the tokens it pushes, the nearest prototypes (anchors) and their contexts, and the
    residual's mean share over the tokens from ``answer_from`` on."""
    _checked(s, token_ids, token_index)
    if token_index >= len(token_ids):
        raise ConfigError(f"token_index must name a token of the text (< {len(token_ids)}), got {token_index}")
    s.limits.check_top(top, "top")
    tok, t = s.run.tokenizer, token_index - 1
    with s.lock, s.run.intervened() as model, torch.no_grad():
        x = torch.tensor([token_ids], dtype=torch.long, device=s.run.device)  # (1, n)
        out = model(x[:, :-1])
        dec = decompose(model, out, x[:, 1:])
        assert out.residual is not None
        r, z = out.residual[0, t].float(), out.hidden[0, t].float()  # (d,)
        push = (model.lm_head.weight.float() @ r)[: tok.vocab_size]  # (V,) W r_t
        P = model.require_prototypes().weight.float()  # (K, d)
        cos = (P @ r) / (P.norm(dim=-1) * r.norm()).clamp_min(1e-12)  # (K,)
    share = dec.residual_slice[0].abs() / (
        dec.prototype_slices[0].abs().sum(-1) + dec.residual_slice[0].abs()
    )  # (n−1,)
    a = max(0, min(answer_from, len(token_ids) - 1) - 1)  # shares are per predicted token: index − 1
    near = cos.topk(min(top, cos.numel())).indices.tolist()
    return ResidualView(
        token_index=token_index,
        token=tok.id_to_token(token_ids[token_index]),
        residual_slice=float(dec.residual_slice[0, t]),
        residual_share=float(share[t]),
        norm_share=float(r.norm() / z.norm().clamp_min(1e-12)),
        pushes_up=[(tok.id_to_token(int(i)), float(push[i])) for i in push.topk(top).indices],
        pushes_down=[(tok.id_to_token(int(i)), float(push[i])) for i in (-push).topk(top).indices],
        anchors=_anchors(s, near, cos),
        answer_share=float(share[a:].double().mean()),
        answer_from=a + 1,
        answer_tokens=int(share[a:].numel()),
    )


def _anchors(s: Session, ids: list[int], cos: torch.Tensor) -> list[Anchor]:
    """The prototypes ``ids`` with their cosine to r_t, label and (with an index) nearest training context."""
    labs = s.labelled(ids)
    nbs = s.index.neighbours_of(ids, 1, before=10, after=3) if s.index is not None else {}
    out: list[Anchor] = []
    for i in ids:
        found = nbs.get(i) or []
        nb = found[0] if found else None
        out.append(
            {
                "id": i,
                "cosine": float(cos[i]),
                "label": labs[i][0],
                "before": nb.before if nb is not None else "",
                "target": (nb.target or "") if nb is not None else "",
                "after": nb.after if nb is not None else "",
            }
        )
    return out
