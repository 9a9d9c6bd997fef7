#!/usr/bin/env python
"""Retrofit a prototype head onto a pretrained dense model vs PRISM from scratch vs the dense model continued.

The "pretrained" model is the dense ``cpu-small`` baseline trained as in ``bench/quality.py`` (or ``--dense RUN``).
Then, at equal total training tokens: **stage 1** (``retrofit_model``, backbone frozen, S1 steps), **stage 1 +
2** (S1 frozen steps, then S2 joint steps with ``--unfreeze``), the **dense model continued** S1 + S2 steps and
**PRISM from scratch** for all the steps; each evaluated with ``prismlm.eval.metrics.evaluate`` on the same fixed
validation sample (val CE, residual share, R̄1, R2, dead prototypes), with its training wall time.

Goals (issue "open models"): stage 1 keeps CE exactly and reaches residual share ≤ 0.25 with R̄1, R2 ≥ 0.94 in
≤ 10% of the from-scratch time; stage 2 changes CE by ≤ 0.5% and reaches residual share ≤ 0.15.

Run: ``PYTHONPATH=src python bench/retrofit.py [--dense RUN] [--skip-scratch]``. Writes
``bench/results/retrofit.json`` and one summary line.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from _common import RESULTS_DIR, RUNS_DIR, Json, environment, num, obj, warn_if_busy, write_json

from prismlm.app.retrofit import RetrofitRecipe, retrofit_model
from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, prepare_from_config
from prismlm.eval.metrics import evaluate
from prismlm.model import PrismLM
from prismlm.train.checkpoint import load_checkpoint
from prismlm.train.trainer import train

METRICS = ("val_loss", "residual_share", "r1_bar", "r2", "dead_prototypes")
R = TypeVar("R")


def measure(model: PrismLM, shards: ShardSet, eval_batches: int) -> Json:
    m: Json = dict(
        evaluate(
            model,
            shards.val,
            seq_len=model.config.block_size,
            batch_size=16,
            max_batches=eval_batches,
            device=torch.device("cpu"),
        )
    )
    return {k: m[k] for k in METRICS if k in m} | {"val_tokens": m["val_tokens"]}


def timed(fn: Callable[[], R]) -> tuple[R, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
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
    return ap.parse_args(argv)


def train_models(args: argparse.Namespace, work: Path, results: Json) -> tuple[Json, dict[str, float]]:
    """The pretrained dense model (trained here unless ``--dense``) and every model compared, trained; each
    measured on the same validation sample. Returns the step counts and the training wall times."""
    base = RunConfig.from_name("cpu-small").override({"train.num_threads": args.threads})
    dense_dir = Path(args.dense) if args.dense else fresh(work / "dense")
    if args.dense is None:
        cfg = base.dense().override({"train.max_steps": args.pretrain_steps})
        res, wall = timed(lambda: train(cfg, dense_dir, progress=False))
        results["dense_pretraining"] = {"steps": res.step, "wall_s": wall}
    pre = load_checkpoint(dense_dir)
    pre_steps = int(pre.manifest["step"])
    total = pre_steps + args.stage1_steps + args.stage2_steps

    def recipe(steps: int, frozen_steps: int | None = None, unfreeze: str = "none") -> RetrofitRecipe:
        return RetrofitRecipe(
            corpus=pre.config.data.corpus,
            lr=args.lr,
            backbone_lr_ratio=args.backbone_lr_ratio,
            batch_size=pre.config.train.batch_size,
            prototypes=512,
            top_k=8,
            steps=steps,
            frozen_steps=frozen_steps,
            unfreeze=unfreeze,
        )

    def retrofit(out: Path, r: RetrofitRecipe) -> Path:
        overrides = [f"train.num_threads={args.threads}"]
        return retrofit_model(
            str(dense_dir), out=out, recipe=r, overrides=overrides, device="cpu", progress=False
        ).checkpoint

    s1, s1_wall = timed(lambda: retrofit(fresh(work / "stage1"), recipe(args.stage1_steps)))
    s12_recipe = recipe(args.stage1_steps + args.stage2_steps, frozen_steps=args.stage1_steps, unfreeze=args.unfreeze)
    s12, s12_wall = timed(lambda: retrofit(fresh(work / "stage12"), s12_recipe))
    shards = prepare_from_config(load_checkpoint(s1).config.data, show_progress=False)
    cont_dir = fresh(work / "dense-continued")
    shutil.copytree(dense_dir, cont_dir)
    cont_cfg = RunConfig.from_json(cont_dir / "config.json")
    cont, cont_wall = timed(lambda: train(cont_cfg, cont_dir, resume=True, extend_to=total, progress=False))

    def measured(ckpt: Path) -> Json:
        return measure(load_checkpoint(ckpt).model, shards, args.eval_batches)

    results["pretrained_dense"] = measure(pre.model, shards, args.eval_batches)
    results["stage1"] = measured(s1) | {"steps": args.stage1_steps, "wall_s": s1_wall}
    results["stage1_2"] = measured(s12) | {
        "steps": args.stage1_steps + args.stage2_steps,
        "wall_s": s12_wall,
        "unfreeze": args.unfreeze,
    }
    results["dense_continued"] = measured(cont.checkpoint) | {"steps": total - pre_steps, "wall_s": cont_wall}
    if not args.skip_scratch:
        scratch_cfg = base.override({"train.max_steps": total})
        sc, sc_wall = timed(lambda: train(scratch_cfg, fresh(work / "scratch"), progress=False))
        results["prism_from_scratch"] = measured(sc.checkpoint) | {"steps": total, "wall_s": sc_wall}
    tokens_per_step = pre.config.train.batch_size * pre.config.train.grad_accum * pre.config.model.block_size
    steps = {"pre_steps": pre_steps, "total": total, "tokens_per_step": tokens_per_step, "seed": base.train.seed}
    return results, {**steps, "s1_wall": s1_wall}


def summarise(results: Json, st: dict[str, float]) -> Json:
    ce0 = num(results, "pretrained_dense", "val_loss")
    s1r, s12r, cont = obj(results, "stage1"), obj(results, "stage1_2"), obj(results, "dense_continued")
    summary: Json = {
        "stage1_ce_change": num(s1r, "val_loss") - ce0,
        "stage1_residual_share": s1r["residual_share"],
        "stage1_r1_bar": s1r["r1_bar"],
        "stage1_r2": s1r["r2"],
        "stage1_dead": s1r["dead_prototypes"],
        "stage2_ce_change_pct": 100 * (num(s12r, "val_loss") - ce0) / ce0,
        "stage2_ce_vs_dense_continued_pct": 100
        * (num(s12r, "val_loss") - num(cont, "val_loss"))
        / num(cont, "val_loss"),
        "stage2_residual_share": s12r["residual_share"],
        "stage2_r1_bar": s12r["r1_bar"],
        "stage2_r2": s12r["r2"],
        "total_steps": int(st["total"]),
        "tokens_per_step": int(st["tokens_per_step"]),
    }
    if "prism_from_scratch" in results:
        sc_r = obj(results, "prism_from_scratch")
        # the time from-scratch PRISM needs for the pretraining budget alone (its wall time is ~linear in steps)
        scratch_pre_s = num(sc_r, "wall_s") * st["pre_steps"] / st["total"]
        summary |= {
            "stage1_time_share_of_scratch": st["s1_wall"] / scratch_pre_s,
            "scratch_val_loss": sc_r["val_loss"],
            "scratch_residual_share": sc_r["residual_share"],
        }
    return summary


def summary_line(args: argparse.Namespace, s: Json, s1_wall: float) -> str:
    line = (
        f"retrofit: stage 1 ({args.stage1_steps} steps, {s1_wall:.0f}s) CE {num(s, 'stage1_ce_change'):+.1e} "
        f"residual {num(s, 'stage1_residual_share'):.3f} R̄1 {num(s, 'stage1_r1_bar'):.3f} R2 {num(s, 'stage1_r2'):.3f} "
        f"| stage 2 CE {num(s, 'stage2_ce_change_pct'):+.2f}% (vs dense continued "
        f"{num(s, 'stage2_ce_vs_dense_continued_pct'):+.2f}%) residual {num(s, 'stage2_residual_share'):.3f}"
    )
    if "stage1_time_share_of_scratch" in s:
        line += (
            f" | stage 1 took {100 * num(s, 'stage1_time_share_of_scratch'):.0f}% of from-scratch time; scratch "
            f"CE {num(s, 'scratch_val_loss'):.3f} residual {num(s, 'scratch_residual_share'):.3f}"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    work = Path(args.workdir) / "retrofit"
    work.mkdir(parents=True, exist_ok=True)
    results, st = train_models(args, work, {})
    summary = summarise(results, st)
    payload = {
        "benchmark": "retrofit",
        "what": (__doc__ or "").split("\n\n")[0],
        "args": vars(args),
        "environment": environment("cpu", int(st["seed"])),
        "summary": summary,
        "results": results,
    }
    write_json(args.out, payload)
    print(f"[retrofit] wrote {args.out}", file=sys.stderr)
    print(summary_line(args, summary, st["s1_wall"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
