#!/usr/bin/env python
"""Attribution costs at equal work: the postings cache vs kronfluence EK-FAC, on the same queries.

Both methods answer the same Q queries of the planted-fact corpus (``prismlm.tda.planted``) at ``--sizes``
models (``d:layers:K:k``) and ``--fractions`` of the training set: one-off cost (``build_cache`` vs fitting the
factors), per query in one batch of Q, one warm query, peak RSS, top-10/100 overlap with EK-FAC, break-even
query counts. Every cost is fitted in log–log against parameters P and training tokens D, and projected to
gpt2-124m twice (the joint power law, and a work model anchored at the largest point). kronfluence's per-call
``gc.collect()`` is neutralised by ``gc.freeze()`` (``--no-gc-freeze``: called naively).

Run: ``PYTHONPATH=src python bench/attribution_costs.py [--quick]``. Writes
``bench/results/attribution-costs[-quick].json`` (headline: ``speedup_vs_ekfac_equal_work``) and one summary
line. How each cost is taken and the measurements: docs/results.md ("4. Cost at equal work").
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import shutil
import statistics
import time
import warnings
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
    environment,
    load_average,
    log,
    num,
    obj,
    planted_corpus,
    profile_from_args,
    warn_if_busy,
    write_json,
)

from prismlm.config import AttributionConfig, RunConfig
from prismlm.data.shards import ShardSet, prepare_shards
from prismlm.eval.resources import current_peak_rss_mib, reset_peak_rss, timed_call
from prismlm.model import PrismLM
from prismlm.tda.baselines import KronfluenceBaseline
from prismlm.tda.cache import AttributionCache, build_cache
from prismlm.tda.evaluation import topk_overlap
from prismlm.tda.influence import query_gradients
from prismlm.train import load_checkpoint, train


class Profile(TypedDict):
    background: int
    doc_chars: int
    facts: int
    copies: int
    steps: int
    batch: int
    sizes: list[str]
    fractions: list[float]
    corpus_model: int
    queries: int
    repeats: int


# default: ~2.4k training sequences of 64 tokens (as attribution.py), three widths × depths (32k, 141k, 883k
# parameters); measured under a load average of ~5–7 on 2 cores: ~8 min with the models trained, + ~1.5 min to
# train them; the largest model's EK-FAC factors ~1.5–2.5 min. quick: a smoke run (~1 min; its sizes are too
# close together for meaningful fits).
PROFILES: dict[str, Profile] = {
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
Query = tuple[list[int], int]
METHODS, METRICS = ("cached", "cached-compact", "ekfac"), ("oneoff_s", "per_query_batch_s", "single_query_s")


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


def break_even(oneoff_c: float, pq_c: float, oneoff_e: float, pq_e: float) -> Json:
    """Queries q at which one-off + q·per-query is equal for both (None: one is cheaper at every q ≥ 0)."""
    d_one, d_pq = oneoff_c - oneoff_e, pq_e - pq_c
    if d_pq == 0:
        return {"queries": None, "cheaper_always": "cached" if d_one < 0 else "ekfac"}
    q = d_one / d_pq
    if q <= 0:
        return {"queries": None, "cheaper_always": "cached" if pq_c < pq_e else "ekfac"}
    return {"queries": q, "cheaper_below": "ekfac" if d_one > 0 else "cached"}


def totals(row: Json) -> dict[str, float]:
    return {
        str(q): num(row, "oneoff_s") + (num(row, "single_query_s") if q == 1 else q * num(row, "per_query_batch_s"))
        for q in (1, 100, 10_000)
    }


def work_model_projection(
    row: Json, P_star: float, D_star: float, K_star: int, k_star: int, d_star: int, Q: int
) -> Json:
    """A second projection, from the cost structure instead of fitted exponents, anchored at one measured row.

    EK-FAC: every scoring call recomputes the gradient of every training sequence, so a call costs ∝ P·D
    (``c* = c · (P*/P) · (D*/D)``, per-query and single alike; factor fitting too: covariance and lambda
    passes; the eigendecompositions are left out). Cached: the query's forward/backward ∝ P (the measured
    ``batch_query_gradients_s``), plus the postings read, ∝ (active prototypes of the query ∝ k) × (list
    length ∝ D·k/K) × r: ``scores* = scores · (D*/D) · (k*/k)² · (K/K*) · (r*/r)``; the single query is split
    in the same proportions as the batch. One-off: curvature + postings passes ∝ P·D."""
    m = obj(row, "model")
    sP, sD = P_star / num(row, "params"), D_star / num(row, "tokens")
    out: Json = {
        "anchor": {"model": m["spec"], "params": row["params"], "tokens": row["tokens"]},
        "target": {"params": P_star, "tokens": D_star, "num_prototypes": K_star, "top_k": k_star, "n_embd": d_star},
    }
    e = obj(row, "ekfac")
    ek = {
        "oneoff_s": num(e, "oneoff_s") * sP * sD,
        "per_query_batch_s": num(e, "per_query_batch_s") * sP * sD,
        "single_query_s": num(e, "single_query_s") * sP * sD,
    }
    out["ekfac_seconds"] = ek
    for name in ("cached", "cached-compact"):
        c = obj(row, name)
        r_star = d_star if name == "cached" else min(48, d_star)
        s_read = (
            sD
            * (k_star / num(m, "top_k")) ** 2
            * (num(m, "num_prototypes") / K_star)
            * (r_star / num(c, "config", "r"))
        )
        qg = num(c, "batch_query_gradients_s") / Q
        rd = max(0.0, num(c, "per_query_batch_s") - qg)
        frac = qg / max(num(c, "per_query_batch_s"), 1e-12)
        pq = qg * sP + rd * s_read
        single = num(c, "single_query_s") * (frac * sP + (1 - frac) * s_read)
        cs = {"oneoff_s": num(c, "oneoff_s") * sP * sD, "per_query_batch_s": pq, "single_query_s": single}
        out[name] = {
            "seconds": cs,
            "speedup_vs_ekfac": {k.removesuffix("_s"): ek[k] / cs[k] for k in cs},
            "query_gradient_share_measured": frac,
        }
    return out


def train_model(spec: str, prof: Profile, shards: ShardSet, work: Path, seed: int) -> tuple[PrismLM, Json]:
    d, L, K, k = (int(v) for v in spec.split(":"))
    heads = 1 if d < 32 else (2 if d < 128 else 4)
    sets = {
        **ATTRIBUTION_MODEL_SETS,
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


def build_caches(
    net: PrismLM, shards: ShardSet, n: int, work: Path, out: Json
) -> tuple[dict[str, AttributionConfig], dict[str, AttributionCache]]:
    """The default and the compact cache of the first n sequences, each build timed whole into ``out``."""
    cfgs = {"cached": AttributionConfig(max_sequences=n), "cached-compact": compact_config(net.config.n_embd, n)}
    caches = {}
    for name, cfg in cfgs.items():
        folder = work / f"cache-{name}-{n}"
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()
        cache, t, mem = timed_call(partial(build_cache, net, shards, cfg, out=folder))
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
    return cfgs, caches


class Rounds:
    """Every round's timings: a batch of all Q queries and one warm query per method, EK-FAC's factor load,
    the batch's query-gradient share, and the last batch's scores."""

    def __init__(self, names: list[str]) -> None:
        self.batch: dict[str, list[float]] = {name: [] for name in names}
        self.single: dict[str, list[float]] = {name: [] for name in names}
        self.qgrad: dict[str, list[float]] = {name: [] for name in names if name != "ekfac"}
        self.load: list[float] = []
        self.qsum: list[int] = []
        self.scores: dict[str, np.ndarray] = {}


def one_round(
    rep: int,
    net: PrismLM,
    queries: list[Query],
    pad_id: int,
    caches: dict[str, AttributionCache],
    kb: KronfluenceBaseline,
    out: Json,
    r: Rounds,
) -> None:
    """One round, methods alternating: the batch of Q, then the same single query for every method."""
    Q = len(queries)
    for name, cache in caches.items():  # batch of Q: query gradients + scores, one call
        reset_peak_rss()
        t0 = time.perf_counter()
        qg = query_gradients(net, queries)
        t1 = time.perf_counter()
        S = cache.scores(qg, Q)
        r.batch[name].append(time.perf_counter() - t0)
        r.qgrad[name].append(t1 - t0)
        obj(out, name)["peak_rss_mib_query"] = current_peak_rss_mib()
        r.scores[name] = S.numpy()
    S, t, mem_q = timed_call(partial(kb.scores, queries, pad_id, query_batch_size=Q))
    r.batch["ekfac"].append(t)
    obj(out, "ekfac")["peak_rss_mib_scores"] = mem_q
    r.scores["ekfac"] = S.numpy()
    qi = rep % Q  # the same single query for every method in this round
    r.qsum.append(qi)
    for name, cache in caches.items():
        inner = []
        for _ in range(CHEAP_INNER):
            t0 = time.perf_counter()
            cache.scores(query_gradients(net, [queries[qi]]), 1)
            inner.append(time.perf_counter() - t0)
        r.single[name].append(statistics.median(inner))
    _, t, _ = timed_call(partial(kb.scores, [queries[qi]], pad_id, query_batch_size=1))
    r.single["ekfac"].append(t)
    t0 = time.perf_counter()
    kb.analyzer.load_all_factors(factors_name=kb.strategy)
    r.load.append(time.perf_counter() - t0)


def summarise_rounds(out: Json, r: Rounds, cfgs: dict[str, AttributionConfig], Q: int, n: int) -> None:
    """Medians over the rounds, overlaps with EK-FAC, speed-ups, break-even and totals into ``out``."""
    for name in r.batch:
        obj(out, name).update(
            {
                "batch_s": statistics.median(r.batch[name]),
                "per_query_batch_s": statistics.median(r.batch[name]) / Q,
                "single_query_s": statistics.median(r.single[name]),
                "batch_samples_s": r.batch[name],
                "single_samples_s": r.single[name],
            }
        )
    for name in cfgs:
        obj(out, name)["batch_query_gradients_s"] = statistics.median(r.qgrad[name])
    obj(out, "ekfac")["factor_load_s"] = statistics.median(r.load)
    out["single_query_ids"] = r.qsum
    e = obj(out, "ekfac")
    for name in cfgs:
        c = obj(out, name)
        c["top10_vs_ekfac"] = topk_overlap(r.scores[name], r.scores["ekfac"], 10)
        c["top100_vs_ekfac"] = topk_overlap(r.scores[name], r.scores["ekfac"], min(100, n))
        c["speedup_vs_ekfac"] = {
            "oneoff": num(e, "oneoff_s") / num(c, "oneoff_s"),
            "per_query_batch": num(e, "per_query_batch_s") / num(c, "per_query_batch_s"),
            "single_query": num(e, "single_query_s") / num(c, "single_query_s"),
        }
        c["break_even_vs_ekfac"] = break_even(
            num(c, "oneoff_s"), num(c, "per_query_batch_s"), num(e, "oneoff_s"), num(e, "per_query_batch_s")
        )
        c["total_s"] = totals(c)
    e["total_s"] = totals(e)
    obj(out, "cached-compact")["top10_vs_cached"] = topk_overlap(r.scores["cached-compact"], r.scores["cached"], 10)


def measure(
    net: PrismLM, shards: ShardSet, queries: list[Query], pad_id: int, n: int, repeats: int, work: Path, freeze: bool
) -> Json:
    """All costs of the three methods at one (model, training-set size), interleaved."""
    Q, T = len(queries), net.config.block_size
    out: Json = {"num_train": n, "tokens": n * T}
    t0 = time.perf_counter()
    gc.collect()  # what each of kronfluence's gc.collect() calls costs on this process's heap, unfrozen
    out["gc_collect_unfrozen_s"] = time.perf_counter() - t0
    if freeze:
        gc.freeze()
    cfgs, caches = build_caches(net, shards, n, work, out)
    gc.collect()
    fit = partial(KronfluenceBaseline, net, shards, strategy="ekfac", max_sequences=n, batch_size=16)
    kb, t_fit, mem = timed_call(fit)
    out["ekfac"] = {"oneoff_s": t_fit, "peak_rss_mib_factors": mem, "factor_timings": dict(kb.timings)}
    rounds = Rounds([*cfgs, "ekfac"])
    for rep in range(repeats):
        one_round(rep, net, queries, pad_id, caches, kb, out, rounds)
    summarise_rounds(out, rounds, cfgs, Q, n)
    kb.close()
    for folder in (work / f"cache-{name}-{n}" for name in cfgs):
        shutil.rmtree(folder, ignore_errors=True)
    del kb, caches
    gc.unfreeze()
    gc.collect()
    return out


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
    return ap, ap.parse_args()


def planted_queries(args: argparse.Namespace, prof: Profile, work: Path) -> tuple[ShardSet, list[Query], int]:
    """The planted-fact corpus's shards (``bpe-512``) and the Q queries: the planted paraphrases, then
    held-out windows; the number of planted ones."""
    pc = planted_corpus(work, prof, args.seed)
    corpus_dir = pc.path.parent
    shards = prepare_shards(str(pc.path), "bpe-512", corpus_dir / "shards", val_fraction=0.05, show_progress=False)
    tok = shards.tokenizer
    planted_q, _ = pc.queries(tok)
    nv = shards.val.num_sequences(32)
    Qn = prof["queries"]
    val_q = [
        ([tok.eot_id] + shards.val.sequence(j, 32).tolist(), 1)
        for j in np.linspace(0, max(0, nv - 1), num=max(0, Qn - len(planted_q)), dtype=int).tolist()
    ]
    return shards, (planted_q + val_q)[:Qn], len(planted_q)


def log_row(spec: str, n: int, Q: int, row: Json) -> None:
    c, cc, e = obj(row, "cached"), obj(row, "cached-compact"), obj(row, "ekfac")

    def ms(x: Json, key: str) -> float:
        return num(x, key) * 1e3

    log(
        f"{spec} n={n}: one-off cached {num(c, 'oneoff_s'):.1f}s / compact {num(cc, 'oneoff_s'):.1f}s / ekfac "
        f"{num(e, 'oneoff_s'):.1f}s; per query (batch of {Q}) {ms(c, 'per_query_batch_s'):.1f} / "
        f"{ms(cc, 'per_query_batch_s'):.1f} / {ms(e, 'per_query_batch_s'):.0f} ms; single "
        f"{ms(c, 'single_query_s'):.1f} / {ms(cc, 'single_query_s'):.1f} / {ms(e, 'single_query_s'):.0f} ms "
        f"(factor load {ms(e, 'factor_load_s'):.0f} ms); top10 vs ekfac {num(c, 'top10_vs_ekfac'):.2f} / "
        f"{num(cc, 'top10_vs_ekfac'):.2f}"
    )


def measure_models(
    args: argparse.Namespace, prof: Profile, shards: ShardSet, queries: list[Query], work: Path
) -> tuple[list[Json], list[Json]]:
    """Every model size at the full training set, the ``--corpus-model`` one at every fraction too."""
    T = RunConfig.from_name("tiny").model.block_size
    N = shards.train.num_sequences(T)
    sizes = sorted({max(8, int(round(f * N))) for f in prof["fractions"]})
    rows: list[Json] = []
    models = []
    for i, spec in enumerate(prof["sizes"]):
        net, info = train_model(spec, prof, shards, work, args.seed)
        models.append(info)
        for n in sizes if i == prof["corpus_model"] else [N]:
            row = {
                "model": info,
                "params": info["params"],
                **measure(
                    net, shards, queries, shards.tokenizer.eot_id, n, prof["repeats"], work, not args.no_gc_freeze
                ),
            }
            row["load_average"] = load_average()
            rows.append(row)
            log_row(spec, n, len(queries), row)
        del net
        gc.collect()
    return rows, models


def fit_costs(
    rows: list[Json], N: int, corpus_model: str, P_star: float, D_star: float
) -> tuple[dict[str, Json], dict[str, dict[str, float]]]:
    """Per method and cost: power laws vs P (full training set) and vs D (the corpus model), the joint fit,
    and the joint fit's value at (P*, D*)."""
    by_params = [r for r in rows if r["num_train"] == N]
    by_tokens = [r for r in rows if obj(r, "model")["spec"] == corpus_model]
    Pp = np.array([num(r, "params") for r in by_params], float)
    Dt = np.array([num(r, "tokens") for r in by_tokens], float)
    P_all = np.array([num(r, "params") for r in rows], float)
    D_all = np.array([num(r, "tokens") for r in rows], float)
    fits: dict[str, Json] = {}
    projected: dict[str, dict[str, float]] = {}
    for m in METHODS:
        fits[m], projected[m] = {}, {}
        for met in METRICS:
            jf = joint_fit(P_all, D_all, np.array([num(r, m, met) for r in rows]))
            fits[m][met] = {
                "vs_params": power_fit(Pp, np.array([num(r, m, met) for r in by_params])),
                "vs_tokens": power_fit(Dt, np.array([num(r, m, met) for r in by_tokens])),
                "joint": jf,
            }
            projected[m][met] = predict(jf, P_star, D_star)
    return fits, projected


def speedups(
    args: argparse.Namespace, rows: list[Json], N: int, T: int, Q: int, projected: dict[str, dict[str, float]]
) -> Json:
    """The headline: measured speed-ups at the largest model, both projections to (P*, D*)."""
    largest = [r for r in rows if r["num_train"] == N][-1]
    P_all = np.array([num(r, "params") for r in rows], float)
    D_all = np.array([num(r, "tokens") for r in rows], float)
    P_star, D_star = args.project_params, args.project_sequences * GPT2_BLOCK
    speed: Json = {
        "definition": "EK-FAC seconds ÷ cached seconds for the same queries. per_query_batch: one call answering "
        f"all Q={Q} queries ÷ Q on both sides; single_query: one query, cache open / factors already "
        "fitted (kronfluence reloads them from disk inside the call); oneoff: whole build_cache vs "
        "factor fitting.",
        "measured_at": {
            "model": obj(largest, "model")["spec"],
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
        c = obj(largest, name)
        speed[name] = {
            "measured": {
                **obj(c, "speedup_vs_ekfac"),
                "top10_vs_ekfac": c["top10_vs_ekfac"],
                "break_even_queries": c["break_even_vs_ekfac"],
            },
            "projected_power_law": {k.removesuffix("_s"): projected["ekfac"][k] / projected[name][k] for k in METRICS},
            "projected_power_law_seconds": projected[name],
        }
    speed["ekfac_projected_power_law_seconds"] = projected["ekfac"]
    speed["work_model_projection"] = work_model_projection(
        largest, P_star, D_star, args.project_prototypes, args.project_top_k, args.project_embd, Q
    )
    return speed


def summary_line(largest: Json, speed: Json, fits: dict[str, Json], N: int, Q: int, out_path: Path) -> str:
    c, e = obj(largest, "cached"), obj(largest, "ekfac")
    sp = obj(speed, "cached")
    fe = obj(fits, "ekfac", "per_query_batch_s")
    wm = obj(speed, "work_model_projection", "cached", "speedup_vs_ekfac")
    at = obj(speed, "projected_power_law_at")
    return (
        f"attribution costs ({obj(largest, 'model')['spec']}, {N} seq, Q={Q}, same queries): one-off cached "
        f"{num(c, 'oneoff_s'):.1f}s vs EK-FAC {num(e, 'oneoff_s'):.1f}s; per query (batch) "
        f"{num(c, 'per_query_batch_s') * 1e3:.1f} vs {num(e, 'per_query_batch_s') * 1e3:.0f} ms "
        f"({num(sp, 'measured', 'per_query_batch'):.0f}×); single warm {num(c, 'single_query_s') * 1e3:.1f} vs "
        f"{num(e, 'single_query_s') * 1e3:.0f} ms ({num(sp, 'measured', 'single_query'):.0f}×); "
        f"EK-FAC per query ∝ P^{num(fe, 'vs_params', 'exponent'):.2f} (R² {num(fe, 'vs_params', 'r2'):.2f}) "
        f"D^{num(fe, 'vs_tokens', 'exponent'):.2f} (R² {num(fe, 'vs_tokens', 'r2'):.2f}); projected at "
        f"{num(at, 'params'):.3g} params, {num(at, 'tokens'):.3g} tokens: power law "
        f"{num(sp, 'projected_power_law', 'per_query_batch'):.0f}× batch, "
        f"{num(sp, 'projected_power_law', 'single_query'):.0f}× single (extrapolation; work model "
        f"{num(wm, 'per_query_batch'):.0f}× / {num(wm, 'single_query'):.0f}×) → {out_path}"
    )


def main() -> None:
    ap, args = parse_args()
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
    shards, queries, n_planted = planted_queries(args, prof, work)
    T = RunConfig.from_name("tiny").model.block_size
    N, Q = shards.train.num_sequences(T), len(queries)
    log(f"{N} training sequences of {T} tokens; {Q} queries ({min(Q, n_planted)} planted)")
    rows, models = measure_models(args, prof, shards, queries, work)
    P_star, D_star = args.project_params, args.project_sequences * GPT2_BLOCK
    fits, projected = fit_costs(rows, N, prof["sizes"][prof["corpus_model"]], P_star, D_star)
    speed = speedups(args, rows, N, T, Q, projected)
    payload = {
        "benchmark": "attribution-costs",
        "profile": "quick" if args.quick else "default",
        "settings": {**prof, **{k: v for k, v in vars(args).items() if k not in prof}},
        "num_train": N,
        "block_size": T,
        "queries": {"count": Q, "planted": min(Q, n_planted)},
        "models": models,
        "rows": rows,
        "fits": fits,
        "speedup_vs_ekfac_equal_work": speed,
        "environment": env,
        "load_average_end": load_average(),
        "total_seconds": time.perf_counter() - t_start,
    }
    write_json(out_path, payload)
    largest = [r for r in rows if r["num_train"] == N][-1]
    print(summary_line(largest, speed, fits, N, Q, out_path))


if __name__ == "__main__":
    main()
