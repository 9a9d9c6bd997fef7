"""Faithfulness of the prototype head on SmolLM2-135M-Instruct (issue 33): would the prototypes alone have
predicted the model's token? Stage 2 on stored boundary activations, long and resumable.

    python bench/real_faithfulness.py --stage stage2 --threads 1    # the long run (run again to continue)
    python bench/real_faithfulness.py --stage curve                 # held-out numbers of its latest checkpoint
    python bench/real_faithfulness.py --stage speed --threads 2     # tokens/s: stored stage 2 vs per-step, same N
    python bench/real_faithfulness.py --stage frozen --lever kl     # a frozen head lever on the run's stored z
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
from prismlm.config import RunConfig
from prismlm.errors import CheckpointError
from prismlm.model.prototypes import seed_prototypes
from prismlm.train.bank_stage import train_bank
from prismlm.train.checkpoint import find_checkpoint
from prismlm.train.retrofit import build_model, load_pretrained, seed_sequences
from prismlm.train.stage2 import heldout_stage2_metrics
from prismlm.train.stored_z import build_stored_z, open_stored_z

SOURCE = "smollm2-135m-instruct"
ROOT = RUNS_DIR / "real-faithfulness"  # --root overrides it (the GPU campaign writes under its OUT_DIR)
CURVE = RESULTS_DIR / "real-faithfulness-curve.json"
ANCHOR = ["data.max_chars_per_doc=2000", "data.val_fraction=0.05"]
"""Every built-in document (books, speeches, the shipped chat answers), cut to its first 2,000 characters."""


def recipe(args: argparse.Namespace) -> RetrofitRecipe:
    return RetrofitRecipe(
        steps=args.frozen_steps + args.steps,
        frozen_steps=args.frozen_steps,
        corpus="builtin:gutenberg+sotu+chat",
        unfreeze=f"last-{args.last}",
        prototypes=args.prototypes,
        top_k=args.top_k,
        lr=args.lr,
        backbone_lr_ratio=args.block_lr / args.lr,
        batch_size=args.batch_size,
        block_size=256,
    )


def run_dir(args: argparse.Namespace) -> Path:
    return args.root / f"stage2-K{args.prototypes}-k{args.top_k}-N{args.last}-a{args.alpha:g}"


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
        result = resume_retrofit(out, steps=args.frozen_steps + args.steps, device=args.device)
    except CheckpointError:
        out.parent.mkdir(parents=True, exist_ok=True)
        result = retrofit_model(
            args.source, out=out, recipe=recipe(args), overrides=overrides(args), device=args.device
        )
    print(f"stage2: step {result.step} in {time.perf_counter() - t0:.0f} s → {out}")


def heldout_store(args: argparse.Namespace, out: Path) -> Any:
    """The source model's stored z and boundary activations over the run's validation split (made once)."""
    path = args.root / f"val-store-L{30 - args.last}"
    try:
        return open_stored_z(path).check()
    except Exception:  # noqa: BLE001 (absent or unfinished: build or finish it)
        pre = load_pretrained(args.source, block_size=256)
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
    curve = json.loads(args.curve.read_text()) if args.curve.exists() else {"points": []}
    curve["points"] = [p for p in curve["points"] if p["step"] != step] + [point]
    curve["points"].sort(key=lambda p: p["step"])
    recipe_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    curve["run"] = {"folder": str(out), "recipe": recipe_args, "overrides": overrides(args)}
    curve["environment"] = environment("cpu", 0)
    write_json(args.curve, curve)
    print(f"curve: step {step} proto_top1 {got['proto_top1']:.3f} proto_kl {got['proto_kl']:.3f} "
          f"CE {got['ce']:.4f} (source {got['ce_source']:.4f}) top1 vs source {got['top1_vs_source']:.3f}")  # fmt: skip


def speed_main(args: argparse.Namespace) -> None:
    """Stage-2 tokens/s at N=args.last: on stored boundary activations vs the per-step path (same recipe,
    batch, steps, threads), from the runs' own metrics lines (stage-2 lines only; the first dropped)."""
    torch.set_num_threads(args.threads)
    small = ["data.max_docs=6", "data.max_chars_per_doc=4000", "train.log_interval=1", "train.eval_interval=1000"]
    rates = {}
    for name, extra in (("stored", []), ("per_step", ["train.stage2_from_stored=false"])):
        out = args.root / f"speed-{name}"
        spec = RetrofitRecipe(steps=6 + args.speed_steps, frozen_steps=6, unfreeze=f"last-{args.last}",
                              prototypes=512, top_k=8, batch_size=2, block_size=256)  # fmt: skip
        retrofit_model(args.source, out=out, recipe=spec, overrides=[*small, *extra, f"train.num_threads={args.threads}"],
                       device="cpu", overwrite=out.exists(), progress=False)  # fmt: skip
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        stage2 = [x["tokens_per_s"] for x in lines if "tokens_per_s" in x and x["step"] > 7 and "stored_z" not in x]
        rates[name] = float(np.median(stage2))
    payload = {"N": args.last, "tokens_per_s": rates, "ratio": rates["stored"] / rates["per_step"],
               "environment": environment("cpu", 0)}  # fmt: skip
    write_json(RESULTS_DIR / "real-faithfulness-speed.json", payload)
    print(f"speed: stored {rates['stored']:.0f} tok/s, per-step {rates['per_step']:.0f} tok/s, ×{payload['ratio']:.1f}")


LEVERS: dict[str, dict[str, float]] = {
    "paper": {"K": 2048, "k": 8, "alpha": 0.0},
    "kl": {"K": 2048, "k": 8, "alpha": 1.0},
    "kl-K8192-k32": {"K": 8192, "k": 32, "alpha": 1.0},
    "paper-K8192-k32": {"K": 8192, "k": 32, "alpha": 0.0},
}
"""Frozen heads compared on the same stored z, steps and held-out tokens: the paper's objective (REC + R1 + R2)
and the prototype-only KL added (``loss.lambda_proto_kl``), at two bank sizes."""


def frozen_main(args: argparse.Namespace) -> None:
    """Train one frozen bank per ``--lever`` on the long run's stored z (the source backbone) and measure the
    prototype-only prediction on the held-out store; results merged into real-faithfulness-frozen.json."""
    torch.set_num_threads(args.threads)
    out = run_dir(args)
    store, val = open_stored_z(out / "stored-z").check(), heldout_store(args, out)
    base = RunConfig.from_json(out / "config.json")
    pre = load_pretrained(args.source, block_size=256)
    path = RESULTS_DIR / "real-faithfulness-frozen.json"
    results = json.loads(path.read_text()) if path.exists() else {"levers": {}}
    for name in args.lever:
        lever = LEVERS[name]
        cfg = base.override(
            {
                "model.prototypes": {"num_prototypes": int(lever["K"]), "top_k": int(lever["k"])},
                "loss.lambda_proto_kl": lever["alpha"],
                "train.max_steps": args.frozen_steps,
                "train.frozen_steps": args.frozen_steps,
                "train.trainable": "prototypes",
            }
        )
        torch.manual_seed(0)
        model = build_model(pre, cfg.model)
        seeds = seed_sequences(store.num_sequences, 256, 16 * int(lever["K"]), 0)
        bank = seed_prototypes(store.hidden(seeds).reshape(-1, 576)[: 16 * int(lever["K"])], int(lever["K"]),
                               int(lever["k"]), generator=torch.Generator().manual_seed(0))  # fmt: skip
        with torch.no_grad():
            model.require_prototypes().weight.copy_(bank)
        t0 = time.perf_counter()
        train_bank(model, store, cfg, steps=args.frozen_steps, device=torch.device("cpu"))
        got = heldout_stage2_metrics(model, val, None, max_sequences=args.heldout_sequences)
        results["levers"][name] = {**lever, "steps": args.frozen_steps, "seconds": time.perf_counter() - t0, **got}
        results["environment"] = environment("cpu", 0)
        write_json(path, results)
        print(f"frozen {name}: proto_top1 {got['proto_top1']:.3f} proto_kl {got['proto_kl']:.3f} "
              f"residual {got['residual_share']:.3f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=["stage2", "curve", "speed", "frozen"], required=True)
    p.add_argument("--lever", action="append", choices=sorted(LEVERS), default=[], help="frozen: which heads")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--source", default=SOURCE, help="the model: the shipped name, a .gguf file or a transformers folder"
    )
    p.add_argument("--device", default="cpu", help="stage2: cpu or cuda")
    p.add_argument("--root", type=Path, default=ROOT, help="where the runs and stores live")
    p.add_argument("--curve", type=Path, default=CURVE, help="curve: the JSON file the points are merged into")
    p.add_argument("--prototypes", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--last", type=int, default=4, help="unfrozen blocks N (the boundary is block 30 − N)")
    p.add_argument("--alpha", type=float, default=1.0, help="loss.lambda_proto_kl")
    p.add_argument("--lr", type=float, default=3e-3, help="the bank's learning rate")
    p.add_argument("--block-lr", type=float, default=1e-4, help="the unfrozen blocks' learning rate")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--frozen-steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=4000, help="stage-2 steps")
    p.add_argument("--heldout-sequences", type=int, default=32)
    p.add_argument("--speed-steps", type=int, default=6)
    args = p.parse_args()
    {"stage2": stage2_main, "curve": curve_main, "speed": speed_main, "frozen": frozen_main}[args.stage](args)


if __name__ == "__main__":
    main()
