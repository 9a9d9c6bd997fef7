"""The non-lexical planted set (``prismlm.tda.nonlexical``, issue 37 item 4): determinism, queries that hold no
word of their answer's sentence or hidden names (checked by splitting words here, not by the module's tokeniser),
hops located in the documents and the shards, BM25 far from right on it while it is right on the named set, the
retrieval metrics against hand-computed values, and the cost fields."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prismlm.data.shards import prepare_shards
from prismlm.data.tokenizer import train_bpe
from prismlm.errors import ConfigError
from prismlm.tda.lexical import bm25_scores
from prismlm.tda.nonlexical import (
    ADJECTIVES,
    LANDMARKS,
    NOUNS,
    RELATIONS,
    NonlexicalCorpus,
    NonlexicalSize,
    answer_accuracy,
    build_nonlexical_corpus,
    content_overlap,
    document_metrics,
    lexical_report,
    nonlexical_summary,
    per_query_seconds,
    plant_world,
    relevant_sequences,
    statement_prompts,
    template_overlaps,
)
from prismlm.tda.planted import build_planted_corpus, retrieval_metrics

SMALL = NonlexicalSize(n_per_kind=3, train_sequences=60, block_size=32)
FUNCTION_WORDS = {"the", "is", "of", "in", "a", "by", "from", "at", "to", "which", "were", "was"}


def _words(text: str) -> set[str]:
    return {w.strip(".,:;!?'\"").lower() for w in text.split()} - {""}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> NonlexicalCorpus:
    return build_nonlexical_corpus(tmp_path_factory.mktemp("nl") / "a", SMALL, seed=3)


def test_the_same_seed_gives_the_same_corpus_and_another_seed_another(small, tmp_path):
    again = build_nonlexical_corpus(tmp_path / "b", SMALL, seed=3)
    assert again.path.read_bytes() == small.path.read_bytes()
    assert (tmp_path / "b" / "nonlexical.json").read_text() == (small.path.parent / "nonlexical.json").read_text()
    other = build_nonlexical_corpus(tmp_path / "c", SMALL, seed=4)
    assert other.path.read_bytes() != small.path.read_bytes()
    assert [q.prompt for q in other.queries] != [q.prompt for q in small.queries]
    loaded = NonlexicalCorpus.load(small.path.parent)
    assert loaded.statements == small.statements and loaded.queries == small.queries


def test_no_query_holds_its_answer_hidden_names_or_a_word_of_its_answers_sentence(small):
    assert [q.kind for q in small.queries].count("alias") == 3 and len(small.queries) == 9
    for q in small.queries:
        prompt = _words(q.prompt)
        answer_sentence = small.statements[q.hops[-1]].sentence
        assert q.answer in answer_sentence and q.answer.lower() not in q.prompt.lower()
        assert not prompt & {h.lower() for h in q.hidden}, q
        assert not (prompt & _words(answer_sentence)) - FUNCTION_WORDS, (q.prompt, answer_sentence)
        first = small.statements[q.hops[0]].sentence
        if q.kind in ("alias", "two-hop"):  # the chain is connected: the prompt's name opens the first hop
            assert len(q.hops) == 2 and prompt & _words(first) - FUNCTION_WORDS
            assert small.statements[q.hops[0]].key in small.statements[q.hops[1]].sentence  # alias / capital reused
        else:  # the prompt names the place with the synonyms of the words its sentence uses
            adj, noun = q.hidden[:2]
            assert f"{adj} {noun}" in answer_sentence
            assert {ADJECTIVES[adj].lower(), NOUNS[noun].lower()} <= prompt
    assert all(not v for v in template_overlaps().values())


def test_every_planted_sentence_sits_in_its_documents_and_shares_answers(small):
    docs = small.documents()
    seen: set[int] = set()
    for st in small.statements:
        assert len(st.lines) == SMALL.copies and not seen & set(st.lines)
        seen |= set(st.lines)
        assert all(st.sentence in docs[line - 1] and st.key in st.sentence for line in st.lines)
    assert len(docs) == len(seen) + small.filler_docs
    # every answer word is the object of answer_share facts (the pools deal them out in turn)
    by_answer: dict[str, int] = {}
    for st in small.statements:
        if st.role in ("fact", "mention"):
            by_answer[st.key] = by_answer.get(st.key, 0) + 1
    assert max(by_answer.values()) == SMALL.answer_share
    assert all(by_answer[q.answer] >= 2 for q in small.queries)
    # no sentence outside a query's hops holds both a word of its prompt and its answer (a shortcut past the hops);
    # over many worlds (the shared pools made one now and then before mentions skipped the asked relation)
    for seed in range(40):
        statements, queries = plant_world(4, 3, 3, seed)
        for q in queries:
            names = _words(q.prompt) - FUNCTION_WORDS
            for i, st in enumerate(statements):
                if i not in q.hops:
                    assert not (q.answer in st.sentence and names & _words(st.sentence)), (seed, q.prompt, st.sentence)
    # each name a query uses is the subject of `mentions` other facts (the mentions hold the name)
    for q in small.queries[:2]:
        name = next(iter(_words(q.prompt) & _words(small.statements[q.hops[0]].sentence) - FUNCTION_WORDS))
        holding = [s for s in small.statements if s.role == "mention" and name in s.sentence.lower()]
        assert len(holding) == SMALL.mentions


def test_relevant_sequences_hold_the_hops_and_the_corpus_reaches_its_size(tmp_path):
    probe = build_nonlexical_corpus(tmp_path / "probe", SMALL, seed=5)
    tok = train_bpe(probe.documents(), 400, show_progress=False)
    nl = build_nonlexical_corpus(tmp_path / "nl", SMALL, count_tokens=lambda s: len(tok.encode(s)), seed=5)
    sh = prepare_shards(str(nl.path), str(_save(tok, tmp_path)), tmp_path / "shards", show_progress=False)
    T, tr = SMALL.block_size, sh.train
    assert tr.num_sequences(T) >= SMALL.train_sequences  # the filler made up the size with the real tokenizer
    rel = relevant_sequences(nl, sh, T)
    line_of = [int(d.rsplit("#L", 1)[1]) for d in tr.doc_ids]
    for q_i, q in enumerate(nl.queries):
        hop_lines = nl.hop_lines(q_i)
        keys = [nl.statements[s].key for s in q.hops]
        assert rel[q_i], q
        for j in rel[q_i]:  # a relevant sequence predicts tokens of a hop document, and a piece of a hop key
            docs = {line_of[tr.locate(off)[0]] for off in range(j * T + 1, j * T + T + 1)}
            assert docs & hop_lines
            text = tok.decode(tr.sequence(j, T)[1:].tolist())
            assert any(_holds_piece(text, k) for k in keys), (keys, text)
        for j in range(tr.num_sequences(T)):  # every sequence holding a hop sentence whole is relevant
            window = tok.decode(tr.sequence(j, T)[1:].tolist())
            if any(nl.statements[s].sentence in window for s in q.hops):
                assert j in rel[q_i], (q.prompt, j)


def _holds_piece(text: str, key: str) -> bool:
    """``text`` holds ``key``, ends with a beginning of it or starts with an end of it (a key cut by a sequence
    boundary)."""
    t = text.strip()
    return key in t or any(t.endswith(key[:i]) or t.startswith(key[-i:]) for i in range(1, len(key) + 1))


def _save(tok, tmp_path):
    tok.save(tmp_path / "tok")
    return tmp_path / "tok"


def test_bm25_is_far_from_right_here_and_right_on_the_named_set(tmp_path):
    for seed in (0, 1):
        nl = build_nonlexical_corpus(tmp_path / f"nl{seed}", NonlexicalSize(train_sequences=300), seed=seed)
        rep = lexical_report(nl)
        bm25 = rep["bm25"]
        assert isinstance(bm25, dict) and bm25["queries"] == 24
        assert bm25["recall@1"] < 0.5 and bm25["mrr"] < 0.6, bm25
        # the same numbers from BM25 computed here over the documents
        docs = nl.documents()
        S = bm25_scores(docs, [f"{q.prompt} {q.answer}" for q in nl.queries])
        top = S.argmax(1)  # ties: the lower index, as retrieval_metrics
        assert bm25["recall@1"] == pytest.approx(np.mean([t + 1 in nl.hop_lines(i) for i, t in enumerate(top)]))
        rows = rep["queries"]
        assert isinstance(rows, list) and all(not r["prompt_shares_with_answer_sentence"] for r in rows)
        assert all(not r["hidden_in_prompt"] for r in rows)
        assert isinstance(m := rep["mean_others_at_least_as_close"], float) and m >= 5  # many documents as close
    named = build_planted_corpus(tmp_path / "named", n_facts=12, copies=3, n_background=40, doc_chars=300, seed=0)
    docs = [json.loads(x)["text"] for x in named.path.read_text().splitlines()]
    texts = [f"{p} {f.answer}" for f in named.facts for p in f.queries]
    lines = [set(f.lines) for f in named.facts for _ in f.queries]
    assert document_metrics(bm25_scores(docs, texts), lines)["recall@1"] >= 0.95


def test_the_report_sees_a_query_made_lexical(small):
    q = small.queries[0]
    sentence = small.statements[q.hops[-1]].sentence
    leaky = NonlexicalCorpus(small.path, small.statements, [q.__class__(**{**q.__dict__, "prompt": sentence})])
    row = lexical_report(leaky)["queries"][0]  # type: ignore[index]
    assert row["prompt_shares_with_answer_sentence"] and q.answer in row["hidden_in_prompt"]
    assert row["overlap_relevant_max"] > 0


def test_retrieval_metrics_against_hand_values():
    S = np.array(
        [
            [0.9, 0.5, 0.5, 0.1, 0.0],  # relevant {2}: ranks 0,1,2 (tie 1/2 → index 1 first): rank 3
            [0.2, 0.8, 0.1, 0.3, 0.0],  # relevant {1, 4}: first at rank 1
            [0.0, 0.0, 0.0, 0.0, 0.0],  # relevant {3}: all tied, index order: rank 4
        ]
    )
    rel = [{2}, {1, 4}, {3}]
    m = retrieval_metrics(S, [0, 1, 2], rel, k=2)
    assert m["queries"] == 3
    assert m["recall@1"] == pytest.approx(1 / 3)
    assert m["recall@2"] == pytest.approx(1 / 3)
    assert m["share@2"] == pytest.approx((0 + 0.5 + 0) / 3)
    assert m["mrr"] == pytest.approx((1 / 3 + 1 + 1 / 4) / 3)
    m3 = retrieval_metrics(S, [0, 1, 2], rel, k=3)
    assert m3["recall@3"] == pytest.approx(2 / 3) and m3["recall@1"] == pytest.approx(1 / 3)
    assert document_metrics(S, [{3}, {2, 5}, {4}], k=3) == m3  # 1-based lines → the same documents


class _Memo:
    """A language model that learned exactly the given token sequences: logit 10 on the token that follows a
    prefix of one of them (whole prefixes, so prompts that end alike are told apart)."""

    def __init__(self, sequences: list[list[int]], V: int):
        self.next = {tuple(s[: t + 1]): s[t + 1] for s in sequences for t in range(len(s) - 1)}
        self.V = V

    def __call__(self, x: torch.Tensor) -> SimpleNamespace:
        out = torch.zeros(*x.shape, self.V)
        for b in range(x.shape[0]):
            for t in range(x.shape[1]):
                nxt = self.next.get(tuple(x[b, : t + 1].tolist()))
                if nxt is not None:
                    out[b, t, nxt] = 10.0
        return SimpleNamespace(logits=out)


def test_answer_accuracy_ranks_a_taught_answer_first(small):
    tok = train_bpe(small.documents(), 400, show_progress=False)
    taught = [ids for ids, _ in small.token_queries(tok)]
    acc = answer_accuracy(small, _Memo(taught, tok.vocab_size), tok)
    assert acc["top1"] == 1.0 and acc["queries"] == len(small.queries)
    # taught another answer of the same relation: every query misses, in every kind
    wrong = []
    for (ids, start), q in zip(small.token_queries(tok), small.queries, strict=True):
        other = next(s.key for s in small.statements if s.relation == q.relation and s.key != q.answer)
        wrong.append(ids[:start] + tok.encode(" " + other))
    miss = answer_accuracy(small, _Memo(wrong, tok.vocab_size), tok)
    assert miss["top1"] == 0.0 and miss["top1_by_kind"] == {"alias": 0.0, "two-hop": 0.0, "paraphrase": 0.0}
    pools = {q.relation: {s.key for s in small.statements if s.relation == q.relation} for q in small.queries}
    assert acc["chance_top1"] == pytest.approx(np.mean([1 / len(pools[q.relation]) for q in small.queries]))
    for (ids, start), q in zip(small.token_queries(tok), small.queries, strict=True):
        assert tok.decode(ids[start:]) == " " + q.answer and re.sub(r"\s+", " ", tok.decode(ids[1:start])) == q.prompt
    # the answer's NLL per token: logit 10 on the taught token over V=400 is ~0.04 nats; an untaught one ~10
    assert acc["answer_nll_per_token"] < 0.1 and miss["answer_nll_per_token"] > 5
    # the statements completed verbatim: untaught by the query-taught model (uniform over V=400: ~6 nats a
    # token; its top-1 is not 0, summed log-probabilities favour shorter keys); taught, every one ranks first
    assert acc["statement_nll_per_token"] > 5 and acc["statements"] == len(statement_prompts(small)) > 0
    said = [[tok.eot_id, *tok.encode(prompt), *tok.encode(" " + st.key)] for st, prompt in statement_prompts(small)]
    learned = answer_accuracy(small, _Memo(said, tok.vocab_size), tok)
    assert learned["statement_top1"] == 1.0 and learned["statement_nll_per_token"] < 0.1
    assert learned["answer_nll_per_token"] > 5  # the queries stay untaught
    for st, prompt in statement_prompts(small):  # the text before the key, from the statement's own sentence
        assert st.sentence.startswith(prompt) and st.sentence[len(prompt) :].lstrip().startswith(st.key)


def test_per_query_seconds_times_both_ways_and_the_summary_divides_like_by_like():
    def score(qs: list) -> int:  # a fixed cost per call + a cost per query
        time.sleep(0.02 + 0.005 * len(qs))
        return len(qs)

    t, batched = per_query_seconds(score, [([0], 0)] * 4, single=2)
    assert batched == 4  # the batched call's result
    assert t["single_queries"] == 2
    assert t["batched_per_query_s"] == pytest.approx((0.02 + 0.02) / 4, rel=0.5)
    assert t["single_query_s"] == pytest.approx(0.025, rel=0.5) and t["single_query_s"] > t["batched_per_query_s"]
    planted = {
        "cached": {"all": {"mrr": 0.5, "recall@1": 0.25, "recall@10": 0.75}},
        "bm25": {"all": {"mrr": 0.2, "recall@1": 0.1, "recall@10": 0.9}},
    }
    costs = {
        "cached": {"batched_per_query_s": 0.1, "single_query_s": 0.2},
        "ekfac": {"batched_per_query_s": 3.0, "single_query_s": 40.0},
    }
    s = nonlexical_summary(planted, costs)
    assert s == {
        "mrr_nonlexical_cached": 0.5,
        "recall1_nonlexical_cached": 0.25,
        "recall10_nonlexical_cached": 0.75,
        "mrr_nonlexical_bm25": 0.2,
        "recall1_nonlexical_bm25": 0.1,
        "recall10_nonlexical_bm25": 0.9,
        "ekfac_cost_over_cached_nonlexical": pytest.approx(30.0),
        "ekfac_single_query_cost_over_cached_nonlexical": pytest.approx(200.0),
    }
    named = nonlexical_summary(planted, costs, "landmark")  # the landmark set's fields: the same values
    assert named == {k.replace("_nonlexical", "_landmark"): v for k, v in s.items()}


def test_content_overlap_counts_shared_content_words():
    texts = ["The ship sailed abroad.", "Merchants of the port", "a ship and a port and merchants", "nothing"]
    o = content_overlap(texts, "Merchants ship abroad the", {0, 1})  # content words: merchants, ship, abroad
    assert o == {
        "overlap_relevant_max": 2,  # ship, abroad
        "overlap_relevant_mean": 1.5,  # (2 + 1) / 2
        "overlap_other_max": 2,  # ship, merchants
        "others_at_least_as_close": 1,
    }


# ----- the landmark kind: a made-up fact about a real city, asked through one of its sights -----------------------
LANDMARK = NonlexicalSize(n_per_kind=6, train_sequences=60, block_size=32, kinds=("landmark",))


def test_landmark_queries_name_a_sight_never_the_city_or_the_answer():
    statements, queries = plant_world(6, 3, 3, 2, ("landmark",))
    assert [q.kind for q in queries] == ["landmark"] * 6
    cities = list(LANDMARKS)[:3]
    for i, q in enumerate(queries):
        city, sight = cities[i // 2], LANDMARKS[cities[i // 2]][i % 2]  # each city asked through both sights
        said = [statements[s] for s in q.hops]
        rel = RELATIONS[q.relation]
        # the fact in every wording of its relation, one answer, about the city the sight stands for
        assert [s.sentence for s in said] == [t.format(E=city, A=q.answer) for t in (rel.fact, *rel.rewordings)]
        assert len(said) == 3 and {s.key for s in said} == {q.answer} and {s.role for s in said} == {"fact"}
        assert sight in q.prompt and city not in q.prompt and q.answer not in q.prompt and q.hidden == [city, q.answer]
        # the query is the fact's own words up to the answer, with the city named through its sight
        assert q.prompt == rel.fact.split("{A}")[0].strip().format(E=f"the city where you can see {sight}")
        # the city is the subject of other facts (its mentions), never of another fact of the asked relation
        about = [
            s
            for s in statements
            if s.sentence.startswith(city) or f" {city} " in s.sentence or f" {city}," in s.sentence
        ]
        assert {s.relation for s in about if s.role == "mention"} == {
            r for r in ("export", "language", "animal", "founder") if r != q.relation
        }
        assert [s for s in about if s.relation == q.relation] == said
    assert queries[0].hops == queries[1].hops and queries[0].hops != queries[2].hops
    # the first set's kinds are the default, and they are unchanged by the new kind
    first = plant_world(4, 3, 3, 2)
    assert first == plant_world(4, 3, 3, 2, ("alias", "two-hop", "paraphrase"))
    assert "landmark" not in {q.kind for q in first[1]}
    for bad in (5, 2 * len(LANDMARKS) + 2):
        with pytest.raises(ConfigError, match="n_per_kind must be even"):
            plant_world(bad, 3, 3, 2, ("landmark",))
    with pytest.raises(ConfigError, match="kinds must be a non-empty subset"):
        plant_world(4, 3, 3, 2, ("alias", "riddle"))  # type: ignore[arg-type]


def test_a_landmark_corpus_holds_every_wording_and_its_relevant_sequences(tmp_path):
    probe = build_nonlexical_corpus(tmp_path / "probe", LANDMARK, seed=5)
    tok = train_bpe(probe.documents(), 400, show_progress=False)
    nl = build_nonlexical_corpus(tmp_path / "nl", LANDMARK, count_tokens=lambda s: len(tok.encode(s)), seed=5)
    docs = nl.documents()
    for q_i, q in enumerate(nl.queries):
        assert len(nl.hop_lines(q_i)) == 3 * LANDMARK.copies  # three wordings, each in `copies` documents
        assert all(any(nl.statements[s].sentence in docs[line - 1] for s in q.hops) for line in nl.hop_lines(q_i))
    sh = prepare_shards(str(nl.path), str(_save(tok, tmp_path)), tmp_path / "shards", show_progress=False)
    T, tr = LANDMARK.block_size, sh.train
    rel = relevant_sequences(nl, sh, T)
    for q_i, q in enumerate(nl.queries):
        for j in range(tr.num_sequences(T)):  # every sequence holding one of the wordings whole is relevant
            window = tok.decode(tr.sequence(j, T)[1:].tolist())
            if any(nl.statements[s].sentence in window for s in q.hops):
                assert j in rel[q_i]
        assert rel[q_i]
    report = lexical_report(nl)
    assert set(report["bm25_by_kind"]) == {"landmark"}
    assert all(not r["hidden_in_prompt"] for r in report["queries"])
    tok_q = [ids for ids, _ in nl.token_queries(tok)]
    acc = answer_accuracy(nl, _Memo(tok_q, tok.vocab_size), tok)
    assert acc["top1"] == 1.0 and acc["top1_by_kind"] == {"landmark": 1.0}
