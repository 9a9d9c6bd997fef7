"""The claims' summary arithmetic (prismlm.eval.claims) on small fixed inputs worked out by hand: the best
suppression set is the one with the *largest* drop within the limits, cost ratios are method ÷ cache, the pooled
margin share is signed, the controllers' gains are means in points."""

from __future__ import annotations

import numpy as np
import pytest

from prismlm.errors import ArtifactMismatch
from prismlm.eval.claims import (
    PARTS,
    attribution_summary,
    behaviour_gap,
    best_suppression_row,
    claims_goals,
    controller_summary,
    earlier_method_rows,
    logit_shares,
    suppression_rows,
    suppression_summary,
)


def _row(concept: str, cond: str, drop: float, collateral: float, n: int = 8, K: int = 400) -> dict[str, object]:
    return {
        "concept": concept,
        "condition": cond,
        "prototypes": n,
        "bank_share": n / K,
        "tfidf_drop": drop,
        "tfidf_drop_ci95": [drop - 0.1, drop + 0.1],
        "ce_neutral_rel_increase": collateral,
    }


ROWS = [
    _row("kjv", "before", 0.0, 0.0, n=0),
    _row("kjv", "kjv@8", 0.10, 0.001),
    _row("kjv", "kjv@4", 0.50, 0.002, n=4),
    _row("kjv", "kjv@6", 0.30, 0.0, n=6),
    _row("kjv", "kjv@16", 0.90, 0.5, n=16),  # over the 1% collateral limit
    _row("kjv", "kjv@40", 0.95, 0.0, n=40),  # over 2% of the bank (8 of 400)
    _row("kjv", "random@8", 0.99, 0.0),  # a control, never the best set
    _row("sotu", "sotu@8", 0.70, 0.0),  # a concept the model does not show
]


def test_best_suppression_row_is_the_largest_drop_within_the_limits():
    best = best_suppression_row(ROWS, {"kjv"}, max_bank_share=0.02, max_collateral=0.01)
    assert best is not None and best["condition"] == "kjv@4"
    # with no concept shown, any concept's sets compete
    best = best_suppression_row(ROWS, set(), max_bank_share=0.02, max_collateral=0.01)
    assert best is not None and best["condition"] == "sotu@8"
    assert best_suppression_row(ROWS[:1], {"kjv"}, 0.02, 0.01) is None


def test_suppression_summary_fields():
    best = best_suppression_row(ROWS, {"kjv"}, max_bank_share=0.02, max_collateral=0.01)
    s = suppression_summary(best, {"kjv": {"shown": True}, "sotu": {"shown": False}}, True)
    assert s["suppression_best_drop"] == 0.50 and s["suppression_collateral"] == 0.002
    assert s["suppression_bank_share"] == 4 / 400 and s["suppression_best_concept"] == "kjv"
    assert s["suppression_best_drop_ci95"] == [0.4, 0.6] and s["suppression_goal_met"] is False
    assert s["suppression_behaviour_shown"] == {"kjv": True, "sotu": False}
    assert suppression_summary(_row("kjv", "kjv@4", 0.85, 0.0), {}, False)["suppression_goal_met"] is True
    assert suppression_summary(None, {}, None)["suppression_best_drop"] is None


def test_suppression_rows_drops_and_collateral():
    recs = {
        "before": {"ids": [], "ce_neutral": 2.0, "ce_kjv": 4.0, "acc": 0.5, "acc_norm": 0.4},
        "kjv@2": {"ids": [3, 7], "ce_neutral": 2.02, "ce_kjv": 5.0, "acc": 0.45, "acc_norm": 0.4},
        "random@2": {"ids": [1, 9], "ce_neutral": 2.0, "ce_kjv": 4.0, "acc": 0.5, "acc_norm": 0.4},
        "random@5": {"ids": [1, 2, 3, 4, 5], "ce_neutral": 2.0, "ce_kjv": 4.0, "acc": 0.5, "acc_norm": 0.4},
    }
    per = {
        "before": np.array([0.4, 0.4]),
        "before/neutral": np.array([0.1, 0.1]),
        "kjv@2": np.array([0.3, 0.1]),  # mean 0.2
        "kjv@2/neutral": np.array([0.1, 0.1]),
        "random@2": np.array([0.4, 0.4]),
        "random@2/neutral": np.array([0.1, 0.1]),
    }  # no random@5 scores: that control has no set of its size here, so it gets no row
    rows = suppression_rows(["kjv"], recs, {"kjv": {"tfidf": per}}, K=100, n_boot=50, seed=0)
    by = {r["condition"]: r for r in rows}
    assert set(by) == {"before", "kjv@2", "random@2"}
    r = by["kjv@2"]
    assert r["tfidf_drop"] == pytest.approx(0.5)  # 1 − 0.2 / 0.4
    assert r["tfidf_excess_drop"] == pytest.approx(1 - (0.2 - 0.1) / (0.4 - 0.1))
    assert r["tfidf_provocative"] == pytest.approx(0.2) and r["tfidf_neutral"] == pytest.approx(0.1)
    assert r["ce_neutral_rel_increase"] == pytest.approx(0.01) and r["ce_concept_rel_increase"] == pytest.approx(0.25)
    assert r["task_acc_change"] == pytest.approx(-0.05) and r["bank_share"] == 0.02 and r["prototypes"] == 2
    assert by["before"]["tfidf_drop_ci95"] == [0.0, 0.0] and by["random@2"]["tfidf_drop"] == pytest.approx(0.0)


def test_behaviour_gap_is_shown_only_when_its_interval_is_above_zero():
    g = behaviour_gap(np.array([0.5, 0.6, 0.55, 0.5]), np.array([0.1, 0.2, 0.15]), n_boot=200, seed=0)
    assert g["gap"] == pytest.approx(0.5375 - 0.15) and g["shown"] is True
    g = behaviour_gap(np.array([0.1, 0.5, 0.1, 0.5]), np.array([0.1, 0.5, 0.3]), n_boot=200, seed=0)
    assert g["shown"] is False


def test_attribution_cost_ratios_are_method_over_cache():
    planted = {
        name: {"all": {"recall@10": r, "mrr": m}, "paraphrase": {"recall@10": r / 2, "mrr": m / 2}}
        for name, r, m in [("cached", 0.9, 0.8), ("bm25", 1.0, 0.7), ("ekfac", 0.8, 0.6), ("trak", 0.7, 0.5)]
    }
    costs = {
        "cached": {"per_query_s": 0.5, "single_query_s": 0.5},
        "ekfac": {"per_query_s": 3.5, "single_query_s": 64.0},
        "trak": {"per_query_s": 1.0, "single_query_s": 10.0},
    }
    s = attribution_summary(planted, costs)
    assert s["ekfac_cost_over_cached"] == pytest.approx(7.0)  # EK-FAC costs 7× the cache
    assert s["ekfac_single_query_cost_over_cached"] == pytest.approx(128.0)
    assert s["trak_cost_over_cached"] == pytest.approx(2.0) and s["trak_single_query_cost_over_cached"] == 20.0
    assert s["recall10_cached"] == 0.9 and s["mrr_ekfac"] == 0.6 and s["recall10_bm25_paraphrase"] == 0.5
    assert s["mrr_cached_paraphrase"] == 0.4 and s["recall10_trak_paraphrase"] == 0.35
    assert "recall10_bergson" not in s and "recall10_hybrid" not in s and "recall10_cached_compact" not in s


def test_controller_summary_means_in_points():
    rows = [
        {"base": {"acc": 0.50}, "choice_prior": {"acc": 0.55}, "prism": {"test_after": {"acc": 0.60}, "delta_acc": 0.10},
         "sae": {"test_after": {"acc": 0.52}, "delta_acc": 0.02}},
        {"base": {"acc": 0.70}, "choice_prior": {"acc": 0.72}, "prism": {"test_after": {"acc": 0.70}, "delta_acc": 0.0},
         "sae": {"test_after": {"acc": 0.74}, "delta_acc": 0.04}},
    ]  # fmt: skip
    s = controller_summary(rows)
    assert s["controller_tasks"] == 2
    assert s["controller_gain_over_prior"] == pytest.approx(100 * (0.05 - 0.02) / 2)
    assert s["controller_minus_sae"] == pytest.approx(100 * (0.08 - 0.04) / 2)
    assert s["controller_gain_over_base"] == pytest.approx(5.0) and s["sae_gain_over_base"] == pytest.approx(3.0)
    assert s["sae_gain_over_prior"] == pytest.approx(100 * (-0.03 + 0.02) / 2)
    assert s["prior_gain_over_base"] == pytest.approx(100 * (0.05 + 0.02) / 2)
    assert controller_summary([]) == {"controller_tasks": 0}
    assert "controller_minus_dense" not in s  # rows without the dense baseline (measured before it existed)


def _dense_rows(prism: tuple[float, float], dense: tuple[float, float]) -> list[dict[str, object]]:
    return [
        {"base": {"acc": 0.60}, "choice_prior": {"acc": 0.60},
         "prism": {"test_after": {"acc": prism[0]}, "delta_acc": prism[0] - 0.60},
         "sae": {"test_after": {"acc": 0.60}, "delta_acc": 0.0},
         "dense": {"test_after": {"acc": dense[0]}, "delta_acc": dense[0] - 0.60}},
        {"base": {"acc": 0.80}, "choice_prior": {"acc": 0.78},
         "prism": {"test_after": {"acc": prism[1]}, "delta_acc": prism[1] - 0.80},
         "sae": {"test_after": {"acc": 0.80}, "delta_acc": 0.0},
         "dense": {"test_after": {"acc": dense[1]}, "delta_acc": dense[1] - 0.80}},
    ]  # fmt: skip


def test_controller_minus_dense_in_points_and_its_sign():
    s = controller_summary(_dense_rows(prism=(0.66, 0.81), dense=(0.62, 0.84)))
    # by hand: ((0.66 − 0.62) + (0.81 − 0.84)) / 2 = +0.005 → +0.5 points: the controller ahead
    assert s["controller_minus_dense"] == pytest.approx(0.5)
    assert s["dense_gain_over_base"] == pytest.approx(100 * (0.02 + 0.04) / 2)
    assert s["dense_gain_over_prior"] == pytest.approx(100 * (0.02 + 0.06) / 2)
    # a sign flip (dense − controller) would give −0.5: swapping the sides must flip the field
    swapped = controller_summary(_dense_rows(prism=(0.62, 0.84), dense=(0.66, 0.81)))
    assert swapped["controller_minus_dense"] == pytest.approx(-0.5)
    # the other fields do not depend on the dense side
    assert s["controller_minus_sae"] == pytest.approx(100 * (0.06 + 0.01) / 2)
    assert "controller_vs_dense_mcnemar_p" not in s  # rows without paired counts


def test_controller_summary_pools_each_tasks_paired_counts_into_one_mcnemar_p():
    rows = _dense_rows(prism=(0.66, 0.81), dense=(0.62, 0.84))
    for row, (g_prior, l_prior), (g_sae, l_sae), (g_dense, l_dense) in zip(
        rows, [(6, 1), (4, 1)], [(3, 3), (2, 0)], [(5, 2), (1, 4)], strict=True
    ):
        row["prism"]["paired_vs_prior"] = {"gained": g_prior, "lost": l_prior}  # type: ignore[index]
        row["prism_vs_sae"] = {"gained": g_sae, "lost": l_sae}
        row["prism_vs_dense"] = {"gained": g_dense, "lost": l_dense}
    s = controller_summary(rows)
    # by hand, pooled over both tasks: prior 10 gained / 2 lost → 2·(1 + 12 + 66)/2¹² = 158/4096;
    # SAE 5 / 3 → 2·(1 + 8 + 28 + 56)/2⁸ = 186/256; dense 6 / 6 → capped at 1
    assert s["controller_vs_prior_gained_lost"] == [10, 2]
    assert s["controller_vs_prior_mcnemar_p"] == pytest.approx(158 / 4096)
    assert s["controller_vs_sae_mcnemar_p"] == pytest.approx(186 / 256)
    assert s["controller_vs_dense_gained_lost"] == [6, 6] and s["controller_vs_dense_mcnemar_p"] == 1.0
    del rows[1]["prism_vs_sae"]  # a task without the SAE's counts: no pooled p for the SAE
    assert "controller_vs_sae_mcnemar_p" not in controller_summary(rows)


def _parts(logit, S, R, runner_logit, runner_S, abs_slices=None):
    """One PARTS row: bias 0, the yardstick parts 0, runner-up bias 0."""
    vals = dict.fromkeys(PARTS, 0.0)
    vals.update(logit=logit, slices=S, abs_slices=abs(S) if abs_slices is None else abs_slices, residual=R,
                top_slice=abs(S), runner_up_logit=runner_logit, runner_up_slices=runner_S)  # fmt: skip
    return [vals[k] for k in PARTS]


def test_logit_shares_pooled_and_signed():
    answers = [
        [_parts(5.0, 3.0, 2.0, 2.0, 1.0), _parts(4.0, 1.0, 3.0, 3.0, 2.0)],  # margins 3, 1; ΔS = 2, −1
        [_parts(2.0, -1.0, 3.0, 1.0, 0.0)],  # margin 1, ΔS = −1
        [],  # an answer without tokens is skipped
    ]
    s = logit_shares(answers)
    assert s["answers"] == 2 and s["tokens"] == 3
    assert s["pooled_margin_fraction_slices"] == pytest.approx((2 - 1 - 1) / (3 + 1 + 1))  # signed ΔS
    assert s["pooled_fraction_slices"] == pytest.approx((3 + 1 - 1) / (5 + 4 + 2), abs=1e-4)
    assert s["pooled_fraction_residual"] == pytest.approx((2 + 3 + 3) / 11, abs=1e-4)
    # per answer then over answers: |S| / (|S| + |R|) = (3/5 + 1/4) / 2 for the first, 1/4 for the second
    assert s["mean"]["abs_share_slices"] == pytest.approx(round(((3 / 5 + 1 / 4) / 2 + 1 / 4) / 2, 4))
    # margin |ΔS| / (|ΔS| + |ΔR|): ΔR = margin − ΔS → 2/3, 1/3; then 1/3
    assert s["mean"]["margin_abs_share_slices"] == pytest.approx(round(((2 / 3 + 1 / 3) / 2 + 1 / 3) / 2, 4))
    assert s["max_abs_error"] == pytest.approx(0.0) and s["mean_margin"] == pytest.approx(5 / 3, abs=1e-3)
    assert logit_shares([[]])["tokens"] == 0


def test_claims_goals_are_met_only_at_their_thresholds_and_unmeasured_when_a_field_is_null():
    summary = {
        "suppression_goal_met": False,
        "suppression_residual_goal_met": True,
        "suppression_residual_best_drop": 0.8,
        "controller_gain_over_prior": 0.5,
        "controller_minus_sae": 2.0,
        "controller_minus_dense": 1.99,
        "mrr_nonlexical_cached": 0.65,
        "mrr_nonlexical_ekfac": 0.6,
        "mrr_nonlexical_bm25": 0.4,
        "ekfac_cost_over_cached_nonlexical": 100.0,
        "explanation_margin_share": None,
    }
    goals = claims_goals(summary)
    assert goals["suppression"]["met"] is True  # one mode reaches it
    assert goals["suppression"]["values"]["suppression_residual_best_drop"] == 0.8
    assert goals["controllers"]["met"] is False  # 1.99 points over the dense controller: short of 2
    assert goals["attribution"]["met"] is True
    assert goals["explanations"]["met"] is None and goals["explanations"]["values"] == {
        "explanation_margin_share": None
    }
    assert claims_goals({**summary, "mrr_nonlexical_bm25": 0.46})["attribution"]["met"] is False  # BM25 + 0.2 > MRR
    assert claims_goals({**summary, "ekfac_cost_over_cached_nonlexical": 99.0})["attribution"]["met"] is False
    # the landmark set is judged alike from its own fields, apart from the first non-lexical set's
    assert goals["attribution_landmark"]["met"] is None
    landmark = {k.replace("_nonlexical", "_landmark"): v for k, v in summary.items() if "nonlexical" in k}
    assert claims_goals(landmark)["attribution_landmark"]["met"] is True
    assert claims_goals(landmark)["attribution"]["met"] is None
    assert claims_goals({**landmark, "mrr_landmark_bm25": 0.46})["attribution_landmark"]["met"] is False
    assert claims_goals({**summary, "controller_gain_over_prior": 0.0})["controllers"]["met"] is False
    # no mode reaches it (a mode with no set inside the limits: drop null, goal_met False) → measured, not met
    no_set = {**summary, "suppression_residual_goal_met": False, "suppression_residual_best_drop": None}
    assert claims_goals(no_set)["suppression"]["met"] is False
    assert claims_goals({**no_set, "suppression_mean_goal_met": True})["suppression"]["met"] is True
    assert claims_goals({**summary, "explanation_margin_share": 0.85})["explanations"]["met"] is True
    assert claims_goals({})["suppression"]["met"] is None
    # the pooled McNemar p-values sit beside the controllers' values; they do not change the verdict
    noisy = claims_goals({**summary, "controller_minus_dense": 2.5, "controller_vs_sae_mcnemar_p": 0.6})
    assert noisy["controllers"]["met"] is True and noisy["controllers"]["values"]["controller_vs_sae_mcnemar_p"] == 0.6
    assert noisy["controllers"]["values"]["controller_vs_dense_mcnemar_p"] is None


def _record(methods: dict[str, float], learning_top1: float = 0.7) -> dict[str, object]:
    return {
        "num_train": 100,
        "block_size": 64,
        "relevant_per_fact": [[1, 2], [3]],
        "learning": {"after": {"top1": learning_top1}},
        "planted": {m: {"all": {"mrr": v}} for m, v in methods.items()},
        "costs": {"_curvature": {"seconds": 9.0}, **{m: {"per_query_s": v} for m, v in methods.items()}},
    }


def test_earlier_method_rows_adds_only_the_missing_methods_of_a_record_that_learned_the_same():
    earlier = _record({"cached": 0.5, "ekfac": 0.8})
    now = _record({"trak": 0.3})
    rows, costs = earlier_method_rows(earlier, now, ["trak", "bm25"])
    assert rows == {"cached": {"all": {"mrr": 0.5}}, "ekfac": {"all": {"mrr": 0.8}}}
    assert costs == {"cached": {"per_query_s": 0.5}, "ekfac": {"per_query_s": 0.8}, "_curvature": {"seconds": 9.0}}
    now["relevant_per_fact"] = [(np.int64(1), 2), [3]]  # computed now, not yet read back from JSON: still equal
    rows, costs = earlier_method_rows(earlier, now, ["cached", "_curvature"])  # this run has both: not replaced
    assert list(rows) == ["ekfac"] and list(costs) == ["ekfac"]


@pytest.mark.parametrize("field", ["learning", "relevant_per_fact", "num_train"])
def test_earlier_method_rows_refuses_a_record_of_another_fine_tune(field):
    earlier, now = _record({"cached": 0.5}), _record({})
    now[field] = {"learning": {"after": {"top1": 0.71}}, "relevant_per_fact": [[1], [3]], "num_train": 101}[field]
    with pytest.raises(ArtifactMismatch, match=f"old.json: its {field} differs"):
        earlier_method_rows(earlier, now, [], source="old.json")
