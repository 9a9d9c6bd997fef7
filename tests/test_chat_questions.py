"""The explanations claim's fixed chat questions: 200, 40 of each kind, distinct, interleaved by kind."""

from __future__ import annotations

from collections import Counter

from prismlm.data.chat_questions import KINDS, chat_questions


def test_two_hundred_questions_forty_of_each_kind_interleaved():
    qs = chat_questions()
    assert len(qs) == 200 and Counter(k for k, _ in qs) == dict.fromkeys(KINDS, 40)
    assert len({q for _, q in qs}) == 200  # no question twice
    assert [k for k, _ in qs[:5]] == list(KINDS)  # a prefix (the quick run's five) holds one of each kind
    assert all(q.strip() == q and q[-1] in "?." for _, q in qs)
    assert chat_questions() == qs  # fixed
