"""Postings → stored cache arrays: grouping raw postings by prototype (``to_csr``) and encoding CSR postings
with a config's storage options (``encode_postings``: document sums, pruning, quantisation, PQ), in chunks.

Invariant: every pass reads ``CHUNK`` postings at a time, so memory stays bounded by ~CHUNK × r floats
plus O(P) integers, whatever the number of postings. Formats: docs/architecture.md ("The attribution cache").
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from prismlm.config import AttributionConfig
from prismlm.tda.cache.codecs import (
    FLOAT_DTYPES,
    QMAX,
    SCALE_RANGE,
    DeltaIds,
    FloatSketches,
    Ids,
    PlainIds,
    PQSketches,
    QuantDtype,
    QuantSketches,
    Sketches,
    StorageEntries,
    code_width,
    pq_encode,
    pq_layout,
    pq_train,
    quantise,
)

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet

__all__ = [
    "CHUNK",
    "EncodedEntries",
    "alloc",
    "check_storage",
    "document_of_sequences",
    "encode_postings",
    "prune_keep",
    "to_csr",
]

CHUNK = 1 << 16
"""Postings per chunk of the encoding passes: bounds the memory of every gather to ~CHUNK × r floats."""


class EncodedEntries(StorageEntries, total=False):
    """``encode_postings``' manifest entries: postings before/after aggregation and pruning, the codecs'
    entries, and for PQ the codebooks' training sample."""

    postings_raw: int
    postings_aggregated: int
    pruned: int
    pq_sample: int
    pq_trained_on: int


def document_of_sequences(shards: ShardSet, universe: int, T: int) -> np.ndarray:
    """(universe,) int64: the document of each training sequence j — the one holding its middle target
    token (offset j·T + 1 + (T−1)//2) — ascending in j."""
    offs = np.arange(universe, dtype=np.int64) * T + 1 + (T - 1) // 2
    return np.searchsorted(np.asarray(shards.train.doc_offsets), offs, side="right").astype(np.int64) - 1


def alloc(folder: Path | None, name: str, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """An output array: a memory-mapped ``folder/name`` (.npy) or, without a folder, in memory."""
    if folder is None:
        return np.empty(shape, dtype)
    return np.lib.format.open_memmap(folder / name, mode="w+", dtype=dtype, shape=shape)


def prune_keep(
    norms: np.ndarray, proto: np.ndarray, unit: np.ndarray, K: int, prune: float, prune_by: str = "list"
) -> np.ndarray:
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


def check_storage(config: AttributionConfig, r: int) -> None:
    """Refuse storage options that cannot encode r-dimensional sketches (ConfigError), before any pass."""
    if config.dtype == "pq":
        pq_layout(r, config.pq_dims)


def encode_postings(
    offsets: np.ndarray,
    ids: np.ndarray,
    sketch: np.ndarray,
    K: int,
    r: int,
    config: AttributionConfig,
    *,
    units_of: np.ndarray | None,
    work: Path | None,
    out: Path | None = None,
) -> tuple[np.ndarray, Ids, Sketches, EncodedEntries]:
    """Encode CSR postings (``offsets`` (K+1,), ``ids`` (P,) ascending sequence ids within each list,
    ``sketch`` (P, r) float, memory-mapped or not) with the storage options of ``config`` (``dtype``,
    ``prune``/``prune_by``, ``id_encoding``, ``pq_dims``/``pq_sample``/``seed``); returns (offsets, ids,
    sketches, manifest entries).

    ``units_of`` (universe,): document of each sequence (document aggregation: the sketches of a
    (document, prototype) run are summed in float64), None: sequence postings. Postings are then pruned
    (``prune_keep``) and quantised (``pq``: codebooks trained first on ``pq_sample`` of the kept postings,
    drawn with ``seed``). Two passes over the postings in chunks of
    ``CHUNK`` (run keys and norms are O(P) integers/floats; sketches are streamed); ``work``: a folder
    for the document sums (memory-mapped), None: in memory; ``out``: write the sketch arrays there as
    memory-mapped ``.npy`` files (their final names), None: in memory."""
    P = len(ids)
    run_start, run_proto, run_unit = _runs(offsets, np.asarray(ids, dtype=np.int64), K, units_of)
    R = len(run_start)
    agg: np.ndarray | None = None
    if units_of is not None:
        agg = (
            np.lib.format.open_memmap(work / "agg.npy", mode="w+", dtype=np.float64, shape=(R, r))
            if work is not None
            else np.empty((R, r), np.float64)
        )
    norms, maxabs = _run_norms(sketch, run_start, P, r, agg)
    keep = prune_keep(norms, run_proto, run_unit, K, config.prune, config.prune_by)
    kept = np.flatnonzero(keep)
    out_offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(run_proto[kept], minlength=K), out=out_offsets[1:])
    id_store: Ids = (DeltaIds if config.id_encoding == "delta" else PlainIds).encode(run_unit[kept], out_offsets)
    Pk = len(kept)

    def rows(k: np.ndarray) -> np.ndarray:  # (len(k), r) float64: the kept runs k, summed or as posted
        return agg[k] if agg is not None else np.asarray(sketch[run_start[k]], dtype=np.float64)

    sk_store = _sketch_store(config, r, kept, norms, maxabs, rows, out)
    for a in range(0, Pk, CHUNK):  # pass 2: the kept postings, encoded
        k = kept[a : a + CHUNK]
        _encode_rows(sk_store, a, rows(k), norms[k])
    agg = None  # the memory-mapped sums are closed before their file is removed
    if work is not None:
        (work / "agg.npy").unlink(missing_ok=True)
    meta: EncodedEntries = {
        "postings_raw": P,
        "postings_aggregated": R,
        "pruned": int(R - Pk),
        **id_store.manifest(),
        **sk_store.manifest(),
    }
    if isinstance(sk_store, PQSketches):  # provenance of the codebooks: how many postings they were fitted on
        meta.update({"pq_sample": config.pq_sample, "pq_trained_on": int(min(Pk, config.pq_sample))})
    return out_offsets, id_store, sk_store, meta


def _runs(
    offsets: np.ndarray, ids: np.ndarray, K: int, units_of: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(run_start (R,), run_proto (R,), run_unit (R,)): the first posting, prototype and unit of each
    (prototype, unit) run of the CSR postings (every posting its own run without ``units_of``)."""
    P = len(ids)
    proto = np.repeat(np.arange(K, dtype=np.int64), np.diff(offsets))  # (P,)
    unit = ids if units_of is None else np.asarray(units_of)[ids]  # (P,) ascending within each list
    if units_of is None:
        run_start = np.arange(P, dtype=np.int64)
    else:
        new = np.ones(P, dtype=bool)
        new[1:] = (proto[1:] != proto[:-1]) | (unit[1:] != unit[:-1])
        run_start = np.flatnonzero(new).astype(np.int64)  # (R,) first posting of each (prototype, unit) run
    return run_start, proto[run_start], unit[run_start]


def _run_norms(
    sketch: np.ndarray, run_start: np.ndarray, P: int, r: int, agg: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1, in chunks: (norms (R,), largest |entry| (R,)) of each run's (summed) sketch; the sums go
    to ``agg`` (R, r) when given."""
    R = len(run_start)
    run_end = np.append(run_start[1:], P)
    norms, maxabs = np.empty(R), np.empty(R)
    bounds = list(range(0, R, CHUNK)) + [R]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if a == b:
            continue
        p0, p1 = int(run_start[a]), int(run_end[b - 1])
        x = np.asarray(sketch[p0:p1], dtype=np.float64)
        if agg is not None:
            x = np.add.reduceat(x, run_start[a:b] - p0, axis=0) if len(x) else x
            agg[a:b] = x
        norms[a:b] = np.linalg.norm(x, axis=1)
        maxabs[a:b] = np.abs(x).max(1) if r else 0.0
    return norms, maxabs


def _sketch_store(
    config: AttributionConfig,
    r: int,
    kept: np.ndarray,
    norms: np.ndarray,
    maxabs: np.ndarray,
    rows: typing.Callable[[np.ndarray], np.ndarray],
    out: Path | None,
) -> Sketches:
    """The empty sketch store of ``config.dtype`` for the ``kept`` runs (PQ: its codebooks trained on a
    sample of their ``rows``), allocated under ``out`` or in memory."""
    dtype, Pk = config.dtype, len(kept)
    if dtype in QMAX:
        qdt = typing.cast(QuantDtype, dtype)
        top_scale = float(maxabs[kept].max()) / QMAX[qdt] if Pk else 0.0
        unit_scale = top_scale / SCALE_RANGE if top_scale > 0 else 1.0
        codes = alloc(out, "sketch_codes.npy", (Pk, code_width(qdt, r)), np.int8 if qdt == "int8" else np.uint8)
        scales = alloc(out, "sketch_scale.npy", (Pk,), np.float16)
        return QuantSketches(codes, scales, unit_scale, qdt, r)
    if dtype == "pq":
        M = pq_layout(r, config.pq_dims)
        rng = np.random.default_rng(config.seed)
        ks = kept[np.sort(rng.choice(Pk, min(Pk, config.pq_sample), replace=False))]
        codebook = pq_train(_unit_rows(rows(ks), norms[ks]), M, config.seed)
        top_norm = float(norms[kept].max()) if Pk else 0.0
        unit_scale = top_norm / SCALE_RANGE if top_norm > 0 else 1.0
        return PQSketches(
            alloc(out, "sketch_codes.npy", (Pk, M), np.uint8),
            alloc(out, "sketch_scale.npy", (Pk,), np.float16),
            unit_scale,
            codebook,
        )
    return FloatSketches(alloc(out, "sketch.npy", (Pk, r), FLOAT_DTYPES[dtype]))


def _encode_rows(sk_store: Sketches, a: int, x: np.ndarray, norms: np.ndarray) -> None:
    """Write rows ``x`` (n, r) float64 of norms ``norms`` (n,) into ``sk_store`` from row ``a`` on."""
    n = len(x)
    if isinstance(sk_store, QuantSketches):
        sk_store.codes[a : a + n], sk_store.scales[a : a + n] = quantise(x, sk_store.qdtype, sk_store.unit)
    elif isinstance(sk_store, PQSketches):
        sk_store.codes[a : a + n] = pq_encode(_unit_rows(x, norms), sk_store.codebook)
        sk_store.scales[a : a + n] = (norms / sk_store.unit).astype(np.float16)
    else:
        assert isinstance(sk_store, FloatSketches)
        sk_store.data[a : a + n] = x


def _unit_rows(x: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Rows ``x`` (n, r) divided by their ``norms`` (n,); zero rows stay zero."""
    return np.divide(x, norms[:, None], out=np.zeros_like(x), where=norms[:, None] > 0)


def to_csr(
    seq: np.ndarray,
    proto: np.ndarray,
    sketch: np.ndarray,
    K: int,
    out_dir: Path | None,
    dtype: type[np.floating],
    r: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    step = CHUNK
    for s in range(0, P, step):  # chunks of postings bound the memory of the gather
        o = order[s : s + step]
        seq_o[s : s + step] = seq[o]
        sk_o[s : s + step] = sketch[o]
    return offsets, seq_o, sk_o
