"""Deterministic data order: which training sequences each process reads at each step.

Training sequences are fixed, aligned windows ``j`` of the token shard (``TokenShard.sequence(j, T)``),
so "training sequence j" means the same thing to the trainer and to attribution. Each epoch is a
seeded permutation of all N sequences; step s consumes positions [s·G, (s+1)·G) of the concatenated
epochs (G = global batch). Because the order is a pure function of (seed, step), resuming needs only
the step, and a 2-process run reads exactly the sequences a 1-process run with the same global batch
reads.

Layout of one global batch: G = world · accum · B sequences, chunk c = micro · world + rank. A single
process with ``grad_accum = world`` therefore sees, micro-batch by micro-batch, what each rank of a
``world``-process run sees — the basis of the DDP-equivalence test.
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
