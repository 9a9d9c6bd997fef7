"""The faithful head's summary arithmetic (``prismlm.eval.faithfulness_summary``, read by
``bench/real_faithfulness.py``) on fixed inputs: each field reads the model and the
measurement the issue names (chat answers for the margin shares, held-out text for the rest, CE against the
frozen model's), and the goals compare with the issue's thresholds."""

from __future__ import annotations

import pytest

from prismlm.eval.faithfulness_summary import faithfulness_goals, faithfulness_summary


def _measures(top1: float, kl: float, margin: float, val: float, chat_top1: float) -> dict[str, dict[str, float]]:
    text = {"top1_agreement": top1, "kl": kl, "margin_share": margin + 0.1, "centred_residual_share": 0.5,
            "r1_bar": 0.9, "r2": 0.95, "dead_prototypes": 3, "val_loss": val, "pca_margin_share": 0.0}  # fmt: skip
    chat = {"top1_agreement": chat_top1, "margin_share": margin, "pca_margin_share": margin - 0.35}
    return {"heldout_text": text, "chat_answers": chat}


def test_summary_fields_read_the_named_models_and_measurements():
    models = {
        "frozen": _measures(0.4, 1.2, 0.7, 3.5, 0.3),
        "stage2": _measures(0.7, 0.5, 0.9, 3.06, 0.6),
        "source": _measures(0.2, 2.0, 0.2, 3.0, 0.1),
        "demo": _measures(0.1, 9.0, 0.1, 9.0, 0.45),
    }
    s = faithfulness_summary(models, 1.5, frozen="frozen", stage2="stage2", source="source", demo="demo")
    assert s["frozen_top1_agreement"] == 0.4 and s["frozen_kl"] == 1.2
    assert s["frozen_margin_share"] == 0.7 and s["frozen_margin_share_pca"] == pytest.approx(0.35)  # chat answers
    assert s["chat_top1_agreement"] == 0.45  # the demo recipe's held-out chat answers
    assert s["stage2_top1_agreement"] == 0.7 and s["stage2_kl"] == 0.5
    assert s["stage2_ce_rel_change"] == pytest.approx(0.02)  # 3.06 / 3.0 − 1: the stage-2 run's source CE
    models["source"]["heldout_text"]["val_loss"] = 3.06
    again = faithfulness_summary(models, 1.5, frozen="frozen", stage2="stage2", source="source", demo="demo")
    assert again["stage2_ce_rel_change"] == pytest.approx(0.0)
    assert s["stage2_tokens_per_s_ratio"] == 1.5 and s["frozen_dead"] == 3
    goals = faithfulness_goals(s)
    assert goals["frozen_margin_share_ge_pca_plus_0.3"] and not goals["frozen_margin_share_ge_0.8"]
    assert not goals["stage2_ce_within_1pct"] and not goals["frozen_dead_0"] and not goals["stage2_speed_ge_5x"]
    assert not goals["frozen_r1_bar_and_r2_ge_0.94"]  # R̄1 0.9
