"""A uniform random sample of each prototype's firings, kept by the index pass (``prismlm.explain.index``).

Beside its top-N neighbourhoods the index keeps, per prototype, S of the positions where it is active (a > 0)
drawn uniformly without replacement: every (offset, prototype) pair gets a 64-bit key ``sample_key(offset, i)``
and each prototype keeps the S pairs with the largest keys, as (K, S) tables ``key``, ``offset``, ``act``.
Invariant: a key depends on (offset, prototype) alone, so the sample is deterministic and the top S of a union
is the top S of the parts' top S (index parts merge, resumed builds continue to the sample of one pass).
Why, how and the stored tables: docs/modules.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from prismlm.errors import ArtifactError

if TYPE_CHECKING:
    from prismlm.model import PrismOutput

__all__ = ["EMPTY_KEY", "TENSOR_NAMES", "ActivationSample", "sample_key", "top_s"]

EMPTY_KEY = torch.iinfo(torch.int64).min
TENSOR_NAMES = ("sample_key", "sample_offset", "sample_act")


def _signed(c: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic: mask the sign copies off)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (additions and products wrap mod 2^64, as uint64)."""
    z = x + _GAMMA
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def sample_key(offsets: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(n,) int64 keys of the (offset, prototype id) pairs: splitmix64(splitmix64(offset) ^ id)."""
    return _splitmix64(_splitmix64(offsets.long()) ^ ids.long())


def top_s(
    proto: torch.Tensor, key: torch.Tensor, off: torch.Tensor, act: torch.Tensor, K: int, S: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat candidates (n,) each, prototype ids in [0, K) → (K, S) tables of the S largest keys per prototype,
    by key descending.

    Two stable sorts give the order (prototype, key desc); a candidate's rank in its prototype's group is
    its position minus the group's start (cumsum of the group counts); rank < S is kept. A prototype's keys
    are distinct (``sample_key`` is a bijection of the offset for a fixed id), so the order is total.
    """
    dev = key.device
    order = torch.argsort(key, descending=True, stable=True)
    order = order[torch.argsort(proto[order], stable=True)]
    p = proto[order]  # (n,) ascending
    counts = torch.bincount(p, minlength=K)  # (K,)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(p.numel(), device=dev) - starts[p]  # (n,) 0-based within each prototype
    keep = rank < S
    sel, p, rank = order[keep], p[keep], rank[keep]
    t_key = torch.full((K, S), EMPTY_KEY, dtype=torch.long, device=dev)
    t_off = torch.full((K, S), -1, dtype=torch.long, device=dev)
    t_act = torch.zeros((K, S), dtype=torch.float32, device=dev)
    t_key[p, rank], t_off[p, rank], t_act[p, rank] = key[sel], off[sel], act[sel].float()
    return t_key, t_off, t_act


def _merge_rows(
    a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], S: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sets of (R, S) (key, offset, act) tables → per row the S largest keys of both, descending (the
    (R, 2S) candidates' ``topk``; keys within a row are distinct, empty slots all alike)."""
    key, off, act = (torch.cat([x, y], dim=1) for x, y in zip(a, b))  # (R, 2S) each
    t_key, j = key.topk(S, dim=1)  # sorted descending
    return t_key, off.gather(1, j), act.gather(1, j)


@dataclass
class ActivationSample:
    """Per prototype, a uniform sample of S of its firings (module docstring): three (K, S) tables."""

    key: torch.Tensor
    """(K, S) int64, descending per row; ``EMPTY_KEY`` marks empty slots (they come last)."""
    offset: torch.Tensor
    """(K, S) int64 global offset j·T + t of the context's last token (where the prototype fired); -1 empty."""
    act: torch.Tensor
    """(K, S) float32 activation a > 0 there; 0 empty."""

    @classmethod
    def empty(cls, K: int, S: int, device: torch.device | str = "cpu") -> ActivationSample:
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(*top_s(none, none, none, none, K, S))

    @property
    def size(self) -> int:
        """S, the most firings kept per prototype."""
        return int(self.key.shape[1])

    def to(self, device: torch.device | str) -> ActivationSample:
        return ActivationSample(self.key.to(device), self.offset.to(device), self.act.to(device))

    def _flat(self) -> tuple[torch.Tensor, ...]:
        """(proto, key, offset, act) of the filled slots, flat (n,) each."""
        K, S = self.key.shape
        filled = self.offset >= 0  # (K, S)
        proto = torch.arange(K, device=self.key.device)[:, None].expand(K, S)
        return proto[filled], self.key[filled], self.offset[filled], self.act[filled]

    @torch.no_grad()
    def add(self, out: PrismOutput, offsets: torch.Tensor) -> None:
        """Add the firings of one model output over B aligned sequences; ``offsets`` (B·T,) = j·T + t of
        each position, in ``out``'s (B, T) order.

        A chunk's pairs are ranked by ``top_s`` among themselves (their top S per prototype), then merged row
        by row with the running table. Pairs below their prototype's S-th key (a full row) cannot enter and
        are dropped first (late in a pass, most are); only rows with pairs left are touched, as (R, S) tables.
        """
        if out.indices is None or out.activations is None:
            return
        k = out.indices.shape[-1]
        a = out.activations.detach().reshape(-1, k)  # (B·T, k)
        on = a > 0  # the index's "active" (prismlm.eval.metrics.active_prototypes)
        ids = out.indices.reshape(-1, k)[on]  # (n_active,)
        offs = offsets.to(ids.device)[:, None].expand(-1, k)[on]  # (n_active,): each slot's position
        keys, acts = sample_key(offs, ids), a[on].float()
        can = keys > self.key[ids, -1]  # the S-th key: EMPTY_KEY while the row is not full
        ids, offs, keys, acts = ids[can], offs[can], keys[can], acts[can]
        if ids.numel() == 0:
            return
        K = self.key.shape[0]
        touched = torch.zeros(K, dtype=torch.bool, device=ids.device)
        touched[ids] = True
        rows = touched.nonzero().squeeze(1)  # (R,)
        compact = torch.full((K,), -1, dtype=torch.long, device=ids.device)
        compact[rows] = torch.arange(rows.numel(), device=ids.device)
        new = top_s(compact[ids], keys, offs, acts, rows.numel(), self.size)  # (R, S) each
        old = (self.key[rows], self.offset[rows], self.act[rows])
        self.key[rows], self.offset[rows], self.act[rows] = _merge_rows(old, new, self.size)

    @classmethod
    def merged(cls, samples: Sequence[ActivationSample]) -> ActivationSample:
        """The sample of the union of disjoint parts: the top S of their top S (S = the smallest size)."""
        K, S = samples[0].key.shape[0], min(s.size for s in samples)
        flat = [s._flat() for s in samples]
        proto, key, off, act = (torch.cat([f[j] for f in flat]) for j in range(4))
        return cls(*top_s(proto, key, off, act, K, S))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tables under their ``index.safetensors`` names."""
        return dict(zip(TENSOR_NAMES, (self.key.contiguous(), self.offset.contiguous(), self.act.contiguous())))

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], K: int, S: int, where: str) -> ActivationSample | None:
        """The sample stored in ``t`` (None when the index predates it); ``ArtifactError`` naming ``where``
        when tables are missing or not (K, S)."""
        present = [n for n in TENSOR_NAMES if n in t]
        if not present:
            return None
        shapes = {n: tuple(t[n].shape) for n in present}
        if len(present) < len(TENSOR_NAMES) or any(s != (K, S) for s in shapes.values()):
            raise ArtifactError(
                f"{where}: activation sample tables {shapes} are not three ({K}, {S}) tables; rebuild it with `prism index`"
            )
        return cls(t["sample_key"], t["sample_offset"], t["sample_act"])

    def row(self, i: int) -> tuple[list[int], list[float]]:
        """Prototype ``i``'s sampled firings (offsets, activations), in key order (a random order)."""
        filled = self.offset[i] >= 0
        return self.offset[i][filled].tolist(), self.act[i][filled].tolist()
