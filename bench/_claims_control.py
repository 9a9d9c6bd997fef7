"""The ``controllers`` stage of ``bench/real_claims.py``: sparse controllers over the active prototypes of the
retrofitted SmolLM2-135M-Instruct vs a TopK SAE (same K and k) on the *same* frozen backbone hidden states,
on multiple-choice tasks the model can do (issue 27, item 2; protocol of ``bench/control.py``).

 1. Candidate tasks: the five of ``prismlm.eval.tasks`` and two built here from the same shipped data
    (``sotu_ending``: the next 12 words of a State-of-the-Union paragraph; ``gutenberg_bible``: is a
    Gutenberg passage from the King James Bible, Yes/No). Base accuracy of each on its *validation* split
    vs chance; a task is kept when it is clearly above chance (one-sided binomial p < 0.01 and ≥ 5 points;
    ``--quick``: any margin). The test splits are not looked at before the controllers are fitted.
 2. A TopK SAE with the bank's K and k, trained on the bank's stored z (``RUN/stored-z``: the backbone's
    hidden states over the anchor corpus the prototypes were fitted on).
 3. Per kept task (``--quick``: the first two) and side: base accuracy (c = 0), a controller fitted on train
    with λ chosen on validation from ``ControlSize.l1_grid`` (proximal Adam as ``fit_controller``, ``ctl_steps``
    steps at ``CTL_LR``), test accuracy after; the choice-prior control (``fit_choice_prior``); paired McNemar p
    and bootstrap 95% intervals (``paired_stats``); PRISM's non-zero coefficients traced to their prototypes.
    The sizes (examples, λ grid, steps, |S|, SAE steps, checked documents): ``SIZES``.

Two things differ from ``bench/control.py`` because V = 49,152 and d = 576 make its full-batch fit cost
~10 s per step here (N·V·d per step):
 * Features are extracted with the query's keys/values cached once per example and the choices run as one
   batch on top of them (``extract_shared_prefix``; the query is cut from the left so the longest choice
   fits the window; the scored z equal ``extract_features``'s up to float rounding, checked at run time).
 * The controller is *fitted* on a vocabulary-restricted surrogate of the log-softmax: the logits of the
   targets ∪ the ``surrogate_vocab`` tokens with the most base probability mass on the training tokens,
   with the rest of the partition function frozen at its base value (exact at c = 0). The change of those
   logits is Σ c_i a_i (W_S d_i), a sparse (N × K) by dense (K × |S|) product. Every accuracy reported
   (λ selection on validation included) is computed with the exact full-vocabulary scores, and PRISM's
   exact test scores are checked against the model's own forward pass (``with model.control(c)``).

Everything extracted is cached under ``WORK/controllers`` (features keyed by the backbone's identity, so a
bank over the same backbone reuses them; the SAE; one JSON per finished task), so the stage resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from _claims_common import ClaimsContext

from prismlm.control.controller import (
    ControlFeatures,
    Controller,
    Encoder,
    accuracy,
    correct,
    fit_choice_prior,
    prism_encoder,
    trace_prism_controller,
)
from prismlm.control.sae import SAERecipe, TopKSAE, fit_sae, row_sampler
from prismlm.eval.claims import controller_summary
from prismlm.eval.stats import binomial_p_above, paired_stats, wilson
from prismlm.eval.tasks import (
    SPLITS,
    TASKS,
    MCExample,
    TaskSpec,
    _pick,
    _sotu_raw,
    build_from_spec,
    build_task,
    passages,
)
from prismlm.model import PrismLM
from prismlm.train.stored_z import backbone_identity, open_stored_z


@dataclass(frozen=True)
class ControlSize:
    """How much of the protocol runs (``--quick``: a smoke size that runs every step of it on less)."""

    caps: dict[str, int]
    """Examples per split of each task."""
    l1_grid: tuple[float, ...]
    """λ values tried (chosen on validation)."""
    ctl_steps: int
    """Proximal Adam steps per controller fit."""
    surrogate_vocab: int
    """|S| of the fitting surrogate (besides the targets)."""
    sae_steps: int
    """× ``SAE_BATCH`` hidden states (full: 410k, ~3 passes over the 125k training rows; the CPU budget of
    2026-12-05)."""
    forward_check_docs: int
    """Test documents scored again through the model's own forward (per task, c = 0 and controlled)."""
    max_tasks: int | None
    """The first this many kept tasks get controllers (None: all)."""


SIZES = {
    # full: bench/control.py's λ grid, steps and learning rate. quick (CI, ~1 min at 1 thread beyond the bank;
    # 2026-12-05): the extraction of the task texts by the backbone is most of the time (~0.2 s per example),
    # then the reference forwards of the check and the fits, so fewer examples, docs, λ values and steps, and
    # two tasks (the screen still sees every candidate)
    "quick": ControlSize({"train": 8, "validation": 8, "test": 12}, (3e-3, 3e-2), 30, 512, 80, 2, 2),
    "full": ControlSize({"train": 100, "validation": 60, "test": 160}, (3e-3, 1e-2, 3e-2), 60, 2048, 800, 3, None),
}
CTL_LR = 0.1


def ctx_size(ctx: ClaimsContext) -> ControlSize:
    return SIZES["quick" if ctx.quick else "full"]


SAE_BATCH = 512  # hidden states per SAE step
SAE_RECIPE = "data"  # see train_sae_on_stored_z; chosen by held-out FVU (docs/results.md, Controllers)
SAE_DEAD_STEPS, SAE_RESAMPLE = 50, 250
SAE_CHECKPOINTS = (200, 400, 600, 800)
FIRST_BANK = "the first bank (bf3ef15: 139k anchor tokens, no kjv.jsonl; its data-init 800-step SAE: FVU 0.340)"
SAE_TRIED = (  # the other settings measured (2026-12-05) on the first bank's held-out rows, for the reader of the JSON
    {"recipe": "random", "steps": 300, "fvu": 0.403, "dead_fraction": 0.699, "note": "a short check run", "bank": FIRST_BANK},
    {"recipe": "random", "steps": 800, "fvu": 0.362, "dead_fraction": 0.708, "note": "the first run (d7bb952)", "bank": FIRST_BANK},
    {"recipe": "data", "steps": 1500, "fvu": 0.338, "dead_fraction": 0.15, "note": "a 3000-step run stopped for time", "bank": FIRST_BANK},
)  # fmt: skip
MIN_TASKS = 3  # the tasks built here are screened only when fewer shipped ones pass
KEEP_P, KEEP_MARGIN = 0.01, 0.05


# ----- the two tasks built here (the pattern of prismlm.eval.tasks) ------------------------------------------
def _sotu_ending_raw(per_doc: int = 6, ending_words: int = 12) -> Iterator[tuple[str, str, str, str]]:
    """(first half of a SOTU passage, its next ``ending_words`` words), as ``gutenberg_ending``."""
    for group, ex_id, p, _president in _sotu_raw("president", per_doc):
        words = p.removesuffix(" …").split()
        half = len(words) // 2
        if len(words) - half >= ending_words:
            yield group, ex_id, " ".join(words[:half]), " ".join(words[half : half + ending_words])


def _bible_raw(per_doc: int = 6) -> Iterator[tuple[str, str, str, str]]:
    """Gutenberg passages labelled Yes (King James Bible) / No (any other book): as many No books as Bible
    books, spread over the other books (deterministic)."""
    from prismlm.data.corpus import gutenberg_documents

    docs = [d for d in gutenberg_documents() if d.meta.get("author")]
    bible = [d for d in docs if d.meta["author"] == "King James Bible"]
    other = _pick([d for d in docs if d.meta["author"] != "King James Bible"], len(bible))
    for doc in bible + other:
        label = "Yes" if doc.meta["author"] == "King James Bible" else "No"
        for j, p in enumerate(_pick(passages(doc.text), per_doc)):
            yield doc.id, f"{doc.id}/p{j}", p, label


EXTRA_TASKS = {
    "sotu_ending": TaskSpec(_sotu_ending_raw, "{passage}", 4, answers_per_example=True),
    "gutenberg_bible": TaskSpec(
        _bible_raw, "Passage: {passage}\nQuestion: Is this passage from the Bible?\nAnswer:", 2
    ),
}
CANDIDATES = (*TASKS, *EXTRA_TASKS)


def build_any_task(name: str, caps: dict[str, int]) -> dict[str, list[MCExample]]:
    """A shipped task (``build_task``) or one of ``EXTRA_TASKS``, split by source document as ``build_task``."""
    return build_task(name, caps) if name in TASKS else build_from_spec(EXTRA_TASKS[name], caps)


# ----- features: the backbone once per query, the choices batched on its cache -------------------------------
@torch.no_grad()
def extract_shared_prefix(model: PrismLM, tokenizer, docs: Sequence[MCExample]) -> ControlFeatures:
    """``ControlFeatures`` (code fields empty) of every (query, choice) pair: the query's keys/values once,
    then the C choices as one right-padded batch on the cache repeated C times. The query is cut from the
    left so that the longest choice fits the window (block_size + 1 tokens with the last target)."""
    T, eot = model.config.block_size, tokenizer.eot_id
    Z, Y, R, doc_of, clen, n_choices, texts = [], [], [], [], [], [], []
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


_FIELDS = ("z", "targets", "request", "doc_of_request", "gold", "choice_len", "n_choices", "choice_text")
_BASE = ("base_logp", "lse", "top_ids", "top_p")
TOP_TOKENS = 64  # per scored token: the base model's most probable tokens (the surrogate's vocabulary)


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
    """The ``_BASE`` fields of ``f`` (one full-vocabulary pass over its tokens, in chunks)."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in _BASE}
    for s in range(0, len(f.targets), chunk):
        logits = F.linear(f.z[s : s + chunk], W)  # (n, V) float32
        logp = F.log_softmax(logits.double(), dim=-1)
        parts["base_logp"].append(logp.gather(-1, f.targets[s : s + chunk, None]).squeeze(-1))
        parts["lse"].append(torch.logsumexp(logits, -1))
        top = logp.topk(TOP_TOKENS, dim=-1)
        parts["top_ids"].append(top.indices.int())
        parts["top_p"].append(top.values.exp().half())
    return {k: torch.cat(v) for k, v in parts.items()}


def _first_docs(saved: dict, m: int) -> dict:
    """A saved split cut to its first m documents (requests and tokens are stored in document order)."""
    R = sum(saved["n_choices"][:m])
    N = int((saved["request"] < R).sum())
    out = {"ids": saved["ids"][:m], "gold": saved["gold"][:m], "n_choices": saved["n_choices"][:m]}
    for k in ("doc_of_request", "choice_len", "choice_text"):
        out[k] = saved[k][:R]
    for k in ("z", "targets", "request", *_BASE):
        if k in saved:
            out[k] = saved[k][:N]
    return out


def cached_features(
    ctx: ClaimsContext, model: PrismLM, tokenizer, folder: Path, task: str, split: str, docs: list[MCExample]
) -> TaskFeatures:
    """``extract_shared_prefix`` and ``base_pass`` of one split, from ``folder`` when extracted earlier (the
    same documents, or a file of more whose first documents are these)."""
    path = folder / f"{task}-{split}-{len(docs)}.pt"
    ids = [d["id"] for d in docs]
    saved = None
    for p in [path, *sorted(folder.glob(f"{task}-{split}-*.pt"))]:
        if p.exists():
            s = torch.load(p, weights_only=False)
            if s["ids"][: len(ids)] == ids:
                saved = _first_docs(s, len(ids)) if len(s["ids"]) > len(ids) else s
                break
    if saved is None:
        t = time.perf_counter()
        f = extract_shared_prefix(model, tokenizer, docs)
        saved = {"ids": ids, **{k: getattr(f, k) for k in _FIELDS}}
        ctx.log(
            f"controllers: {task}/{split}: {len(docs)} examples, {len(f.targets)} scored tokens "
            f"({time.perf_counter() - t:.0f} s)"
        )
    if any(k not in saved for k in _BASE):
        f = ControlFeatures(indices=torch.empty(0), activations=torch.empty(0), **{k: saved[k] for k in _FIELDS})
        saved.update(base_pass(f, model.lm_head.weight.detach().float()))
    if not path.exists() or "base_logp" not in torch.load(path, weights_only=False):
        tmp = path.with_suffix(".tmp")
        torch.save(saved, tmp)
        tmp.replace(path)
    return TaskFeatures(indices=torch.empty(0), activations=torch.empty(0), **{k: saved[k] for k in (*_FIELDS, *_BASE)})


def encoded(f: TaskFeatures, encoder: Encoder, chunk: int = 4096) -> TaskFeatures:
    """A copy of ``f`` with the code (indices, activations) of ``encoder`` at every scored token."""
    with torch.no_grad():
        parts = [encoder(f.z[i : i + chunk]) for i in range(0, len(f.z), chunk)]
    return TaskFeatures(
        indices=torch.cat([p[0] for p in parts]),
        activations=torch.cat([p[1] for p in parts]).detach().float(),
        **{k: getattr(f, k) for k in (*_FIELDS, *_BASE)},
    )


# ----- scoring: exact (full vocabulary, chunked) and the fitting surrogate ----------------------------------
@torch.no_grad()
def exact_scores(
    f: TaskFeatures, W: torch.Tensor, directions: torch.Tensor, c: torch.Tensor | None, chunk: int = 2048
) -> torch.Tensor:
    """(R,) float64 Σ log p(continuation) per request under ℓ' = W (z + Σ c_i a_i d_i), as ``request_scores``:
    the base pass where no unit of non-zero c is active, the full vocabulary (in chunks) where one is."""
    tok = f.base_logp.clone()  # (N,)
    if c is not None:
        touched = (c[f.indices] != 0).any(-1).nonzero().squeeze(-1)  # tokens whose z the controller moves
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
def surrogate(f: TaskFeatures, W: torch.Tensor, directions: torch.Tensor, S: torch.Tensor) -> Surrogate:
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
    """``fit_controller``'s proximal Adam (soft-threshold in Adam's diagonal metric) on the surrogate."""
    K = p.WD.shape[0]
    c = torch.zeros(K, requires_grad=True)
    m1, m2 = torch.zeros(K), torch.zeros(K)
    b1, b2, eps = 0.9, 0.999, 1e-8
    losses = []
    for t in range(1, steps + 1):
        loss = surrogate_loss(p, f, c)
        (g,) = torch.autograd.grad(loss, c)
        with torch.no_grad():
            m1.mul_(b1).add_(g, alpha=1 - b1)
            m2.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (m2 / (1 - b2**t)).sqrt() + eps
            u = c - lr * (m1 / (1 - b1**t)) / denom
            c.copy_(torch.sign(u) * torch.clamp(u.abs() - lr * l1 / denom, min=0.0))
        losses.append(float(loss.detach()))
    hist = {"final_loss": losses[-1], "loss_first": losses[0], "steps": steps, "lr": lr}
    return Controller(coefficients=c.detach().double(), l1=l1, history=hist)  # type: ignore[arg-type]


# ----- the SAE on the stored z ---------------------------------------------------------------------------------
def train_sae_on_stored_z(
    run_folder: Path, K: int, k: int, steps: int, seed: int, log: Callable[[str], None], *, recipe: str = SAE_RECIPE
) -> tuple[TopKSAE, dict[str, object]]:
    """``prismlm.control.sae.fit_sae`` on the bank's stored hidden states (``SAE_BATCH`` rows a step, b_dec at
    the mean of 8 batches); ``recipe`` "data": the data initialisation and resampling every ``SAE_RESAMPLE``
    steps, "random": AuxK alone. The last 10% of the stored sequences are held out (FVU, dead fraction)."""
    store = open_stored_z(run_folder / "stored-z").check()
    T, n_seq = store.block_size, store.num_sequences
    n_train = max(1, int(0.9 * n_seq)) if n_seq > 1 else n_seq
    train_rows = n_train * T
    Z = store.rows(0, train_rows)  # (rows, d) float32 in memory: random rows of a memory map cost more
    held = store.rows(train_rows, n_seq * T) if n_seq > n_train else Z[: min(4096, train_rows)]
    data = recipe == "data"
    plan = SAERecipe(
        steps=steps, batch=SAE_BATCH, dead_steps=SAE_DEAD_STEPS, data_init=data,
        resample_every=SAE_RESAMPLE if data else 0, mean_draws=8 * SAE_BATCH,
    )  # fmt: skip
    fit = fit_sae(
        Z.shape[1], K, k, row_sampler(Z, seed), plan, seed=seed, held=held, checkpoints=SAE_CHECKPOINTS,
        log=lambda m: log(f"controllers: {m} ({recipe})"),
    )  # fmt: skip
    return fit.sae, {
        **fit.curve[-1],
        "recipe": recipe,
        "steps": steps,
        "batch": SAE_BATCH,
        "curve": fit.curve,
        "resampled_latents": fit.resampled,
        "train_hidden_states": train_rows,
        "heldout_hidden_states": len(held),
    }


# ----- the stage -----------------------------------------------------------------------------------------------
@torch.no_grad()
def forward_scores(model: PrismLM, tokenizer, docs: Sequence[MCExample]) -> torch.Tensor:
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


def screen(ctx: ClaimsContext, run, folder: Path, caps: dict[str, int]) -> tuple[list[dict[str, object]], dict]:
    """Base validation accuracy of every shipped task vs chance, and of the tasks built here when fewer
    than ``MIN_TASKS`` shipped ones are clearly above it; which are kept."""
    rows: list[dict[str, object]] = []
    splits_of = {}
    for task in CANDIDATES:
        if task in EXTRA_TASKS and sum(bool(r["kept"]) for r in rows) >= MIN_TASKS:
            break
        splits = build_any_task(task, caps)
        f = cached_features(ctx, run.model, run.tokenizer, folder, task, "validation", splits["validation"])
        acc = accuracy(f, f.base_logp.new_zeros(len(f.doc_of_request)).index_add(0, f.request, f.base_logp))["acc"]
        n, ch = len(f.gold), chance(f)
        p = binomial_p_above(round(acc * n), n, ch)
        keep = acc > ch if ctx.quick else (p < KEEP_P and acc - ch >= KEEP_MARGIN)
        rows.append({"task": task, "validation_acc": acc, "chance": ch, "n": n, "binomial_p": p, "kept": keep})
        ctx.log(
            f"controllers: screen {task}: val acc {acc:.3f} vs chance {ch:.3f} (p {p:.2g}) → "
            f"{'kept' if keep else 'dropped'}"
        )
        splits_of[task] = splits
    return rows, splits_of


def stage_sae(ctx: ClaimsContext, run_folder: Path, K: int, k: int) -> tuple[TopKSAE, dict[str, object]]:
    """The SAE of ``train_sae_on_stored_z``, cached under the stage folder by what it depends on (the stored
    z, K, k, steps): it can be trained as soon as the bank's z pass is done."""
    store = open_stored_z(run_folder / "stored-z").check()
    steps = ctx_size(ctx).sae_steps
    key = f"{store.manifest['backbone'][9:21]}-{store.manifest['shard_key'][:12]}-{K}-{k}-{steps}x{SAE_BATCH}-{SAE_RECIPE}"
    path = ctx.stage_dir("controllers") / f"sae-{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        sae = TopKSAE(store.z.shape[1], K, k)
        sae.load_state_dict(saved["state"])
        return sae.eval(), {**saved["info"], "cache_key": key}
    t = time.perf_counter()
    sae, info = train_sae_on_stored_z(run_folder, K, k, steps, ctx.seed, ctx.log)
    info["seconds"] = round(time.perf_counter() - t, 1)
    torch.save({"state": sae.state_dict(), "info": info}, path)
    return sae, {**info, "cache_key": key}


def side_result(
    feats: dict[str, ControlFeatures],
    W: torch.Tensor,
    directions: torch.Tensor,
    base: dict,
    seed: int,
    size: ControlSize,
) -> tuple[Controller, dict[str, object]]:
    """One side's controller: fitted on the train surrogate per λ, λ by surrogate validation accuracy (same
    vocabulary S), exact test; the exact validation accuracy of the chosen one checks the surrogate."""
    train, val, test = feats["train"], feats["validation"], feats["test"]
    S = surrogate_vocab(train, W.shape[0], size.surrogate_vocab)
    prob, prob_val = surrogate(train, W, directions, S), surrogate(val, W, directions, S)
    best, best_key, trials = None, None, []
    for l1 in size.l1_grid:
        ctl = fit_surrogate(prob, train, l1, size.ctl_steps, CTL_LR)
        with torch.no_grad():
            va = accuracy(val, surrogate_scores(prob_val, val, ctl.coefficients.float()))["acc"]
        trials.append({"l1": l1, "val_acc": va, "nonzero": len(ctl.nonzero), **ctl.history})
        key = (va, -len(ctl.nonzero))
        if best_key is None or key > best_key:
            best, best_key = ctl, key
    assert best is not None
    with torch.no_grad():  # how faithful the surrogate is on held-out data: validation, exact vs surrogate
        fidelity = {
            "surrogate_vocab": len(S),
            "val_acc_exact": accuracy(val, exact_scores(val, W, directions, best.coefficients))["acc"],
            "val_acc_surrogate": float(best_key[0]),  # type: ignore[index]
        }
    s1 = exact_scores(test, W, directions, best.coefficients)
    after = accuracy(test, s1)
    prior_scores = base["prior_scores"]
    return best, {
        "test_after": after,
        "test_after_ci95": wilson(after["acc"], after["n"]),
        "delta_acc": after["acc"] - base["acc"],
        "paired_vs_base": paired_stats(base["correct"], correct(test, s1), seed=seed),
        "paired_vs_prior": paired_stats(correct(test, prior_scores), correct(test, s1), seed=seed),
        "nonzero": len(best.nonzero),
        "l1": best.l1,
        "selection": trials,
        "surrogate_fidelity": fidelity,
        "_correct": correct(test, s1),
        "_scores": s1,
    }


def task_row(ctx: ClaimsContext, run, task: str, splits: dict, folder: Path, sae: TopKSAE, index) -> dict:
    """Both controllers, the choice prior and the paired statistics on one kept task."""
    model, tok = run.model, run.tokenizer
    W = model.lm_head.weight.detach().float()
    raw = {s: cached_features(ctx, model, tok, folder, task, s, splits[s]) for s in SPLITS}
    test = raw["test"]
    s0 = exact_scores(test, W, W[:1], None)
    base = accuracy(test, s0)
    train_base = exact_scores(raw["train"], W, W[:1], None)
    prior_scores = fit_choice_prior(raw["train"], train_base).scores(test, s0)
    prior = accuracy(test, prior_scores)
    info = {"acc": base["acc"], "correct": correct(test, s0), "prior_scores": prior_scores}
    row: dict[str, object] = {
        "task": task,
        "n": {s: len(v) for s, v in splits.items()},
        "chance": chance(test),
        "base": {**base, "ci95": wilson(base["acc"], base["n"])},
        "choice_prior": {**prior, "ci95": wilson(prior["acc"], prior["n"])},
    }
    sides = {
        "prism": (prism_encoder(model), model.prototypes.weight.detach().float()),
        "sae": (sae.encode, sae.directions.detach().float()),
    }
    ctls, feats_of = {}, {}
    for side, (enc, directions) in sides.items():
        t = time.perf_counter()
        feats = {s: encoded(f, enc) for s, f in raw.items()}
        ctls[side], row[side] = side_result(feats, W, directions, info, ctx.seed, ctx_size(ctx))
        feats_of[side] = feats
        ctx.log(
            f"controllers: {task} {side}: {base['acc']:.3f} → {row[side]['test_after']['acc']:.3f} "
            f"({row[side]['nonzero']} non-zero, λ {row[side]['l1']}; prior {prior['acc']:.3f}) "
            f"[{time.perf_counter() - t:.0f} s]"
        )
    row["prism_vs_sae"] = paired_stats(row["sae"].pop("_correct"), row["prism"].pop("_correct"), seed=ctx.seed)
    s1 = row["prism"].pop("_scores")
    row["sae"].pop("_scores")
    # the cached-feature scores against the model's own forward, with c = 0 and with PRISM's controller
    m = ctx_size(ctx).forward_check_docs
    r = sum(test.n_choices[:m])
    fwd0 = forward_scores(model, tok, splits["test"][:m])
    with model.control(ctls["prism"].coefficients.float()):
        fwd1 = forward_scores(model, tok, splits["test"][:m])
    row["forward_check"] = {
        "docs": m,
        "max_abs_diff_base": float((fwd0 - s0[:r]).abs().max()),
        "max_abs_diff_controlled": float((fwd1 - s1[:r]).abs().max()),
        "max_abs_shift": float((fwd1 - fwd0).abs().max()),  # what the controller moved: the check is not vacuous
    }
    row["trace"] = trace_prism_controller(
        model, tok, ctls["prism"], feats_of["prism"]["train"], splits["train"], index=index, top=10
    )
    return row


def controller_stage(ctx: ClaimsContext, only: Sequence[str] | None = None) -> dict[str, object]:
    """Screen the tasks, train the SAE, fit and test both controllers on each kept task (resumable; each
    finished task is saved; ``only``: just these of the kept tasks, e.g. from parallel processes)."""
    torch.set_num_threads(ctx.threads)
    t0 = time.perf_counter()
    stage = ctx.stage_dir("controllers")
    run = ctx.open_run()
    model = run.model.eval()
    size = ctx_size(ctx)
    folder = stage / "features" / backbone_identity(model).removeprefix("backbone:")[:16]
    folder.mkdir(parents=True, exist_ok=True)
    screened, splits_of = screen(ctx, run, folder, size.caps)
    K, k = model.prototypes.num_prototypes, model.prototypes.cfg.top_k
    sae, sae_info = stage_sae(ctx, run.folder, K, k)
    ctx.log(f"controllers: SAE K={K} k={k}: FVU {sae_info['fvu']:.3f}, dead {sae_info['dead_fraction']:.2f}")
    try:
        index = run.index()
    except Exception as e:  # the trace works without one (no labels or neighbours)
        ctx.log(f"controllers: no prototype index for the trace ({e})")
        index = None
    # the rows depend on the SAE too: a new SAE gets its own folder of finished tasks; the quick size is tuned
    # for CI time and may change, so its rows are keyed by it (the full rows keep the folder they were made in)
    tag = f"quick-{hashlib.sha256(repr(size).encode()).hexdigest()[:8]}" if ctx.quick else "full"
    done = stage / f"tasks-{(run.identity or 'run')[:16]}-{tag}-sae-{sae_info['cache_key']}"
    done.mkdir(exist_ok=True)
    rows = []
    kept = [r["task"] for r in screened if r["kept"]][: size.max_tasks]
    for task in [t for t in kept if only is None or t in only]:
        path = done / f"{task}.json"
        if not path.exists():
            row = task_row(ctx, run, task, splits_of[task], folder, sae, index)
            path.write_text(json.dumps(row, indent=1, default=float))
        rows.append(json.loads(path.read_text()))
    return {
        "summary": controller_summary(rows),
        "screening": screened,
        "tasks": rows,
        "sae": {"num_latents": K, "k": k, **sae_info, "other_settings_tried": list(SAE_TRIED)},
        "protocol": {
            "caps": size.caps,
            "l1_grid": list(size.l1_grid),
            "ctl_steps": size.ctl_steps,
            "ctl_lr": CTL_LR,
            "surrogate_vocab": size.surrogate_vocab,
            "forward_check_docs": size.forward_check_docs,
            "max_tasks": size.max_tasks,
            "keep_p": KEEP_P,
            "keep_margin": KEEP_MARGIN,
        },
        "stage_seconds": round(time.perf_counter() - t0, 1),
    }
