#!/usr/bin/env python
"""The paper's claims on the real model: SmolLM2-135M-Instruct retrofitted on an anchor corpus that holds the
concepts, then one measurement per stage, each a script ``bench/claims_<stage>.py`` that runs alone too:

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
import json
import subprocess
import sys
from pathlib import Path

import torch
from _common import BENCH_DIR, CLAIMS_STAGES, RESULTS_DIR, Json, claims_work, environment, write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI smoke size")
    ap.add_argument(
        "--stage", action="append", choices=CLAIMS_STAGES, help="run only these stages (repeatable; default all)"
    )
    ap.add_argument("--redo", action="append", default=[], choices=CLAIMS_STAGES, help="run a finished stage again")
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
    for name in args.stage or CLAIMS_STAGES:
        path = stage_path(out, name)
        if path.exists() and name not in args.redo:
            print(f"[real-claims] {name}: finished earlier ({path}); --redo {name} runs it again", file=sys.stderr)
            continue
        cmd = [sys.executable, str(BENCH_DIR / f"claims_{name}.py"), *options, "--out", str(path), "--environment", env]
        if subprocess.run(cmd).returncode != 0:
            sys.exit(f"[real-claims] the {name} stage failed (bench/claims_{name}.py); finished stages are kept")
    stages = {name: json.loads(p.read_text()) for name in CLAIMS_STAGES if (p := stage_path(out, name)).exists()}
    summary = merged_summary(stages)
    sources = {name: {"file": stage_path(out, name).name, **revision(stage)} for name, stage in stages.items()}
    write_json(out, {"summary": summary, "summary_sources": sources, "stages": stages})
    shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
    print(f"real-claims: {', '.join(stages) or 'no stage'} → {out}; {shown}")


def stage_path(out: Path, name: str) -> Path:
    """Each stage's own JSON beside ``out`` (``real-claims-suppression.json``): stages run at different times and
    revisions, so each records its own; ``out`` gathers them."""
    return out.with_name(f"{out.stem}-{name}.json")


def revision(stage: Json) -> Json:
    env = stage.get("environment")
    return {"git_revision": env.get("git_revision")} if isinstance(env, dict) else {}


def merged_summary(stages: dict[str, Json]) -> Json:
    """Each stage's ``summary`` fields, in stage order (the issue's field names)."""
    summary: Json = {}
    for name in CLAIMS_STAGES:
        part = stages.get(name, {}).get("summary")
        if isinstance(part, dict):
            summary.update(part)
    return summary


if __name__ == "__main__":
    main()
