#!/usr/bin/env python
"""Validation-loss gap and prototype coverage of PRISM vs the matched dense baseline at equal budget.

Two ``train`` runs on the same shards from the same config, seed, steps and tokens — PRISM and ``cfg.dense()``
— then ``prismlm.eval.metrics.evaluate`` of both on the same fixed sample of validation sequences
(``--eval-batches``). ``gap`` = val CE(PRISM) − val CE(dense), read with PRISM's coverage (R̄1, R2, residual
share, dead prototypes). ``--minutes M``: each model trains for about M minutes of steps instead (step times
from ``--step-time-from`` a throughput JSON of the same shapes, or calibrated here with
``prismlm.train.step_timing``); ``--same-steps`` gives both the smaller count.

Run: ``PYTHONPATH=src python bench/quality.py [--preset cpu-small] [--set KEY=VALUE …] [--tag TAG]`` (sweeps:
one run per setting, each with a ``--tag``). Runs go to ``<workdir>/quality[-TAG]-{prism,dense}``, the JSON to
``bench/results/quality[-TAG].json``, one summary line to stdout. How to read it and the measurements:
docs/results.md ("bench/quality.py").
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from _common import (
    RESULTS_DIR,
    RUNS_DIR,
    Json,
    add_set_option,
    environment,
    num,
    obj,
    parse_sets,
    warn_if_busy,
    write_json,
)

from prismlm.config import PRESETS, RunConfig
from prismlm.data.shards import ShardSet, prepare_from_config
from prismlm.eval.metrics import evaluate
from prismlm.train.distributed import resolve_device
from prismlm.train.state import autocast_for
from prismlm.train.step_timing import BatchSource, Runner
from prismlm.train.trainer import train

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


def _same_shapes(a: Mapping[str, object], b: Mapping[str, object]) -> bool:
    """Do two config dicts describe the same training step (model shape, batch, compile, dtype)?"""
    model_keys = ("n_layer", "n_head", "n_embd", "block_size", "prototypes", "backbone")
    train_keys = ("batch_size", "grad_accum", "compile", "dtype")
    return all(obj(a, "model").get(k) == obj(b, "model").get(k) for k in model_keys) and all(
        obj(a, "train").get(k) == obj(b, "train").get(k) for k in train_keys
    )


def step_seconds(cfg: RunConfig, source: str | None, calibration_steps: int) -> tuple[dict[str, float], str]:
    """Seconds per training step of PRISM (``cfg``) and dense (``cfg.dense()``): from a throughput JSON
    whose size has the same shapes, else measured here with the throughput benchmark's bare step."""
    want = cfg.to_dict()
    if source is not None and Path(source).exists():
        for size in json.loads(Path(source).read_text()).get("sizes", []):
            if "step_s_median" in size and _same_shapes(size["config"], want):
                return dict(size["step_s_median"]), f"{source} (size {size['size']}, median bare step)"
        print(f"[quality] {source} has no size with these shapes; calibrating here", file=sys.stderr)
    device = resolve_device(cfg.train.device)
    steps = max(1, calibration_steps)
    data = BatchSource(cfg, min(steps, 32) * cfg.train.grad_accum, device, synthetic=False, seed=cfg.train.seed)
    vcfg = cfg.override({"model.vocab_size": data.vocab})
    tok_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size
    out: dict[str, float] = {}
    for kind, c in (("prism", vcfg), ("dense", vcfg.dense())):
        t0 = time.perf_counter()
        runner = Runner(kind, c, device, cfg.train.seed)
        runner.block(data, 3, timed=False)
        out[kind] = tok_per_step / runner.block(data, steps, timed=True)
        print(
            f"[quality] calibration {kind}: {out[kind] * 1e3:.1f} ms/step ({time.perf_counter() - t0:.1f}s with "
            "warm-up)",
            file=sys.stderr,
        )
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out, f"calibrated here ({steps} bare steps after 3 warm-up steps)"


def run_one(kind: str, cfg: RunConfig, run_dir: Path, shards: ShardSet, eval_batches: int) -> Json:
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
    metrics = evaluate(
        model,
        shards.val,
        seq_len=T,
        batch_size=tc.batch_size,
        max_batches=eval_batches,
        device=device,
        autocast=autocast_for(final_cfg, device),
        loss_weights=final_cfg.loss.weights_at(tc.max_steps - 1),
    )
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Train PRISM and the matched dense baseline with the same seed, steps and tokens, then "
        "compare validation loss on the same fixed sample and report PRISM's coverage. Writes JSON "
        "and prints one summary line.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS), help="starting config for both runs")
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the preset's)")
    add_set_option(
        ap,
        "config override applied to both runs, e.g. --set loss.lambda_rec=0.1 "
        "--set model.prototypes.top_k=4 (values parsed as JSON); repeatable",
    )
    ap.add_argument(
        "--eval-batches",
        type=int,
        default=32,
        help="validation batches (of train.batch_size sequences) in the final evaluation of both models",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (train.num_threads)")
    ap.add_argument("--device", default=None, help="train.device: cpu, cuda, auto (default: the preset's, auto)")
    ap.add_argument(
        "--tag", default=None, help="name of this setting: results go to quality-TAG.json, runs to quality-TAG-*"
    )
    ap.add_argument("--workdir", default=str(RUNS_DIR), help="folder for the two run directories")
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/quality[-TAG].json)")
    ap.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="train each model for about this many minutes of steps instead of --steps (see the docstring)",
    )
    ap.add_argument(
        "--step-time-from",
        default=None,
        metavar="JSON",
        help="with --minutes: a bench/throughput.py JSON to take the step times from (same shapes)",
    )
    ap.add_argument(
        "--calibration-steps",
        type=int,
        default=10,
        help="with --minutes and no usable --step-time-from: timed steps per model of the calibration",
    )
    ap.add_argument(
        "--same-steps",
        action="store_true",
        help="with --minutes: both models get the smaller step count (equal tokens) instead of equal time",
    )
    ap.add_argument(
        "--max-steps-cap", type=int, default=None, help="with --minutes: never more than this many steps per model"
    )
    ap.add_argument("--compile", action="store_true", help="train.compile = true (torch.compile the forward)")
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help="train.dtype (default: the preset's; auto = bf16 autocast on CUDA only)",
    )
    args = ap.parse_args(argv)
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9._+=-]+", args.tag):
        ap.error("--tag may only contain letters, digits and . _ + = -")
    if args.eval_batches < 1 or args.threads < 1 or (args.steps is not None and args.steps < 1):
        ap.error("--eval-batches, --threads and --steps must be >= 1")
    if args.minutes is not None and (args.steps is not None or args.minutes <= 0):
        ap.error("--minutes must be > 0 and excludes --steps")

    return args


def config(args: argparse.Namespace) -> tuple[RunConfig, dict[str, object]]:
    """The PRISM config (the preset with ``--set`` and the options applied) and the overrides."""
    overrides = parse_sets(args.sets)
    if args.steps is not None:
        overrides["train.max_steps"] = args.steps
    overrides["train.num_threads"] = args.threads
    if args.device is not None:
        overrides["train.device"] = args.device
    if args.compile:
        overrides["train.compile"] = True
    if args.dtype is not None:
        overrides["train.dtype"] = args.dtype
    cfg = RunConfig.from_name(args.preset).override(overrides)
    if cfg.model.prototypes is None:
        raise SystemExit("the PRISM config has no prototype head (model.prototypes is null); nothing to compare")
    # A warm-up longer than the run would leave the prototype losses at a fraction of their weight.
    if cfg.loss.warmup_steps > cfg.train.max_steps:
        print(
            f"[quality] note: loss.warmup_steps={cfg.loss.warmup_steps} > max_steps={cfg.train.max_steps}; the "
            f"prototype losses never reach full weight",
            file=sys.stderr,
        )
    return cfg, overrides


def time_budget(
    args: argparse.Namespace, cfg: RunConfig, overrides: dict[str, object]
) -> tuple[RunConfig, int, Json | None]:
    """``--minutes``: each model's step count from its step time (PRISM's into ``cfg`` and ``overrides``),
    the dense step count and the plan; else the config's steps and no plan."""
    budget: Json | None = None
    steps_dense = cfg.train.max_steps
    if args.minutes is not None:
        step_s, source = step_seconds(cfg, args.step_time_from, args.calibration_steps)
        planned = {k: max(1, int(60.0 * args.minutes / v)) for k, v in step_s.items()}
        if args.max_steps_cap is not None:
            planned = {k: min(v, args.max_steps_cap) for k, v in planned.items()}
        if args.same_steps:
            planned = dict.fromkeys(planned, min(planned.values()))
        overrides["train.max_steps"] = planned["prism"]
        cfg = cfg.override({"train.max_steps": planned["prism"]})
        steps_dense = planned["dense"]
        budget = {
            "minutes": args.minutes,
            "step_time_source": source,
            "step_s": step_s,
            "steps": planned,
            "same_steps": args.same_steps,
            "max_steps_cap": args.max_steps_cap,
            "planned_train_s": {k: planned[k] * step_s[k] for k in planned},
        }
        print(
            f"[quality] --minutes {args.minutes}: PRISM {planned['prism']} steps, dense {planned['dense']} steps "
            f"(step times {step_s['prism'] * 1e3:.1f} / {step_s['dense'] * 1e3:.1f} ms, {source})",
            file=sys.stderr,
        )
    return cfg, steps_dense, budget


def summarise(prism: Json, dense: Json, K: int) -> Json:
    """The headline: both validation losses, the gap, PRISM's coverage, tokens, steps and wall times."""
    vp, vd = obj(prism, "val"), obj(dense, "val")
    if vp["val_tokens"] != vd["val_tokens"]:
        raise RuntimeError("PRISM and dense were evaluated on different numbers of validation tokens")
    gap = num(vp, "val_loss") - num(vd, "val_loss")
    return {
        "val_loss_prism": vp["val_loss"],
        "val_loss_dense": vd["val_loss"],
        "gap": gap,
        "gap_pct": 100.0 * gap / num(vd, "val_loss"),
        "val_ppl_prism": vp["val_ppl"],
        "val_ppl_dense": vd["val_ppl"],
        **{k: vp[k] for k in COVERAGE_KEYS},
        "num_prototypes": K,
        "val_tokens": vp["val_tokens"],
        "tokens_seen": prism["tokens_seen"],
        "train_wall_s_prism": prism["train_wall_s"],
        "train_wall_s_dense": dense["train_wall_s"],
        "steps_prism": prism["steps"],
        "steps_dense": dense["steps"],
        "tokens_seen_dense": dense["tokens_seen"],
    }


def summary_line(s: Json, K: int, tag: str | None) -> str:
    return (
        f"quality: val loss PRISM {num(s, 'val_loss_prism'):.2f} vs dense {num(s, 'val_loss_dense'):.2f} "
        f"({num(s, 'gap_pct'):+.1f}%) | R̄1 {num(s, 'r1_bar'):.2f} R2 {num(s, 'r2'):.2f} residual "
        f"{num(s, 'residual_share'):.2f} dead {s['dead_prototypes']}/{K} | {num(s, 'tokens_seen') / 1e6:.2f}M tokens"
        + (f" (dense {num(s, 'tokens_seen_dense') / 1e6:.2f}M)" if s["tokens_seen_dense"] != s["tokens_seen"] else "")
        + ", train "
        f"{num(s, 'train_wall_s_prism'):.0f}s vs {num(s, 'train_wall_s_dense'):.0f}s" + (f" | tag {tag}" if tag else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg, overrides = config(args)
    torch.set_num_threads(args.threads)
    cfg, steps_dense, budget = time_budget(args, cfg, overrides)
    dense_cfg = cfg.dense().override({"train.max_steps": steps_dense})
    if (cfg.train.device == "cpu") or (cfg.train.device == "auto" and not torch.cuda.is_available()):
        warn_if_busy(args.threads)
    env = environment(
        cfg.train.device if cfg.train.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"),
        cfg.train.seed,
    )
    t0 = time.perf_counter()
    shards = prepare_from_config(cfg.data, show_progress=False)
    print(
        f"[quality] data {cfg.data.corpus}/{cfg.data.tokenizer} ready in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    suffix = f"-{args.tag}" if args.tag else ""
    workdir = Path(args.workdir)
    prism = run_one("PRISM", cfg, workdir / f"quality{suffix}-prism", shards, args.eval_batches)
    dense = run_one("dense", dense_cfg, workdir / f"quality{suffix}-dense", shards, args.eval_batches)
    assert cfg.model.prototypes is not None  # checked by config()
    K = cfg.model.prototypes.num_prototypes
    summary = summarise(prism, dense, K)
    if budget is not None:
        budget["train_wall_s"] = {"prism": prism["train_wall_s"], "dense": dense["train_wall_s"]}
    payload = {
        "benchmark": "quality",
        "what": "validation CE of PRISM vs the matched dense baseline at equal seed/steps/tokens, plus PRISM coverage",
        "tag": args.tag,
        "preset": args.preset,
        "overrides": overrides,
        "loss_weights": cfg.loss.weights_at(cfg.train.max_steps - 1),
        "loss_warmup_steps": cfg.loss.warmup_steps,
        "eval": {
            "batches": args.eval_batches,
            "batch_size": cfg.train.batch_size,
            "seq_len": cfg.model.block_size,
            "sample": "prismlm.eval.metrics.eval_sequence_ids (fixed, evenly spread)",
        },
        "data_manifest_key": shards.manifest.get("key") if isinstance(shards.manifest, dict) else None,
        "args": vars(args),
        "environment": env,
        "time_budget": budget,
        "summary": summary,
        "prism": prism,
        "dense": dense,
    }
    out = Path(args.out) if args.out else RESULTS_DIR / f"quality{suffix}.json"
    write_json(out, payload)
    print(f"[quality] wrote {out}", file=sys.stderr)
    print(summary_line(summary, K, args.tag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
