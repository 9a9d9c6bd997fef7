"""The claims' anchor corpus (prismlm.control.anchor_corpus) holds what it says: the requested number of documents
per source, cut to the requested length, fortunes from the LM split only, Gutenberg text from every 7th document,
King James Bible documents that the Gutenberg draw and the held-out documents (j % 7 == 1) never hold; the
same corpus for the same seed; files that read back as written."""

from __future__ import annotations

import json

import pytest

from prismlm.control.anchor_corpus import KJV_ID, anchor_corpus, kjv_anchor_documents, write_text_files
from prismlm.control.judges import FortuneSplits
from prismlm.data.corpus import gutenberg_documents

FORTUNES = FortuneSplits(
    lm_clean=[f"clean {i}" for i in range(20)],
    lm_offensive=[f"rude {i}" for i in range(5)],
    judge_clean=[f"judge clean {i}" for i in range(20)],
    judge_offensive=[f"judge rude {i}" for i in range(20)],
)
SIZES = dict(gutenberg_docs=3, sotu_docs=2, clean_fortunes=4, offensive_fortunes=9, kjv_docs=2, chars_per_doc=300)


def test_kjv_anchor_documents_are_kjv_and_outside_the_other_draws():
    docs = list(gutenberg_documents())
    position = {d.id: j for j, d in enumerate(docs)}
    got = kjv_anchor_documents(5)
    assert len(got) == 5 and all(d.id.startswith(KJV_ID) for d in got)
    js = [position[d.id] for d in got]
    assert js == sorted(js)  # corpus order
    assert all(j % 7 not in (0, 1) for j in js)  # not in the Gutenberg draw nor the held-out documents
    # the first five such documents: every KJV document before the last one taken is taken or excluded
    skipped = [j for j, d in enumerate(docs[: js[-1]]) if d.id.startswith(KJV_ID) and j not in js]
    assert all(j % 7 not in (3, 5) for j in skipped)
    assert [d.id for d in kjv_anchor_documents(2)] == [d.id for d in got[:2]]


@pytest.mark.slow
def test_anchor_corpus_counts_sources_and_seed():
    texts = anchor_corpus(FORTUNES, seed=1, **SIZES)
    assert {k: len(v) for k, v in texts.items()} == {
        "gutenberg.jsonl": 3,
        "sotu.jsonl": 2,
        "fortunes_clean.jsonl": 4,
        "fortunes_offensive.jsonl": 5,  # all the LM split holds
        "kjv.jsonl": 2,
    }
    assert set(texts["fortunes_clean.jsonl"]) <= set(FORTUNES.lm_clean)
    assert sorted(texts["fortunes_offensive.jsonl"]) == sorted(FORTUNES.lm_offensive)
    assert all(len(t) <= 300 for v in texts.values() for t in v)
    every_7th = {d.text[:300] for j, d in enumerate(gutenberg_documents()) if j % 7 == 0}
    assert set(texts["gutenberg.jsonl"]) <= every_7th
    assert not set(texts["kjv.jsonl"]) & every_7th
    assert texts["kjv.jsonl"] == [d.text[:300] for d in kjv_anchor_documents(2)]
    assert anchor_corpus(FORTUNES, seed=1, **SIZES) == texts
    other = anchor_corpus(FORTUNES, seed=2, **SIZES)
    assert other["fortunes_clean.jsonl"] != texts["fortunes_clean.jsonl"]


def test_write_text_files_reads_back(tmp_path):
    texts = {"a.jsonl": ["one\nline", 'with "quotes"'], "b.jsonl": []}
    assert write_text_files(tmp_path / "c", texts) == {"a.jsonl": 2, "b.jsonl": 0}
    lines = (tmp_path / "c" / "a.jsonl").read_text().splitlines()
    assert [json.loads(x)["text"] for x in lines] == texts["a.jsonl"]
    assert (tmp_path / "c" / "b.jsonl").read_text() == ""
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["a.jsonl", "b.jsonl"]
