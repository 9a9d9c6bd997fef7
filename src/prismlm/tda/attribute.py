"""`attribute`: the training sequences that most influenced a prompt and/or its completion (spec §3.2).

A query is tokens ``[eot] + prompt + completion``; its measured tokens' block gradients come from one
forward pass, and it is scored by the cached postings (``AttributionCache``, fast) or by exact block
gradients (``FullGradients``, the reference). Invariant: an item's prototype contributions are the exact
terms of its prototype-space score, and its snippet marks its most-contributing token (the exact
per-token decomposition ``I(q, j) = Σ_t Σ_i a_{t,i} u_tᵀ H_i⁻¹ G_{q,i}``). What to measure, how to search
and how to re-rank are the parameter objects ``QuerySpec``, ``SearchSpec`` and ``Rescoring``; the method
and its measured quality: docs/attribution.md.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict, cast

import numpy as np
import torch

from prismlm.artifacts import write_output
from prismlm.errors import ConfigError, ModelError
from prismlm.model import eval_mode
from prismlm.tda.cache import AttributionCache
from prismlm.tda.gradients import BlockGradients, output_gradients, query_table
from prismlm.tda.influence import Curvature, FullGradients, query_gradients

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.tokenizer import Tokenizer
    from prismlm.model import PrismLM
    from prismlm.tda.search import SearchIndex

__all__ = [
    "AttributedRecord",
    "AttributedSequence",
    "Attribution",
    "AttributionRecord",
    "QuerySpec",
    "Rescorer",
    "Rescoring",
    "SearchSpec",
    "attribute",
    "make_query",
]


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    """``ConfigError`` "NAME must be RULE, got VALUE" unless ``ok`` (NAME: ``Class.field``, which a front end
    maps to its own option name)."""
    if not ok:
        raise ConfigError(f"{name} must be {rule}, got {value!r}", param=name)


@dataclass(frozen=True)
class QuerySpec:
    """What is measured of the attributed text: its completion (``answer``), its last ``completion``
    tokens, or ``generate`` sampled tokens (at most one of the three); by default every token."""

    answer: str | None = None
    """A completion appended to the text: only its tokens are measured."""
    completion: int | None = None
    """Measure only the last N tokens of the text (of the token ids, when they are given)."""
    generate: int = 0
    """Sample N tokens after the text and measure them."""
    temperature: float = 0.0
    """Sampling temperature of ``generate`` (0 = greedy)."""
    seed: int = 0
    """Sampling seed of ``generate``."""

    def __post_init__(self) -> None:
        _check(self.completion is None or self.completion >= 1, "QuerySpec.completion", ">= 1", self.completion)
        _check(self.generate >= 0, "QuerySpec.generate", ">= 0", self.generate)
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "QuerySpec.temperature",
            "a finite number >= 0",
            self.temperature,
        )
        if sum(x is not None and x != 0 for x in (self.answer, self.completion, self.generate)) > 1:
            raise ConfigError(
                "use at most one of QuerySpec.answer, QuerySpec.completion and QuerySpec.generate, "
                f"got {self.answer!r}, {self.completion!r}, {self.generate!r}",
                param=("QuerySpec.answer", "QuerySpec.completion", "QuerySpec.generate"),
            )


@dataclass(frozen=True)
class SearchSpec:
    """How the top training sequences are found and how many are shown."""

    top: int = 10
    """Training sequences (documents, for a document-aggregated cache) to show."""
    method: Literal["cached", "full"] = "cached"
    """``cached`` (the postings cache) or ``full`` (exact block gradients, the reference)."""
    search: Literal["auto", "exact", "approximate"] = "auto"
    """With a cache: ``auto`` (its approximate-search index when there is one, else the exact scan),
    ``exact`` (scan every posting of the query's prototypes) or ``approximate`` (the index, required)."""
    candidates: int = 32
    """Approximate search: sequences proposed per long posting list (the HNSW beam is max(64, candidates)),
    then scored exactly."""
    nprobe: int = 16
    """Approximate search (IVF): cells probed per posting list."""
    max_sequences: int | None = None
    """``full``: the first N training sequences only."""

    def __post_init__(self) -> None:
        _check(self.top >= 1, "SearchSpec.top", ">= 1", self.top)
        _check(self.method in ("cached", "full"), "SearchSpec.method", "cached or full", self.method)
        _check(
            self.search in ("auto", "exact", "approximate"),
            "SearchSpec.search",
            "auto, exact or approximate",
            self.search,
        )
        _check(self.candidates >= 1, "SearchSpec.candidates", ">= 1", self.candidates)
        _check(self.nprobe >= 1, "SearchSpec.nprobe", ">= 1", self.nprobe)
        _check(
            self.max_sequences is None or self.max_sequences >= 1,
            "SearchSpec.max_sequences",
            ">= 1",
            self.max_sequences,
        )


@dataclass(frozen=True)
class Rescoring:
    """The hybrid: the ``candidates`` best sequences by prototype space re-ranked by a whole-network score.
    ``attribute`` takes that score itself as its ``rescorer``; the application layer builds it from
    ``method``."""

    method: Literal["none", "ekfac", "gradient"] = "none"
    """The whole-network score: ``none``, ``ekfac`` (kronfluence EK-FAC on every ``nn.Linear``, factors fitted
    once per run and reused; the ``attribution`` extra) or ``gradient`` (whole-network gradient dot
    products)."""
    candidates: int = 128
    """Candidates re-scored per query."""

    def __post_init__(self) -> None:
        _check(self.method in ("none", "ekfac", "gradient"), "Rescoring.method", "none, ekfac or gradient", self.method)
        _check(self.candidates >= 1, "Rescoring.candidates", ">= 1", self.candidates)


class Rescorer(Protocol):
    """A whole-network score of one query against chosen training sequences (the hybrid's re-ranker)."""

    name: str

    def scores(self, query: tuple[list[int], int], train_ids: list[int]) -> np.ndarray:
        """(len(train_ids),) scores of ``query`` = (token ids, measure_from) on those training sequences."""
        ...


@dataclass
class AttributedSequence:
    """One training sequence (or document) and its influence on the query."""

    rank: int
    """1-based rank in ``Attribution.top``."""
    sequence: int
    """Training sequence id j (tokens ``shards.train.sequence(j, T)``); for a document-aggregated cache,
    the first sequence of the ranked document."""
    score: float
    """Its influence on the query (prototype space; the rescorer's score when re-scored)."""
    prototypes: list[dict[str, float]]
    """The connecting prototypes (at most 5): [{"id", "contribution"}], largest |contribution| first."""
    doc_index: int | None = None
    """The document of the snippet's token; for a document-aggregated cache, the ranked document."""
    doc_id: str | None = None
    """That document's id in the corpus (when the shards record one)."""
    snippet: str = ""
    """Text around the training token that contributed most, marked ⟦like this⟧."""


class AttributedRecord(TypedDict):
    """``AttributedSequence`` as a dict (its fields, in order)."""

    rank: int
    sequence: int
    score: float
    prototypes: list[dict[str, float]]
    doc_index: int | None
    doc_id: str | None
    snippet: str


class AttributionRecord(TypedDict):
    """``Attribution.to_dict()``: its fields, in order."""

    prompt: str
    completion: str
    method: str
    query_loss: float
    measured_tokens: int
    top: list[AttributedRecord]
    num_train: int
    seconds: float
    notes: list[str]


@dataclass
class Attribution:
    """Result of ``attribute``: the query and its ``top`` training sequences, best first."""

    prompt: str
    """The text before the measured tokens."""
    completion: str
    """The measured tokens' text ("" when every token is measured)."""
    method: str
    """``cached`` (the exact scan of the postings), ``cached-search`` (candidates from the cache's
    approximate-search sidecar, scores exact) or ``full``; ``+ekfac`` / ``+gradient`` when re-scored."""
    query_loss: float
    """Summed cross-entropy of the measured tokens."""
    measured_tokens: int
    """How many tokens are measured."""
    top: list[AttributedSequence]
    """The best training sequences, ``min(top, num_train)`` of them, rank 1 first."""
    num_train: int
    """Training sequences (documents) scored."""
    seconds: float
    """Wall time of the attribution."""
    notes: list[str] = field(default_factory=list)
    """What the reader should know (a cropped query, document ranking, re-scoring)."""

    def to_dict(self) -> AttributionRecord:
        return cast("AttributionRecord", asdict(self))  # the fields, recursively: AttributionRecord's

    def to_json(self, path: str | Path, option: str = "path") -> None:
        write_output(path, json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n", option=option)


def make_query(
    tokenizer: Tokenizer, prompt: str, completion: str | None = None, *, completion_tokens: int | None = None
) -> tuple[list[int], int]:
    """(token ids, measure_from) of a query: ``[eot] + prompt (+ completion)``; measured are the completion's
    tokens, or the last ``completion_tokens`` tokens, or all tokens."""
    p = tokenizer.encode(prompt) if prompt else []
    c = tokenizer.encode(completion) if completion else []
    ids = [tokenizer.eot_id] + p + c
    if c:
        start = 1 + len(p)
    elif completion_tokens:
        if completion_tokens >= len(ids):
            raise ConfigError(
                f"QuerySpec.completion {completion_tokens} is not shorter than the text ({len(ids) - 1} "
                f"tokens); measure fewer tokens",
                param="QuerySpec.completion",
            )
        start = len(ids) - completion_tokens
    else:
        start = 1
    if len(ids) < 2:
        raise ConfigError("nothing to attribute: the text is empty; give a prompt or a completion")
    return ids, start


@dataclass
class _Ranking:
    """The best units of one query and the prototype-space terms their items are explained by."""

    order: np.ndarray
    """(n,) int64 unit ids (sequences, or documents), best first."""
    scores: np.ndarray
    """(n,) float64 their scores."""
    terms: tuple[np.ndarray, np.ndarray, np.ndarray]
    """(unit (P,), prototype (P,), contribution (P,)): the query's score terms, one per (unit, prototype)."""
    method: str
    num_train: int
    curvature: Curvature | None


def attribute(
    model: PrismLM,
    tokenizer: Tokenizer,
    prompt: str,
    query: QuerySpec = QuerySpec(),
    *,
    source: AttributionCache | FullGradients,
    search: SearchSpec = SearchSpec(),
    index: SearchIndex | None = None,
    rescorer: Rescorer | None = None,
    rescoring: Rescoring = Rescoring(),
    shards: ShardSet | None = None,
    token_ids: Sequence[int] | None = None,
    snippet_tokens: int = 24,
) -> Attribution:
    """The ``search.top`` training sequences that most influenced ``prompt`` (what of it is measured:
    ``query``) in the PRISM ``model`` (``tokenizer``: its tokenizer), scored by ``source``: the cached
    postings (``AttributionCache``) or the full block gradients (``FullGradients``).

    ``token_ids`` attributes exactly these tokens (e.g. an explained generation, whose text would not
    always re-tokenize to the same ids); ``query.completion`` then counts from their end. ``index`` (a
    ``prismlm.tda.search.SearchIndex`` of the cache): candidates come from approximate search in each long
    posting list (``search.candidates``, ``search.nprobe``) instead of a scan of every posting of the
    query's prototypes; the scores and contributions of the sequences found are the exact scan's.
    ``rescorer`` (the hybrid): the ``rescoring.candidates`` best sequences by prototype space are re-ranked
    by ``rescorer.scores(query, ids)``, a whole-network score; the items' scores are then that score, and
    their prototypes the prototype-space contributions. ``shards`` (for snippets) defaults to none."""
    t0 = time.perf_counter()
    _check_sources(model, source, index, rescorer)
    ids, start, prompt, completion = _query_tokens(model, tokenizer, prompt, query, token_ids)
    notes = []
    if len(ids) > model.config.block_size + 1:
        notes.append(f"query cropped to its last {model.config.block_size + 1} tokens (the context window)")
    q = query_gradients(model, [(ids, start)])
    by_document = isinstance(source, AttributionCache) and source.aggregate == "document"
    if by_document:
        notes.append("the cache aggregates documents: scores are per document, each shown through its first sequence")
    k = max(search.top, rescoring.candidates) if rescorer is not None else search.top  # candidates, then the top
    if isinstance(source, AttributionCache) and index is not None:
        ranked = _rank_by_search(source, index, q, k, search)
    elif isinstance(source, AttributionCache):
        ranked = _rank_by_cache(source, q, k)
    else:
        ranked = _rank_by_full(source, q, k)
    if rescorer is not None:
        notes.append(_rescore(ranked, rescorer, rescoring.candidates, (ids, start), search.top))
    else:
        ranked.order, ranked.scores = ranked.order[: search.top], ranked.scores[: search.top]
    shown = source.first_sequence(ranked.order) if isinstance(source, AttributionCache) and by_document else None
    items = _items(ranked, shown)
    if shards is not None and items:
        _fill_snippets(model, shards, tokenizer, items, q, ranked.curvature, snippet_tokens)
        if by_document:  # the ranked document, not the one of the snippet's token
            for it, j in zip(items, ranked.order.tolist(), strict=True):
                it.doc_index = int(j)
                it.doc_id = shards.train.doc_ids[j] if j < len(shards.train.doc_ids) else None
    assert q.loss is not None  # query_gradients measures every query's loss
    return Attribution(
        prompt=prompt,
        completion=completion or "",
        method=ranked.method,
        query_loss=float(q.loss.sum()),
        measured_tokens=len(ids) - start,
        top=items,
        num_train=ranked.num_train,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _check_sources(
    model: PrismLM,
    source: AttributionCache | FullGradients,
    index: SearchIndex | None,
    rescorer: Rescorer | None,
) -> None:
    """``ModelError`` / ``ConfigError`` for a model without prototypes or sources that do not fit together."""
    if model.prototypes is None:
        raise ModelError(
            "prototype-space attribution needs a PRISM model; this is the dense baseline (it has no prototypes)"
        )
    if not isinstance(source, AttributionCache | FullGradients):
        raise ConfigError(
            f"source must be an AttributionCache (fast, the postings cache) or FullGradients (reference), "
            f"got {type(source).__name__}"
        )
    if index is not None and not isinstance(source, AttributionCache):
        raise ConfigError("index is the approximate-search sidecar of a cache: pass the cache as the source")
    if rescorer is not None and isinstance(source, AttributionCache) and source.aggregate == "document":
        raise ConfigError(
            "re-scoring needs training sequences; this cache ranks documents (aggregate=document): "
            "use a sequence cache (the default) or Rescoring.method none",
            param="Rescoring.method",
        )


def _query_tokens(
    model: PrismLM, tok: Tokenizer, prompt: str, query: QuerySpec, token_ids: Sequence[int] | None
) -> tuple[list[int], int, str, str | None]:
    """(token ids, measure_from, prompt, completion) of the query: the given ids, the prompt + a sampled
    completion (``query.generate``), or the prompt (+ ``query.answer``)."""
    completion_tokens = query.completion
    if token_ids is not None:
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ConfigError("nothing to attribute: token_ids holds fewer than two tokens")
        if completion_tokens and completion_tokens >= len(ids):
            raise ConfigError(
                f"QuerySpec.completion {completion_tokens} is not shorter than the {len(ids)} tokens; "
                f"measure fewer tokens",
                param="QuerySpec.completion",
            )
        start = len(ids) - completion_tokens if completion_tokens else 1
        return ids, start, tok.decode(ids[:start]), tok.decode(ids[start:])
    if query.generate > 0:
        ids0 = [tok.eot_id] + (tok.encode(prompt) if prompt else [])
        g = torch.Generator().manual_seed(query.seed)
        x = torch.tensor([ids0], device=next(model.parameters()).device)
        y = model.generate(x, query.generate, temperature=query.temperature, generator=g)[0].tolist()
        return y, len(ids0), prompt, tok.decode(y[len(ids0) :])
    ids, start = make_query(tok, prompt, query.answer, completion_tokens=completion_tokens)
    completion = query.answer
    if completion is None and completion_tokens:
        completion = tok.decode(ids[start:])
    return ids, start, prompt, completion


def _best(s: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (k',), scores (k',)) of the k best of the scores ``s`` (n,); ties by id, so results are
    deterministic."""
    n = s.shape[0]
    order = np.lexsort((np.arange(n), -s.numpy()))[: min(k, n)]
    return order, s.numpy()[order]


def _rank_by_search(
    cache: AttributionCache, index: SearchIndex, q: BlockGradients, k: int, search: SearchSpec
) -> _Ranking:
    """Candidates from the approximate-search sidecar, scored exactly."""
    sq = cache.sketch_query(q)  # (Rq, r): one query, every row
    qseq, qproto = q.seq.cpu().numpy(), q.proto.cpu().numpy()
    index.check(cache)
    top_s, top_i = index.top_sketches(
        cache, qseq, qproto, sq, 1, k, m=search.candidates, nprobe=search.nprobe, ef=max(64, search.candidates)
    )
    order = top_i[0]
    cpos, c_proto, c_val = index.terms(cache, qproto, sq, order)
    return _Ranking(order, top_s[0], (order[cpos], c_proto, c_val), "cached-search", cache.num_train, cache.curvature)


def _rank_by_cache(cache: AttributionCache, q: BlockGradients, k: int) -> _Ranking:
    """The exact scan of every posting of the query's prototypes."""
    scores, contrib = cache.scores(q, 1, contributions=True)
    order, top = _best(scores[0], k)
    return _Ranking(order, top, contrib[0], "cached", cache.num_train, cache.curvature)


def _rank_by_full(full: FullGradients, q: BlockGradients, k: int) -> _Ranking:
    """The reference: the exact block gradients of the training sequences."""
    s = full.scores(q, 1)[0]
    tr = full.train
    keep = torch.isin(tr.proto, q.proto)
    K = int(max(tr.proto.max(), q.proto.max())) + 1
    table = query_table(q, full.curvature, K, 1)[:, 0]  # (K, d): H_i⁻¹ G_{q,i} (one query)
    c_seq, c_proto = tr.seq[keep].numpy(), tr.proto[keep].numpy()
    c_val = (tr.grad[keep].to(table.dtype) * table[tr.proto[keep]]).sum(1).numpy()
    order, top = _best(s, k)
    return _Ranking(order, top, (c_seq, c_proto, c_val), "full", full.num_train, full.curvature)


def _rescore(ranked: _Ranking, rescorer: Rescorer, candidates: int, query: tuple[list[int], int], top: int) -> str:
    """The hybrid: re-rank the ``candidates`` best of ``ranked`` by the whole-network score (in place, keeping
    the ``top`` best); returns the note that says so."""
    cand = ranked.order[:candidates]
    whole = np.asarray(rescorer.scores(query, cand.tolist()), dtype=np.float64).reshape(-1)  # (M,)
    by = np.lexsort((np.arange(len(cand)), -whole))[:top]  # ties: the prototype-space order
    ranked.order, ranked.scores = cand[by], whole[by]
    ranked.method = f"{ranked.method}+{rescorer.name}"
    return (
        f"the top {len(cand)} sequences by prototype space re-ranked by {rescorer.name}: scores are "
        f"{rescorer.name}'s, the prototypes listed their prototype-space contributions"
    )


def _items(ranked: _Ranking, shown: np.ndarray | None) -> list[AttributedSequence]:
    """One item per ranked unit, with its 5 largest prototype contributions; ``shown`` (n,): the sequence
    each document is shown through (None: the units are sequences)."""
    c_seq, c_proto, c_val = ranked.terms
    seqs = ranked.order if shown is None else shown
    items = []
    for rank, (j, js, sj) in enumerate(zip(ranked.order.tolist(), seqs.tolist(), ranked.scores.tolist(), strict=True)):
        sel = c_seq == j
        pv, pp = c_val[sel], c_proto[sel]
        o = np.argsort(-np.abs(pv))[:5]
        items.append(
            AttributedSequence(
                rank=rank + 1,
                sequence=int(js),
                score=float(sj),
                prototypes=[{"id": int(pp[i]), "contribution": float(pv[i])} for i in o],
                doc_index=int(j) if shown is not None else None,
            )
        )
    return items


@torch.no_grad()
def _fill_snippets(
    net: PrismLM,
    shards: ShardSet,
    tok: Tokenizer,
    items: list[AttributedSequence],
    q: BlockGradients,
    curvature: Curvature | None,
    width: int,
) -> None:
    """Snippet around each top sequence's most-contributing token (exact per-token decomposition)."""
    T = net.config.block_size
    js = np.array([it.sequence for it in items], dtype=np.int64)
    seqs = torch.from_numpy(shards.train.sequences(js, T))  # (B, T+1)
    dev = next(net.parameters()).device
    with eval_mode(net):
        out = net(seqs[:, :-1].to(dev))
    assert out.activations is not None and out.indices is not None and net.prototypes is not None
    dt = torch.promote_types(out.logits.dtype, torch.float32)
    u = output_gradients(net, out.logits, seqs[:, 1:].to(dev))  # (B, T, d)
    table = query_table(q, curvature, net.prototypes.num_prototypes, 1, dtype=dt, device=dev)[:, 0]  # (K, d)
    per_tok = (out.activations.to(dt)[..., None] * table[out.indices]).sum(2)  # (B, T, d)
    c_t = (per_tok * u).sum(-1)  # (B, T): token contributions, sum to the full score
    best = c_t.argmax(1).tolist()
    for b, it in enumerate(items):
        t = best[b]
        target_off = it.sequence * T + t + 1
        d, _ = shards.train.locate(target_off)
        it.doc_index = d
        it.doc_id = shards.train.doc_ids[d] if d < len(shards.train.doc_ids) else None
        toks = seqs[b].tolist()
        a, e = max(0, t + 1 - width), min(len(toks), t + 2 + width // 3)
        it.snippet = tok.decode(toks[a : t + 1]) + "⟦" + tok.decode([toks[t + 1]]) + "⟧" + tok.decode(toks[t + 2 : e])
