#!/usr/bin/env python
"""Validation-loss gap and prototype coverage of PRISM vs the matched dense baseline at equal budget.

What is measured
    Two runs of ``prismlm.train.trainer.train`` on the same prepared shards (default: the built-in
    corpus) from the same config, seed, steps and therefore the same training tokens in the same
    order: PRISM (the preset's prototype head and loss weights) and ``cfg.dense()`` (same backbone, plain
    linear head, CE only). Both final models are then evaluated with ``prismlm.eval.metrics.evaluate``
    on the same fixed, evenly spread sample of validation sequences (``--eval-batches`` × batch size
    sequences; usually larger than the trainer's own ``train.eval_batches``, whose numbers are also kept).

How to read it
    ``gap`` = val CE(PRISM) − val CE(dense) (``gap_pct`` relative to dense): the price in loss of routing
    the prediction through prototypes. Read it together with the coverage of the PRISM model, because
    the loss weights trade one against the other (shared/notes/objective-tradeoff.md):
    ``r1_bar`` (mean_i max_t cos(p_i, z_t): do prototypes sit on real data?), ``r2`` (mean_t max_i
    cos: is every token covered?), ``residual_share`` (mean ‖r‖/‖z‖: how much of each hidden state the
    prototypes leave unexplained; lower is more interpretable) and ``dead_prototypes`` (never in any
    top-k over the sample). A good setting has a small gap *and* a small residual *and* high coverage.
    Training wall time includes the trainer's periodic evaluations and final checkpoint; on a shared
    machine it is indicative only (the throughput benchmark measures speed properly).

Sweeps: run the script once per setting with ``--set`` overrides (applied to both runs) and a ``--tag``,
e.g. ``--set loss.lambda_rec=0.1 --set loss.lambda_r1=0.05 --set loss.lambda_r2=0.05 --tag rec0.1``, then
compare ``bench/results/quality-*.json``.

Output: runs in ``<workdir>/quality[-TAG]-{prism,dense}`` (default workdir ``bench/runs``; an existing run
folder of the same name is replaced), JSON at ``bench/results/quality[-TAG].json`` (or ``--out``), and one
summary line on stdout. Default budget (cpu-small, 600 steps): about 5–6 minutes per model on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, parse_sets, warn_if_busy, write_json

from prismlm.config import PRESETS, RunConfig
from prismlm.data.shards import prepare_from_config
from prismlm.eval.metrics import evaluate
from prismlm.train.trainer import autocast_for, train

COVERAGE_KEYS = ("r1_bar", "r2", "dead_prototypes", "dead_fraction", "residual_share")


def _median_train_tok_s(run_dir: Path) -> float | None:
    """Median of the trainer's logged tokens/s (metrics.jsonl), skipping the first record (warm-up)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rates = [r["tokens_per_s"] for r in map(json.loads, path.read_text().splitlines()) if "tokens_per_s" in r]
    rates = rates[1:] or rates
    if not rates:
        return None
    rates.sort()
    return rates[len(rates) // 2]


def run_one(kind: str, cfg: RunConfig, run_dir: Path, shards, eval_batches: int) -> dict[str, Any]:
    if run_dir.exists():
        if not (run_dir / "config.json").exists():
            raise SystemExit(f"{run_dir} exists and is not a previous run folder; choose another --workdir/--tag")
        shutil.rmtree(run_dir)  # a stale run folder: old checkpoints must not mix with the new run's
    print(f"[quality] training {kind} into {run_dir} ({cfg.train.max_steps} steps)", file=sys.stderr)
    t0 = time.perf_counter()
    res = train(cfg, run_dir, shards=shards, progress=False)
    wall = time.perf_counter() - t0
    model = res.model
    assert model is not None
    device = next(model.parameters()).device
    final_cfg = RunConfig.from_json(run_dir / "config.json")  # as trained (vocab_size set by the trainer)
    T, tc = final_cfg.model.block_size, final_cfg.train
    metrics = evaluate(model, shards.val, seq_len=T, batch_size=tc.batch_size, max_batches=eval_batches,
                       device=device, autocast=autocast_for(final_cfg, device),
                       loss_weights=final_cfg.loss.weights_at(tc.max_steps - 1))
    tokens = res.step * tc.batch_size * tc.grad_accum * T  # single process
    out = {
        "run_dir": str(run_dir),
        "checkpoint": str(res.checkpoint),
        "steps": res.step,
        "tokens_seen": tokens,
        "train_wall_s": wall,
        "train_tok_s_overall": tokens / wall,
        "train_tok_s_median_logged": _median_train_tok_s(run_dir),
        "parameters": model.num_parameters(),
        "val": metrics,
        "trainer_final_val": res.metrics,
        "config": final_cfg.to_dict(),
    }
    print(f"[quality] {kind}: val loss {metrics['val_loss']:.4f} after {res.step} steps, {wall:.0f}s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Train PRISM and the matched dense baseline with the same seed, steps and tokens, then "
                    "compare validation loss on the same fixed sample and report PRISM's coverage. Writes JSON "
                    "and prints one summary line.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS), help="starting config for both runs")
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the preset's)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override applied to both runs, e.g. --set loss.lambda_rec=0.1 "
                         "--set model.prototypes.top_k=4 (values parsed as JSON); repeatable")
    ap.add_argument("--eval-batches", type=int, default=32,
                    help="validation batches (of train.batch_size sequences) in the final evaluation of both models")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (train.num_threads)")
    ap.add_argument("--device", default=None, help="train.device: cpu, cuda, auto (default: the preset's, auto)")
    ap.add_argument("--tag", default=None, help="name of this setting: results go to quality-TAG.json, runs to quality-TAG-*")
    ap.add_argument("--workdir", default=str(RUNS_DIR), help="folder for the two run directories")
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/quality[-TAG].json)")
    args = ap.parse_args(argv)
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9._+=-]+", args.tag):
        ap.error("--tag may only contain letters, digits and . _ + = -")
    if args.eval_batches < 1 or args.threads < 1 or (args.steps is not None and args.steps < 1):
        ap.error("--eval-batches, --threads and --steps must be >= 1")

    overrides = parse_sets(args.sets)
    if args.steps is not None:
        overrides["train.max_steps"] = args.steps
    overrides["train.num_threads"] = args.threads
    if args.device is not None:
        overrides["train.device"] = args.device
    cfg = RunConfig.from_name(args.preset).override(overrides)
    if cfg.model.prototypes is None:
        ap.error("the PRISM config has no prototype head (model.prototypes is null); nothing to compare")
    # A warm-up longer than the run would leave the prototype losses at a fraction of their weight.
    if cfg.loss.warmup_steps > cfg.train.max_steps:
        print(f"[quality] note: loss.warmup_steps={cfg.loss.warmup_steps} > max_steps={cfg.train.max_steps}; the "
              f"prototype losses never reach full weight", file=sys.stderr)
    dense_cfg = cfg.dense()

    torch.set_num_threads(args.threads)
    if (cfg.train.device == "cpu") or (cfg.train.device == "auto" and not torch.cuda.is_available()):
        warn_if_busy(args.threads)
    env = environment(cfg.train.device if cfg.train.device != "auto" else
                      ("cuda" if torch.cuda.is_available() else "cpu"), cfg.train.seed)
    t0 = time.perf_counter()
    shards = prepare_from_config(cfg.data, show_progress=False)
    print(f"[quality] data {cfg.data.corpus}/{cfg.data.tokenizer} ready in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)

    suffix = f"-{args.tag}" if args.tag else ""
    workdir = Path(args.workdir)
    prism = run_one("PRISM", cfg, workdir / f"quality{suffix}-prism", shards, args.eval_batches)
    dense = run_one("dense", dense_cfg, workdir / f"quality{suffix}-dense", shards, args.eval_batches)

    vp, vd = prism["val"], dense["val"]
    if vp["val_tokens"] != vd["val_tokens"]:
        raise RuntimeError("PRISM and dense were evaluated on different numbers of validation tokens")
    gap = vp["val_loss"] - vd["val_loss"]
    K = cfg.model.prototypes.num_prototypes
    summary = {
        "val_loss_prism": vp["val_loss"],
        "val_loss_dense": vd["val_loss"],
        "gap": gap,
        "gap_pct": 100.0 * gap / vd["val_loss"],
        "val_ppl_prism": vp["val_ppl"],
        "val_ppl_dense": vd["val_ppl"],
        **{k: vp[k] for k in COVERAGE_KEYS},
        "num_prototypes": K,
        "val_tokens": vp["val_tokens"],
        "tokens_seen": prism["tokens_seen"],
        "train_wall_s_prism": prism["train_wall_s"],
        "train_wall_s_dense": dense["train_wall_s"],
    }
    payload = {
        "benchmark": "quality",
        "what": "validation CE of PRISM vs the matched dense baseline at equal seed/steps/tokens, plus PRISM coverage",
        "tag": args.tag,
        "preset": args.preset,
        "overrides": overrides,
        "loss_weights": cfg.loss.weights_at(cfg.train.max_steps - 1),
        "loss_warmup_steps": cfg.loss.warmup_steps,
        "eval": {"batches": args.eval_batches, "batch_size": cfg.train.batch_size,
                 "seq_len": cfg.model.block_size, "sample": "prismlm.eval.metrics.eval_sequence_ids (fixed, evenly spread)"},
        "data_manifest_key": shards.manifest.get("key") if isinstance(shards.manifest, dict) else None,
        "args": vars(args),
        "environment": env,
        "summary": summary,
        "prism": prism,
        "dense": dense,
    }
    out = Path(args.out) if args.out else RESULTS_DIR / f"quality{suffix}.json"
    write_json(out, payload)
    print(f"[quality] wrote {out}", file=sys.stderr)
    s = summary
    print(f"quality: val loss PRISM {s['val_loss_prism']:.2f} vs dense {s['val_loss_dense']:.2f} "
          f"({s['gap_pct']:+.1f}%) | R̄1 {s['r1_bar']:.2f} R2 {s['r2']:.2f} residual {s['residual_share']:.2f} "
          f"dead {s['dead_prototypes']}/{K} | {s['tokens_seen'] / 1e6:.2f}M tokens, train "
          f"{s['train_wall_s_prism']:.0f}s vs {s['train_wall_s_dense']:.0f}s" + (f" | tag {args.tag}" if args.tag else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
