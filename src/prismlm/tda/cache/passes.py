"""The model passes of a cache build: the sampled curvature, the ``pca``/``pca-local`` fit and the postings
pass's block gradients of one batch (``posting_batch``), with the batches the fits already ran kept for
the postings pass (``BatchStore``).

Invariant: every pass runs the same fixed grid of batches (``influence.batch_grid``), so a kept batch's
block gradients equal, bit for bit, those the postings pass would compute.
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from prismlm.config import AttributionConfig
from prismlm.errors import ConfigError
from prismlm.model import eval_mode
from prismlm.progress import Progress, Reporter
from prismlm.tda.cache.projection import fit_ranges, pca_bases, per_prototype_moments
from prismlm.tda.gradients import BlockGradients, block_gradients, output_gradients
from prismlm.tda.influence import Curvature, CurvatureAccumulator, batch_grid, forward_batch

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM, PrismOutput

__all__ = ["BatchStore", "pca_projection", "posting_batch", "postings_gradients", "sampled_curvature"]


class BatchStore:
    """Block gradients of postings-pass batches that a curvature or projection fit already ran through the
    model, kept so that the postings pass reads them instead of running the batch again: the same batch of
    the grid, the same forward and the same ``postings_gradients`` rows (equal bit for bit). A batch
    [j0, j1) is wanted when it is one the postings pass over [start, stop) makes (``batch_grid``). Kept on
    disk under ``folder`` (one .npz per batch, deleted when read: memory stays bounded by one batch), or in
    memory when ``folder`` is None (a build without ``out``, which holds its postings in memory anyway)."""

    def __init__(self, folder: Path | None, start: int, stop: int, batch_size: int) -> None:
        self.folder, self.start, self.stop, self.batch_size = folder, start, stop, batch_size
        self.mem: dict[int, BlockGradients] = {}
        self.held: set[int] = set()
        self.crc: dict[int, int] = {}
        """crc32 of each kept batch's .npz as written: a file changed since is not read (the batch runs again)."""
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def wants(self, j0: int, j1: int) -> bool:
        grid_end = min(self.stop, (j0 // self.batch_size + 1) * self.batch_size)
        return self.start <= j0 < self.stop and j0 % self.batch_size == 0 and j1 == grid_end and j0 not in self.held

    def add(self, j0: int, bg: BlockGradients) -> None:
        self.held.add(j0)
        if self.folder is None:
            self.mem[j0] = BlockGradients(bg.seq.cpu(), bg.proto.cpu(), bg.grad.cpu())
            return
        buf = io.BytesIO()
        np.savez(buf, seq=bg.seq.cpu().numpy(), proto=bg.proto.cpu().numpy(), grad=bg.grad.cpu().numpy())
        self.crc[j0] = zlib.crc32(buf.getbuffer())
        (self.folder / f"{j0}.npz").write_bytes(buf.getbuffer())

    def pop(self, j0: int) -> BlockGradients | None:
        """The kept block gradients of the batch starting at ``j0`` (then forgotten), or None (none kept, or
        its file changed since it was written: the caller runs the batch again)."""
        if j0 not in self.held:
            return None
        self.held.discard(j0)
        if self.folder is None:
            return self.mem.pop(j0)
        f = self.folder / f"{j0}.npz"
        data = f.read_bytes() if f.is_file() else b""
        f.unlink(missing_ok=True)
        if zlib.crc32(data) != self.crc.pop(j0):
            return None
        with np.load(io.BytesIO(data)) as z:
            return BlockGradients(torch.from_numpy(z["seq"]), torch.from_numpy(z["proto"]), torch.from_numpy(z["grad"]))


def postings_gradients(
    net: PrismLM, out: PrismOutput, targets: torch.Tensor, seq_ids: torch.Tensor, mu: torch.Tensor | None = None
) -> BlockGradients:
    """``block_gradients(net, out, targets, seq_ids=seq_ids)`` without the per-sequence losses, which a cache
    does not store: the same operations on the same rows (equal bit for bit), less one cross-entropy over
    the batch's tokens × vocabulary (~8% of the postings pass). ``mu``: the batch's Wᵀπ_t when the curvature
    pass already has it (``CurvatureAccumulator.update``)."""
    assert net.prototypes is not None and out.indices is not None and out.activations is not None
    B, K = out.indices.shape[0], net.prototypes.num_prototypes
    dt = torch.promote_types(out.logits.dtype, torch.float32)
    u = output_gradients(net, out.logits.detach().to(dt), targets, mu)  # (B, T, d)
    a = out.activations.detach().to(dt)  # (B, T, k)
    on = a > 0
    keys = (torch.arange(B, device=a.device)[:, None, None] * K + out.indices)[on]
    vals = (a[:, :, :, None] * u[:, :, None, :])[on]
    uniq, inv = torch.unique(keys, return_inverse=True)
    G = torch.zeros(uniq.shape[0], u.shape[-1], dtype=dt, device=a.device).index_add_(0, inv, vals)
    return BlockGradients(seq=seq_ids.to(a.device)[uniq // K], proto=uniq % K, grad=G)


def sampled_curvature(
    net: PrismLM,
    shards: ShardSet,
    cfg: AttributionConfig,
    universe: int,
    *,
    progress: Progress = False,
    keep: BatchStore | None = None,
) -> Curvature:
    """The curvature a cache of sequences [0, universe) uses: statistics over ``cfg.curvature_sample``
    of them in batches spread over the range (``fit_ranges``; all of them when 0/None or when there are
    fewer), accumulated in ascending batch order — the same on every process that calls it. ``keep``: where
    the block gradients of the batches a postings pass will need are kept (``build_cache``)."""
    n = cfg.curvature_sample or universe
    ranges = fit_ranges(universe, min(n, universe), cfg.batch_size)
    T, dev = net.config.block_size, next(net.parameters()).device
    acc = CurvatureAccumulator(net, exact=cfg.curvature_mode == "exact")
    with eval_mode(net), Reporter(progress, "curvature", sum(b - a for a, b in ranges), unit="seq") as bar:
        for j0, j1 in (b for a0, a1 in ranges for b in batch_grid(a0, a1, cfg.batch_size)):
            out, y = forward_batch(net, shards, j0, j1, T, dev)
            mu = acc.update(out)  # (B·T, d) Wᵀπ_t in the shared mode: the postings' product, not made twice
            if keep is not None and keep.wants(j0, j1):
                keep.add(j0, postings_gradients(net, out, y, torch.arange(j0, j1, device=dev), mu))
            bar.update(j1 - j0)
    return acc.finish(damping=cfg.damping)


def pca_projection(
    net: PrismLM,
    shards: ShardSet,
    curvature: Curvature,
    r: int,
    n: int,
    batch_size: int,
    local: bool = False,
    universe: int | None = None,
    keep: BatchStore | None = None,
) -> np.ndarray:
    """Top-r eigenvectors (rows) of the second moment of whitened block gradients of ~n sequences spread
    over [0, universe) (``fit_ranges``; universe None: the first n): (r, d), or with ``local`` one basis
    per prototype, (K, r, d) (``pca_bases``). ``keep``: where the block gradients of the batches a
    postings pass will need are kept."""
    d = net.config.n_embd
    kind = "pca-local" if local else "pca"
    if r > d:
        raise ConfigError(
            f"projection {kind!r} needs r <= d = {d}, got r = {r} (AttributionConfig.r)", param="AttributionConfig.r"
        )
    assert net.prototypes is not None
    K = net.prototypes.num_prototypes
    T, dev = net.config.block_size, next(net.parameters()).device
    C = torch.zeros(K if local else 1, d, d, dtype=torch.float64)
    count = torch.zeros(K, dtype=torch.long)
    ranges = fit_ranges(universe, n, batch_size) if universe is not None else [(0, n)]
    for j0, j1 in (b for a0, a1 in ranges for b in batch_grid(a0, a1, batch_size)):
        fo, y = forward_batch(net, shards, j0, j1, T, dev)
        bg = block_gradients(net, fo, y)
        if keep is not None and keep.wants(j0, j1):  # equal to postings_gradients bit for bit
            keep.add(j0, BlockGradients(seq=bg.seq + j0, proto=bg.proto, grad=bg.grad))
        proto = bg.proto.cpu()
        w = curvature.apply(proto, bg.grad.double().cpu(), -0.5)  # (rows, d)
        if not local:
            C[0] += w.T @ w
            continue
        C_add, present = per_prototype_moments(w, proto)
        C.index_add_(0, present, C_add)
        count += torch.bincount(proto, minlength=K)
    if not local:
        return pca_bases(C[0].numpy(), r)
    return pca_bases(C.numpy(), r, count.numpy())


def posting_batch(net: PrismLM, shards: ShardSet, j0: int, j1: int, kept: BatchStore) -> BlockGradients:
    """The postings pass's block gradients of batch [j0, j1): those a fit pass kept, else one forward."""
    bg = kept.pop(j0)
    if bg is not None:
        return bg
    T, dev = net.config.block_size, next(net.parameters()).device
    fo, y = forward_batch(net, shards, j0, j1, T, dev)
    return postings_gradients(net, fo, y, torch.arange(j0, j1, device=dev))
