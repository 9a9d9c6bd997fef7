"""The caches behind prototype cards (signature top tokens, token strings, index snippets, labels) give
exactly what a fresh computation gives, and never serve data of an earlier model or index state."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from prismlm import RunConfig
from prismlm.explain import IndexSettings, PrototypeIndex, build_index, explain, explain_generation, prototype_card
from prismlm.explain.explanation import clear_card_cache
from prismlm.model import PrismLM
from prismlm.model.generation import Sampling
from prismlm.train.state import round_vocab


@pytest.fixture()
def model(tiny_shards):
    cfg = RunConfig.from_name("tiny").override({"model.vocab_size": round_vocab(tiny_shards.tokenizer.vocab_size)})
    torch.manual_seed(0)
    return PrismLM(cfg.model).eval()


@pytest.fixture()
def index(model, tiny_shards):
    return build_index(
        model, tiny_shards, IndexSettings(top_n=6, batch_size=4, max_sequences=8), progress=False, model_sha256="test"
    )


def reference_top_tokens(model, tok, ids, m=10):
    """The card's signature tokens as computed before any cache: W p_i for these ids in one matmul."""
    with torch.no_grad():
        sig = model.signatures(torch.tensor(ids)).float()
    sig[:, tok.vocab_size :] = -float("inf")
    vals, toks = sig.topk(min(m, tok.vocab_size), dim=-1)
    return {i: [(tok.id_to_token(t), v) for t, v in zip(toks[r].tolist(), vals[r].tolist())] for r, i in enumerate(ids)}


def reference_neighbours(idx, i, n, shards, before=12, after=3):
    """Prototype i's neighbours decoded one by one from the shards (the uncached algorithm)."""
    shard, tok = shards.train, shards.tokenizer
    out: list[dict] = []
    for s, o in zip(idx.top_sim[i].tolist(), idx.top_offset[i].tolist()):
        if o == -1 or len(out) >= n:
            break
        t = o + 1
        d, pos = shard.locate(t)
        start, end = int(shard.doc_offsets[d]), int(shard.doc_offsets[d + 1])
        a, b = max(start, t - before), min(end, t + 1 + after)
        toks = np.asarray(shard.tokens[a:b], dtype=np.int64)
        k = t - a
        out.append(
            {
                "offset": o,
                "similarity": s,
                "doc_index": d,
                "doc_id": shard.doc_ids[d],
                "position": pos,
                "target_id": int(toks[k]),
                "target": tok.decode([int(toks[k])]),
                "before": tok.decode(toks[:k].tolist()),
                "after": tok.decode(toks[k + 1 :].tolist()),
            }
        )
    return out


def as_dicts(nbs):
    return [dataclasses.asdict(nb) for nb in nbs]


def test_cached_explanations_equal_fresh_ones(model, index, tiny_shards):
    tok = tiny_shards.tokenizer
    clear_card_cache()
    index.clear_cache()
    cold = explain_generation(
        model, tok, "It was the best of times", 12, sampling=Sampling(0.8, 50, seed=3), index=index
    )
    warm = explain_generation(
        model, tok, "It was the best of times", 12, sampling=Sampling(0.8, 50, seed=3), index=index
    )
    assert warm.to_dict() == cold.to_dict()  # cards, positions, everything
    ids = sorted(cold.prototypes)
    ref = reference_top_tokens(model, tok, ids)
    for i, card in cold.prototypes.items():
        assert card.top_tokens == ref[i]
        assert as_dicts(card.neighbours) == reference_neighbours(index, i, 5, tiny_shards)
        assert card.stats == {
            "id": i,
            "count": int(index.counts[i]),
            "frequency": int(index.counts[i]) / index.tokens,
            "mean_activation": (float(index.act_sum[i]) / int(index.counts[i]) if int(index.counts[i]) else 0.0),
            "max_similarity": float(index.top_sim[i, 0]),
            "histogram": index.hist[i].tolist(),
            "bins": int(index.manifest["bins"]),
        }
    # another text reuses part of the cache: still what a cache-free run gives
    text = explain(model, tok, "In a hole in the ground there lived a hobbit.", index=index)
    clear_card_cache()
    index.clear_cache()
    assert explain(model, tok, "In a hole in the ground there lived a hobbit.", index=index).to_dict() == text.to_dict()
    # the cached parts are not shared with callers: changing a card leaves the next one intact
    card = next(iter(warm.prototypes.values()))
    card.top_tokens.clear()
    card.neighbours.clear()
    again = explain_generation(
        model, tok, "It was the best of times", 12, sampling=Sampling(0.8, 50, seed=3), index=index
    )
    assert again.to_dict() == cold.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.prototypes[card.id].neighbours[0].before = "changed"


def test_in_place_weight_changes_invalidate_the_card_cache(model, tiny_shards):
    tok = tiny_shards.tokenizer
    ids = [0, 5, 17]

    def cards():
        return {i: prototype_card(model, tok, i).top_tokens for i in ids}

    def fresh():
        return {i: reference_top_tokens(model, tok, [i])[i] for i in ids}

    before = cards()
    assert before == fresh() and cards() == before  # computed, then served from the cache
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an in-place change of the prototype bank (bumps its version counter)
        model.prototypes.weight.add_(torch.randn(model.prototypes.weight.shape, generator=g))
    after = cards()
    assert after == fresh() and after != before  # not the stale cards
    with torch.no_grad():  # the unembedding determines the signatures too (tied to the token embedding)
        model.lm_head.weight.mul_(-1.0)
    flipped = cards()
    assert flipped == fresh() and flipped != after
    # an optimizer step
    model.train()
    x = torch.randint(0, 100, (2, 16))
    model(x, x).loss.backward()
    torch.optim.SGD(model.parameters(), lr=10.0).step()
    model.eval()
    stepped = cards()
    assert stepped == fresh() and stepped != flipped
    # a replaced parameter (same shape, the same version count)
    model.prototypes.weight = torch.nn.Parameter(torch.randn(model.prototypes.weight.shape, generator=g))
    replaced = cards()
    assert replaced == fresh() and replaced != stepped
    # writes through .data bypass version counters: clear_card_cache is the documented remedy
    with torch.no_grad():
        model.prototypes.weight.data.copy_(torch.randn(model.prototypes.weight.shape, generator=g))
    clear_card_cache(model)
    assert cards() == fresh()


def test_explanation_cards_follow_in_place_changes(model, index, tiny_shards):
    tok = tiny_shards.tokenizer
    first = explain(model, tok, "It was the best of times", index=index)
    with torch.no_grad():
        model.prototypes.weight.add_(
            torch.randn(model.prototypes.weight.shape, generator=torch.Generator().manual_seed(2))
        )
    second = explain(model, tok, "It was the best of times", index=index)
    ref = reference_top_tokens(model, tok, sorted(second.prototypes))
    assert {i: c.top_tokens for i, c in second.prototypes.items()} == ref
    shared = set(first.prototypes) & set(second.prototypes)
    assert shared and all(first.prototypes[i].top_tokens != second.prototypes[i].top_tokens for i in shared)
    clear_card_cache()
    assert explain(model, tok, "It was the best of times", index=index).to_dict() == second.to_dict()


def test_index_snippet_cache_equals_a_fresh_load(model, index, tiny_shards, tmp_path):
    index.save(tmp_path / "index")
    loaded = PrototypeIndex.load(tmp_path / "index", shards=tiny_shards)
    ids = list(range(loaded.num_prototypes))
    first = loaded.neighbours_of(ids, 4)
    second = loaded.neighbours_of(ids, 4)  # from the cache
    fresh = PrototypeIndex.load(tmp_path / "index", shards=tiny_shards)
    fresh.snippet_cache_size = 0  # no cache at all
    for i in ids:
        assert as_dicts(first[i]) == as_dicts(second[i]) == as_dicts(fresh.neighbours(i, 4))
        assert as_dicts(first[i]) == reference_neighbours(loaded, i, 4, tiny_shards)
        assert as_dicts(loaded.neighbours(i, None, before=0, after=0)) == reference_neighbours(
            loaded, i, loaded.top_n, tiny_shards, before=0, after=0
        )
        assert loaded.stats(i) == fresh.stats(i)
    assert second[0] is not first[0]  # a new list each call: callers may change it
    # bounded: an LRU of snippet_cache_size entries, still exact
    small = PrototypeIndex.load(tmp_path / "index", shards=tiny_shards)
    small.snippet_cache_size = 3
    for _ in range(2):
        got = small.neighbours_of(ids, 4)
        assert len(small._snippets) <= 3
        assert all(as_dicts(got[i]) == as_dicts(first[i]) for i in ids)


def test_index_snippet_cache_follows_changed_tables(index, tiny_shards):
    i = 0
    before = as_dicts(index.neighbours(i, 3))
    assert before == reference_neighbours(index, i, 3, tiny_shards)
    row = index.top_offset[i].clone()
    index.top_offset[i] = row.flip(0)  # in place: the index's tables changed
    after = as_dicts(index.neighbours(i, 3))
    assert after == reference_neighbours(index, i, 3, tiny_shards) and after != before
    index.top_offset = index.top_offset.clone()  # another tensor
    index.top_offset[i] = row
    assert as_dicts(index.neighbours(i, 3)) == before
    stats = index.stats(i)
    index.counts[i] += 5  # the statistics follow their tables too
    index.hist[i, 0] += 5
    assert index.stats(i)["count"] == stats["count"] + 5 and index.stats(i)["histogram"][0] == stats["histogram"][0] + 5
    index.shards = None  # detached: no snippets
    assert all(nb.before == "" and nb.target is None for nb in index.neighbours(i, 3))


def test_labels_are_re_read_when_the_file_changes(index, tmp_path):
    path = index.save(tmp_path / "index")
    loaded = PrototypeIndex.load(path)
    assert loaded.labels() == {}
    (path / "labels.json").write_text(json.dumps({"3": {"label": "a", "category": "x"}}))
    assert loaded.labels() == {3: {"label": "a", "category": "x"}}
    loaded.labels()[4] = {"label": "mutated"}  # a copy: the cache is unaffected
    assert loaded.labels() == {3: {"label": "a", "category": "x"}}
    (path / "labels.json").write_text(json.dumps({"3": {"label": "b", "category": "x"}}))  # same size
    assert loaded.labels() == {3: {"label": "b", "category": "x"}}
    (path / "labels.json").unlink()
    assert loaded.labels() == {}


def test_an_index_with_filled_caches_copies_and_pickles(index, tiny_shards):
    import copy
    import pickle

    before = {i: as_dicts(nbs) for i, nbs in index.neighbours_of(range(8), 3).items()}
    stats = index.stats_of(range(8))
    dup = copy.deepcopy(index)  # the caches (and their lock) are not copied: rebuilt on demand
    assert {i: as_dicts(nbs) for i, nbs in dup.neighbours_of(range(8), 3).items()} == before
    assert dup.stats_of(range(8)) == stats
    index.shards = None
    back = pickle.loads(pickle.dumps(index))
    assert back.stats_of(range(8)) == stats
    assert [nb.offset for nb in back.neighbours(0, 3)] == [nb["offset"] for nb in before[0]]


def _reference_top(row: list[float], n: int) -> list[int]:
    """The documented order, by plain Python: similarity descending, then column (offset) ascending."""
    return sorted(range(len(row)), key=lambda j: (-row[j], j))[:n]


def test_index_top_n_breaks_ties_by_offset():
    """Equal cosines do occur (identical contexts at position 0 of two sequences). The index keeps, among
    equal similarities, the smallest offsets: a run of 78 equal values from column 50 gives 50, 51, 52, …
    (torch.topk alone picks among them arbitrarily), whether the tie straddles the cut or fills it."""
    from prismlm.explain.index.build import _chunk_topn, _topn_merge

    n = 8
    plateau = torch.zeros(128)
    plateau[50:] = 1.0  # 78 tied values, all above the rest
    straddle = torch.zeros(128)
    straddle[3], straddle[90] = 2.0, 1.5
    straddle[10:100:3] = 1.0  # the last places are a tie among 29 columns
    g = torch.Generator().manual_seed(0)
    few_values = torch.randint(0, 4, (6, 128), generator=g).float()  # heavy ties in every row
    distinct = torch.randn(2, 128, generator=g)
    sim = torch.cat([plateau[None], straddle[None], few_values, distinct])  # (10, 128)
    vals, idx = _chunk_topn(sim, n)
    assert idx[0].tolist() == list(range(50, 58))
    for r in range(sim.shape[0]):
        want = _reference_top(sim[r].tolist(), n)
        assert idx[r].tolist() == want, r
        assert vals[r].tolist() == [sim[r, j].item() for j in want]
    # the merge of two tables (offsets not in order) follows the same rule
    off = torch.randperm(128, generator=g).repeat(sim.shape[0], 1)  # (10, 128) distinct offsets per row
    msim, moff = _topn_merge(sim, off, n)
    for r in range(sim.shape[0]):
        want = sorted(zip(sim[r].tolist(), off[r].tolist()), key=lambda p: (-p[0], p[1]))[:n]
        assert list(zip(msim[r].tolist(), moff[r].tolist())) == want, r


def test_index_settings_are_checked_when_made():
    """``IndexSettings`` refuses what cannot build an index before any model runs, naming the field (the CLI
    maps ``ConfigError.param`` to its flag); ``ConceptSelection`` does the same for a concept search."""
    from prismlm.control.concept import ConceptSelection
    from prismlm.errors import ConfigError

    cases = [
        (IndexSettings, dict(top_n=0), "top_n"),
        (IndexSettings, dict(batch_size=0), "batch_size"),
        (IndexSettings, dict(bins=0), "bins"),
        (IndexSettings, dict(max_sequences=0), "max_sequences"),
        (IndexSettings, dict(chunk_size=0), "chunk_size"),
        (IndexSettings, dict(part=(3, 2)), "part"),
        (ConceptSelection, dict(rank_by="magic"), "rank_by"),
        (ConceptSelection, dict(budget=-1), "budget"),
        (ConceptSelection, dict(threshold=float("inf")), "threshold"),
        (ConceptSelection, dict(min_purity=1.5), "min_purity"),
    ]
    for cls, kw, field in cases:
        with pytest.raises(ConfigError, match=field) as e:
            cls(**kw)
        assert e.value.param == field
    assert IndexSettings(part=(1, 2)).part == (1, 2) and ConceptSelection(budget=None).budget is None
