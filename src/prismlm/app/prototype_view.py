"""What the explorer's Prototype view adds to a prototype's card (``prismlm.explain.prototype_card``), from
data the model and the index already have — what Neuronpedia and sae_vis show for a feature: the histogram
of its direct effect on every token (``logit_histogram``) and training contexts across its stored
neighbourhood (``example_bands``). For Steer, ``never_active``: the steered prototypes that never fire on a
text — steering them cannot change it, worth saying when the generations come out identical.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import torch

from prismlm.explain import PrototypeIndex
from prismlm.model import PrismLM

__all__ = ["Band", "LogitHistogram", "example_bands", "logit_histogram", "never_active"]

BANDS = ("top", "middle", "bottom")


class LogitHistogram(TypedDict):
    """A histogram of a signature W p_i over the real vocabulary."""

    lo: float
    hi: float
    counts: list[int]
    """Tokens per bin (``bins`` equal bins on [lo, hi]); they sum to ``tokens``."""
    mean: float
    std: float
    tokens: int


class Band(TypedDict):
    """Examples from one third (by rank) of a prototype's stored nearest contexts."""

    band: str
    """``top``, ``middle`` or ``bottom``."""
    ranks: list[int]
    """[first, last], 1-based ranks among ``stored``."""
    stored: int
    similarity: list[float]
    """[max, min] cos(z_t, p_i) of the band."""
    examples: list[dict[str, object]]
    """Neighbour dicts (``prismlm.explain.Neighbour.to_dict``)."""


@torch.no_grad()
def logit_histogram(model: PrismLM, i: int, valid_vocab: int, bins: int = 40) -> LogitHistogram:
    """Histogram of (W p_i)_v over the ``valid_vocab`` real tokens: ``bins`` equal bins on [lo, hi],
    ``counts`` summing to ``valid_vocab``; with the mean and standard deviation. One unit of activation
    adds (W p_i)_v to token v's logit; the tails are the card's ``top_tokens`` (pushed up) and
    ``bottom_tokens`` (pushed down)."""
    sig = model.signatures(torch.tensor([i], device=model.lm_head.weight.device))[0, :valid_vocab].double().cpu()
    lo, hi = float(sig.min()), float(sig.max())
    counts = torch.histc(sig, bins=bins, min=lo, max=hi if hi > lo else lo + 1.0)  # (bins,)
    return {
        "lo": lo,
        "hi": hi if hi > lo else lo + 1.0,
        "counts": [int(c) for c in counts.tolist()],
        "mean": float(sig.mean()),
        "std": float(sig.std()) if sig.numel() > 1 else 0.0,
        "tokens": valid_vocab,
    }


def example_bands(index: PrototypeIndex, i: int, per_band: int = 3) -> list[Band]:
    """Up to ``per_band`` contexts from each third (by rank) of prototype ``i``'s stored nearest contexts:
    the first of the top third, the middle ones of the middle third, the last of the bottom third. Empty
    without stored contexts. The index keeps each prototype's N nearest training contexts by cos(z_t, p_i)
    (the activation where it is active), so the bands span the top N only, not every activation (the
    card's activation histogram covers all indexed tokens)."""
    nbs = index.neighbours(i)  # all N stored, by decreasing cos (ties by offset)
    n = len(nbs)
    if n == 0:
        return []
    bands: list[Band] = []
    for name, part in zip(BANDS, np.array_split(np.arange(n), min(3, n))):
        m = len(part)
        start = {"top": 0, "middle": max(0, (m - per_band) // 2), "bottom": max(0, m - per_band)}[name]
        pick = part[start : start + per_band].tolist()
        bands.append(
            {
                "band": name,
                "ranks": [int(part[0]) + 1, int(part[-1]) + 1],
                "stored": n,
                "similarity": [nbs[int(part[0])].similarity, nbs[int(part[-1])].similarity],
                "examples": [nbs[j].to_dict() for j in pick],
            }
        )
    return bands


def never_active(
    mult: torch.Tensor,
    indices: torch.Tensor,
    activations: torch.Tensor,
) -> tuple[int, list[int], str | None]:
    """(steered count, ids, note) of the prototypes with multiplier ≠ 1 (``mult``: (K,)) that are active
    (a > 0) at no position of a forward's (n, k) ``indices``/``activations``. Activations do not depend on
    the multipliers, so steering these changes none of the text's logits."""
    active = torch.zeros(mult.shape[0], dtype=torch.bool)
    active[indices[activations > 0].cpu()] = True
    steered = mult.cpu() != 1
    ids = (steered & ~active).nonzero().squeeze(1).tolist()
    n = int(steered.sum())
    if not ids:
        return n, ids, None
    shown = ", ".join(f"#{i}" for i in ids[:20]) + (" …" if len(ids) > 20 else "")
    return (
        n,
        ids,
        (
            f"{len(ids)} of the {n} steered prototypes never fire on this text (prompt + generation), so "
            f"steering them changes none of its logits: {shown}"
        ),
    )
