"""Controllers fitted at the scale of a real vocabulary (V ≈ 49k, d ≈ 576), where ``fit_controller``'s full-batch
fit costs N·V·d per step:

* features with the query's keys/values computed once per example and the choices run as one batch on top of
  them (``extract_shared_prefix``; ``forward_scores`` is the model's own forward, the reference);
* one full-vocabulary pass at c = 0 (``base_pass``: log p(target), the log-partition, the top tokens);
* the fit on a vocabulary-restricted surrogate of the log-softmax (``build_surrogate``): the logits of the
  targets ∪ the ``surrogate_vocab`` tokens with the most base probability mass, the rest of the partition
  frozen at its base value (exact at c = 0); the change of those logits is Σ c_i a_i (W_S d_i), a sparse
  (N × K) by dense (K × |S|) product. λ is chosen on validation (``fit_surrogate_controller``); accuracies
  are reported with the exact full-vocabulary scores (``exact_scores``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from prismlm.control.controller import (
    ControlFeatures,
    Controller,
    ControllerHistory,
    Encoder,
    accuracy,
    proximal_adam,
)
from prismlm.errors import ConfigError
from prismlm.eval.tasks import MCExample

if TYPE_CHECKING:
    from prismlm.data.tokenizer import Tokenizer
    from prismlm.model import PrismLM


@torch.no_grad()
def extract_shared_prefix(model: PrismLM, tokenizer: Tokenizer, docs: Sequence[MCExample]) -> ControlFeatures:
    """``ControlFeatures`` (code fields empty) of every (query, choice) pair: the query's keys/values once,
    then the C choices as one right-padded batch on the cache repeated C times. The query is cut from the
    left so that the longest choice fits the window (block_size + 1 tokens with the last target)."""
    T, eot = model.config.block_size, tokenizer.eot_id
    Z: list[torch.Tensor] = []
    Y: list[torch.Tensor] = []
    R: list[torch.Tensor] = []
    doc_of: list[int] = []
    clen: list[int] = []
    n_choices: list[int] = []
    texts: list[str] = []
    for di, d in enumerate(docs):
        conts = [tokenizer.encode(ch) for ch in d["choices"]]
        ctx = (tokenizer.encode(d["query"]) or [eot])[-(T + 1 - max(map(len, conts))) :]
        C, L = len(conts), max(map(len, conts))
        cache = None
        if len(ctx) > 1:
            cache = model.new_cache()
            model.backbone(torch.tensor([ctx[:-1]]), cache)
            cache.batch_repeat_interleave(C)
        x = torch.full((C, L), eot, dtype=torch.long)
        for r, c in enumerate(conts):
            x[r, : len(c)] = torch.tensor([ctx[-1], *c[:-1]])
        z = model.backbone(x, cache)  # (C, L, d): row r's first len(conts[r]) positions are the scored ones
        for r, c in enumerate(conts):
            Z.append(z[r, : len(c)])
            Y.append(torch.tensor(c))
            R.append(torch.full((len(c),), len(doc_of)))
            doc_of.append(di)
            clen.append(len(d["choices"][r]))
            texts.append(d["choices"][r])
        n_choices.append(C)
    return ControlFeatures(
        z=torch.cat(Z).float(),
        indices=torch.empty(0, dtype=torch.long),
        activations=torch.empty(0),
        targets=torch.cat(Y),
        request=torch.cat(R),
        doc_of_request=torch.tensor(doc_of),
        gold=torch.tensor([d["gold"] for d in docs]),
        choice_len=torch.tensor(clen),
        n_choices=n_choices,
        choice_text=texts,
    )


FEATURE_FIELDS = ("z", "targets", "request", "doc_of_request", "gold", "choice_len", "n_choices", "choice_text")
BASE_FIELDS = ("base_logp", "lse", "top_ids", "top_p")
TOP_TOKENS = 64  # per scored token: the base model's most probable tokens (the surrogate's vocabulary)
MAX_GATHER = 2**26  # elements of the gathered directions per chunk of ``exact_scores`` (256 MB of float32)


@dataclass
class TaskFeatures(ControlFeatures):
    """``ControlFeatures`` with the base model's full-vocabulary pass at every scored token (c = 0)."""

    base_logp: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(N,) float64 log p(target) under the base model."""
    lse: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(N,) logsumexp of the base logits."""
    top_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(N, TOP_TOKENS) the base model's most probable tokens."""
    top_p: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(N, TOP_TOKENS) their probabilities."""


@torch.no_grad()
def base_pass(f: ControlFeatures, W: torch.Tensor, chunk: int = 2048) -> dict[str, torch.Tensor]:
    """The ``BASE_FIELDS`` fields of ``f`` (one full-vocabulary pass over its tokens, in chunks)."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in BASE_FIELDS}
    for s in range(0, len(f.targets), chunk):
        logits = F.linear(f.z[s : s + chunk], W)  # (n, V) float32
        logp = F.log_softmax(logits.double(), dim=-1)
        parts["base_logp"].append(logp.gather(-1, f.targets[s : s + chunk, None]).squeeze(-1))
        parts["lse"].append(torch.logsumexp(logits, -1))
        top = logp.topk(TOP_TOKENS, dim=-1)
        parts["top_ids"].append(top.indices.int())
        parts["top_p"].append(top.values.exp().half())
    return {k: torch.cat(v) for k, v in parts.items()}


def encoded(f: TaskFeatures, encoder: Encoder, chunk: int = 4096) -> TaskFeatures:
    """A copy of ``f`` with the code (indices, activations) of ``encoder`` at every scored token."""
    with torch.no_grad():
        parts = [encoder(f.z[i : i + chunk]) for i in range(0, len(f.z), chunk)]
    return TaskFeatures(
        indices=torch.cat([p[0] for p in parts]),
        activations=torch.cat([p[1] for p in parts]).detach().float(),
        **{k: getattr(f, k) for k in (*FEATURE_FIELDS, *BASE_FIELDS)},
    )


@torch.no_grad()
def exact_scores(
    f: TaskFeatures, W: torch.Tensor, directions: torch.Tensor, c: torch.Tensor | None, chunk: int = 2048
) -> torch.Tensor:
    """(R,) float64 Σ log p(continuation) per request under ℓ' = W (z + Σ c_i a_i d_i), as ``request_scores``:
    the base pass where no unit of non-zero c is active, the full vocabulary (in chunks) where one is."""
    tok = f.base_logp.clone()  # (N,)
    if c is not None:
        touched = (c[f.indices] != 0).any(-1).nonzero().squeeze(-1)  # tokens whose z the controller moves
        # directions[idx] is (rows, k, d): a dense code (k = K' of hundreds) needs fewer rows per chunk
        chunk = max(1, min(chunk, MAX_GATHER // max(1, f.indices.shape[1] * directions.shape[1])))
        for s in range(0, len(touched), chunk):
            n = touched[s : s + chunk]
            idx = f.indices[n]
            coef = c.float()[idx] * f.activations[n]  # (n, k)
            z = f.z[n] + torch.einsum("nk,nkd->nd", coef, directions[idx].float())
            logits = F.linear(z, W)  # (n, V); float32 (float64 over V costs twice the time here)
            tok[n] = (logits.gather(-1, f.targets[n, None]).squeeze(-1) - logits.logsumexp(-1)).double()
    return torch.zeros(len(f.doc_of_request), dtype=torch.float64).index_add(0, f.request, tok)


@dataclass
class Surrogate:
    """The controller's fitting problem on vocabulary S (see the module doc)."""

    base: torch.Tensor
    """(N, |S|) base logits on S."""
    tail: torch.Tensor
    """(N,) log Σ_{v ∉ S} exp(base logit v), frozen."""
    target: torch.Tensor
    """(N,) each target's column in S."""
    A: torch.Tensor
    """(N, K) sparse: activation of unit i at token n."""
    WD: torch.Tensor
    """(K, |S|) logit change on S per unit of c_i·a_i."""
    slot: torch.Tensor
    """(R,) position of each request among its doc's choices."""


@torch.no_grad()
def surrogate_vocab(f: TaskFeatures, V: int, vocab: int) -> torch.Tensor:
    """S (sorted token ids): the targets ∪ the ``vocab`` tokens with the most base probability mass over
    the stored top tokens of every token of ``f`` (the training split)."""
    mass = torch.zeros(V).index_add_(0, f.top_ids.reshape(-1).long(), f.top_p.reshape(-1).float())
    mass[f.targets] = float("inf")  # every target is in S
    return mass.topk(min(V, vocab + len(f.targets.unique()))).indices.sort().values  # (|S|,)


@torch.no_grad()
def build_surrogate(f: TaskFeatures, W: torch.Tensor, directions: torch.Tensor, S: torch.Tensor) -> Surrogate:
    """The fitting problem of ``f`` on vocabulary S (a target outside S, possible on a split other than
    train, keeps its exact base logit as an extra column)."""
    V, N = W.shape[0], len(f.targets)
    S = torch.cat([S, f.targets[~torch.isin(f.targets, S)].unique()]).sort().values
    WS = W[S]  # (|S|, d)
    base = F.linear(f.z, WS)  # (N, |S|)
    frac = (base.logsumexp(-1) - f.lse).clamp(max=-1e-6)  # log of S's share of the base mass (< 0)
    tail = f.lse + torch.log(-torch.expm1(frac))
    col = torch.full((V,), -1, dtype=torch.long)
    col[S] = torch.arange(len(S))
    K, k = directions.shape[0], f.indices.shape[1]
    rows = torch.arange(N).repeat_interleave(k)
    A = torch.sparse_coo_tensor(
        torch.stack([rows, f.indices.reshape(-1)]), f.activations.reshape(-1), (N, K), check_invariants=True
    )
    n_choices = torch.tensor(f.n_choices)
    first = n_choices.cumsum(0) - n_choices  # (D,) first request of each doc (requests are in doc order)
    slot = torch.arange(len(f.doc_of_request)) - first[f.doc_of_request]
    return Surrogate(base, tail, col[f.targets], A.coalesce(), directions.float() @ WS.T, slot)


def surrogate_scores(p: Surrogate, f: ControlFeatures, c: torch.Tensor) -> torch.Tensor:
    """(R,) the surrogate's request scores under coefficients c (K,)."""
    logits = p.base + torch.sparse.mm(p.A, c[:, None] * p.WD)  # (N, |S|)
    lse = torch.logaddexp(logits.logsumexp(-1), p.tail)
    tok = logits.gather(-1, p.target[:, None]).squeeze(-1) - lse  # (N,)
    return torch.zeros(len(f.doc_of_request), dtype=tok.dtype).index_add(0, f.request, tok)


def surrogate_loss(p: Surrogate, f: ControlFeatures, c: torch.Tensor) -> torch.Tensor:
    """Multiple-choice cross-entropy of the surrogate request scores under coefficients c (K,)."""
    scores = surrogate_scores(p, f, c)
    M = torch.full((len(f.gold), max(f.n_choices)), -float("inf")).index_put((f.doc_of_request, p.slot), scores)
    return F.cross_entropy(M, f.gold)


def fit_surrogate(p: Surrogate, f: ControlFeatures, l1: float, steps: int, lr: float) -> Controller:
    """``fit_controller``'s proximal Adam on the surrogate's multiple-choice cross-entropy + λ‖c‖₁."""
    c, losses = proximal_adam(lambda c: surrogate_loss(p, f, c), p.WD.shape[0], l1=l1, steps=steps, lr=lr)
    hist: ControllerHistory = {"final_loss": losses[-1], "loss_first": losses[0], "steps": steps, "lr": lr}
    return Controller(coefficients=c.double(), l1=l1, history=hist)


@dataclass
class SurrogateFit:
    """``fit_surrogate_controller``'s result."""

    controller: Controller
    """The controller of the chosen λ."""
    trials: list[dict[str, object]]
    """Per λ: its surrogate validation accuracy, non-zero count and fit history."""
    fidelity: dict[str, float]
    """|S| and the chosen controller's validation accuracy, exact and by the surrogate."""


def fit_surrogate_controller(
    train: TaskFeatures,
    val: TaskFeatures,
    W: torch.Tensor,
    directions: torch.Tensor,
    *,
    l1_grid: Sequence[float],
    steps: int,
    lr: float,
    vocab: int,
) -> SurrogateFit:
    """A controller fitted on the train surrogate (vocabulary S of ``surrogate_vocab`` on train) per λ of
    ``l1_grid``; λ chosen by surrogate validation accuracy on the same S (ties: fewer non-zero); the chosen
    one's exact validation accuracy measures how faithful the surrogate is on held-out data."""
    S = surrogate_vocab(train, W.shape[0], vocab)
    prob, prob_val = build_surrogate(train, W, directions, S), build_surrogate(val, W, directions, S)
    best: Controller | None = None
    best_key: tuple[float, int] | None = None
    trials: list[dict[str, object]] = []
    for l1 in l1_grid:
        ctl = fit_surrogate(prob, train, l1, steps, lr)
        with torch.no_grad():
            va = accuracy(val, surrogate_scores(prob_val, val, ctl.coefficients.float()))["acc"]
        trials.append({"l1": l1, "val_acc": va, "nonzero": len(ctl.nonzero), **ctl.history})
        key = (va, -len(ctl.nonzero))
        if best_key is None or key > best_key:
            best, best_key = ctl, key
    if best is None or best_key is None:
        raise ConfigError("l1_grid is empty: give at least one λ")
    with torch.no_grad():
        fidelity = {
            "surrogate_vocab": len(S),
            "val_acc_exact": accuracy(val, exact_scores(val, W, directions, best.coefficients))["acc"],
            "val_acc_surrogate": float(best_key[0]),
        }
    return SurrogateFit(best, trials, fidelity)


@torch.no_grad()
def forward_scores(model: PrismLM, tokenizer: Tokenizer, docs: Sequence[MCExample]) -> torch.Tensor:
    """(R,) Σ log p(continuation) through the model's own forward (whatever ``control`` is active), with
    ``extract_shared_prefix``'s cut of the query: the independent reference for the cached-feature scores."""
    T, eot = model.config.block_size, tokenizer.eot_id
    out = []
    for d in docs:
        conts = [tokenizer.encode(ch) for ch in d["choices"]]
        ctx = (tokenizer.encode(d["query"]) or [eot])[-(T + 1 - max(map(len, conts))) :]
        for c in conts:
            full = torch.tensor([ctx + c])
            logp = F.log_softmax(model(full[:, :-1]).logits[0, -len(c) :].double(), dim=-1)  # (n, V)
            out.append(float(logp.gather(-1, full[0, -len(c) :, None]).sum()))
    return torch.tensor(out, dtype=torch.float64)


def chance(f: ControlFeatures) -> float:
    return float(sum(1 / n for n in f.n_choices) / len(f.n_choices))
