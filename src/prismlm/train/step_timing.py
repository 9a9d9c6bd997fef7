"""A bare training step, timed: what the throughput benches compare between a PRISM model and its dense
twin.

``BatchSource`` pre-loads the batches both models train on (identical tensors, same order; the built-in corpus
or random ids). ``Runner`` holds one model and its optimizer and runs blocks of bare steps — forward with the
loss weights of late training, backward, global-norm clipping, AdamW (``build_optimizer``, as the trainer) — with
no logging, evaluation or checkpointing, recording tokens/s and the peak memory of each block (CUDA allocator,
or the process's peak RSS on CPU). ``flops_per_token`` is PaLM's 6·N + 12·L·d·T.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext

import numpy as np
import torch

from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, prepare_from_config
from prismlm.errors import DataError
from prismlm.eval.resources import current_peak_rss_mib, reset_peak_rss
from prismlm.model import PrismLM
from prismlm.train.state import autocast_for, build_optimizer, round_vocab


def flops_per_token(model: PrismLM) -> int:
    """Training FLOPs per token, 6·N + 12·L·d·T (PaLM's convention: N = the parameters that take part in
    matrix products — every unique parameter but the position embedding, so the tied token embedding counts
    once as the output head and the prototype bank for its similarity product; 12·L·d·T the attention scores
    and mixing, forward and backward, no causal discount)."""
    n = model.num_parameters()
    wpe = dict(model.named_parameters()).get("transformer.wpe.weight")
    if wpe is not None:
        n -= wpe.numel()
    cfg = model.config
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


class BatchSource:
    """Pre-loads the batches both models train on (identical tensors, same order)."""

    _shards_cache: dict[str, ShardSet] = {}

    def __init__(self, cfg: RunConfig, n_batches: int, device: torch.device, synthetic: bool, seed: int) -> None:
        T, B = cfg.model.block_size, cfg.train.batch_size
        rng = np.random.default_rng(seed)
        if synthetic:
            self.vocab = round_vocab(cfg.model.vocab_size)
            self.source = "synthetic (uniform random token ids)"
            arrays = [rng.integers(0, cfg.model.vocab_size, size=(B, T + 1), dtype=np.int64) for _ in range(n_batches)]
        else:
            key = repr(cfg.data)
            if key not in self._shards_cache:  # prepared once per data config in a process
                self._shards_cache[key] = prepare_from_config(cfg.data, show_progress=False)
            shards = self._shards_cache[key]
            self.vocab = round_vocab(shards.tokenizer.vocab_size)
            n_seq = shards.train.num_sequences(T)
            if n_seq < B:
                raise DataError(f"the training split has {n_seq} sequences of {T}; need at least {B}")
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

    def __init__(self, kind: str, cfg: RunConfig, device: torch.device, seed: int) -> None:
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
