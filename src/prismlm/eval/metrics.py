"""Validation metrics: loss/perplexity and the PRISM coverage metrics (spec §2).

Coverage, over a sample of tokens:
- ``r1_bar`` = mean_i max_t cos(p_i, z_t): does each prototype sit on real data?
- ``r2``     = mean_t max_i cos(z_t, p_i): is each token covered by some prototype?
- ``dead_prototypes``: prototypes never active (a > 0 in any top-k) over the sample of ``coverage_tokens``
  tokens — the one rule of every dead count (training, retrofit, ``prism eval``, ``prism index``), always
  said with its token count (``dead_text``): on a small sample most prototypes are "dead" by chance;
- ``residual_share`` = mean_t ‖r_t‖ / ‖z_t‖: how much of each hidden state the prototypes leave out.
All accumulate across batches in O(K) memory, so the sample can be as large as wanted.

``evaluate`` adds the faithfulness metrics of ``prismlm.eval.faithfulness`` (top-1 agreement, KL, margin share
of the prototype-only prediction and of its two yardsticks, the slices' logit share, the centred residual share);
their mean μ and PCA subspace are fitted on the first validation batch and then fixed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from prismlm.errors import DataError, ModelError
from prismlm.eval.faithfulness import FaithfulnessAccumulator
from prismlm.model import PrismLM, PrismOutput, eval_mode

if TYPE_CHECKING:
    from prismlm.data.shards import TokenShard


def active_prototypes(out: PrismOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, activations) of every (token, prototype) pair with a > 0 in ``out`` — flat (n_active,) each."""
    if out.activations is None or out.indices is None:
        raise ModelError("active prototypes need a PRISM forward output (the dense baseline has no prototypes)")
    act = out.activations.detach().reshape(-1)
    ids = out.indices.reshape(-1)
    on = act > 0
    return ids[on], act[on]


def coverage_sums(out: PrismOutput) -> tuple[float, float, int]:
    """Per-batch sums that coverage metrics average over tokens, in float64 so streamed sums do not drift:
    (Σ_t max_i cos(z_t, p_i), Σ_t ‖r_t‖/‖z_t‖, number of tokens)."""
    if out.token_max_cos is None or out.residual is None:
        raise ModelError("coverage needs a PRISM forward output (the dense baseline has no prototypes)")
    token_cos = float(out.token_max_cos.detach().double().sum())
    ratio = out.residual.detach().double().norm(dim=-1) / out.hidden.detach().double().norm(dim=-1).clamp_min(1e-8)
    return token_cos, float(ratio.sum()), out.token_max_cos.numel()


def coverage_metrics(
    proto_max: torch.Tensor, counts: torch.Tensor, token_cos_sum: float, residual_share_sum: float, tokens: int
) -> dict[str, float]:
    """R̄1, R2, dead prototypes and residual share from streamed statistics (definitions above)."""
    if tokens == 0:
        return {}
    dead = int((counts == 0).sum())
    return {
        "r1_bar": float(proto_max.double().mean()),
        "r2": token_cos_sum / tokens,
        "dead_prototypes": dead,
        "dead_fraction": dead / counts.numel(),
        "residual_share": residual_share_sum / tokens,
        "coverage_tokens": tokens,
    }


DEAD_MIN_ACTIVATIONS = 8
"""A dead count is meaningful once the sample holds at least this many active slots per prototype on average
(tokens × top_k ≥ 8 K): fewer, and prototypes go unseen by chance."""


def dead_text(metrics: dict[str, float], top_k: int | None = None) -> str:
    """``dead 3 of 512 on 65,536 tokens``: a dead count with what it was counted on — and, with ``top_k``, a
    warning when the sample is too small for it to mean anything (``DEAD_MIN_ACTIVATIONS``)."""
    dead, frac, n = metrics["dead_prototypes"], metrics["dead_fraction"], int(metrics.get("coverage_tokens", 0))
    K = round(dead / frac) if frac else None
    out = f"dead {int(dead)}" + (f" of {K}" if K else "") + f" on {n:,} tokens"
    if top_k and K and n * top_k < DEAD_MIN_ACTIVATIONS * K:
        out += f" (too few tokens to tell: {-(-DEAD_MIN_ACTIVATIONS * K // top_k):,} needed; `prism index` counts on the training tokens)"
    return out


@dataclass
class CoverageAccumulator:
    """Streams PrismOutputs and reduces them to coverage metrics."""

    num_prototypes: int
    proto_max: torch.Tensor | None = None  # (K,) running max_t cos(p_i, z_t)
    counts: torch.Tensor | None = None  # (K,) number of tokens where prototype i is active
    token_cos_sum: float = 0.0
    residual_share_sum: float = 0.0
    tokens: int = 0

    def update(self, out: PrismOutput) -> None:
        assert out.proto_max_cos is not None and out.indices is not None
        pm = out.proto_max_cos.detach().float()
        self.proto_max = pm if self.proto_max is None else torch.maximum(self.proto_max, pm)
        ids, _ = active_prototypes(out)
        c = torch.bincount(ids, minlength=self.num_prototypes).cpu()
        self.counts = c if self.counts is None else self.counts + c
        token_cos, residual, n = coverage_sums(out)
        self.token_cos_sum += token_cos
        self.residual_share_sum += residual
        self.tokens += n

    def result(self) -> dict[str, float]:
        if self.proto_max is None or self.counts is None:
            return {}
        return coverage_metrics(self.proto_max, self.counts, self.token_cos_sum, self.residual_share_sum, self.tokens)


def eval_sequence_ids(num_sequences: int, max_sequences: int) -> np.ndarray:
    """A fixed, evenly spread set of validation sequence ids (identical for every run on the shard)."""
    n = min(num_sequences, max_sequences)
    return np.unique(np.linspace(0, num_sequences - 1, n).round().astype(np.int64))


@torch.no_grad()
def evaluate(
    model: PrismLM,
    shard: TokenShard,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    device: torch.device | str = "cpu",
    autocast: torch.autocast | None = None,
    loss_weights: dict[str, float] | None = None,
) -> dict[str, float]:
    """Validation loss, perplexity and (for PRISM) coverage and faithfulness on a fixed sample of ``shard``'s
    sequences (faithfulness: ``FaithfulnessAccumulator``, its yardsticks fitted on the first batch)."""
    with eval_mode(model):
        n_seq = shard.num_sequences(seq_len)
        if n_seq < 1:
            raise DataError(
                f"the validation split has fewer than {seq_len + 1} tokens; use more data or a smaller block_size"
            )
        ids = eval_sequence_ids(n_seq, batch_size * max_batches)
        cov = CoverageAccumulator(model.prototypes.num_prototypes) if model.prototypes is not None else None
        faith = FaithfulnessAccumulator() if model.prototypes is not None else None
        sums: dict[str, float] = {}
        n_tokens = 0
        for start in range(0, len(ids), batch_size):
            batch = torch.from_numpy(shard.sequences(ids[start : start + batch_size], seq_len)).to(device)
            x, y = batch[:, :-1], batch[:, 1:]
            with autocast or nullcontext():
                out = model(x, y, loss_weights=loss_weights)
            ntok = y.numel()
            n_tokens += ntok
            for name, value in out.losses.items():
                sums[name] = sums.get(name, 0.0) + float(value) * ntok
            if cov is not None and faith is not None:
                cov.update(out)
                faith.update(model, out)
    metrics = {f"val_{k}": v / n_tokens for k, v in sums.items()}
    metrics["val_loss"] = metrics["val_ce"]
    metrics["val_ppl"] = math.exp(min(metrics["val_ce"], 50.0))
    metrics["val_tokens"] = n_tokens
    if cov is not None and faith is not None:
        metrics.update(cov.result())
        metrics.update(faith.result())
    return metrics


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n of generations (Li et al. 2016): distinct whitespace n-grams / all n-grams, pooled over
    ``texts`` (0 when there is none). A drop means repetitive text."""
    grams: set[tuple[str, ...]] = set()
    total = 0
    for t in texts:
        w = t.split()
        g = [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]
        grams.update(g)
        total += len(g)
    return len(grams) / max(1, total)
