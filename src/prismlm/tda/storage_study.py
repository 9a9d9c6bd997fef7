"""Bytes per training token against top-10 overlap for the attribution cache's storage options.

One pass builds a reference cache with the identity projection at r = d in float64 — its scores equal the full
prototype-space method's (tests/test_influence.py, test_cache_store.py) — so "full" costs no second pass. Each
r-dimensional float32 cache is derived from it by projecting the stored whitened gradients (``s_r = R_i s_d``:
what ``build_cache`` with that projection stores; ``pca``/``pca-local`` fitted on the postings of
``pca_sequences`` sequences spread over the corpus: ``fit_ranges``), and every storage variant by
``compress_cache``. Document-level overlaps compare document scores (sums over the document's sequences) with
the full method's document scores. Per-query time: ``cache.scores`` of one query (its forward pass excluded:
common to all variants), median over queries, with the postings it read. Run by ``bench/attribution.py``
(its ``compression`` mode).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from prismlm.artifacts import model_identity
from prismlm.config import AttributionConfig
from prismlm.data.shards import ShardSet
from prismlm.model import PrismLM
from prismlm.tda.cache import (
    AttributionCache,
    FloatSketches,
    build_cache,
    compress_cache,
    document_of_sequences,
    fit_ranges,
    make_projection,
    pca_bases,
    project,
)
from prismlm.tda.evaluation import topk_overlap
from prismlm.tda.gradients import BlockGradients
from prismlm.tda.influence import Curvature, curvature_pass, query_gradients

Row = dict[str, object]
Projection = Literal["identity", "orthogonal", "gaussian", "pca", "pca-local"]
Dtype = Literal["float16", "float32", "float64", "int8", "int4", "int3", "pq"]
PruneBy = Literal["list", "unit"]
Aggregate = Literal["sequence", "document"]
IdEncoding = Literal["int32", "delta"]
Variant = tuple[Aggregate, Dtype, float, PruneBy, IdEncoding]


@dataclass
class StorageStudySettings:
    """What the study compares (the ``comp_*`` options of ``bench/attribution.py``)."""

    max_sequences: int | None = None
    """First N training sequences (None: all)."""
    curvature_sequences: int = 2048
    """Sequences of the curvature pass (shared by every variant)."""
    reuse_reference: bool = False
    """Reuse the reference cache of an earlier run in the work folder (checked against the model and shards)."""
    pca_sequences: int = 2048
    """Sequences the pca / pca-local projections are fitted on (spread out)."""
    projections: tuple[Projection, ...] = ("orthogonal", "pca", "pca-local")
    """Projections; the first gets the whole grid at ``main_rank``."""
    ranks: tuple[int, ...] = (16, 32, 64)
    """Sketch sizes r (those above d are skipped)."""
    main_rank: int = 32
    """The rank that gets the whole grid (others: storage type only)."""
    dtypes: tuple[Dtype, ...] = ("float32", "float16", "int8", "int4")
    prunes: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2)
    aggregates: tuple[Aggregate, ...] = ("sequence", "document")
    prune_by: tuple[PruneBy, ...] = ("list", "unit")
    """Pruning rules (``AttributionConfig.prune_by``) for prune > 0."""
    seed: int = 0
    """Seed of the random projections."""


def _doc_sum(S: np.ndarray, docs: np.ndarray, D: int) -> np.ndarray:
    """(Q, N) sequence scores → (Q, D) document scores (sums over each document's sequences)."""
    out = np.zeros((S.shape[0], D))
    np.add.at(out, (slice(None), docs), S)  # type: ignore[arg-type]  # numpy stubs: no slice in an index tuple
    return out


def _single_queries(qg: BlockGradients, Q: int) -> list[BlockGradients]:
    """One BlockGradients per query (its rows, query id 0): what a single `attribute` call scores."""
    out = []
    for q in range(Q):
        sel = qg.seq == q
        out.append(BlockGradients(torch.zeros(int(sel.sum()), dtype=torch.long), qg.proto[sel], qg.grad[sel]))
    return out


@dataclass
class _Reference:
    cache: AttributionCache
    curvature: Curvature
    build_s: float
    curvature_s: float | None


def _reference(
    net: PrismLM, shards: ShardSet, N: int, s: StorageStudySettings, work: Path, log: Callable[[str], None]
) -> _Reference:
    """The identity float64 reference cache (reused from ``work`` when asked and present)."""
    ref_dir = work / f"compression-ref-n{N}-c{s.curvature_sequences}"
    if s.reuse_reference and (ref_dir / "manifest.json").exists():  # same model, shards and curvature
        ref = AttributionCache.load(ref_dir, model_sha256=model_identity(net), shards=shards)
        curv, t_curv, t_ref = ref.curvature, None, float(ref.manifest["postings_seconds"])
    else:
        t0 = time.perf_counter()
        curv = curvature_pass(net, shards, sequences=(0, min(N, s.curvature_sequences)), batch_size=16)
        t_curv = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = build_cache(
            net,
            shards,
            AttributionConfig(projection="identity", dtype="float64", max_sequences=N),
            curvature=curv,
            out=ref_dir,
        )
        t_ref = time.perf_counter() - t0
    d = net.config.n_embd
    log(
        f"reference cache (r = d = {d}, float64): {ref.num_postings:,} postings over {N:,} sequences "
        f"({ref.manifest['tokens']:,} tokens) in {t_ref:.0f}s"
        + (
            " (reused)"
            if t_curv is None
            else f" (+ curvature {t_curv:.0f}s on {min(N, s.curvature_sequences)} sequences)"
        )
    )
    return _Reference(ref, curv, t_ref, t_curv)


def _pca_moments(
    ref: AttributionCache, N: int, d: int, s: StorageStudySettings
) -> tuple[torch.Tensor, np.ndarray, np.ndarray, float]:
    """Per-prototype second moments (K, d, d) of the whitened gradients of ``pca_sequences`` sequences spread
    over the corpus (what build_cache's fitting pass accumulates, same sequences), their counts, each
    posting's prototype, and the seconds taken."""
    assert isinstance(ref.sketches, FloatSketches)  # the reference: identity float64
    x = ref.sketches.data  # (P, d) float64 memmap: H_i^{-1/2} G_{j,i}
    K = ref.num_prototypes
    proto_all = np.repeat(np.arange(K), np.diff(ref.offsets))
    in_fit = np.zeros(N, dtype=bool)
    for a0, a1 in fit_ranges(N, s.pca_sequences, 16):
        in_fit[a0:a1] = True
    fit = np.flatnonzero(in_fit[np.asarray(ref.seq)])
    C = torch.zeros(K, d, d, dtype=torch.float64)
    t0 = time.perf_counter()
    if {"pca", "pca-local"} & set(s.projections):
        for a in range(0, len(fit), 512):
            w = torch.from_numpy(np.array(x[fit[a : a + 512]], dtype=np.float64))
            C.index_add_(0, torch.from_numpy(proto_all[fit[a : a + 512]]), w[:, :, None] * w[:, None, :])
    count = np.bincount(proto_all[fit], minlength=K)
    return C, count, proto_all, time.perf_counter() - t0


def _projected(
    ref: AttributionCache, curv: Curvature, R: np.ndarray, proto_all: np.ndarray, r: int, proj: str
) -> AttributionCache:
    """The float32 cache of sketches ``s_r = R_i s_d`` (as build_cache stores them) derived from the reference."""
    assert isinstance(ref.sketches, FloatSketches)
    x, P = ref.sketches.data, ref.num_postings
    sk = np.empty((P, r), np.float32)
    Rt = torch.from_numpy(R)
    for a in range(0, P, 1 << 16):
        sk[a : a + (1 << 16)] = project(
            torch.from_numpy(np.array(x[a : a + (1 << 16)], dtype=np.float64)),
            torch.from_numpy(proto_all[a : a + (1 << 16)]),
            Rt,
        ).numpy()
    return AttributionCache(
        offsets=ref.offsets,
        ids=ref.ids,
        sketches=FloatSketches(sk),
        projection=R,
        curvature=curv,
        manifest={**ref.manifest, "r": r, "projection": proj, "dtype": "float32"},
    )


def _variants(s: StorageStudySettings, main_axis: bool) -> list[Variant]:
    """(aggregate, dtype, prune, prune_by, id encoding) of every variant of one (r, projection); off the main
    axis, the storage type only."""
    one: tuple[PruneBy, ...] = ("list",)
    both: tuple[IdEncoding, ...] = ("int32", "delta")
    delta: tuple[IdEncoding, ...] = ("delta",)
    return [
        (agg, dt, prune, by, ids)
        for agg in s.aggregates
        for dt in s.dtypes
        for prune in s.prunes
        for by in (s.prune_by if prune > 0 else one)
        for ids in (both if (dt == "float32" and prune == 0 and agg == "sequence") else delta)
        if main_axis or (prune == 0 and agg == "sequence")
    ]


class _Measure:
    """Scores of a cache, one query at a time as ``prism attribute`` answers it, with each query's time (ms)
    and postings read; every measured variant's timings are kept in ``per_query``."""

    def __init__(self, singles: list[BlockGradients]) -> None:
        self.singles = singles
        self.per_query: dict[str, dict[str, list[float] | list[int]]] = {}

    def __call__(self, c: AttributionCache, name: str) -> tuple[np.ndarray, list[float], list[int]]:
        S = np.zeros((len(self.singles), c.num_train))
        ms: list[float] = []
        nread: list[int] = []
        for q, sq in enumerate(self.singles):
            t = time.perf_counter()
            S[q] = c.scores(sq, 1)[0].numpy()
            ms.append((time.perf_counter() - t) * 1e3)
            protos = sq.proto.numpy()
            nread.append(int((c.offsets[protos + 1] - c.offsets[protos]).sum()))
        self.per_query[name] = {"ms": ms, "postings_read": nread}
        return S, ms, nread


def _variant_row(
    name: str,
    c: AttributionCache,
    variant: Variant,
    r: int,
    proj: Projection,
    S: np.ndarray,
    refs: tuple[np.ndarray, np.ndarray],
    timing: tuple[list[float], list[int], float],
    P: int,
) -> Row:
    """One variant's record: its size, its overlaps with the full method (``refs[0]``) and with its float32
    cache (``refs[1]``), its per-query time."""
    agg, dt, prune, by, ids = variant
    ms, nread, t_enc = timing
    m = c.manifest
    return {
        "name": name,
        "r": r,
        "projection": proj,
        "dtype": dt,
        "prune": prune,
        "prune_by": by,
        "aggregate": agg,
        "id_encoding": ids,
        "postings": m["postings"],
        "postings_per_token": m["postings"] / m["tokens"],
        "kept_of_sequence_postings": m["postings"] / max(1, P),
        "pruned": m.get("pruned", 0),
        "bytes_per_token": m["bytes_per_token"],
        "bytes_per_posting": m["bytes_postings"] / max(1, m["postings"]),
        "id_bytes_per_posting": c.ids.nbytes / max(1, m["postings"]),
        "top10_vs_full": topk_overlap(S, refs[0], 10),
        "top10_vs_fp32": topk_overlap(S, refs[1], 10),
        "top100_vs_full": topk_overlap(S, refs[0], 100),
        "per_query_ms_median": statistics.median(ms),
        "postings_read_median": statistics.median(nread),
        "encode_s": t_enc,
    }


def _summarise(rows: list[Row], per_query: dict[str, dict[str, list[float] | list[int]]], main_rank: int) -> Row:
    """Per-query time against postings read (a least-squares line per storage type at the main rank) and the
    best variants at ≤ 32 bytes per token (per training sequence, and per document)."""
    fits = {}
    for row in rows:
        if row["prune"] == 0 and row["aggregate"] == "sequence" and row["r"] == main_rank:
            pq = per_query[str(row["name"])]
            b, a = np.polyfit(np.asarray(pq["postings_read"], float), np.asarray(pq["ms"]), 1)
            fits[str(row["name"])] = {"ms_intercept": float(a), "ns_per_posting": float(b * 1e6)}

    def best(aggregate: str) -> Row | None:
        ok = [r for r in rows if _f(r["bytes_per_token"]) <= 32 and r["aggregate"] == aggregate]
        return max(ok, key=lambda r: _f(r["top10_vs_full"])) if ok else None

    return {
        "time_vs_postings": fits,
        "best_at_32_bytes": best("sequence"),
        "best_at_32_bytes_documents": best("document"),
    }


def _f(x: object) -> float:
    assert isinstance(x, int | float), x
    return float(x)


def _variant_rows(
    s: StorageStudySettings,
    shards: ShardSet,
    base: AttributionCache,
    at: tuple[int, Projection, bool],
    sc: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    measure: _Measure,
    P: int,
    log: Callable[[str], None],
) -> list[Row]:
    """Every storage variant of one (r, projection) float32 cache ``base``, compressed and measured; ``sc``: the
    full method's and the base's sequence scores, then their document scores."""
    r, proj, main_axis = at
    rows: list[Row] = []
    for variant in _variants(s, main_axis):
        agg, dt, prune, by, ids = variant
        cfg = AttributionConfig(
            r=r,
            projection=proj,
            dtype=dt,
            prune=prune,
            prune_by=by,
            aggregate=agg,
            id_encoding=ids,
        )
        t = time.perf_counter()
        c = compress_cache(base, cfg, shards=shards)
        t_enc = time.perf_counter() - t
        name = f"r{r}-{proj}-{dt}-p{prune:g}{'' if by == 'list' else '-unit'}-{agg}-{ids}"
        S, ms, nread = measure(c, name)
        refs = (sc[2], sc[3]) if agg == "document" else (sc[0], sc[1])
        row = _variant_row(name, c, variant, r, proj, S, refs, (ms, nread, t_enc), P)
        rows.append(row)
        log(
            f"{name}: {_f(row['bytes_per_token']):.1f} B/token, top-10 vs full {_f(row['top10_vs_full']):.2f}, "
            f"vs fp32 {_f(row['top10_vs_fp32']):.2f}, {_f(row['per_query_ms_median']):.1f} ms/query"
        )
        del c
    return rows


def storage_study(
    net: PrismLM,
    shards: ShardSet,
    queries: list[tuple[list[int], int]],
    s: StorageStudySettings,
    work: Path,
    log: Callable[[str], None] = lambda _: None,
) -> Row:
    """The study (see the module docstring) on ``net``'s first N training sequences and ``queries``: the
    reference, one row per variant, the time-vs-postings fits, the best variants at ≤ 32 bytes per token."""
    T, d = net.config.block_size, net.config.n_embd
    N = shards.train.num_sequences(T)
    if s.max_sequences:
        N = min(N, s.max_sequences)
    Q = len(queries)
    ref = _reference(net, shards, N, s, work, log)
    qg = query_gradients(net, queries)
    measure = _Measure(_single_queries(qg, Q))
    S_full = ref.cache.scores(qg, Q).numpy()
    docs = document_of_sequences(shards, N, T)
    D = int(docs[-1]) + 1
    S_full_doc = _doc_sum(S_full, docs, D)
    P = ref.cache.num_postings
    C, count, proto_all, t_fit = _pca_moments(ref.cache, N, d, s)
    rows: list[Row] = []
    for proj in s.projections:
        for r in s.ranks:
            if r > d:
                continue
            R = (
                pca_bases(C.sum(0).numpy(), r)
                if proj == "pca"
                else pca_bases(C.numpy(), r, count)
                if proj == "pca-local"
                else make_projection(d, r, proj, s.seed)
            )  # (r, d) or (K, r, d)
            base = _projected(ref.cache, ref.curvature, R, proto_all, r, proj)
            S_base = base.scores(qg, Q).numpy()
            S_base_doc = _doc_sum(S_base, docs, D)
            main_axis = r == s.main_rank and proj == s.projections[0]
            sc = (S_full, S_base, S_full_doc, S_base_doc)
            rows += _variant_rows(s, shards, base, (r, proj, main_axis), sc, measure, P, log)
            del base
            gc.collect()
    summary = _summarise(rows, measure.per_query, s.main_rank)
    return {
        "num_train": N,
        "tokens": int(ref.cache.manifest["tokens"]),
        "documents": D,
        "queries": Q,
        "reference": {
            "r": d,
            "dtype": "float64",
            "projection": "identity",
            "postings": P,
            "postings_per_token": P / ref.cache.manifest["tokens"],
            "build_s": ref.build_s,
            "curvature_s": ref.curvature_s,
            "curvature_sequences": min(N, s.curvature_sequences),
            "pca_sequences": min(N, s.pca_sequences),
            "pca_fit_s": t_fit,
        },
        "compression": rows,
        "time_vs_postings": summary["time_vs_postings"],
        "per_query": measure.per_query,
        "best_at_32_bytes": summary["best_at_32_bytes"],
        "best_at_32_bytes_documents": summary["best_at_32_bytes_documents"],
    }
