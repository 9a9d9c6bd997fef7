#!/usr/bin/env python
"""Training throughput of PRISM vs the matched dense baseline (spec §1.6; paper: PRISM at 97.3% of dense).

Training tokens/s of a bare step (``prismlm.train.step_timing``: forward with the PRISM loss weights, backward,
clipping, AdamW; no logging, evaluation or checkpointing) of PRISM and of its dense twin — same backbone shape
and initial weights, same process, same pre-loaded batches — in timed blocks whose order alternates per round
(P,D / D,P / …) after untimed warm-up steps. ``ratio`` = median PRISM tokens/s ÷ median dense; the per-round
extremes show the noise. Also peak memory per model, MFU (``flops_per_token`` × tokens/s ÷ the device's peak
dense bf16 FLOP/s: ``--peak-tflops`` or ``PEAK_BF16_TFLOPS``; null on CPU without the flag).

Run: ``PYTHONPATH=src python bench/throughput.py [--sizes tiny cpu-small] [--device cuda] [--threads 1]``.
Writes ``bench/results/throughput.json`` and one summary line; docs/results.md has the measurements and how to
read them (compare ratios, not absolute rates, on a shared CPU).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch
from _common import (
    RESULTS_DIR,
    Json,
    add_set_option,
    environment,
    fmt_rate,
    load_average,
    num,
    obj,
    parse_sets,
    warn_if_busy,
    write_json,
)

from prismlm.config import PRESETS, RunConfig
from prismlm.eval.resources import peak_rss_mib
from prismlm.train.distributed import resolve_device
from prismlm.train.step_timing import BatchSource, Runner, flops_per_token

PAPER_RATIO = 0.973

# name → (preset, overrides, default steps per timed block). grad_accum=1 everywhere: one micro-batch per
# optimizer step, so the AdamW step (which also updates the prototype bank) is in every timed step — the
# conservative comparison. Steps per block are chosen so a block lasts ~1–5 s on 2 CPU cores (tiny) or a
# GPU (gpt2-124m): much shorter blocks are dominated by timer and scheduler noise.
SIZES: dict[str, tuple[str, dict[str, object], int]] = {
    "tiny": ("tiny", {"model.n_embd": 64, "train.grad_accum": 1}, 100),
    "cpu-small": ("cpu-small", {"train.grad_accum": 1}, 10),
    "gpt2-124m": ("gpt2-124m", {"train.grad_accum": 1}, 10),
}
DEFAULT_STEPS = 10

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOP/s, of the SXM/OAM parts (vendor data sheets); the
# first key contained in torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "GH200": 989.0,
    "H800": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
}


def peak_flops(device: torch.device, flag_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from)."""
    if flag_tflops is not None:
        return flag_tflops * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, "none (CPU: pass --peak-tflops for an MFU)"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12, f"table PEAK_BF16_TFLOPS[{key!r}] (device {name!r}, dense bf16)"
    return None, f"unknown device {name!r}: pass --peak-tflops"


def size_config(
    name: str, sets: dict[str, object], device: str, args: argparse.Namespace | None = None
) -> tuple[RunConfig, dict[str, object]]:
    if name in SIZES:
        preset, overrides, _ = SIZES[name]
    elif name in PRESETS:
        preset, overrides = name, {"train.grad_accum": 1}
    else:
        raise SystemExit(f"unknown size {name!r}; choose from {sorted(set(SIZES) | set(PRESETS))}")
    overrides = {**overrides, **sets, "train.device": device}
    if args is not None and args.compile:
        overrides["train.compile"] = True
    if args is not None and args.dtype is not None:
        overrides["train.dtype"] = args.dtype
    cfg = RunConfig.from_name(preset).override(overrides)
    if cfg.model.prototypes is None:
        raise SystemExit(f"size {name!r} has no prototype head; nothing to compare")
    return cfg, overrides


def timed_rounds(
    name: str, args: argparse.Namespace, prism: Runner, dense: Runner, data: BatchSource, steps: int
) -> list[Json]:
    """Warm-up, then ``--rounds`` rounds of one block per model, the order alternating."""
    for r in (prism, dense):
        r.block(data, args.warmup, timed=False)
    rounds: list[Json] = []
    for i in range(args.rounds):
        order = (prism, dense) if i % 2 == 0 else (dense, prism)
        for r in order:
            r.block(data, steps, timed=True)
        ratio = prism.tok_s[-1] / dense.tok_s[-1]
        rounds.append(
            {
                "order": [r.kind for r in order],
                "prism_tok_s": prism.tok_s[-1],
                "dense_tok_s": dense.tok_s[-1],
                "ratio": ratio,
            }
        )
        print(
            f"[throughput] {name} round {i + 1}/{args.rounds} ({order[0].kind} first): PRISM "
            f"{fmt_rate(prism.tok_s[-1])} tok/s, dense {fmt_rate(dense.tok_s[-1])} tok/s, ratio {ratio:.3f}",
            file=sys.stderr,
        )
    return rounds


def mfu(prism: Runner, dense: Runner, device: torch.device, peak_tflops: float | None) -> Json:
    """Model FLOPs utilisation of both models at their median tokens/s."""
    med_p, med_d = statistics.median(prism.tok_s), statistics.median(dense.tok_s)
    peak, peak_source = peak_flops(device, peak_tflops)
    fpt_p, fpt_d = flops_per_token(prism.model), flops_per_token(dense.model)
    return {
        "flops_per_token": {"prism": fpt_p, "dense": fpt_d},
        "formula": "6*N + 12*n_layer*n_embd*block_size; N = unique parameters minus the position embedding",
        "peak_flops": peak,
        "peak_source": peak_source,
        "prism": None if peak is None else fpt_p * med_p / peak,
        "dense": None if peak is None else fpt_d * med_d / peak,
        "achieved_tflops": {"prism": fpt_p * med_p / 1e12, "dense": fpt_d * med_d / 1e12},
    }


def size_record(
    name: str,
    cfg: RunConfig,
    overrides: dict[str, object],
    runners: tuple[Runner, Runner],
    data: BatchSource,
    rounds: list[Json],
    mfu_: Json,
    same_init: bool,
    steps: int,
    args: argparse.Namespace,
    device: torch.device,
) -> Json:
    prism, dense = runners
    m = prism.model
    p_total, p_backbone, d_total = m.num_parameters(), m.num_parameters(prototypes=False), dense.model.num_parameters()
    tok_per_step = cfg.train.grad_accum * cfg.train.batch_size * cfg.model.block_size
    ratios = [num(x, "ratio") for x in rounds]
    med_p, med_d = statistics.median(prism.tok_s), statistics.median(dense.tok_s)
    return {
        "size": name,
        "preset": SIZES[name][0] if name in SIZES else name,
        "overrides": overrides,
        "config": cfg.to_dict(),
        "dense_config_differs_only_in": "model.prototypes = null",
        "data": data.source,
        "loss_weights": prism.weights,
        "autocast": None if prism.autocast is None else str(prism.autocast.fast_dtype),
        "compile": cfg.train.compile,
        "mfu": mfu_,
        "step_s_median": {"prism": tok_per_step / med_p, "dense": tok_per_step / med_d},
        "parameters": {
            "prism": p_total,
            "dense": d_total,
            "prism_backbone": p_backbone,
            "prototype_bank": p_total - p_backbone,
            "overhead_pct": 100.0 * (p_total - d_total) / d_total,
        },
        "same_backbone_init": same_init,  # before any step
        "tokens_per_step": tok_per_step,
        "warmup_steps": args.warmup,
        "steps_per_block": steps,
        "rounds": rounds,
        "prism_tok_s": {"median": med_p, "min": min(prism.tok_s), "max": max(prism.tok_s)},
        "dense_tok_s": {"median": med_d, "min": min(dense.tok_s), "max": max(dense.tok_s)},
        "ratio": med_p / med_d,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_median_of_rounds": statistics.median(ratios),
        "peak_memory_mib": {
            "kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS during the blocks",
            "prism": prism.peak_mem_mib,
            "dense": dense.peak_mem_mib,
        },
    }


def bench_size(name: str, args: argparse.Namespace, sets: dict[str, object], device: torch.device) -> Json:
    cfg, overrides = size_config(name, sets, str(device), args)
    steps = args.steps or (SIZES[name][2] if name in SIZES else DEFAULT_STEPS)
    n_batches = max(1, min(steps, 32)) * cfg.train.grad_accum
    data = BatchSource(cfg, n_batches, device, args.synthetic, args.seed)
    cfg = cfg.override({"model.vocab_size": data.vocab})
    prism = Runner("PRISM", cfg, device, args.seed)
    dense = Runner("dense", cfg.dense(), device, args.seed)
    m = prism.model
    print(
        f"[throughput] {name}: PRISM {m.num_parameters() / 1e6:.2f}M params, dense "
        f"{dense.model.num_parameters() / 1e6:.2f}M; "
        f"{cfg.train.grad_accum * cfg.train.batch_size * cfg.model.block_size} tokens/step; warm-up "
        f"{args.warmup}, {args.rounds} rounds × {steps} steps",
        file=sys.stderr,
    )
    same_init = all(
        torch.equal(a, b)
        for a, b in zip(
            dense.model.state_dict().values(),
            [v for k, v in prism.model.state_dict().items() if not k.startswith("prototypes.")],
        )
    )
    rounds = timed_rounds(name, args, prism, dense, data, steps)
    result = size_record(
        name,
        cfg,
        overrides,
        (prism, dense),
        data,
        rounds,
        mfu(prism, dense, device, args.peak_tflops),
        same_init,
        steps,
        args,
        device,
    )
    if device.type == "cuda":
        obj(result, "peak_memory_mib")["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device) / 2**20
    del prism, dense, data
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Training tokens/s of PRISM vs the matched dense baseline (same backbone, same process, "
        "same batches, interleaved rounds). Writes JSON and prints one summary line.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--sizes",
        nargs="+",
        default=["tiny", "cpu-small"],
        help=f"model sizes to measure: {', '.join(SIZES)} (tiny = the tiny preset at d=64), or any preset name",
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds; each runs one PRISM and one dense block")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per timed block (default: per size — "
        + ", ".join(f"{k} {v[2]}" for k, v in SIZES.items())
        + f", others {DEFAULT_STEPS})",
    )
    ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per model before the rounds")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (fixed for the whole run)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, or auto")
    ap.add_argument(
        "--seed", type=int, default=1337, help="seed of the initialisation of both models and of the batches"
    )
    ap.add_argument(
        "--synthetic",
        action="store_true",
        help="random token ids instead of the built-in corpus (skips tokenizer/shard preparation)",
    )
    add_set_option(
        ap,
        "config override applied to every size and both models, e.g. --set train.batch_size=32 "
        "--set model.prototypes.num_prototypes=1024 (values parsed as JSON); repeatable",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the forward of both models (train.compile); compilation falls in the warm-up",
    )
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help="train.dtype: bfloat16 = bf16 autocast (default: the preset's, auto = bf16 on CUDA only)",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak dense bf16 TFLOP/s for MFU (default: looked up by CUDA device name; none on CPU)",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "throughput.json"), help="where to write the JSON results")
    args = ap.parse_args(argv)
    if args.rounds < 1 or (args.steps is not None and args.steps < 1) or args.warmup < 0 or args.threads < 1:
        ap.error("--rounds, --steps and --threads must be >= 1, --warmup >= 0")
    return args


def summary_part(r: Json) -> str:
    m = obj(r, "mfu")
    return (
        f"{r['size']} ratio {num(r, 'ratio'):.2f} [{num(r, 'ratio_min'):.2f}–{num(r, 'ratio_max'):.2f}] "
        f"(PRISM {fmt_rate(num(r, 'prism_tok_s', 'median'))} tok/s, dense {fmt_rate(num(r, 'dense_tok_s', 'median'))})"
        + (
            f" MFU PRISM {100 * num(m, 'prism'):.1f}% dense {100 * num(m, 'dense'):.1f}%"
            if m["prism"] is not None
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cpu":
        warn_if_busy(args.threads)
    sets = parse_sets(args.sets)
    env = environment(device, args.seed)
    results = [bench_size(name, args, sets, device) for name in args.sizes]
    payload = {
        "benchmark": "throughput",
        "what": "training tokens/s of PRISM and the matched dense baseline; ratio = median PRISM / median dense",
        "paper_ratio": PAPER_RATIO,
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "environment": env,
        "load_average_end": load_average(),
        "process_peak_rss_mib": peak_rss_mib(),
        "sizes": results,
    }
    out = write_json(args.out, payload)
    print(f"[throughput] wrote {out}", file=sys.stderr)
    print("throughput: " + " | ".join(summary_part(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
