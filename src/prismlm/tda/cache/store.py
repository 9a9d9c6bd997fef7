"""Cached statistics for fast prototype-space attribution (spec §3.2): an inverted index prototype → postings.

For every (training sequence j, active prototype i) the cache stores a posting ``(j, s_{j,i})`` with the
r-dimensional sketch ``s_{j,i} = R H_i^{-1/2} G_{j,i}`` (``R``: a fixed r × d projection, the same for all
prototypes). For a query, ``s_{q,i} = R H_i^{-1/2} G_{q,i}`` and

    score(q, j) = Σ_{i ∈ A_q} Σ_{postings (j, s) of i} s_{q,i} · s   ≈ Σ_i G_{q,i}ᵀ H_i⁻¹ G_{j,i} = I(q, j),

exact when ``RᵀR = I`` (``projection="identity"``, or ``"orthogonal"``/``"pca"``/``"pca-local"`` with r = d). For r < d:
``"orthogonal"`` (r random orthonormal rows scaled by √(d/r); E[RᵀR] = I), ``"gaussian"`` (a JL matrix
with N(0, 1/r) entries), ``"pca"`` (the top-r principal directions of the whitened block gradients
H_i^{-1/2} G_{j,i}, fitted on ``pca_sequences`` training sequences spread over the corpus: the data-dependent choice
the spec lists as a candidate), or ``"pca-local"`` (one such basis R_i per prototype, fitted on its own
postings: the tokens that activate a prototype are alike, so its whitened gradients span far fewer
directions than all of them do; K·r·d floats, and K·d² while fitting). Scores then read
``s_{q,i} · s_{j,i} = w_qᵀ R_iᵀR_i w_j``, exact at r = d. H_i^{-1/2} weights *low*-curvature directions most, so the sketch is taken after
whitening, never by keeping F's top eigenvectors.

**Building.** ``build_cache`` makes a curvature pass over ``curvature_sample`` sequences spread over the
corpus in whole batches (``sampled_curvature``; or takes a ``Curvature``) and then one streaming pass
over the training sequences, appending postings to temporary files; at the end they are grouped by
prototype (stable, so within a prototype postings ascend by sequence id) into CSR arrays. The batches the
curvature and projection fits already ran keep their block gradients for the postings pass
(``_BatchStore``), and each posting's whitening and projection is one folded map (``PostingSketcher``). A query is one
forward pass plus a vectorised scan of its prototypes' postings: ``Σ_{i∈A_q} |postings(i)| · r``
multiply-adds.

**Storage** (``AttributionConfig``: ``dtype``, ``prune``, ``aggregate``, ``id_encoding``). Postings are
grouped by prototype (CSR: ``offsets`` (K+1,) int64, the ids of prototype i are rows offsets[i]:offsets[i+1],
ascending). Ids are ``int32`` (4 bytes) or ``delta``: the gaps between consecutive ids of a list (the
first id of a list stored as itself) in uint8 or uint16 — whichever gives fewer bytes — with the gaps that
do not fit (≥ the type's maximum, which marks them) kept as exceptions (position int64, value uint32).
Decoding a list is a gather, a patch and a segmented cumulative sum: exact. Sketches are float16/32/64,
or ``int8``/``int4``/``int3``: symmetric codes q ∈ [−Q, Q] (Q = 127 / 7 / 3) with one float16 scale per
posting (relative to ``scale_unit`` in the manifest, rounded up so that |q·scale − s| ≤ scale/2 for every
entry); int4 packs two codes per byte (low nibble first, stored as q + 8), int3 eight codes per three
bytes (a little-endian bit stream of q + 4); or ``pq``: product quantisation (``PQSketches``: the posting's
norm as a float16 scale, its direction as r / ``pq_dims`` one-byte codes into 256-centroid codebooks, trained
on ``pq_sample`` of the cache's postings). ``prune`` drops postings
whose sketch norm is below ``prune`` × the largest norm of the same prototype's list. ``aggregate=
"document"`` sums the sketches of the sequences of a document (postings per (document, prototype);
scores are per document).

**Artifact.** A folder: ``offsets.npy`` (K+1 int64); ids ``seq.npy`` (P int32) or ``ids_gap.npy`` (P
uint8/uint16), ``ids_exc_pos.npy`` (E int64), ``ids_exc_val.npy`` (E uint32); sketches ``sketch.npy`` (P × r,
float16/32/64) or ``sketch_codes.npy`` (P × r int8, or P × ⌈r/2⌉ / ⌈3r/8⌉ uint8 for int4 / int3) and ``sketch_scale.npy``
(P float16), for ``pq`` also ``sketch_codebook.npy`` (M × 256 × pq_dims float32); ``units.npy`` (document of each sequence, int32; document aggregation only);
``projection.npy`` (r × d float64; ``pca-local``: K × r × d), ``curvature.safetensors, ``manifest.json`` (kind, format_version,
model_sha256, shard_key, r, projection, seed, storage options, covered sequences, tokens, postings, bytes
per training token, build seconds, sha256 of every file). Every file is verified on load (size and
sha256, sampled for large files) and the posting arrays are memory-mapped: a query reads only its
prototypes' slices. Format-1 caches (``seq.npy`` + ``sketch.npy``, no storage options) load unchanged;
a cache of a newer format is refused (``ArtifactError`` naming the manifest and ``prism
attribute-cache``). Loading the cache for another checkpoint or another corpus raises
``ArtifactMismatch`` (the prototype index's error), naming both.

**Compression after the fact.** ``compress_cache`` re-encodes a lossless cache (float32/64 sketches,
sequence postings, no pruning) with other storage options, without another pass over the data: how
``bench/attribution.py --compression`` compares formats.

**Parts.** ``build_cache(..., part=(i, n))`` caches one batch-aligned slice of the sequences (give every
part the same ``curvature``); ``merge_caches`` concatenates parts into one cache equal to a single pass.
Only lossless sequence-level parts merge (pruning and quantisation scales depend on the whole corpus, and
a document may straddle two parts): merge them, then ``compress_cache`` (what ``prism attribute-cache``
does under torchrun). A merge to a folder gathers the parts' sketches in chunks into a memory-mapped file.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import time
import typing
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from prismlm.artifacts import (
    atomic_dir,
    check_provenance,
    file_records,
    merge_ranges,
    model_identity,
    overlap,
    part_range,
    provenance,
    reading,
    verify_files,
    writes_folder,
)
from prismlm.config import AttributionConfig
from prismlm.errors import ArtifactCorrupt, ArtifactError, ArtifactMismatch, ConfigError, ModelError
from prismlm.model import eval_mode
from prismlm.progress import Progress, Reporter
from prismlm.tda.build_state import PostingFiles, Resumed, record_fitted, resume_build
from prismlm.tda.gradients import BlockGradients, block_gradients, output_gradients
from prismlm.tda.influence import Curvature, CurvatureAccumulator, _batches, _forward

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM
    from prismlm.tda.search import SearchIndex

__all__ = ["AttributionCache", "DeltaIds", "FloatSketches", "PQSketches", "PlainIds", "QuantSketches", "build_cache", "compress_cache",
           "dequantise", "document_of_sequences", "fit_ranges", "make_projection", "merge_caches", "pca_bases", "pq_encode",
           "pq_layout", "pq_train", "project",
           "quantise", "sampled_curvature"]

KIND = "prismlm-attribution-cache"
FORMAT_VERSION = 2
"""1: int32 ids + float sketches (no storage options in the manifest); 2: adds ``id_encoding``, quantised
sketches, pruning and document aggregation (a format-2 cache with the default options has format 1's files)."""
_DTYPES: dict[str, type[np.floating]] = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
_QMAX: dict[str, int] = {"int8": 127, "int4": 7, "int3": 3}
QuantDtype = Literal["int8", "int4", "int3"]
_INT3_SHIFTS = np.arange(0, 24, 3, dtype=np.uint32)  # bit offsets of the 8 codes in a 24-bit word
_SCALE_RANGE = 2.0 ** 15
"""The largest per-posting scale is stored as 2^15 × ``scale_unit`` (float16 holds up to 65504), so ratios
down to ~2e-9 of it stay normal float16 numbers."""
_CHUNK = 1 << 16
"""Postings per chunk of the encoding passes: bounds the memory of every gather to ~_CHUNK × r floats."""
_REBUILD = "prism attribute-cache RUN"
_QUERY_CHUNK = 1 << 17
"""Postings decoded and multiplied at a time by a query: bounds its memory to ~3 × _QUERY_CHUNK × r float64
(a query's active prototypes can hold half of all postings) without changing any sum's order."""


def concat_ranges(lo: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The rows lo[0] … lo[0]+n[0]−1, lo[1] … of several ranges, concatenated: (n.sum(),) int64, one arange."""
    lo, n = np.asarray(lo, dtype=np.int64), np.asarray(n, dtype=np.int64)
    starts = np.cumsum(n) - n
    return np.arange(int(n.sum()), dtype=np.int64) + np.repeat(lo - starts, n)


# ----- posting ids ----------------------------------------------------------------------------------------
class PlainIds:
    """Ids as int32 (the format-1 ``seq.npy``): 4 bytes per posting."""

    encoding = "int32"

    def __init__(self, seq: np.ndarray) -> None:
        self.seq = seq
        """(P,) int32, memory-mapped on load."""

    @classmethod
    def encode(cls, ids: np.ndarray, offsets: np.ndarray) -> PlainIds:
        if len(ids) and int(ids.max()) > np.iinfo(np.int32).max:
            raise ArtifactError(f"id {int(ids.max())} does not fit int32; use --id-encoding delta")
        return cls(np.asarray(ids, dtype=np.int32))

    def gather(self, lo: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Ids of the postings of ranges [lo, lo+n), concatenated: (n.sum(),) int64."""
        return np.asarray(self.seq[concat_ranges(lo, n)], dtype=np.int64)

    def decode(self, offsets: np.ndarray) -> np.ndarray:
        """All ids, (P,) — the stored array itself (no copy)."""
        return self.seq

    def arrays(self) -> dict[str, np.ndarray]:
        return {"seq.npy": self.seq}

    @property
    def nbytes(self) -> int:
        return int(self.seq.nbytes)

    def manifest(self) -> dict[str, Any]:
        return {"id_encoding": self.encoding}


class DeltaIds:
    """Ids as gaps within each prototype's ascending list, in uint8/uint16 with exceptions (patched
    frame of reference). Exact; a list decodes with a gather, a patch and a cumulative sum."""

    encoding = "delta"

    def __init__(self, gaps: np.ndarray, exc_pos: np.ndarray, exc_val: np.ndarray) -> None:
        self.gaps = gaps
        """(P,) uint8 or uint16: id − previous id of the same list (the first: the id itself); the type's
        maximum marks an exception."""
        self.exc_pos = exc_pos
        """(E,) int64, ascending: postings whose gap is in ``exc_val``."""
        self.exc_val = exc_val
        """(E,) uint32: their gaps."""

    @classmethod
    def encode(cls, ids: np.ndarray, offsets: np.ndarray) -> DeltaIds:
        """Encode ``ids`` (P,), ascending within each list ``offsets[i]:offsets[i+1]``; the gap type
        (uint8 or uint16) is the one giving fewer bytes (P·width + 12·exceptions)."""
        ids = np.asarray(ids, dtype=np.int64)
        gaps = np.diff(ids, prepend=np.int64(0))
        first = np.asarray(offsets[:-1])[np.diff(offsets) > 0]
        gaps[first] = ids[first]
        if len(gaps) and int(gaps.min()) < 0:
            raise ArtifactError("cannot delta-encode posting ids: a prototype's ids are not ascending")
        if len(ids) and int(ids.max()) > np.iinfo(np.uint32).max:
            raise ArtifactError(f"id {int(ids.max())} does not fit uint32")
        best: tuple[int, type[np.unsignedinteger]] | None = None
        for dt in (np.uint8, np.uint16):
            cost = len(gaps) * np.dtype(dt).itemsize + 12 * int(np.count_nonzero(gaps >= np.iinfo(dt).max))
            if best is None or cost < best[0]:
                best = (cost, dt)
        assert best is not None
        dt = best[1]
        esc = np.iinfo(dt).max
        exc = gaps >= esc
        return cls(np.where(exc, esc, gaps).astype(dt), np.flatnonzero(exc).astype(np.int64),
                   gaps[exc].astype(np.uint32))

    def gather(self, lo: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Ids of whole lists starting at ``lo`` (each lo must be a list start, as every query reads)
        with ``n`` postings, concatenated: (n.sum(),) int64. Vectorised over the ranges."""
        lo, n = np.asarray(lo, dtype=np.int64), np.asarray(n, dtype=np.int64)
        keep = n > 0
        lo, n = lo[keep], n[keep]
        starts = np.cumsum(n) - n  # where each range begins in the concatenation
        g = np.asarray(self.gaps[concat_ranges(lo, n)], dtype=np.int64)
        a = np.searchsorted(self.exc_pos, lo)
        m = np.searchsorted(self.exc_pos, lo + n) - a  # exceptions inside each range
        e = concat_ranges(a, m)
        g[np.asarray(self.exc_pos[e]) - np.repeat(lo - starts, m)] = self.exc_val[e]
        c = np.cumsum(g)
        return c - np.repeat(c[starts] - g[starts], n)  # segmented cumulative sum: each list from its first id

    def decode(self, offsets: np.ndarray) -> np.ndarray:
        """All ids, (P,) int64."""
        off = np.asarray(offsets)
        return self.gather(off[:-1], np.diff(off))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"ids_gap.npy": self.gaps, "ids_exc_pos.npy": self.exc_pos, "ids_exc_val.npy": self.exc_val}

    @property
    def nbytes(self) -> int:
        return int(self.gaps.nbytes + self.exc_pos.nbytes + self.exc_val.nbytes)

    def manifest(self) -> dict[str, Any]:
        return {"id_encoding": self.encoding, "id_width": int(self.gaps.dtype.itemsize),
                "id_exceptions": int(len(self.exc_pos))}


# ----- sketches -------------------------------------------------------------------------------------------
class FloatSketches:
    """Sketches as float16/32/64 rows."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        """(P, r) float16/32/64, memory-mapped on load."""

    @property
    def dtype(self) -> str:
        return str(self.data.dtype)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), r) float64."""
        return np.asarray(self.data[rows], dtype=np.float64)

    def dots(self, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Row-wise dot products of the sketches at ``rows`` (n,) with ``q`` (n, r) float64: (n,) float64 —
        what every score is built from (the exact scan and the search's rescoring share it)."""
        return (torch.from_numpy(self.gather(rows)) * torch.from_numpy(q)).sum(1).numpy()

    def decode(self) -> np.ndarray:
        """All sketches: the stored array itself."""
        return self.data

    def arrays(self) -> dict[str, np.ndarray]:
        return {"sketch.npy": self.data}

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def manifest(self) -> dict[str, Any]:
        return {"dtype": self.dtype}


def code_width(dtype: QuantDtype, r: int) -> int:
    """Bytes of one posting's codes: r (int8), ⌈r/2⌉ (int4), ⌈3r/8⌉ (int3)."""
    return r if dtype == "int8" else (r + 1) // 2 if dtype == "int4" else (3 * r + 7) // 8


def quantise(x: np.ndarray, dtype: QuantDtype, unit: float) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric codes of rows ``x`` (n, r) float64 with one float16 scale per row (in multiples of
    ``unit``): returns (codes (n, r) int8 — int4: packed (n, ⌈r/2⌉) uint8; int3: a little-endian bit
    stream of 3-bit codes q + 4, (n, ⌈3r/8⌉) uint8 —, scales (n,) float16).

    The scale is max|x|/Q rounded *up* to a float16 (so no code is clipped) and every decoded entry
    ``q · scale · unit`` is within ``scale · unit / 2`` of ``x``."""
    qmax = _QMAX[dtype]
    s = np.abs(x).max(1) / qmax if x.shape[1] else np.zeros(len(x))
    s16 = (s / unit).astype(np.float16)
    low = s16.astype(np.float64) * unit < s
    s16[low] = np.nextafter(s16[low], np.float16(np.inf))
    d = s16.astype(np.float64)[:, None] * unit
    q = np.clip(np.rint(np.divide(x, d, out=np.zeros_like(x), where=d > 0)), -qmax, qmax)
    if dtype == "int8":
        return q.astype(np.int8), s16
    n, r = q.shape
    if dtype == "int3":  # each code's 3 low bits, row by row, packed 8 to a byte (first code in the low bits)
        bits = np.unpackbits((q + 4).astype(np.uint8)[:, :, None], axis=2, bitorder="little")[:, :, :3]
        return np.packbits(bits.reshape(n, 3 * r), axis=1, bitorder="little"), s16
    u = np.full((n, r + (r & 1)), 8, dtype=np.uint8)
    u[:, :r] = (q + 8).astype(np.uint8)  # 1 … 15
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8), s16


def dequantise(codes: np.ndarray, scales: np.ndarray, unit: float, dtype: QuantDtype, r: int) -> np.ndarray:
    """Inverse of ``quantise``: (n, r) float64."""
    return code_values(codes, dtype, r) * (np.asarray(scales, dtype=np.float64) * unit)[:, None]


def code_values(codes: np.ndarray, dtype: QuantDtype, r: int) -> np.ndarray:
    """The integer codes q of stored rows (unpacked, unscaled): (n, r) float64."""
    if dtype == "int8":
        q = codes.astype(np.float64)
    elif dtype == "int3":  # every 3 bytes hold 8 codes: read them as one 24-bit word and shift
        b = np.asarray(codes, dtype=np.uint8)
        n, groups = b.shape[0], (r + 7) // 8
        padded = np.zeros((n, 3 * groups), dtype=np.uint32)
        padded[:, :b.shape[1]] = b
        word = padded[:, 0::3] | (padded[:, 1::3] << 8) | (padded[:, 2::3] << 16)  # (n, groups)
        q = ((word[:, :, None] >> _INT3_SHIFTS) & 7).reshape(n, 8 * groups)[:, :r].astype(np.float64) - 4
    else:
        b = np.asarray(codes, dtype=np.uint8)
        q = np.empty((b.shape[0], 2 * b.shape[1]), dtype=np.float64)
        q[:, 0::2] = (b & 15).astype(np.int16) - 8
        q[:, 1::2] = (b >> 4).astype(np.int16) - 8
        q = q[:, :r]
    return q


class QuantSketches:
    """Sketches as int8/int4/int3 codes with a float16 scale per posting (see ``quantise``)."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, unit: float, dtype: QuantDtype,
                 r: int) -> None:
        self.codes = codes
        """(P, r) int8; for int4 (P, ⌈r/2⌉) uint8 (two codes per byte, low nibble first); for int3
        (P, ⌈3r/8⌉) uint8 (a bit stream of 3-bit codes)."""
        self.scales = scales
        """(P,) float16, in multiples of ``unit``."""
        self.unit, self._dtype, self.r = float(unit), dtype, r

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def qdtype(self) -> QuantDtype:
        return self._dtype

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), r) float64, decoded."""
        return dequantise(np.asarray(self.codes[rows]), np.asarray(self.scales[rows]), self.unit, self._dtype, self.r)

    def dots(self, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Row-wise dot products of the decoded sketches at ``rows`` (n,) with ``q`` (n, r) float64: (n,)
        float64, as (Σ_c code_c · q_c) · scale · unit — the integer codes dotted first, the posting's scale
        applied once (no decoded (n, r) copy); equal to ``gather(rows)`` dotted with q up to rounding."""
        codes = code_values(np.asarray(self.codes[rows]), self._dtype, self.r)
        return np.einsum("nr,nr->n", codes, q) * (np.asarray(self.scales[rows], dtype=np.float64) * self.unit)

    def decode(self) -> np.ndarray:
        """All sketches, decoded: (P, r) float64 (materialised: for tests and small caches)."""
        return self.gather(np.arange(self.codes.shape[0]))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"sketch_codes.npy": self.codes, "sketch_scale.npy": self.scales}

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    def manifest(self) -> dict[str, Any]:
        return {"dtype": self._dtype, "scale_unit": self.unit}


PQ_CENTROIDS = 256
"""Centroids per sub-quantizer of ``dtype="pq"``: one uint8 code each."""


def pq_layout(r: int, pq_dims: int) -> int:
    """Sub-quantizers M of an r-dimensional ``pq`` sketch with ``pq_dims`` dimensions each (ConfigError
    unless pq_dims divides r)."""
    if pq_dims < 1 or r % pq_dims:
        raise ConfigError(f"dtype 'pq' splits the r = {r} sketch dimensions into sub-vectors of pq_dims = "
                          f"{pq_dims}; choose --pq-dims dividing {r} (or --r a multiple of {pq_dims})")
    return r // pq_dims


def _subvectors(x: np.ndarray, M: int) -> np.ndarray:
    """Rows ``x`` (n, r) as M interleaved sub-vectors (n, M, t), t = r / M: sub-vector m holds dimensions
    m, m + M, …, m + (t − 1)M. A pca/pca-local sketch's variance falls along its dimensions, so interleaving
    gives every codebook a share of the leading directions (contiguous blocks would spend the same 8 bits on
    the first four directions as on the last four: top-10 overlap 0.78 vs 0.80 at r = 40, 10 codes)."""
    n, r = x.shape
    return x.reshape(n, r // M, M).transpose(0, 2, 1)


def pq_train(z: np.ndarray, M: int, seed: int) -> np.ndarray:
    """Codebooks (M, 256, t) float32 for unit directions ``z`` (n, r): per sub-quantizer, its distinct
    sub-vectors when there are at most 256 (then every training row is represented exactly), else faiss
    k-means (25 iterations, seeded: the same codebooks for the same rows)."""
    sub = _subvectors(np.asarray(z, dtype=np.float32), M)  # (n, M, t)
    n, _, t = sub.shape
    cb = np.zeros((M, PQ_CENTROIDS, t), dtype=np.float32)
    for m in range(M):  # M ≤ r sub-quantizers, each one vectorised k-means
        uniq = np.unique(sub[:, m], axis=0)
        if len(uniq) <= PQ_CENTROIDS:
            cb[m, :len(uniq)], cb[m, len(uniq):] = uniq, uniq[0] if len(uniq) else 0.0
            continue
        try:
            import faiss
        except ImportError as e:
            raise ConfigError("dtype 'pq' trains its codebooks with faiss, which is not installed",
                              fix="pip install 'prismlm[search]'") from e
        km = faiss.Kmeans(t, PQ_CENTROIDS, niter=25, seed=seed + m, verbose=False)
        km.train(np.ascontiguousarray(sub[:, m]))
        cb[m] = km.centroids
    return cb


def pq_encode(z: np.ndarray, codebook: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """Codes (n, M) uint8 of unit directions ``z`` (n, r): per sub-quantizer the nearest centroid (squared
    distance; ties to the lowest index). ``chunk`` rows at a time bound the (chunk, M, 256) distances."""
    M = codebook.shape[0]
    cb = torch.from_numpy(codebook).double()  # (M, 256, t)
    c2 = (cb * cb).sum(-1)  # (M, 256)
    out = np.empty((z.shape[0], M), dtype=np.uint8)
    for a in range(0, z.shape[0], chunk):
        sub = torch.from_numpy(np.ascontiguousarray(_subvectors(np.asarray(z[a:a + chunk], np.float64), M)))
        dist = c2[None] - 2 * torch.einsum("nmt,mkt->nmk", sub, cb)  # ‖z‖² dropped: the same for every centroid
        out[a:a + chunk] = dist.argmin(-1).numpy().astype(np.uint8)
    return out


class PQSketches:
    """Sketches as product-quantised codes (``dtype="pq"``): a posting s is stored as its norm ‖s‖ (a
    float16 scale in multiples of ``unit``) and its direction s/‖s‖ split into M interleaved sub-vectors
    (``_subvectors``), each replaced by the index of the nearest of 256 centroids of its sub-quantizer's
    codebook (trained on the cache's own postings: ``pq_train``). Decoded: ‖s‖ · (centroids, re-interleaved).
    Per posting M bytes + 2: at r = 40 with 4 dimensions per code, 12 bytes where int4 takes 22."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, unit: float, codebook: np.ndarray) -> None:
        self.codes = codes
        """(P, M) uint8: the centroid of each sub-vector."""
        self.scales = scales
        """(P,) float16: each posting's norm, in multiples of ``unit``."""
        self.codebook = codebook
        """(M, 256, t) float32: the centroids of the M sub-quantizers (r = M·t)."""
        self.unit = float(unit)
        self.r = int(codebook.shape[0] * codebook.shape[2])

    @property
    def dtype(self) -> str:
        return "pq"

    def _centroids(self, rows: np.ndarray) -> np.ndarray:
        """(n, M, t) float64: the centroids the postings at ``rows`` are coded by."""
        codes = np.asarray(self.codes[rows])  # (n, M)
        return self.codebook[np.arange(self.codebook.shape[0])[None, :], codes].astype(np.float64)

    def _norms(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self.scales[rows], dtype=np.float64) * self.unit

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), r) float64, decoded (centroids back in dimension order, times the norm)."""
        C = self._centroids(rows)  # (n, M, t): C[:, m, j] is dimension m + jM
        return C.transpose(0, 2, 1).reshape(len(C), self.r) * self._norms(rows)[:, None]

    def dots(self, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Row-wise dot products of the decoded sketches at ``rows`` (n,) with ``q`` (n, r) float64: (n,)
        float64, the centroids dotted with q's matching dimensions and the norm applied once."""
        C = self._centroids(rows)  # (n, M, t)
        qv = np.asarray(q, dtype=np.float64).reshape(len(C), C.shape[2], C.shape[1])  # [n, j, m] = q[n, m + jM]
        return np.einsum("nmj,njm->n", C, qv) * self._norms(rows)

    def decode(self) -> np.ndarray:
        """All sketches, decoded: (P, r) float64 (materialised: for tests and small caches)."""
        return self.gather(np.arange(self.codes.shape[0]))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"sketch_codes.npy": self.codes, "sketch_scale.npy": self.scales, "sketch_codebook.npy": self.codebook}

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes + self.codebook.nbytes)

    def manifest(self) -> dict[str, Any]:
        return {"dtype": "pq", "scale_unit": self.unit, "pq_dims": int(self.codebook.shape[2])}


Ids = PlainIds | DeltaIds
Sketches = FloatSketches | QuantSketches | PQSketches


def _lossless(manifest: dict[str, Any]) -> bool:
    """Whether a cache keeps every sequence posting at float32/64 (can be merged and re-encoded)."""
    return (manifest.get("dtype") in ("float32", "float64") and not manifest.get("prune", 0)
            and manifest.get("aggregate", "sequence") == "sequence")


def document_of_sequences(shards: ShardSet, universe: int, T: int) -> np.ndarray:
    """(universe,) int64: the document of each training sequence j — the one holding its middle target
    token (offset j·T + 1 + (T−1)//2) — ascending in j."""
    offs = np.arange(universe, dtype=np.int64) * T + 1 + (T - 1) // 2
    return np.searchsorted(np.asarray(shards.train.doc_offsets), offs, side="right").astype(np.int64) - 1


def make_projection(d: int, r: int,
                    kind: Literal["identity", "orthogonal", "gaussian", "pca", "pca-local"] = "orthogonal",
                    seed: int = 0) -> np.ndarray:
    """The fixed r × d sketch matrix R (float64)."""
    if kind == "identity":
        if r != d:
            raise ConfigError(f"projection 'identity' needs r = d = {d}, got r = {r}; leave r unset (--r) or "
                              f"choose another projection")
        return np.eye(d)
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return (torch.randn(r, d, generator=g, dtype=torch.float64) / math.sqrt(r)).numpy()
    if kind == "orthogonal":
        if r > d:
            raise ConfigError(f"projection 'orthogonal' needs r <= d = {d}, got r = {r} (option --r)")
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        return (q[:, :r].T * math.sqrt(d / r)).numpy()
    raise ConfigError(f"projection {kind!r} (option --projection) is fitted to the data, not made here; "
                      f"make_projection knows identity, orthogonal and gaussian")


def fit_ranges(universe: int, n: int, batch_size: int) -> list[tuple[int, int]]:
    """The sequences a curvature or a ``pca``/``pca-local`` projection is fitted on: ~n of [0, universe) in
    batches of the ``batch_size`` grid spread evenly over the corpus (a corpus is often ordered by source, so
    its first n sequences are not a sample of it), as sorted disjoint [start, stop) ranges."""
    if n >= universe:
        return [(0, universe)]
    blocks = max(1, math.ceil(n / batch_size))
    last = (universe - 1) // batch_size  # the last batch of the grid [b·batch_size, (b+1)·batch_size)
    # whole batches of the grid every pass uses (``_batches``): one forward each, and the postings pass can
    # take a fitted batch's block gradients instead of running it again (``_BatchStore``)
    starts = np.unique(np.linspace(0, last, blocks).round().astype(np.int64)) * batch_size
    out: list[tuple[int, int]] = []
    for a in starts.tolist():  # a few hundred blocks at most: the fit's plan, not a hot path
        b = min(universe, a + batch_size)
        if out and a <= out[-1][1]:  # adjacent batches: one range
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _pca_projection(net: PrismLM, shards: ShardSet, curvature: Curvature, r: int, n: int, batch_size: int,
                    local: bool = False, universe: int | None = None, keep: _BatchStore | None = None) -> np.ndarray:
    """Top-r eigenvectors (rows) of the second moment of whitened block gradients of ~n sequences spread
    over [0, universe) (``fit_ranges``; universe None: the first n): (r, d), or with ``local`` one basis
    per prototype, (K, r, d) (``pca_bases``). ``keep``: where the block gradients of the batches a
    postings pass will need are kept."""
    d = net.config.n_embd
    kind = "pca-local" if local else "pca"
    if r > d:
        raise ConfigError(f"projection {kind!r} needs r <= d = {d}, got r = {r} (option --r)")
    assert net.prototypes is not None
    K = net.prototypes.num_prototypes
    T, dev = net.config.block_size, next(net.parameters()).device
    C = torch.zeros(K if local else 1, d, d, dtype=torch.float64)
    count = torch.zeros(K, dtype=torch.long)
    ranges = fit_ranges(universe, n, batch_size) if universe is not None else [(0, n)]
    for j0, j1 in (b for a0, a1 in ranges for b in _batches(a0, a1, batch_size)):
        fo, y = _forward(net, shards, j0, j1, T, dev)
        bg = block_gradients(net, fo, y)
        if keep is not None and keep.wants(j0, j1):  # equal to _postings_gradients bit for bit
            keep.add(j0, BlockGradients(seq=bg.seq + j0, proto=bg.proto, grad=bg.grad))
        proto = bg.proto.cpu()
        w = curvature.apply(proto, bg.grad.double().cpu(), -0.5)  # (rows, d)
        if not local:
            C[0] += w.T @ w
            continue
        C_add, present = _per_prototype_moments(w, proto)
        C.index_add_(0, present, C_add)
        count += torch.bincount(proto, minlength=K)
    if not local:
        return pca_bases(C[0].numpy(), r)
    return pca_bases(C.numpy(), r, count.numpy())


def _rows_by_group(W: torch.Tensor, proto: torch.Tensor, max_fill: float | None = None
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


def _per_prototype_moments(w: torch.Tensor, proto: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        out[a:a + chunk] = torch.einsum("nd,nrd->nr", W[a:a + chunk], R[proto[a:a + chunk]].to(W.dtype))
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


def _alloc(folder: Path | None, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An output array: a memory-mapped ``folder/name`` (.npy) or, without a folder, in memory."""
    if folder is None:
        return np.empty(shape, dtype)
    return np.lib.format.open_memmap(folder / name, mode="w+", dtype=dtype, shape=shape)


def prune_keep(norms: np.ndarray, proto: np.ndarray, unit: np.ndarray, K: int, prune: float,
               prune_by: str = "list") -> np.ndarray:
    """Which postings (norms (R,), prototype (R,), unit (R,)) survive pruning: (R,) bool.

    ``list``: norm ≥ prune × the largest norm of the same prototype's list. ``unit``: per unit, postings by
    norm descending (ties: storage order) are kept while the squared-norm mass of the larger ones before
    them is < (1 − prune) × the unit's total — the smallest postings holding ≤ prune of the mass go."""
    R = len(norms)
    if prune <= 0 or not R:
        return np.ones(R, dtype=bool)
    if prune_by == "list":
        top = np.zeros(K)
        np.maximum.at(top, proto, norms)
        return norms >= prune * top[proto]
    n2 = np.asarray(norms, dtype=np.float64) ** 2
    order = np.lexsort((np.arange(R), -n2, unit))  # by unit, largest first
    u, v = unit[order], n2[order]
    first = np.ones(R, dtype=bool)
    first[1:] = u[1:] != u[:-1]
    starts = np.flatnonzero(first)
    csum = np.cumsum(v)
    before = csum - v - np.repeat((csum - v)[starts], np.diff(np.append(starts, R)))  # larger ones' mass
    total = np.bincount(u, weights=v)[u]
    keep = np.empty(R, dtype=bool)
    keep[order] = before < (1 - prune) * total
    return keep


def _check_storage(config: AttributionConfig, r: int) -> None:
    """Refuse storage options that cannot encode r-dimensional sketches (ConfigError), before any pass."""
    if config.dtype == "pq":
        pq_layout(r, config.pq_dims)


def _encode(offsets: np.ndarray, ids: np.ndarray, sketch: np.ndarray, K: int, r: int, config: AttributionConfig, *,
            units_of: np.ndarray | None, work: Path | None,
            out: Path | None = None) -> tuple[np.ndarray, Ids, Sketches, dict[str, Any]]:
    """Encode CSR postings (``offsets`` (K+1,), ``ids`` (P,) ascending sequence ids within each list,
    ``sketch`` (P, r) float, memory-mapped or not) with the storage options of ``config`` (``dtype``,
    ``prune``/``prune_by``, ``id_encoding``, ``pq_dims``/``pq_sample``/``seed``); returns (offsets, ids,
    sketches, manifest entries).

    ``units_of`` (universe,): document of each sequence (document aggregation: the sketches of a
    (document, prototype) run are summed in float64), None: sequence postings. Postings are then pruned
    (``prune_keep``) and quantised (``pq``: codebooks trained first on ``pq_sample`` of the kept postings,
    drawn with ``seed``). Two passes over the postings in chunks of
    ``_CHUNK`` (run keys and norms are O(P) integers/floats; sketches are streamed); ``work``: a folder
    for the document sums (memory-mapped), None: in memory; ``out``: write the sketch arrays there as
    memory-mapped ``.npy`` files (their final names), None: in memory."""
    dtype, prune, prune_by, id_encoding = config.dtype, config.prune, config.prune_by, config.id_encoding
    P = len(ids)
    ids = np.asarray(ids, dtype=np.int64)
    proto = np.repeat(np.arange(K, dtype=np.int64), np.diff(offsets))  # (P,)
    unit = ids if units_of is None else np.asarray(units_of)[ids]  # (P,) ascending within each list
    if units_of is None:
        run_start = np.arange(P, dtype=np.int64)
    else:
        new = np.ones(P, dtype=bool)
        new[1:] = (proto[1:] != proto[:-1]) | (unit[1:] != unit[:-1])
        run_start = np.flatnonzero(new).astype(np.int64)  # (R,) first posting of each (prototype, unit) run
    R = len(run_start)
    run_end = np.append(run_start[1:], P)
    run_proto, run_unit = proto[run_start], unit[run_start]
    del proto, unit
    agg: np.ndarray | None = None
    if units_of is not None:
        agg = (np.lib.format.open_memmap(work / "agg.npy", mode="w+", dtype=np.float64, shape=(R, r))
               if work is not None else np.empty((R, r), np.float64))
    norms, maxabs = np.empty(R), np.empty(R)
    bounds = list(range(0, R, _CHUNK)) + [R]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # pass 1: sums, norms, largest entries
        if a == b:
            continue
        p0, p1 = int(run_start[a]), int(run_end[b - 1])
        x = np.asarray(sketch[p0:p1], dtype=np.float64)
        if agg is not None:
            x = np.add.reduceat(x, run_start[a:b] - p0, axis=0) if len(x) else x
            agg[a:b] = x
        norms[a:b] = np.linalg.norm(x, axis=1)
        maxabs[a:b] = np.abs(x).max(1) if r else 0.0
    keep = prune_keep(norms, run_proto, run_unit, K, prune, prune_by)
    kept = np.flatnonzero(keep)
    out_offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(run_proto[kept], minlength=K), out=out_offsets[1:])
    id_store: Ids = (DeltaIds if id_encoding == "delta" else PlainIds).encode(run_unit[kept], out_offsets)
    Pk = len(kept)
    sk_store: Sketches
    if dtype in _QMAX:
        qdt = typing.cast(QuantDtype, dtype)
        top_scale = float(maxabs[kept].max()) / _QMAX[qdt] if Pk else 0.0
        unit_scale = top_scale / _SCALE_RANGE if top_scale > 0 else 1.0
        codes = _alloc(out, "sketch_codes.npy", (Pk, code_width(qdt, r)), np.int8 if qdt == "int8" else np.uint8)
        scales = _alloc(out, "sketch_scale.npy", (Pk,), np.float16)
        sk_store = QuantSketches(codes, scales, unit_scale, qdt, r)
    elif dtype == "pq":
        M = pq_layout(r, config.pq_dims)
        rng = np.random.default_rng(config.seed)
        ks = kept[np.sort(rng.choice(Pk, min(Pk, config.pq_sample), replace=False))]
        xs = agg[ks] if agg is not None else np.asarray(sketch[run_start[ks]], dtype=np.float64)
        codebook = pq_train(_unit_rows(xs, norms[ks]), M, config.seed)
        top_norm = float(norms[kept].max()) if Pk else 0.0
        unit_scale = top_norm / _SCALE_RANGE if top_norm > 0 else 1.0
        sk_store = PQSketches(_alloc(out, "sketch_codes.npy", (Pk, M), np.uint8),
                              _alloc(out, "sketch_scale.npy", (Pk,), np.float16), unit_scale, codebook)
    else:
        sk_store = FloatSketches(_alloc(out, "sketch.npy", (Pk, r), _DTYPES[dtype]))
    for a in range(0, Pk, _CHUNK):  # pass 2: the kept postings, encoded
        k = kept[a:a + _CHUNK]
        x = agg[k] if agg is not None else np.asarray(sketch[run_start[k]], dtype=np.float64)
        if isinstance(sk_store, QuantSketches):
            sk_store.codes[a:a + len(k)], sk_store.scales[a:a + len(k)] = quantise(x, sk_store.qdtype, sk_store.unit)
        elif isinstance(sk_store, PQSketches):
            sk_store.codes[a:a + len(k)] = pq_encode(_unit_rows(x, norms[k]), sk_store.codebook)
            sk_store.scales[a:a + len(k)] = (norms[k] / sk_store.unit).astype(np.float16)
        else:
            sk_store.data[a:a + len(k)] = x
    del agg
    if work is not None:
        (work / "agg.npy").unlink(missing_ok=True)
    meta: dict[str, Any] = {"postings_raw": P, "postings_aggregated": R, "pruned": int(R - Pk),
                            **id_store.manifest(), **sk_store.manifest()}
    if isinstance(sk_store, PQSketches):  # provenance of the codebooks: how many postings they were fitted on
        meta.update({"pq_sample": config.pq_sample, "pq_trained_on": int(min(Pk, config.pq_sample))})
    return out_offsets, id_store, sk_store, meta


def _unit_rows(x: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Rows ``x`` (n, r) divided by their ``norms`` (n,); zero rows stay zero."""
    return np.divide(x, norms[:, None], out=np.zeros_like(x), where=norms[:, None] > 0)


@dataclass
class AttributionCache:
    """The inverted index prototype → postings (memory-mapped) and what it needs to sketch a query."""

    offsets: np.ndarray
    """(K+1,) int64: postings of prototype i are rows offsets[i]:offsets[i+1]."""
    ids: Ids
    """Posting ids (training sequence, or document with ``aggregate="document"``), ascending within a
    prototype: ``PlainIds`` (int32) or ``DeltaIds``."""
    sketches: Sketches
    """(P, r) sketches R H_i^{-1/2} G_{j,i}: ``FloatSketches`` or ``QuantSketches``."""
    projection: np.ndarray
    """(r, d) float64: R; ``pca-local``: (K, r, d), one basis R_i per prototype."""
    curvature: Curvature
    manifest: dict[str, Any]
    path: Path | None = field(default=None, compare=False)
    units_of: np.ndarray | None = None
    """Document aggregation: (universe,) the document of each sequence (int32, ascending); else None."""
    _query_sketcher: PostingSketcher | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_prototypes(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def r(self) -> int:
        return int(self.projection.shape[-2])

    @property
    def num_postings(self) -> int:
        return int(self.offsets[-1])

    @property
    def aggregate(self) -> Literal["sequence", "document"]:
        """What a posting id and a score column are: a training sequence or a document."""
        return "document" if self.manifest.get("aggregate") == "document" else "sequence"

    @property
    def num_train(self) -> int:
        """Columns of ``scores``: training sequences, or (document aggregation) documents 0 … last covered."""
        return int(self.manifest.get("units", self.manifest["universe"]))

    @property
    def seq(self) -> np.ndarray:
        """(P,) every posting's id, decoded (the stored int32 array itself for ``id_encoding="int32"``)."""
        return self.ids.decode(self.offsets)

    @property
    def sketch(self) -> np.ndarray:
        """(P, r) every sketch: the stored (memory-mapped) array for float formats, decoded float64 for
        int8/int4 (materialised)."""
        return self.sketches.decode()

    def first_sequence(self, units: np.ndarray) -> np.ndarray:
        """The first training sequence of each unit (a sequence id itself without document aggregation)."""
        units = np.asarray(units, dtype=np.int64)
        if self.units_of is None:
            return units
        return np.searchsorted(np.asarray(self.units_of), units, side="left").astype(np.int64)

    def nbytes(self) -> int:
        """Bytes of the postings (ids, sketches, scales, offsets, document map): what the queries read."""
        return int(self.ids.nbytes + self.sketches.nbytes + self.offsets.nbytes
                   + (self.units_of.nbytes if self.units_of is not None else 0))

    # ----- identity checks ------------------------------------------------------------------------------
    def check(self, *, model_sha256: str | None = None, shards: ShardSet | None = None,
              shard_key: str | None = None) -> None:
        """Raise ``ArtifactMismatch`` unless the cache was built from this model (``model_sha256``: a
        checkpoint's ``manifest["model_sha256"]``) and these shards (``shards`` or their ``shard_key``)."""
        where = f" {self.path}" if self.path else ""
        if shards is not None:
            shard_key = shards.manifest["key"]
        check_provenance(self.manifest, what=f"attribution cache{where}", rebuild="prism attribute-cache",
                         model_sha256=model_sha256, shard_key=shard_key)

    # ----- queries --------------------------------------------------------------------------------------
    def sketch_query(self, query: BlockGradients) -> torch.Tensor:
        """(Rq, r) sketches R H_i^{-1/2} G_{q,i} of a query's block gradients (float64): the map the
        postings were made with (``PostingSketcher``), in float64, made once per open cache."""
        if self._query_sketcher is None:
            R = torch.from_numpy(np.asarray(self.projection))
            self._query_sketcher = PostingSketcher(self.curvature, R, torch.float64)
        return self._query_sketcher(query.proto.cpu(), query.grad.detach().cpu())  # (Rq, r)

    def scores(self, query: BlockGradients, num_queries: int, *, contributions: bool = False):
        """(num_queries, num_train) float64 scores. Only the lists of each query's active prototypes are
        read (one gather of their concatenated rows, decoded), and their dot products with the query's
        sketches are scatter-added into the scores: Σ_{i∈A_q} |postings(i)| · r multiply-adds, nothing
        proportional to the corpus. With ``contributions=True`` also returns, per query, the flat arrays
        (id, proto, contribution) of every posting read."""
        sq = self.sketch_query(query)  # (Rq, r)
        out = torch.zeros(num_queries, self.num_train, dtype=torch.float64)
        contrib_out = []
        qseq, qproto = query.seq.cpu(), query.proto.cpu()
        for q in range(num_queries):  # queries are few; each read below is vectorised over prototypes
            sel = qseq == q
            protos = qproto[sel].numpy()
            lo, hi = self.offsets[protos], self.offsets[protos + 1]
            n = hi - lo
            if n.sum() == 0:
                contrib_out.append((np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)))
                continue
            rep = np.repeat(np.arange(len(protos)), n)  # query row of each posting read
            rows = concat_ranges(lo, n)  # (P_q,)
            ids = torch.from_numpy(self.ids.gather(lo, n))  # (P_q,) int64
            sq_q = sq[sel]
            c = torch.empty(len(rows), dtype=torch.float64)
            sq_np = sq_q.numpy()
            for a in range(0, len(rows), _QUERY_CHUNK):  # chunks bound memory; each row's sum is unchanged
                b = a + _QUERY_CHUNK
                c[a:b] = torch.from_numpy(self.sketches.dots(rows[a:b], sq_np[rep[a:b]]))  # (chunk,) s_j · s_q
                out[q].index_add_(0, ids[a:b], c[a:b])  # in posting order, as one call would
            if contributions:
                contrib_out.append((ids.numpy(), protos[rep], c.numpy()))
        return (out, contrib_out) if contributions else out

    def top(self, query: BlockGradients, num_queries: int, k: int = 10, *, search: SearchIndex | None = None,
            **effort: int) -> tuple[np.ndarray, np.ndarray]:
        """Each query's k best units: (scores (Q, k) float64, ids (Q, k) int64), score descending, ties by
        ascending id. ``search=None``: the exact scan (``scores``); a ``prismlm.tda.search.SearchIndex`` of
        this cache: candidates from approximate top-M search in long lists, rescored exactly (``effort``:
        ``m``, ``nprobe``, ``ef``; see ``SearchIndex.top``)."""
        from prismlm.tda.search import exact_top

        if search is None:
            return exact_top(self, query, num_queries, k)
        return search.top(self, query, num_queries, k, **effort)

    # ----- persistence ----------------------------------------------------------------------------------
    def _arrays(self) -> dict[str, np.ndarray]:
        arrays = {"offsets.npy": np.asarray(self.offsets), **self.ids.arrays(), **self.sketches.arrays()}
        if self.units_of is not None:
            arrays["units.npy"] = self.units_of
        return arrays

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with atomic_dir(path) as tmp:
            _write_arrays(tmp, self._arrays())
            np.save(tmp / "projection.npy", self.projection)
            self.curvature.save(tmp / "curvature.safetensors")
            self.manifest["files"] = file_records(tmp)
            (tmp / "manifest.json").write_text(json.dumps(self.manifest, indent=2) + "\n")
        self.path = path
        return path

    def verify(self) -> list[str]:
        """``prism verify``: the full sha256 of every file the cache reads, and of its search sidecar's
        (``search/``, if any), against their manifests; a file without a record is refused as well
        (``ArtifactCorrupt`` naming it). Returns the files checked."""
        assert self.path is not None, "a cache opened from a folder"
        names = (*self._arrays(), "projection.npy", "curvature.safetensors")
        checked = verify_files(self.path, self.manifest.get("files"), what="attribution cache", full=True,
                               fix=f"rebuild it with `{_REBUILD}`", required=names)
        side = self.path / "search" / "manifest.json"
        if side.exists():
            fix = "rebuild it with `prism attribute-search RUN`"
            with reading(side, "search index manifest", fix=fix):
                records = json.loads(side.read_text())["files"]
                if not records or not isinstance(records, dict):
                    raise ValueError("it records no files")
            checked += [f"search/{n}" for n in verify_files(side.parent, records, what="search index", fix=fix,
                                                             full=True)]
        return checked

    @classmethod
    def load(cls, path: str | Path, *, model_sha256: str | None = None, shards: ShardSet | None = None,
             mmap: bool = True) -> AttributionCache:
        """Open a saved cache (arrays memory-mapped when ``mmap``); with ``model_sha256`` and ``shards`` it
        is checked against them (``ArtifactMismatch``). Format-1 caches load as int32 ids + float sketches;
        a newer format or unknown storage options raise ``ArtifactError`` naming the manifest."""
        path = Path(path)
        mpath = path / "manifest.json"
        if not mpath.exists():
            raise ArtifactError(f"no attribution cache at {path}; build it with `prism attribute-cache`")
        with reading(mpath, "attribution cache manifest", fix=_REBUILD):
            manifest = json.loads(mpath.read_text())
        if manifest.get("kind") != KIND:
            raise ArtifactError(f"{path} is not an attribution cache (kind {manifest.get('kind')!r})")
        version = manifest.get("format_version", 1)
        ids_enc, dtype = manifest.get("id_encoding", "int32"), manifest.get("dtype", "float32")
        agg = manifest.get("aggregate", "sequence")
        if not isinstance(version, int) or version > FORMAT_VERSION or ids_enc not in ("int32", "delta") \
                or dtype not in (*_DTYPES, *_QMAX, "pq") or agg not in ("sequence", "document"):
            raise ArtifactError(f"{mpath}: attribution cache format {version!r} (ids {ids_enc!r}, sketches "
                                f"{dtype!r}, aggregate {agg!r}) is not one this prismlm reads (format <= "
                                f"{FORMAT_VERSION})", fix=f"rebuild it with `{_REBUILD}`, or upgrade prismlm",
                                path=mpath)
        verify_files(path, manifest.get("files"), what="attribution cache", fix=f"rebuild it with `{_REBUILD}`")
        mode: Literal["r"] | None = "r" if mmap else None

        def arr(name: str) -> np.ndarray:
            with reading(path / name, "attribution cache file", fix=_REBUILD):
                return np.load(path / name, mmap_mode=mode)

        ids: Ids = PlainIds(arr("seq.npy")) if ids_enc == "int32" else \
            DeltaIds(arr("ids_gap.npy"), arr("ids_exc_pos.npy"), arr("ids_exc_val.npy"))
        sk: Sketches
        if dtype in _DTYPES:
            sk = FloatSketches(arr("sketch.npy"))
        elif dtype == "pq":
            sk = PQSketches(arr("sketch_codes.npy"), arr("sketch_scale.npy"), float(manifest["scale_unit"]),
                            np.asarray(arr("sketch_codebook.npy")))
        else:
            sk = QuantSketches(arr("sketch_codes.npy"), arr("sketch_scale.npy"), float(manifest["scale_unit"]),
                               typing.cast(QuantDtype, dtype), int(manifest["r"]))
        with reading(path, "attribution cache", fix=_REBUILD):
            c = cls(offsets=np.load(path / "offsets.npy"), ids=ids, sketches=sk,
                    projection=np.load(path / "projection.npy"),
                    curvature=Curvature.load(path / "curvature.safetensors"), manifest=manifest, path=path,
                    units_of=arr("units.npy") if agg == "document" else None)
        P = c.num_postings
        shapes_ok = (c.offsets.ndim == 1 and len(c.offsets) == int(manifest["num_prototypes"]) + 1
                     and len(c.ids.gaps if isinstance(c.ids, DeltaIds) else c.ids.seq) == P
                     and (c.sketches.data.shape == (P, c.r) if isinstance(c.sketches, FloatSketches)
                          else c.sketches.scales.shape == (P,))
                     and (not isinstance(c.sketches, PQSketches)
                          or (c.sketches.r == c.r and c.sketches.codes.shape == (P, c.sketches.codebook.shape[0])
                              and c.sketches.codebook.shape[1] == PQ_CENTROIDS)))
        if not shapes_ok:
            raise ArtifactCorrupt(f"attribution cache {path}: its arrays disagree in size with offsets.npy "
                                  f"({P} postings)", fix=f"rebuild it with `{_REBUILD}`", path=path)
        c.check(model_sha256=model_sha256, shards=shards)
        return c


def _write_arrays(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    """Save arrays as ``folder/name`` .npy files; an array already memory-mapped at that file is flushed."""
    for name, a in arrays.items():
        f = folder / name
        if isinstance(a, np.memmap) and a.filename is not None and f.exists() and os.path.samefile(a.filename, f):
            a.flush()
        else:
            np.save(folder / name, np.asarray(a))


def _finalise(seq: np.ndarray, proto: np.ndarray, sketch: np.ndarray, K: int, out_dir: Path | None,
              dtype: type[np.floating], r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group postings by prototype (stable: sequence order kept) into CSR arrays (memory-mapped when
    ``out_dir`` is given)."""
    order = np.argsort(proto, kind="stable")
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(proto, minlength=K), out=offsets[1:])
    P = len(order)
    seq_o: np.ndarray
    sk_o: np.ndarray
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        seq_o = np.lib.format.open_memmap(out_dir / "seq.npy", mode="w+", dtype=np.int32, shape=(P,))
        sk_o = np.lib.format.open_memmap(out_dir / "sketch.npy", mode="w+", dtype=dtype, shape=(P, r))
    else:
        seq_o, sk_o = np.empty(P, np.int32), np.empty((P, r), dtype)
    step = _CHUNK
    for s in range(0, P, step):  # chunks of postings bound the memory of the gather
        o = order[s:s + step]
        seq_o[s:s + step] = seq[o]
        sk_o[s:s + step] = sketch[o]
    return offsets, seq_o, sk_o


class _BatchStore:
    """Block gradients of postings-pass batches that a curvature or projection fit already ran through the
    model, kept so that the postings pass reads them instead of running the batch again: the same batch of
    the grid, the same forward and the same ``_postings_gradients`` rows (equal bit for bit). A batch
    [j0, j1) is wanted when it is one the postings pass over [start, stop) makes (``_batches``). Kept on
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
        return self.start <= j0 < self.stop and j0 % self.batch_size == 0 and j1 == grid_end \
            and j0 not in self.held

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


def _postings_gradients(net: PrismLM, out: Any, targets: torch.Tensor, seq_ids: torch.Tensor,
                        mu: torch.Tensor | None = None) -> BlockGradients:
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


def sampled_curvature(net: PrismLM, shards: ShardSet, cfg: AttributionConfig, universe: int, *,
                      progress: Progress = False, keep: _BatchStore | None = None) -> Curvature:
    """The curvature a cache of sequences [0, universe) uses: statistics over ``cfg.curvature_sample``
    of them in batches spread over the range (``fit_ranges``; all of them when 0/None or when there are
    fewer), accumulated in ascending batch order — the same on every process that calls it. ``keep``: where
    the block gradients of the batches a postings pass will need are kept (``build_cache``)."""
    n = cfg.curvature_sample or universe
    ranges = fit_ranges(universe, min(n, universe), cfg.batch_size)
    T, dev = net.config.block_size, next(net.parameters()).device
    acc = CurvatureAccumulator(net, exact=cfg.curvature_mode == "exact")
    with eval_mode(net), Reporter(progress, "curvature", sum(b - a for a, b in ranges), unit="seq") as bar:
        for j0, j1 in (b for a0, a1 in ranges for b in _batches(a0, a1, cfg.batch_size)):
            out, y = _forward(net, shards, j0, j1, T, dev)
            mu = acc.update(out)  # (B·T, d) Wᵀπ_t in the shared mode: the postings' product, not made twice
            if keep is not None and keep.wants(j0, j1):
                keep.add(j0, _postings_gradients(net, out, y, torch.arange(j0, j1, device=dev), mu))
            bar.update(j1 - j0)
    return acc.finish(damping=cfg.damping)


def _tensor_digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _finished_build(out_dir: Path, started: dict[str, Any], shards: ShardSet) -> AttributionCache:
    """``resume`` when the build already finished: the cache at ``out_dir``, if it is this build's."""
    cache = AttributionCache.load(out_dir, model_sha256=started["model_sha256"], shards=shards)
    m, opts = cache.manifest, started["options"]
    mine = (m.get("universe") == started["universe"] and list(m.get("part", [])) == started["part"]
            and opts["r"] in (None, m.get("r"))
            and all(m.get(k) == opts[k] for k in ("projection", "dtype", "prune", "aggregate", "id_encoding")))
    if not mine:
        raise ArtifactError(f"cannot resume: {out_dir} holds a finished cache built with other options or sequences",
                            fix="rerun without --resume to rebuild it, or choose another --out", path=out_dir)
    return cache


@writes_folder("out")  # one writer per output folder: a second build is refused, never deletes this one's
def build_cache(
    model: PrismLM,
    shards: ShardSet,
    config: AttributionConfig | None = None,
    *,
    out: str | Path | None = None,
    curvature: Curvature | None = None,
    part: tuple[int, int] = (0, 1),
    model_sha256: str | None = None,
    resume: bool = False,
    progress: Progress = False,
) -> AttributionCache:
    """Build the postings cache of a PRISM ``model`` over ``shards.train``.

    ``config``: the attribution options (sketch size and projection, curvature mode and damping, sequences,
    batch size, storage: dtype, prune, aggregate, id_encoding; default ``AttributionConfig()``). ``out``:
    write the artifact there (postings go to memory-mapped files). ``curvature``: reuse one (required to
    make parts agree), else one is computed first (``sampled_curvature``: over ``config.curvature_sample``
    of the cached sequences, spread over them). ``part=(i, n)``: only the i-th batch-aligned slice. ``model_sha256``: the identity recorded in
    the manifest (pass the checkpoint's ``manifest["model_sha256"]``; None: a hash of the weights,
    ``model_identity``). ``resume`` (with ``out``): continue the interrupted build in ``OUT.build`` after its
    last written batch, with the curvature and projection it saved (the same cache as one uninterrupted
    build, bit for bit; ``ArtifactError`` if it was started with another model, corpus, part or options),
    or return ``out`` when that build already finished; without ``resume`` a left-over build folder is
    discarded. A resume first checks the build files (``tda.build_state``): a changed curvature or
    projection is refused by name (``ArtifactCorrupt``), damaged or missing posting rows are built again
    from the last intact batch. ``out`` is locked for the whole build (``output_lock``: a second writer
    gets ``ArtifactError``).
    """
    cfg = config if config is not None else AttributionConfig()
    net = model
    if net.prototypes is None:
        raise ModelError("an attribution cache needs a PRISM model; this is the dense baseline (it has no prototypes)")
    ident = model_sha256 or model_identity(net)
    d, K, T = net.config.n_embd, net.prototypes.num_prototypes, net.config.block_size
    r = d if cfg.r is None else int(cfg.r)
    projection, batch_size, dtype = cfg.projection, cfg.batch_size, cfg.dtype
    _check_storage(cfg, r)  # before the passes, not after them
    if projection not in ("pca", "pca-local"):
        R = torch.from_numpy(make_projection(d, r, projection, cfg.seed))  # (r, d)
    n_all = shards.train.num_sequences(T)
    universe = n_all if cfg.max_sequences is None else min(n_all, cfg.max_sequences)
    if universe < 1:
        raise ArtifactError(f"the training split has no complete sequence of {T + 1} tokens")
    start, stop = part_range(universe, batch_size, part)
    out_dir = Path(out) if out is not None else None
    if resume and out_dir is None:
        raise ConfigError("resuming a cache build needs its output folder (out)")
    tmp_dir = None
    # what a resumed build must share with the one it continues (the storage options are applied at the end)
    started = {"model_sha256": ident, "shard_key": shards.manifest["key"], "part": list(part), "universe": universe,
               "options": cfg.to_dict(), "curvature_given": curvature is not None,
               "curvature_F": None if curvature is None else _tensor_digest(curvature.F)}
    # the raw postings keep float32 (float64/float16 when stored so); int8/int4/int3 are encoded from float32
    npdt = _DTYPES[dtype] if dtype in _DTYPES else np.float32
    widths = {"seq": 4, "proto": 4, "sketch": r * np.dtype(npdt).itemsize}  # bytes per row of each raw file
    resumed: Resumed | None = None
    if out_dir is not None:
        tmp_dir = out_dir.with_name(out_dir.name + ".build")
        if resume:
            if not tmp_dir.exists() and (out_dir / "manifest.json").exists():
                return _finished_build(out_dir, started, shards)
            # checked before anything is read: a damaged batch and those after it are built again
            resumed = resume_build(tmp_dir, started, widths)
        if resumed is None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir.mkdir(parents=True)
    state = resumed.state if resumed is not None else None
    # the batches the curvature and projection fits run through the model keep their block gradients for
    # the postings pass (up to curvature_sample + pca_sequences sequences: fewer forwards, same postings)
    kept = _BatchStore(None if tmp_dir is None else tmp_dir / "fitted", start, stop, batch_size)
    t0 = time.perf_counter()
    if state is not None:  # a resumed build: the saved curvature and projection, no fit passes
        assert tmp_dir is not None
        curvature = curvature if curvature is not None else Curvature.load(tmp_dir / "curvature.safetensors")
        R = torch.from_numpy(np.load(tmp_dir / "projection.npy"))
    else:
        if curvature is None:
            curvature = sampled_curvature(net, shards, cfg, universe, progress=progress, keep=kept)
        if projection in ("pca", "pca-local"):
            with eval_mode(net):
                R = torch.from_numpy(_pca_projection(net, shards, curvature, r, min(universe, cfg.pca_sequences),
                                                     batch_size, local=projection == "pca-local", universe=universe,
                                                     keep=kept))
        if tmp_dir is not None:  # what a resumed build reads instead of fitting again (checked by its sha256)
            curvature.save(tmp_dir / "curvature.safetensors")
            np.save(tmp_dir / "projection.npy", R.numpy())
    t_curv = time.perf_counter() - t0 + (state["curvature_seconds"] if state else 0.0)
    model_dt = torch.promote_types(next(net.parameters()).dtype, torch.float32)
    # float16 and float64 sketches are rounded from float64 (what lossless_options' float64 parts give)
    sketcher = PostingSketcher(curvature, R, torch.float64 if dtype in ("float16", "float64") else model_dt)
    plain = dtype in _DTYPES and cfg.prune == 0 and cfg.aggregate == "sequence" and cfg.id_encoding == "int32"
    units_of = document_of_sequences(shards, universe, T) if cfg.aggregate == "document" else None
    dev = next(net.parameters()).device
    files: PostingFiles | None = None
    lists: dict[str, list[np.ndarray]] = {"seq": [], "proto": [], "sketch": []}
    done_to, tokens = (state["done_to"], state["tokens"]) if state else (start, 0)
    if tmp_dir is not None:  # rows after the last good batch (a torn write, a damaged batch) are dropped
        files = PostingFiles(tmp_dir, resumed)
        files.open(widths, None if resumed else
                   {**started, "start": start, "fitted": record_fitted(tmp_dir), "curvature_seconds": t_curv})
    t1 = time.perf_counter()
    pass_before = state["postings_seconds"] if state else 0.0
    try:
        with eval_mode(net), Reporter(progress, "postings", stop - start, unit="seq", initial=done_to - start) as bar:
            if resumed is not None and resumed.note:
                bar.message(resumed.note)
            for j0, j1 in _batches(done_to, stop, batch_size):
                bg = kept.pop(j0)
                if bg is None:
                    fo, y = _forward(net, shards, j0, j1, T, dev)
                    bg = _postings_gradients(net, fo, y, torch.arange(j0, j1, device=dev))
                pr = bg.proto.cpu()
                sk = sketcher(pr, bg.grad.cpu())  # (rows, r)
                rows = {"seq": bg.seq.cpu().numpy().astype(np.int32),
                        "proto": bg.proto.cpu().numpy().astype(np.int32), "sketch": sk.numpy().astype(npdt)}
                tokens += (j1 - j0) * T
                bar.update(j1 - j0)
                if files is not None:  # the batch whole on disk, then recorded (a resume continues after it)
                    files.append(rows, j1=j1, tokens=tokens, seconds=pass_before + time.perf_counter() - t1)
                else:
                    for k, v in rows.items():
                        lists[k].append(v)
    finally:
        if files is not None:
            files.close()
    t_pass = pass_before + time.perf_counter() - t1
    units = universe if units_of is None else int(units_of[-1]) + 1
    manifest: dict[str, Any] = {
        "kind": KIND, "format_version": FORMAT_VERSION, "model_sha256": ident,
        "shard_key": shards.manifest["key"], "shards_root": str(Path(shards.root).resolve()),
        "split": "train", "num_prototypes": K, "d": d, "block_size": T, "r": r, "projection": projection,
        "seed": cfg.seed, "pca_sequences": cfg.pca_sequences if projection.startswith("pca") else None, "dtype": dtype,
        "prune": cfg.prune, "prune_by": cfg.prune_by, "aggregate": cfg.aggregate, "id_encoding": cfg.id_encoding, "units": units,
        "curvature_mode": curvature.mode, "damping": curvature.damping,
        "curvature_sample": cfg.curvature_sample, "curvature_tokens": curvature.tokens,
        "batch_size": batch_size, "universe": universe,
        "part": list(part), "covered": [[start, stop]] if stop > start else [], "tokens": tokens,
    }

    def _store(offsets: np.ndarray, seq: np.ndarray, sk: np.ndarray, work: Path | None,
               stage: Path | None) -> tuple[np.ndarray, Ids, Sketches]:
        """CSR float postings → the configured storage (the CSR arrays themselves when plain)."""
        if plain:
            return offsets, PlainIds(seq), FloatSketches(sk)
        o, ids, sks, meta = _encode(offsets, seq, sk, K, r, cfg, units_of=units_of, work=work, out=stage)
        manifest.update(meta)
        return o, ids, sks

    def _finish(ids: Ids, sks: Sketches) -> None:
        P = len(ids.gaps) if isinstance(ids, DeltaIds) else len(ids.seq)
        bytes_postings = ids.nbytes + sks.nbytes + (4 * universe if units_of is not None else 0)
        manifest.update({
            "postings": P, "postings_per_sequence": P / max(1, stop - start),
            "bytes_postings": bytes_postings, "bytes_per_token": bytes_postings / max(1, tokens),
            "curvature_seconds": t_curv, "postings_seconds": t_pass,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **provenance(),
        })

    if out_dir is None:
        seq = np.concatenate(lists["seq"]) if lists["seq"] else np.zeros(0, np.int32)
        proto = np.concatenate(lists["proto"]) if lists["proto"] else np.zeros(0, np.int32)
        sketch = np.concatenate(lists["sketch"]) if lists["sketch"] else np.zeros((0, r), npdt)
        offsets, ids, sks = _store(*_finalise(seq, proto, sketch, K, None, npdt, r), None, None)
        _finish(ids, sks)
        return AttributionCache(offsets=offsets, ids=ids, sketches=sks, projection=R.numpy(), curvature=curvature,
                                manifest=manifest, units_of=None if units_of is None else units_of.astype(np.int32))
    assert tmp_dir is not None
    seq = np.fromfile(tmp_dir / "seq.raw", dtype=np.int32)
    proto = np.fromfile(tmp_dir / "proto.raw", dtype=np.int32)
    sketch = np.memmap(tmp_dir / "sketch.raw", dtype=npdt, mode="r", shape=(len(seq), r)) if len(seq) else \
        np.zeros((0, r), npdt)
    with atomic_dir(out_dir) as stage:  # the sorted arrays are written as .npy under the stage
        # plain: sorted straight into the stage; otherwise sorted under the build folder, then encoded
        csr = _finalise(seq, proto, sketch, K, stage if plain else tmp_dir / "csr", npdt, r)
        offsets, ids, sks = _store(*csr, tmp_dir, stage)
        _finish(ids, sks)
        arrays = {"offsets.npy": offsets, **ids.arrays(), **sks.arrays()}
        if units_of is not None:
            arrays["units.npy"] = units_of.astype(np.int32)
        _write_arrays(stage, arrays)
        del csr, ids, sks, sketch, arrays
        np.save(stage / "projection.npy", R.numpy())
        curvature.save(stage / "curvature.safetensors")
        manifest["files"] = file_records(stage)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    return AttributionCache.load(out_dir)


@writes_folder("out")
def compress_cache(cache: AttributionCache, config: AttributionConfig, *, shards: ShardSet | None = None,
                   out: str | Path | None = None) -> AttributionCache:
    """Re-encode a lossless cache (float32/64 sketches, sequence postings, no pruning) with the storage
    options of ``config`` (``dtype``, ``prune``, ``aggregate``, ``id_encoding``), without another pass over
    the data. ``shards``: the cache's token shards (needed for ``aggregate="document"``). ``out``: save it
    there. Equal to building with those options from the same postings."""
    m = cache.manifest
    if not _lossless(m):
        raise ArtifactError(f"compress_cache needs a lossless cache (float32/float64 sketches, sequence postings, "
                            f"no pruning); this one is {m.get('dtype')}, prune {m.get('prune', 0)}, "
                            f"aggregate {m.get('aggregate', 'sequence')}", fix="build it with the default options")
    if config.aggregate == "document" and shards is None:
        raise ConfigError("aggregate='document' needs the cache's token shards (shards=)")
    if shards is not None:
        cache.check(shards=shards)
    universe, T, K, r = int(m["universe"]), int(m["block_size"]), cache.num_prototypes, cache.r
    _check_storage(config, r)
    units_of = document_of_sequences(shards, universe, T) if config.aggregate == "document" and shards else None
    offsets, ids, sks, meta = _encode(cache.offsets, cache.seq, cache.sketches.decode(), K, r, config,
                                      units_of=units_of, work=None)
    manifest = dict(m)
    manifest.pop("files", None)
    bytes_postings = ids.nbytes + sks.nbytes + (4 * universe if units_of is not None else 0)
    P = int(offsets[-1])
    manifest.update({"format_version": FORMAT_VERSION, "dtype": config.dtype, "prune": config.prune,
                     "prune_by": config.prune_by,
                     "aggregate": config.aggregate, "id_encoding": config.id_encoding,
                     "units": universe if units_of is None else int(units_of[-1]) + 1, **meta,
                     "postings": P, "postings_per_sequence": P / max(1, sum(b - a for a, b in m["covered"])),
                     "bytes_postings": bytes_postings, "bytes_per_token": bytes_postings / max(1, int(m["tokens"])),
                     "compressed_from": str(cache.path) if cache.path else None})
    c = AttributionCache(offsets=offsets, ids=ids, sketches=sks, projection=cache.projection, curvature=cache.curvature,
                         manifest=manifest, units_of=None if units_of is None else units_of.astype(np.int32))
    if out is not None:
        c.save(out)
        c = AttributionCache.load(out)
    return c


@writes_folder("out")
def merge_caches(parts: list[AttributionCache], out: str | Path | None = None) -> AttributionCache:
    """Combine caches of disjoint sequence ranges (same model, shards, curvature, projection) into one,
    equal to a single pass (postings grouped by prototype, ascending sequence id within each). Parts must
    be lossless (float32/64 sketches, no pruning, sequence postings): compress the merged cache after."""
    if not parts:
        raise ArtifactError("nothing to merge")
    first = parts[0].manifest
    for p in parts:
        if not _lossless(p.manifest):
            raise ArtifactError(f"cannot merge caches stored as {p.manifest.get('dtype')} with prune "
                                f"{p.manifest.get('prune', 0)} and aggregate {p.manifest.get('aggregate')}: "
                                f"pruning, quantisation scales and documents depend on the whole corpus",
                                fix="build the parts with --dtype float32 (no --prune, --aggregate sequence), "
                                    "merge them, then compress the merged cache (prismlm.tda.cache.compress_cache)")
    for p in parts[1:]:
        m = p.manifest
        for key in ("model_sha256", "shard_key"):
            if m[key] != first[key]:
                raise ArtifactMismatch(f"cannot merge caches: {key} differs ({first[key]} vs {m[key]})")
        for key in ("r", "projection", "seed", "dtype", "num_prototypes", "universe", "curvature_mode"):
            if m[key] != first[key]:
                raise ArtifactError(f"cannot merge caches: {key} differs ({first[key]} vs {m[key]})")
        if not (np.array_equal(p.projection, parts[0].projection)
                and torch.equal(p.curvature.F, parts[0].curvature.F) and torch.equal(p.curvature.m, parts[0].curvature.m)):
            raise ArtifactError("cannot merge caches built with different curvature or projection; pass the same "
                              "`curvature` to every part")
    covered: list[list[int]] = []
    for p in parts:
        ov = overlap(covered, merge_ranges(p.manifest["covered"]))
        if ov is not None:
            raise ArtifactError(f"cannot merge caches: parts overlap on sequences [{ov[0]}, {ov[1]})")
        covered = merge_ranges(covered + p.manifest["covered"])
    parts = sorted(parts, key=lambda p: p.manifest["covered"][0][0] if p.manifest["covered"] else 0)
    K = parts[0].num_prototypes
    seq = np.concatenate([np.asarray(p.seq, dtype=np.int64) for p in parts])
    proto = np.concatenate([np.repeat(np.arange(K, dtype=np.int32), np.diff(p.offsets)) for p in parts])
    order = np.lexsort((seq, proto))  # by prototype, then sequence: the single-pass order
    bounds = np.cumsum([0] + [p.num_postings for p in parts])
    P, r = len(seq), parts[0].r
    work = Path(out).with_name(Path(out).name + ".merge") if out is not None else None
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    sketch = _alloc(work, "sketch.npy", (P, r), np.asarray(parts[0].sketch[:0]).dtype)
    for s in range(0, P, _CHUNK):  # the parts' sketches gathered in chunks: never all in memory
        idx = order[s:s + _CHUNK]
        which = np.searchsorted(bounds, idx, side="right") - 1
        dst = sketch[s:s + len(idx)]
        for k, p in enumerate(parts):  # a few parts
            sel = which == k
            if sel.any():
                dst[sel] = p.sketch[idx[sel] - bounds[k]]
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(proto, minlength=K), out=offsets[1:])
    manifest = dict(first)
    manifest.pop("files", None)
    tokens = sum(int(p.manifest["tokens"]) for p in parts)
    ids: Ids = (DeltaIds if first.get("id_encoding") == "delta" else PlainIds).encode(seq[order], offsets)
    manifest.update({"covered": covered, "part": [0, 1], "tokens": tokens, "postings": P,
                     "postings_per_sequence": P / max(1, sum(b - a for a, b in covered)),
                     "bytes_postings": ids.nbytes + int(sketch.nbytes),
                     "postings_seconds": sum(float(p.manifest["postings_seconds"]) for p in parts),
                     "merged_from": len(parts), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **ids.manifest()})
    manifest["bytes_per_token"] = manifest["bytes_postings"] / max(1, tokens)
    cache = AttributionCache(offsets=offsets, ids=ids, sketches=FloatSketches(sketch),
                             projection=parts[0].projection, curvature=parts[0].curvature, manifest=manifest)
    if out is not None:
        cache.save(out)
        del cache, sketch
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        cache = AttributionCache.load(out)
    return cache
