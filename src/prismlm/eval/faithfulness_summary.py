"""The faithful-head issue's summary over measured models (``bench/real_faithfulness.py --stage summary``): which
measurement of which model each field reads, and the goals each is compared with. Pure arithmetic on the
measures' JSON, tested on fixed inputs (tests/test_faithfulness_summary.py)."""

from __future__ import annotations

from collections.abc import Mapping

Measures = Mapping[str, Mapping[str, float]]
"""One model's measures: ``{"heldout_text": {metric: value}, "chat_answers": {metric: value}}``."""


def faithfulness_summary(
    models: Mapping[str, Measures], speed_ratio: float, *, frozen: str, stage2: str, source: str, demo: str
) -> dict[str, float]:
    """The issue's summary fields from the measures of four models (keys of ``models``): the kept frozen head
    (``frozen``: held-out text for top-1, KL, centred residual, R̄1, R2 and dead; its chat answers for the margin
    shares), the stage-2 model (``stage2``), the frozen model of the stage-2 run (``source``: its logits are the
    source model's, so the stage-2 CE is compared with its CE on the same held-out tokens) and the demo's recipe
    (``demo``: its held-out chat answers). ``speed_ratio``: stage-2 tokens/s on stored activations over the
    per-step path's at the same N."""
    f, s, d = models[frozen], models[stage2], models[demo]
    ft, fc, st = f["heldout_text"], f["chat_answers"], s["heldout_text"]
    source_ce = models[source]["heldout_text"]["val_loss"]
    return {
        "frozen_top1_agreement": ft["top1_agreement"],
        "frozen_kl": ft["kl"],
        "frozen_margin_share": fc["margin_share"],
        "frozen_margin_share_pca": fc["pca_margin_share"],
        "frozen_centred_residual_share": ft["centred_residual_share"],
        "frozen_r1_bar": ft["r1_bar"],
        "frozen_r2": ft["r2"],
        "frozen_dead": ft["dead_prototypes"],
        "chat_top1_agreement": d["chat_answers"]["top1_agreement"],
        "stage2_top1_agreement": st["top1_agreement"],
        "stage2_kl": st["kl"],
        "stage2_ce_rel_change": st["val_loss"] / source_ce - 1.0,
        "stage2_centred_residual_share": st["centred_residual_share"],
        "stage2_tokens_per_s_ratio": speed_ratio,
    }


def faithfulness_goals(summary: Mapping[str, float]) -> dict[str, bool]:
    """The issue's goals, each said plainly (True: met)."""
    return {
        "frozen_top1_ge_0.60": summary["frozen_top1_agreement"] >= 0.60,
        "frozen_margin_share_ge_0.8": summary["frozen_margin_share"] >= 0.8,
        "frozen_margin_share_ge_pca_plus_0.3": summary["frozen_margin_share"]
        >= summary["frozen_margin_share_pca"] + 0.3,
        "frozen_kl_le_0.8": summary["frozen_kl"] <= 0.8,
        "frozen_r1_bar_and_r2_ge_0.94": min(summary["frozen_r1_bar"], summary["frozen_r2"]) >= 0.94,
        "frozen_dead_0": summary["frozen_dead"] == 0,
        "stage2_ce_within_1pct": summary["stage2_ce_rel_change"] <= 0.01,
        "stage2_top1_ge_0.85": summary["stage2_top1_agreement"] >= 0.85,
        "stage2_kl_le_0.3": summary["stage2_kl"] <= 0.3,
        "stage2_centred_residual_le_0.25": summary["stage2_centred_residual_share"] <= 0.25,
        "stage2_speed_ge_5x": summary["stage2_tokens_per_s_ratio"] >= 5.0,
    }


__all__ = ["Measures", "faithfulness_goals", "faithfulness_summary"]
