"""The attribution claim's ground truth and its lexical yardstick: BM25 against a loop over the textbook formula,
the random-ranking recall against exhaustive enumeration, trimmed planted documents that keep their facts, and
queries whose measured tokens are the answer and whose prompts do not hold it."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prismlm.data.tokenizer import train_bpe
from prismlm.tda.lexical import bm25_scores
from prismlm.tda.planted import (
    answer_accuracy,
    answer_logprobs,
    build_planted_corpus,
    chance_recall,
    planted_queries,
    trim_planted,
)

DOCS = [
    "The capital of Zorbia is Quell.",
    "quell quell and more",
    "Nothing here at all, 42 times",
    "Zorbia's seat: QUELL!",
]
QUERIES = ["capital of zorbia", "quell", "unknown words", "42 quell"]


def _bm25_reference(docs, queries, k1=1.5, b=0.75):
    """Okapi BM25 written out term by term: Σ_w∈q c_q(w) · idf(w) · tf(w,d)(k1+1) / (tf + k1(1 − b + b·|d|/avgdl)),
    idf(w) = ln(1 + (N − n_w + 0.5) / (n_w + 0.5))."""
    words = [[w for w in "".join(ch if ch.isalnum() else " " for ch in d.lower()).split()] for d in docs]
    avgdl = sum(map(len, words)) / len(words)
    out = np.zeros((len(queries), len(docs)))
    for qi, q in enumerate(queries):
        qc = Counter("".join(ch if ch.isalnum() else " " for ch in q.lower()).split())
        for di, dw in enumerate(words):
            tf = Counter(dw)
            for w, c in qc.items():
                n_w = sum(w in x for x in words)
                if n_w == 0:
                    continue
                idf = math.log(1 + (len(docs) - n_w + 0.5) / (n_w + 0.5))
                out[qi, di] += c * idf * tf[w] * (k1 + 1) / (tf[w] + k1 * (1 - b + b * len(dw) / avgdl))
    return out


def test_bm25_is_the_textbook_formula():
    S = bm25_scores(DOCS, QUERIES)
    np.testing.assert_allclose(S, _bm25_reference(DOCS, QUERIES), rtol=1e-12)
    assert S[2].max() == 0.0  # no shared word, no score
    assert S[1].argmax() == 1  # the document that repeats "quell" most, relative to its length


@pytest.mark.parametrize(("n", "r", "k"), [(6, 1, 2), (6, 2, 2), (7, 3, 3), (5, 2, 1)])
def test_chance_recall_is_the_share_of_random_top_k_that_hit(n, r, k):
    hits = [bool(set(top) & set(range(r))) for top in itertools.combinations(range(n), k)]
    assert chance_recall(n, [r], k) == pytest.approx(sum(hits) / len(hits))
    assert chance_recall(10, [1], 3) == pytest.approx(0.3)
    assert chance_recall(8, [2, 0], 10) == 1.0  # k ≥ n: every ranking finds it
    assert chance_recall(10, [1, 0, 2], 3) == pytest.approx((0.3 + (1 - math.comb(8, 3) / math.comb(10, 3))) / 2)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planted")
    raw = build_planted_corpus(tmp / "raw", n_facts=3, copies=2, n_background=12, seed=1)
    return raw, trim_planted(raw, tmp / "trimmed", 60)


def test_trimmed_documents_keep_their_facts_and_their_line_numbers(planted):
    raw, pc = planted
    before = raw.path.read_text().splitlines()
    after = pc.path.read_text().splitlines()
    assert len(after) == len(before) and pc.facts == raw.facts and pc.distractors == raw.distractors
    planted_lines = {line for f in pc.facts + pc.distractors for line in f.lines}
    for f in pc.facts + pc.distractors:
        for line in f.lines:
            text = json.loads(after[line - 1])["text"]
            assert f.sentence in text and len(text) <= len(f.sentence) + 2 * 60
            assert text in json.loads(before[line - 1])["text"]  # a cut of the original, not a rewrite
    for i, (a, b) in enumerate(zip(before, after, strict=True), start=1):
        if i not in planted_lines:
            assert a == b  # the background is untouched
    assert json.loads((pc.path.parent / "facts.json").read_text())["facts"][0]["answer"] == pc.facts[0].answer


def test_queries_measure_the_answer_and_their_prompts_do_not_hold_it(planted):
    _, pc = planted
    tok = train_bpe([json.loads(x)["text"] for x in pc.path.read_text().splitlines()], 300, show_progress=False)
    queries, fact_of, kind = planted_queries(pc, tok)
    assert len(queries) == len(fact_of) == len(kind) == sum(len(f.queries) for f in pc.facts) + len(pc.facts)
    assert set(kind) == {"paraphrase", "verbatim"} and (kind[-len(pc.facts) :] == "verbatim").all()
    for (ids, measure_from), f_i, k in zip(queries, fact_of, kind, strict=True):
        fact = pc.facts[f_i]
        assert tok.decode(ids[measure_from:]) == " " + fact.answer  # only the answer's tokens are measured
        prompt = tok.decode(ids[1:measure_from])
        assert fact.answer.lower() not in prompt.lower()
        if k == "verbatim":  # the training wording up to the answer
            assert fact.sentence.startswith(prompt)
        else:
            assert prompt in fact.queries


class _Bigram:
    """A language model that has learned exactly the given token sequences: logit 10 for each of their bigrams."""

    def __init__(self, sequences: list[list[int]], V: int):
        self.table = torch.zeros(V, V)
        for s in sequences:
            for a, b in zip(s[:-1], s[1:], strict=True):
                self.table[a, b] = 10.0

    def __call__(self, x: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[x])  # (B, T, V)


def test_answer_accuracy_ranks_the_learned_answer_first(planted):
    _, pc = planted
    tok = train_bpe([json.loads(x)["text"] for x in pc.path.read_text().splitlines()], 300, show_progress=False)
    taught = [[tok.eot_id, *tok.encode(q), *tok.encode(" " + f.answer)] for f in pc.facts for q in f.queries]
    acc = answer_accuracy(pc, _Bigram(taught, tok.vocab_size), tok)
    pool = Counter(f.relation for f in pc.facts + pc.distractors)
    assert acc["candidates"] == dict(pool) and acc["queries"] == sum(len(f.queries) for f in pc.facts)
    want_chance = np.mean([1 / pool[f.relation] for f in pc.facts for _ in f.queries])
    assert acc["chance_top1"] == pytest.approx(want_chance)
    assert acc["top1"] == 1.0 and acc["mean_rank"] == 1.0
    assert acc["answer_nll_per_token"] < 0.5 * math.log(tok.vocab_size)  # far below the uniform model's
    blank = answer_accuracy(pc, _Bigram([], tok.vocab_size), tok)  # uniform: every token costs log V
    assert blank["answer_nll_per_token"] == pytest.approx(math.log(tok.vocab_size), rel=1e-5)


def test_answer_logprobs_sum_only_the_answer_tokens():
    V = 7
    net = _Bigram([[0, 1, 2], [1, 3]], V)
    lp = answer_logprobs(net, [0, 1], [[2], [3, 4]])
    z1 = math.log(2 * math.exp(10) + V - 2)  # log-partition of row 1: two learned bigrams (1 → 2, 1 → 3)
    assert lp[0] == pytest.approx(10 - z1, rel=1e-5)  # 1 → 2 learned
    assert lp[1] == pytest.approx((10 - z1) - math.log(V), rel=1e-5)  # 1 → 3 learned, 3 → 4 uniform
