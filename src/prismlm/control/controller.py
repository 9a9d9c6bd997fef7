"""Sparse linear controllers over a sparse code of the final hidden state (spec §4).

``ℓ'_t = W (z_t + Σ_i c_i a_{t,i} d_i)`` with the LM frozen, c fitted with multiple-choice cross-entropy +
λ‖c‖₁ (proximal steps give exact zeros). Invariant: ``c = 0`` is exactly the base model, and the fitting
cache ``ControlFeatures`` scores as the forward pass does. See docs/architecture.md (controllers).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

import torch
import torch.nn.functional as F

from prismlm.control.suppress import Neighbour
from prismlm.errors import ArtifactError, DataError
from prismlm.eval.scoring import encode_pair
from prismlm.eval.tasks import MCExample

if TYPE_CHECKING:
    from prismlm.data.tokenizer import Tokenizer
    from prismlm.explain.index import PrototypeIndex
    from prismlm.model import PrismLM

Encoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""z (N, d) → (indices (N, k) int64, activations (N, k)) of a sparse code."""


@dataclass
class ControlFeatures:
    """What the frozen model computes at every scored (continuation) token of a task split."""

    z: torch.Tensor
    """(N, d) final hidden states predicting each continuation token."""
    indices: torch.Tensor
    """(N, k) active code units."""
    activations: torch.Tensor
    """(N, k) their activations."""
    targets: torch.Tensor
    """(N,) the continuation token."""
    request: torch.Tensor
    """(N,) which (doc, choice) request the token belongs to."""
    doc_of_request: torch.Tensor
    """(R,) doc of each request."""
    gold: torch.Tensor
    """(D,) gold choice of each doc."""
    choice_len: torch.Tensor
    """(R,) characters of each choice (for acc_norm)."""
    n_choices: list[int] = field(default_factory=list)
    """(D,) number of choices of each doc."""
    choice_text: list[str] = field(default_factory=list)
    """(R,) the choice string of each request (for the choice-prior baseline)."""
    _choice_pos: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    """(R,) position of each request among its doc's choices (cached by ``_choice_matrix``)."""


def prism_encoder(model: PrismLM) -> Encoder:
    prototypes = model.require_prototypes()

    def enc(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        po = prototypes(z)
        return po.indices, po.activations

    return enc


@torch.no_grad()
def extract_features(
    model: PrismLM, tokenizer: Tokenizer, docs: Sequence[MCExample], encoder: Encoder, *, batch_size: int = 32
) -> ControlFeatures:
    """Run the frozen backbone on every (query, choice) pair and cache the code at the scored tokens."""
    T = model.config.block_size
    reqs: list[tuple[list[int], int]] = []
    doc_of: list[int] = []
    clen: list[int] = []
    n_choices: list[int] = []
    texts: list[str] = []
    for di, d in enumerate(docs):
        n_choices.append(len(d["choices"]))
        for ch in d["choices"]:
            reqs.append(encode_pair(tokenizer, d["query"], ch, T))
            doc_of.append(di)
            clen.append(len(ch))
            texts.append(ch)
    dev = next(model.parameters()).device
    Z: list[torch.Tensor] = []
    Y: list[torch.Tensor] = []
    R: list[torch.Tensor] = []
    for b in range(0, len(reqs), batch_size):
        chunk = reqs[b : b + batch_size]
        L = max(len(f) - 1 for f, _ in chunk)
        x = torch.full((len(chunk), L), tokenizer.eot_id, dtype=torch.long)
        for r, (full, _) in enumerate(chunk):
            x[r, : len(full) - 1] = torch.tensor(full[:-1])
        z = model.backbone(x.to(dev))  # (B, L, d) — the same z the forward pass computes
        for r, (full, n) in enumerate(chunk):
            pos = torch.arange(len(full) - 1 - n, len(full) - 1)
            Z.append(z[r, pos].cpu())
            Y.append(torch.tensor(full[-n:]))
            R.append(torch.full((n,), b + r))
    Zc = torch.cat(Z)
    idx, act = encoder(Zc.to(dev))
    return ControlFeatures(
        z=Zc,
        indices=idx.cpu(),
        activations=act.detach().cpu(),
        targets=torch.cat(Y),
        request=torch.cat(R),
        doc_of_request=torch.tensor(doc_of),
        gold=torch.tensor([d["gold"] for d in docs]),
        choice_len=torch.tensor(clen, dtype=torch.float64),
        n_choices=n_choices,
        choice_text=texts,
    )


def request_scores(
    f: ControlFeatures, W: torch.Tensor, directions: torch.Tensor, c: torch.Tensor | None
) -> torch.Tensor:
    """(R,) Σ log p(continuation) per request under ℓ' = W (z + Σ c_i a_i d_i)."""
    z = f.z.to(W.dtype)
    if c is not None:
        coef = c[f.indices] * f.activations.to(W.dtype)  # (N, k)
        z = z + torch.einsum("nk,nkd->nd", coef, directions[f.indices].to(W.dtype))
    logp = F.log_softmax(F.linear(z, W), dim=-1)  # (N, V) in W's dtype (float64 for evaluation)
    tok = logp.gather(-1, f.targets[:, None]).squeeze(-1)  # (N,)
    return torch.zeros(len(f.doc_of_request), dtype=tok.dtype).index_add(0, f.request, tok)


def _choice_matrix(f: ControlFeatures, scores: torch.Tensor) -> torch.Tensor:
    """(D, max_choices) matrix of scores, −inf padded."""
    D, C = len(f.gold), max(f.n_choices)
    M = torch.full((D, C), -float("inf"), dtype=scores.dtype)
    pos = f._choice_pos
    if pos is None:  # position of each request among its doc's choices (computed once per feature set)
        pos = torch.zeros(len(f.doc_of_request), dtype=torch.long)
        seen: dict[int, int] = {}
        for r, d in enumerate(f.doc_of_request.tolist()):
            pos[r] = seen.get(d, 0)
            seen[d] = int(pos[r]) + 1
        f._choice_pos = pos
    M = M.index_put((f.doc_of_request, pos), scores)
    return M


def correct(f: ControlFeatures, scores: torch.Tensor) -> torch.Tensor:
    """(D,) bool: is the highest-scoring choice the gold one (first maximum wins, like ``numpy.argmax``)."""
    return _choice_matrix(f, scores.detach()).argmax(-1) == f.gold


def accuracy(f: ControlFeatures, scores: torch.Tensor) -> dict[str, float]:
    M = _choice_matrix(f, scores.detach())
    Mn = _choice_matrix(f, scores.detach() / f.choice_len.to(scores.dtype))
    return {
        "acc": float((M.argmax(-1) == f.gold).double().mean()),
        "acc_norm": float((Mn.argmax(-1) == f.gold).double().mean()),
        "n": len(f.gold),
    }


class LambdaTrial(TypedDict):
    """One λ of ``fit_with_validation``'s grid: the validation accuracy and size of its controller."""

    l1: float
    val_acc: float
    nonzero: int
    final_loss: float


class ControllerHistory(TypedDict, total=False):
    """How a controller was fitted (``fit_controller``; ``selection`` added by ``fit_with_validation``)."""

    final_loss: float
    loss_first: float
    steps: int
    lr: float
    selection: list[LambdaTrial]


class TracedExample(TypedDict):
    """A task token where a traced unit is most active."""

    doc: str
    """The task example's id."""
    label: str
    activation: float
    target: str
    """The continuation token, decoded."""


class TracedUnit(TypedDict):
    """One non-zero coefficient of ``trace_prism_controller``."""

    id: int
    c: float
    signature_top_tokens: list[str]
    task_examples: list[TracedExample]
    active_tokens_in_train: int
    label: NotRequired[str | None]
    """With an index that labels the prototype."""
    neighbours: NotRequired[list[Neighbour]]
    """With an index attached to its shards."""


@dataclass
class Controller:
    """A fitted sparse controller: coefficients c over K code units, and how it was fitted."""

    coefficients: torch.Tensor
    """(K,) float; 0 = unit untouched, −1 = unit removed (suppression), > 0 = amplified."""
    l1: float
    """The L1 weight λ it was fitted with."""
    history: ControllerHistory = field(default_factory=ControllerHistory)
    """How it was fitted: loss per step, and the λ trials (``selection``)."""

    @property
    def nonzero(self) -> list[int]:
        return self.coefficients.nonzero().squeeze(1).tolist()

    def save(self, path: str | Path, **meta: object) -> Path:  # meta: JSON-encodable entries
        path = Path(path)
        path.write_text(
            json.dumps(
                {
                    "kind": "prismlm-controller",
                    "num_units": len(self.coefficients),
                    "l1": self.l1,
                    "coefficients": {str(i): float(self.coefficients[i]) for i in self.nonzero},
                    "history": self.history,
                    **meta,
                },
                indent=2,
            )
            + "\n"
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Controller:
        d = json.loads(Path(path).read_text())
        if d.get("kind") != "prismlm-controller":
            raise ArtifactError(f"{path} is not a controller file", path=path)
        c = torch.zeros(d["num_units"], dtype=torch.float64)
        for i, v in d["coefficients"].items():
            c[int(i)] = v
        return cls(coefficients=c, l1=d["l1"], history=d.get("history", {}))


def proximal_adam(
    loss: Callable[[torch.Tensor], torch.Tensor],
    K: int,
    *,
    l1: float,
    steps: int,
    lr: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, list[float]]:
    """Minimise loss(c) + λ‖c‖₁ over c (K,) from 0: each Adam step is followed by the L1 prox in Adam's diagonal
    metric — coordinate i soft-thresholded by lr·λ/(√v̂_i + ε) — so a coefficient stays exactly 0 unless its
    gradient consistently exceeds λ (the L1 optimality condition), whatever the gradient scale. Returns c
    (detached) and the loss before each step."""
    c = torch.zeros(K, dtype=dtype, requires_grad=True)
    m1, m2 = torch.zeros(K, dtype=dtype), torch.zeros(K, dtype=dtype)
    b1, b2, eps = 0.9, 0.999, 1e-8
    losses: list[float] = []
    for t in range(1, steps + 1):
        value = loss(c)
        (g,) = torch.autograd.grad(value, c)
        with torch.no_grad():
            m1.mul_(b1).add_(g, alpha=1 - b1)
            m2.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (m2 / (1 - b2**t)).sqrt() + eps
            u = c - lr * (m1 / (1 - b1**t)) / denom
            c.copy_(torch.sign(u) * torch.clamp(u.abs() - lr * l1 / denom, min=0.0))
        losses.append(float(value.detach()))
    return c.detach(), losses


def fit_controller(
    train: ControlFeatures,
    W: torch.Tensor,
    directions: torch.Tensor,
    *,
    l1: float = 1e-3,
    steps: int = 100,
    lr: float = 0.05,
    val: ControlFeatures | None = None,
    dtype: torch.dtype = torch.float32,
) -> Controller:
    """Full-batch Adam on the multiple-choice cross-entropy, each step followed by the L1 prox
    (soft-threshold by lr·λ). ``W`` (V, d) is the frozen output head, ``directions`` (K, d) the code's
    directions; only units active on the training tokens can become non-zero."""
    W, Dn = W.detach().to(dtype), directions.detach().to(dtype)

    def loss(c: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_choice_matrix(train, request_scores(train, W, Dn, c)), train.gold)

    c, losses = proximal_adam(loss, Dn.shape[0], l1=l1, steps=steps, lr=lr, dtype=dtype)
    out = Controller(
        coefficients=c.double(),
        l1=l1,
        history={"final_loss": losses[-1], "loss_first": losses[0], "steps": steps, "lr": lr},
    )
    return out


def fit_with_validation(
    train: ControlFeatures,
    val: ControlFeatures,
    W: torch.Tensor,
    directions: torch.Tensor,
    *,
    l1_grid: Sequence[float] = (3e-3, 1e-2, 3e-2),
    steps: int = 100,
    lr: float = 0.05,
) -> tuple[Controller, list[LambdaTrial]]:
    """Fit one controller per λ; keep the best validation accuracy (ties: fewer non-zeros)."""
    trials: list[LambdaTrial] = []
    best: Controller | None = None
    best_key: tuple[float, int] | None = None
    for l1 in l1_grid:
        ctl = fit_controller(train, W, directions, l1=l1, steps=steps, lr=lr)
        va = accuracy(val, request_scores(val, W.double(), directions.double(), ctl.coefficients))
        trials.append(
            {"l1": l1, "val_acc": va["acc"], "nonzero": len(ctl.nonzero), "final_loss": ctl.history["final_loss"]}
        )
        key = (va["acc"], -len(ctl.nonzero))
        if best_key is None or key > best_key:
            best, best_key = ctl, key
    assert best is not None
    best.history["selection"] = trials
    return best, trials


@dataclass
class ControllerResult:
    """A controller fitted on train (λ chosen on validation) and its test scores before and after."""

    controller: Controller
    """The controller fitted on train at the λ chosen on validation."""
    trials: list[LambdaTrial]
    """One record per λ of the grid: validation accuracy and non-zero coefficients."""
    test_scores_before: torch.Tensor
    """(R,) float64 request scores of the test split with c = 0"""
    test_scores_after: torch.Tensor
    """(R,) float64 request scores of the test split with the fitted c."""
    before: dict[str, float]
    """``accuracy`` (acc, acc_norm, n) of the test split with c = 0."""
    after: dict[str, float]
    """``accuracy`` of the test split with the fitted c."""


def fit_and_test(
    feats: dict[str, ControlFeatures],
    W: torch.Tensor,
    directions: torch.Tensor,
    *,
    l1_grid: Sequence[float] = (3e-3, 1e-2, 3e-2),
    steps: int = 100,
    lr: float = 0.05,
) -> ControllerResult:
    """The protocol used by ``prism controller fit`` and ``bench/control.py``: fit on ``feats["train"]``,
    choose λ on ``feats["validation"]``, score ``feats["test"]`` with c = 0 and with the fitted c."""
    ctl, trials = fit_with_validation(
        feats["train"], feats["validation"], W, directions, l1_grid=l1_grid, steps=steps, lr=lr
    )
    s0 = request_scores(feats["test"], W.double(), directions.double(), None)
    s1 = request_scores(feats["test"], W.double(), directions.double(), ctl.coefficients)
    return ControllerResult(ctl, trials, s0, s1, accuracy(feats["test"], s0), accuracy(feats["test"], s1))


# ----- choice-prior baseline ---------------------------------------------------------------------------------
@dataclass
class ChoicePrior:
    """A learned additive preference per choice *string* (``score' = score + b[choice]``), context-free:
    the most a controller could gain without reading the query. On a classification task with a fixed
    label set (authors, eras) it is a calibration of the label prior; on a task whose every example has
    its own choices it changes nothing on test (unseen strings get 0)."""

    bias: dict[str, float]
    """Choice string → its additive score b (strings never seen in training get 0)."""

    def scores(self, f: ControlFeatures, base_scores: torch.Tensor) -> torch.Tensor:
        b = torch.tensor([self.bias.get(t, 0.0) for t in f.choice_text], dtype=base_scores.dtype)
        return base_scores + b


def fit_choice_prior(
    train: ControlFeatures, base_scores: torch.Tensor, *, steps: int = 300, lr: float = 0.1
) -> ChoicePrior:
    """Fit one bias per distinct choice string of the training split by full-batch Adam on the same
    multiple-choice cross-entropy as the controllers (base scores fixed: the LM is not involved)."""
    if not train.choice_text:
        raise DataError("these features carry no choice strings; re-extract them with extract_features")
    vocab = sorted(set(train.choice_text))
    pos = {t: i for i, t in enumerate(vocab)}
    cid = torch.tensor([pos[t] for t in train.choice_text])
    base = base_scores.detach().double()
    b = torch.zeros(len(vocab), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([b], lr=lr)
    for _ in range(steps):
        loss = F.cross_entropy(_choice_matrix(train, base + b[cid]), train.gold)
        opt.zero_grad()
        loss.backward()
        opt.step()
    bias = b.detach()
    return ChoicePrior(bias={t: float(bias[i]) for t, i in pos.items()})


# ----- tracing ---------------------------------------------------------------------------------------------
def trace_prism_controller(
    model: PrismLM,
    tokenizer: Tokenizer,
    ctl: Controller,
    feats: ControlFeatures,
    docs: Sequence[MCExample],
    *,
    index: PrototypeIndex | None = None,
    top: int = 20,
) -> list[TracedUnit]:
    """Each non-zero c_i with its prototype's signature tokens, label and training neighbourhood (when an
    index is given) and the task examples where it is most active."""
    from prismlm.control.concept import signature_tokens

    labels = index.labels() if index is not None else {}
    order = sorted(ctl.nonzero, key=lambda i: -abs(float(ctl.coefficients[i])))[:top]
    out: list[TracedUnit] = []
    for i in order:
        m = feats.indices == i
        acts = torch.where(m, feats.activations, torch.zeros_like(feats.activations)).sum(-1)  # (N,)
        best = acts.topk(min(3, len(acts))).indices.tolist()
        ex: list[TracedExample] = []
        for n in best:
            if acts[n] <= 0:
                continue
            r = int(feats.request[n])
            d = int(feats.doc_of_request[r])
            ex.append(
                {
                    "doc": docs[d]["id"],
                    "label": docs[d]["label"],
                    "activation": float(acts[n]),
                    "target": tokenizer.decode([int(feats.targets[n])]),
                }
            )
        e: TracedUnit = {
            "id": i,
            "c": float(ctl.coefficients[i]),
            "signature_top_tokens": signature_tokens(model, tokenizer, i),
            "task_examples": ex,
            "active_tokens_in_train": int(m.any(-1).sum()),
        }
        if i in labels:
            e["label"] = labels[i].get("label")  # a LabelEntry: labels.json holds strings (`prism label`)
        if index is not None and getattr(index, "shards", None) is not None:
            e["neighbours"] = [{"doc_id": nb.doc_id, "snippet": nb.snippet} for nb in index.neighbours(i, 3)]
        out.append(e)
    return out
