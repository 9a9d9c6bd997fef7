"""Faithfulness of the prototype head on SmolLM2-135M-Instruct (issue 33): would the prototypes alone have
predicted the model's token? Stage 2 on stored boundary activations, long and resumable.

    python bench/real_faithfulness.py --stage stage2 --threads 1    # the long run (run again to continue)
    python bench/real_faithfulness.py --stage curve                 # held-out numbers of its latest checkpoint
    python bench/real_faithfulness.py --stage speed --threads 2     # tokens/s: stored stage 2 vs per-step, same N
    python bench/real_faithfulness.py --stage summary               # bench/results/real-faithfulness.json

Runs live under bench/runs/real-faithfulness/; results and their commands: docs/results.md ("Faithfulness").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, write_json

from prismlm.app import Run
from prismlm.app.retrofit import RetrofitRecipe, resume_retrofit, retrofit_model
from prismlm.errors import CheckpointError
from prismlm.train.checkpoint import find_checkpoint
from prismlm.train.retrofit import build_model, load_pretrained
from prismlm.train.stage2 import heldout_stage2_metrics
from prismlm.train.stored_z import build_stored_z, open_stored_z

SOURCE = "smollm2-135m-instruct"
ROOT = RUNS_DIR / "real-faithfulness"
CURVE = RESULTS_DIR / "real-faithfulness-curve.json"
ANCHOR = [
    "data.max_chars_per_doc=6000",
    "data.val_fraction=0.05",
]  # every built-in document, its first 6,000 characters


def recipe(args: argparse.Namespace) -> RetrofitRecipe:
    return RetrofitRecipe(
        steps=args.frozen_steps + args.steps,
        frozen_steps=args.frozen_steps,
        unfreeze=f"last-{args.last}",
        prototypes=args.prototypes,
        top_k=args.top_k,
        lr=args.lr,
        backbone_lr_ratio=args.block_lr / args.lr,
        batch_size=args.batch_size,
        block_size=256,
    )


def run_dir(args: argparse.Namespace) -> Path:
    return ROOT / f"stage2-K{args.prototypes}-k{args.top_k}-N{args.last}-a{args.alpha:g}"


def overrides(args: argparse.Namespace) -> list[str]:
    return [
        *ANCHOR,
        f"loss.lambda_proto_kl={args.alpha}",
        "train.eval_interval=200",
        "train.ckpt_interval=50",
        "train.log_interval=10",
        "train.eval_batches=4",
        f"train.num_threads={args.threads}",
    ]


def stage2_main(args: argparse.Namespace) -> None:
    """Start the long run, or continue it from its latest checkpoint (the same command after a kill)."""
    out = run_dir(args)
    t0 = time.perf_counter()
    try:
        find_checkpoint(out)
        result = resume_retrofit(out, steps=args.frozen_steps + args.steps, device="cpu")
    except CheckpointError:
        out.parent.mkdir(parents=True, exist_ok=True)
        result = retrofit_model(SOURCE, out=out, recipe=recipe(args), overrides=overrides(args), device="cpu")
    print(f"stage2: step {result.step} in {time.perf_counter() - t0:.0f} s → {out}")


def heldout_store(args: argparse.Namespace, out: Path) -> Any:
    """The source model's stored z and boundary activations over the run's validation split (made once)."""
    path = ROOT / f"val-store-L{30 - args.last}"
    try:
        return open_stored_z(path).check()
    except Exception:  # noqa: BLE001 (absent or unfinished: build or finish it)
        pre = load_pretrained(SOURCE, block_size=256)
        source = build_model(pre, pre.model)
        shards = Run.open(out, device="cpu").shards()
        return build_stored_z(
            source, shards, path, split="val", dtype="float32", batch_size=4, max_sequences=args.heldout_sequences,
            boundary_layer=30 - args.last,
        )  # fmt: skip


def curve_main(args: argparse.Namespace) -> None:
    """Held-out numbers of the run's latest checkpoint (stored path), appended to the curve file."""
    torch.set_num_threads(args.threads)
    out = run_dir(args)
    store = heldout_store(args, out)
    run = Run.open(out, device="cpu")
    step = int(find_checkpoint(out).name.removeprefix("step-"))
    got = heldout_stage2_metrics(run.model, store, 30 - args.last, max_sequences=args.heldout_sequences)
    tokens_per_step = args.batch_size * 256
    point = {"step": step, "stage2_tokens": max(0, step - args.frozen_steps) * tokens_per_step, **got}
    curve = json.loads(CURVE.read_text()) if CURVE.exists() else {"points": []}
    curve["points"] = [p for p in curve["points"] if p["step"] != step] + [point]
    curve["points"].sort(key=lambda p: p["step"])
    curve["run"] = {"folder": str(out.relative_to(RUNS_DIR.parent)), "recipe": vars(args), "overrides": overrides(args)}
    curve["environment"] = environment("cpu", 0)
    write_json(CURVE, curve)
    print(f"curve: step {step} proto_top1 {got['proto_top1']:.3f} proto_kl {got['proto_kl']:.3f} "
          f"CE {got['ce']:.4f} (source {got['ce_source']:.4f}) top1 vs source {got['top1_vs_source']:.3f}")  # fmt: skip


def speed_main(args: argparse.Namespace) -> None:
    """Stage-2 tokens/s at N=args.last: on stored boundary activations vs the per-step path (same recipe,
    batch, steps, threads), from the runs' own metrics lines (stage-2 lines only; the first dropped)."""
    torch.set_num_threads(args.threads)
    small = ["data.max_docs=6", "data.max_chars_per_doc=4000", "train.log_interval=1", "train.eval_interval=1000"]
    rates = {}
    for name, extra in (("stored", []), ("per_step", ["train.stage2_from_stored=false"])):
        out = ROOT / f"speed-{name}"
        spec = RetrofitRecipe(steps=6 + args.speed_steps, frozen_steps=6, unfreeze=f"last-{args.last}",
                              prototypes=512, top_k=8, batch_size=2, block_size=256)  # fmt: skip
        retrofit_model(SOURCE, out=out, recipe=spec, overrides=[*small, *extra, f"train.num_threads={args.threads}"],
                       device="cpu", overwrite=out.exists(), progress=False)  # fmt: skip
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        stage2 = [x["tokens_per_s"] for x in lines if "tokens_per_s" in x and x["step"] > 7 and "stored_z" not in x]
        rates[name] = float(np.median(stage2))
    payload = {"N": args.last, "tokens_per_s": rates, "ratio": rates["stored"] / rates["per_step"],
               "environment": environment("cpu", 0)}  # fmt: skip
    write_json(RESULTS_DIR / "real-faithfulness-speed.json", payload)
    print(f"speed: stored {rates['stored']:.0f} tok/s, per-step {rates['per_step']:.0f} tok/s, ×{payload['ratio']:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=["stage2", "curve", "speed"], required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prototypes", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--last", type=int, default=4, help="unfrozen blocks N (the boundary is block 30 − N)")
    p.add_argument("--alpha", type=float, default=1.0, help="loss.lambda_proto_kl")
    p.add_argument("--lr", type=float, default=3e-3, help="the bank's learning rate")
    p.add_argument("--block-lr", type=float, default=1e-4, help="the unfrozen blocks' learning rate")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--frozen-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=4000, help="stage-2 steps")
    p.add_argument("--heldout-sequences", type=int, default=32)
    p.add_argument("--speed-steps", type=int, default=6)
    args = p.parse_args()
    {"stage2": stage2_main, "curve": curve_main, "speed": speed_main}[args.stage](args)


if __name__ == "__main__":
    main()
