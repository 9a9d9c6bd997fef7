"""The explorer's Prototype view: one prototype's card, the direct effect on every token, examples across its
stored neighbourhood, the most similar prototypes, and where it fires in a given text.

Invariant: ``fires[].slice`` is ``decompose``'s slice of the token the view marks (the next token of the
text, the model's own argmax after its end), not a re-derivation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F

from prismlm.app.explorer.plain import Plain
from prismlm.app.explorer.session import Session
from prismlm.app.prototype_view import Band, LogitHistogram, example_bands, logit_histogram
from prismlm.explain import prototype_card
from prismlm.explain.records import CardDict
from prismlm.model import decompose

__all__ = ["Fire", "PrototypeDetail", "SimilarPrototype", "prototype_view"]


class SimilarPrototype(TypedDict):
    id: int
    cosine: float
    """cos(p_i, p_j) of the unit prototype vectors."""
    label: str | None
    category: str | None


class Fire(TypedDict):
    """Where a prototype is active in a text."""

    position: int
    """The predicting position."""
    token_index: int
    """position + 1: the token whose logit gets ``slice`` (``len(text_tokens)``: the model's own next)."""
    token: str
    next_token: str
    activation: float
    slice: float


@dataclass
class PrototypeDetail(Plain):
    """What ``Explorer.prototype`` returns for one prototype."""

    card: CardDict
    """``prismlm.explain.PrototypeCard.to_dict()``: label, category, top/bottom tokens, stats, neighbours."""
    similar: list[SimilarPrototype]
    """Nearest prototypes by cosine of p_i, with their labels."""
    fires: list[Fire] | None
    """Where it is active in the given text (None: no text given)."""
    text_tokens: list[str] | None
    """(n,) the tokens of the given text (None: no text)."""
    has_index: bool
    logit_histogram: LogitHistogram | None = None
    """Its direct effect on every token: a histogram of W p_i (``prismlm.app.prototype_view``)."""
    bands: list[Band] | None = None
    """Examples from the top, middle and bottom third of its stored nearest contexts (with an index)."""


def prototype_view(s: Session, i: int, *, text: str | None, neighbours: int, similar: int) -> PrototypeDetail:
    """``Explorer.prototype``: prototype ``i``'s card, histogram, bands, ``similar`` nearest prototypes and
    its fires in ``text``."""
    s.limits.check_top(neighbours, "neighbours")
    s.limits.check_top(similar, "similar")
    if text is not None:
        s.limits.check_text(text)
    model, tok = s.model, s.run.tokenizer
    with s.lock, torch.no_grad():
        labels = s.index.labels() if s.index is not None else {}  # the card takes labels.json's own entries
        card = prototype_card(
            model, tok, i, index=s.index, labels=labels, neighbours=neighbours, signature_tokens=12
        ).to_dict()
        hist = logit_histogram(model, i, min(tok.vocab_size, model.config.vocab_size))
        bands = example_bands(s.index, i) if s.index is not None and s.index.shards is not None else None
        P = F.normalize(model.require_prototypes().weight.detach().float(), dim=-1)  # (K, d)
        cos = P @ P[i]  # (K,)
        cos[i] = -float("inf")
        k = min(similar, s.num_prototypes - 1)
        vals, idx = cos.topk(k) if k > 0 else (cos[:0], cos[:0].long())
        text_tokens, fires = fires_in(s, i, text) if text is not None else (None, None)
    labs = s.labelled(idx.tolist())
    sim: list[SimilarPrototype] = [
        {"id": j, "cosine": v, "label": labs[j][0], "category": labs[j][1]} for j, v in zip(idx.tolist(), vals.tolist())
    ]
    return PrototypeDetail(
        card=card,
        similar=sim,
        fires=fires,
        text_tokens=text_tokens,
        has_index=s.index is not None,
        logit_histogram=hist,
        bands=bands,
    )


def fires_in(s: Session, i: int, text: str) -> tuple[list[str], list[Fire]]:
    """(tokens of ``text``, the positions where prototype ``i`` is active with its slice of the next token).
    Call under ``s.lock``."""
    tok = s.run.tokenizer
    ids = (tok.encode(text) if text else [tok.eot_id])[-s.model.config.block_size :]
    with s.run.intervened() as m:
        out = m(torch.tensor([ids], dtype=torch.long, device=s.run.device))
    assert out.indices is not None and out.activations is not None
    hit = (out.indices[0] == i) & (out.activations[0] > 0)  # (n, k)
    a = (out.activations[0] * hit).sum(-1)  # (n,)
    nxt = torch.tensor(ids[1:] + [int(out.logits[0, -1].argmax())], device=s.run.device)  # (n,)
    dec = decompose(m, out, nxt[None])
    sl = (dec.prototype_slices[0] * hit).sum(-1)  # (n,)
    pos = hit.any(-1).nonzero().squeeze(1).tolist()
    text_tokens = [tok.id_to_token(t) for t in ids]
    fires: list[Fire] = [
        {
            "position": p,
            "token_index": p + 1,
            "token": text_tokens[p],
            "next_token": tok.id_to_token(int(nxt[p])),
            "activation": float(a[p]),
            "slice": float(sl[p]),
        }
        for p in pos
    ]
    return text_tokens, fires
