"""The summary arithmetic of the paper's claims (``bench/real_claims.py``): from per-condition, per-task and
per-method measurements to the published fields — suppression's table and best set, the controllers' mean gains,
attribution's recall, MRR and cost ratios, and the explanations' logit and margin shares.

Pure functions of JSON-like records (the stage files' own shapes), so each field can be checked by hand on a
few fixed numbers (tests/test_claims_summaries.py).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized

import numpy as np
import torch

from prismlm.errors import ArtifactMismatch
from prismlm.eval.faithfulness import ChoiceParts, choice_shares
from prismlm.eval.stats import drop_ci, excess_drop, gap_ci, mcnemar_exact_p, relative_drop

Record = Mapping[str, object]
"""One JSON-like record of a stage (a table row, a condition, a task row)."""


def _num(v: object) -> float:
    if not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {type(v).__name__}")
    return float(v)


def _rec(v: object) -> Record:
    if not isinstance(v, Mapping):
        raise TypeError(f"expected a mapping, got {type(v).__name__}")
    return v


# ----- suppression ----------------------------------------------------------------------------------------------
Scores = Mapping[str, Mapping[str, Mapping[str, np.ndarray]]]
"""concept → judge → condition → (prompts,) mean judged score; ``<cond>/neutral`` on the neutral prompts."""


PROJECT = "+project"
"""The suffix of a condition whose set is suppressed with ``residual="project"`` (``kjv@41+project``); a
condition without a suffix removes the slices only (``residual="keep"``)."""
MEAN = "+mean"
"""The suffix of a condition whose set is suppressed with ``residual="mean"`` (``kjv@41+mean``): the residual
projected off the set's unit mean direction only."""
CONTRAST = "+contrast"
"""The suffix of a condition whose set is suppressed with ``residual="contrast"`` (``kjv@41+contrast``): the
residual projected off the unit difference between the set's mean prototype and the bank's."""
MODE_SUFFIXES = {"project": PROJECT, "mean": MEAN, "contrast": CONTRAST}
"""Residual-editing mode → its condition suffix."""
SUMMARY_PREFIXES = {
    "project": "suppression_residual_",
    "mean": "suppression_mean_",
    "contrast": "suppression_contrast_",
}
"""Residual-editing mode → the prefix of its summary fields (``residual_suppression_summary``); ``project``
keeps the first run's ``suppression_residual_`` names."""


def condition_mode(cond: str) -> tuple[str, str]:
    """``kjv@41+project`` → (``kjv@41``, ``project``); ``kjv@41+mean`` → (``kjv@41``, ``mean``); ``random2@41``
    → (``random2@41``, ``keep``). Conditions are ``before``, ``<concept>@n`` (its top n), ``random@n`` (n
    prototypes active on neutral text, outside every concept's ranking) and ``random<d>@n`` (draw d of n
    prototypes from the whole bank), each with or without a suffix of ``MODE_SUFFIXES``."""
    for mode, suffix in MODE_SUFFIXES.items():
        if cond.endswith(suffix):
            return cond[: -len(suffix)], mode
    return cond, "keep"


def is_random(cond: str) -> bool:
    """A control set (``random@n``, ``random<d>@n``, with either residual mode)."""
    return condition_mode(cond)[0].startswith("random")


def suppression_rows(
    concepts: Iterable[str], recs: Mapping[str, Record], scores: Scores, K: int, n_boot: int, seed: int
) -> list[dict[str, object]]:
    """One row per (concept, condition) of that concept (its own sets, the random sets, before): per judge the
    provocative and neutral score, the relative drop (``drop_ci``) and the drop of the excess over neutral; the
    collateral (relative CE increase on neutral text, task accuracy change) and the relative CE increase on the
    concept's own text; ``set`` and ``residual`` (``condition_mode``). ``recs``: condition → {ids, ce_neutral,
    ce_<concept>, acc, acc_norm}, with ``before``."""
    rows: list[dict[str, object]] = []
    b = recs["before"]
    for concept in concepts:
        for cond, rec in recs.items():
            base, mode = condition_mode(cond)
            if cond != "before" and not (is_random(cond) or base.startswith(f"{concept}@")):
                continue
            if cond not in scores[concept]["tfidf"]:  # a random set of a size this concept has no set of
                continue
            ids = rec["ids"]
            n_ids = len(ids) if isinstance(ids, Sized) else 0
            row: dict[str, object] = {"concept": concept, "condition": cond, "prototypes": n_ids}
            row |= {"set": base, "residual": mode, "bank_share": n_ids / K}
            for jn, per in scores[concept].items():
                p0, p, n0 = per["before"], per[cond], per["before/neutral"]
                row[f"{jn}_provocative"] = float(p.mean())
                row[f"{jn}_neutral"] = float(per[f"{cond}/neutral"].mean())
                row[f"{jn}_drop"] = float(relative_drop(p0.mean(), p.mean()))
                row[f"{jn}_drop_ci95"] = drop_ci(p0, p, n_boot, seed) if cond != "before" else [0.0, 0.0]
                row[f"{jn}_excess_drop"] = float(excess_drop(p0.mean(), p.mean(), n0.mean()))
            row["ce_neutral"] = rec["ce_neutral"]
            row["ce_neutral_rel_increase"] = _num(rec["ce_neutral"]) / _num(b["ce_neutral"]) - 1
            row["ce_concept_rel_increase"] = _num(rec[f"ce_{concept}"]) / _num(b[f"ce_{concept}"]) - 1
            row["task_acc"] = rec["acc"]
            row["task_acc_change"] = _num(rec["acc"]) - _num(b["acc"])
            row["task_acc_norm"] = rec["acc_norm"]
            rows.append(row)
    return rows


def behaviour_gap(provocative: np.ndarray, neutral: np.ndarray, n_boot: int, seed: int) -> dict[str, object]:
    """Does the model have the behaviour? The judged score on provocative minus neutral prompts (before any
    suppression), with a 95% bootstrap interval (``gap_ci``); ``shown`` when the interval is above 0."""
    p, n = provocative, neutral
    ci = gap_ci(p, n, n_boot, seed)
    return {"provocative": float(p.mean()), "neutral": float(n.mean()), "gap": float(p.mean() - n.mean()),
            "gap_ci95": ci, "shown": ci[0] > 0}  # fmt: skip


def best_suppression_row(
    rows: Sequence[Record],
    shown: set[str],
    max_bank_share: float,
    max_collateral: float,
    residual: str = "keep",
    metric: str = "tfidf_drop",
) -> Record | None:
    """The concept set with the *largest* ``metric`` among those of the ``residual`` mode within the bank-share
    and collateral limits, of a concept whose behaviour the model shows (of any concept if none shows it); None
    when none qualifies. Exact slice removal is ranked by the raw drop (``tfidf_drop``, the first run's field);
    the residual-projecting suppression by the drop of the excess over neutral (``tfidf_excess_drop``)."""
    ok = [
        r
        for r in rows
        if r["condition"] != "before"
        and not is_random(str(r["condition"]))
        and r.get("residual", "keep") == residual
        and (r["concept"] in shown or not shown)
        and _num(r["prototypes"]) <= round(max_bank_share * _num(r["prototypes"]) / _num(r["bank_share"]))
        and _num(r["ce_neutral_rel_increase"]) <= max_collateral
    ]
    return max(ok, key=lambda r: _num(r[metric]), default=None)


def random_controls(rows: Sequence[Record], best: Record, metric: str) -> list[float]:
    """``metric`` of the whole-bank random draws (``random<d>@n``) of ``best``'s concept, size and residual mode:
    the sets ``best`` must beat (the older ``random@n``, drawn among prototypes active on neutral text, is not
    one of them)."""
    n, mode = best["prototypes"], best.get("residual", "keep")
    return [
        _num(r[metric])
        for r in rows
        if r["concept"] == best["concept"]
        and r["prototypes"] == n
        and r.get("residual", "keep") == mode
        and condition_mode(str(r["condition"]))[0].startswith("random")
        and not condition_mode(str(r["condition"]))[0].startswith("random@")
    ]


def residual_suppression_summary(
    best: Record | None,
    rows: Sequence[Record],
    export_identical: object,
    goal_drop: float = 0.8,
    mode: str = "project",
) -> dict[str, object]:
    """A residual-editing suppression's fields from its best row (``best_suppression_row(..., mode,
    "tfidf_excess_drop")``), named with ``SUMMARY_PREFIXES[mode]`` (``suppression_residual_…`` for ``project``,
    ``suppression_mean_…`` for ``mean``): the drop that counts is the drop of the excess over neutral text (the
    raw drop beside it), the collateral the relative CE increase on neutral text; the same-size, same-mode
    whole-bank random draws' mean excess drop is the control. All None when no set qualifies."""
    pre = SUMMARY_PREFIXES[mode]
    if best is None:
        keys = ("best_drop", "collateral", "raw_drop", "bank_share", "concept", "concept_ce_increase",
                "task_acc_change", "random_drop", "random_draws")  # fmt: skip
        what = "projected" if mode == "project" else f"{mode}-projected"
        why = f"no {what} concept set within the bank-share and collateral limits (or none measured)"
        return {f"{pre}{k}": None for k in keys} | {
            f"{pre}goal_met": False,
            f"{pre}export_identical": export_identical,
            "why_null": {f"{pre}best_drop": why, f"{pre}collateral": why},
        }
    draws = random_controls(rows, best, "tfidf_excess_drop")
    return {
        f"{pre}best_drop": best["tfidf_excess_drop"],
        f"{pre}collateral": best["ce_neutral_rel_increase"],
        f"{pre}raw_drop": best["tfidf_drop"],
        f"{pre}bank_share": best["bank_share"],
        f"{pre}concept": best["concept"],
        f"{pre}concept_ce_increase": best["ce_concept_rel_increase"],
        f"{pre}task_acc_change": best["task_acc_change"],
        f"{pre}random_drop": statistics.fmean(draws) if draws else None,
        f"{pre}random_draws": len(draws),
        f"{pre}goal_met": _num(best["tfidf_excess_drop"]) >= goal_drop,
        f"{pre}export_identical": export_identical,
    }


def suppression_summary(
    best: Record | None, behaviour: Mapping[str, Record], export_identical: object, goal_drop: float = 0.8
) -> dict[str, object]:
    """The issue's suppression fields from the best row (``best_suppression_row``)."""
    return {
        "suppression_best_drop": best["tfidf_drop"] if best else None,
        "suppression_collateral": best["ce_neutral_rel_increase"] if best else None,
        "suppression_bank_share": best["bank_share"] if best else None,
        "suppression_best_concept": best["concept"] if best else None,
        "suppression_best_drop_ci95": best["tfidf_drop_ci95"] if best else None,
        "suppression_goal_met": bool(best and _num(best["tfidf_drop"]) >= goal_drop),
        "suppression_export_identical": export_identical,
        "suppression_behaviour_shown": {c: b["shown"] for c, b in behaviour.items()},
    }


# ----- controllers ----------------------------------------------------------------------------------------------
def controller_summary(rows: Sequence[Record]) -> dict[str, object]:
    """The issue's controller fields: mean accuracy differences over the kept tasks, in points (2 decimals).
    Each row: ``base``/``choice_prior`` {acc}, ``prism``/``sae`` {test_after: {acc}, delta_acc}, and, when every
    row has it, ``dense`` (the dense-residual controller of the same size): then ``controller_minus_dense``."""
    if not rows:
        return {"controller_tasks": 0}

    def mean(f: Callable[[Record], float]) -> float:
        return round(100 * sum(f(r) for r in rows) / len(rows), 2)

    def acc(r: Record, side: str) -> float:
        return _num(_rec(_rec(r[side])["test_after"])["acc"])

    def plain(r: Record, part: str, key: str = "acc") -> float:
        return _num(_rec(r[part])[key])

    out: dict[str, object] = {
        "controller_tasks": len(rows),
        "controller_gain_over_prior": mean(lambda r: acc(r, "prism") - plain(r, "choice_prior")),
        "controller_minus_sae": mean(lambda r: acc(r, "prism") - acc(r, "sae")),
        "controller_gain_over_base": mean(lambda r: plain(r, "prism", "delta_acc")),
        "sae_gain_over_base": mean(lambda r: plain(r, "sae", "delta_acc")),
        "sae_gain_over_prior": mean(lambda r: acc(r, "sae") - plain(r, "choice_prior")),
        "prior_gain_over_base": mean(lambda r: plain(r, "choice_prior") - plain(r, "base")),
    }
    if all("dense" in r for r in rows):  # rows measured before the dense baseline existed have none
        out["controller_minus_dense"] = mean(lambda r: acc(r, "prism") - acc(r, "dense"))
        out["dense_gain_over_base"] = mean(lambda r: plain(r, "dense", "delta_acc"))
        out["dense_gain_over_prior"] = mean(lambda r: acc(r, "dense") - plain(r, "choice_prior"))
    # the noise around those means: the exact McNemar p of the test examples of every task pooled (each row's
    # paired counts: examples the controller gets right and the other side wrong, and the reverse)
    paths = {"prior": ("prism", "paired_vs_prior"), "sae": ("prism_vs_sae",), "dense": ("prism_vs_dense",)}
    for side, path in paths.items():
        known = [c for r in rows if (c := _paired_counts(r, path)) is not None]
        if len(known) == len(rows):
            gained, lost = sum(g for g, _ in known), sum(x for _, x in known)
            out[f"controller_vs_{side}_gained_lost"] = [gained, lost]
            out[f"controller_vs_{side}_mcnemar_p"] = mcnemar_exact_p(gained, lost)
    return out


def _paired_counts(row: Record, path: tuple[str, ...]) -> tuple[int, int] | None:
    """A row's paired counts at ``path`` (``gained``, ``lost``), or None where the row has none."""
    node: object = row
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    if not isinstance(node, Mapping) or "gained" not in node or "lost" not in node:
        return None
    return int(_num(node["gained"])), int(_num(node["lost"]))


# ----- attribution ----------------------------------------------------------------------------------------------
def attribution_summary(planted: Mapping[str, Record], costs: Mapping[str, Record]) -> dict[str, object]:
    """The issue's attribution fields: recall@10 and MRR per method and query part (``planted``: method → part →
    {recall@10, mrr}), and each method's per-query cost over the cache's (``costs``: method → {per_query_s,
    single_query_s}; > 1 means the method costs more). A method not run leaves its fields out."""

    def metric(name: str, part: str, key: str) -> object:
        return _rec(_rec(planted.get(name, {})).get(part, {})).get(key)

    def r10(name: str, part: str = "all") -> object:
        return metric(name, part, "recall@10")

    def cost(name: str, key: str) -> float:
        return _num(costs[name][key]) / _num(costs["cached"]["per_query_s"])

    out: dict[str, object] = {
        "recall10_cached": r10("cached"),
        "recall10_cached_compact": r10("cached-compact"),
        "recall10_cached_paraphrase": r10("cached", "paraphrase"),
        "recall10_bm25_paraphrase": r10("bm25", "paraphrase"),
        "mrr_cached": metric("cached", "all", "mrr"),
        "mrr_cached_paraphrase": metric("cached", "paraphrase", "mrr"),
        "mrr_bm25_paraphrase": metric("bm25", "paraphrase", "mrr"),
        "recall10_bm25_prompt_paraphrase": r10("bm25-prompt", "paraphrase"),
    }
    hyb = [k for k in planted if k.startswith("hybrid")]
    if hyb:
        out["recall10_hybrid"] = r10(hyb[0])
    for name in ("trak", "bergson"):
        if name in planted:
            out[f"recall10_{name}"] = r10(name)
            out[f"recall10_{name}_paraphrase"] = r10(name, "paraphrase")
            out[f"mrr_{name}"] = metric(name, "all", "mrr")
            out[f"{name}_cost_over_cached"] = cost(name, "per_query_s")
            out[f"{name}_single_query_cost_over_cached"] = cost(name, "single_query_s")
    if "ekfac" in planted:
        out["recall10_ekfac"] = r10("ekfac")
        out["ekfac_cost_over_cached"] = cost("ekfac", "per_query_s")
        out["ekfac_single_query_cost_over_cached"] = cost("ekfac", "single_query_s")
        out["mrr_ekfac"] = metric("ekfac", "all", "mrr")
    return {k: v for k, v in out.items() if v is not None}


MATCHED_FIELDS = ("num_train", "block_size", "relevant_per_fact", "learning")
"""What two attribution records of one stage must share for their method rows to stand side by side: the same
training sequences, the same ground truth, and a fine-tune that learned the same to the last digit (its held-out
accuracies and NLLs, which any change to the seeded fine-tune moves)."""


def _as_json(v: object) -> object:
    """``v`` as it reads back from a JSON file (tuples as lists, NumPy scalars as numbers), so that a record computed
    now compares equal to the same record read from disk."""
    return json.loads(json.dumps(v, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def earlier_method_rows(
    earlier: Record, now: Record, have: Iterable[str], source: str = "the earlier record"
) -> tuple[dict[str, dict[str, Record]], dict[str, dict[str, object]]]:
    """The ``planted`` rows and ``costs`` of the methods in ``earlier`` (an attribution record of the same stage,
    e.g. a partial one from another revision) that ``have`` (this run's methods and cost entries) lacks, to
    complete a run that ran only some methods.
    ``now`` holds this run's ``MATCHED_FIELDS``; where one differs from ``earlier``'s the two runs did not
    fine-tune the same model and ``ArtifactMismatch`` names ``source`` and the field. Cost entries that belong to a
    method (``_curvature``: the cache's one-off curvature pass) come along when ``have`` lacks them."""
    for field in MATCHED_FIELDS:
        if _as_json(earlier.get(field)) != _as_json(now.get(field)):
            raise ArtifactMismatch(
                f"{source}: its {field} differs from this run's, so its methods did not score the same fine-tune; "
                "rerun those methods here instead of merging"
            )
    have = set(have)
    planted, costs = _rec(earlier["planted"]), _rec(earlier["costs"])
    rows = {name: {part: _rec(m) for part, m in _rec(row).items()} for name, row in planted.items() if name not in have}
    merged_costs = {name: dict(_rec(costs[name])) for name in rows if name in costs}
    merged_costs |= {k: dict(_rec(v)) for k, v in costs.items() if k.startswith("_") and k not in have}
    return rows, merged_costs


# ----- explanations ---------------------------------------------------------------------------------------------
PARTS = ChoiceParts._fields
"""The columns of an answer's ``parts`` rows (one row per answer token): the fields of ``ChoiceParts``."""


def per_token_shares(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x (n, len(PARTS)) rows → each share of ``choice_shares``, (n,) per name."""
    return choice_shares(ChoiceParts(*x.unbind(-1)))


def logit_shares(parts: Sequence[Sequence[Sequence[float]]]) -> dict[str, object]:
    """The logit and margin shares over answers (each a list of ``PARTS`` rows, one per answer token): per-token
    shares averaged over each answer's tokens and then over the answers (``mean``), plus pooled sums (Σ S / Σ ℓ_y,
    Σ ΔS / Σ margin: signed, so slices that push against the choice count against it) and distribution figures.
    Answers without tokens are skipped."""
    rows = [torch.tensor(p, dtype=torch.float64) for p in parts if p]
    if not rows:
        return {"tokens": 0, "answers": 0, "mean": {}, "pooled_fraction_slices": None, "max_abs_error": None}
    per_answer = [per_token_shares(x) for x in rows]  # each: name → (n,)
    names = list(per_answer[0])
    mean = {k: round(statistics.fmean(float(a[k].mean()) for a in per_answer), 4) for k in names}
    flat = {k: torch.cat([a[k] for a in per_answer]) for k in names}
    allp = torch.cat(rows)  # (N, len(PARTS))
    logit, S, A, R, Bb = (allp[:, i] for i in range(5))
    margin, dS = logit - allp[:, 8], S - allp[:, 9]
    return {
        "answers": len(rows),
        "tokens": int(allp.shape[0]),
        "mean": mean,
        "token_median": {k: round(float(v.median()), 4) for k, v in flat.items()},
        "tokens_with_slices_over_half": round(float((flat["abs_share_slices"] > 0.5).double().mean()), 4),
        "pooled_fraction_slices": round(float(S.sum() / logit.sum()), 4),
        "pooled_fraction_residual": round(float(R.sum() / logit.sum()), 4),
        "pooled_margin_fraction_slices": round(float(dS.sum() / margin.sum()), 4),
        "mean_margin": round(float(margin.mean()), 3),
        "mean_logit": round(float(logit.mean()), 3),
        "mean_abs_slices": round(float(S.abs().mean()), 3),
        "mean_gross_abs_slices": round(float(A.mean()), 3),
        "mean_abs_residual": round(float(R.abs().mean()), 3),
        "max_abs_bias": float(Bb.abs().max()),
        "max_abs_error": float((S + R + Bb - logit).abs().max()),
    }


def explanation_margin_fields(shares: Record, faith: Record | None) -> dict[str, object]:
    """The explanations' margin fields: ``explanation_margin_share`` Σ(ℓ̂_y1 − ℓ̂_y2) / Σ(ℓ_y1 − ℓ_y2) of the
    prototype-only prediction ℓ̂ = W ẑ + b, and ``explanation_margin_share_pca`` the same for the fixed-subspace
    yardstick W Q Qᵀ z + b (Q: the anchor z's mean and top k principal directions), both pooled over the answer
    tokens (``faith``: ``FaithfulnessAccumulator.result()`` of the answers, keys ``margin_share`` and
    ``pca_margin_share``); ``explanation_margin_share_parts`` the pooled Σ ΔS / Σ margin of the answers' logit
    parts (``logit_shares``), the same quantity from the generating forward, as a cross-check. Without ``faith``
    the first two are None, with the reason in ``why_null``."""
    out: dict[str, object] = {"explanation_margin_share_parts": shares.get("pooled_margin_fraction_slices")}
    if faith is None or "margin_share" not in faith:
        why = "the answers' pooled margins were not measured (explanations stage from before the field existed)"
        return out | {
            "explanation_margin_share": None,
            "explanation_margin_share_pca": None,
            "why_null": {"explanation_margin_share": why, "explanation_margin_share_pca": why},
        }
    pca = faith.get("pca_margin_share")
    return out | {"explanation_margin_share": _num(faith["margin_share"]),
                  "explanation_margin_share_pca": None if pca is None else _num(pca)}  # fmt: skip


# ----- the gathered summary (bench/real_claims.py) --------------------------------------------------------------
CLAIMS_FIELDS: dict[str, str] = {
    "suppression_best_drop": "suppression",
    "suppression_collateral": "suppression",
    "suppression_residual_best_drop": "suppression",
    "suppression_residual_collateral": "suppression",
    "suppression_mean_best_drop": "suppression",
    "suppression_mean_collateral": "suppression",
    "suppression_contrast_best_drop": "suppression",
    "suppression_contrast_collateral": "suppression",
    "controller_gain_over_prior": "controllers",
    "controller_minus_sae": "controllers",
    "controller_minus_dense": "controllers",
    "recall10_cached": "attribution",
    "recall10_ekfac": "attribution",
    "ekfac_cost_over_cached": "attribution",
    "mrr_nonlexical_cached": "attribution-nonlexical",
    "mrr_nonlexical_ekfac": "attribution-nonlexical",
    "mrr_nonlexical_bm25": "attribution-nonlexical",
    "ekfac_cost_over_cached_nonlexical": "attribution-nonlexical",
    "mrr_landmark_cached": "attribution-landmark",
    "mrr_landmark_ekfac": "attribution-landmark",
    "mrr_landmark_bm25": "attribution-landmark",
    "ekfac_cost_over_cached_landmark": "attribution-landmark",
    "logit_share_slices_abs": "explanations",
    "margin_fraction_slices_pooled": "explanations",
    "explanation_margin_share": "explanations",
    "explanation_margin_share_pca": "explanations",
}
"""The fields the gathered summary always has (field → the stage that writes it): null, with the reason in
``why_null``, where that stage has not run or did not measure it — never filled in from elsewhere."""


def gathered_summary(stages: Mapping[str, Record], order: Sequence[str]) -> dict[str, object]:
    """The summary of ``real-claims.json`` from the stage records (name → the stage's JSON), merged in ``order``
    (a later stage's field wins): every field of ``CLAIMS_FIELDS`` (None where missing, the reason in
    ``why_null``: the stage's own reason if it gives one), and ``head``: stage → the head it ran on (None for a
    stage not run, or recorded before the head was named). The controllers' summary is derived again from the
    stage's recorded task rows (``controller_summary``)."""
    summary: dict[str, object] = {}
    why: dict[str, str] = {}
    for name in order:
        part = stages.get(name, {}).get("summary")
        rows = stages.get(name, {}).get("tasks")
        if name == "controllers" and isinstance(part, Mapping) and isinstance(rows, list) and rows:
            # a pure function of the recorded task rows: derived again, so fields added since the stage ran
            # (the pooled McNemar p) are there
            part = {**part, **controller_summary(rows)}
        if isinstance(part, Mapping):
            summary.update({k: v for k, v in part.items() if k != "why_null"})
            own = part.get("why_null")
            why.update({str(k): str(v) for k, v in own.items()} if isinstance(own, Mapping) else {})
    for field_, stage in CLAIMS_FIELDS.items():
        if summary.get(field_) is not None:
            why.pop(field_, None)
            continue
        summary[field_] = None
        if stage not in stages:
            why[field_] = f"the {stage} stage has not run"
        else:
            why.setdefault(field_, f"the {stage} stage's summary has no {field_} (recorded before it existed)")
    head: dict[str, object] = {}
    for name in order:
        head[name] = stages[name].get("head") if name in stages else None
        if head[name] is None:
            why[f"head.{name}"] = (
                f"the {name} stage has not run"
                if name not in stages
                else f"the {name} stage's record predates --head (the paper's head was the only one then)"
            )
    summary["head"] = head
    if why:
        summary["why_null"] = why
    return summary


# ----- the goals of the claims issue, read off a gathered summary ------------------------------------------------
def claims_goals(summary: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """Each goal of the claims (the paper's numbers in the issue) read off a ``gathered_summary``: goal →
    ``{"met": bool | None, "values": {field: value}, "target": str}``; ``met`` is None when a field it needs is
    null (the stage has not run), never guessed. Suppression is met by any of its modes (slices only, the span
    projection, the mean direction, the contrast direction), each judged by its own ``goal_met`` (its best row already obeys ≤ 1% neutral
    CE and ≤ 2% of the bank); controllers are in accuracy points."""

    def get(*names: str) -> tuple[dict[str, object], list[float] | None]:
        vals = {n: summary.get(n) for n in names}
        nums = [float(v) for v in vals.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return vals, nums if len(nums) == len(names) else None

    goals: dict[str, dict[str, object]] = {}

    def goal(
        name: str, target: str, names: tuple[str, ...], test: Callable[[list[float]], bool], beside: Sequence[str] = ()
    ) -> None:
        """``beside``: fields shown with the values that the test does not read (the noise around them)."""
        vals, nums = get(*names)
        vals.update({f: summary.get(f) for f in beside})
        goals[name] = {"met": None if nums is None else bool(test(nums)), "values": vals, "target": target}

    # suppression: met by any mode whose best set (already within <= 1% neutral CE and <= 2% of the bank) reaches
    # the drop; a mode with no set inside the limits has a null drop and goal_met False — measured, not met
    prefixes = ("suppression_", *SUMMARY_PREFIXES.values())
    flags = {f"{pre}goal_met": summary.get(f"{pre}goal_met") for pre in prefixes}
    ran = [v for v in flags.values() if isinstance(v, bool)]
    drops = tuple(f"{pre}best_drop" for pre in prefixes)
    goals["suppression"] = {
        "met": any(ran) if ran else None,
        "values": {f: summary.get(f) for f in drops},
        "target": "drop >= 0.8 (of the excess over neutral text with the residual edited; raw with slices only) at "
        "<= 1% neutral CE and <= 2% of the bank, in any mode",
    }
    goal(
        "controllers",
        "> the choice prior, and >= the SAE and the dense controller by 2 points (means over tasks; the pooled "
        "McNemar p beside them says whether each gap is outside the noise)",
        ("controller_gain_over_prior", "controller_minus_sae", "controller_minus_dense"),
        lambda v: v[0] > 0 and v[1] >= 2 and v[2] >= 2,
        beside=[f"controller_vs_{side}_mcnemar_p" for side in ("prior", "sae", "dense")],
    )
    for name, set_name, what in (
        ("attribution", "nonlexical", "non-lexical (alias, two-hop, synonym)"),
        ("attribution_landmark", "landmark", "landmark (a real city's made-up fact, asked through a sight)"),
    ):
        goal(
            name,
            f"{what} MRR >= EK-FAC's and >= BM25's + 0.2, at >= 100x less per-query cost batched",
            (
                f"mrr_{set_name}_cached",
                f"mrr_{set_name}_ekfac",
                f"mrr_{set_name}_bm25",
                f"ekfac_cost_over_cached_{set_name}",
            ),
            lambda v: v[0] >= v[1] and v[0] >= v[2] + 0.2 and v[3] >= 100,
        )
    goal("explanations", "slices carry >= 0.8 of the answer token's margin", ("explanation_margin_share",),
         lambda v: v[0] >= 0.8)  # fmt: skip
    return goals
