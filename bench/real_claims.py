#!/usr/bin/env python
"""The paper's claims on SmolLM2-135M-Instruct retrofitted on an anchor corpus that holds the concepts: one
script ``bench/claims_<script>.py`` per stage (bank, suppression, controllers, attribution, attribution-nonlexical
= ``claims_attribution.py --planted nonlexical``, explanations), each run once per head (``--head``, repeatable;
default faithful then paper: the bank with and without the prototype-only KL, same anchor set), so each claim has
a before/after row.

Run: ``python bench/real_claims.py [--quick] [--head H] [--stage S] [--redo S]``. Each stage writes
``bench/results/real-claims[-<head>]-<stage>.json`` (the paper head's keep the first run's names; a rerun skips
finished stages); ``real-claims.json`` gathers them (``prismlm.eval.claims.gathered_summary``): ``summary`` is the
first head's, ``summary_by_head`` every head's. ``--quick``: the CI smoke size (tests/test_real_claims.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from _common import (
    BENCH_DIR,
    CLAIMS_HEADS,
    CLAIMS_STAGES,
    RESULTS_DIR,
    Json,
    claims_work,
    environment,
    head_tag,
    write_json,
)

from prismlm.eval.claims import claims_goals, gathered_summary

RUNS: dict[str, tuple[str, list[str]]] = {
    **{name: (name, []) for name in CLAIMS_STAGES if name != "explanations"},
    "attribution-nonlexical": ("attribution", ["--planted", "nonlexical"]),
    "attribution-landmark": ("attribution", ["--planted", "landmark"]),
    "explanations": ("explanations", []),
}
"""What ``real_claims.py`` runs, in dependency order: name → (the stage script ``claims_<script>.py``, its
options)."""
HEADS = ("faithful", "paper")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI smoke size")
    ap.add_argument("--stage", action="append", choices=RUNS, help="run only these stages (repeatable; default all)")
    ap.add_argument("--redo", action="append", default=[], choices=RUNS, help="run a finished stage again")
    ap.add_argument("--head", action="append", choices=CLAIMS_HEADS, help="heads, in order (default faithful, paper)")
    ap.add_argument(
        "--train-sequences", type=int, default=None, help="attribution-nonlexical's and -landmark's corpus size"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default bench/runs/real-claims[-quick])")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # the environment record notes the threads
    out = args.out or RESULTS_DIR / f"real-claims{'-quick' if args.quick else ''}.json"
    options = [
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--work",
        str(claims_work(args.quick, args.work)),
    ]
    options += ["--quick"] if args.quick else []
    # the revision is read once, before any stage writes its JSON into bench/results (a tracked folder): read
    # per stage, the first stage's output would mark every later stage of the same run "-dirty"
    env = json.dumps(environment(args.device, 0), default=str)
    heads = args.head or list(HEADS)
    for head in heads:
        for name in args.stage or RUNS:
            path = stage_path(out, name, head)
            if path.exists() and name not in args.redo:
                print(f"[real-claims] {name} ({head}): finished earlier ({path}); --redo {name} runs it again",
                      file=sys.stderr)  # fmt: skip
                continue
            script, extra = RUNS[name]
            if name in ("attribution-nonlexical", "attribution-landmark") and args.train_sequences is not None:
                extra = [*extra, "--train-sequences", str(args.train_sequences)]
            cmd = [sys.executable, str(BENCH_DIR / f"claims_{script}.py"), *options, *extra, "--head", head]
            if subprocess.run([*cmd, "--out", str(path), "--environment", env]).returncode != 0:
                sys.exit(f"[real-claims] the {name} stage ({head}) failed (bench/claims_{script}.py); finished "
                         "stages are kept")  # fmt: skip
    gathered = {head: gather(out, head) for head in heads}
    first = gathered[heads[0]]
    by_head = {head: g["summary"] for head, g in gathered.items()}
    sources = {head: g["summary_sources"] for head, g in gathered.items()}
    goals = {head: claims_goals(summary) for head, summary in by_head.items() if isinstance(summary, dict)}
    write_json(out, {**first, "summary_by_head": by_head, "summary_sources_by_head": sources, "goals_by_head": goals})
    summary = first["summary"]
    assert isinstance(summary, dict)
    shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
    met = ", ".join(f"{g} {'met' if r['met'] else 'unmeasured' if r['met'] is None else 'not met'}"
                    for g, r in goals[heads[0]].items())  # fmt: skip
    print(f"real-claims ({heads[0]}): → {out}; goals: {met}; {shown}")


def gather(out: Path, head: str) -> Json:
    """One head's stage records, their gathered summary and each stage's source file and revision."""
    stages: dict[str, Json] = {
        name: json.loads(p.read_text()) for name in RUNS if (p := stage_path(out, name, head)).exists()
    }
    summary = gathered_summary(stages, list(RUNS))
    sources = {name: {"file": stage_path(out, name, head).name, **revision(stage)} for name, stage in stages.items()}
    return {"summary": summary, "summary_sources": sources, "stages": stages}


def stage_path(out: Path, name: str, head: str = "paper") -> Path:
    """Each stage's own JSON beside ``out`` (``real-claims[-<head>]-suppression.json``): stages run at different
    times and revisions, so each records its own; ``out`` gathers them. The paper head's files have no tag (the
    first run's names)."""
    return out.with_name(f"{out.stem}{head_tag(head)}-{name}.json")


def revision(stage: Json) -> Json:
    env = stage.get("environment")
    return {"git_revision": env.get("git_revision")} if isinstance(env, dict) else {}


if __name__ == "__main__":
    main()
