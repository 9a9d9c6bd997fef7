"""`attribute`: the training sequences that most influenced a prompt and/or its completion (spec §3.2).

A query is tokens ``[eot] + prompt + completion``; the loss of the completion's tokens is measured (of
every token when there is no completion). Its block gradients come from one forward pass; scores come
from the cached postings (``AttributionCache``, fast) or from exact block gradients of the training
sequences (``FullGradients``, the reference).

For each top training sequence the result lists the prototypes that connect it to the query (its
largest per-prototype contributions, which sum to the score) and a snippet centred on the training token
that contributed most. A cache built with ``aggregate="document"`` ranks documents: each item is a
document (``doc_index``), shown through its first sequence. Per-token contributions use the exact decomposition of the full score,
``I(q, j) = Σ_t Σ_i a_{t,i} u_tᵀ H_i⁻¹ G_{q,i}`` (one forward over the top sequences).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

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

__all__ = ["Attribution", "AttributedSequence", "Rescorer", "attribute", "make_query"]


class Rescorer(Protocol):
    """A whole-network score of one query against chosen training sequences (the hybrid's re-ranker)."""

    name: str

    def scores(self, query: tuple[list[int], int], train_ids: list[int]) -> np.ndarray:
        """(len(train_ids),) scores of ``query`` = (token ids, measure_from) on those training sequences."""
        ...


@dataclass
class AttributedSequence:
    """One training sequence and its influence on the query."""

    rank: int
    sequence: int
    """Training sequence id j (tokens ``shards.train.sequence(j, T)``); for a document-aggregated cache,
    the first sequence of the ranked document."""
    score: float
    prototypes: list[dict[str, float]]
    """The connecting prototypes: [{"id", "contribution"}], largest |contribution| first."""
    doc_index: int | None = None
    """The document of the snippet's token; for a document-aggregated cache, the ranked document."""
    doc_id: str | None = None
    snippet: str = ""
    """Text around the training token that contributed most, marked ⟦like this⟧."""


@dataclass
class Attribution:
    """Result of ``attribute``."""

    prompt: str
    completion: str
    method: str
    """``cached`` (the exact scan of the postings), ``cached-search`` (candidates from the cache's
    approximate-search sidecar, scores exact) or ``full``."""
    query_loss: float
    """Summed cross-entropy of the measured tokens."""
    measured_tokens: int
    top: list[AttributedSequence]
    num_train: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path, option: str = "--json") -> None:
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
                f"--completion {completion_tokens} is not shorter than the text ({len(ids) - 1} "
                f"tokens); measure fewer tokens"
            )
        start = len(ids) - completion_tokens
    else:
        start = 1
    if len(ids) < 2:
        raise ConfigError("nothing to attribute: the text is empty; give a prompt or a completion")
    return ids, start


def attribute(
    model: PrismLM,
    tokenizer: Tokenizer,
    prompt: str,
    completion: str | None = None,
    *,
    cache: AttributionCache | None = None,
    full: FullGradients | None = None,
    shards: ShardSet | None = None,
    completion_tokens: int | None = None,
    generate: int = 0,
    temperature: float = 0.0,
    seed: int = 0,
    top: int = 10,
    snippet_tokens: int = 24,
    token_ids: Sequence[int] | None = None,
    search: SearchIndex | None = None,
    candidates: int = 32,
    nprobe: int = 16,
    rescorer: Rescorer | None = None,
    rescore_top: int = 128,
) -> Attribution:
    """Top training sequences for ``prompt`` (+ ``completion``), by the cached postings (``cache``) or the
    full block gradients (``full``) of the PRISM ``model`` (``tokenizer``: its tokenizer). ``generate=N`` samples N tokens after the prompt (greedy at
    ``temperature=0``) and attributes them as the completion. ``shards`` (for snippets) defaults to none.
    ``token_ids`` attributes exactly these tokens (e.g. an explained generation, whose text would not
    always re-tokenize to the same ids); ``completion_tokens`` then counts from their end. ``search`` (a
    ``prismlm.tda.search.SearchIndex`` of ``cache``): take the top sequences from approximate top-``candidates``
    search in each long posting list (``nprobe`` IVF cells probed; the HNSW beam is max(64, candidates)),
    rescored exactly, instead of scanning every posting of the query's prototypes; scores and
    contributions of the sequences found are the exact scan's. ``rescorer`` (the hybrid): the
    ``rescore_top`` best sequences by prototype space are re-ranked by ``rescorer.scores(query, ids)``, a
    whole-network score (EK-FAC, gradient dot products); the items' scores are then that score, and their
    prototypes the prototype-space contributions."""
    import time

    t0 = time.perf_counter()
    net, tok = model, tokenizer
    if net.prototypes is None:
        raise ModelError(
            "prototype-space attribution needs a PRISM model; this is the dense baseline (it has no prototypes)"
        )
    if (cache is None) == (full is None):
        raise ConfigError("pass exactly one of cache= (fast, the postings cache) or full= (reference)")
    if search is not None and cache is None:
        raise ConfigError("search= is the approximate-search sidecar of a cache: pass the cache too (cache=)")
    if rescorer is not None and rescore_top < 1:
        raise ConfigError(f"rescore_top (--rescore-top) must be >= 1, got {rescore_top}")
    if rescorer is not None and cache is not None and cache.aggregate == "document":
        raise ConfigError(
            "re-scoring needs training sequences; this cache ranks documents (aggregate=document): "
            "use a sequence cache (the default) or no --rescore"
        )
    k_top = max(top, rescore_top) if rescorer is not None else top  # the candidates, then the shown top
    notes = []
    if token_ids is not None:
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ConfigError("nothing to attribute: token_ids holds fewer than two tokens")
        if completion_tokens and completion_tokens >= len(ids):
            raise ConfigError(
                f"completion_tokens {completion_tokens} is not shorter than the {len(ids)} tokens; measure fewer tokens"
            )
        start = len(ids) - completion_tokens if completion_tokens else 1
        prompt, completion = tok.decode(ids[:start]), tok.decode(ids[start:])
    elif generate > 0:
        ids0 = [tok.eot_id] + (tok.encode(prompt) if prompt else [])
        g = torch.Generator().manual_seed(seed)
        x = torch.tensor([ids0], device=next(net.parameters()).device)
        y = net.generate(x, generate, temperature=temperature, generator=g)[0].tolist()
        completion = tok.decode(y[len(ids0) :])
        ids, start = y, len(ids0)
    else:
        ids, start = make_query(tok, prompt, completion, completion_tokens=completion_tokens)
        if completion is None and completion_tokens:
            completion = tok.decode(ids[start:])
    if len(ids) > net.config.block_size + 1:
        notes.append(f"query cropped to its last {net.config.block_size + 1} tokens (the context window)")
    q = query_gradients(net, [(ids, start)])
    curv: Curvature | None
    by_document = cache is not None and cache.aggregate == "document"
    if by_document:
        notes.append("the cache aggregates documents: scores are per document, each shown through its first sequence")
    if cache is not None and search is not None:
        sq = cache.sketch_query(q)  # (Rq, r): one query, every row
        qseq, qproto = q.seq.cpu().numpy(), q.proto.cpu().numpy()
        search.check(cache)
        top_s, top_i = search.top_sketches(
            cache, qseq, qproto, sq, 1, k_top, m=candidates, nprobe=nprobe, ef=max(64, candidates)
        )
        order, top_scores = top_i[0], top_s[0]
        cpos, c_proto, c_val = search.terms(cache, qproto, sq, order)
        c_seq = order[cpos]
        method, n_train, curv = "cached-search", cache.num_train, cache.curvature
    else:
        if cache is not None:
            scores, contrib = cache.scores(q, 1, contributions=True)
            s = scores[0]
            c_seq, c_proto, c_val = contrib[0]
            method, n_train, curv = "cached", cache.num_train, cache.curvature
        else:
            assert full is not None
            s = full.scores(q, 1)[0]
            tr = full.train
            keep = torch.isin(tr.proto, q.proto)
            K = int(max(tr.proto.max(), q.proto.max())) + 1
            table = query_table(q, full.curvature, K, 1)[:, 0]  # (K, d): H_i⁻¹ G_{q,i} (one query)
            c_seq, c_proto = tr.seq[keep].numpy(), tr.proto[keep].numpy()
            c_val = (tr.grad[keep].to(table.dtype) * table[tr.proto[keep]]).sum(1).numpy()
            method, n_train, curv = "full", full.num_train, full.curvature
        k = min(k_top, n_train)
        # rank by score; ties broken by sequence id so results are deterministic
        order = np.lexsort((np.arange(n_train), -s.numpy()))[:k]
        top_scores = s.numpy()[order]
    if rescorer is not None:  # the hybrid: the prototype-space candidates re-ranked by a whole-network score
        cand = order[:rescore_top]
        whole = np.asarray(rescorer.scores((ids, start), cand.tolist()), dtype=np.float64).reshape(-1)  # (M,)
        by = np.lexsort((np.arange(len(cand)), -whole))[:top]  # ties: the prototype-space order
        order, top_scores = cand[by], whole[by]
        method = f"{method}+{rescorer.name}"
        notes.append(
            f"the top {len(cand)} sequences by prototype space re-ranked by {rescorer.name}: scores are "
            f"{rescorer.name}'s, the prototypes listed their prototype-space contributions"
        )
    else:
        order, top_scores = order[:top], top_scores[:top]
    items = []
    shown = cache.first_sequence(order) if cache is not None and by_document else order
    for rank, (j, js, sj) in enumerate(zip(order.tolist(), shown.tolist(), top_scores.tolist(), strict=True)):
        sel = c_seq == j
        pv, pp = c_val[sel], c_proto[sel]
        o = np.argsort(-np.abs(pv))[:5]
        items.append(
            AttributedSequence(
                rank=rank + 1,
                sequence=int(js),
                score=float(sj),
                prototypes=[{"id": int(pp[i]), "contribution": float(pv[i])} for i in o],
                doc_index=int(j) if by_document else None,
            )
        )
    if shards is not None and items:
        _fill_snippets(net, shards, tok, items, q, curv, snippet_tokens)
        if by_document:  # the ranked document, not the one of the snippet's token
            for it, j in zip(items, order.tolist(), strict=True):
                it.doc_index = int(j)
                it.doc_id = shards.train.doc_ids[j] if j < len(shards.train.doc_ids) else None
    assert q.loss is not None  # query_gradients measures every query's loss
    return Attribution(
        prompt=prompt,
        completion=completion or "",
        method=method,
        query_loss=float(q.loss.sum()),
        measured_tokens=len(ids) - start,
        top=items,
        num_train=n_train,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


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
