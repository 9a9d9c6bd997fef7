"""The sketch projection R of a cache (``make_projection``; ``pca_bases`` for the fitted ones), where the fits
read (``fit_ranges``) and the map from block gradients to stored sketches (``PostingSketcher``,
``project``). Math on tensors: no model pass (those are in ``passes``).

Invariant: a posting's sketch is ``R_i H_i^{-1/2} G_{j,i}`` and a query's is made by the same map, so
scores are exact when ``RᵀR = I``. Projection kinds: docs/architecture.md ("The attribution cache").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from prismlm.errors import ConfigError

if TYPE_CHECKING:
    from prismlm.tda.influence import Curvature

__all__ = ["PostingSketcher", "fit_ranges", "make_projection", "pca_bases", "per_prototype_moments", "project"]


def make_projection(
    d: int,
    r: int,
    kind: Literal["identity", "orthogonal", "gaussian", "pca", "pca-local"] = "orthogonal",
    seed: int = 0,
) -> np.ndarray:
    """The fixed r × d sketch matrix R (float64)."""
    if kind == "identity":
        if r != d:
            raise ConfigError(
                f"projection 'identity' needs r = d = {d}, got r = {r}; leave AttributionConfig.r unset or "
                f"choose another projection",
                param="AttributionConfig.r",
            )
        return np.eye(d)
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return (torch.randn(r, d, generator=g, dtype=torch.float64) / math.sqrt(r)).numpy()
    if kind == "orthogonal":
        if r > d:
            raise ConfigError(
                f"projection 'orthogonal' needs r <= d = {d}, got r = {r} (AttributionConfig.r)",
                param="AttributionConfig.r",
            )
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        return (q[:, :r].T * math.sqrt(d / r)).numpy()
    raise ConfigError(
        f"projection {kind!r} (AttributionConfig.projection) is fitted to the data, not made here; "
        f"make_projection knows identity, orthogonal and gaussian",
        param="AttributionConfig.projection",
    )


def fit_ranges(universe: int, n: int, batch_size: int) -> list[tuple[int, int]]:
    """The sequences a curvature or a ``pca``/``pca-local`` projection is fitted on: ~n of [0, universe) in
    batches of the ``batch_size`` grid spread evenly over the corpus (a corpus is often ordered by source, so
    its first n sequences are not a sample of it), as sorted disjoint [start, stop) ranges."""
    if n >= universe:
        return [(0, universe)]
    blocks = max(1, math.ceil(n / batch_size))
    last = (universe - 1) // batch_size  # the last batch of the grid [b·batch_size, (b+1)·batch_size)
    # whole batches of the grid every pass uses (``batch_grid``): one forward each, and the postings pass can
    # take a fitted batch's block gradients instead of running it again (``BatchStore``)
    starts = np.unique(np.linspace(0, last, blocks).round().astype(np.int64)) * batch_size
    out: list[tuple[int, int]] = []
    for a in starts.tolist():  # a few hundred blocks at most: the fit's plan, not a hot path
        b = min(universe, a + batch_size)
        if out and a <= out[-1][1]:  # adjacent batches: one range
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _rows_by_group(
    W: torch.Tensor, proto: torch.Tensor, max_fill: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Rows ``W`` (n, d) scattered by prototype ``proto`` (n,) into a zero-padded block X (U, m, d): row i at
    ``X[inv[i], pos[i]]`` (pos: its rank among its prototype's rows, in input order; m: the most rows of one
    prototype), for the U prototypes present, ``ids`` (U,). → (X, ids, inv, pos); None when ``max_fill`` is
    given and U·m > max_fill·n (a few prototypes hold most rows: the block would be mostly padding)."""
    ids, inv, counts = torch.unique(proto, return_inverse=True, return_counts=True)
    m = int(counts.max()) if len(ids) else 0
    if max_fill is not None and len(ids) * m > max_fill * W.shape[0]:
        return None
    order = torch.argsort(inv, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(len(inv)) - (torch.cumsum(counts, 0) - counts)[inv[order]]
    X = torch.zeros(len(ids), m, W.shape[1], dtype=W.dtype)
    X[inv, pos] = W
    return X, ids, inv, pos


def per_prototype_moments(w: torch.Tensor, proto: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w wᵀ over the rows of each prototype present: (U, d, d) and their prototype ids (U,), as one batched
    matmul of the zero-padded rows (``_rows_by_group``; m ≤ the batch's sequences, as rows are distinct
    (sequence, prototype) pairs): no (rows, d, d) outer products."""
    grouped = _rows_by_group(w, proto)
    assert grouped is not None  # no max_fill
    X, ids, _, _ = grouped
    return X.transpose(1, 2) @ X, ids


def pca_bases(C: np.ndarray, r: int, count: np.ndarray | None = None) -> np.ndarray:
    """The top-r eigenvectors (as rows) of a second moment ``C`` (d, d) → (r, d), or of each of K
    per-prototype moments (K, d, d) → (K, r, d). A prototype seen in fewer than r postings (``count``,
    (K,)) gets the basis of the summed moment instead: its own would be mostly arbitrary directions."""
    if C.ndim == 2:
        return np.ascontiguousarray(np.linalg.eigh(C)[1][:, ::-1][:, :r].T)
    V = np.linalg.eigh(C)[1]  # (K, d, d), ascending eigenvalues
    B = np.ascontiguousarray(np.swapaxes(V[:, :, ::-1][:, :, :r], 1, 2))  # (K, r, d)
    if count is not None:
        B[count < r] = pca_bases(C.sum(0), r)
    return B


def project(W: torch.Tensor, proto: torch.Tensor, R: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Sketches R_i w of rows ``W`` (n, d) of prototypes ``proto`` (n,): one projection R (r, d) for all,
    or per-prototype bases R (K, r, d) (``pca-local``: the rows grouped by prototype into one batched matmul
    with the bases present; when a few prototypes hold most rows, ``chunk`` rows at a time). → (n, r)."""
    if R.ndim == 2:
        return W @ R.T
    grouped = _rows_by_group(W, proto, max_fill=4)  # rows spread over prototypes (a cache batch: <= B rows each)
    if grouped is not None:
        X, ids, inv, pos = grouped  # (U, m, d): one batched matmul of each prototype's rows with its basis
        return (X @ R[ids].to(W.dtype).transpose(1, 2))[inv, pos]
    out = torch.empty(W.shape[0], R.shape[1], dtype=W.dtype)
    for a in range(0, W.shape[0], chunk):
        out[a : a + chunk] = torch.einsum("nd,nrd->nr", W[a : a + chunk], R[proto[a : a + chunk]].to(W.dtype))
    return out


class PostingSketcher:
    """Block gradients → cached sketches ``R_i H_i^{-1/2} G_{j,i}`` (n, r), the whitening and the projection
    folded into one map made once per cache.

    Shared curvature (H_i = Q diag(λ_i) Qᵀ, one eigenbasis Q): ``((G Q) ⊙ λ_i^{-1/2}) (R_i Q)ᵀ``, two products
    in ``dtype`` with ``R Q`` precomputed, instead of three in float64 (whiten into the eigenbasis, back,
    then project) — the postings pass's share of the cache build that is not the model's own work. Exact
    curvature (a basis per block): ``Curvature.apply`` then ``project``. ``dtype``: the sketches'
    precision (the model's, float32 at least; float64 when they are stored so)."""

    def __init__(self, curvature: Curvature, R: torch.Tensor, dtype: torch.dtype) -> None:
        self.curvature, self.R, self.dtype = curvature, R, dtype
        self.scale: torch.Tensor | None = None
        if curvature.blocks is None:
            K = int(curvature.m.shape[0])
            lam, _ = curvature.eigen(torch.arange(K))  # (K, d)
            Q = curvature.evecs  # (d, d) float64
            self.scale = lam.pow(-0.5).to(dtype)  # (K, d): λ_i^{-1/2} in the eigenbasis
            self.Q = Q.to(dtype)
            self.RQ = (R.to(torch.float64) @ Q).to(dtype)  # (r, d), or (K, r, d) per-prototype bases

    def __call__(self, proto: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """``proto`` (n,) prototype of each row, ``G`` (n, d) its block gradient → (n, r) in ``dtype``."""
        if self.scale is None:
            return project(self.curvature.apply(proto, G.double(), -0.5), proto, self.R).to(self.dtype)
        c = (G.to(self.dtype) @ self.Q) * self.scale[proto]  # (n, d): H_i^{-1/2} G in the eigenbasis
        return project(c, proto, self.RQ)
