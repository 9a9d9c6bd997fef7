#!/usr/bin/env python
"""Training throughput of PRISM vs the matched dense baseline (spec §1.6; paper: PRISM at 97.3% of dense).

What is measured
    Training tokens per second of a bare training step — forward with the PRISM loss weights (CE + REC +
    R1 + R2; CE only for dense), backward, global-norm clipping, AdamW step (``build_optimizer``, as the
    trainer does) — with no logging, evaluation or checkpointing. PRISM and dense share the backbone
    shape and the initial backbone weights (same seed), run in the same process on the same
    pre-loaded batches, one after the other:

        warm-up: W steps of each model, not timed
        round r: a block of S steps of PRISM and a block of S steps of dense, timed separately;
                 the order alternates per round (P,D / D,P / ...) so a slow drift in machine speed
                 (thermal, a neighbour's job) affects both equally.

    A step is ``train.grad_accum`` micro-batches of ``train.batch_size`` × ``block_size`` tokens (the
    benchmark sets grad_accum=1 unless overridden with ``--set``). On CUDA the device is synchronised
    around each block, bf16 autocast follows ``train.dtype`` as in the trainer.

How to read it
    ``ratio`` = median PRISM tokens/s ÷ median dense tokens/s (1.0: the prototype head is free; the
    paper reports 0.973). ``ratio_min``/``ratio_max`` are the extremes of the per-round ratios: if they
    straddle 1.0 the difference is within this machine's noise. Peak memory: on CPU, the peak RSS of
    the process during each model's blocks (both models' weights and optimizer states are resident,
    so the *difference* PRISM − dense is the meaningful part); on CUDA, ``torch.cuda.max_memory_allocated``
    during each model's blocks. On a shared CPU, timings are noisy: compare ratios, not absolute rates,
    and look at ``load_average_start``/``load_average_end`` in the JSON. If other jobs occupy the cores,
    ``--threads`` above the number of free cores makes every step 10–100× slower (OpenMP threads waiting
    on each other); the script warns when the load average suggests this.

Sizes (``--sizes``): ``tiny`` is the tiny preset widened to d=64 (2 layers, T=64, K=64, k=4, B=8);
``cpu-small`` (d=128, 4 layers, T=128, K=512, k=8, B=16); ``gpt2-124m`` (d=768, 12 layers, T=1024,
K=8192, B=16; for ``--device cuda``); any other preset name is accepted as-is.

GPU options: ``--dtype bfloat16`` (``train.dtype``: bf16 autocast; the default ``auto`` is bf16 on CUDA and
float32 on CPU), ``--compile`` (``torch.compile`` of the forward, as ``train.compile`` in the trainer; the
warm-up steps then include the compilation). Each size also reports MFU (model FLOPs utilisation):
``flops_per_token`` × tokens/s ÷ the device's peak dense bf16 FLOP/s, with ``flops_per_token`` = 6·N + 12·L·d·T
(PaLM's convention: N = the parameters that take part in matrix products — every unique parameter
but the position embedding, so the tied token embedding counts once as the output head and the prototype
bank counts for its similarity product; 12·L·d·T the attention scores and mixing, fwd + bwd, no causal
discount). The peak comes from ``--peak-tflops`` or else a small table keyed by the device name (``PEAK_BF16_TFLOPS``);
the JSON records which (``mfu.peak_source``); on CPU, with no flag, MFU is null.

Output: JSON at ``--out`` (default ``bench/results/throughput.json``) and one summary line on stdout.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from _common import RESULTS_DIR, environment, fmt_rate, load_average, parse_sets, warn_if_busy, write_json

from prismlm.config import PRESETS, RunConfig
from prismlm.eval.resources import current_peak_rss_mib, peak_rss_mib, reset_peak_rss
from prismlm.model import PrismLM
from prismlm.train.distributed import resolve_device
from prismlm.train.trainer import autocast_for, build_optimizer, round_vocab

PAPER_RATIO = 0.973

# name → (preset, overrides, default steps per timed block). grad_accum=1 everywhere: one micro-batch per
# optimizer step, so the AdamW step (which also updates the prototype bank) is in every timed step — the
# conservative comparison. Steps per block are chosen so a block lasts ~1–5 s on 2 CPU cores (tiny) or a
# GPU (gpt2-124m): much shorter blocks are dominated by timer and scheduler noise.
SIZES: dict[str, tuple[str, dict[str, Any], int]] = {
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


def flops_per_token(model: PrismLM) -> int:
    """Training FLOPs per token, 6·N + 12·L·d·T (see the module docstring)."""
    n = model.num_parameters()
    wpe = dict(model.named_parameters()).get("transformer.wpe.weight")
    if wpe is not None:
        n -= wpe.numel()
    cfg = model.config
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


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
    name: str, sets: dict[str, Any], device: str, args: argparse.Namespace | None = None
) -> tuple[RunConfig, dict[str, Any]]:
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


class BatchSource:
    """Pre-loads the batches both models train on (identical tensors, same order)."""

    _shards_cache: dict[str, Any] = {}

    def __init__(self, cfg: RunConfig, n_batches: int, device: torch.device, synthetic: bool, seed: int):
        T, B = cfg.model.block_size, cfg.train.batch_size
        rng = np.random.default_rng(seed)
        if synthetic:
            self.vocab = round_vocab(cfg.model.vocab_size)
            self.source = "synthetic (uniform random token ids)"
            arrays = [rng.integers(0, cfg.model.vocab_size, size=(B, T + 1), dtype=np.int64) for _ in range(n_batches)]
        else:
            from prismlm.data.shards import prepare_from_config

            key = repr(cfg.data)
            if key not in self._shards_cache:
                t0 = time.perf_counter()
                self._shards_cache[key] = prepare_from_config(cfg.data, show_progress=False)
                print(
                    f"[throughput] data {cfg.data.corpus}/{cfg.data.tokenizer} ready in "
                    f"{time.perf_counter() - t0:.1f}s",
                    file=sys.stderr,
                )
            shards = self._shards_cache[key]
            self.vocab = round_vocab(shards.tokenizer.vocab_size)
            n_seq = shards.train.num_sequences(T)
            if n_seq < B:
                raise SystemExit(f"the training split has {n_seq} sequences of {T}; need at least {B}")
            self.source = f"{cfg.data.corpus} train split, tokenizer {cfg.data.tokenizer}"
            arrays = [shards.train.sequences(rng.choice(n_seq, size=B, replace=False), T) for _ in range(n_batches)]
        self.batches = [torch.from_numpy(a).to(device) for a in arrays]
        self.i = 0

    def reset(self) -> None:
        self.i = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch[:, :-1], batch[:, 1:]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One model + optimizer and its bare training step."""

    def __init__(self, kind: str, cfg: RunConfig, device: torch.device, seed: int):
        self.kind, self.cfg, self.device = kind, cfg, device
        torch.manual_seed(seed)  # same seed → same backbone init (the bank is created last in PrismLM)
        self.model = PrismLM(cfg.model).to(device)
        self.model.train()
        self.optimizer = build_optimizer(self.model, cfg, device)
        self.fwd = torch.compile(self.model) if cfg.train.compile else self.model
        self.autocast = autocast_for(cfg, device)
        # Full (post-warm-up) loss weights: every PRISM term is in the graph, as in most of training.
        self.weights = cfg.loss.weights_at(cfg.train.max_steps)
        self.tok_s: list[float] = []
        self.peak_mem_mib = 0.0

    def step(self, data: BatchSource) -> None:
        tc = self.cfg.train
        for _ in range(tc.grad_accum):
            x, y = data.next()
            with self.autocast or nullcontext():
                out = self.fwd(x, y, loss_weights=self.weights)
            (out.loss / tc.grad_accum).backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def block(self, data: BatchSource, steps: int, timed: bool) -> float:
        """Run ``steps`` steps on the shared batches; returns tokens/s (and records it when timed)."""
        data.reset()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(data)
        sync(self.device)
        dt = time.perf_counter() - t0
        tc = self.cfg.train
        rate = steps * tc.grad_accum * tc.batch_size * self.cfg.model.block_size / dt
        mem = (
            torch.cuda.max_memory_allocated(self.device) / 2**20
            if self.device.type == "cuda"
            else current_peak_rss_mib()
        )
        self.peak_mem_mib = max(self.peak_mem_mib, mem)
        if timed:
            self.tok_s.append(rate)
        return rate


def bench_size(name: str, args: argparse.Namespace, sets: dict[str, Any], device: torch.device) -> dict[str, Any]:
    cfg, overrides = size_config(name, sets, str(device), args)
    steps = args.steps or (SIZES[name][2] if name in SIZES else DEFAULT_STEPS)
    n_batches = max(1, min(steps, 32)) * cfg.train.grad_accum
    data = BatchSource(cfg, n_batches, device, args.synthetic, args.seed)
    cfg = cfg.override({"model.vocab_size": data.vocab})
    dense_cfg = cfg.dense()
    prism = Runner("PRISM", cfg, device, args.seed)
    dense = Runner("dense", dense_cfg, device, args.seed)
    same_init = all(
        torch.equal(a, b)
        for a, b in zip(
            dense.model.state_dict().values(),
            [v for k, v in prism.model.state_dict().items() if not k.startswith("prototypes.")],
        )
    )
    m = prism.model
    p_total, p_backbone, d_total = m.num_parameters(), m.num_parameters(prototypes=False), dense.model.num_parameters()
    tok_per_step = cfg.train.grad_accum * cfg.train.batch_size * cfg.model.block_size
    print(
        f"[throughput] {name}: PRISM {p_total / 1e6:.2f}M params, dense {d_total / 1e6:.2f}M; "
        f"{tok_per_step} tokens/step; warm-up {args.warmup}, {args.rounds} rounds × {steps} steps",
        file=sys.stderr,
    )

    for r in (prism, dense):
        r.block(data, args.warmup, timed=False)
    rounds = []
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

    ratios = [x["ratio"] for x in rounds]
    med_p, med_d = statistics.median(prism.tok_s), statistics.median(dense.tok_s)
    peak, peak_source = peak_flops(device, args.peak_tflops)
    fpt_p, fpt_d = flops_per_token(prism.model), flops_per_token(dense.model)
    mfu = {
        "flops_per_token": {"prism": fpt_p, "dense": fpt_d},
        "formula": "6*N + 12*n_layer*n_embd*block_size; N = unique parameters minus the position embedding",
        "peak_flops": peak,
        "peak_source": peak_source,
        "prism": None if peak is None else fpt_p * med_p / peak,
        "dense": None if peak is None else fpt_d * med_d / peak,
        "achieved_tflops": {"prism": fpt_p * med_p / 1e12, "dense": fpt_d * med_d / 1e12},
    }
    result = {
        "size": name,
        "preset": SIZES[name][0] if name in SIZES else name,
        "overrides": overrides,
        "config": cfg.to_dict(),
        "dense_config_differs_only_in": "model.prototypes = null",
        "data": data.source,
        "loss_weights": prism.weights,
        "autocast": None if prism.autocast is None else str(prism.autocast.fast_dtype),
        "compile": cfg.train.compile,
        "mfu": mfu,
        "step_s_median": {"prism": tok_per_step / med_p, "dense": tok_per_step / med_d},
        "parameters": {
            "prism": p_total,
            "dense": d_total,
            "prism_backbone": p_backbone,
            "prototype_bank": p_total - p_backbone,
            "overhead_pct": 100.0 * (p_total - d_total) / d_total,
        },
        "same_backbone_init": same_init,
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
    if device.type == "cuda":
        result["peak_memory_mib"]["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device) / 2**20
    del prism, dense, data
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
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
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override applied to every size and both models, e.g. --set train.batch_size=32 "
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
    parts = [
        f"{r['size']} ratio {r['ratio']:.2f} [{r['ratio_min']:.2f}–{r['ratio_max']:.2f}] "
        f"(PRISM {fmt_rate(r['prism_tok_s']['median'])} tok/s, dense {fmt_rate(r['dense_tok_s']['median'])})"
        + (
            f" MFU PRISM {100 * r['mfu']['prism']:.1f}% dense {100 * r['mfu']['dense']:.1f}%"
            if r["mfu"]["prism"] is not None
            else ""
        )
        for r in results
    ]
    print(f"[throughput] wrote {out}", file=sys.stderr)
    print("throughput: " + " | ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
