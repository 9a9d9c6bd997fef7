#!/usr/bin/env python
"""Training-data attribution: prototype-space influence (full and cached) vs kronfluence EK-FAC, TRAK,
whole-network gradient dot products, the hybrid re-ranker and (optionally) bergson.

One process, one model, one training set, one query set for every method: a planted-fact corpus
(``prismlm.tda.planted``) and a PRISM model trained on it (cached under ``--workdir``). Measured: costs at ≥ 3
training-set sizes (one-off and per-query time, peak RSS, cache bytes per token), top-10/100 overlap with
``full`` (``prismlm.tda.evaluation.topk_overlap``), planted-fact retrieval (recall@10, MRR) and LDS over
``--lds-subsets`` retrained half subsets (``prismlm.tda.evaluation.lds``, 95% bootstrap CI).
``--compression``: only the cache's storage study (``prismlm.tda.storage_study``), on ``--run`` or this model.

Run: ``PYTHONPATH=src python bench/attribution.py [--quick]`` (``--help``: every method and option). Writes
``bench/results/attribution[-quick].json`` and one summary line; docs/results.md has the measurements.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch
from _common import (
    ATTRIBUTION_MODEL_SETS,
    RESULTS_DIR,
    RUNS_DIR,
    Json,
    add_set_option,
    environment,
    load_average,
    log,
    num,
    obj,
    parse_sets,
    planted_corpus,
    profile_from_args,
    results_number,
    warn_if_busy,
    write_json,
)

from prismlm.config import AttributionConfig, RunConfig
from prismlm.data.shards import ShardSet, load_shards, prepare_shards
from prismlm.data.tokenizer import Tokenizer
from prismlm.eval.resources import current_peak_rss_mib, reset_peak_rss, timed_call
from prismlm.integrations.bergson import bergson_scores
from prismlm.model import PrismLM
from prismlm.tda.baselines import KronfluenceBaseline
from prismlm.tda.cache import build_cache
from prismlm.tda.comparison import Attributed, ComparisonSettings, Query, Scores, all_scores
from prismlm.tda.evaluation import LDS, SubsetShards, lds, topk_overlap
from prismlm.tda.influence import FullGradients, query_gradients
from prismlm.tda.planted import PlantedCorpus, relevant_sequences, retrieval_metrics
from prismlm.tda.storage_study import StorageStudySettings, storage_study
from prismlm.train import load_checkpoint, train


class Profile(TypedDict):
    background: int
    doc_chars: int
    facts: int
    copies: int
    steps: int
    batch: int
    val_queries: int
    lds_subsets: int
    lds_seeds: int
    ranks: list[int]
    fractions: list[float]


# Why these sizes: "default" aims at the ≤ 30 min budget on 2 idle cores with 1 thread (d=64, 2 layers, K=128,
# ~2.4k training sequences of 64 tokens); "quick" is a smoke run of ~2 minutes.
PROFILES: dict[str, Profile] = {
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


@dataclass
class Setup:
    """The attributed model, its data and the queries (planted paraphrases, then held-out windows)."""

    pc: PlantedCorpus
    cfg: RunConfig
    cfg_hash: str
    shards: ShardSet
    run_dir: Path
    net: PrismLM
    tok: Tokenizer
    N: int
    T: int
    planted_q: list[Query]
    fact_of: list[int]
    val_q: list[Query]
    relevant: list[set[int]]

    @property
    def queries(self) -> list[Query]:
        return self.planted_q + self.val_q


def heldout_queries(shards: ShardSet, n: int) -> list[Query]:
    """``n`` held-out windows of 32 tokens spread over the val split, every token measured."""
    nv = shards.val.num_sequences(32)
    return [
        ([shards.tokenizer.eot_id] + shards.val.sequence(j, 32).tolist(), 1)
        for j in np.linspace(0, max(0, nv - 1), num=min(n, nv), dtype=int).tolist()
    ]


def setup(args: argparse.Namespace, prof: Profile, work: Path) -> Setup:
    """The planted corpus, its shards and the trained model (each built once under ``work``), the queries."""
    pc = planted_corpus(work, prof, args.seed)
    corpus_dir = pc.path.parent
    sets = {
        **ATTRIBUTION_MODEL_SETS,
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
    net = load_checkpoint(run_dir).model.eval()
    N = shards.train.num_sequences(T)
    protos = cfg.model.prototypes
    assert protos is not None  # the preset's model has prototypes
    log(f"model d={cfg.model.n_embd} K={protos.num_prototypes} k={protos.top_k}; {N} training sequences of {T}")
    planted_q, fact_of = pc.queries(shards.tokenizer)
    val_q = heldout_queries(shards, prof["val_queries"])
    relevant = relevant_sequences(pc, shards, T)
    s = Setup(pc, cfg, cfg_hash, shards, run_dir, net, shards.tokenizer, N, T, planted_q, fact_of, val_q, relevant)
    log(
        f"{len(s.queries)} queries ({len(planted_q)} planted, {len(val_q)} held-out); relevant sequences per "
        f"fact: {[len(r) for r in relevant]}"
    )
    return s


# ----- compression study (issue 13, items 1–2) -----------------------------------------------------------
def study_settings(args: argparse.Namespace) -> StorageStudySettings:
    return StorageStudySettings(
        max_sequences=args.max_sequences,
        curvature_sequences=args.curvature_sequences,
        reuse_reference=args.reuse_reference,
        pca_sequences=args.pca_sequences,
        projections=tuple(args.comp_projections),
        ranks=tuple(args.comp_ranks),
        main_rank=args.comp_main_rank,
        dtypes=tuple(args.comp_dtypes),
        prunes=tuple(args.comp_prunes),
        aggregates=tuple(args.comp_aggregates),
        prune_by=tuple(args.comp_prune_by),
        seed=args.seed,
    )


def compression_on_run(args: argparse.Namespace, out_path: Path, env: Json, t_start: float) -> None:
    """``--compression --run RUN --shards S``: the storage study on an existing run."""
    ck = load_checkpoint(args.run)
    sh = load_shards(args.shards)
    vq = heldout_queries(sh, args.val_queries or 24)
    cwork = Path(args.workdir) if args.workdir else RUNS_DIR / "attribution-compression"
    study = storage_study(ck.model.eval(), sh, vq, study_settings(args), cwork, log)
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
    print(compression_summary(study, out_path))


def compression_summary(study: Json, out_path: Path) -> str:
    rows = _rows(study["compression"])
    parts = [f"compression n={study['num_train']} ({num(study['tokens']):,.0f} tokens, {study['queries']} queries)"]
    main = rows[0]["projection"] if rows else None
    for r in rows:
        if (
            r["prune"] == 0
            and r["aggregate"] == "sequence"
            and r["projection"] == main
            and r["id_encoding"] == ("int32" if r["dtype"] == "float32" else "delta")
        ):
            parts.append(
                f"{main} r{r['r']} {r['dtype']} {num(r['bytes_per_token']):.0f} B/tok top10 full "
                f"{num(r['top10_vs_full']):.2f} fp32 {num(r['top10_vs_fp32']):.2f}"
            )
    b = study["best_at_32_bytes"]
    best = (
        f"{b['name']} {num(b['bytes_per_token']):.1f} B/tok top10 vs full {num(b['top10_vs_full']):.2f}"
        if isinstance(b, dict)
        else "none"
    )
    parts.append("best <= 32 B/token: " + best)
    return "; ".join(parts) + f" → {out_path}"


# ----- costs at several training-set sizes ----------------------------------------------------------------
def per_query_seconds(score: object, net: PrismLM, queries: list[Query], repeats: int) -> float:
    """Median seconds of ``score.scores(query gradients, 1)`` over the first 8 queries, ``repeats`` rounds."""
    per = []
    for _ in range(repeats):
        for qq in queries[:8]:
            t0 = time.perf_counter()
            score.scores(query_gradients(net, [qq]), 1)  # type: ignore[attr-defined]  # FullGradients or a cache
            per.append(time.perf_counter() - t0)
    return statistics.median(per)


def kronfluence_costs(s: Setup, n: int, row: Json, last: bool, scores_at_N: Scores) -> None:
    """EK-FAC and identity kronfluence at n training sequences: factors, a batch of every query, one query."""
    Q = len(s.queries)
    for strat in ("ekfac", "identity"):
        gc.collect()
        fit = partial(KronfluenceBaseline, s.net, s.shards, strategy=strat, max_sequences=n, batch_size=16)
        kb, t_f, mem = timed_call(fit)
        S, t_all, mem_q = timed_call(partial(kb.scores, s.queries, s.tok.eot_id, query_batch_size=Q))
        _, t_one, _ = timed_call(partial(kb.scores, s.queries[:1], s.tok.eot_id))
        row["ekfac" if strat == "ekfac" else "kf-identity"] = {
            "oneoff_s": t_f,
            "peak_rss_mib_factors": mem,
            "peak_rss_mib_scores": mem_q,
            "batch_scores_s": t_all,
            "per_query_s": t_all / Q,
            "single_query_s": t_one,
        }
        if last:
            scores_at_N["ekfac" if strat == "ekfac" else "kf-identity"] = S.numpy()
        kb.close()
        del kb
    ek, cached = obj(row["ekfac"]), obj(row["cached"])
    row["speedup_per_query_cached_vs_ekfac"] = num(ek["per_query_s"]) / num(cached["per_query_s"])
    row["speedup_single_query_cached_vs_ekfac"] = num(ek["single_query_s"]) / num(cached["per_query_s"])


def costs_at(
    args: argparse.Namespace, s: Setup, work: Path, n: int, r_time: int, last: bool, scores_at_N: Scores
) -> Json:
    """One-off and per-query costs of full, cached (r = r_time) and kronfluence at n training sequences."""
    row: Json = {"num_train": n, "tokens": n * s.T}
    full, t_full, mem = timed_call(lambda: FullGradients.build(s.net, s.shards, max_sequences=n))
    row["full"] = {
        "oneoff_s": t_full,
        "peak_rss_mib": mem,
        "per_query_s": per_query_seconds(full, s.net, s.queries, args.repeats),
    }
    # cached (r = r_time), curvature reused from nothing: time the whole build
    out = work / f"cache-{s.cfg_hash}-n{n}-r{r_time}"
    cfg = AttributionConfig(max_sequences=n, r=r_time)
    cache, t_c, mem = timed_call(lambda: build_cache(s.net, s.shards, cfg, out=out))
    reset_peak_rss()
    per_q = per_query_seconds(cache, s.net, s.queries, args.repeats)
    row["cached"] = {
        "r": r_time,
        "oneoff_s": t_c,
        "curvature_s": cache.manifest["curvature_seconds"],
        "postings_s": cache.manifest["postings_seconds"],
        "peak_rss_mib_build": mem,
        "peak_rss_mib_query": current_peak_rss_mib(),
        "per_query_s": per_q,
        "bytes_per_token": cache.manifest["bytes_per_token"],
        "cache_bytes": cache.nbytes(),
        "postings_per_sequence": cache.manifest["postings_per_sequence"],
    }
    if not args.no_kronfluence:
        kronfluence_costs(s, n, row, last, scores_at_N)
    f, c = obj(row["full"]), obj(row["cached"])
    ek = obj(row["ekfac"]) if "ekfac" in row else None
    log(
        f"n={n}: full {num(f['oneoff_s']):.1f}s + {num(f['per_query_s']) * 1e3:.1f} ms/q; cached "
        f"{num(c['oneoff_s']):.1f}s + {num(c['per_query_s']) * 1e3:.1f} ms/q"
        + (
            f"; ekfac {num(ek['oneoff_s']):.1f}s + {num(ek['per_query_s']) * 1e3:.0f} ms/q (batched), "
            f"{num(ek['single_query_s']):.1f}s single"
            if ek is not None
            else ""
        )
    )
    del full, cache
    gc.collect()
    return row


# ----- LDS ---------------------------------------------------------------------------------------------------
def lds_losses(
    args: argparse.Namespace, s: Setup, work: Path, M: int, seeds: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """M random half subsets and the (M, seeds, Q) losses of the queries under models retrained on each (with
    ``--lds-range``: only those subsets; models and losses cached under ``work/lds``)."""
    rng = np.random.default_rng(1000 + args.seed)
    subsets = [np.sort(rng.choice(s.N, size=s.N // 2, replace=False)) for _ in range(M)]
    qkey = hashlib.sha256(json.dumps(s.queries).encode()).hexdigest()[:12]
    losses = np.zeros((M, seeds, len(s.queries)))
    t0 = time.perf_counter()
    first, stop = args.lds_range or (0, M)
    for m, ids in enumerate(subsets):
        if not first <= m < stop:
            continue
        for seed in range(seeds):
            d = work / "lds" / s.cfg_hash / f"subset{m:03d}-seed{seed}"
            lf = d / f"losses-{qkey}.json"
            if lf.exists():
                losses[m, seed] = json.loads(lf.read_text())
                continue
            if not (d / "checkpoints" / "latest").exists():
                c2 = s.cfg.override({"train.seed": 1337 + 1 + seed})
                train(c2, d, shards=SubsetShards(s.shards, ids, s.T), progress=False)  # type: ignore[arg-type]
                np.save(d / "subset.npy", ids)
            m2 = load_checkpoint(d).model.eval()
            loss = query_gradients(m2, s.queries).loss
            assert loss is not None  # query_gradients measures every query's loss
            losses[m, seed] = loss.numpy()
            lf.write_text(json.dumps(losses[m, seed].tolist()))
        log(f"LDS subset {m + 1}/{M} done ({time.perf_counter() - t0:.0f}s)")
    return subsets, losses


def score_key(args: argparse.Namespace, s: Setup, ranks: list[int], costs: bool) -> str:
    """What the saved scores depend on: the model, the queries and the method options."""
    opts = (args.seed, args.trak_proj_dim, args.hybrid_m, args.no_kronfluence, args.no_trak, ranks, costs)
    return hashlib.sha256((s.cfg_hash + json.dumps(s.queries) + repr(opts)).encode()).hexdigest()[:12]


def add_bergson(args: argparse.Namespace, s: Setup, work: Path, scores_at_N: Scores, extra: Json) -> bool:
    """bergson's scores under ``--bergson PYTHON`` (added to saved scores without recomputing the others);
    whether they were computed now. A failure is recorded in the notes."""
    costs, notes = _dd(extra["method_costs"]), _strs(extra["notes"])
    if not args.bergson or (
        "bergson" in scores_at_N and args.bergson_proj_dim == costs.get("bergson", {}).get("projection_dim")
    ):
        return False
    try:
        tb0 = time.perf_counter()
        scores_at_N["bergson"] = bergson_scores(
            args.bergson, s.run_dir, s.shards, s.queries, s.N, s.T, work / "bergson", proj_dim=args.bergson_proj_dim
        )[0]  # (scores, seconds of each step)
        costs["bergson"] = {
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
    return True


BERGSON_NOT_RUN = (
    "not run (--bergson PYTHON runs it from a separate venv): bergson==2.5.1 works on "
    "CPU on a `prism export`ed model only with torchvision/torchaudio removed (their "
    "wheels do not match torch 2.13 CPU), prismlm importable and PrismLM.device "
    "patched (prismlm/integrations/bergson_driver.py); docs/results.md, issue 13 items 5-6"
)


def scores_and_extra(
    args: argparse.Namespace, s: Setup, work: Path, prof: Profile, r_time: int, scores_at_N: Scores, costs: list[Json]
) -> tuple[Json, Path]:
    """Every method's scores (computed, or loaded with ``--reuse-scores``; saved under ``work``) and what they
    come with, bergson added when asked."""
    spath = work / f"scores-{score_key(args, s, prof['ranks'], bool(costs))}.npz"
    if args.reuse_scores and spath.exists() and spath.with_suffix(".json").exists():
        with np.load(spath) as z:
            scores_at_N.update({k: z[k] for k in z.files})
        extra = json.loads(spath.with_suffix(".json").read_text())
        log(f"scores reused from {spath}")
    else:
        settings = ComparisonSettings(
            ranks=prof["ranks"],
            r_time=r_time,
            lambda_rec=float(s.cfg.loss.lambda_rec),
            seed=args.seed,
            no_kronfluence=args.no_kronfluence,
            no_trak=args.no_trak,
            trak_proj_dim=args.trak_proj_dim,
            hybrid_m=args.hybrid_m,
            timing_queries=args.timing_queries,
            log=log,
        )
        extra = all_scores(settings, Attributed(s.net, s.shards, s.queries, s.tok.eot_id), scores_at_N, costs)
        np.savez(spath, **scores_at_N)  # type: ignore[arg-type]  # numpy stubs: names to arrays
        spath.with_suffix(".json").write_text(json.dumps(extra))
    if add_bergson(args, s, work, scores_at_N, extra):
        np.savez(spath, **scores_at_N)  # type: ignore[arg-type]
        spath.with_suffix(".json").write_text(json.dumps(extra))
    if "bergson" not in scores_at_N:
        _strs(extra["notes"]).setdefault("bergson", BERGSON_NOT_RUN)
    return extra, spath


def judge(s: Setup, scores_at_N: Scores, cache_meta: dict[str, Json]) -> tuple[dict[str, Json], dict[str, Json]]:
    """Every method's agreement with ``full`` (and ``ekfac``) and its planted-fact retrieval."""
    agreement: dict[str, Json] = {}
    for name, S in scores_at_N.items():
        agreement[name] = {
            "top10_vs_full": topk_overlap(S, scores_at_N["full"], 10),
            "top100_vs_full": topk_overlap(S, scores_at_N["full"], min(100, s.N)),
        }
        if "ekfac" in scores_at_N:
            agreement[name]["top10_vs_ekfac"] = topk_overlap(S, scores_at_N["ekfac"], 10)
        agreement[name].update(cache_meta.get(name, {}))
    n_planted = len(s.planted_q)
    planted = {name: retrieval_metrics(S[:n_planted], s.fact_of, s.relevant, k=10) for name, S in scores_at_N.items()}
    return agreement, planted


def lds_of(
    s: Setup, scores_at_N: Scores, subsets: list[np.ndarray], losses: np.ndarray, t0: float
) -> dict[str, LDS | Json]:
    """LDS of every method against the seed-averaged retrained losses, and its setup."""
    M, seeds = losses.shape[0], losses.shape[1]
    y = losses.mean(1)  # (M, Q) seed-averaged retrained losses
    out: dict[str, LDS | Json] = {name: lds(S, subsets, y, len(s.planted_q)) for name, S in scores_at_N.items()}
    out["_setup"] = {
        "subsets": M,
        "seeds": seeds,
        "subset_size": s.N // 2,
        "queries": len(s.queries),
        "seconds": time.perf_counter() - t0,
    }
    return out


def _summary(
    agreement: dict[str, Json], lds: dict[str, LDS | Json], cache_meta: dict[str, Json], out_path: Path, d: int
) -> Json:
    """The headline numbers (issue 13): the compact cache's bytes/token, its top-10 overlap with the full
    prototype-space scores and its LDS (this run), EK-FAC's LDS (this run), the query-time exponent and the
    equal-work speed-up (read from the scaling / costs benches' JSON)."""
    name = "cached-compact"
    qt = results_number("attribution-scaling.json", "query_time_exponent")
    sp = results_number("attribution-costs.json", "speedup_vs_ekfac_equal_work")

    def get(table: dict[str, LDS | Json] | dict[str, Json], method: str, key: str) -> object:
        return obj(table.get(method, {})).get(key)

    meta_keys = ("projection", "r", "dtype", "prune", "id_encoding")
    return {
        "cached_method": f"{name}: " + json.dumps({k: get(cache_meta, name, k) for k in meta_keys}),
        "cache_bytes_per_token": get(cache_meta, name, "bytes_per_token"),
        "top10_overlap_vs_full": get(agreement, name, "top10_vs_full"),
        "lds_cached": get(lds, name, "mean"),
        "lds_cached_ci95": get(lds, name, "ci95"),
        "lds_ekfac": get(lds, "ekfac", "mean"),
        "lds_ekfac_ci95": get(lds, "ekfac", "ci95"),
        "lds_full": get(lds, "full", "mean"),
        "lds_full_ci95": get(lds, "full", "ci95"),
        "lds_cached_default_r": get(lds, f"cached-r{d}", "mean"),  # AttributionConfig(): r = d, orthogonal
        "lds_cached_default_r_ci95": get(lds, f"cached-r{d}", "ci95"),
        "lds_trak": get(lds, "trak", "mean"),
        "lds_trak_ci95": get(lds, "trak", "ci95"),
        "lds_hybrid": {k: obj(v)["mean"] for k, v in lds.items() if k.startswith("hybrid")},
        "query_time_exponent": qt["value"],
        "query_time_exponent_source": qt,
        "speedup_vs_ekfac_equal_work": sp["value"],
        "speedup_vs_ekfac_equal_work_source": sp,
        "this_file": str(out_path),
    }


# ----- main -------------------------------------------------------------------------------------------
def add_method_options(ap: argparse.ArgumentParser) -> None:
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
        "bergson installed; see src/prismlm/integrations/bergson_driver.py)",
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


def add_compression_options(ap: argparse.ArgumentParser) -> None:
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


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small smoke profile (a few minutes)")
    ap.add_argument("--preset", default="tiny", help="model preset (with the d=64, K=128 overrides below)")
    add_set_option(ap, "config override, e.g. model.n_embd=128 (repeatable)")
    add_method_options(ap)
    add_compression_options(ap)
    return ap, ap.parse_args()


def print_summary(payload: Json, r_time: int, out_path: Path) -> None:
    costs, agreement, planted = _rows(payload["costs"]), _dd(payload["agreement"]), _dd(payload["planted"])
    lds_ = _dd(payload["lds"])
    best_r = f"cached-r{r_time}"
    parts = [f"attribution n={payload['num_train']}"]
    if costs:
        big = costs[-1]
        sp = big.get("speedup_per_query_cached_vs_ekfac")
        parts.append(
            f"cached r={r_time} {num(obj(big['cached'])['per_query_s']) * 1e3:.1f} ms/query"
            + (f", {num(sp):.0f}× faster than EK-FAC per query (batched)" if sp else "")
        )
    parts.append(f"top10 vs full {num(agreement.get(best_r, {}).get('top10_vs_full', float('nan'))):.2f}")
    shown = ("full", best_r, "ekfac", "kf-identity")
    parts.append("planted R@10 " + " ".join(f"{k}={num(v['recall@10']):.2f}" for k, v in planted.items() if k in shown))
    if lds_:
        names = ("full", "full-rec", best_r, "ekfac", "kf-identity", "trak", "wn-dot")
        parts.append(
            "LDS "
            + " ".join(
                f"{k}={num(lds_[k]['mean']):.2f}"
                for k in lds_
                if not k.startswith("_") and (k in names or k.startswith(("cached-compact", "hybrid")))
            )
        )
    print("; ".join(parts) + f" → {out_path}")


def main() -> None:
    ap, args = parse_args()
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
        if not args.shards:
            ap.error("--run needs --shards")
        return compression_on_run(args, out_path, env, t_start)
    s = setup(args, prof, work)
    if args.compression:
        study = storage_study(s.net, s.shards, s.queries, study_settings(args), work, log)
        head = {"benchmark": "attribution-compression", "profile": "quick" if args.quick else "default"}
        rest = {"environment": env, "load_average_end": load_average(), "total_seconds": time.perf_counter() - t_start}
        write_json(out_path, {**head, "settings": {**prof, **vars(args)}, "config": s.cfg.to_dict(), **study, **rest})
        print(compression_summary(study, out_path))
        return
    sizes = [] if args.no_costs else sorted({max(8, int(round(f * s.N))) for f in prof["fractions"]})
    scores_at_N: Scores = {}
    r_time = min(32, s.cfg.model.n_embd)
    costs = [costs_at(args, s, work, n, r_time, n == sizes[-1], scores_at_N) for n in sizes]
    M, seeds = prof["lds_subsets"], prof["lds_seeds"]
    if M > 0:
        t_lds = time.perf_counter()
        subsets, losses = lds_losses(args, s, work, M, seeds)
        if args.lds_range:
            first, stop = args.lds_range
            log(f"LDS subsets {first}..{stop - 1} trained under {work / 'lds' / s.cfg_hash}; exiting (--lds-range)")
            return
    extra, spath = scores_and_extra(args, s, work, prof, r_time, scores_at_N, costs)
    cache_meta = _dd(extra["cache_meta"])
    agreement, planted = judge(s, scores_at_N, cache_meta)
    lds_ = lds_of(s, scores_at_N, subsets, losses, t_lds) if M > 0 else {}
    payload = {
        "benchmark": "attribution",
        "profile": "quick" if args.quick else "default",
        "settings": prof,
        "config": s.cfg.to_dict(),
        "num_train": s.N,
        "block_size": s.T,
        "queries": {"planted": len(s.planted_q), "heldout": len(s.val_q)},
        "relevant_per_fact": [sorted(r) for r in s.relevant],
        "costs": costs,
        "agreement": agreement,
        "planted": planted,
        "lds": lds_,
        "method_costs": extra["method_costs"],
        "hybrid": extra["hybrid"],
        "curvature": extra["curvature"],
        "scores_file": str(spath),
        "notes": extra["notes"],
        "summary": _summary(agreement, lds_, cache_meta, out_path, s.cfg.model.n_embd),
        "environment": env,
        "load_average_end": load_average(),
        "total_seconds": time.perf_counter() - t_start,
    }
    write_json(out_path, payload)
    print_summary(payload, r_time, out_path)


def _dd(x: object) -> dict[str, Json]:
    assert isinstance(x, dict), x
    return x


def _strs(x: object) -> dict[str, str]:
    assert isinstance(x, dict), x
    return x


def _rows(x: object) -> list[Json]:
    assert isinstance(x, list), x
    return x


if __name__ == "__main__":
    main()
