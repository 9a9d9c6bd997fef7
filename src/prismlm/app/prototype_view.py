"""What the explorer's Prototype and Steer views add to a prototype's card (``prismlm.explain.prototype_card``).

``logit_histogram`` (the direct effect W p_i of a prototype on every token), ``example_bands`` (training
contexts from the top, middle and bottom of its stored neighbourhood) and ``never_active`` (steered
prototypes that never fire on a text). Everything comes from data the model and the index already have;
bands span the index's top N contexts only. See docs/modules.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prismlm.explain import PrototypeIndex
from prismlm.model import PrismLM

__all__ = ["example_bands", "logit_histogram", "never_active"]

BANDS = ("top", "middle", "bottom")


@torch.no_grad()
def logit_histogram(model: PrismLM, i: int, valid_vocab: int, bins: int = 40) -> dict[str, Any]:
    """Histogram of (W p_i)_v over the ``valid_vocab`` real tokens: ``bins`` equal bins on [lo, hi],
    ``counts`` summing to ``valid_vocab``; with the mean and standard deviation."""
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


def example_bands(index: PrototypeIndex, i: int, per_band: int = 3) -> list[dict[str, Any]]:
    """Up to ``per_band`` contexts from each third (by rank) of prototype ``i``'s stored nearest contexts:
    the first of the top third, the middle ones of the middle third, the last of the bottom third.
    Each band: {band, ranks: [first, last] (1-based, of ``stored``), stored, similarity: [max, min],
    examples: [neighbour dicts]}. Empty without stored contexts."""
    nbs = index.neighbours(i)  # all N stored, by decreasing cos (ties by offset)
    n = len(nbs)
    if n == 0:
        return []
    bands = []
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
