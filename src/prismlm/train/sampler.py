"""Deterministic data order: which training sequences each process reads at each step.

"Training sequence j" is the aligned window ``TokenShard.sequence(j, T)``, the same to the trainer and to
attribution. Each epoch is a seeded permutation; the order is a pure function of (seed, step), so resuming
needs only the step. Invariant: a process with ``grad_accum = world`` sees, micro-batch by micro-batch, what
each rank of a ``world``-process run sees (chunk c = micro · world + rank). See docs/modules.md.
"""

from __future__ import annotations

import numpy as np

from prismlm.errors import DataError


class SequenceSampler:
    def __init__(self, num_sequences: int, batch_size: int, grad_accum: int, world_size: int, seed: int):
        if num_sequences < 1:
            raise DataError("the training split has no full sequence; use a smaller block_size or more data")
        self.n = num_sequences
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.seed = seed
        self.global_batch = batch_size * grad_accum * world_size
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perm_cache[epoch]

    def global_indices(self, step: int) -> np.ndarray:
        """(G,) int64 sequence ids of the whole global batch at ``step``."""
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.n)
        out = np.empty_like(pos)
        for e in np.unique(epochs):  # at most a few epochs per batch
            mask = epochs == e
            out[mask] = self._perm(int(e))[offsets[mask]]
        return out

    def micro_indices(self, step: int, micro: int, rank: int) -> np.ndarray:
        """(B,) sequence ids of micro-batch ``micro`` on process ``rank`` at ``step``."""
        chunk = micro * self.world_size + rank
        return self.global_indices(step)[chunk * self.batch_size : (chunk + 1) * self.batch_size]

    def epoch_at(self, step: int) -> float:
        return step * self.global_batch / self.n
