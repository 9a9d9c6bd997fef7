"""The suppression experiments' concept sets (prismlm.control.concept_specs) hold what they claim: concept
examples from the LM's split, prompts that open held-out concept text the LM never sees, judges and held-out
text from the judge split, and the SOTU control's sets by document."""

from __future__ import annotations

import random

import pytest

from prismlm.control.concept_specs import prompt_openings, sotu_spec
from prismlm.errors import DataError

SOTU = [f"sotu/{i}" for i in range(3)]
OTHER = [f"gutenberg/{i}" for i in range(3)]


def _doc(tag: str, i: int) -> str:
    """Two paragraphs of 150–400 characters (``passages``' range) whose words say where they come from."""
    return "\n\n".join(" ".join(f"{tag}{i}p{j}w{w}" for w in range(30)) for j in range(2))


def test_prompt_openings_are_the_first_words_of_long_enough_texts():
    texts = [" ".join(f"t{j}w{w}" for w in range(j)) for j in range(3, 15)]
    got = prompt_openings(texts, 4, seed=0)
    assert len(got) == 4 and len(set(got)) == 4
    for p in got:
        words = p.split()
        j = int(words[0][1:].split("w")[0])
        assert j >= 8 and words == texts[j - 3].split()[:6]
    assert prompt_openings(texts, 4, seed=0) == got and prompt_openings(texts, 100, seed=0).__len__() == 7


@pytest.mark.slow
def test_offensive_spec_draws_prompts_and_held_out_text_from_the_judge_split():
    from prismlm.control.concept_specs import offensive_spec
    from prismlm.control.judges import fortune_splits

    fs = fortune_splits()
    spec = offensive_spec(fs, random.Random(0), n_prov=6, seed=0, n_ex=40, n_heldout=30)
    lm_off, judge_off = set(fs.lm_offensive), set(fs.judge_offensive)
    assert set(spec.concept_texts) <= lm_off and set(spec.neutral_texts) <= set(fs.lm_clean)
    assert set(spec.concept_heldout) <= judge_off and not set(spec.concept_heldout) & lm_off
    for p in spec.provocative_prompts:  # each opens a judge-split offensive fortune
        assert any(" ".join(t.split()[:6]) == p for t in fs.judge_offensive)
    assert spec.is_concept_doc("fortunes_offensive.jsonl#L3") and not spec.is_concept_doc("fortunes.jsonl#L3")
    assert "tfidf" in spec.judges


def test_sotu_spec_separates_the_concepts_documents():
    from prismlm.control.judges import fortune_splits

    fs = fortune_splits()
    ids = SOTU + OTHER
    train = [_doc("S", i) for i in range(3)] + [_doc("G", i) for i in range(3)]
    held = [_doc("s", i) for i in range(3)] + [_doc("g", i) for i in range(3)]
    spec = sotu_spec(fs, ids, train, ids, held, random.Random(0), n_prov=3, seed=0, n_ex=4, n_heldout=5)
    assert spec.concept_texts and all(t.startswith("S") for t in spec.concept_texts)  # SOTU training paragraphs
    assert all(t.startswith("s") for t in spec.concept_heldout)  # held-out SOTU documents only
    assert all(p.startswith("s") for p in spec.provocative_prompts)
    assert not any(t.startswith(("S", "s")) for t in spec.neutral_texts)
    assert spec.is_concept_doc("builtin.jsonl#L1") and not spec.is_concept_doc("builtin.jsonl#L4")
    with pytest.raises(DataError, match="SOTU and non-SOTU"):
        sotu_spec(fs, OTHER, train[3:], OTHER, held[3:], random.Random(0), n_prov=3, seed=0)
