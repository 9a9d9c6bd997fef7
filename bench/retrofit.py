#!/usr/bin/env python
"""Retrofit a prototype head onto a pretrained dense model vs PRISM from scratch vs the dense model continued.

What is measured
    The "pretrained" model is the dense ``cpu-small`` baseline trained as in ``bench/quality.py`` (same config,
    seed and 600 steps; pass ``--dense RUN`` to reuse one). Then, all at equal total training tokens
    (pretraining + S1 + S2 steps of the same batch × block):

    * **stage 1**: ``prism retrofit`` with the backbone frozen for S1 steps (only the bank trains: REC + R1 + R2);
    * **stage 1 + 2**: the same S1 frozen steps, then S2 joint steps (``--unfreeze``, CE + REC + R1 + R2);
    * **dense continued**: the pretrained dense model trained S1 + S2 more steps (``--resume --steps``);
    * **PRISM from scratch**: the PRISM ``cpu-small`` preset trained for pretraining + S1 + S2 steps.

    Every model is evaluated with ``prismlm.eval.metrics.evaluate`` on the same fixed validation sample:
    val CE, residual share, R̄1, R2, dead prototypes. Wall times are training times on this machine (shared,
    indicative). Stage 1's time is compared with from-scratch PRISM's time for the same pretraining budget.

Goals (issue "open models"): stage 1 keeps CE exactly and reaches residual share ≤ 0.25 with R̄1, R2 ≥ 0.94 in
≤ 10% of the from-scratch time; stage 2 changes CE by ≤ 0.5% and reaches residual share ≤ 0.15.

Output: JSON at ``bench/results/retrofit.json`` (or ``--out``) and one summary line.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, warn_if_busy, write_json

from prismlm.app.retrofit import retrofit_model
from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, prepare_from_config
from prismlm.eval.metrics import evaluate
from prismlm.model import PrismLM
from prismlm.train.checkpoint import load_checkpoint
from prismlm.train.trainer import train

METRICS = ("val_loss", "residual_share", "r1_bar", "r2", "dead_prototypes")


def measure(model: PrismLM, shards: ShardSet, eval_batches: int) -> dict[str, Any]:
    m = evaluate(
        model,
        shards.val,
        seq_len=model.config.block_size,
        batch_size=16,
        max_batches=eval_batches,
        device=torch.device("cpu"),
    )
    return {k: m[k] for k in METRICS if k in m} | {"val_tokens": m["val_tokens"]}


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--dense", default=None, help="a trained dense cpu-small run to retrofit (default: train one)")
    ap.add_argument("--pretrain-steps", type=int, default=600, help="steps of the dense model when trained here")
    ap.add_argument("--stage1-steps", type=int, default=150)
    ap.add_argument("--stage2-steps", type=int, default=450)
    ap.add_argument("--unfreeze", default="all", help="stage 2's --unfreeze")
    ap.add_argument("--lr", type=float, default=1e-2, help="learning rate of the bank")
    ap.add_argument("--backbone-lr-ratio", type=float, default=0.1)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-scratch", action="store_true", help="do not train PRISM from scratch (quick runs)")
    ap.add_argument("--workdir", default=str(RUNS_DIR))
    ap.add_argument("--out", default=str(RESULTS_DIR / "retrofit.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    work = Path(args.workdir) / "retrofit"
    work.mkdir(parents=True, exist_ok=True)
    threads = [f"train.num_threads={args.threads}"]
    results: dict[str, Any] = {}

    base = RunConfig.from_name("cpu-small").override({"train.num_threads": args.threads})
    dense_dir = Path(args.dense) if args.dense else fresh(work / "dense")
    if args.dense is None:
        cfg = base.dense().override({"train.max_steps": args.pretrain_steps})
        res, wall = timed(train, cfg, dense_dir, progress=False)
        results["dense_pretraining"] = {"steps": res.step, "wall_s": wall}
    pre = load_checkpoint(dense_dir)
    pre_steps = int(pre.manifest["step"])
    total = pre_steps + args.stage1_steps + args.stage2_steps
    tokens_per_step = pre.config.train.batch_size * pre.config.train.grad_accum * pre.config.model.block_size

    common = dict(
        corpus=pre.config.data.corpus,
        lr=args.lr,
        backbone_lr_ratio=args.backbone_lr_ratio,
        batch_size=pre.config.train.batch_size,
        prototypes=512,
        top_k=8,
        device="cpu",
        progress=False,
        overrides=threads,
    )
    s1, s1_wall = timed(retrofit_model, str(dense_dir), out=fresh(work / "stage1"), steps=args.stage1_steps, **common)
    s12, s12_wall = timed(
        retrofit_model,
        str(dense_dir),
        out=fresh(work / "stage12"),
        steps=args.stage1_steps + args.stage2_steps,
        frozen_steps=args.stage1_steps,
        unfreeze=args.unfreeze,
        **common,
    )
    shards = prepare_from_config(load_checkpoint(s1.checkpoint).config.data, show_progress=False)

    cont_dir = fresh(work / "dense-continued")
    shutil.copytree(dense_dir, cont_dir)
    cont, cont_wall = timed(
        train, RunConfig.from_json(cont_dir / "config.json"), cont_dir, resume=True, extend_to=total, progress=False
    )

    results["pretrained_dense"] = measure(pre.model, shards, args.eval_batches)
    results["stage1"] = measure(load_checkpoint(s1.checkpoint).model, shards, args.eval_batches) | {
        "steps": args.stage1_steps,
        "wall_s": s1_wall,
    }
    results["stage1_2"] = measure(load_checkpoint(s12.checkpoint).model, shards, args.eval_batches) | {
        "steps": args.stage1_steps + args.stage2_steps,
        "wall_s": s12_wall,
        "unfreeze": args.unfreeze,
    }
    results["dense_continued"] = measure(load_checkpoint(cont.checkpoint).model, shards, args.eval_batches) | {
        "steps": total - pre_steps,
        "wall_s": cont_wall,
    }
    if not args.skip_scratch:
        scratch_cfg = base.override({"train.max_steps": total})
        sc, sc_wall = timed(train, scratch_cfg, fresh(work / "scratch"), progress=False)
        results["prism_from_scratch"] = measure(load_checkpoint(sc.checkpoint).model, shards, args.eval_batches) | {
            "steps": total,
            "wall_s": sc_wall,
        }

    ce0 = results["pretrained_dense"]["val_loss"]
    s1r, s12r = results["stage1"], results["stage1_2"]
    summary = {
        "stage1_ce_change": s1r["val_loss"] - ce0,
        "stage1_residual_share": s1r["residual_share"],
        "stage1_r1_bar": s1r["r1_bar"],
        "stage1_r2": s1r["r2"],
        "stage1_dead": s1r["dead_prototypes"],
        "stage2_ce_change_pct": 100 * (s12r["val_loss"] - ce0) / ce0,
        "stage2_ce_vs_dense_continued_pct": 100
        * (s12r["val_loss"] - results["dense_continued"]["val_loss"])
        / results["dense_continued"]["val_loss"],
        "stage2_residual_share": s12r["residual_share"],
        "stage2_r1_bar": s12r["r1_bar"],
        "stage2_r2": s12r["r2"],
        "total_steps": total,
        "tokens_per_step": tokens_per_step,
    }
    if "prism_from_scratch" in results:
        sc_r = results["prism_from_scratch"]
        # the time from-scratch PRISM needs for the pretraining budget alone (its wall time is ~linear in steps)
        scratch_pre_s = sc_r["wall_s"] * pre_steps / total
        summary |= {
            "stage1_time_share_of_scratch": s1_wall / scratch_pre_s,
            "scratch_val_loss": sc_r["val_loss"],
            "scratch_residual_share": sc_r["residual_share"],
        }
    payload = {
        "benchmark": "retrofit",
        "what": __doc__.split("\n\n")[0],
        "args": vars(args),
        "environment": environment("cpu", base.train.seed),
        "summary": summary,
        "results": results,
    }
    write_json(args.out, payload)
    print(f"[retrofit] wrote {args.out}", file=sys.stderr)
    s = summary
    line = (
        f"retrofit: stage 1 ({args.stage1_steps} steps, {s1_wall:.0f}s) CE {s['stage1_ce_change']:+.1e} residual "
        f"{s['stage1_residual_share']:.3f} R̄1 {s['stage1_r1_bar']:.3f} R2 {s['stage1_r2']:.3f} | stage 2 "
        f"CE {s['stage2_ce_change_pct']:+.2f}% (vs dense continued {s['stage2_ce_vs_dense_continued_pct']:+.2f}%) "
        f"residual {s['stage2_residual_share']:.3f}"
    )
    if "stage1_time_share_of_scratch" in s:
        line += (
            f" | stage 1 took {100 * s['stage1_time_share_of_scratch']:.0f}% of from-scratch time; scratch "
            f"CE {s['scratch_val_loss']:.3f} residual {s['scratch_residual_share']:.3f}"
        )
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
