"""The built-in chat anchor text (``prismlm.data.chat_anchor``, ``builtin:chat``): fixed questions from the
shipped data, a stable held-out split, and transcripts that tokenise with the chat template's special tokens."""

from __future__ import annotations

import json
import lzma

import pytest

from prismlm.data.chat_anchor import CHAT_FILE, COUNTRIES, anchor_questions, is_heldout, read_chat_answers
from prismlm.data.corpus import BUILTIN_DIR, CHATS_PER_DOCUMENT, iter_documents
from prismlm.errors import CorpusError

SOURCES = {"gutenberg": [{"title": "Emma", "author": "Jane Austen"}, {"title": "Emma", "author": "Jane Austen"}]}


def test_questions_are_fixed_built_from_the_sources_and_asked_once():
    qs = anchor_questions(SOURCES, [("George Washington", 1790)])
    assert qs == anchor_questions(SOURCES, [("George Washington", 1790)])
    assert qs[0] == "What is the capital of France?" and len(qs) == 3 * len(COUNTRIES) + 3 + 2
    assert "Who wrote Emma?" in qs and qs.count("Who wrote Emma?") == 1
    assert "What did George Washington speak about in the 1790 State of the Union address?" in qs


def test_the_heldout_split_is_stable_and_about_a_fifth():
    qs = anchor_questions(json.loads((BUILTIN_DIR / "SOURCES.json").read_text()), [])
    held = [q for q in qs if is_heldout(q)]
    assert 0.1 < len(held) / len(qs) < 0.3
    assert [is_heldout(q) for q in qs] == [is_heldout(q) for q in qs]
    assert not is_heldout("What is the capital of France?")  # the demo's question is in the anchor text


def test_the_shipped_transcripts_split_and_group_as_documents():
    path = BUILTIN_DIR / CHAT_FILE
    with lzma.open(path, "rt") as f:
        header = json.loads(f.readline())
    assert header["model"] == "smollm2-135m-instruct" and header["sampling"] == "greedy"
    anchor, held = list(read_chat_answers(path)), list(read_chat_answers(path, heldout=True))
    assert anchor and held and not {r["question"] for r in anchor} & {r["question"] for r in held}
    assert all(r["text"].endswith(r["answer"] + "<|im_end|>") and r["question"] in r["text"] for r in anchor)
    docs = list(iter_documents("builtin:chat"))
    assert len(docs) == -(-len(anchor) // CHATS_PER_DOCUMENT)
    assert docs[0].text.count("<|im_end|>") >= CHATS_PER_DOCUMENT  # each chat ends its turns with it
    assert not any(r["question"] in "".join(d.text for d in docs) for r in held[:20])  # held-out never enters
    mixed = [d.meta["source"] for d in iter_documents("builtin:gutenberg+sotu+chat", max_docs=6)]
    assert mixed == ["gutenberg", "sotu", "chat"] * 2
    with pytest.raises(CorpusError, match="unknown builtin corpus 'chats'"):
        list(iter_documents("builtin:gutenberg+chats"))
