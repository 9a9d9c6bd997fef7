"""Training-context snippets of a prototype index: ``Neighbour`` and the decoding of its text.

A neighbour is a global token offset j·T + t of ``shards.train`` (the context's last token); its target
is the token after it. ``decode_snippets`` locates, gathers and decodes many of them at once, each
clipped to the target's document. See docs/architecture.md (prototype index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from prismlm.data.tokenizer import Tokenizer as _Tokenizer

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.tokenizer import Tokenizer

__all__ = ["Neighbour", "NeighbourDict", "decode_many", "decode_snippets"]


class NeighbourDict(TypedDict):
    """``Neighbour.to_dict()``: its fields and its snippet, in this order."""

    offset: int
    similarity: float
    doc_index: int | None
    doc_id: str | None
    position: int | None
    target_id: int | None
    target: str | None
    before: str
    after: str
    snippet: str


@dataclass(frozen=True)
class Neighbour:
    """One training context of a prototype's neighbourhood (immutable: a loaded index hands the same
    decoded neighbours to every caller, see ``PrototypeIndex.neighbours``)."""

    offset: int
    """Global token offset j·T + t of the context's last token in the training shard."""
    similarity: float
    """cos(z_t, p_i)."""
    doc_index: int | None = None
    """Index of the target token's document in the shard."""
    doc_id: str | None = None
    """That document's id."""
    position: int | None = None
    """Position of the target token (x_{t+1}) in its document."""
    target_id: int | None = None
    """The next token x_{t+1} the context predicted in training."""
    target: str | None = None
    """Its text."""
    before: str = ""
    """Decoded context before the target (within the target's document)."""
    after: str = ""
    """Decoded text after the target."""

    @property
    def snippet(self) -> str:
        """Plain-text snippet with the target token marked: ``…context⟦target⟧after…``."""
        return f"{self.before}⟦{self.target}⟧{self.after}"

    def to_dict(self) -> NeighbourDict:
        return {
            "offset": self.offset,
            "similarity": self.similarity,
            "doc_index": self.doc_index,
            "doc_id": self.doc_id,
            "position": self.position,
            "target_id": self.target_id,
            "target": self.target,
            "before": self.before,
            "after": self.after,
            "snippet": self.snippet,
        }


def decode_snippets(
    offsets: list[int], sims: list[float], shards: ShardSet, tokenizer: Tokenizer, before: int, after: int
) -> list[Neighbour]:
    """The neighbours at context offsets ``offsets`` of ``shards.train`` with their snippets: ``before``
    tokens up to the target, the target, ``after`` tokens after it, clipped to the target's document.
    Located, gathered and decoded for all offsets together."""
    if not offsets:
        return []
    shard = shards.train
    target = np.asarray(offsets, dtype=np.int64) + 1  # the target token follows the context's last token
    bad = target[(target < 0) | (target >= len(shard))]
    if bad.size:
        raise IndexError(f"token offset {int(bad[0])} out of range [0, {len(shard)})")
    docs = np.searchsorted(shard.doc_offsets, target, side="right") - 1  # shard.locate, for all at once
    start, end = shard.doc_offsets[docs], shard.doc_offsets[docs + 1]  # end includes the eot
    a, b = np.maximum(start, target - before), np.minimum(end, target + 1 + after)  # window [a, b) ∋ target
    lens = b - a
    first = np.cumsum(lens) - lens  # where each window starts in the gathered tokens
    gathered = np.asarray(
        shard.tokens[np.arange(int(lens.sum())) - np.repeat(first - a, lens)], dtype=np.int64
    ).tolist()  # one gather of every window
    pieces: list[list[int]] = []
    for f, n, k in zip(first.tolist(), lens.tolist(), (target - a).tolist()):
        toks = gathered[f : f + n]
        pieces += [toks[:k], toks[k : k + 1], toks[k + 1 :]]  # before, target, after
    texts = decode_many(tokenizer, pieces)
    doc_ids = shard.doc_ids
    out = []
    for j, (o, s, d, t, st) in enumerate(zip(offsets, sims, docs.tolist(), target.tolist(), start.tolist())):
        out.append(
            Neighbour(
                offset=int(o),
                similarity=float(s),
                doc_index=d,
                doc_id=doc_ids[d] if d < len(doc_ids) else None,
                position=t - st,
                target_id=pieces[3 * j + 1][0],
                target=texts[3 * j + 1],
                before=texts[3 * j],
                after=texts[3 * j + 2],
            )
        )
    return out


def decode_many(tokenizer: Tokenizer, seqs: list[list[int]]) -> list[str]:
    """``[tokenizer.decode(s) for s in seqs]``, in one call of the backend when the tokenizer is prismlm's
    ``Tokenizer`` (its ``decode`` is the backend's, special tokens kept)."""
    if isinstance(tokenizer, _Tokenizer) and type(tokenizer).decode is _Tokenizer.decode:
        return list(tokenizer.backend.decode_batch(seqs, skip_special_tokens=False))
    return [tokenizer.decode(s) for s in seqs]
