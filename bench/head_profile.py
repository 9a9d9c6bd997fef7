#!/usr/bin/env python
"""What the PRISM prototype head costs inside a training step (forward + backward), and its peak memory.

For each shape (``--shapes``: ``cpu-small``; ``gpt2-124m`` at d=768, K=8192 with 2 layers and B×T = 2×256;
``k16k-small``: cpu-small with K=16,384) a PRISM model and its dense twin (same seed and backbone init) on
synthetic batches, timed interleaved over ``--rounds``: a PRISM step (forward with the full loss weights +
backward), a dense step, and the prototype layer alone on the backbone's hidden states (forward with REC/R1/R2,
backward). No optimizer step. ``head_share`` = head ÷ PRISM step; ``prism_over_dense`` = PRISM step ÷ dense
step − 1; peak memory: the rise of the peak RSS over one head forward + backward (its transient working set).

Run: ``PYTHONPATH=src python bench/head_profile.py [--shapes cpu-small]``. Writes
``bench/results/head_profile.json`` and one summary line; compare ratios on a shared CPU (the head's share at
12 layers is smaller than at 2). The measurements: docs/results.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import RESULTS_DIR, Json, environment, load_average, num, warn_if_busy, write_json

from prismlm.config import RunConfig
from prismlm.eval.resources import current_peak_rss_mib, reset_peak_rss
from prismlm.model import PrismLM
from prismlm.model import losses as L
from prismlm.model.prototypes import PrototypeLayer
from prismlm.train.state import round_vocab

# name → (preset, overrides, default repetitions per timed quantity per round)
SHAPES: dict[str, tuple[str, dict[str, object], int]] = {
    "cpu-small": ("cpu-small", {}, 5),
    "gpt2-124m": ("gpt2-124m", {"model.n_layer": 2, "model.block_size": 256, "train.batch_size": 2}, 2),
    "k16k-small": ("cpu-small", {"model.prototypes.num_prototypes": 16384}, 3),
}


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def trim() -> None:
    """Return freed heap pages to the OS (glibc), so that the next peak-RSS rise is the head's working set
    rather than hidden by pages the allocator kept from earlier steps."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def timed(fn: Callable[[], object], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


@dataclass
class Shape:
    """One shape's PRISM and dense models, a synthetic batch, and the timed operations."""

    cfg: RunConfig
    idx: torch.Tensor
    tgt: torch.Tensor
    prism: PrismLM
    dense: PrismLM
    head: PrototypeLayer
    z0: torch.Tensor
    weights: dict[str, float]
    holder: dict[str, torch.Tensor] = field(default_factory=dict)

    def step(self, model: PrismLM) -> None:
        out = model(self.idx, self.tgt, loss_weights=self.weights)
        assert out.loss is not None
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    def head_fwd(self) -> None:
        z = self.z0.detach().requires_grad_(True)
        po = self.head(z)
        w = self.weights
        loss = (
            w["rec"] * L.reconstruction_loss(po.residual, z)
            + w["r1"] * L.r1_loss(po.proto_max_cos)
            + w["r2"] * L.r2_loss(po.token_max_cos)
        )
        self.holder["loss"] = loss

    def head_bwd(self) -> None:
        self.holder.pop("loss").backward()
        self.head.zero_grad(set_to_none=True)

    def head_both(self) -> None:
        self.head_fwd()
        self.head_bwd()


def build(name: str, seed: int) -> Shape:
    preset, overrides, _ = SHAPES[name]
    cfg = RunConfig.from_name(preset).override({**overrides, "train.device": "cpu"})
    cfg = cfg.override({"model.vocab_size": round_vocab(cfg.model.vocab_size)})
    assert cfg.model.prototypes is not None
    B, T = cfg.train.batch_size, cfg.model.block_size
    weights = cfg.loss.weights_at(cfg.train.max_steps)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g)
    idx, tgt = x[:, :-1], x[:, 1:]
    torch.manual_seed(seed)
    prism = PrismLM(cfg.model).train()
    torch.manual_seed(seed)
    dense = PrismLM(cfg.dense().model).train()
    head = prism.prototypes
    assert head is not None
    with torch.no_grad():
        z0 = prism.backbone(idx).reshape(B * T, -1).clone()  # (N, d) real hidden states of this init
    return Shape(cfg, idx, tgt, prism, dense, head, z0, weights)


def time_rounds(s: Shape, rounds: int, reps: int) -> dict[str, list[float]]:
    """Per round: the mean of ``reps`` PRISM and dense steps (order alternating), head forward and backward."""
    for _ in range(2):  # warm-up
        s.step(s.prism)
        s.step(s.dense)
        s.head_both()
    samples: dict[str, list[float]] = {"step_prism_s": [], "step_dense_s": [], "head_fwd_s": [], "head_bwd_s": []}
    for r in range(rounds):
        order = [("step_prism_s", lambda: s.step(s.prism)), ("step_dense_s", lambda: s.step(s.dense))]
        for key, fn in order if r % 2 == 0 else order[::-1]:
            gc.collect()
            samples[key].append(timed(fn, reps))
        fwd = bwd = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            s.head_fwd()
            t1 = time.perf_counter()
            s.head_bwd()
            t2 = time.perf_counter()
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
        samples["head_fwd_s"].append(fwd / reps)
        samples["head_bwd_s"].append(bwd / reps)
    return samples


def bench_shape(name: str, args: argparse.Namespace) -> Json:
    preset, overrides, default_reps = SHAPES[name]
    reps = args.steps or default_reps
    s = build(name, args.seed)
    samples = time_rounds(s, args.rounds, reps)
    med = {k: statistics.median(v) for k, v in samples.items()}
    gc.collect()
    trim()
    before = rss_mib()
    reset_ok = reset_peak_rss()
    s.head_both()
    peak = current_peak_rss_mib()
    head_total = med["head_fwd_s"] + med["head_bwd_s"]
    head, B, T = s.head, s.cfg.train.batch_size, s.cfg.model.block_size
    K, k, d = head.num_prototypes, head.cfg.top_k, head.weight.shape[1]
    res: Json = {
        "shape": name,
        "preset": preset,
        "overrides": overrides,
        "N": B * T,
        "B": B,
        "T": T,
        "d": d,
        "K": K,
        "k": k,
        "chunk_size": head.chunk_size_for(B * T, torch.device("cpu")),
        "n_layer": s.cfg.model.n_layer,
        "vocab_size": s.cfg.model.vocab_size,
        "reps": reps,
        "rounds": args.rounds,
        **{k_: round(v, 6) for k_, v in med.items()},
        "head_s": round(head_total, 6),
        "head_share": round(head_total / med["step_prism_s"], 4),
        "prism_over_dense": round(med["step_prism_s"] / med["step_dense_s"] - 1.0, 4),
        "head_peak_mem_mib": round(peak - before, 1) if reset_ok else None,
        "samples": {k_: [round(x, 6) for x in v] for k_, v in samples.items()},
    }
    print(
        f"[head_profile] {name}: N={B * T} d={d} K={K} k={k}: step PRISM {med['step_prism_s'] * 1e3:.1f} ms, "
        f"dense {med['step_dense_s'] * 1e3:.1f} ms, head fwd {med['head_fwd_s'] * 1e3:.2f} + bwd "
        f"{med['head_bwd_s'] * 1e3:.2f} ms = {num(res, 'head_share'):.1%} of the step; peak "
        f"+{res['head_peak_mem_mib']} MiB",
        file=sys.stderr,
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds")
    ap.add_argument("--steps", type=int, default=None, help="repetitions per quantity per round (default per shape)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", default=str(RESULTS_DIR / "head_profile.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    env = environment("cpu", args.seed)
    results = [bench_shape(s, args) for s in args.shapes]
    env["load_average_end"] = load_average()
    write_json(args.out, {"environment": env, "args": vars(args), "results": results})
    print(
        "head_profile: "
        + "; ".join(
            f"{r['shape']} head {num(r, 'head_s') * 1e3:.1f} ms = {num(r, 'head_share'):.1%} of step "
            f"(PRISM/dense −1 = {num(r, 'prism_over_dense'):+.1%}), peak +{r['head_peak_mem_mib']} MiB"
            for r in results
        )
    )


if __name__ == "__main__":
    main()
