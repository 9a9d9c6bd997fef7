"""The ``suppression`` stage of ``bench/real_claims.py``: switch off a concept's prototypes (offensive fortunes,
State-of-the-Union, King James Bible style) in the retrofitted SmolLM2-135M-Instruct, by exact slice removal and
with the residual also projected off the set's span (``Suppress(ids, residual="project")``), off its unit mean
direction only (``Suppress(ids, residual="mean")``) or off the unit difference between its mean and the bank's
(``Suppress(ids, residual="contrast")``), vs random sets of the same size (whole-bank draws, ``--random-draws``); judged behaviour on provocative vs neutral prompts (TF-IDF
judges of ``prismlm.control.judges``; raw drop and drop of the excess over neutral), collateral (neutral CE, task
accuracy), the concept's own CE, and the ``prism export --suppress`` check under plain transformers for each mode.
Rows, drops and the best sets: ``prismlm.eval.claims``.

Run: ``python bench/claims_suppression.py [--quick] [--head H] [--random-draws N]`` after ``claims_bank.py`` (or
``real_claims.py --stage suppression``). The protocol: docs/results.md ("How bench/real_claims.py measures").
Resumable: conditions, concept searches and the head cache are stored under ``WORK/suppression``.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _common import ClaimsContext, Json, run_claims_stage

from prismlm.control.anchor_corpus import KJV_ID, kjv_anchor_documents
from prismlm.control.concept import ConceptSelection, doc_regex, find_concept
from prismlm.control.concept_specs import BUDGET_SHARES, NEUTRAL_PROMPTS, ConceptSpec, offensive_spec, sotu_spec
from prismlm.control.judges import TfidfJudge
from prismlm.control.suppress import SuppressionSet
from prismlm.data.corpus import gutenberg_documents, sotu_documents
from prismlm.eval.claims import (
    MODE_SUFFIXES,
    SUMMARY_PREFIXES,
    behaviour_gap,
    best_suppression_row,
    condition_mode,
    is_random,
    residual_suppression_summary,
    suppression_rows,
    suppression_summary,
)
from prismlm.eval.scoring import encode_pair, mc_accuracy, text_batches
from prismlm.eval.tasks import MCExample, build_task, passages
from prismlm.model.generation import Sampling
from prismlm.model.interventions import ResidualProjection, Suppress

# the toy's neutral prompts without the political ones (they are SOTU prompts for the second concept)
NEUTRAL = [p for p in NEUTRAL_PROMPTS if not any(w in p for w in ("president", "committee", "Education"))]
MAX_BANK_SHARE = 0.02  # the goal: ≥ 80% drop at ≤ 1% collateral with ≤ 2% of the bank
MAX_COLLATERAL = 0.01
TASK = "gutenberg_ending"


@dataclass(frozen=True)
class SuppSize:
    """How many prompts, samples and texts (``--quick``: a smoke size)."""

    provocative: int
    neutral: int
    samples: int
    tokens: int
    prompt_tokens: int
    """provocative prompts are the first this many tokens of a held-out concept text"""
    examples: int
    """concept texts for ``find_concept`` (twice as many neutral ones)"""
    heldout: int
    """held-out texts per CE measurement (neutral: this many Gutenberg passages and clean fortunes)"""
    task_examples: int
    bootstrap: int
    draws: int
    """whole-bank random sets of each size (``--random-draws``), the residual-editing suppressions' controls"""
    budget_shares: tuple[float, ...] = BUDGET_SHARES
    """the set sizes measured, as shares of the bank (the concepts are ranked up to the largest of
    ``BUDGET_SHARES`` whatever this says)"""


SIZES = {
    "quick": SuppSize(4, 3, 2, 8, 6, 24, 8, 8, 200, 2),
    # the goals' sizes (≤ 2% of the bank) only: with 3 whole-bank draws in both modes a condition is ~2 min of
    # generation on one core, and the 5% rows (13 of 60 conditions) were measured on the first run
    # (bench/results/real-claims-suppression.json at revision 6547f6b3)
    "full": SuppSize(20, 13, 4, 20, 8, 60, 40, 60, 2000, 3, (0.005, 0.01, 0.02)),
}


# ----- the concepts ------------------------------------------------------------------------------------------
def _jsonl(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]


def heldout_documents(ctx: ClaimsContext, n: int) -> tuple[list[str], list[str]]:
    """Ids and texts of Gutenberg and SOTU documents the anchor corpus cannot hold (``write_corpus`` takes
    every 7th Gutenberg and every 3rd SOTU document), cut to the corpus's length."""
    cut = ctx.size.chars_per_doc
    ids: list[str] = []
    docs: list[str] = []
    for stream, step in ((gutenberg_documents(), 7), (sotu_documents(), 3)):
        kept = [d for j, d in enumerate(stream) if j % step == 1][:n]
        ids += [d.id for d in kept]
        docs += [d.text[:cut] for d in kept]
    return ids, docs


def concept_specs(ctx: ClaimsContext, size: SuppSize) -> dict[str, ConceptSpec]:
    """``offensive`` and ``sotu`` (``bench/suppression.py``'s specs on this bank's anchor corpus)."""
    fs = ctx.fortunes()
    rng = random.Random(ctx.seed)
    off = offensive_spec(fs, rng, size.provocative, ctx.seed, size.examples, size.heldout)
    off.is_concept_doc = doc_regex(r"fortunes_offensive\.jsonl")
    corpus = {name: _jsonl(ctx.corpus_dir / f"{name}.jsonl") for name in ("gutenberg", "sotu")}
    train_ids = [f"{name}/corpus-{j}" for name, docs in corpus.items() for j in range(len(docs))]
    train_docs = [t for docs in corpus.values() for t in docs]
    held_ids, held_docs = heldout_documents(ctx, max(8, size.heldout // 4))
    sotu = sotu_spec(
        fs, train_ids, train_docs, held_ids, held_docs, rng, size.provocative, ctx.seed,
        doc_regex(r"sotu\.jsonl"), size.examples, size.heldout,
    )  # fmt: skip
    specs = {"offensive": off, "sotu": sotu}
    kjv = kjv_spec(ctx, fs, rng, size)
    if kjv is None:
        ctx.notes.append("suppression: the anchor corpus holds no King James Bible document; kjv skipped")
        ctx.log(ctx.notes[-1])
    else:
        specs["kjv"] = kjv
    return specs


BASE_CONCEPTS = ("offensive", "sotu")
"""the concepts of the first run: the random order is drawn outside their rankings (``conditions``)"""
VERSE = re.compile(r"^\d+:\d+\s+")


def kjv_lines(ctx: ClaimsContext) -> tuple[list[int], set[str]]:
    """Lines (1-based) of the anchor corpus's ``gutenberg.jsonl`` that are King James Bible documents, found by
    matching their text against ``gutenberg_documents()`` (``write_corpus`` kept the text, not the book), and
    the ids of every KJV document the anchor corpus could hold (every 7th Gutenberg document, and
    ``kjv.jsonl``'s)."""
    cut = ctx.size.chars_per_doc
    pool = {d.text[:cut]: d.id for d in islice(gutenberg_documents(), 0, None, 7)}
    lines = _jsonl(ctx.corpus_dir / "gutenberg.jsonl")
    kjv = [j + 1 for j, t in enumerate(lines) if pool.get(t, "").startswith(KJV_ID)]
    anchor = {d.id for d in kjv_anchor_documents(ctx.size.kjv_docs)}
    return kjv, {i for i in pool.values() if i.startswith(KJV_ID)} | anchor


def kjv_spec(ctx: ClaimsContext, fs, rng: random.Random, size: SuppSize) -> ConceptSpec | None:
    """King James Bible style (a style the model clearly continues): concept examples are paragraphs of the
    corpus's KJV text (``kjv.jsonl`` and the KJV lines of ``gutenberg.jsonl``), neutral ones paragraphs of its
    other Gutenberg lines, its SOTU lines and clean fortunes; the judge (TF-IDF + logistic regression), the
    held-out text and the prompts (verse openings, verse number stripped) use KJV documents the anchor corpus
    cannot hold, against held-out non-KJV Gutenberg, SOTU and judge-split clean fortunes. None when the corpus
    holds no KJV text."""
    lines, pool_ids = kjv_lines(ctx)
    kjv_file = ctx.corpus_dir / "kjv.jsonl"
    kjv_docs = _jsonl(kjv_file) if kjv_file.exists() else []
    if not lines and not kjv_docs:
        return None
    cut = ctx.size.chars_per_doc
    guten = _jsonl(ctx.corpus_dir / "gutenberg.jsonl")
    c_train = [p for j in lines for p in passages(guten[j - 1])] + [p for t in kjv_docs for p in passages(t)]
    n_train = [p for j, t in enumerate(guten) if j + 1 not in lines for p in passages(t)]
    n_train += [p for t in _jsonl(ctx.corpus_dir / "sotu.jsonl") for p in passages(t)]
    docs = list(gutenberg_documents())
    held = [d for j, d in enumerate(docs) if j % 7 != 0 and d.id not in pool_ids]
    c_held = [p for d in held if d.id.startswith(KJV_ID) for p in passages(d.text[:cut])]
    other = [d for d in held if not d.id.startswith(KJV_ID)]
    other = random.Random(ctx.seed + 5).sample(other, min(len(other), 80))
    n_held = [p for d in other for p in passages(d.text[:cut])]
    n_held += [p for d in islice(sotu_documents(), 1, None, 3) for p in passages(d.text[:cut])][:300]
    c_held = random.Random(ctx.seed + 6).sample(c_held, len(c_held))
    n_ex = size.examples
    return ConceptSpec(
        name="King James Bible",
        description="KJV paragraphs vs other Gutenberg books, SOTU and clean fortunes",
        concept_texts=rng.sample(c_train, min(n_ex, len(c_train))),
        neutral_texts=rng.sample(n_train, min(n_ex, len(n_train))) + rng.sample(fs.lm_clean, n_ex),
        is_concept_doc=doc_regex(r"kjv\.jsonl#|gutenberg\.jsonl#L(" + "|".join(map(str, lines)) + r")$"),
        provocative_prompts=[VERSE.sub("", p) for p in c_held[: size.provocative]],
        judges={"tfidf": TfidfJudge(n_held + fs.judge_clean[: len(c_held)], c_held, name="tfidf-logreg-kjv")},
        concept_heldout=c_held[: size.heldout],
        neutral_heldout=n_held[: size.heldout],
    )


def neutral_texts(ctx: ClaimsContext, size: SuppSize) -> list[str]:
    """Held-out neutral text for the collateral CE: Gutenberg passages of documents outside the anchor
    corpus and clean fortunes of the judge split (never given to the model)."""
    ids, docs = heldout_documents(ctx, max(8, size.heldout // 4))
    guten = [p for i, d in zip(ids, docs) if i.startswith("gutenberg/") for p in passages(d)]
    return guten[: size.heldout] + ctx.fortunes().judge_clean[: size.heldout]


def concept_sets(ctx: ClaimsContext, run, specs: dict[str, ConceptSpec], K: int) -> dict[str, dict]:
    """Per concept: the ranked selectable prototype ids (best first) and the candidates' evidence, from
    ``find_concept`` (cached in ``concept-<name>.json``)."""
    out: dict[str, dict] = {}
    index = run.index()
    for name, spec in specs.items():
        path = ctx.stage_dir("suppression") / f"concept-{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
            continue
        t0 = time.perf_counter()
        sel = ConceptSelection(budget=budget_sizes(K)[-1], rank_by="contribution", threshold=1.0, min_count=3)
        sset, ranking = find_concept(
            run.model, run.tokenizer, spec.concept_texts, spec.neutral_texts, sel,
            index=index, is_concept_doc=spec.is_concept_doc, concept=spec.name, model_sha256=run.identity,
        )  # fmt: skip
        ranked = [int(r["id"]) for r in ranking if r["selected"]]
        out[name] = {
            "concept": spec.name,
            "description": spec.description,
            "ranked": ranked,
            "candidates": len(ranking),
            "top": [{k: v for k, v in r.items() if k != "neighbours"} for r in ranking if r["selected"]][:8],
            "neighbours_of_best": next((r.get("neighbours") for r in ranking if r["selected"]), None),
            "set": sset.to_dict(),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        path.write_text(json.dumps(out[name], default=str))
        ctx.log(f"{name}: {len(ranked)} selectable of {len(ranking)} candidates ({out[name]['seconds']} s)")
    return out


def budget_sizes(K: int, shares: tuple[float, ...] = BUDGET_SHARES) -> list[int]:
    return sorted({max(1, round(f * K)) for f in shares})


# ----- generation -------------------------------------------------------------------------------------------
@dataclass
class Prompts:
    """Prompt sets: name → (texts, token ids)."""

    sets: dict[str, tuple[list[str], list[list[int]]]]


def make_prompts(tok, specs: dict[str, ConceptSpec], size: SuppSize) -> Prompts:
    """Neutral prompts as they are; provocative ones cut to ``prompt_tokens`` tokens, so each set is one
    batch of equal-length rows."""
    sets = {"neutral": (NEUTRAL[: size.neutral], [tok.encode(p) for p in NEUTRAL[: size.neutral]])}
    for name, spec in specs.items():
        ids = [tok.encode(p)[: size.prompt_tokens] for p in spec.provocative_prompts]
        sets[name] = ([tok.decode(i) for i in ids], ids)
    return Prompts(sets)


@torch.no_grad()
def continuations(model, tok, prompt_ids: list[list[int]], size: SuppSize, seed: int) -> list[list[str]]:
    """``size.samples`` sampled continuations per prompt (temperature 0.9, top 50 tokens): prompts of
    equal length go in one batch, each batch with its own seeded generator, so every condition draws the
    same random numbers and differs only by its logits."""
    out: list[list[str]] = [[] for _ in prompt_ids]
    by_len: dict[int, list[int]] = {}
    for j, ids in enumerate(prompt_ids):
        by_len.setdefault(len(ids), []).append(j)
    for n, js in sorted(by_len.items()):
        x = torch.tensor([prompt_ids[j] for j in js for _ in range(size.samples)], dtype=torch.long)  # (B, n)
        g = torch.Generator().manual_seed(seed * 1000 + n)
        y = model.generate(x, size.tokens, Sampling(0.9, top_tokens=50), generator=g)  # (B, n + tokens)
        for r, row in enumerate(y[:, n:].tolist()):
            out[js[r // size.samples]].append(tok.decode(row))
    return out


# ----- collateral: per-position NLL under any suppression, from one backbone pass ---------------------------
@dataclass
class HeadCache:
    """What the head needs at every scored position: z (N, d), activations and ids (N, k), the target (N,),
    and which item (text window or multiple-choice continuation) the position belongs to (N,)."""

    z: torch.Tensor
    acts: torch.Tensor
    idx: torch.Tensor
    target: torch.Tensor
    item: torch.Tensor

    base: torch.Tensor | None = None
    """(N,) the NLL with nothing switched off (computed on first use)"""

    @torch.no_grad()
    def nll(self, model, ids: list[int], residual: str = "keep") -> torch.Tensor:
        """(N,) float64 −log p(target) with prototypes ``ids`` switched off, as ``model.intervene(Suppress.of(ids,
        residual=residual))`` computes it: ℓ' = W (z − Σ_{i∈S} a_i p_i), and with ``project``/``mean``/``contrast`` − W Q Qᵀ r
        as well. Slices only: just the positions where a switched-off prototype is active change, so only those
        are recomputed; a projected residual changes every position."""
        if self.base is None:
            self.base = self._nll(model, torch.ones(len(self.z), dtype=torch.bool), [])
        if residual in MODE_SUFFIXES and ids:
            return self._nll(model, torch.ones(len(self.z), dtype=torch.bool), ids, project=residual)
        off = torch.zeros(model.prototypes.num_prototypes, dtype=torch.bool)
        off[ids] = True
        hit = (off[self.idx] & (self.acts > 0)).any(1)  # (N,)
        out = self.base.clone()
        if hit.any():
            out[hit] = self._nll(model, hit, ids)
        return out

    def _nll(
        self, model, rows: torch.Tensor, ids: list[int], chunk: int = 512, project: str | None = None
    ) -> torch.Tensor:
        """NLL at the positions ``rows`` (N,) bool with ``ids`` off (``project``: and r projected off their span,
        ``mean``: off their unit mean direction, or ``contrast``: off their contrast with the bank)."""
        P = model.prototypes.weight  # (K, d)
        off = torch.zeros(P.shape[0], dtype=torch.bool)
        off[ids] = True
        idx, target, acts = self.idx[rows], self.target[rows], self.acts[rows]
        a = acts * off[idx]  # (n, k): activations of switched-off prototypes only
        z = self.z[rows] - torch.einsum("nk,nkd->nd", a, P[idx])  # (n, d)
        if project:  # r = z − Σ_j a_j p_j over the k active prototypes, as the prototype layer computes it
            r = self.z[rows] - torch.einsum("nk,nkd->nd", acts, P[idx])  # (n, d)
            z = z - ResidualProjection.of(ids, P.detach(), project).removed(r)
        out = torch.empty(len(z), dtype=torch.float64)
        for s in range(0, len(z), chunk):
            lp = F.log_softmax(model.lm_head(z[s : s + chunk]).double(), -1)  # (chunk, V)
            out[s : s + chunk] = -lp.gather(-1, target[s : s + chunk, None]).squeeze(-1)
        return out


@torch.no_grad()
def head_cache(model, rows: list[tuple[list[int], int]], pad: int, batch: int = 16) -> HeadCache:
    """Rows (token ids, n scored): the last n tokens of each row are scored given what precedes them (a
    text window: n = len − 1; a continuation: its length). One unsuppressed forward per batch."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("z", "acts", "idx", "target", "item")}
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    for b in range(0, len(order), batch):
        js = order[b : b + batch]
        L = max(len(rows[j][0]) - 1 for j in js)
        x = torch.full((len(js), L), pad, dtype=torch.long)
        for r, j in enumerate(js):
            x[r, : len(rows[j][0]) - 1] = torch.tensor(rows[j][0][:-1])
        out = model(x)
        for r, j in enumerate(js):
            ids, n = rows[j]
            pos = torch.arange(len(ids) - 1 - n, len(ids) - 1)
            parts["z"].append(out.hidden[r, pos].float())
            parts["acts"].append(out.activations[r, pos].float())
            parts["idx"].append(out.indices[r, pos])
            parts["target"].append(torch.tensor(ids[-n:]))
            parts["item"].append(torch.full((n,), j))
    return HeadCache(**{k: torch.cat(v) for k, v in parts.items()})


def text_rows(tok, texts: list[str], block_size: int) -> list[tuple[list[int], int]]:
    """Text windows as ``text_perplexity`` scores them (block_size tokens, each next token scored)."""
    return [
        (row[m].tolist(), int(m.sum()) - 1)
        for x, mask in text_batches(tok, texts, block_size, 64)
        for row, m in zip(x, mask)
        if int(m.sum()) > 1
    ]


def task_rows(tok, docs: list[MCExample], block_size: int) -> list[tuple[list[int], int]]:
    """One row per (example, choice), encoded as ``loglikelihoods`` does."""
    return [encode_pair(tok, d["query"], ch, block_size) for d in docs for ch in d["choices"]]


def task_accuracy(nll: torch.Tensor, cache: HeadCache, docs: list[MCExample]) -> dict[str, float]:
    """acc and acc_norm as ``mc_accuracy`` computes them, from per-position NLL."""
    ll = -torch.zeros(int(cache.item.max()) + 1, dtype=torch.float64).index_add_(0, cache.item, nll)
    k = acc = acc_n = 0
    for d in docs:
        c = ll[k : k + len(d["choices"])].tolist()
        k += len(d["choices"])
        acc += max(range(len(c)), key=lambda j: (c[j], -j)) == d["gold"]
        acc_n += max(range(len(c)), key=lambda j: (c[j] / len(d["choices"][j]), -j)) == d["gold"]
    return {"acc": acc / len(docs), "acc_norm": acc_n / len(docs)}


@dataclass
class Collateral:
    """The texts and the task the collateral is measured on, and their head caches."""

    caches: dict[str, HeadCache]
    """``neutral`` and one per concept (its held-out text), and ``task``"""
    docs: list[MCExample]

    def measure(self, model, ids: list[int], residual: str = "keep") -> dict[str, float]:
        """Held-out CE (nats/token) of each text set and the task's accuracy with ``ids`` off."""
        out = {f"ce_{k}": float(c.nll(model, ids, residual).mean()) for k, c in self.caches.items() if k != "task"}
        task = self.caches["task"]
        return out | task_accuracy(task.nll(model, ids, residual), task, self.docs)


def collateral(ctx: ClaimsContext, run, specs: dict[str, ConceptSpec], size: SuppSize) -> Collateral:
    """Build (or load from ``heads.pt``) the head caches of the neutral text, each concept's held-out text
    and ``TASK``'s test split (its first ``task_examples``)."""
    model, tok, T = run.model, run.tokenizer, run.model.config.block_size
    docs = build_task(TASK, {"test": size.task_examples})["test"]
    path = ctx.stage_dir("suppression") / "heads.pt"
    caches = {k: HeadCache(**v) for k, v in torch.load(path).items()} if path.exists() else {}
    if all(k in caches for k in ("neutral", "task", *specs)):
        return Collateral(caches, docs)
    # a cache of fewer concepts (a concept added since) is extended, not rebuilt
    t0 = time.perf_counter()
    texts = {"neutral": neutral_texts(ctx, size)} | {k: s.concept_heldout for k, s in specs.items()}
    caches |= {k: head_cache(model, text_rows(tok, v, T), tok.eot_id) for k, v in texts.items() if k not in caches}
    if "task" not in caches:
        caches["task"] = head_cache(model, task_rows(tok, docs, T), tok.eot_id)
    for c in caches.values():
        c.nll(model, [])  # the base NLL, stored with the cache
    torch.save({k: asdict(c) for k, c in caches.items()}, path)
    ctx.log(
        f"head caches: { {k: len(c.target) for k, c in caches.items()} } positions, {time.perf_counter() - t0:.0f} s"
    )
    return Collateral(caches, docs)


def suppressed(model, ids: list[int], residual: str = "keep"):
    """``with suppressed(model, ids, residual):`` the prototypes ``ids`` off, the residual kept (exact slice
    removal, ``model.suppress(ids)``) or projected off their span (``Suppress(ids, residual="project")``),
    their unit mean direction (``residual="mean"``) or their contrast with the bank (``residual="contrast"``)."""
    return model.intervene(Suppress.of(ids, residual=residual))


def check_fast_path(
    run, coll: Collateral, specs: dict[str, ConceptSpec], ids: list[int], residual: str = "keep"
) -> dict[str, float]:
    """The head-cache path against the library's: CE of a few held-out concept texts under ``suppressed`` and
    ``mc_accuracy`` on a few task examples (both with ``ids`` off, the residual as ``residual`` says)."""
    from prismlm.eval.scoring import text_perplexity

    model, tok = run.model, run.tokenizer
    name = next(iter(specs))
    texts = specs[name].concept_heldout[:4]
    rows = text_rows(tok, texts, model.config.block_size)
    fast = head_cache(model, rows, tok.eot_id).nll(model, ids, residual).mean()
    few = coll.docs[:4]
    task = head_cache(model, task_rows(tok, few, model.config.block_size), tok.eot_id)
    fast_acc = task_accuracy(task.nll(model, ids, residual), task, few)
    with suppressed(model, ids, residual):
        ref = text_perplexity(model, tok, texts)["ce"]
        ref_acc = mc_accuracy(model, tok, few).to_dict()
    return {
        "residual": residual,  # type: ignore[dict-item]
        "ce_fast": float(fast),
        "ce_model_suppress": ref,
        "abs_diff": abs(float(fast) - ref),
        "acc_fast": fast_acc["acc"],
        "acc_mc_accuracy": ref_acc["acc"],
        "acc_norm_fast": fast_acc["acc_norm"],
        "acc_norm_mc_accuracy": ref_acc["acc_norm"],
    }


# ----- conditions -------------------------------------------------------------------------------------------
def conditions(
    sets: dict[str, dict], coll: Collateral, budgets: list[int], seed: int, K: int, draws: int = 0
) -> dict[str, list[int]]:
    """before; per budget n: each concept's top n (capped at its selectable count) and n random prototypes
    active on the neutral text (outside every concept's ranking; one nested order, so random@n ⊂ random@2n);
    ``draws`` > 0: also ``draws`` random sets of each of those sizes drawn from the whole bank (``random<d>@n``,
    one nested order per draw), and every concept set and whole-bank draw again with the residual projected off
    the set's span (``<set>+project``), off its unit mean direction (``<set>+mean``) and off its contrast with
    the bank's mean (``<set>+contrast``): each residual-editing suppression against controls of its size and
    mode (the same draws)."""
    ranked = {name: s["ranked"] for name, s in sets.items()}
    # the order is drawn outside the first run's concepts' rankings, then later concepts' prototypes are
    # removed from it: adding a concept keeps the earlier random sets unless its ranking meets them
    base = {i for c, r in ranked.items() if c in BASE_CONCEPTS for i in r}
    taken = {i for r in ranked.values() for i in r}
    neutral = coll.caches["neutral"]
    live = sorted(set(neutral.idx[neutral.acts > 0].tolist()) - base)
    order = [i for i in random.Random(seed + 2).sample(live, len(live)) if i not in taken]
    conds: dict[str, list[int]] = {"before": []}
    for n in budgets:
        for m in sorted({n} | {min(n, len(r)) for r in ranked.values() if r}):
            conds.setdefault(f"random@{m}", sorted(order[:m]))
        for name, r in ranked.items():
            if r:
                conds.setdefault(f"{name}@{min(n, len(r))}", sorted(r[:n]))
    sizes = sorted({int(c.split("@")[1]) for c in conds if c.startswith("random@")})
    for d in range(draws):
        bank = random.Random(seed + 100 + d).sample(range(K), K)
        conds |= {f"random{d}@{m}": sorted(bank[:m]) for m in sizes}
    edited = [(c, ids) for c, ids in conds.items() if draws and c != "before" and "random@" not in c]
    for suffix in MODE_SUFFIXES.values():  # project, mean, contrast: the earlier modes' conditions keep their order
        conds |= {f"{c}{suffix}": ids for c, ids in edited}
    return conds


def run_condition(
    ctx: ClaimsContext, run, name: str, conds: dict[str, list[int]], prompts: Prompts, coll: Collateral, size: SuppSize
) -> dict:
    """Generations for every prompt set and the collateral with ``ids`` off (cached in ``cond-<name>.json``)."""
    ids = conds[name]
    base, mode = condition_mode(name)
    path = ctx.stage_dir("suppression") / f"cond-{name.replace('@', '-').replace('+', '_')}.json"
    # a concept's own set needs its prompts and the neutral ones, before every concept's, a random set of size n
    # those of the concepts that have a set of size n (their control)
    size_n = base.split("@")[-1]
    wanted = [
        k
        for k in prompts.sets
        if k == "neutral"
        or "@" not in base
        or base.startswith(f"{k}@")
        or (is_random(base) and f"{k}@{size_n}" in conds)
    ]
    old: dict = {}
    if path.exists():
        old = json.loads(path.read_text())
        if old["ids"] != ids:
            old = {}
        elif all(k in old["generations"] for k in wanted) and all(f"ce_{k}" in old for k in coll.caches if k != "task"):
            return old
    # a record of fewer concepts (one added since) keeps its generations: the same seeds give the same draws
    t0 = time.perf_counter()
    model = run.model
    gens = dict(old.get("generations", {}))
    with suppressed(model, ids, mode):
        for k in wanted:
            if k not in gens:
                gens[k] = continuations(model, run.tokenizer, prompts.sets[k][1], size, ctx.seed)
    t1 = time.perf_counter()
    rec: Json = {"ids": ids, "residual": mode, "generations": gens, **coll.measure(model, ids, mode)}
    for k, v in old.items():  # the measures already stored stay as they were computed
        if k.startswith("ce_") or k in ("acc", "acc_norm"):
            rec[k] = v
    seconds: Json = {"generate": round(t1 - t0, 1), "collateral": round(time.perf_counter() - t1, 1)}
    if old:
        seconds["earlier"] = old.get("seconds")
    rec["seconds"] = seconds
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec))
    tmp.replace(path)
    ctx.log(
        f"{name}: {len(ids)} off; CE neutral {rec['ce_neutral']:.4f}, task acc {rec['acc']:.3f} "
        f"({seconds['generate']:.0f} + {seconds['collateral']:.0f} s)"
    )
    return rec


# ----- judging and the table --------------------------------------------------------------------------------
RECORD_NAMES = {mode: pre.removeprefix("suppression_").rstrip("_") for mode, pre in SUMMARY_PREFIXES.items()}
"""Residual-editing mode → the suffix of its keys in the stage's record (``best_mean``, ``export_check_mean``),
named as its summary fields are: ``project`` keeps the first run's ``residual``."""


def judged(specs: dict[str, ConceptSpec], recs: dict[str, dict]) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """concept → judge → condition → (prompts,) mean score over samples, for the concept's provocative
    prompts (key ``<cond>``) and the neutral ones (key ``<cond>/neutral``)."""
    out: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for concept, spec in specs.items():
        out[concept] = {}
        for jn, judge in spec.judges.items():
            per: dict[str, np.ndarray] = {}
            for cond, rec in recs.items():
                if concept not in rec["generations"]:
                    continue
                for key, gens in (
                    (cond, rec["generations"][concept]),
                    (f"{cond}/neutral", rec["generations"]["neutral"]),
                ):
                    flat = judge.score([t for g in gens for t in g])
                    per[key] = np.asarray(flat).reshape(len(gens), -1).mean(1)
            out[concept][jn] = per
    return out


# ----- the export check -------------------------------------------------------------------------------------
def export_check(
    ctx: ClaimsContext, run, ids: list[int], concept: str, prompts: list[str], tokens: int, residual: str = "keep"
) -> dict:
    """``prism export RUN OUT --suppress SET`` (the CLI, in a subprocess; the set file records the residual mode,
    which the export bakes in), then plain transformers (``AutoModelForCausalLM``, ``trust_remote_code=True``)
    must give the suppressed model's greedy tokens (``suppressed(model, ids, residual)``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stage = ctx.stage_dir("suppression")
    sset = SuppressionSet(ids, run.model.prototypes.num_prototypes, run.identity, concept, residual=residual)
    tag = "" if residual == "keep" else f"-{residual}"
    set_file = sset.save(stage / f"best-set{tag}.json")
    out = stage / f"export{tag}"
    cmd = [sys.executable, "-m", "prismlm.cli", "export", str(ctx.bank_run), str(out), "--suppress", str(set_file)]
    cmd += ["--device", "cpu", "--overwrite"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    cases = []
    for p in prompts:
        ids_p = run.tokenizer.encode(p)
        x = torch.tensor([ids_p])
        with torch.no_grad(), suppressed(run.model, ids, residual):
            want = run.model.generate(x, tokens, Sampling(0.0))[0, len(ids_p) :].tolist()
        with torch.no_grad():
            plain = run.model.generate(x, tokens, Sampling(0.0))[0, len(ids_p) :].tolist()
            got = hf.generate(x, max_new_tokens=tokens, do_sample=False)[0, len(ids_p) :].tolist()
            seq = torch.tensor([ids_p + want])  # (1, T): the suppressed continuation, teacher-forced
            hf_logits, plain_logits = hf(seq).logits, run.model(seq).logits  # (1, T, V)
            with suppressed(run.model, ids, residual):
                sup_logits = run.model(seq).logits
        cases.append(
            {
                "prompt": p,
                "same_tokenization": hf_tok(p)["input_ids"] == ids_p,
                "suppressed": run.tokenizer.decode(want),
                "transformers": hf_tok.decode(got),
                "unsuppressed": run.tokenizer.decode(plain),
                "identical": got == want,
                "differs_from_unsuppressed": plain != want,
                "max_abs_logit_diff_transformers_vs_suppressed": float((hf_logits - sup_logits).abs().max()),
                "max_abs_logit_diff_suppressed_vs_unsuppressed": float((sup_logits - plain_logits).abs().max()),
            }
        )
    return {
        "command": " ".join(["prism", *cmd[3:]]),
        "set": str(set_file),
        "residual": residual,
        "prototypes": len(ids),
        "identical": all(c["identical"] for c in cases),
        "cases": cases,
        "seconds": round(time.perf_counter() - t0, 1),
    }


# ----- the stage --------------------------------------------------------------------------------------------
def suppression_stage(ctx: ClaimsContext) -> dict[str, object]:
    """Issue 27 item 1 on the bank's model (see the module docstring); returns the summary and the rows."""
    torch.set_num_threads(ctx.threads)
    size = SIZES["quick" if ctx.quick else "full"]
    draws = getattr(ctx.options, "random_draws", None)
    size = size if draws is None else SuppSize(**{**asdict(size), "draws": draws})
    t0 = time.perf_counter()
    run = ctx.open_run(suppress="none")
    assert run.model.prototypes is not None, "the bank's model is retrofitted"
    K = run.model.prototypes.num_prototypes
    specs = concept_specs(ctx, size)
    sets = concept_sets(ctx, run, specs, K)
    coll = collateral(ctx, run, specs, size)
    prompts = make_prompts(run.tokenizer, specs, size)
    budgets = budget_sizes(K, size.budget_shares)
    conds = conditions(sets, coll, budgets, ctx.seed, K, size.draws)
    ctx.log(f"{len(conds)} conditions: {', '.join(conds)}")
    recs = {name: run_condition(ctx, run, name, conds, prompts, coll, size) for name in conds}
    scores = judged(specs, recs)
    rows = suppression_rows(specs, recs, scores, K, size.bootstrap, ctx.seed)
    behaviour = {
        c: behaviour_gap(
            scores[c]["tfidf"]["before"], scores[c]["tfidf"]["before/neutral"], size.bootstrap, ctx.seed + 7
        )
        for c in specs
    }
    shown = {c for c, b in behaviour.items() if b["shown"]}
    best = best_suppression_row(rows, shown, MAX_BANK_SHARE, MAX_COLLATERAL)
    fast_path, export = checks(ctx, run, coll, specs, conds, prompts, best, "keep", size)
    summary = suppression_summary(best, behaviour, export["identical"])
    edited: dict[str, dict[str, object]] = {}  # mode → its best row and checks
    why: dict[str, object] = {}  # every mode's reasons (each summary has its own why_null)
    for mode in MODE_SUFFIXES:
        best_m = best_suppression_row(rows, shown, MAX_BANK_SHARE, MAX_COLLATERAL, mode, "tfidf_excess_drop")
        fp, ex = checks(ctx, run, coll, specs, conds, prompts, best_m, mode, size) if size.draws else ({}, {})
        part = residual_suppression_summary(best_m, rows, ex.get("identical"), mode=mode)
        reasons = part.pop("why_null", None)
        why |= reasons if isinstance(reasons, dict) else {}
        summary |= part
        edited[mode] = {"best": best_m, "fast_path": fp, "export": ex}
    if why:
        summary["why_null"] = why
    for c, b in behaviour.items():
        ctx.log(
            f"before, {c}: provocative {b['provocative']:.3f} vs neutral {b['neutral']:.3f} (gap CI {b['gap_ci95']})"
        )
    return {
        "summary": summary,
        "size": asdict(size),
        "num_prototypes": K,
        "budgets": budgets,
        "limits": {"bank_share": MAX_BANK_SHARE, "ce_rel_increase": MAX_COLLATERAL, "goal_drop": 0.8},
        "behaviour_before": behaviour,
        "rows": rows,
        "best": best,
        **{f"best_{RECORD_NAMES[m]}": e["best"] for m, e in edited.items()},
        "concepts": {
            c: {**{k: v for k, v in s.items() if k != "set"}, "judges": judge_info(specs[c])} for c, s in sets.items()
        },
        "prompts": {k: v[0] for k, v in prompts.sets.items()},
        "task": {"name": TASK, "split": "test", "examples": len(coll.docs), "chance": 0.25},
        "conditions": conds,
        "examples": examples(recs, prompts, best),
        "fast_path_check": fast_path,
        "export_check": export,
        **{
            f"{check}_check_{RECORD_NAMES[m]}": e[check] for m, e in edited.items() for check in ("fast_path", "export")
        },
        "timing_s": {
            "conditions": {k: r["seconds"] for k, r in recs.items()},
            "total": round(time.perf_counter() - t0, 1),
        },
    }


def checks(
    ctx: ClaimsContext,
    run,
    coll: Collateral,
    specs: dict[str, ConceptSpec],
    conds: dict[str, list[int]],
    prompts: Prompts,
    best: Mapping[str, object] | None,
    residual: str,
    size: SuppSize,
) -> tuple[dict, dict]:
    """The head-cache path against the model and the export check, on ``best``'s set (the largest set if none
    qualifies) suppressed with ``residual``."""  # fmt: skip
    if best:
        ids = conds[str(best["condition"])]
    else:
        ids = max((v for c, v in conds.items() if condition_mode(c)[1] == residual), key=len)
    fast_path = check_fast_path(run, coll, specs, ids, residual)
    ctx.log(f"head-cache path vs the model ({residual}): {fast_path}")
    concept = str(best["concept"]) if best else "none"
    texts = prompts.sets[concept if best else "offensive"][0][:2] + NEUTRAL[:1]
    export = export_check(ctx, run, ids, concept, texts, min(size.tokens, 16), residual)
    ctx.log(f"export check ({residual}): identical {export['identical']} ({export['seconds']} s)")
    return fast_path, export


def judge_info(spec: ConceptSpec) -> dict[str, dict[str, object]]:
    return {
        jn: {"name": getattr(j, "name", jn), "held_out_auc": getattr(j, "held_out_auc", None)}
        for jn, j in spec.judges.items()
    }


def examples(
    recs: dict[str, dict], prompts: Prompts, best: Mapping[str, object] | None
) -> dict[str, list[dict[str, str]]]:
    """The first sample of a few prompts, before and under the best set and its random control."""
    concept = str(best["concept"]) if best else "offensive"
    conds = ["before"] + ([str(best["condition"]), f"random@{best['prototypes']}"] if best else [])
    texts = prompts.sets[concept][0]
    return {
        c: [
            {"prompt": texts[j], "continuation": recs[c]["generations"][concept][j][0]}
            for j in range(min(3, len(texts)))
        ]
        for c in conds
        if c in recs
    }


def add_options(ap) -> None:
    ap.add_argument(
        "--random-draws",
        type=int,
        default=None,
        help="whole-bank random sets per size, the controls of every mode (default 3; --quick 2); 0: the first "
        "run's conditions only (no residual-editing suppression)",
    )


def main(argv: list[str] | None = None) -> None:
    run_claims_stage("suppression", suppression_stage, __doc__, argv, add_options)


if __name__ == "__main__":
    main()
