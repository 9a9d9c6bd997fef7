#!/usr/bin/env python
"""Does a bigger prototype bank make a concept more separable? (issue 14; spec §4's 0.52%-of-the-bank cut)

For each bank size K (``--sizes``, default 512, 2,048, 8,192) ``bench/suppression.py --concept sotu`` trains
a PRISM model with the same backbone (cpu-small: d=128, 4 layers, T=128), corpus, token order, seeds and
steps — only K differs — then finds the State-of-the-Union prototypes and sweeps suppression sets of
0.5/1/2/5% of K (capped at the prototypes that pass the concept filter), each against a random set of the
same size, judged by the same held-out TF-IDF SOTU judge on the same prompts and seeds. This script runs
the three (each in its own run folder ``bench/runs/bank-K``) or, with ``--inputs``, reads their JSON, and
writes one table against the share of the bank removed:

    judge_drop     relative drop of the SOTU judge's mean score on provocative prompts (openings of
                   held-out SOTU paragraphs): 1 − after / before (the paper's 0.668 → 0.154 is 0.77)
    collateral     relative perplexity increase on held-out non-SOTU text (novel paragraphs + clean
                   fortunes): the cost to everything else (``collateral_over_random``: minus that of the
                   random set of the same size — switching off any prototypes costs something)
    concept_ppl    relative perplexity increase on held-out SOTU text

Goal (issue 14): judge drop ≥ 0.8 at collateral ≤ 1%. ``summary.best_at_1pct`` gives, per K, the largest
drop among the sets whose collateral is ≤ 1% and the share of K it took.

Output: JSON at ``--out`` (default ``bench/results/bank_size.json``) and one summary line. Each K takes
~25–40 min on one idle core (training 2,400 steps dominates; K=8,192 is the slowest).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, write_json

HERE = Path(__file__).parent
GOAL_DROP, GOAL_COLLATERAL = 0.8, 0.01


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per suppression set of one ``suppression.py --concept sotu`` result."""
    judge = next(iter(result["table"]))  # the headline judge (tfidf)
    table, quality = result["table"][judge], result["quality"]
    before_score = table["before"]["provocative"]
    before_ppl = quality["before"]
    rows = []
    for cond, ids in result["conditions"].items():
        if cond == "before":
            continue
        kind, n = cond.split("@")
        q = quality[cond]
        rows.append(
            {
                "set": kind,
                "n": int(n),
                "share_of_K": int(n) / result["num_prototypes"],
                "judge_provocative": table[cond]["provocative"],
                "judge_provocative_before": before_score,
                "judge_drop": 1.0 - table[cond]["provocative"] / before_score,
                "judge_all_drop": 1.0 - table[cond]["all"] / table["before"]["all"],
                "collateral": q["neutral_rel_ppl_increase"],
                "concept_ppl": q["concept_rel_ppl_increase"],
                "builtin_ppl": q["ppl_builtin_heldout"] / before_ppl["ppl_builtin_heldout"] - 1.0,
                "distinct_2": q["distinct_2"],
            }
        )
        assert len(ids) == int(n)
    random_collateral = {r["n"]: r["collateral"] for r in rows if r["set"] == "random"}
    for r in rows:  # removing any prototypes costs something: what the concept set costs beyond chance
        r["collateral_over_random"] = r["collateral"] - random_collateral.get(r["n"], 0.0)
    return sorted(rows, key=lambda r: (r["set"], r["n"]))


def summarise(results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for K, res in sorted(results.items()):
        ok = [r for r in rows_of(res) if r["set"] == "concept" and r["collateral"] <= GOAL_COLLATERAL]
        top = max(ok, key=lambda r: r["judge_drop"], default=None)
        best[str(K)] = (
            None
            if top is None
            else {k: top[k] for k in ("n", "share_of_K", "judge_drop", "collateral", "collateral_over_random")}
        )
    met = {K: b is not None and b["judge_drop"] >= GOAL_DROP for K, b in best.items()}
    return {"best_at_1pct": best, "goal": {"judge_drop": GOAL_DROP, "collateral": GOAL_COLLATERAL}, "goal_met": met}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument(
        "--inputs",
        type=Path,
        nargs="*",
        default=None,
        help="suppression.py --concept sotu JSON files to aggregate instead of running them",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="passed on: reuse each K's trained run")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "bank_size.json")
    args = ap.parse_args()
    inputs = args.inputs
    if not inputs:
        inputs = []
        for K in args.sizes:
            out = RESULTS_DIR / f"suppression-sotu-K{K}.json"
            cmd = [
                sys.executable,
                str(HERE / "suppression.py"),
                "--concept",
                "sotu",
                "--threads",
                str(args.threads),
                "--set",
                f"model.prototypes.num_prototypes={K}",
                "--name",
                f"bank-{K}",
                "--out",
                str(out),
            ]
            subprocess.run(cmd + (["--reuse"] if args.reuse else []), check=True)
            inputs.append(out)
    loaded = sorted(((json.loads(p.read_text()), p) for p in inputs), key=lambda rp: rp[0]["num_prototypes"])
    results = {int(res["num_prototypes"]): res for res, _ in loaded}
    revisions = {res["environment"].get("git_revision") for res in results.values()}
    table = {
        str(res["num_prototypes"]): {
            "source": str(path),
            "selectable": res["selectable"],
            "candidates": res["candidates"],
            "train_val_ppl": res.get("train_metrics", {}).get("val_ppl"),
            "dead_fraction": res.get("train_metrics", {}).get("dead_fraction"),
            "rows": rows_of(res),
        }
        for res, path in loaded
    }
    summary = summarise(results)
    write_json(
        args.out,
        {
            "benchmark": "bank_size",
            "revisions": sorted(r or "?" for r in revisions),
            "sizes": table,
            "summary": summary,
        },
    )
    parts = [
        f"K={K}: "
        + ("no set ≤1% collateral" if b is None else f"drop {b['judge_drop']:.2f} at {b['share_of_K'] * 100:.1f}% of K")
        for K, b in summary["best_at_1pct"].items()
    ]
    print("[bank_size] best judge drop at ≤1% collateral — " + "; ".join(parts))


if __name__ == "__main__":
    main()
