"""Chat on a run: a message (and an optional system prompt) written with the run's chat template, and the
model's answer to it — generated greedily, ending at the template's end-of-turn token
(``Tokenizer.end_of_turn_ids``). Every command and view that takes a chat message (generate, explain,
attribute, concept, the explorer's chat box and Steer) writes it and stops its answer here; ``Run.chat`` is
the same for the Python API.
"""

from __future__ import annotations

from prismlm.app.run import Run

__all__ = ["CHAT_ANSWER_TOKENS", "chat_prompt", "chat_texts", "end_of_turn", "stops_for"]

CHAT_ANSWER_TOKENS = 64
"""Longest chat answer generated for a chat message when no length is given."""


def chat_prompt(run: Run, message: str, system: str | None = None) -> str:
    """``Run.chat_prompt``: ``message`` (after ``system``) written with the run's chat template."""
    return run.chat_prompt(message, system)


def end_of_turn(run: Run) -> tuple[int, ...]:
    """The ids that end a chat answer on this run (``Tokenizer.end_of_turn_ids``)."""
    return run.tokenizer.end_of_turn_ids


def chat_texts(run: Run, messages: list[str], tokens: int = CHAT_ANSWER_TOKENS) -> list[str]:
    """Each message as the model sees and answers it in a chat: written with the run's chat template, the
    model's answer (greedy, up to and including the end-of-turn token) appended."""
    tok = run.tokenizer
    out = []
    for m in messages:
        ids = tok.encode(run.chat_prompt(m))
        out.append(tok.decode(ids + run.chat_ids(ids, tokens)))
    return out


def stops_for(run: Run, chat: bool) -> tuple[int, ...]:
    """The tokens a generation on ``run`` stops at: the end-of-turn tokens for a chat message, and for any
    text on a run with a chat template (past the end of a turn the model writes the next turn); none
    otherwise (a plain model's end-of-text starts a new document, which a continuation may run into)."""
    return end_of_turn(run) if chat or run.tokenizer.chat_template else ()
