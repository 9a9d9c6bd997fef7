"""How a cache stores its postings: ids (``PlainIds``, ``DeltaIds``) and sketches (``FloatSketches``,
``QuantSketches`` int8/int4/int3, ``PQSketches``), each with ``gather``/``dots``/``decode`` and the
arrays and manifest entries it saves. Pure numpy/torch on arrays: no model, no files.

Invariant: decoding is exact for ids and float sketches; a quantised entry is within half its scale of
the value it encodes. The on-disk layout is in docs/architecture.md ("The attribution cache").
"""

from __future__ import annotations

from typing import Literal, TypedDict

import numpy as np
import torch

from prismlm.errors import ArtifactError, ConfigError

__all__ = [
    "FLOAT_DTYPES",
    "PQ_CENTROIDS",
    "QMAX",
    "SCALE_RANGE",
    "DeltaIds",
    "FloatSketches",
    "Ids",
    "PQSketches",
    "PlainIds",
    "QuantDtype",
    "QuantSketches",
    "Sketches",
    "StorageEntries",
    "code_values",
    "code_width",
    "concat_ranges",
    "dequantise",
    "pq_encode",
    "pq_layout",
    "pq_train",
    "quantise",
]

FLOAT_DTYPES: dict[str, type[np.floating]] = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
QMAX: dict[str, int] = {"int8": 127, "int4": 7, "int3": 3}
"""The largest code Q of each quantised dtype: codes are q ∈ [−Q, Q]."""
QuantDtype = Literal["int8", "int4", "int3"]
_INT3_SHIFTS = np.arange(0, 24, 3, dtype=np.uint32)  # bit offsets of the 8 codes in a 24-bit word
SCALE_RANGE = 2.0**15
"""The largest per-posting scale is stored as 2^15 × ``scale_unit`` (float16 holds up to 65504), so ratios
down to ~2e-9 of it stay normal float16 numbers."""


class StorageEntries(TypedDict, total=False):
    """The manifest entries of how ids and sketches are stored (each codec's ``manifest()``)."""

    id_encoding: str
    """``int32`` or ``delta``."""
    id_width: int
    """Bytes per delta gap (1 or 2)."""
    id_exceptions: int
    dtype: str
    """float16/32/64, int8/int4/int3 or pq."""
    scale_unit: float
    pq_dims: int


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
            raise ArtifactError(
                f"id {int(ids.max())} does not fit int32; use AttributionConfig.id_encoding delta",
                param="AttributionConfig.id_encoding",
            )
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

    def manifest(self) -> StorageEntries:
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
        return cls(
            np.where(exc, esc, gaps).astype(dt), np.flatnonzero(exc).astype(np.int64), gaps[exc].astype(np.uint32)
        )

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

    def manifest(self) -> StorageEntries:
        return {
            "id_encoding": self.encoding,
            "id_width": int(self.gaps.dtype.itemsize),
            "id_exceptions": int(len(self.exc_pos)),
        }


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

    def manifest(self) -> StorageEntries:
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
    qmax = QMAX[dtype]
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
        padded[:, : b.shape[1]] = b
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

    def __init__(self, codes: np.ndarray, scales: np.ndarray, unit: float, dtype: QuantDtype, r: int) -> None:
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

    def manifest(self) -> StorageEntries:
        return {"dtype": self._dtype, "scale_unit": self.unit}


PQ_CENTROIDS = 256
"""Centroids per sub-quantizer of ``dtype="pq"``: one uint8 code each."""


def pq_layout(r: int, pq_dims: int) -> int:
    """Sub-quantizers M of an r-dimensional ``pq`` sketch with ``pq_dims`` dimensions each (ConfigError
    unless pq_dims divides r)."""
    if pq_dims < 1 or r % pq_dims:
        raise ConfigError(
            f"dtype 'pq' splits the r = {r} sketch dimensions into sub-vectors of pq_dims = "
            f"{pq_dims}; choose AttributionConfig.pq_dims dividing {r} (or AttributionConfig.r a multiple of {pq_dims})",
            param=("AttributionConfig.pq_dims", "AttributionConfig.r"),
        )
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
            cb[m, : len(uniq)], cb[m, len(uniq) :] = uniq, uniq[0] if len(uniq) else 0.0
            continue
        try:
            import faiss
        except ImportError as e:
            raise ConfigError(
                "dtype 'pq' trains its codebooks with faiss, which is not installed",
                fix="pip install 'prismlm[search]'",
            ) from e
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
        sub = torch.from_numpy(np.ascontiguousarray(_subvectors(np.asarray(z[a : a + chunk], np.float64), M)))
        dist = c2[None] - 2 * torch.einsum("nmt,mkt->nmk", sub, cb)  # ‖z‖² dropped: the same for every centroid
        out[a : a + chunk] = dist.argmin(-1).numpy().astype(np.uint8)
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

    def manifest(self) -> StorageEntries:
        return {"dtype": "pq", "scale_unit": self.unit, "pq_dims": int(self.codebook.shape[2])}


Ids = PlainIds | DeltaIds
Sketches = FloatSketches | QuantSketches | PQSketches
