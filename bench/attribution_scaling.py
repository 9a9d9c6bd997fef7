#!/usr/bin/env python
"""Attribution query time vs corpus size: the exact scan of the active prototypes' postings vs approximate
top-M search + exact rescoring (``prismlm.tda.search``, issue 13 item 2).

A compact cache of a real PRISM run (default: the cpu-small run, trained first if missing; ``pca-local`` r = 48,
int4, prune 0.1, delta ids; built once under ``--workdir``) gives the postings. At each corpus size (``--sizes``,
training tokens): the real postings of its first sequences up to the real cache's size, above it synthetic
postings (each synthetic sequence copies all postings of a real one drawn with replacement, sketches plus
Gaussian noise, re-quantised). The same held-out queries at every size: per-query median time of ``exact_top``
and of ``SearchIndex.top``, their top-k overlap, the search index's build time and bytes per token, and the
exponent b of time ≈ a · tokens^b for each. Goal: b ≤ 0.5 for the search with top-10 overlap ≥ ~0.95.

Run: ``PYTHONPATH=src python bench/attribution_scaling.py [--quick]``. Writes
``bench/results/attribution-scaling[-quick].json`` and one summary line; the sampling in detail and the
measurements: docs/results.md (attribution at scale).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict, cast

import numpy as np
import torch
from _common import (
    CPU_SMALL_RUN,
    RESULTS_DIR,
    RUNS_DIR,
    Json,
    ensure_cpu_small_run,
    environment,
    load_average,
    num,
    profile_from_args,
    warn_if_busy,
    write_json,
)

from prismlm import AttributionConfig
from prismlm.app import Run
from prismlm.config import SearchConfig
from prismlm.data.shards import ShardSet, load_shards
from prismlm.model import PrismLM
from prismlm.tda.cache import AttributionCache, DeltaIds, QuantSketches, build_cache, quantise
from prismlm.tda.cache.manifest import CacheManifest
from prismlm.tda.cache.store import exact_top
from prismlm.tda.gradients import BlockGradients
from prismlm.tda.influence import query_gradients
from prismlm.tda.search import SearchIndex, build_search_index
from prismlm.train import load_checkpoint
from prismlm.train.checkpoint import Checkpoint


class Profile(TypedDict):
    sizes: list[float]
    queries: int
    repeats: int
    max_sequences: int


PROFILES: dict[str, Profile] = {
    "default": {"sizes": [1e5, 3e5, 1e6, 3e6, 1e7], "queries": 8, "repeats": 3, "max_sequences": 12288},
    "quick": {"sizes": [3e4, 1e5, 3e5], "queries": 3, "repeats": 3, "max_sequences": 256},
}


def log(msg: str) -> None:
    print(f"[attribution-scaling] {msg}", file=sys.stderr, flush=True)


Index = Any  # an index of faiss, hnswlib or usearch: untyped libraries


def real_cache(args: argparse.Namespace, prof: Profile, work: Path) -> tuple[AttributionCache, Checkpoint, ShardSet]:
    """The real cache (built once under ``work``), the model and the shards."""
    ck = load_checkpoint(ensure_cpu_small_run(args.run))
    sh = load_shards(args.shards) if args.shards else Run.open(args.run, device="cpu").shards()
    cfg = AttributionConfig(
        projection="pca-local",
        r=args.r,
        dtype="int4",
        prune=0.1,
        id_encoding="delta",
        max_sequences=prof["max_sequences"],
    )
    path = work / f"cache-pcalocal{args.r}-int4-p0.1-delta-n{prof['max_sequences'] or 'all'}"
    if args.cache:
        path = Path(args.cache)
    if (path / "manifest.json").exists():
        cache = AttributionCache.load(path, model_sha256=ck.manifest["model_sha256"], shards=sh)
        log(f"reusing the cache {path}")
    else:
        log(f"building the cache {path} (one-off)")
        cache = build_cache(ck.model.eval(), sh, cfg, out=path, model_sha256=ck.manifest["model_sha256"])
    return cache, ck, sh


def sub_cache(real: AttributionCache, units: int) -> AttributionCache:
    """The real postings of sequences < ``units``: same storage (delta ids, int4 codes with the same unit)."""
    ids = np.asarray(real.seq, dtype=np.int64)
    keep = np.flatnonzero(ids < units)
    K = real.num_prototypes
    proto = np.repeat(np.arange(K), np.diff(real.offsets))[keep]
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(proto, minlength=K), out=offsets[1:])
    sk = real.sketches
    assert isinstance(sk, QuantSketches)
    sks = QuantSketches(
        np.ascontiguousarray(sk.codes[keep]), np.ascontiguousarray(sk.scales[keep]), sk.unit, sk.qdtype, sk.r
    )
    m = {
        **real.manifest,
        "units": units,
        "universe": units,
        "tokens": units * int(real.manifest["block_size"]),
        "synthetic": False,
    }
    return AttributionCache(
        offsets=offsets,
        ids=DeltaIds.encode(ids[keep], offsets),
        sketches=sks,
        projection=real.projection,
        curvature=real.curvature,
        manifest=cast(CacheManifest, m),  # the real manifest with this size's counts and a synthetic flag
    )


def synthetic_cache(real: AttributionCache, units: int, noise: float, seed: int) -> AttributionCache:
    """Postings of ``units`` synthetic sequences, each a real sequence resampled (see the module docstring):
    every posting of the source sequence (so the joint structure across prototypes is kept), its sketch plus
    noise, re-quantised. Vectorised over postings; sketches in chunks (bounded memory)."""
    rng = np.random.default_rng(seed)
    K = real.num_prototypes
    sk = real.sketches
    assert isinstance(sk, QuantSketches)
    src = rng.integers(0, real.num_train, size=units)  # (U,) the real sequence each synthetic one copies
    by_src = np.argsort(src, kind="stable")  # synthetic units grouped by source
    count = np.bincount(src, minlength=real.num_train)
    first = np.cumsum(count) - count  # where each source's copies start in by_src
    rid = np.asarray(real.seq, dtype=np.int64)  # (P,) real ids
    rep = count[rid]  # copies of each real posting
    rows = np.repeat(np.arange(len(rid)), rep)  # (P',) source row of each new posting
    k = np.arange(len(rows)) - np.repeat(np.cumsum(rep) - rep, rep)  # which copy
    ids = by_src[np.repeat(first[rid], rep) + k]
    proto = np.repeat(np.arange(K), np.diff(real.offsets))[rows]
    order = np.lexsort((ids, proto))  # CSR: by prototype, ids ascending
    rows, ids, proto = rows[order], ids[order], proto[order]
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(proto, minlength=K), out=offsets[1:])
    P = len(rows)
    codes = np.empty((P, sk.codes.shape[1]), dtype=sk.codes.dtype)
    scales = np.empty(P, dtype=np.float16)
    for a in range(0, P, 1 << 18):
        x = sk.gather(rows[a : a + (1 << 18)])  # (n, r) float64, the real decoded sketches
        x = x + rng.normal(size=x.shape) * (noise * np.sqrt((x**2).mean(1, keepdims=True)))
        codes[a : a + len(x)], scales[a : a + len(x)] = quantise(x, sk.qdtype, sk.unit)
    m = {
        **real.manifest,
        "units": units,
        "universe": units,
        "tokens": units * int(real.manifest["block_size"]),
        "synthetic": True,
    }
    return AttributionCache(
        offsets=offsets,
        ids=DeltaIds.encode(ids, offsets),
        sketches=QuantSketches(codes, scales, sk.unit, sk.qdtype, sk.r),
        projection=real.projection,
        curvature=real.curvature,
        manifest=cast(CacheManifest, m),  # the real manifest with this size's counts and a synthetic flag
    )


def library_comparison(real: AttributionCache, lists: int = 3, queries: int = 20, m: int = 50, seed: int = 0) -> Json:
    """The measurement behind the library choice: on the real decoded sketches of the ``lists`` longest
    lists, top-``m`` inner-product recall (vs an exact matvec) and per-query µs (1 thread, one query per
    call, as ``SearchIndex`` searches) of faiss IVF-SQ8 / IVF-Flat / HNSW, hnswlib and usearch (each when
    installed), plus build seconds. Queries: other postings' sketches of the same list."""
    import faiss

    rng = np.random.default_rng(seed)
    n = np.diff(real.offsets)
    per_list: list[Json] = []
    out: Json = {"lists": per_list, "m": m, "queries_per_list": queries}
    for i in np.argsort(-n)[:lists].tolist():
        a, b = int(real.offsets[i]), int(real.offsets[i + 1])
        X = np.ascontiguousarray(real.sketches.gather(np.arange(a, b)), dtype=np.float32)
        Q = np.ascontiguousarray(X[rng.choice(len(X), queries, replace=False)])
        per_list.append({"prototype": i, "postings": len(X), **_compare_on(faiss, X, Q, m)})
    return out


def _compare_on(faiss: ModuleType, X: np.ndarray, Q: np.ndarray, m: int) -> Json:
    """Build each library's index over ``X`` (n, r) float32 and search the rows of ``Q`` one at a time."""
    truth = np.argsort(-(Q @ X.T), axis=1)[:, :m]
    res: Json = {}

    def run(name: str, build: Callable[[], Index], search: Callable[[Index, np.ndarray], object]) -> None:
        t = time.perf_counter()
        ix = build()
        bt = time.perf_counter() - t
        t = time.perf_counter()
        got = [np.asarray(search(ix, Q[j : j + 1])) for j in range(len(Q))]
        qt = (time.perf_counter() - t) / len(Q)
        rec = float(np.mean([len(set(g.tolist()) & set(tr.tolist())) / m for g, tr in zip(got, truth)]))
        res[name] = {"build_s": round(bt, 3), "query_us": round(qt * 1e6, 1), "recall": round(rec, 3)}

    nl = int(np.ceil(np.sqrt(len(X))))

    def ivf(enc: str) -> Index:
        q = faiss.IndexFlatIP(X.shape[1])
        ix = (
            faiss.IndexIVFScalarQuantizer(q, X.shape[1], nl, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
            if enc == "sq8"
            else faiss.IndexIVFFlat(q, X.shape[1], nl, faiss.METRIC_INNER_PRODUCT)
        )
        ix.cp.min_points_per_centroid = 1
        ix.train(X)
        ix.add(X)
        return ix

    for enc in ("sq8", "flat"):
        for npb in (8, 16):
            run(
                f"faiss-ivf-{enc} nlist={nl} nprobe={npb}",
                partial(ivf, enc),
                partial(_search_ivf, faiss, m, npb),
            )
    for ef in (64, 128):
        run(
            f"faiss-hnsw M=16 ef={ef}",
            lambda: _hnsw(faiss, X),
            partial(_search_hnsw, faiss, m, ef),
        )
    try:
        import hnswlib

        def hb() -> Index:
            h = hnswlib.Index(space="ip", dim=X.shape[1])
            h.init_index(len(X), M=16, ef_construction=100)
            h.set_num_threads(1)
            h.add_items(X)
            h.set_ef(128)
            return h

        run("hnswlib M=16 ef=128", hb, lambda ix, x: ix.knn_query(x, m)[0][0])
    except ImportError:
        pass
    try:
        from usearch.index import Index as UIndex

        def ub() -> Index:
            u = UIndex(ndim=X.shape[1], metric="ip", dtype="f32", connectivity=16)
            u.add(np.arange(len(X)), X, threads=1)
            return u

        run("usearch connectivity=16", ub, lambda ix, x: ix.search(x[0], m, threads=1).keys)
    except ImportError:
        pass
    t = time.perf_counter()
    for j in range(len(Q)):
        np.argpartition(-(X @ Q[j]), m)[:m]
    res["exact matvec + argpartition"] = {
        "build_s": 0.0,
        "query_us": round((time.perf_counter() - t) / len(Q) * 1e6, 1),
        "recall": 1.0,
    }
    return res


def _search_ivf(faiss: ModuleType, m: int, nprobe: int, ix: Index, x: np.ndarray) -> object:
    return ix.search(x, m, params=faiss.SearchParametersIVF(nprobe=nprobe))[1][0]


def _search_hnsw(faiss: ModuleType, m: int, ef: int, ix: Index, x: np.ndarray) -> object:
    return ix.search(x, m, params=faiss.SearchParametersHNSW(efSearch=ef))[1][0]


def _hnsw(faiss: ModuleType, X: np.ndarray) -> Index:
    ix = faiss.IndexHNSWFlat(X.shape[1], 16, faiss.METRIC_INNER_PRODUCT)
    ix.add(X)
    return ix


def fit_exponent(tokens: list[float], times: list[float]) -> dict[str, float]:
    """Least squares of log t = log a + b log N."""
    b, loga = np.polyfit(np.log(tokens), np.log(times), 1)
    return {"b": float(b), "a": float(np.exp(loga))}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="≤ 1 min: a 256-sequence cache, 3 sizes up to 3e5, 3 queries")
    ap.add_argument("--run", default=str(CPU_SMALL_RUN), help="trained PRISM run (default: trained if missing)")
    ap.add_argument("--shards", default="", help="its token shards ('' = the run's)")
    ap.add_argument("--cache", default=None, help="a compact cache of --run to reuse (default: built in --workdir)")
    ap.add_argument("--r", type=int, default=48)
    ap.add_argument("--sizes", type=float, nargs="+", default=None, help="training tokens per size")
    ap.add_argument("--queries", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--m", type=int, default=32, help="candidates per list")
    ap.add_argument("--nprobe", type=int, default=16)
    ap.add_argument("--ef", type=int, default=64)
    ap.add_argument("--kind", choices=["ivf", "hnsw"], default="ivf")
    ap.add_argument(
        "--encoding",
        choices=["cache", "flat", "sq8", "sq4"],
        default="sq8",
        help="IVF vector storage (cache: none, cells over the cache's own postings)",
    )
    ap.add_argument("--min-list", type=int, default=512, help="shorter lists are scanned exactly")
    ap.add_argument("--noise", type=float, default=0.1, help="synthetic sketches: noise / rms of the resampled one")
    ap.add_argument("--no-library", action="store_true", help="skip the library comparison (on in the default profile)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="default bench/runs/attribution-scaling")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def held_out_queries(net: PrismLM, sh: ShardSet, n: int) -> list[BlockGradients]:
    """Block gradients of ``n`` held-out validation windows (32 tokens, as bench/attribution.py)."""
    nv = sh.val.num_sequences(32)
    wins = np.linspace(0, max(0, nv - 1), num=min(n, nv), dtype=int).tolist()
    return [query_gradients(net, [([sh.tokenizer.eot_id] + sh.val.sequence(j, 32).tolist(), 1)]) for j in wins]


def time_queries(
    args: argparse.Namespace, cache: AttributionCache, idx: SearchIndex, qg: list[BlockGradients], repeats: int
) -> tuple[list[float], list[float], list[float]]:
    """Per query: the median seconds of the exact scan and of the search, and their top-k overlap."""
    t_ex, t_ap, ov = [], [], []
    for q in qg:
        exact_top(cache, q, 1, args.k)  # warm the pages
        idx.top(cache, q, 1, args.k, m=args.m, nprobe=args.nprobe, ef=args.ef)
        te, ta = [], []
        for _ in range(repeats):
            a = time.perf_counter()
            _, ei = exact_top(cache, q, 1, args.k)
            b = time.perf_counter()
            _, ai = idx.top(cache, q, 1, args.k, m=args.m, nprobe=args.nprobe, ef=args.ef)
            c = time.perf_counter()
            te.append(b - a)
            ta.append(c - b)
        t_ex.append(statistics.median(te))
        t_ap.append(statistics.median(ta))
        ov.append(len(set(ei[0].tolist()) & set(ai[0].tolist())) / args.k)
    return t_ex, t_ap, ov


def size_row(
    args: argparse.Namespace,
    real: AttributionCache,
    N: float,
    scfg: SearchConfig,
    qg: list[BlockGradients],
    repeats: int,
) -> Json:
    """One corpus size: the (sub or synthetic) cache, its search index, both query times and the overlap."""
    T = int(real.manifest["block_size"])
    units = max(1, int(round(N / T)))
    t0 = time.perf_counter()
    cache = sub_cache(real, units) if units <= real.num_train else synthetic_cache(real, units, args.noise, args.seed)
    t_make = time.perf_counter() - t0
    idx = build_search_index(cache, scfg)
    idx.warm()
    t_ex, t_ap, ov = time_queries(args, cache, idx, qg, repeats)
    row: Json = {
        "tokens": units * T,
        "sequences": units,
        "synthetic": bool(dict(cache.manifest)["synthetic"]),
        "postings": cache.num_postings,
        "postings_bytes_per_token": cache.nbytes() / (units * T),
        "make_seconds": t_make,
        "index_build_seconds": idx.manifest["build_seconds"],
        "index_lists": idx.manifest["lists_indexed"],
        "index_postings": idx.manifest["postings_indexed"],
        "index_bytes": idx.nbytes(),
        "index_bytes_per_token": idx.nbytes() / (units * T),
        "exact_ms": 1e3 * statistics.median(t_ex),
        "approx_ms": 1e3 * statistics.median(t_ap),
        "exact_ms_per_query": [1e3 * t for t in t_ex],
        "approx_ms_per_query": [1e3 * t for t in t_ap],
        "overlap": float(np.mean(ov)),
        "overlap_per_query": ov,
    }
    log(
        f"N={units * T:.2e} ({'synthetic' if row['synthetic'] else 'real'}): {cache.num_postings} postings; "
        f"exact {num(row, 'exact_ms'):.1f} ms, approx {num(row, 'approx_ms'):.1f} ms, top-{args.k} overlap "
        f"{num(row, 'overlap'):.3f}; index {num(row, 'index_build_seconds'):.1f} s, "
        f"{num(row, 'index_bytes_per_token'):.1f} B/token (postings {num(row, 'postings_bytes_per_token'):.1f})"
    )
    return row


def payload_of(
    args: argparse.Namespace,
    prof: Profile,
    scfg: SearchConfig,
    real: AttributionCache,
    rows: list[Json],
    lib: Json | None,
) -> Json:
    synth = (
        "each of the N/T synthetic sequences copies a real sequence drawn uniformly with replacement: all of its "
        f"postings (so list lengths scale with the real frequencies and the joint structure across prototypes "
        f"is kept), each sketch + N(0, ({args.noise} x its rms)^2) noise, re-quantised to int4 with the real "
        "scale unit"
    )
    return {
        "benchmark": "attribution-scaling",
        "profile": "quick" if args.quick else "default",
        "settings": {**prof, **vars(args)},
        "search_config": scfg.to_dict(),
        "real_cache": {
            "path": str(real.path),
            "postings": real.num_postings,
            "tokens": real.manifest["tokens"],
            "bytes_per_token": real.manifest["bytes_per_token"],
            "dtype": real.manifest["dtype"],
            "r": real.r,
            "projection": real.manifest["projection"],
        },
        "synthetic": any(r["synthetic"] for r in rows),
        "synthetic_how": synth,
        "library_choice": f"IVF ({args.encoding}; faiss k-means cells) (prismlm.tda.search; the measurement behind "
        "it: library_comparison and the module docstring)",
        "library_comparison": lib,
        "sizes": rows,
    }


def main() -> None:
    args = parse_args()
    prof = profile_from_args(PROFILES, args)
    tag = "attribution-scaling-quick" if args.quick else "attribution-scaling"
    work = Path(args.workdir) if args.workdir else RUNS_DIR / "attribution-scaling"
    out_path = Path(args.out) if args.out else RESULTS_DIR / f"{tag}.json"
    torch.set_num_threads(args.threads)
    import faiss

    faiss.omp_set_num_threads(args.threads)
    warn_if_busy(args.threads)
    env = environment("cpu", args.seed)
    t_start = time.perf_counter()
    real, ck, sh = real_cache(args, prof, work)
    qg = held_out_queries(ck.model.eval(), sh, prof["queries"])
    log(
        f"real cache: {real.num_postings} postings over {real.num_train} sequences ({real.manifest['tokens']} tokens); "
        f"{len(qg)} queries, {np.mean([q.rows for q in qg]):.0f} active prototypes each"
    )
    lib = None
    if not (args.quick or args.no_library):
        lib = library_comparison(real, seed=args.seed)
        first = lib["lists"][0] if isinstance(lib["lists"], list) else {}
        log(
            "library comparison (top-50 recall, µs/query, build s) on the longest real lists: "
            + "; ".join(
                f"{k}: {v['recall']}/{v['query_us']:.0f}/{v['build_s']}"
                for k, v in first.items()
                if isinstance(v, dict)
            )
        )
    scfg = SearchConfig(kind=args.kind, min_list=args.min_list, encoding=args.encoding)
    rows = [size_row(args, real, N, scfg, qg, prof["repeats"]) for N in sorted(prof["sizes"])]
    tok = [num(r, "tokens") for r in rows]
    fit = {
        "exact": fit_exponent(tok, [num(r, "exact_ms") for r in rows]),
        "approx": fit_exponent(tok, [num(r, "approx_ms") for r in rows]),
    }
    payload = payload_of(args, prof, scfg, real, rows, lib)
    payload.update(
        {
            "fit": fit,
            "environment": env,
            "load_average_end": load_average(),
            "total_seconds": time.perf_counter() - t_start,
        }
    )
    write_json(out_path, payload)
    print(
        f"attribution-scaling: exact b={fit['exact']['b']:.2f}, approx b={fit['approx']['b']:.2f} over "
        f"{tok[0]:.0e}-{tok[-1]:.0e} tokens; top-{args.k} overlap min {min(num(r, 'overlap') for r in rows):.3f}; "
        f"at {tok[-1]:.0e}: exact {num(rows[-1], 'exact_ms'):.0f} ms vs approx {num(rows[-1], 'approx_ms'):.0f} ms, "
        f"index {num(rows[-1], 'index_build_seconds'):.0f} s one-off, "
        f"{num(rows[-1], 'index_bytes_per_token'):.1f} B/token -> {out_path}"
    )


if __name__ == "__main__":
    main()
