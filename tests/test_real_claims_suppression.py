"""``bench/real_claims.py --quick --stage bank --stage suppression`` end to end (issue 27 item 1): the
retrofitted SmolLM2 bank, the concepts' prototypes, every condition judged with its random control, the
head-cache collateral path equal to ``model.suppress``/``mc_accuracy``, and the ``prism export --suppress``
folder giving the suppressed model's greedy tokens under plain transformers. Slow: minutes of CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_suppression_stage(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    out = tmp_path / "claims.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "bench" / "real_claims.py"), "--quick", "--threads", "1"]
    cmd += ["--stage", "bank", "--stage", "suppression", "--work", str(tmp_path / "work"), "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    stage = json.loads((tmp_path / "claims-suppression.json").read_text())
    summary = json.loads(out.read_text())["summary"]
    for field in ("suppression_best_drop", "suppression_collateral", "suppression_bank_share"):
        assert field in summary
    assert summary["suppression_export_identical"] is True
    assert all(
        c["identical"] and c["max_abs_logit_diff_transformers_vs_suppressed"] < 1e-4
        for c in stage["export_check"]["cases"]
    )
    check = stage["fast_path_check"]
    assert check["abs_diff"] < 1e-6 and check["acc_fast"] == check["acc_mc_accuracy"]
    assert check["acc_norm_fast"] == check["acc_norm_mc_accuracy"]
    rows = stage["rows"]
    K = stage["num_prototypes"]
    for row in rows:
        cond = row["condition"]
        assert row["prototypes"] == len(stage["conditions"][cond]) and row["bank_share"] == row["prototypes"] / K
        if cond == "before":
            assert row["tfidf_drop"] == 0.0 and row["ce_neutral_rel_increase"] == 0.0
        elif not cond.startswith("random@"):  # every concept set has its random control of the same size
            assert f"random@{row['prototypes']}" in stage["conditions"]
    concept_sets = {c: s["ranked"] for c, s in stage["concepts"].items()}
    for cond, ids in stage["conditions"].items():
        if cond.startswith("random@"):
            assert not set(ids) & {i for r in concept_sets.values() for i in r}
        elif cond != "before":
            concept, n = cond.split("@")
            assert sorted(concept_sets[concept][: int(n)]) == ids
