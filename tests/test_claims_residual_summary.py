"""The claims-v2 summary arithmetic (prismlm.eval.claims) on small fixed inputs worked out by hand: the
residual-projecting suppression is ranked and reported by the drop of the excess over neutral text (not the raw
drop), against whole-bank random draws of its size and mode; the explanations' pooled margin fields; the gathered
summary's new fields, null with a reason where their stage has not run, and the head of each stage."""

from __future__ import annotations

import numpy as np
import pytest

from prismlm.eval.claims import (
    CLAIMS_FIELDS,
    best_suppression_row,
    claims_goals,
    condition_mode,
    explanation_margin_fields,
    gathered_summary,
    is_random,
    random_controls,
    residual_suppression_summary,
    suppression_rows,
)


def test_condition_names_carry_the_residual_mode():
    assert condition_mode("kjv@41+project") == ("kjv@41", "project")
    assert condition_mode("random2@41") == ("random2@41", "keep")
    assert condition_mode("before") == ("before", "keep")
    assert is_random("random@8") and is_random("random0@8+project") and not is_random("kjv@8+project")


def _recs() -> dict[str, dict[str, object]]:
    def rec(ids: list[int], ce_n: float, ce_k: float, acc: float) -> dict[str, object]:
        return {"ids": ids, "ce_neutral": ce_n, "ce_kjv": ce_k, "acc": acc, "acc_norm": acc}

    return {
        "before": rec([], 2.0, 4.0, 0.5),
        "kjv@2": rec([3, 7], 2.01, 4.4, 0.5),
        "kjv@2+project": rec([3, 7], 2.016, 5.0, 0.45),
        "random0@2+project": rec([1, 9], 2.002, 4.1, 0.5),
        "random1@2+project": rec([4, 8], 2.004, 4.2, 0.5),
        "random0@2": rec([1, 9], 2.0, 4.0, 0.5),
    }


def _scores() -> dict[str, dict[str, dict[str, np.ndarray]]]:
    neutral = np.array([0.2, 0.2])
    per = {"before": np.array([0.6, 0.6]), "kjv@2": np.array([0.5, 0.5])}
    per |= {"kjv@2+project": np.array([0.3, 0.3]), "random0@2+project": np.array([0.5, 0.5])}
    per |= {"random1@2+project": np.array([0.6, 0.6]), "random0@2": np.array([0.6, 0.6])}
    per |= {f"{c}/neutral": neutral for c in list(per)}
    return {"kjv": {"tfidf": per}}


def test_residual_rows_have_the_mode_and_the_excess_drop():
    rows = suppression_rows(["kjv"], _recs(), _scores(), K=100, n_boot=50, seed=0)
    by = {r["condition"]: r for r in rows}
    assert set(by) == set(_recs())
    r = by["kjv@2+project"]
    assert r["residual"] == "project" and r["set"] == "kjv@2" and r["prototypes"] == 2
    assert r["tfidf_drop"] == pytest.approx(0.5)  # 1 − 0.3 / 0.6
    assert r["tfidf_excess_drop"] == pytest.approx(0.75)  # 1 − (0.3 − 0.2) / (0.6 − 0.2)
    assert r["ce_neutral_rel_increase"] == pytest.approx(0.008) and r["ce_concept_rel_increase"] == pytest.approx(0.25)
    assert r["task_acc_change"] == pytest.approx(-0.05)
    assert by["kjv@2"]["residual"] == "keep" and by["random0@2+project"]["tfidf_excess_drop"] == pytest.approx(0.25)


def _row(cond: str, raw: float, excess: float, collateral: float = 0.0, n: int = 8) -> dict[str, object]:
    base, mode = condition_mode(cond)
    return {"concept": "kjv", "condition": cond, "set": base, "residual": mode, "prototypes": n, "bank_share": n / 400,
            "tfidf_drop": raw, "tfidf_excess_drop": excess, "ce_neutral_rel_increase": collateral,
            "ce_concept_rel_increase": 0.3, "task_acc_change": -0.01}  # fmt: skip


ROWS = [
    _row("kjv@8", 0.95, 0.99),  # exact slice removal: not a candidate of the residual summary
    _row("kjv@8+project", 0.60, 0.70),  # the largest raw drop …
    _row("kjv@4+project", 0.50, 0.90, 0.004, n=4),  # … but the largest excess drop
    _row("kjv@6+project", 0.58, 0.95, 0.02, n=6),  # over the 1% collateral limit
    _row("kjv@40+project", 0.99, 0.99, n=40),  # over 2% of the bank
    _row("random0@4+project", 0.99, 0.99, n=4),  # controls, never the best set
    _row("random0@4+project", 0.2, 0.1, n=4) | {"condition": "random1@4+project"},
    _row("random1@4+project", 0.1, 0.3, n=4),
    _row("random0@4", 0.1, 0.5, n=4),  # the other mode
    _row("random@4+project", 0.1, 0.8, n=4),  # the first run's neutral-active control is not a whole-bank draw
    _row("random0@8+project", 0.1, 0.4),  # another size
]


def test_the_residual_best_row_is_ranked_by_the_excess_drop():
    best = best_suppression_row(ROWS, {"kjv"}, 0.02, 0.01, "project", "tfidf_excess_drop")
    assert best is not None and best["condition"] == "kjv@4+project"
    # exact slice removal (the first run's ranking by the raw drop) ignores the projected rows
    keep = best_suppression_row(ROWS, {"kjv"}, 0.02, 0.01)
    assert keep is not None and keep["condition"] == "kjv@8"
    assert best_suppression_row(ROWS[:1], {"kjv"}, 0.02, 0.01, "project", "tfidf_excess_drop") is None


def test_residual_summary_fields_against_same_size_whole_bank_draws():
    best = best_suppression_row(ROWS, {"kjv"}, 0.02, 0.01, "project", "tfidf_excess_drop")
    assert best is not None
    assert random_controls(ROWS, best, "tfidf_excess_drop") == [0.99, 0.1, 0.3]
    s = residual_suppression_summary(best, ROWS, True)
    assert s["suppression_residual_best_drop"] == 0.90 and s["suppression_residual_raw_drop"] == 0.50
    assert s["suppression_residual_collateral"] == 0.004 and s["suppression_residual_bank_share"] == 4 / 400
    assert s["suppression_residual_random_drop"] == pytest.approx((0.99 + 0.1 + 0.3) / 3)
    assert s["suppression_residual_random_draws"] == 3 and s["suppression_residual_goal_met"] is True
    assert s["suppression_residual_export_identical"] is True and s["suppression_residual_concept"] == "kjv"
    low = residual_suppression_summary(_row("kjv@4+project", 0.95, 0.79, n=4), ROWS, False)
    assert low["suppression_residual_goal_met"] is False  # the goal is on the excess drop, not the raw one
    none = residual_suppression_summary(None, ROWS, None)
    assert none["suppression_residual_best_drop"] is None and none["suppression_residual_goal_met"] is False
    assert set(none["why_null"]) == {"suppression_residual_best_drop", "suppression_residual_collateral"}
    s = gathered_summary({"suppression": {"summary": none}}, ["suppression"])  # the stage's reason is kept
    assert s["why_null"]["suppression_residual_best_drop"] == none["why_null"]["suppression_residual_best_drop"]
    assert "why_null" not in {k for k, v in s.items() if k.startswith("suppression_residual")}


def test_explanation_margin_fields():
    shares = {"pooled_margin_fraction_slices": 0.17}
    f = explanation_margin_fields(shares, {"margin_share": 0.2, "pca_margin_share": 0.45, "kl": 1.0})
    assert f == {"explanation_margin_share_parts": 0.17, "explanation_margin_share": 0.2,
                 "explanation_margin_share_pca": 0.45}  # fmt: skip
    f = explanation_margin_fields(shares, None)
    assert f["explanation_margin_share"] is None and f["explanation_margin_share_pca"] is None
    assert set(f["why_null"]) == {"explanation_margin_share", "explanation_margin_share_pca"}


ORDER = ["bank", "suppression", "controllers", "attribution", "attribution-nonlexical", "attribution-landmark",
         "explanations"]  # fmt: skip


def test_gathered_summary_new_fields_heads_and_reasons():
    stages = {
        "bank": {"summary": {}, "head": "faithful"},
        "suppression": {"head": "faithful", "summary": {"suppression_best_drop": 0.3, "suppression_collateral": 0.01,
                        "suppression_residual_best_drop": 0.85, "suppression_residual_collateral": 0.002}},
        "controllers": {"head": "faithful", "summary": {"controller_minus_dense": 2.5, "controller_minus_sae": 1.0}},
        "attribution-nonlexical": {"head": "faithful", "summary": {"mrr_nonlexical_cached": 0.6,
                                   "mrr_nonlexical_bm25": 0.2, "ekfac_cost_over_cached_nonlexical": 150.0}},
        "explanations": {"summary": {"explanation_margin_share": None, "why_null": {"explanation_margin_share": "x"}}},
    }  # fmt: skip
    s = gathered_summary(stages, ORDER)
    assert set(CLAIMS_FIELDS) <= set(s)
    assert s["suppression_residual_best_drop"] == 0.85 and s["suppression_residual_collateral"] == 0.002
    assert s["controller_minus_dense"] == 2.5 and s["mrr_nonlexical_cached"] == 0.6
    assert s["mrr_nonlexical_bm25"] == 0.2 and s["ekfac_cost_over_cached_nonlexical"] == 150.0
    why = s["why_null"]
    assert s["mrr_nonlexical_ekfac"] is None and "has no mrr_nonlexical_ekfac" in why["mrr_nonlexical_ekfac"]
    assert s["recall10_cached"] is None and why["recall10_cached"] == "the attribution stage has not run"
    assert s["explanation_margin_share"] is None and why["explanation_margin_share"] == "x"  # the stage's own reason
    assert "explanation_margin_share_pca" in why and "controller_minus_dense" not in why
    assert s["head"] == {"bank": "faithful", "suppression": "faithful", "controllers": "faithful", "attribution": None,
                         "attribution-nonlexical": "faithful", "attribution-landmark": None,
                         "explanations": None}  # fmt: skip
    assert why["head.attribution"] == "the attribution stage has not run"
    assert "predates --head" in why["head.explanations"]
    full = {k: {"head": "paper", "summary": {f: 1.0 for f, st in CLAIMS_FIELDS.items() if st == k}} for k in ORDER}
    done = gathered_summary(full, ORDER)
    assert "why_null" not in done and set(done["head"].values()) == {"paper"}


def test_gathered_controllers_fields_are_derived_again_from_the_recorded_task_rows():
    """A controllers record from before the pooled McNemar p existed: its summary lacks it, its task rows have
    the paired counts, and the gathered summary has the p (and the recorded means, unchanged)."""
    row = {"base": {"acc": 0.6}, "choice_prior": {"acc": 0.6},
           "prism": {"test_after": {"acc": 0.7}, "delta_acc": 0.1, "paired_vs_prior": {"gained": 9, "lost": 1}},
           "sae": {"test_after": {"acc": 0.6}, "delta_acc": 0.0}}  # fmt: skip
    old = {"controller_tasks": 1, "controller_gain_over_prior": 10.0}
    s = gathered_summary({"controllers": {"summary": old, "tasks": [row]}}, ORDER)
    assert s["controller_gain_over_prior"] == 10.0 and s["controller_vs_prior_gained_lost"] == [9, 1]
    assert s["controller_vs_prior_mcnemar_p"] == pytest.approx(2 * 11 / 2**10)  # 2·(1 + 10)/2¹⁰


# ----- the mean mode (residual="mean"): its own conditions, rows, controls and summary fields -----------------
MEAN_ROWS = [
    _row("kjv@4+mean", 0.40, 0.60, 0.002, n=4),  # the best mean set: largest excess drop within the limits
    _row("kjv@8+mean", 0.45, 0.55, 0.003),
    _row("kjv@6+mean", 0.90, 0.97, 0.03, n=6),  # over the collateral limit
    _row("random0@4+mean", 0.05, 0.2, n=4),  # its controls: same size, same mode
    _row("random1@4+mean", 0.15, 0.4, n=4),
    _row("random0@8+mean", 0.3, 0.9),  # another size
]


def test_mean_conditions_are_their_own_mode():
    assert condition_mode("kjv@41+mean") == ("kjv@41", "mean")
    assert condition_mode("random2@41+mean") == ("random2@41", "mean")
    assert is_random("random0@8+mean") and not is_random("kjv@8+mean")
    assert condition_mode("kjv@41+contrast") == ("kjv@41", "contrast")
    assert condition_mode("random0@41+contrast") == ("random0@41", "contrast") and is_random("random0@41+contrast")


def test_contrast_summary_is_built_from_its_own_rows_and_draws():
    """The ``contrast`` rows (the mean's values under another suffix) give the mean's summary under
    ``suppression_contrast_…``; the mean rows beside them change nothing; the goal reads either mode."""
    contrast = [{**r, "condition": str(r["condition"]).replace("+mean", "+contrast"), "residual": "contrast"}
                for r in MEAN_ROWS]  # fmt: skip
    rows = ROWS + MEAN_ROWS + contrast
    best = best_suppression_row(rows, {"kjv"}, 0.02, 0.01, "contrast", "tfidf_excess_drop")
    assert best is not None and best["condition"] == "kjv@4+contrast"
    s = residual_suppression_summary(best, rows, True, mode="contrast")
    mean = residual_suppression_summary(
        best_suppression_row(ROWS + MEAN_ROWS, {"kjv"}, 0.02, 0.01, "mean", "tfidf_excess_drop"),
        rows,
        True,
        mode="mean",
    )
    assert s == {k.replace("suppression_mean_", "suppression_contrast_"): v for k, v in mean.items()}
    g = gathered_summary({"suppression": {"summary": s | {"suppression_contrast_goal_met": True}}}, ["suppression"])
    assert g["suppression_contrast_best_drop"] == 0.60 and g["suppression_contrast_collateral"] == 0.002
    assert claims_goals(g)["suppression"]["met"] is True
    assert claims_goals(g)["suppression"]["values"]["suppression_contrast_best_drop"] == 0.60


def test_mean_summary_beside_the_project_one():
    """With rows of both modes, the ``mean`` summary (``suppression_mean_…``) is built from the mean rows and
    mean draws only, and the ``project`` summary keeps its names and values (those of ``ROWS`` alone)."""
    rows = ROWS + MEAN_ROWS
    best = best_suppression_row(rows, {"kjv"}, 0.02, 0.01, "mean", "tfidf_excess_drop")
    assert best is not None and best["condition"] == "kjv@4+mean"
    assert random_controls(rows, best, "tfidf_excess_drop") == [0.2, 0.4]
    s = residual_suppression_summary(best, rows, True, mode="mean")
    assert s == {
        "suppression_mean_best_drop": 0.60,
        "suppression_mean_collateral": 0.002,
        "suppression_mean_raw_drop": 0.40,
        "suppression_mean_bank_share": 4 / 400,
        "suppression_mean_concept": "kjv",
        "suppression_mean_concept_ce_increase": 0.3,
        "suppression_mean_task_acc_change": -0.01,
        "suppression_mean_random_drop": pytest.approx(0.3),
        "suppression_mean_random_draws": 2,
        "suppression_mean_goal_met": False,
        "suppression_mean_export_identical": True,
    }
    bp = best_suppression_row(rows, {"kjv"}, 0.02, 0.01, "project", "tfidf_excess_drop")
    assert bp is not None and bp["condition"] == "kjv@4+project"  # the mean rows change nothing for project
    assert residual_suppression_summary(bp, rows, True) == residual_suppression_summary(bp, ROWS, True)
    assert all(k.startswith("suppression_residual_") for k in residual_suppression_summary(bp, rows, True))
    none = residual_suppression_summary(None, rows, None, mode="mean")
    assert none["suppression_mean_best_drop"] is None and none["suppression_mean_goal_met"] is False
    assert set(none["why_null"]) == {"suppression_mean_best_drop", "suppression_mean_collateral"}
    assert "mean-projected" in none["why_null"]["suppression_mean_best_drop"]
    old = residual_suppression_summary(None, ROWS, None)["why_null"]["suppression_residual_best_drop"]
    assert old == "no projected concept set within the bank-share and collateral limits (or none measured)"
    g = gathered_summary({"suppression": {"summary": s}}, ["suppression"])
    assert g["suppression_mean_best_drop"] == 0.60 and g["suppression_mean_collateral"] == 0.002
    assert g["suppression_residual_best_drop"] is None  # a stage without project rows says why
    assert "has no suppression_residual_best_drop" in g["why_null"]["suppression_residual_best_drop"]


def test_mean_rows_have_the_mode():
    recs = _recs() | {"kjv@2+mean": {"ids": [3, 7], "ce_neutral": 2.004, "ce_kjv": 4.2, "acc": 0.5, "acc_norm": 0.5}}
    scores = _scores()
    per = scores["kjv"]["tfidf"]
    per |= {"kjv@2+mean": np.array([0.4, 0.4]), "kjv@2+mean/neutral": np.array([0.2, 0.2])}
    by = {r["condition"]: r for r in suppression_rows(["kjv"], recs, scores, K=100, n_boot=50, seed=0)}
    r = by["kjv@2+mean"]
    assert r["residual"] == "mean" and r["set"] == "kjv@2"
    assert r["tfidf_excess_drop"] == pytest.approx(0.5)  # 1 − (0.4 − 0.2) / (0.6 − 0.2)
    assert r["ce_neutral_rel_increase"] == pytest.approx(0.002)
