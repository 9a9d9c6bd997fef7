"""Log-likelihood scoring of (context, continuation) pairs, multiple-choice accuracy, text perplexity.

One tokenisation rule everywhere (our scorer, the ``lm-eval`` adapter, the controllers): the context and
the continuation are encoded *separately* and concatenated (an empty context becomes the end-of-text
token), then the sequence is cut from the left to the model's context window. The score of a
continuation is Σ log p(continuation token | everything before) under whatever the model's forward
returns — so a suppressed or controlled model (``with model.suppress(...)``) is scored as such.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.nn.functional as F

from prismlm.errors import DataError

if TYPE_CHECKING:
    from prismlm.data.tokenizer import Tokenizer
    from prismlm.eval.tasks import MCExample
    from prismlm.model import PrismLM


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str, block_size: int) -> tuple[list[int], int]:
    """→ (token ids of context+continuation cut to block_size + 1 from the left, continuation length)."""
    ctx = tokenizer.encode(context) if context else [tokenizer.eot_id]
    cont = tokenizer.encode(continuation)
    if not cont:
        raise DataError(f"continuation {continuation!r} encodes to no tokens")
    if len(cont) > block_size:
        raise DataError(f"continuation of {len(cont)} tokens does not fit the context window ({block_size})")
    full = (ctx + cont)[-(block_size + 1) :]
    return full, len(cont)


def text_batches(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    block_size: int,
    batch_size: int,
    *,
    max_tokens_per_text: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Texts → right-padded batches (x (B, T) int64, mask (B, T) bool); a text longer than block_size is
    split into windows of block_size tokens (each scored from its own start)."""
    windows: list[list[int]] = []
    for t in texts:
        ids = tokenizer.encode(t)
        if max_tokens_per_text:
            ids = ids[:max_tokens_per_text]
        for s in range(0, len(ids), block_size):
            if ids[s : s + block_size]:
                windows.append(ids[s : s + block_size])
    for b in range(0, len(windows), batch_size):
        chunk = windows[b : b + batch_size]
        T = max(len(w) for w in chunk)
        x = torch.full((len(chunk), T), tokenizer.eot_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.bool)
        for r, w in enumerate(chunk):
            x[r, : len(w)] = torch.tensor(w)
            mask[r, : len(w)] = True
        yield x, mask


@torch.no_grad()
def loglikelihoods(
    model: PrismLM, tokenizer: Tokenizer, requests: Sequence[tuple[str, str]], *, batch_size: int = 32
) -> list[tuple[float, bool]]:
    """For each (context, continuation): (Σ log p(continuation | context), whether it is the greedy
    continuation) — the ``lm-eval`` ``loglikelihood`` contract."""
    T = model.config.block_size
    enc = [encode_pair(tokenizer, c, x, T) for c, x in requests]
    dev = next(model.parameters()).device
    results: dict[int, tuple[float, bool]] = {}
    order = sorted(range(len(enc)), key=lambda i: -len(enc[i][0]))  # similar lengths together
    for b in range(0, len(order), batch_size):
        ids = order[b : b + batch_size]
        L = max(len(enc[i][0]) - 1 for i in ids)
        x = torch.full((len(ids), L), tokenizer.eot_id, dtype=torch.long)
        for r, i in enumerate(ids):
            full = enc[i][0]
            x[r, : len(full) - 1] = torch.tensor(full[:-1])
        logits = model(x.to(dev)).logits  # (B, L, V)
        for r, i in enumerate(ids):
            full, n = enc[i]
            pos = torch.arange(len(full) - 1 - n, len(full) - 1)
            tgt = torch.tensor(full[-n:])
            lp = F.log_softmax(logits[r, pos].double(), dim=-1).cpu()  # (n, V): only the scored positions
            results[i] = (float(lp[torch.arange(n), tgt].sum()), bool((lp.argmax(-1) == tgt).all()))
    return [results[i] for i in range(len(enc))]


class MCScores(TypedDict):
    """``MCResult.to_dict()``: the accuracies of a task split."""

    acc: float
    acc_norm: float
    n: int


@dataclass
class MCResult:
    acc: float
    acc_norm: float
    n: int
    predictions: list[int]
    loglikelihoods: list[list[float]]

    def to_dict(self) -> MCScores:
        return {"acc": self.acc, "acc_norm": self.acc_norm, "n": self.n}


def mc_accuracy(model: PrismLM, tokenizer: Tokenizer, docs: Sequence[MCExample], *, batch_size: int = 32) -> MCResult:
    """Accuracy of multiple-choice docs ``{"query", "choices", "gold"}`` as lm-eval computes it: ``acc``
    picks the choice with the highest log-likelihood, ``acc_norm`` divides it by the choice's length in
    characters (first maximum wins on ties, like ``numpy.argmax``)."""
    reqs = [(d["query"], ch) for d in docs for ch in d["choices"]]
    lls = [ll for ll, _ in loglikelihoods(model, tokenizer, reqs, batch_size=batch_size)]
    k = 0
    preds: list[int] = []
    per_doc: list[list[float]] = []
    correct = correct_n = 0
    for d in docs:
        ll = lls[k : k + len(d["choices"])]
        k += len(d["choices"])
        p = max(range(len(ll)), key=lambda j: (ll[j], -j))
        pn = max(range(len(ll)), key=lambda j: (ll[j] / len(d["choices"][j]), -j))
        preds.append(p)
        per_doc.append(ll)
        correct += p == d["gold"]
        correct_n += pn == d["gold"]
    n = len(docs)
    return MCResult(
        acc=correct / max(1, n), acc_norm=correct_n / max(1, n), n=n, predictions=preds, loglikelihoods=per_doc
    )


@torch.no_grad()
def text_perplexity(
    model: PrismLM,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
    max_tokens_per_text: int | None = None,
) -> dict[str, float]:
    """Token-level perplexity of ``texts`` (each window of block_size tokens scored from its start)."""
    dev = next(model.parameters()).device
    nll, n = 0.0, 0
    for x, mask in text_batches(
        tokenizer, texts, model.config.block_size, batch_size, max_tokens_per_text=max_tokens_per_text
    ):
        x, mask = x.to(dev), mask.to(dev)
        logits = model(x[:, :-1]).logits.double()
        m = mask[:, 1:]
        lp = F.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        nll -= float(lp[m].sum())
        n += int(m.sum())
    ce = nll / max(1, n)
    return {"ce": ce, "ppl": math.exp(min(ce, 50.0)), "tokens": n}
