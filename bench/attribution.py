#!/usr/bin/env python
"""Training-data attribution: prototype-space influence (full and cached) vs kronfluence EK-FAC / identity.

One process, one model, one training set, one query set for every method (spec §3.2; paper: cached
attribution ~470× faster than EK-FAC per query, keeping ~80% of the full method's top-ranked sequences).

Setup
    A planted-fact corpus (``prismlm.tda.planted``): background documents of the built-in corpus
    plus ``--facts`` made-up facts, each in ``--copies`` short documents, and two distractor facts per
    fact (same entity / other relation; same relation / other entity). Queries are paraphrases + the
    answer with only the answer's tokens measured (2 per fact), plus ``--val-queries`` held-out
    validation windows (all tokens measured). A PRISM model (``--preset`` with ``--set`` overrides) is
    trained on it with ``prismlm.train.train``; corpus, shards and model are cached under ``--workdir``.

Methods
    ``full``: exact block gradients, shared block curvature H_i = m_i F + λ_i I; ``full-exact``: exact
    diagonal blocks; ``proto-dot``: block gradients with H_i = I; ``cached-r{R}``: the postings cache with
    an r-dim orthogonal (``-gauss``: Gaussian JL; ``-pca``: top-r principal directions of the whitened
    gradients) sketch; ``cached-compact``: the app's compact recipe, pca-local, r = min(40, d), pq, delta ids; ``-rec``
    suffix: the curvature plus the reconstruction term's diagonal blocks (λ_rec of the recipe);
    ``ekfac``, ``kf-identity``: kronfluence over every ``nn.Linear`` (damping: kronfluence's 0.1 × mean
    eigenvalue heuristic, the same relative ρ = 0.1 as ours); ``wn-dot``: gradient dot products over every
    parameter; ``trak``: TRAK (traker, dense projector, one checkpoint); ``hybrid-{wn-dot,ekfac}-m{M}``: the
    compact cache's top-M candidates re-scored by that whole-network score (``hybrid_scores``: the rest kept
    below them, in the cached order), ``-sum`` suffix: the same candidates with the rest left at their
    calibrated cached score, unshifted (``keep_order=False``: the scores subset sums should read), with the
    per-query cost of computing it on the M candidates only (``--timing-queries`` queries); ``bergson``
    (with ``--bergson PYTHON``): EleutherAI's bergson gradient index, run from its own venv.

What is measured
    - costs at ≥ 3 training-set sizes (prefixes of the training sequences): one-off time (curvature +
      postings / gradients / factors), per-query time (median over queries; kronfluence: one batch of all
      queries ÷ queries, and one single-query call), peak RSS of each phase, cache bytes per training token;
      per-query speed-up of cached vs EK-FAC;
    - agreement: top-10 / top-100 overlap of every method with ``full`` (and with ``ekfac``);
    - planted facts: recall@10 (a relevant sequence in the top 10), share@10 and MRR per method;
    - LDS: ``--lds-subsets`` random half subsets × ``--lds-seeds`` seeds retrained with the same recipe
      (models and per-query losses cached under ``--workdir/lds``); per query, Spearman between
      −Σ_{j∈S} score(q, j) and the seed-averaged retrained loss; mean over queries with a 95% bootstrap CI.

How to read it
    Timings on a shared CPU are noisy (see ``load_average_*``); ratios were taken in the same
    conditions. Overlap with ``full`` measures agreement, not correctness; planted-fact retrieval and
    LDS are the ground truth. Results: JSON at ``--out`` and one summary line on stdout.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import (
    RESULTS_DIR,
    RUNS_DIR,
    current_peak_rss_mib,
    environment,
    load_average,
    parse_sets,
    profile_from_args,
    reset_peak_rss,
    warn_if_busy,
    write_json,
)

from prismlm.config import AttributionConfig, RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.tda.baselines import KronfluenceBaseline, TrakBaseline, WholeNetworkGradients, hybrid_scores
from prismlm.tda.cache import build_cache
from prismlm.tda.influence import FullGradients, curvature_pass, query_gradients
from prismlm.tda.planted import build_planted_corpus, relevant_sequences, retrieval_metrics
from prismlm.train import load_checkpoint, train

# Why these sizes: "default" aims at the ≤ 30 min budget on 2 idle cores with 1 thread (d=64, 2 layers,
# K=128, ~2.4k training sequences of 64 tokens; measured under load: ~4 min without LDS, and each of the
# 64 LDS models ~16–20 s at 300 steps); "quick" is a smoke run of ~2 minutes.
PROFILES: dict[str, dict[str, Any]] = {
    "default": dict(
        background=160,
        doc_chars=2000,
        facts=8,
        copies=3,
        steps=300,
        batch=16,
        val_queries=40,
        lds_subsets=64,
        lds_seeds=2,
        ranks=[4, 8, 16, 32, 64],
        fractions=[0.25, 0.5, 1.0],
    ),
    "quick": dict(
        background=40,
        doc_chars=1500,
        facts=4,
        copies=2,
        steps=150,
        batch=8,
        val_queries=8,
        lds_subsets=8,
        lds_seeds=2,
        ranks=[4, 16, 64],
        fractions=[0.25, 0.5, 1.0],
    ),
}
MODEL_SETS = {
    "model.n_embd": 64,
    "model.prototypes.num_prototypes": 128,
    "model.prototypes.top_k": 4,
    "train.eval_interval": 100000,
    "train.eval_batches": 1,
    "train.log_interval": 100000,
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ----- data and model ---------------------------------------------------------------------------------
class _SubsetShard:
    """A training shard restricted to selected sequence ids (the trainer samples from it unchanged)."""

    def __init__(self, shard: Any, ids: np.ndarray, T: int):
        self.shard, self.ids, self.T = shard, np.asarray(ids, dtype=np.int64), T

    def num_sequences(self, seq_len: int) -> int:
        return len(self.ids)

    def sequences(self, js: np.ndarray, seq_len: int) -> np.ndarray:
        return self.shard.sequences(self.ids[np.asarray(js, dtype=np.int64)], seq_len)

    def __len__(self) -> int:
        return len(self.ids) * self.T + 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shard, name)


class _SubsetShards:
    def __init__(self, shards: Any, ids: np.ndarray, T: int):
        self.train = _SubsetShard(shards.train, ids, T)
        self.val, self.tokenizer, self.root = shards.val, shards.tokenizer, shards.root
        self.manifest = {**shards.manifest, "key": shards.manifest["key"] + "-subset"}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    def rank(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # average ranks of ties
            m = x == v
            if m.sum() > 1:
                r[m] = r[m].mean()
        return r

    ra, rb = rank(a), rank(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def bootstrap_ci(x: np.ndarray, n: int = 2000, seed: int = 0) -> list[float]:
    x = x[~np.isnan(x)]
    if len(x) == 0:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = rng.choice(x, size=(n, len(x)), replace=True).mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    vals = []
    for q in range(a.shape[0]):
        ta = set(np.argsort(-a[q], kind="stable")[:k].tolist())
        tb = set(np.argsort(-b[q], kind="stable")[:k].tolist())
        vals.append(len(ta & tb) / k)
    return float(np.mean(vals))


def timed(fn, *a, **kw):
    reset_peak_rss()
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0, current_peak_rss_mib()


# ----- compression study (issue 13, items 1–2) -----------------------------------------------------------
def _doc_sum(S: np.ndarray, docs: np.ndarray, D: int) -> np.ndarray:
    """(Q, N) sequence scores → (Q, D) document scores (sums over each document's sequences)."""
    out = np.zeros((S.shape[0], D))
    np.add.at(out, (slice(None), docs), S)
    return out


def _single_queries(qg: Any, Q: int) -> list[Any]:
    """One BlockGradients per query (its rows, query id 0): what a single `attribute` call scores."""
    from prismlm.tda.gradients import BlockGradients

    out = []
    for q in range(Q):
        sel = qg.seq == q
        out.append(BlockGradients(torch.zeros(int(sel.sum()), dtype=torch.long), qg.proto[sel], qg.grad[sel]))
    return out


def compression_study(net: Any, shards: Any, queries: list, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Bytes per training token against top-10 overlap for the cache's storage options.

    One pass builds a reference cache with the identity projection at r = d in float64 — its scores equal
    the full prototype-space method's (tests/test_influence.py, test_cache_store.py) — so "full" costs no
    second pass. Each r-dimensional float32 cache is derived from it by projecting the stored whitened
    gradients (``s_r = R_i s_d``: what ``build_cache`` with that projection stores; ``pca``/``pca-local``
    fitted on the postings of ``--pca-sequences`` sequences spread over the corpus: ``fit_ranges``), and every
    storage variant
    by ``compress_cache`` (delta ids). Document-level overlaps compare document scores (sums over the
    document's sequences) with the full method's document scores. Per-query time: ``cache.scores`` of one
    query (its forward pass excluded: common to all variants), median over queries, with the postings it
    read."""
    from prismlm.artifacts import model_identity
    from prismlm.tda.cache import (
        AttributionCache,
        FloatSketches,
        compress_cache,
        document_of_sequences,
        fit_ranges,
        make_projection,
        pca_bases,
        project,
    )

    T, d = net.config.block_size, net.config.n_embd
    N = shards.train.num_sequences(T)
    if args.max_sequences:
        N = min(N, args.max_sequences)
    Q = len(queries)
    ref_dir = work / f"compression-ref-n{N}-c{args.curvature_sequences}"
    if args.reuse_reference and (ref_dir / "manifest.json").exists():  # same model, shards and curvature
        ref = AttributionCache.load(ref_dir, model_sha256=model_identity(net), shards=shards)
        curv, t_curv, t_ref = ref.curvature, None, float(ref.manifest["postings_seconds"])
    else:
        t0 = time.perf_counter()
        curv = curvature_pass(net, shards, sequences=(0, min(N, args.curvature_sequences)), batch_size=16)
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
    log(
        f"reference cache (r = d = {d}, float64): {ref.num_postings:,} postings over {N:,} sequences "
        f"({ref.manifest['tokens']:,} tokens) in {t_ref:.0f}s"
        + (
            " (reused)"
            if t_curv is None
            else f" (+ curvature {t_curv:.0f}s on {min(N, args.curvature_sequences)} sequences)"
        )
    )
    qg = query_gradients(net, queries)
    singles = _single_queries(qg, Q)
    S_full = ref.scores(qg, Q).numpy()
    docs = document_of_sequences(shards, N, T)
    D = int(docs[-1]) + 1
    S_full_doc = _doc_sum(S_full, docs, D)
    x = ref.sketches.data  # (P, d) float64 memmap: H_i^{-1/2} G_{j,i}
    P = ref.num_postings
    # pca / pca-local: second moments of the whitened gradients of --pca-sequences sequences spread over
    # the corpus (what build_cache's fitting pass accumulates, same sequences), per prototype
    K = ref.num_prototypes
    proto_all = np.repeat(np.arange(K), np.diff(ref.offsets))
    in_fit = np.zeros(N, dtype=bool)
    for a0, a1 in fit_ranges(N, args.pca_sequences, 16):
        in_fit[a0:a1] = True
    fit = np.flatnonzero(in_fit[np.asarray(ref.seq)])
    C = torch.zeros(K, d, d, dtype=torch.float64)
    t0 = time.perf_counter()
    if {"pca", "pca-local"} & set(args.comp_projections):
        for a in range(0, len(fit), 512):
            w = torch.from_numpy(np.array(x[fit[a : a + 512]], dtype=np.float64))
            C.index_add_(0, torch.from_numpy(proto_all[fit[a : a + 512]]), w[:, :, None] * w[:, None, :])
    count = np.bincount(proto_all[fit], minlength=K)
    t_fit = time.perf_counter() - t0
    rows_out, per_query = [], {}

    def measure(c: AttributionCache, name: str) -> tuple[np.ndarray, list[float], list[int]]:
        S = np.zeros((Q, c.num_train))
        ms, nread = [], []
        for q, sq in enumerate(singles):  # one query at a time, as `prism attribute` answers it
            t = time.perf_counter()
            S[q] = c.scores(sq, 1)[0].numpy()
            ms.append((time.perf_counter() - t) * 1e3)
            protos = sq.proto.numpy()
            nread.append(int((c.offsets[protos + 1] - c.offsets[protos]).sum()))
        per_query[name] = {"ms": ms, "postings_read": nread}
        return S, ms, nread

    for proj in args.comp_projections:
        for r in args.comp_ranks:
            if r > d:
                continue
            R = (
                pca_bases(C.sum(0).numpy(), r)
                if proj == "pca"
                else pca_bases(C.numpy(), r, count)
                if proj == "pca-local"
                else make_projection(d, r, proj, args.seed)
            )  # (r, d) or (K, r, d)
            sk = np.empty((P, r), np.float32)
            Rt = torch.from_numpy(R)
            for a in range(0, P, 1 << 16):  # s_r = R_i s_d, as build_cache stores it
                sk[a : a + (1 << 16)] = project(
                    torch.from_numpy(np.array(x[a : a + (1 << 16)], dtype=np.float64)),
                    torch.from_numpy(proto_all[a : a + (1 << 16)]),
                    Rt,
                ).numpy()
            base = AttributionCache(
                offsets=ref.offsets,
                ids=ref.ids,
                sketches=FloatSketches(sk),
                projection=R,
                curvature=curv,
                manifest={**ref.manifest, "r": r, "projection": proj, "dtype": "float32"},
            )
            S_base = base.scores(qg, Q).numpy()
            S_base_doc = _doc_sum(S_base, docs, D)
            main_axis = r == args.comp_main_rank and proj == args.comp_projections[0]
            variants = [
                (agg, dt, prune, by, ids)
                for agg in args.comp_aggregates
                for dt in args.comp_dtypes
                for prune in args.comp_prunes
                for by in (args.comp_prune_by if prune > 0 else ["list"])
                for ids in (
                    ("int32", "delta") if (dt == "float32" and prune == 0 and agg == "sequence") else ("delta",)
                )
                if main_axis or (prune == 0 and agg == "sequence")
            ]  # other r/projections: dtype only
            for agg, dt, prune, by, ids in variants:
                cfg = AttributionConfig(
                    r=r,
                    projection=proj,
                    dtype=dt,
                    prune=prune,
                    prune_by=by,  # type: ignore[arg-type]
                    aggregate=agg,
                    id_encoding=ids,
                )
                t = time.perf_counter()
                c = compress_cache(base, cfg, shards=shards)
                t_enc = time.perf_counter() - t
                name = f"r{r}-{proj}-{dt}-p{prune:g}{'' if by == 'list' else '-unit'}-{agg}-{ids}"
                S, ms, nread = measure(c, name)
                S_ref, S_fp32 = (S_full_doc, S_base_doc) if agg == "document" else (S_full, S_base)
                m = c.manifest
                row = {
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
                    "top10_vs_full": overlap(S, S_ref, 10),
                    "top10_vs_fp32": overlap(S, S_fp32, 10),
                    "top100_vs_full": overlap(S, S_ref, 100),
                    "per_query_ms_median": statistics.median(ms),
                    "postings_read_median": statistics.median(nread),
                    "encode_s": t_enc,
                }
                rows_out.append(row)
                log(
                    f"{name}: {row['bytes_per_token']:.1f} B/token, top-10 vs full {row['top10_vs_full']:.2f}, "
                    f"vs fp32 {row['top10_vs_fp32']:.2f}, {row['per_query_ms_median']:.1f} ms/query"
                )
                del c
            del base, sk
            gc.collect()
    # per-query time against postings read: a least-squares line per storage type at the main rank
    fits = {}
    for row in rows_out:
        if row["prune"] == 0 and row["aggregate"] == "sequence" and row["r"] == args.comp_main_rank:
            pq = per_query[row["name"]]
            b, a = np.polyfit(np.asarray(pq["postings_read"], float), np.asarray(pq["ms"]), 1)
            fits[row["name"]] = {"ms_intercept": float(a), "ns_per_posting": float(b * 1e6)}
    # the goal is per training sequence; document rows rank documents (their overlap is between document scores)
    ok = [r for r in rows_out if r["bytes_per_token"] <= 32 and r["aggregate"] == "sequence"]
    best = max(ok, key=lambda r: r["top10_vs_full"]) if ok else None
    ok_doc = [r for r in rows_out if r["bytes_per_token"] <= 32 and r["aggregate"] == "document"]
    best_doc = max(ok_doc, key=lambda r: r["top10_vs_full"]) if ok_doc else None
    return {
        "num_train": N,
        "tokens": int(ref.manifest["tokens"]),
        "documents": D,
        "queries": Q,
        "reference": {
            "r": d,
            "dtype": "float64",
            "projection": "identity",
            "postings": P,
            "postings_per_token": P / ref.manifest["tokens"],
            "build_s": t_ref,
            "curvature_s": t_curv,
            "curvature_sequences": min(N, args.curvature_sequences),
            "pca_sequences": min(N, args.pca_sequences),
            "pca_fit_s": t_fit,
        },
        "compression": rows_out,
        "time_vs_postings": fits,
        "per_query": per_query,
        "best_at_32_bytes": best,
        "best_at_32_bytes_documents": best_doc,
    }


def _compression_summary(study: dict[str, Any], out_path: Path) -> str:
    parts = [f"compression n={study['num_train']} ({study['tokens']:,} tokens, {study['queries']} queries)"]
    main = study["compression"][0]["projection"] if study["compression"] else None
    for r in study["compression"]:
        if (
            r["prune"] == 0
            and r["aggregate"] == "sequence"
            and r["projection"] == main
            and r["id_encoding"] == ("int32" if r["dtype"] == "float32" else "delta")
        ):
            parts.append(
                f"{main} r{r['r']} {r['dtype']} {r['bytes_per_token']:.0f} B/tok top10 full {r['top10_vs_full']:.2f}"
                f" fp32 {r['top10_vs_fp32']:.2f}"
            )
    b = study["best_at_32_bytes"]
    parts.append(
        "best <= 32 B/token: "
        + (f"{b['name']} {b['bytes_per_token']:.1f} B/tok top10 vs full {b['top10_vs_full']:.2f}" if b else "none")
    )
    return "; ".join(parts) + f" → {out_path}"


# ----- bergson (optional, its own venv) ---------------------------------------------------------------------
def _bergson_scores(
    args: argparse.Namespace, run_dir: Path, shards: Any, queries: list, N: int, T: int, work: Path
) -> np.ndarray:
    """(Q, N) bergson scores under ``--bergson`` (``bench/_bergson.py``)."""
    from _bergson import bergson_scores

    return bergson_scores(
        args.bergson, run_dir, shards, queries, N, T, work / "bergson", proj_dim=args.bergson_proj_dim
    )


# ----- summary (issue 13) -------------------------------------------------------------------------------
def _rec_ratio(c: Any) -> float | None:
    """Mean over prototypes seen in the statistics of trace(REC block) / trace(CE Gauss–Newton block)."""
    if c.rec is None:
        return None
    seen = c.m > 0
    ce = c.m[seen] * float(torch.diagonal(c.F).sum())
    return float((c.rec[seen] * c.F.shape[0] / ce.clamp_min(1e-300)).mean())


def _find_key(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


def _external(name: str, key: str) -> dict[str, Any]:
    """A headline number from another bench's JSON, with the file and its git revision (and whether the
    working tree differs from it), or null and why."""
    import subprocess

    path = RESULTS_DIR / name
    rec: dict[str, Any] = {"source": f"bench/results/{name}", "value": None}
    if not path.exists():
        rec["note"] = f"{rec['source']} absent when this bench ran"
        return rec
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        rec["note"] = f"unreadable: {e}"
        return rec
    rec["value"], rec["field"] = _find_key(data, key), key
    fit = data.get("fit") if isinstance(data, dict) else None
    if rec["value"] is None and key == "query_time_exponent" and isinstance(fit, dict) and "approx" in fit:
        # bench/attribution_scaling.py: time ≈ a · tokens^b fitted for the approximate search and the exact scan
        rec["value"], rec["field"] = fit["approx"].get("b"), "fit.approx.b"
        rec["exact_scan_exponent"] = fit.get("exact", {}).get("b")
    if rec["value"] is None:
        rec["note"] = f"no {key!r} in {rec['source']}"
    rec["profile"] = data.get("profile") if isinstance(data, dict) else None
    env = data.get("environment") if isinstance(data, dict) else None
    rec["measured_at_revision"] = env.get("git_revision") if isinstance(env, dict) else None  # the code it timed
    root = RESULTS_DIR.parent.parent
    try:
        rev = subprocess.run(
            ["git", "log", "-1", "--format=%H", "--", str(path)], cwd=root, capture_output=True, text=True, timeout=20
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", str(path)], cwd=root, capture_output=True, text=True, timeout=20
        ).stdout.strip()
        rec["git_revision"] = rev or None
        rec["uncommitted"] = bool(dirty)
    except (OSError, subprocess.SubprocessError) as e:
        rec["git_revision"] = None
        rec["note"] = (rec.get("note", "") + f" git: {e}").strip()
    return rec


def _summary(
    agreement: dict[str, Any], lds: dict[str, Any], cache_meta: dict[str, Any], out_path: Path, d: int
) -> dict:
    """The headline numbers (issue 13): the compact cache's bytes/token, its top-10 overlap with the full
    prototype-space scores and its LDS (this run), EK-FAC's LDS (this run), the query-time exponent and the
    equal-work speed-up (read from the scaling / costs benches' JSON)."""
    name = "cached-compact"
    qt = _external("attribution-scaling.json", "query_time_exponent")
    sp = _external("attribution-costs.json", "speedup_vs_ekfac_equal_work")
    return {
        "cached_method": f"{name}: "
        + json.dumps(
            {k: cache_meta.get(name, {}).get(k) for k in ("projection", "r", "dtype", "prune", "id_encoding")}
        ),
        "cache_bytes_per_token": cache_meta.get(name, {}).get("bytes_per_token"),
        "top10_overlap_vs_full": agreement.get(name, {}).get("top10_vs_full"),
        "lds_cached": lds.get(name, {}).get("mean"),
        "lds_cached_ci95": lds.get(name, {}).get("ci95"),
        "lds_ekfac": lds.get("ekfac", {}).get("mean"),
        "lds_ekfac_ci95": lds.get("ekfac", {}).get("ci95"),
        "lds_full": lds.get("full", {}).get("mean"),
        "lds_full_ci95": lds.get("full", {}).get("ci95"),
        "lds_cached_default_r": lds.get(f"cached-r{d}", {}).get("mean"),  # AttributionConfig(): r = d, orthogonal
        "lds_cached_default_r_ci95": lds.get(f"cached-r{d}", {}).get("ci95"),
        "lds_trak": lds.get("trak", {}).get("mean"),
        "lds_trak_ci95": lds.get("trak", {}).get("ci95"),
        "lds_hybrid": {k: v["mean"] for k, v in lds.items() if k.startswith("hybrid")},
        "query_time_exponent": qt["value"],
        "query_time_exponent_source": qt,
        "speedup_vs_ekfac_equal_work": sp["value"],
        "speedup_vs_ekfac_equal_work_source": sp,
        "this_file": str(out_path),
    }


# ----- main -------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small smoke profile (a few minutes)")
    ap.add_argument("--preset", default="tiny", help="model preset (with the d=64, K=128 overrides below)")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. model.n_embd=128 (repeatable)",
    )
    ap.add_argument("--background", type=int, help="background documents")
    ap.add_argument("--facts", type=int, help="planted facts (2 paraphrased queries each)")
    ap.add_argument("--copies", type=int, help="planted documents per fact")
    ap.add_argument("--steps", type=int, help="training steps of the attributed model and of every LDS model")
    ap.add_argument("--val-queries", type=int, help="held-out validation windows used as extra queries")
    ap.add_argument("--lds-subsets", type=int, help="random half subsets for LDS (0: skip LDS)")
    ap.add_argument("--lds-seeds", type=int, help="training seeds per subset")
    ap.add_argument("--ranks", type=int, nargs="+", help="sketch sizes r of the cached method")
    ap.add_argument("--fractions", type=float, nargs="+", help="training-set sizes for costs, as fractions")
    ap.add_argument("--no-kronfluence", action="store_true", help="skip the kronfluence baselines")
    ap.add_argument("--no-trak", action="store_true", help="skip the TRAK baseline (traker)")
    ap.add_argument(
        "--trak-proj-dim",
        type=int,
        default=None,
        help="TRAK projection size (default min(512, N/4), at least 128; must be > 100 and < N)",
    )
    ap.add_argument(
        "--hybrid-m",
        type=int,
        nargs="+",
        default=[32, 128, 512],
        help="hybrid: prototype-space candidates per query re-scored by a whole-network score",
    )
    ap.add_argument(
        "--bergson",
        default=None,
        metavar="PYTHON",
        help="also score with bergson==2.5.1 (EleutherAI), run by this python (a separate venv with "
        "bergson installed; see bench/_bergson_driver.py)",
    )
    ap.add_argument("--bergson-proj-dim", type=int, default=16, help="bergson's per-module projection_dim")
    ap.add_argument(
        "--lds-range",
        type=int,
        nargs=2,
        metavar=("FIRST", "STOP"),
        default=None,
        help="only train the LDS models of subsets FIRST..STOP-1 (and their query losses) under --workdir, "
        "then exit: a second process started on the upper subsets once the main run trains the "
        "lower ones halves the LDS time on 2 cores (the main run then reads them)",
    )
    ap.add_argument(
        "--reuse-scores",
        action="store_true",
        help="load every method's scores (and their costs) saved by an earlier run with the same model, "
        "queries and method options under --workdir (e.g. to add LDS subsets)",
    )
    ap.add_argument(
        "--timing-queries",
        type=int,
        default=4,
        help="queries the hybrid's and TRAK's per-query re-scoring time is measured on",
    )
    ap.add_argument("--no-costs", action="store_true", help="skip the timing section (e.g. to resume LDS training)")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument(
        "--compression",
        action="store_true",
        help="only the storage study: bytes/token vs top-10 overlap of the cache's storage options "
        "(issue 13), on --run or on this bench's model",
    )
    ap.add_argument("--run", default=None, help="--compression: an existing PRISM run (instead of training one)")
    ap.add_argument("--shards", default=None, help="--compression with --run: its token shard folder")
    ap.add_argument("--max-sequences", type=int, default=None, help="--compression: first N training sequences")
    ap.add_argument(
        "--curvature-sequences",
        type=int,
        default=2048,
        help="--compression: sequences of the curvature pass (shared by every method compared)",
    )
    ap.add_argument("--comp-ranks", type=int, nargs="+", default=[16, 32, 64], help="--compression: sketch sizes")
    ap.add_argument(
        "--comp-main-rank",
        type=int,
        default=32,
        help="--compression: the rank that gets the whole grid (others: storage type only)",
    )
    ap.add_argument(
        "--reuse-reference",
        action="store_true",
        help="--compression: reuse the reference cache of an earlier run in --workdir (checked against "
        "the model and shards)",
    )
    ap.add_argument(
        "--pca-sequences",
        type=int,
        default=2048,
        help="--compression: sequences the pca / pca-local projections are fitted on (spread out)",
    )
    ap.add_argument(
        "--comp-projections",
        nargs="+",
        default=["orthogonal", "pca", "pca-local"],
        help="--compression: projections (the first gets the whole grid)",
    )
    ap.add_argument("--comp-dtypes", nargs="+", default=["float32", "float16", "int8", "int4"])
    ap.add_argument("--comp-prunes", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2])
    ap.add_argument("--comp-aggregates", nargs="+", default=["sequence", "document"])
    ap.add_argument(
        "--comp-prune-by",
        nargs="+",
        default=["list", "unit"],
        choices=["list", "unit"],
        help="--compression: pruning rules (AttributionConfig.prune_by) for prune > 0",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="corpus/shards/models (default bench/runs/attribution[-quick])")
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/attribution[-quick].json)")
    args = ap.parse_args()
    prof = profile_from_args(PROFILES, args)
    tag = "attribution-quick" if args.quick else "attribution"
    work = Path(args.workdir) if args.workdir else RUNS_DIR / tag
    out_path = Path(args.out) if args.out else RESULTS_DIR / f"{tag}.json"
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    env = environment("cpu", args.seed)
    t_start = time.perf_counter()
    if args.compression:
        out_path = Path(args.out) if args.out else RESULTS_DIR / f"{tag}-compression.json"
    if args.compression and args.run:
        from prismlm.data.shards import load_shards

        if not args.shards:
            ap.error("--run needs --shards")
        ck = load_checkpoint(args.run)
        sh = load_shards(args.shards)
        nvq = args.val_queries or 24
        nv = sh.val.num_sequences(32)
        vq = [
            ([sh.tokenizer.eot_id] + sh.val.sequence(j, 32).tolist(), 1)
            for j in np.linspace(0, max(0, nv - 1), num=min(nvq, nv), dtype=int).tolist()
        ]
        cwork = Path(args.workdir) if args.workdir else RUNS_DIR / "attribution-compression"
        study = compression_study(ck.model.eval(), sh, vq, args, cwork)
        write_json(
            out_path,
            {
                "benchmark": "attribution-compression",
                "run": str(Path(args.run).resolve()),
                "shards": str(Path(args.shards).resolve()),
                "settings": vars(args),
                **study,
                "environment": env,
                "load_average_end": load_average(),
                "total_seconds": time.perf_counter() - t_start,
            },
        )
        print(_compression_summary(study, out_path))
        return

    # --- corpus, shards, model
    corpus_dir = work / f"corpus-b{prof['background']}-f{prof['facts']}x{prof['copies']}-s{args.seed}"
    pc = build_planted_corpus(
        corpus_dir,
        n_facts=prof["facts"],
        copies=prof["copies"],
        n_background=prof["background"],
        doc_chars=prof["doc_chars"],
        seed=args.seed,
    )
    sets = {
        **MODEL_SETS,
        **parse_sets(args.sets),
        "train.max_steps": prof["steps"],
        "train.batch_size": prof["batch"],
        "train.warmup_steps": max(1, prof["steps"] // 20),
        "train.device": "cpu",
        "data.tokenizer": "bpe-512",
    }
    cfg = RunConfig.from_name(args.preset).override(sets)
    shards = prepare_shards(
        str(pc.path), cfg.data.tokenizer, corpus_dir / "shards", val_fraction=0.05, show_progress=False
    )
    T = cfg.model.block_size
    cfg_hash = hashlib.sha256((cfg.to_json() + shards.manifest["key"]).encode()).hexdigest()[:12]
    run_dir = work / f"main-{cfg_hash}"
    if not (run_dir / "checkpoints" / "latest").exists():
        log(f"training the attributed model ({prof['steps']} steps) → {run_dir}")
        train(cfg, run_dir, shards=shards, progress=False)
    ckpt = load_checkpoint(run_dir)
    net = ckpt.model.eval()
    tok = shards.tokenizer
    N = shards.train.num_sequences(T)
    log(
        f"model d={cfg.model.n_embd} K={cfg.model.prototypes.num_prototypes} k={cfg.model.prototypes.top_k}; "
        f"{N} training sequences of {T}"
    )

    # --- queries: planted paraphrases (answer measured) + held-out windows
    planted_q, fact_of = pc.queries(tok)
    val_q = []
    nv = shards.val.num_sequences(32)
    for j in np.linspace(0, max(0, nv - 1), num=min(prof["val_queries"], nv), dtype=int).tolist():
        val_q.append(([tok.eot_id] + shards.val.sequence(j, 32).tolist(), 1))
    queries = planted_q + val_q
    Q = len(queries)
    relevant = relevant_sequences(pc, shards, T)
    log(
        f"{Q} queries ({len(planted_q)} planted, {len(val_q)} held-out); relevant sequences per fact: "
        f"{[len(r) for r in relevant]}"
    )
    if args.compression:
        study = compression_study(net, shards, queries, args, work)
        write_json(
            out_path,
            {
                "benchmark": "attribution-compression",
                "profile": "quick" if args.quick else "default",
                "settings": {**prof, **vars(args)},
                "config": cfg.to_dict(),
                **study,
                "environment": env,
                "load_average_end": load_average(),
                "total_seconds": time.perf_counter() - t_start,
            },
        )
        print(_compression_summary(study, out_path))
        return

    # --- costs at several training-set sizes
    sizes = [] if args.no_costs else sorted({max(8, int(round(f * N))) for f in prof["fractions"]})
    costs = []
    scores_at_N: dict[str, np.ndarray] = {}
    r_time = min(32, cfg.model.n_embd)
    for n in sizes:
        row: dict[str, Any] = {"num_train": n, "tokens": n * T}
        # full prototype-space gradients
        (full, t_full, mem) = timed(FullGradients.build, net, shards, max_sequences=n)
        row["full"] = {"oneoff_s": t_full, "peak_rss_mib": mem}
        per = []
        for _ in range(args.repeats):
            for qq in queries[:8]:
                t0 = time.perf_counter()
                full.scores(query_gradients(net, [qq]), 1)
                per.append(time.perf_counter() - t0)
        row["full"]["per_query_s"] = statistics.median(per)
        # cached (r = r_time), curvature reused from nothing: time the whole build
        (cache, t_c, mem) = timed(
            build_cache,
            net,
            shards,
            AttributionConfig(max_sequences=n, r=r_time),
            out=work / f"cache-{cfg_hash}-n{n}-r{r_time}",
        )
        per = []
        reset_peak_rss()
        for _ in range(args.repeats):
            for qq in queries[:8]:
                t0 = time.perf_counter()
                cache.scores(query_gradients(net, [qq]), 1)
                per.append(time.perf_counter() - t0)
        row["cached"] = {
            "r": r_time,
            "oneoff_s": t_c,
            "curvature_s": cache.manifest["curvature_seconds"],
            "postings_s": cache.manifest["postings_seconds"],
            "peak_rss_mib_build": mem,
            "peak_rss_mib_query": current_peak_rss_mib(),
            "per_query_s": statistics.median(per),
            "bytes_per_token": cache.manifest["bytes_per_token"],
            "cache_bytes": cache.nbytes(),
            "postings_per_sequence": cache.manifest["postings_per_sequence"],
        }
        if not args.no_kronfluence:
            for strat in ("ekfac", "identity"):
                gc.collect()
                (kb, t_f, mem) = timed(KronfluenceBaseline, net, shards, strategy=strat, max_sequences=n, batch_size=16)
                (S, t_all, mem_q) = timed(kb.scores, queries, tok.eot_id, query_batch_size=Q)
                (_, t_one, _) = timed(kb.scores, queries[:1], tok.eot_id)
                row["ekfac" if strat == "ekfac" else "kf-identity"] = {
                    "oneoff_s": t_f,
                    "peak_rss_mib_factors": mem,
                    "peak_rss_mib_scores": mem_q,
                    "batch_scores_s": t_all,
                    "per_query_s": t_all / Q,
                    "single_query_s": t_one,
                }
                if n == sizes[-1]:
                    scores_at_N["ekfac" if strat == "ekfac" else "kf-identity"] = S.numpy()
                kb.close()
                del kb
            row["speedup_per_query_cached_vs_ekfac"] = row["ekfac"]["per_query_s"] / row["cached"]["per_query_s"]
            row["speedup_single_query_cached_vs_ekfac"] = row["ekfac"]["single_query_s"] / row["cached"]["per_query_s"]
        costs.append(row)
        log(
            f"n={n}: full {row['full']['oneoff_s']:.1f}s + {row['full']['per_query_s'] * 1e3:.1f} ms/q; cached "
            f"{row['cached']['oneoff_s']:.1f}s + {row['cached']['per_query_s'] * 1e3:.1f} ms/q"
            + (
                f"; ekfac {row['ekfac']['oneoff_s']:.1f}s + {row['ekfac']['per_query_s'] * 1e3:.0f} ms/q (batched), "
                f"{row['ekfac']['single_query_s']:.1f}s single"
                if "ekfac" in row
                else ""
            )
        )
        del full, cache
        gc.collect()

    # --- LDS
    M, seeds = prof["lds_subsets"], prof["lds_seeds"]
    if M > 0:
        rng = np.random.default_rng(1000 + args.seed)
        subsets = [np.sort(rng.choice(N, size=N // 2, replace=False)) for _ in range(M)]
        qkey = hashlib.sha256(json.dumps(queries).encode()).hexdigest()[:12]
        losses = np.zeros((M, seeds, Q))
        t0 = time.perf_counter()
        first, stop = args.lds_range or (0, M)
        for m, ids in enumerate(subsets):
            if not first <= m < stop:
                continue
            for s in range(seeds):
                d = work / "lds" / cfg_hash / f"subset{m:03d}-seed{s}"
                lf = d / f"losses-{qkey}.json"
                if lf.exists():
                    losses[m, s] = json.loads(lf.read_text())
                    continue
                if not (d / "checkpoints" / "latest").exists():
                    c2 = cfg.override({"train.seed": 1337 + 1 + s})
                    train(c2, d, shards=_SubsetShards(shards, ids, T), progress=False)
                    np.save(d / "subset.npy", ids)
                m2 = load_checkpoint(d).model.eval()
                losses[m, s] = query_gradients(m2, queries).loss.numpy()
                lf.write_text(json.dumps(losses[m, s].tolist()))
            log(f"LDS subset {m + 1}/{M} done ({time.perf_counter() - t0:.0f}s)")
        if args.lds_range:
            log(f"LDS subsets {first}..{stop - 1} trained under {work / 'lds' / cfg_hash}; exiting (--lds-range)")
            return
    # --- scores of every method on the full training set (saved under --workdir: --reuse-scores loads them)
    skey = hashlib.sha256(
        (
            cfg_hash
            + json.dumps(queries)
            + repr(
                (
                    args.seed,
                    args.trak_proj_dim,
                    args.hybrid_m,
                    args.no_kronfluence,
                    args.no_trak,
                    prof["ranks"],
                    bool(costs),
                )
            )
        ).encode()
    ).hexdigest()[:12]
    spath = work / f"scores-{skey}.npz"

    def all_scores() -> dict[str, Any]:
        qg = query_gradients(net, queries)
        curv = curvature_pass(net, shards)
        lam_rec = float(cfg.loss.lambda_rec)
        curv_rec = curvature_pass(net, shards, reconstruction=lam_rec)  # + the REC term's diagonal blocks
        full = FullGradients.build(net, shards, curvature=curv)
        scores_at_N["full"] = full.scores(qg, Q).numpy()
        scores_at_N["full-rec"] = FullGradients(full.train, curv_rec, N).scores(qg, Q).numpy()
        method_costs: dict[str, Any] = {}
        notes: dict[str, str] = {}
        kb_ekfac = None
        if not args.no_kronfluence:
            for strat, name in (("ekfac", "ekfac"), ("identity", "kf-identity")):
                if name in scores_at_N and strat != "ekfac":
                    continue
                kb, t_f, _ = timed(KronfluenceBaseline, net, shards, strategy=strat, batch_size=16)
                if name not in scores_at_N:  # --no-costs: the baselines were not run yet
                    t0 = time.perf_counter()
                    scores_at_N[name] = kb.scores(queries, tok.eot_id, query_batch_size=Q).numpy()
                    method_costs[name] = {"oneoff_s": t_f, "per_query_s_batched": (time.perf_counter() - t0) / Q}
                if strat == "ekfac":
                    kb_ekfac = kb
                else:
                    kb.close()
        if not args.no_trak:
            pdim = args.trak_proj_dim or max(128, min(512, N // 4))
            try:
                tb, t_f, mem = timed(TrakBaseline, net, shards, proj_dim=pdim, batch_size=16, seed=args.seed)
                t0 = time.perf_counter()
                scores_at_N["trak"] = tb.scores(queries, tok.eot_id).numpy()
                method_costs["trak"] = {
                    "oneoff_s": t_f,
                    "peak_rss_mib_features": mem,
                    "proj_dim": pdim,
                    "per_query_s_batched": (time.perf_counter() - t0) / Q,
                    "projector": "BasicProjector (dense Gaussian, CPU)",
                    "checkpoints": 1,
                }
                tb.close()
            except Exception as e:  # recorded, not hidden: the JSON says why TRAK is missing
                notes["trak"] = f"TRAK failed: {type(e).__name__}: {e}"
                log(notes["trak"])
        scores_at_N["full-exact"] = FullGradients.build(net, shards, mode="exact").scores(qg, Q).numpy()
        scores_at_N["proto-dot"] = FullGradients(full.train, None, N).scores(qg, Q).numpy()
        cache_meta = {}
        for r in sorted(set(prof["ranks"]) | {r_time}):
            for proj in ("orthogonal", "gaussian", "pca"):
                if proj in ("orthogonal", "pca") and r > cfg.model.n_embd:
                    continue
                name = f"cached-r{r}" + {"orthogonal": "", "gaussian": "-gauss", "pca": "-pca"}[proj]
                c = build_cache(net, shards, AttributionConfig(r=r, projection=proj, seed=args.seed), curvature=curv)
                scores_at_N[name] = c.scores(qg, Q).numpy()
                cache_meta[name] = {"r": r, "projection": proj, "bytes_per_token": c.manifest["bytes_per_token"]}
        compact_cfg = AttributionConfig(
            projection="pca-local", r=min(40, cfg.model.n_embd), dtype="pq", id_encoding="delta", seed=args.seed
        )  # app.build_run_cache's compact recipe
        for name, cv in (("cached-compact", curv), ("cached-compact-rec", curv_rec)):
            cc = build_cache(net, shards, compact_cfg, curvature=cv)
            scores_at_N[name] = cc.scores(qg, Q).numpy()
            cache_meta[name] = {
                "r": cc.r,
                "projection": "pca-local",
                "dtype": "pq",
                "prune": 0.0,
                "id_encoding": "delta",
                "bytes_per_token": cc.manifest["bytes_per_token"],
                "curvature_reconstruction": cv.reconstruction,
            }
            if name == "cached-compact":
                per = []
                for qq in queries[:8]:
                    t0 = time.perf_counter()
                    cc.scores(query_gradients(net, [qq]), 1)
                    per.append(time.perf_counter() - t0)
                method_costs["cached-compact"] = {"per_query_s": statistics.median(per)}
        crec = build_cache(net, shards, AttributionConfig(seed=args.seed), curvature=curv_rec)
        scores_at_N[f"cached-r{crec.r}-rec"] = crec.scores(qg, Q).numpy()
        cache_meta[f"cached-r{crec.r}-rec"] = {
            "r": crec.r,
            "projection": "orthogonal",
            "bytes_per_token": crec.manifest["bytes_per_token"],
        }

        # --- whole-network gradient dot products (every parameter) and the hybrid re-ranker
        wn = WholeNetworkGradients(net, shards, memo=False)
        t0 = time.perf_counter()
        gq = torch.stack([wn.query(ids, st) for ids, st in queries])  # (Q, P)
        t_qgrad = (time.perf_counter() - t0) / Q
        WN = np.zeros((Q, N))
        t0 = time.perf_counter()
        for j in range(N):
            WN[:, j] = (gq @ wn.train(j)).numpy()
        t_tgrad = (time.perf_counter() - t0) / N
        scores_at_N["wn-dot"] = WN
        method_costs["wn-dot"] = {
            "oneoff_s": 0.0,
            "per_query_s": t_qgrad + N * t_tgrad,
            "train_gradient_s": t_tgrad,
            "query_gradient_s": t_qgrad,
            "note": "per query: the query's gradient + one backward pass per training sequence",
        }
        base_name = "cached-compact"
        hybrid_meta: dict[str, Any] = {"base": base_name, "m": args.hybrid_m, "rescorers": {}}
        rescorers = {"wn-dot": scores_at_N["wn-dot"]}
        if "ekfac" in scores_at_N:
            rescorers["ekfac"] = scores_at_N["ekfac"]
        base_S = torch.from_numpy(scores_at_N[base_name])
        tq = args.timing_queries
        for rname, R in rescorers.items():
            Rt = torch.from_numpy(R)
            for m_c in args.hybrid_m:
                # the re-scorer's value on a candidate does not depend on the other training sequences (fixed
                # factors / gradients), so the scores are read from the full matrix; the per-query time below is
                # measured by computing them on the candidates only
                H, cands = hybrid_scores(base_S, lambda q, ids, Rt=Rt: Rt[q, ids], m_c)
                hname = f"hybrid-{rname}-m{m_c}"
                scores_at_N[hname] = H.numpy()
                scores_at_N[hname + "-sum"] = hybrid_scores(
                    base_S, lambda q, ids, Rt=Rt: Rt[q, ids], m_c, keep_order=False
                )[0].numpy()
                times = []
                for q in range(min(tq, Q)):
                    t0 = time.perf_counter()
                    if rname == "wn-dot":
                        g = wn.query(*queries[q])
                        wn.dot(g, cands[q].tolist())
                    elif kb_ekfac is not None:
                        kb_ekfac.scores_on([queries[q]], cands[q].tolist(), tok.eot_id)
                    times.append(time.perf_counter() - t0)
                base_q = method_costs["cached-compact"]["per_query_s"]
                hybrid_meta["rescorers"][hname] = {
                    "rescore_per_query_s": statistics.median(times) if times else None,
                    "per_query_s": base_q + (statistics.median(times) if times else float("nan")),
                    "cached_per_query_s": base_q,
                    "oneoff_s_extra": (
                        (
                            method_costs.get("ekfac", {}).get("oneoff_s")
                            or (costs[-1].get("ekfac", {}).get("oneoff_s") if costs else None)
                        )
                        if rname == "ekfac"
                        else 0.0
                    ),
                    "timing_queries": len(times),
                }
                log(f"{hname}: {hybrid_meta['rescorers'][hname]['per_query_s'] * 1e3:.0f} ms/query")
        if kb_ekfac is not None:
            kb_ekfac.close()
        c16 = build_cache(net, shards, AttributionConfig(r=min(16, cfg.model.n_embd), dtype="float16"), curvature=curv)
        scores_at_N[f"cached-r{c16.r}-fp16"] = c16.scores(qg, Q).numpy()
        cache_meta[f"cached-r{c16.r}-fp16"] = {
            "r": c16.r,
            "projection": "orthogonal",
            "dtype": "float16",
            "bytes_per_token": c16.manifest["bytes_per_token"],
        }
        return {
            "cache_meta": cache_meta,
            "method_costs": method_costs,
            "hybrid": hybrid_meta,
            "notes": notes,
            "curvature": {"reconstruction_lambda": lam_rec, "mean_rec_over_ce_trace_per_d": _rec_ratio(curv_rec)},
        }

    if args.reuse_scores and spath.exists() and spath.with_suffix(".json").exists():
        with np.load(spath) as z:
            scores_at_N.update({k: z[k] for k in z.files})
        extra = json.loads(spath.with_suffix(".json").read_text())
        log(f"scores reused from {spath}")
    else:
        extra = all_scores()
        np.savez(spath, **scores_at_N)
        spath.with_suffix(".json").write_text(json.dumps(extra))
    cache_meta, method_costs = extra["cache_meta"], extra["method_costs"]
    hybrid_meta, notes = extra["hybrid"], extra["notes"]
    if args.bergson and (
        "bergson" not in scores_at_N or args.bergson_proj_dim != method_costs.get("bergson", {}).get("projection_dim")
    ):  # added to saved scores without recomputing the others
        try:
            tb0 = time.perf_counter()
            scores_at_N["bergson"] = _bergson_scores(args, run_dir, shards, queries, N, T, work)
            method_costs["bergson"] = {
                "total_s": time.perf_counter() - tb0,
                "projection_dim": args.bergson_proj_dim,
                "note": "prism export + bergson build of the training and query sequences "
                "(one subprocess each) + dot products of the "
                "projected gradients; targets: 63 of each training sequence's "
                "64 (bergson feeds at most block_size tokens)",
            }
        except Exception as e:  # recorded: the JSON says why bergson is missing
            notes["bergson_error"] = f"bergson failed: {type(e).__name__}: {e}"
            log(notes["bergson_error"])
        np.savez(spath, **scores_at_N)
        spath.with_suffix(".json").write_text(json.dumps(extra))
    if "bergson" not in scores_at_N:
        notes.setdefault(
            "bergson",
            "not run (--bergson PYTHON runs it from a separate venv): bergson==2.5.1 works on "
            "CPU on a `prism export`ed model only with torchvision/torchaudio removed (their "
            "wheels do not match torch 2.13 CPU), prismlm importable and PrismLM.device "
            "patched (bench/_bergson_driver.py); docs/results.md, issue 13 items 5-6",
        )

    agreement = {}
    for name, S in scores_at_N.items():
        agreement[name] = {
            "top10_vs_full": overlap(S, scores_at_N["full"], 10),
            "top100_vs_full": overlap(S, scores_at_N["full"], min(100, N)),
        }
        if "ekfac" in scores_at_N:
            agreement[name]["top10_vs_ekfac"] = overlap(S, scores_at_N["ekfac"], 10)
        agreement[name].update(cache_meta.get(name, {}))
    planted = {name: retrieval_metrics(S[: len(planted_q)], fact_of, relevant, k=10) for name, S in scores_at_N.items()}

    lds: dict[str, Any] = {}
    if M > 0:
        y = losses.mean(1)  # (M, Q) seed-averaged retrained losses
        member = np.zeros((M, N))
        for m, ids in enumerate(subsets):
            member[m, ids] = 1.0
        for name, S in scores_at_N.items():
            pred = -(member @ S.T)  # (M, Q): predicted loss ∝ −Σ_{j∈S} score
            rho = np.array([spearman(pred[:, q], y[:, q]) for q in range(Q)])
            lds[name] = {
                "mean": float(np.nanmean(rho)),
                "ci95": bootstrap_ci(rho),
                "planted_mean": float(np.nanmean(rho[: len(planted_q)])),
                "heldout_mean": float(np.nanmean(rho[len(planted_q) :])) if len(val_q) else None,
            }
        lds["_setup"] = {
            "subsets": M,
            "seeds": seeds,
            "subset_size": N // 2,
            "queries": Q,
            "seconds": time.perf_counter() - t0,
        }

    payload = {
        "benchmark": "attribution",
        "profile": "quick" if args.quick else "default",
        "settings": prof,
        "config": cfg.to_dict(),
        "num_train": N,
        "block_size": T,
        "queries": {"planted": len(planted_q), "heldout": len(val_q)},
        "relevant_per_fact": [sorted(r) for r in relevant],
        "costs": costs,
        "agreement": agreement,
        "planted": planted,
        "lds": lds,
        "method_costs": method_costs,
        "hybrid": hybrid_meta,
        "curvature": extra["curvature"],
        "scores_file": str(spath),
        "notes": notes,
        "summary": _summary(agreement, lds, cache_meta, out_path, cfg.model.n_embd),
        "environment": env,
        "load_average_end": load_average(),
        "total_seconds": time.perf_counter() - t_start,
    }
    write_json(out_path, payload)
    best_r = f"cached-r{r_time}"
    parts = [f"attribution n={N}"]
    if costs:
        big = costs[-1]
        sp = big.get("speedup_per_query_cached_vs_ekfac")
        parts.append(
            f"cached r={r_time} {big['cached']['per_query_s'] * 1e3:.1f} ms/query"
            + (f", {sp:.0f}× faster than EK-FAC per query (batched)" if sp else "")
        )
    parts.append(f"top10 vs full {agreement.get(best_r, {}).get('top10_vs_full', float('nan')):.2f}")
    parts.append(
        "planted R@10 "
        + " ".join(
            f"{k}={v['recall@10']:.2f}" for k, v in planted.items() if k in ("full", best_r, "ekfac", "kf-identity")
        )
    )
    if lds:
        parts.append(
            "LDS "
            + " ".join(
                f"{k}={lds[k]['mean']:.2f}"
                for k in lds
                if not k.startswith("_")
                and (
                    k in ("full", "full-rec", best_r, "ekfac", "kf-identity", "trak", "wn-dot")
                    or k.startswith(("cached-compact", "hybrid"))
                )
            )
        )
    print("; ".join(parts) + f" → {out_path}")


if __name__ == "__main__":
    main()
