"""Every attribution method's scores of the same queries against the same training set, with their costs:
prototype-space influence (full, exact blocks, identity curvature, with the REC term), the postings cache at
several ranks and projections and the compact recipe, kronfluence (EK-FAC, identity), TRAK, whole-network
gradient dot products and the hybrid re-ranker (the compact cache's top-M candidates re-scored by wn-dot or
EK-FAC). What ``bench/attribution.py`` compares; ``prismlm.tda.evaluation`` judges the scores.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch

from prismlm.config import AttributionConfig
from prismlm.data.shards import ShardSet
from prismlm.eval.resources import timed_call
from prismlm.model import PrismLM
from prismlm.tda.baselines import KronfluenceBaseline, TrakBaseline, WholeNetworkGradients, hybrid_scores
from prismlm.tda.cache import build_cache
from prismlm.tda.gradients import BlockGradients
from prismlm.tda.influence import Curvature, FullGradients, curvature_pass, query_gradients

Json = dict[str, object]
Query = tuple[list[int], int]
Scores = dict[str, np.ndarray]


@dataclass
class Attributed:
    """The model attributed, its training shards and the queries (token ids, first measured position)."""

    net: PrismLM
    shards: ShardSet
    queries: list[Query]
    eot_id: int

    @property
    def N(self) -> int:
        """Training sequences."""
        return self.shards.train.num_sequences(self.net.config.block_size)


@dataclass
class ComparisonSettings:
    """Which methods run and how."""

    ranks: list[int]
    """Sketch sizes r of the cached method (``r_time`` is added)."""
    r_time: int
    """The rank whose cache is timed in the costs."""
    lambda_rec: float
    """λ_rec of the recipe: the REC term's weight in the ``-rec`` curvature."""
    seed: int = 0
    no_kronfluence: bool = False
    no_trak: bool = False
    trak_proj_dim: int | None = None
    """TRAK projection size (None: min(512, N/4), at least 128)."""
    hybrid_m: list[int] = field(default_factory=lambda: [32, 128, 512])
    """Candidates per query the hybrid re-scores."""
    timing_queries: int = 4
    """Queries the hybrid's per-query re-scoring time is measured on."""
    log: Callable[[str], None] = lambda _: None


@dataclass
class Extra:
    """What the scores come with (a bench saves it beside them, to reuse both)."""

    cache_meta: dict[str, Json]
    method_costs: dict[str, Json]
    notes: dict[str, str]
    kb_ekfac: KronfluenceBaseline | None = None


def baseline_scores(settings: ComparisonSettings, s: Attributed, scores_at_N: Scores, ex: Extra) -> None:
    """kronfluence (EK-FAC kept open for the hybrid's timing; identity) and TRAK on every training sequence."""
    Q = len(s.queries)
    if not settings.no_kronfluence:
        for strat, name in (("ekfac", "ekfac"), ("identity", "kf-identity")):
            if name in scores_at_N and strat != "ekfac":
                continue
            kb, t_f, _ = timed_call(partial(KronfluenceBaseline, s.net, s.shards, strategy=strat, batch_size=16))
            if name not in scores_at_N:  # no costs pass before: the baselines were not run yet
                t0 = time.perf_counter()
                scores_at_N[name] = kb.scores(s.queries, s.eot_id, query_batch_size=Q).numpy()
                ex.method_costs[name] = {"oneoff_s": t_f, "per_query_s_batched": (time.perf_counter() - t0) / Q}
            if strat == "ekfac":
                ex.kb_ekfac = kb
            else:
                kb.close()
    if not settings.no_trak:
        pdim = settings.trak_proj_dim or max(128, min(512, s.N // 4))
        try:
            tb, t_f, mem = timed_call(
                lambda: TrakBaseline(s.net, s.shards, proj_dim=pdim, batch_size=16, seed=settings.seed)
            )
            t0 = time.perf_counter()
            scores_at_N["trak"] = tb.scores(s.queries, s.eot_id).numpy()
            ex.method_costs["trak"] = {
                "oneoff_s": t_f,
                "peak_rss_mib_features": mem,
                "proj_dim": pdim,
                "per_query_s_batched": (time.perf_counter() - t0) / Q,
                "projector": "BasicProjector (dense Gaussian, CPU)",
                "checkpoints": 1,
            }
            tb.close()
        except Exception as e:  # recorded, not hidden: the JSON says why TRAK is missing
            ex.notes["trak"] = f"TRAK failed: {type(e).__name__}: {e}"
            settings.log(ex.notes["trak"])


def cached_scores(
    settings: ComparisonSettings,
    s: Attributed,
    qg: BlockGradients,
    curvs: tuple[Curvature, Curvature],
    scores_at_N: Scores,
    ex: Extra,
) -> None:
    """The cached method at every rank and projection, the compact recipe (with and without the REC curvature)
    and the default cache with the REC curvature."""
    (curv, curv_rec), Q, d = curvs, len(s.queries), s.net.config.n_embd
    for r in sorted(set(settings.ranks) | {settings.r_time}):
        projections: tuple[Literal["orthogonal", "gaussian", "pca"], ...] = ("orthogonal", "gaussian", "pca")
        for proj in projections:
            if proj in ("orthogonal", "pca") and r > d:
                continue
            name = f"cached-r{r}" + {"orthogonal": "", "gaussian": "-gauss", "pca": "-pca"}[proj]
            c = build_cache(
                s.net, s.shards, AttributionConfig(r=r, projection=proj, seed=settings.seed), curvature=curv
            )
            scores_at_N[name] = c.scores(qg, Q).numpy()
            ex.cache_meta[name] = {"r": r, "projection": proj, "bytes_per_token": c.manifest["bytes_per_token"]}
    compact_cfg = AttributionConfig(
        projection="pca-local", r=min(40, d), dtype="pq", id_encoding="delta", seed=settings.seed
    )  # app.build_run_cache's compact recipe
    for name, cv in (("cached-compact", curv), ("cached-compact-rec", curv_rec)):
        cc = build_cache(s.net, s.shards, compact_cfg, curvature=cv)
        scores_at_N[name] = cc.scores(qg, Q).numpy()
        ex.cache_meta[name] = {
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
            for qq in s.queries[:8]:
                t0 = time.perf_counter()
                cc.scores(query_gradients(s.net, [qq]), 1)
                per.append(time.perf_counter() - t0)
            ex.method_costs["cached-compact"] = {"per_query_s": statistics.median(per)}
    crec = build_cache(s.net, s.shards, AttributionConfig(seed=settings.seed), curvature=curv_rec)
    scores_at_N[f"cached-r{crec.r}-rec"] = crec.scores(qg, Q).numpy()
    ex.cache_meta[f"cached-r{crec.r}-rec"] = {
        "r": crec.r,
        "projection": "orthogonal",
        "bytes_per_token": crec.manifest["bytes_per_token"],
    }


def wn_dot_scores(s: Attributed, wn: WholeNetworkGradients, scores_at_N: Scores, ex: Extra) -> None:
    """Whole-network gradient dot products (every parameter): one backward pass per training sequence."""
    Q = len(s.queries)
    t0 = time.perf_counter()
    gq = torch.stack([wn.query(ids, st) for ids, st in s.queries])  # (Q, P)
    t_qgrad = (time.perf_counter() - t0) / Q
    WN = np.zeros((Q, s.N))
    t0 = time.perf_counter()
    for j in range(s.N):
        WN[:, j] = (gq @ wn.train(j)).numpy()
    t_tgrad = (time.perf_counter() - t0) / s.N
    scores_at_N["wn-dot"] = WN
    ex.method_costs["wn-dot"] = {
        "oneoff_s": 0.0,
        "per_query_s": t_qgrad + s.N * t_tgrad,
        "train_gradient_s": t_tgrad,
        "query_gradient_s": t_qgrad,
        "note": "per query: the query's gradient + one backward pass per training sequence",
    }


def hybrid_rescore_seconds(
    s: Attributed, rname: str, cands: torch.Tensor, wn: WholeNetworkGradients, ex: Extra, tq: int
) -> list[float]:
    """Seconds of re-scoring each of the first ``tq`` queries' candidates (computed on the candidates only)."""
    times = []
    for q in range(min(tq, len(s.queries))):
        t0 = time.perf_counter()
        if rname == "wn-dot":
            g = wn.query(*s.queries[q])
            wn.dot(g, cands[q].tolist())
        elif ex.kb_ekfac is not None:
            ex.kb_ekfac.scores_on([s.queries[q]], cands[q].tolist(), s.eot_id)
        times.append(time.perf_counter() - t0)
    return times


def hybrid(
    settings: ComparisonSettings,
    s: Attributed,
    wn: WholeNetworkGradients,
    scores_at_N: Scores,
    ex: Extra,
    costs: list[Json],
) -> Json:
    """The compact cache's top-M candidates re-scored by wn-dot and EK-FAC (and the ``-sum`` variants)."""
    base_name = "cached-compact"
    rescorers_meta: dict[str, Json] = {}
    rescorers = {"wn-dot": scores_at_N["wn-dot"]}
    if "ekfac" in scores_at_N:
        rescorers["ekfac"] = scores_at_N["ekfac"]
    base_S = torch.from_numpy(scores_at_N[base_name])
    for rname, R in rescorers.items():
        Rt = torch.from_numpy(R)
        for m_c in settings.hybrid_m:
            # the re-scorer's value on a candidate does not depend on the other training sequences (fixed
            # factors / gradients), so the scores are read from the full matrix; the per-query time below is
            # measured by computing them on the candidates only
            H, cands = hybrid_scores(base_S, lambda q, ids, Rt=Rt: Rt[q, ids], m_c)
            hname = f"hybrid-{rname}-m{m_c}"
            scores_at_N[hname] = H.numpy()
            scores_at_N[hname + "-sum"] = hybrid_scores(
                base_S, lambda q, ids, Rt=Rt: Rt[q, ids], m_c, keep_order=False
            )[0].numpy()
            times = hybrid_rescore_seconds(s, rname, cands, wn, ex, settings.timing_queries)
            base_q = _n(ex.method_costs["cached-compact"]["per_query_s"])
            ekfac_oneoff = ex.method_costs.get("ekfac", {}).get("oneoff_s") or (
                _d(costs[-1].get("ekfac", {})).get("oneoff_s") if costs else None
            )
            rescorers_meta[hname] = {
                "rescore_per_query_s": statistics.median(times) if times else None,
                "per_query_s": base_q + (statistics.median(times) if times else float("nan")),
                "cached_per_query_s": base_q,
                "oneoff_s_extra": ekfac_oneoff if rname == "ekfac" else 0.0,
                "timing_queries": len(times),
            }
            settings.log(f"{hname}: {_n(rescorers_meta[hname]['per_query_s']) * 1e3:.0f} ms/query")
    return {"base": base_name, "m": settings.hybrid_m, "rescorers": rescorers_meta}


def all_scores(settings: ComparisonSettings, s: Attributed, scores_at_N: Scores, costs: list[Json]) -> Json:
    """Every method's (Q, N) scores into ``scores_at_N`` (names in a fixed order; those already there, e.g.
    kronfluence's from a costs pass, are kept); returns what they come with. ``costs``: the costs rows of the
    same model (the EK-FAC one-off time the hybrid adds, when this call did not fit EK-FAC itself)."""
    qg, Q = query_gradients(s.net, s.queries), len(s.queries)
    curv = curvature_pass(s.net, s.shards)
    lam_rec = settings.lambda_rec
    curv_rec = curvature_pass(s.net, s.shards, reconstruction=lam_rec)  # + the REC term's diagonal blocks
    full = FullGradients.build(s.net, s.shards, curvature=curv)
    scores_at_N["full"] = full.scores(qg, Q).numpy()
    scores_at_N["full-rec"] = FullGradients(full.train, curv_rec, s.N).scores(qg, Q).numpy()
    ex = Extra({}, {}, {})
    baseline_scores(settings, s, scores_at_N, ex)
    scores_at_N["full-exact"] = FullGradients.build(s.net, s.shards, mode="exact").scores(qg, Q).numpy()
    scores_at_N["proto-dot"] = FullGradients(full.train, None, s.N).scores(qg, Q).numpy()
    cached_scores(settings, s, qg, (curv, curv_rec), scores_at_N, ex)
    wn = WholeNetworkGradients(s.net, s.shards, memo=False)
    wn_dot_scores(s, wn, scores_at_N, ex)
    hybrid_meta = hybrid(settings, s, wn, scores_at_N, ex, costs)
    if ex.kb_ekfac is not None:
        ex.kb_ekfac.close()
    c16 = build_cache(
        s.net, s.shards, AttributionConfig(r=min(16, s.net.config.n_embd), dtype="float16"), curvature=curv
    )
    scores_at_N[f"cached-r{c16.r}-fp16"] = c16.scores(qg, Q).numpy()
    ex.cache_meta[f"cached-r{c16.r}-fp16"] = {
        "r": c16.r,
        "projection": "orthogonal",
        "dtype": "float16",
        "bytes_per_token": c16.manifest["bytes_per_token"],
    }
    return {
        "cache_meta": ex.cache_meta,
        "method_costs": ex.method_costs,
        "hybrid": hybrid_meta,
        "notes": ex.notes,
        "curvature": {"reconstruction_lambda": lam_rec, "mean_rec_over_ce_trace_per_d": _rec_ratio(curv_rec)},
    }


def _rec_ratio(c: Curvature) -> float | None:
    """Mean over prototypes seen in the statistics of trace(REC block) / trace(CE Gauss–Newton block)."""
    if c.rec is None:
        return None
    seen = c.m > 0
    ce = c.m[seen] * float(torch.diagonal(c.F).sum())
    return float((c.rec[seen] * c.F.shape[0] / ce.clamp_min(1e-300)).mean())


def _n(x: object) -> float:
    assert isinstance(x, int | float), x
    return float(x)


def _d(x: object) -> Json:
    assert isinstance(x, dict), x
    return x
