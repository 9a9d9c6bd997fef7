"""What the explorer's Prototype view adds to a prototype's card (``prismlm.explain.prototype_card``), from
data the model and the index already have — what Neuronpedia and sae_vis show for a feature: the histogram
of its direct effect on every token (``logit_histogram``) and training contexts across its activation range
(``example_bands``: the index's uniform sample of its firings binned into equal-width activation intervals;
an index built before the sample existed falls back to rank thirds of its nearest contexts, ``rank_bands``,
with a note). For Steer, ``never_active``: the steered prototypes that never fire on a text — steering them
cannot change it, worth saying when the generations come out identical."""

from __future__ import annotations

from typing import Literal, TypedDict

import numpy as np
import torch

from prismlm.explain import PrototypeIndex
from prismlm.model import PrismLM

__all__ = [
    "ActivationBand",
    "Band",
    "LogitHistogram",
    "RankBand",
    "example_bands",
    "logit_histogram",
    "never_active",
    "rank_bands",
]

BANDS = ("top", "middle", "bottom")
RANK_NOTE = (
    "this index has no activation sample (built before it existed): these are thirds of its stored nearest "
    "contexts, not activation intervals; rebuild it with `prism index RUN --overwrite` for activation intervals"
)


class LogitHistogram(TypedDict):
    """A histogram of a signature W p_i over the real vocabulary."""

    lo: float
    hi: float
    counts: list[int]
    """Tokens per bin (``bins`` equal bins on [lo, hi]); they sum to ``tokens``."""
    mean: float
    std: float
    tokens: int


class ActivationBand(TypedDict):
    """Examples from one activation interval of a uniform sample of a prototype's firings."""

    kind: Literal["activation"]
    band: str
    """The interval as text, e.g. ``0.25 < a ≤ 0.5``."""
    interval: list[float]
    """[lo, hi], lo excluded."""
    count: int
    """Sampled firings in the interval."""
    sampled: int
    """The sample's size (≤ the index's ``sample_size``)."""
    fired: int
    """All indexed firings of the prototype."""
    examples: list[dict[str, object]]
    """Neighbour dicts (``prismlm.explain.Neighbour.to_dict``) with ``activation`` instead of ``similarity``."""


class RankBand(TypedDict):
    """Examples from one third (by rank) of a prototype's stored nearest contexts (indexes without a sample)."""

    kind: Literal["rank"]
    band: str
    """``top``, ``middle`` or ``bottom``."""
    ranks: list[int]
    """[first, last], 1-based ranks among ``stored``."""
    stored: int
    similarity: list[float]
    """[max, min] cos(z_t, p_i) of the band."""
    examples: list[dict[str, object]]
    """Neighbour dicts (``prismlm.explain.Neighbour.to_dict``)."""
    note: str


Band = ActivationBand | RankBand


@torch.no_grad()
def logit_histogram(model: PrismLM, i: int, valid_vocab: int, bins: int = 40) -> LogitHistogram:
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


def example_bands(
    index: PrototypeIndex, i: int, per_band: int = 3, intervals: int = 4, *, before: int = 12, after: int = 3
) -> list[Band]:
    """Examples of prototype ``i`` across its activation range (module docstring), highest interval first.
    Each band: {kind: "activation", band, interval: [lo, hi] (lo excluded), count (sampled firings in it),
    sampled (the sample's size), fired (all indexed firings), examples: [neighbour dicts + activation]}.
    Without a sample in the index: ``rank_bands`` (kind "rank", with a note). Empty when it never fired."""
    if index.sample is None:
        return rank_bands(index, i, per_band)
    fired = int(index.stats(i)["count"])  # (validates i)
    offs, acts = index.sample.row(i)  # key order: a uniformly random order
    if not offs:
        return []
    a = np.asarray(acts, dtype=np.float64)  # (n,) all > 0
    top = float(a.max())
    edges = [top * j / intervals for j in range(intervals + 1)]  # [0, …, top]: interval j is (edges[j], edges[j+1]]
    bin_of = np.searchsorted(np.asarray(edges[1:-1]), a, side="left")  # inner edges below a: a in (lo, hi]
    pick = {j: np.flatnonzero(bin_of == j)[:per_band].tolist() for j in range(intervals)}
    shown = [r for j in range(intervals) for r in pick[j]]
    ctx = dict(zip(shown, index.contexts([offs[r] for r in shown], before=before, after=after)))
    bands: list[Band] = []
    for j in reversed(range(intervals)):
        examples = [{**ctx[r].to_dict(), "activation": acts[r]} for r in pick[j]]
        for e in examples:
            e.pop("similarity")  # not stored for sampled firings
        bands.append(
            {
                "kind": "activation",
                "band": f"{edges[j]:.3g} < a ≤ {edges[j + 1]:.3g}",
                "interval": [edges[j], edges[j + 1]],
                "count": int((bin_of == j).sum()),
                "sampled": len(offs),
                "fired": fired,
                "examples": examples,
            }
        )
    return bands


def rank_bands(index: PrototypeIndex, i: int, per_band: int = 3) -> list[Band]:
    """Up to ``per_band`` contexts from each third (by rank) of prototype ``i``'s stored nearest contexts:
    the first of the top third, the middle ones of the middle third, the last of the bottom third — the
    fallback for an index without an activation sample. Each band: {kind: "rank", band, ranks: [first,
    last] (1-based, of ``stored``), stored, similarity: [max, min], examples: [neighbour dicts], note}.
    Empty without stored contexts."""
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
                "kind": "rank",
                "band": name,
                "ranks": [int(part[0]) + 1, int(part[-1]) + 1],
                "stored": n,
                "similarity": [nbs[int(part[0])].similarity, nbs[int(part[-1])].similarity],
                "examples": [nbs[j].to_dict() for j in pick],
                "note": RANK_NOTE,
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
