#!/usr/bin/env python
"""Does a bigger prototype bank make a concept more separable? (issue 14; spec §4's 0.52%-of-the-bank cut)

For each bank size K (``--sizes``, default 512, 2,048, 8,192) ``bench/suppression.py --concept sotu`` trains a
PRISM model differing only in K (cpu-small backbone, same corpus, token order, seeds and steps), finds the
State-of-the-Union prototypes and sweeps suppression sets of 0.5/1/2/5% of K, each against a random set of the
same size. This script runs the three (run folders ``bench/runs/bank-K``) or, with ``--inputs``, reads their
JSON, and tabulates against the share of the bank removed: ``judge_drop`` (1 − after / before of the SOTU
judge on provocative prompts), ``collateral`` (relative perplexity increase on held-out non-SOTU text;
``collateral_over_random``: minus the random set's), ``concept_ppl``. Goal (issue 14): judge drop ≥ 0.8 at
collateral ≤ 1%; ``summary.best_at_1pct`` gives per K the largest such drop and the share of K it took.

Run: ``PYTHONPATH=src python bench/bank_size.py [--inputs A.json B.json …]`` (each K ~25–40 min on one idle
core). Writes ``bench/results/bank_size.json`` and one summary line; the measurements: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _common import RESULTS_DIR, Json, num, obj, write_json

HERE = Path(__file__).parent
GOAL_DROP, GOAL_COLLATERAL = 0.8, 0.01


def rows_of(result: Json) -> list[Json]:
    """One row per suppression set of one ``suppression.py --concept sotu`` result."""
    judge = next(iter(obj(result, "table")))  # the headline judge (tfidf)
    table, quality = obj(result, "table", judge), obj(result, "quality")
    before_score = num(table, "before", "provocative")
    before_ppl = obj(quality, "before")
    rows: list[Json] = []
    for cond, ids in obj(result, "conditions").items():
        if cond == "before":
            continue
        kind, n = cond.split("@")
        q = obj(quality, cond)
        rows.append(
            {
                "set": kind,
                "n": int(n),
                "share_of_K": int(n) / num(result, "num_prototypes"),
                "judge_provocative": obj(table, cond)["provocative"],
                "judge_provocative_before": before_score,
                "judge_drop": 1.0 - num(table, cond, "provocative") / before_score,
                "judge_all_drop": 1.0 - num(table, cond, "all") / num(table, "before", "all"),
                "collateral": q["neutral_rel_ppl_increase"],
                "concept_ppl": q["concept_rel_ppl_increase"],
                "builtin_ppl": num(q, "ppl_builtin_heldout") / num(before_ppl, "ppl_builtin_heldout") - 1.0,
                "distinct_2": q["distinct_2"],
            }
        )
        assert isinstance(ids, list) and len(ids) == int(n)
    random_collateral = {r["n"]: num(r, "collateral") for r in rows if r["set"] == "random"}
    for r in rows:  # removing any prototypes costs something: what the concept set costs beyond chance
        r["collateral_over_random"] = num(r, "collateral") - random_collateral.get(r["n"], 0.0)
    return sorted(rows, key=lambda r: (str(r["set"]), num(r, "n")))


def summarise(results: dict[int, Json]) -> Json:
    best: dict[str, Json | None] = {}
    for K, res in sorted(results.items()):
        ok = [r for r in rows_of(res) if r["set"] == "concept" and num(r, "collateral") <= GOAL_COLLATERAL]
        top = max(ok, key=lambda r: num(r, "judge_drop"), default=None)
        best[str(K)] = (
            None
            if top is None
            else {k: top[k] for k in ("n", "share_of_K", "judge_drop", "collateral", "collateral_over_random")}
        )
    met = {K: b is not None and num(b, "judge_drop") >= GOAL_DROP for K, b in best.items()}
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
    results = {int(num(res, "num_prototypes")): res for res, _ in loaded}
    revisions = {obj(res, "environment").get("git_revision") for res in results.values()}
    table = {
        str(res["num_prototypes"]): {
            "source": str(path),
            "selectable": res["selectable"],
            "candidates": res["candidates"],
            "train_val_ppl": obj(res.get("train_metrics", {})).get("val_ppl"),
            "dead_fraction": obj(res.get("train_metrics", {})).get("dead_fraction"),
            "rows": rows_of(res),
        }
        for res, path in loaded
    }
    summary = summarise(results)
    write_json(
        args.out,
        {
            "benchmark": "bank_size",
            "revisions": sorted(str(r or "?") for r in revisions),
            "sizes": table,
            "summary": summary,
        },
    )
    parts = [
        f"K={K}: "
        + (
            "no set ≤1% collateral"
            if not isinstance(b, dict)
            else f"drop {num(b, 'judge_drop'):.2f} at {num(b, 'share_of_K') * 100:.1f}% of K"
        )
        for K, b in obj(summary, "best_at_1pct").items()
    ]
    print("[bank_size] best judge drop at ≤1% collateral — " + "; ".join(parts))


if __name__ == "__main__":
    main()
