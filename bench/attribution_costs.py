#!/usr/bin/env python
"""Attribution costs at equal work: the postings cache vs kronfluence EK-FAC, on the same queries.

Why this bench
    ``attribution.py`` timed the cache's warm per-query median (its build excluded) against one cold
    EK-FAC call, on different query sets. Here both methods answer the *same* Q queries and every cost is
    reported side by side at equal work, at several model and training-set sizes, and the per-query costs
    are fitted against model and corpus size to project the speed-up at gpt2-124m scale.

Setup
    The planted-fact corpus of ``attribution.py`` (``prismlm.tda.planted``; background documents plus made-up
    facts and distractors), tokenised with ``bpe-512``. ``--sizes`` PRISM models (``d:layers:K:k``) are
    trained on it with the same recipe (``--steps``; cached under ``--workdir``). The queries: the planted
    paraphrases (answer tokens measured) then held-out validation windows (all tokens measured), Q =
    ``--queries`` in all; the same list for every method and size.

Methods (what a user would run)
    ``cached``: ``build_cache`` with the default ``AttributionConfig()`` (r = d, orthogonal, float32);
    ``cached-compact``: ``AttributionConfig(projection="pca-local", r=min(48, d), dtype="int4", prune=0.1,
    id_encoding="delta")``; ``ekfac``: ``KronfluenceBaseline`` (every ``nn.Linear``, kronfluence's damping).

Costs at equal work (seconds, 1 torch thread)
    - ``oneoff_s``: cached: the whole ``build_cache`` call (curvature pass + projection fit + postings, written
      to disk); EK-FAC: fitting the factors (``KronfluenceBaseline`` construction: covariance, eigen, lambda).
    - ``per_query_batch_s``: one call answering all Q queries, ÷ Q. Cached: ``query_gradients`` of the Q
      queries + ``cache.scores``; EK-FAC: ``kb.scores(all Q, query_batch_size=Q)`` (its query gradients +
      one pass recomputing every training gradient).
    - ``single_query_s``: one query, warm (cache open / factors fitted, same ``Analyzer``). kronfluence's
      ``compute_pairwise_scores`` reloads the factors from disk on every call (``load_all_factors``), so
      a warm EK-FAC call still pays that load: it is timed on its own too (``factor_load_s``). The cached
      single query (milliseconds) is timed 5 times per round (median), EK-FAC's once.
    - break-even number of queries and total cost at 1, 100 and 10⁴ queries (one-off + single for 1 query,
      one-off + q × per_query_batch otherwise).
    kronfluence calls ``gc.collect()`` four times per scoring call and at every factor stage
    (``release_memory``); in a process holding torch, the models and the corpus each full collection walked
    the heap for ~0.8 s on this machine, a per-call cost that depends on the caller's heap, not on the
    attribution work, and that would flatten the fits. The bench therefore ``gc.freeze()``s the heap
    before timing (a one-line fix a user can apply; same for both methods) and records what one collection
    costs unfrozen (``gc_collect_unfrozen_s``); ``--no-gc-freeze`` times kronfluence as called naively.
    Repeats alternate the methods in each round (same query for both in a single-query round); medians over
    ``--repeats`` rounds. One-off costs are measured once (EK-FAC's fitting is the expensive one). Peak RSS
    per phase. Top-10 / top-100 overlap of each cached variant with EK-FAC on the Q queries: the methods did
    comparable work (agreement, not correctness: see ``attribution.py`` for planted-fact recall and LDS).

Fits and projection
    Every cost c is fitted by least squares in log–log: vs the parameter count P over the model sizes at the
    full training set, vs the training tokens D over ``--fractions`` of the training sequences at the
    ``--corpus-model`` size (exponent, R² each), and jointly log c = a + α log P + β log D over all measured
    points. The joint fit is evaluated at ``--project-params`` (gpt2-124m: 124M) and ``--project-sequences``
    × 1,024 tokens; projected speed-up = c_ekfac(P*, D*) / c_cached(P*, D*). It is an extrapolation over
    ~3 decades of P from tiny models on one CPU: it ignores the change of sequence length (attention),
    of K and of hardware, and treats the cache's per-query cost as a power law although it is a fixed
    query backward plus a postings read that grows with D·k/K; at tiny sizes fixed per-call overheads
    flatten the fitted exponents. A second projection (``work_model_projection``) scales the largest
    measured point by the cost structure instead (EK-FAC call ∝ P·D; cache: query gradients ∝ P, postings
    read ∝ D·k²·r/K; formula in the JSON and in ``work_model_projection``'s docstring).

Results: JSON at ``--out`` (default ``bench/results/attribution-costs[-quick].json``; the object
``speedup_vs_ekfac_equal_work`` is the headline) and one summary line on stdout.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, profile_from_args, warn_if_busy, write_json
from attribution import MODEL_SETS, overlap

from prismlm.config import AttributionConfig, RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.eval.resources import current_peak_rss_mib, reset_peak_rss
from prismlm.tda.baselines import KronfluenceBaseline
from prismlm.tda.cache import build_cache
from prismlm.tda.influence import query_gradients
from prismlm.tda.planted import build_planted_corpus
from prismlm.train import load_checkpoint, train

# default: ~2.4k training sequences of 64 tokens (as attribution.py), three widths × depths (32k, 141k, 883k
# parameters); measured under a load average of ~5–7 on 2 cores: ~8 min with the models trained, + ~1.5 min to
# train them; the largest model's EK-FAC factors ~1.5–2.5 min. quick: a smoke run (~1 min; its sizes are too
# close together for meaningful fits).
PROFILES: dict[str, dict[str, Any]] = {
    "default": dict(
        background=160,
        doc_chars=2000,
        facts=8,
        copies=3,
        steps=300,
        batch=16,
        sizes=["32:1:32:4", "64:2:64:4", "128:4:128:4"],
        fractions=[0.25, 0.5, 1.0],
        corpus_model=1,
        queries=16,
        repeats=3,
    ),
    "quick": dict(
        background=30,
        doc_chars=1200,
        facts=4,
        copies=2,
        steps=60,
        batch=8,
        sizes=["16:1:16:4", "32:1:32:4", "32:2:64:4"],
        fractions=[0.25, 0.5, 1.0],
        corpus_model=2,
        queries=8,
        repeats=3,
    ),
}
CHEAP_INNER = 5  # a cached single query is timed this many times per round (median): it takes milliseconds
GPT2_124M_PARAMS = 124e6
GPT2_BLOCK = 1024


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def timed(fn, *a, **kw) -> tuple[Any, float, float]:
    reset_peak_rss()
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0, current_peak_rss_mib()


def compact_config(d: int, n: int) -> AttributionConfig:
    return AttributionConfig(
        projection="pca-local", r=min(48, d), dtype="int4", prune=0.1, id_encoding="delta", max_sequences=n
    )


def power_fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Least squares log y = log a + b log x: {"exponent": b, "coef": a, "r2"}."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    A = np.stack([np.ones_like(lx), lx], 1)
    coef, *_ = np.linalg.lstsq(A, ly, rcond=None)
    res = ly - A @ coef
    ss = float(((ly - ly.mean()) ** 2).sum())
    return {
        "exponent": float(coef[1]),
        "coef": float(np.exp(coef[0])),
        "r2": float(1 - (res**2).sum() / ss) if ss > 0 else float("nan"),
        "points": len(lx),
    }


def joint_fit(P: np.ndarray, D: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Least squares log y = a + α log P + β log D."""
    A = np.stack([np.ones(len(P)), np.log(P), np.log(D)], 1)
    ly = np.log(y)
    coef, *_ = np.linalg.lstsq(A, ly, rcond=None)
    res = ly - A @ coef
    ss = float(((ly - ly.mean()) ** 2).sum())
    return {
        "log_a": float(coef[0]),
        "alpha_params": float(coef[1]),
        "beta_tokens": float(coef[2]),
        "r2": float(1 - (res**2).sum() / ss) if ss > 0 else float("nan"),
        "points": len(ly),
    }


def predict(fit: dict[str, float], P: float, D: float) -> float:
    return float(np.exp(fit["log_a"] + fit["alpha_params"] * np.log(P) + fit["beta_tokens"] * np.log(D)))


def break_even(oneoff_c: float, pq_c: float, oneoff_e: float, pq_e: float) -> dict[str, Any]:
    """Queries q at which one-off + q·per-query is equal for both (None: one is cheaper at every q ≥ 0)."""
    d_one, d_pq = oneoff_c - oneoff_e, pq_e - pq_c
    if d_pq == 0:
        return {"queries": None, "cheaper_always": "cached" if d_one < 0 else "ekfac"}
    q = d_one / d_pq
    if q <= 0:
        return {"queries": None, "cheaper_always": "cached" if pq_c < pq_e else "ekfac"}
    return {"queries": q, "cheaper_below": "ekfac" if d_one > 0 else "cached"}


def totals(row: dict[str, Any]) -> dict[str, float]:
    return {
        str(q): row["oneoff_s"] + (row["single_query_s"] if q == 1 else q * row["per_query_batch_s"])
        for q in (1, 100, 10_000)
    }


def work_model_projection(
    row: dict[str, Any], P_star: float, D_star: float, K_star: int, k_star: int, d_star: int, Q: int
) -> dict[str, Any]:
    """A second projection, from the cost structure instead of fitted exponents, anchored at one measured row.

    EK-FAC: every scoring call recomputes the gradient of every training sequence, so a call costs ∝ P·D
    (``c* = c · (P*/P) · (D*/D)``, per-query and single alike; factor fitting too: covariance and lambda
    passes; the eigendecompositions are left out). Cached: the query's forward/backward ∝ P (the measured
    ``batch_query_gradients_s``), plus the postings read, ∝ (active prototypes of the query ∝ k) × (list
    length ∝ D·k/K) × r: ``scores* = scores · (D*/D) · (k*/k)² · (K/K*) · (r*/r)``; the single query is split
    in the same proportions as the batch. One-off: curvature + postings passes ∝ P·D."""
    m = row["model"]
    sP, sD = P_star / row["params"], D_star / row["tokens"]
    out: dict[str, Any] = {
        "anchor": {"model": m["spec"], "params": row["params"], "tokens": row["tokens"]},
        "target": {"params": P_star, "tokens": D_star, "num_prototypes": K_star, "top_k": k_star, "n_embd": d_star},
    }
    e = row["ekfac"]
    ek = {
        "oneoff_s": e["oneoff_s"] * sP * sD,
        "per_query_batch_s": e["per_query_batch_s"] * sP * sD,
        "single_query_s": e["single_query_s"] * sP * sD,
    }
    out["ekfac_seconds"] = ek
    for name in ("cached", "cached-compact"):
        c = row[name]
        r_star = d_star if name == "cached" else min(48, d_star)
        s_read = sD * (k_star / m["top_k"]) ** 2 * (m["num_prototypes"] / K_star) * (r_star / c["config"]["r"])
        qg = c["batch_query_gradients_s"] / Q
        rd = max(0.0, c["per_query_batch_s"] - qg)
        frac = qg / max(c["per_query_batch_s"], 1e-12)
        pq = qg * sP + rd * s_read
        single = c["single_query_s"] * (frac * sP + (1 - frac) * s_read)
        cs = {"oneoff_s": c["oneoff_s"] * sP * sD, "per_query_batch_s": pq, "single_query_s": single}
        out[name] = {
            "seconds": cs,
            "speedup_vs_ekfac": {k.removesuffix("_s"): ek[k] / cs[k] for k in cs},
            "query_gradient_share_measured": frac,
        }
    return out


def train_model(spec: str, prof: dict[str, Any], shards: Any, work: Path, seed: int) -> tuple[Any, dict[str, Any]]:
    d, L, K, k = (int(v) for v in spec.split(":"))
    heads = 1 if d < 32 else (2 if d < 128 else 4)
    sets = {
        **MODEL_SETS,
        "model.n_embd": d,
        "model.n_layer": L,
        "model.n_head": heads,
        "model.prototypes.num_prototypes": K,
        "model.prototypes.top_k": k,
        "train.max_steps": prof["steps"],
        "train.batch_size": prof["batch"],
        "train.warmup_steps": max(1, prof["steps"] // 20),
        "train.device": "cpu",
        "train.seed": 1337 + seed,
        "data.tokenizer": "bpe-512",
    }
    cfg = RunConfig.from_name("tiny").override(sets)
    h = hashlib.sha256((cfg.to_json() + shards.manifest["key"]).encode()).hexdigest()[:12]
    run_dir = work / f"model-{spec.replace(':', '-')}-{h}"
    t_train = None
    if not (run_dir / "checkpoints" / "latest").exists():
        log(f"training {spec} ({prof['steps']} steps) → {run_dir}")
        t0 = time.perf_counter()
        train(cfg, run_dir, shards=shards, progress=False)
        t_train = time.perf_counter() - t0
    net = load_checkpoint(run_dir).model.eval()
    n_params = sum(p.numel() for p in net.parameters())
    n_linear = sum(
        m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
        for m in net.modules()
        if type(m) is torch.nn.Linear
    )
    return net, {
        "spec": spec,
        "n_embd": d,
        "n_layer": L,
        "num_prototypes": K,
        "top_k": k,
        "n_head": heads,
        "params": n_params,
        "params_tracked_by_kronfluence": n_linear,
        "train_seconds": t_train,
    }


def measure(
    net: Any, shards: Any, queries: list, pad_id: int, n: int, repeats: int, work: Path, freeze: bool
) -> dict[str, Any]:
    """All costs of the three methods at one (model, training-set size), interleaved."""
    Q, d = len(queries), net.config.n_embd
    T = net.config.block_size
    out: dict[str, Any] = {"num_train": n, "tokens": n * T}
    t0 = time.perf_counter()
    gc.collect()  # what each of kronfluence's gc.collect() calls costs on this process's heap, unfrozen
    out["gc_collect_unfrozen_s"] = time.perf_counter() - t0
    if freeze:
        gc.freeze()
    cfgs = {"cached": AttributionConfig(max_sequences=n), "cached-compact": compact_config(d, n)}
    caches, scores = {}, {}
    for name, cfg in cfgs.items():
        folder = work / f"cache-{name}-{n}"
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()
        cache, t, mem = timed(build_cache, net, shards, cfg, out=folder)
        caches[name] = cache
        out[name] = {
            "config": {
                "r": cache.r,
                "projection": cfg.projection,
                "dtype": cfg.dtype,
                "prune": cfg.prune,
                "id_encoding": cfg.id_encoding,
            },
            "oneoff_s": t,
            "curvature_s": cache.manifest.get("curvature_seconds"),
            "postings_s": cache.manifest.get("postings_seconds"),
            "peak_rss_mib_build": mem,
            "bytes_per_token": cache.manifest.get("bytes_per_token"),
            "cache_bytes": cache.nbytes(),
        }
    gc.collect()
    kb, t_fit, mem = timed(KronfluenceBaseline, net, shards, strategy="ekfac", max_sequences=n, batch_size=16)
    out["ekfac"] = {"oneoff_s": t_fit, "peak_rss_mib_factors": mem, "factor_timings": dict(kb.timings)}

    batch = {name: [] for name in (*cfgs, "ekfac")}
    single = {name: [] for name in (*cfgs, "ekfac")}
    load, qsum = [], []
    qgrad: dict[str, list[float]] = {name: [] for name in cfgs}
    for rep in range(repeats):
        for name, cache in caches.items():  # batch of Q: query gradients + scores, one call
            reset_peak_rss()
            t0 = time.perf_counter()
            qg = query_gradients(net, queries)
            t1 = time.perf_counter()
            S = cache.scores(qg, Q)
            batch[name].append(time.perf_counter() - t0)
            qgrad[name].append(t1 - t0)
            out[name]["peak_rss_mib_query"] = current_peak_rss_mib()
            scores[name] = S.numpy()
        S, t, mem_q = timed(kb.scores, queries, pad_id, query_batch_size=Q)
        batch["ekfac"].append(t)
        out["ekfac"]["peak_rss_mib_scores"] = mem_q
        scores["ekfac"] = S.numpy()
        qi = rep % Q  # the same single query for every method in this round
        qsum.append(qi)
        for name, cache in caches.items():
            inner = []
            for _ in range(CHEAP_INNER):
                t0 = time.perf_counter()
                cache.scores(query_gradients(net, [queries[qi]]), 1)
                inner.append(time.perf_counter() - t0)
            single[name].append(statistics.median(inner))
        _, t, _ = timed(kb.scores, [queries[qi]], pad_id, query_batch_size=1)
        single["ekfac"].append(t)
        t0 = time.perf_counter()
        kb.analyzer.load_all_factors(factors_name=kb.strategy)
        load.append(time.perf_counter() - t0)
    for name in batch:
        out[name].update(
            {
                "batch_s": statistics.median(batch[name]),
                "per_query_batch_s": statistics.median(batch[name]) / Q,
                "single_query_s": statistics.median(single[name]),
                "batch_samples_s": batch[name],
                "single_samples_s": single[name],
            }
        )
    for name in cfgs:
        out[name]["batch_query_gradients_s"] = statistics.median(qgrad[name])
    out["ekfac"]["factor_load_s"] = statistics.median(load)
    out["single_query_ids"] = qsum
    e = out["ekfac"]
    for name in cfgs:
        c = out[name]
        c["top10_vs_ekfac"] = overlap(scores[name], scores["ekfac"], 10)
        c["top100_vs_ekfac"] = overlap(scores[name], scores["ekfac"], min(100, n))
        c["speedup_vs_ekfac"] = {
            "oneoff": e["oneoff_s"] / c["oneoff_s"],
            "per_query_batch": e["per_query_batch_s"] / c["per_query_batch_s"],
            "single_query": e["single_query_s"] / c["single_query_s"],
        }
        c["break_even_vs_ekfac"] = break_even(
            c["oneoff_s"], c["per_query_batch_s"], e["oneoff_s"], e["per_query_batch_s"]
        )
        c["total_s"] = totals(c)
    e["total_s"] = totals(e)
    out["cached-compact"]["top10_vs_cached"] = overlap(scores["cached-compact"], scores["cached"], 10)
    kb.close()
    for folder in (work / f"cache-{name}-{n}" for name in cfgs):
        shutil.rmtree(folder, ignore_errors=True)
    del kb, caches
    gc.unfreeze()
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke profile (≤ 2 min)")
    ap.add_argument("--background", type=int, help="background documents of the planted-fact corpus")
    ap.add_argument("--facts", type=int, help="planted facts (2 paraphrased queries each)")
    ap.add_argument("--steps", type=int, help="training steps of each model")
    ap.add_argument("--sizes", nargs="+", help="model sizes d:layers:K:k (≥ 3 for the parameter fit)")
    ap.add_argument("--fractions", type=float, nargs="+", help="training-set sizes (fractions of the sequences)")
    ap.add_argument("--corpus-model", type=int, help="index into --sizes of the model the corpus-size fit uses")
    ap.add_argument("--queries", type=int, help="Q: queries answered by every method (planted first, then held-out)")
    ap.add_argument("--repeats", type=int, help="timing rounds (median), methods alternating in each round")
    ap.add_argument("--project-params", type=float, default=GPT2_124M_PARAMS, help="projection: parameter count")
    ap.add_argument(
        "--project-sequences", type=float, default=1e5, help=f"projection: training sequences of {GPT2_BLOCK} tokens"
    )
    ap.add_argument("--project-prototypes", type=int, default=8192, help="work-model projection: K (gpt2-124m preset)")
    ap.add_argument("--project-top-k", type=int, default=8, help="work-model projection: k")
    ap.add_argument("--project-embd", type=int, default=768, help="work-model projection: d (r = d by default)")
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="time kronfluence with its gc.collect() calls walking the whole heap (see the docstring)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workdir", default=None, help="corpus/shards/models (default bench/runs/attribution-costs[-quick])"
    )
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/attribution-costs[-quick].json)")
    args = ap.parse_args()
    prof = profile_from_args(PROFILES, args)
    if len(prof["sizes"]) < 3 or len(prof["fractions"]) < 3:
        ap.error("the fits need ≥ 3 --sizes and ≥ 3 --fractions")
    tag = "attribution-costs-quick" if args.quick else "attribution-costs"
    work = Path(args.workdir) if args.workdir else RUNS_DIR / tag
    out_path = Path(args.out) if args.out else RESULTS_DIR / f"{tag}.json"
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"kronfluence")
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    env = environment("cpu", args.seed)
    t_start = time.perf_counter()

    corpus_dir = work / f"corpus-b{prof['background']}-f{prof['facts']}x{prof['copies']}-s{args.seed}"
    pc = build_planted_corpus(
        corpus_dir,
        n_facts=prof["facts"],
        copies=prof["copies"],
        n_background=prof["background"],
        doc_chars=prof["doc_chars"],
        seed=args.seed,
    )
    shards = prepare_shards(str(pc.path), "bpe-512", corpus_dir / "shards", val_fraction=0.05, show_progress=False)
    tok = shards.tokenizer
    T = RunConfig.from_name("tiny").model.block_size
    N = shards.train.num_sequences(T)
    planted_q, _ = pc.queries(tok)
    nv = shards.val.num_sequences(32)
    Qn = prof["queries"]
    val_q = [
        ([tok.eot_id] + shards.val.sequence(j, 32).tolist(), 1)
        for j in np.linspace(0, max(0, nv - 1), num=max(0, Qn - len(planted_q)), dtype=int).tolist()
    ]
    queries = (planted_q + val_q)[:Qn]
    Q = len(queries)
    log(f"{N} training sequences of {T} tokens; {Q} queries ({min(Q, len(planted_q))} planted)")

    sizes = sorted({max(8, int(round(f * N))) for f in prof["fractions"]})
    rows: list[dict[str, Any]] = []
    models = []
    for i, spec in enumerate(prof["sizes"]):
        net, info = train_model(spec, prof, shards, work, args.seed)
        models.append(info)
        for n in sizes if i == prof["corpus_model"] else [N]:
            row = {
                "model": info,
                "params": info["params"],
                **measure(net, shards, queries, tok.eot_id, n, prof["repeats"], work, not args.no_gc_freeze),
            }
            row["load_average"] = load_average()
            rows.append(row)
            c, cc, e = row["cached"], row["cached-compact"], row["ekfac"]
            log(
                f"{spec} n={n}: one-off cached {c['oneoff_s']:.1f}s / compact {cc['oneoff_s']:.1f}s / ekfac "
                f"{e['oneoff_s']:.1f}s; per query (batch of {Q}) {c['per_query_batch_s'] * 1e3:.1f} / "
                f"{cc['per_query_batch_s'] * 1e3:.1f} / {e['per_query_batch_s'] * 1e3:.0f} ms; single "
                f"{c['single_query_s'] * 1e3:.1f} / {cc['single_query_s'] * 1e3:.1f} / {e['single_query_s'] * 1e3:.0f} ms "
                f"(factor load {e['factor_load_s'] * 1e3:.0f} ms); top10 vs ekfac {c['top10_vs_ekfac']:.2f} / "
                f"{cc['top10_vs_ekfac']:.2f}"
            )
        del net
        gc.collect()

    # --- fits
    methods, metrics = ("cached", "cached-compact", "ekfac"), ("oneoff_s", "per_query_batch_s", "single_query_s")
    by_params = [r for r in rows if r["num_train"] == N]
    cm = prof["sizes"][prof["corpus_model"]]
    by_tokens = [r for r in rows if r["model"]["spec"] == cm]
    Pp = np.array([r["params"] for r in by_params], float)
    Dt = np.array([r["tokens"] for r in by_tokens], float)
    P_all = np.array([r["params"] for r in rows], float)
    D_all = np.array([r["tokens"] for r in rows], float)
    P_star, D_star = args.project_params, args.project_sequences * GPT2_BLOCK
    fits: dict[str, Any] = {}
    projected: dict[str, Any] = {}
    for m in methods:
        fits[m], projected[m] = {}, {}
        for met in metrics:
            jf = joint_fit(P_all, D_all, np.array([r[m][met] for r in rows]))
            fits[m][met] = {
                "vs_params": power_fit(Pp, np.array([r[m][met] for r in by_params])),
                "vs_tokens": power_fit(Dt, np.array([r[m][met] for r in by_tokens])),
                "joint": jf,
            }
            projected[m][met] = predict(jf, P_star, D_star)
    largest = by_params[-1]
    speed: dict[str, Any] = {
        "definition": "EK-FAC seconds ÷ cached seconds for the same queries. per_query_batch: one call answering "
        f"all Q={Q} queries ÷ Q on both sides; single_query: one query, cache open / factors already "
        "fitted (kronfluence reloads them from disk inside the call); oneoff: whole build_cache vs "
        "factor fitting.",
        "measured_at": {
            "model": largest["model"]["spec"],
            "params": largest["params"],
            "num_train": N,
            "tokens": N * T,
            "queries": Q,
        },
        "projected_power_law_at": {
            "params": P_star,
            "sequences": args.project_sequences,
            "tokens": D_star,
            "formula": "c(P, D) = exp(a) · P^α · D^β per method and cost, least squares in log–log "
            "over every measured (model, training-set) point; speed-up = "
            "c_ekfac(P*, D*) / c_cached(P*, D*)",
            "caveat": "extrapolation from tiny CPU models (≤ "
            f"{int(P_all.max()):,} parameters, ≤ {int(D_all.max()):,} tokens) to "
            f"{P_star:.3g} parameters and {D_star:.3g} tokens; ignores sequence length, "
            "K and hardware",
        },
    }
    for name in ("cached", "cached-compact"):
        speed[name] = {
            "measured": {
                **largest[name]["speedup_vs_ekfac"],
                "top10_vs_ekfac": largest[name]["top10_vs_ekfac"],
                "break_even_queries": largest[name]["break_even_vs_ekfac"],
            },
            "projected_power_law": {k.removesuffix("_s"): projected["ekfac"][k] / projected[name][k] for k in metrics},
            "projected_power_law_seconds": projected[name],
        }
    speed["ekfac_projected_power_law_seconds"] = projected["ekfac"]
    speed["work_model_projection"] = work_model_projection(
        largest, P_star, D_star, args.project_prototypes, args.project_top_k, args.project_embd, Q
    )

    payload = {
        "benchmark": "attribution-costs",
        "profile": "quick" if args.quick else "default",
        "settings": {**prof, **{k: v for k, v in vars(args).items() if k not in prof}},
        "num_train": N,
        "block_size": T,
        "queries": {"count": Q, "planted": min(Q, len(planted_q))},
        "models": models,
        "rows": rows,
        "fits": fits,
        "speedup_vs_ekfac_equal_work": speed,
        "environment": env,
        "load_average_end": load_average(),
        "total_seconds": time.perf_counter() - t_start,
    }
    write_json(out_path, payload)
    c, e = largest["cached"], largest["ekfac"]
    sp = speed["cached"]
    fe = fits["ekfac"]["per_query_batch_s"]
    print(
        f"attribution costs ({largest['model']['spec']}, {N} seq, Q={Q}, same queries): one-off cached "
        f"{c['oneoff_s']:.1f}s vs EK-FAC {e['oneoff_s']:.1f}s; per query (batch) {c['per_query_batch_s'] * 1e3:.1f} vs "
        f"{e['per_query_batch_s'] * 1e3:.0f} ms ({sp['measured']['per_query_batch']:.0f}×); single warm "
        f"{c['single_query_s'] * 1e3:.1f} vs {e['single_query_s'] * 1e3:.0f} ms ({sp['measured']['single_query']:.0f}×); "
        f"EK-FAC per query ∝ P^{fe['vs_params']['exponent']:.2f} (R² {fe['vs_params']['r2']:.2f}) "
        f"D^{fe['vs_tokens']['exponent']:.2f} (R² {fe['vs_tokens']['r2']:.2f}); projected at {P_star:.3g} params, "
        f"{D_star:.3g} tokens: power law {sp['projected_power_law']['per_query_batch']:.0f}× batch, "
        f"{sp['projected_power_law']['single_query']:.0f}× single (extrapolation; work model "
        f"{speed['work_model_projection']['cached']['speedup_vs_ekfac']['per_query_batch']:.0f}× / "
        f"{speed['work_model_projection']['cached']['speedup_vs_ekfac']['single_query']:.0f}×) → {out_path}"
    )


if __name__ == "__main__":
    main()
