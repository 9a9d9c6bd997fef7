#!/usr/bin/env python
"""The paper's claims on the real model: SmolLM2-135M-Instruct retrofitted on an anchor corpus that holds the
concepts, then one measurement per stage, each composed of ``prismlm`` functions:

    bank          the retrofit (stage 1 on stored z) and its prototype index
    suppression   a concept's prototypes off vs random sets: judged drop, collateral, export check
    controllers   sparse controllers vs a TopK SAE and the choice prior on tasks the model can do
    attribution   planted facts in a fine-tune: cache vs EK-FAC, TRAK, bergson, BM25; cost per query
    explanations  explained chat answers and the logit/margin share carried by prototype slices

Run: ``python bench/real_claims.py [--quick] [--stage S] [--redo S]``. Each stage writes
``bench/results/real-claims-<stage>.json`` when it finishes (a rerun skips finished stages); ``real-claims.json``
gathers their ``summary`` fields. ``--quick`` is the CI smoke size (tests/test_real_claims.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _claims_common import ClaimsContext, bank_stage
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, write_json

StageFn = Callable[[ClaimsContext], dict[str, object]]

# stage name → module (a sibling of this file) and the function in it; the order is the dependency order
STAGES: dict[str, tuple[str, str]] = {
    "bank": ("_claims_common", "bank_stage"),
    "suppression": ("_claims_suppression", "suppression_stage"),
    "controllers": ("_claims_control", "controller_stage"),
    "attribution": ("_claims_attribution", "attribution_stage"),
    "explanations": ("_claims_explain", "explanation_stage"),
}


def stage_function(name: str) -> StageFn | None:
    """The stage's function, or None where its module is not written yet."""
    if name == "bank":
        return bank_stage
    module, fn = STAGES[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI smoke size")
    ap.add_argument(
        "--stage", action="append", choices=sorted(STAGES), help="run only these stages (repeatable; default all)"
    )
    ap.add_argument("--redo", action="append", default=[], choices=sorted(STAGES), help="run a finished stage again")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default bench/runs/real-claims[-quick])")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tag = "-quick" if args.quick else ""
    out = args.out or RESULTS_DIR / f"real-claims{tag}.json"
    ctx = ClaimsContext(
        quick=args.quick, threads=args.threads, work=args.work or RUNS_DIR / f"real-claims{tag}", device=args.device
    )
    # the revision is read once, before any stage writes its JSON into bench/results (a tracked folder): read
    # per stage, the first stage's output would mark every later stage of the same run "-dirty"
    env = environment(args.device, 0)
    for name in args.stage or list(STAGES):
        run_stage(ctx, name, stage_path(out, name), redo=name in args.redo, env=env)
    stages = {name: json.loads(p.read_text()) for name in STAGES if (p := stage_path(out, name)).exists()}
    summary = merged_summary(stages)
    sources = {name: {"file": stage_path(out, name).name, **revision(stage)} for name, stage in stages.items()}
    write_json(out, {"summary": summary, "summary_sources": sources, "stages": stages})
    shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
    print(f"real-claims: {', '.join(stages) or 'no stage'} → {out}; {shown}")


def stage_path(out: Path, name: str) -> Path:
    """Each stage's own JSON beside ``out`` (``real-claims-suppression.json``): stages run at different times and
    revisions, so each records its own; ``out`` gathers them."""
    return out.with_name(f"{out.stem}-{name}.json")


def run_stage(ctx: ClaimsContext, name: str, path: Path, *, redo: bool, env: dict[str, object]) -> None:
    """Run one stage into ``path`` unless it finished there earlier (``redo``: again); ``env``: the run's
    environment record (``_common.environment`` at the start of the run), given the stage's start load."""
    if path.exists() and not redo:
        ctx.log(f"{name}: finished earlier ({path}); --redo {name} runs it again")
        return
    fn = stage_function(name)
    if fn is None:
        ctx.log(f"{name}: not written yet, skipped")
        return
    ctx.log(f"{name}: starting")
    env = {**env, "load_average_start": load_average()}
    t0 = time.perf_counter()
    result = fn(ctx)
    write_json(path, {"stage": name, **result, "seconds": round(time.perf_counter() - t0, 1), "environment": env})
    ctx.log(f"{name}: done in {time.perf_counter() - t0:.0f} s → {path}")


def revision(stage: dict[str, object]) -> dict[str, object]:
    env = stage.get("environment")
    return {"git_revision": env.get("git_revision")} if isinstance(env, dict) else {}


def merged_summary(stages: dict[str, dict[str, object]]) -> dict[str, object]:
    """Each stage's ``summary`` fields, in stage order (the issue's field names)."""
    summary: dict[str, object] = {}
    for name in STAGES:
        part = stages.get(name, {}).get("summary")
        if isinstance(part, dict):
            summary.update(part)
    return summary


if __name__ == "__main__":
    main()
