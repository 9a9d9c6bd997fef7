"""Chat on a run: a message (and an optional system prompt) written with the run's chat template, and the
model's answer to it — generated greedily, ending at the template's end-of-turn token
(``Tokenizer.end_of_turn_ids``). Every command and view that takes a chat message (generate, explain,
attribute, concept, the explorer's chat box and Steer) writes it and stops its answer here.
"""

from __future__ import annotations

import torch

from prismlm.app.run import Run
from prismlm.errors import ModelError
from prismlm.model import PrismLM
from prismlm.model.generation import GREEDY, Sampling

__all__ = ["CHAT_ANSWER_TOKENS", "chat_answer", "chat_prompt", "end_of_turn"]

CHAT_ANSWER_TOKENS = 64
"""Longest chat answer generated for a chat message when no length is given."""


def chat_prompt(run: Run, message: str, system: str | None = None) -> str:
    """The prompt of a one-message chat: ``message`` as the user's turn (after ``system``, the system prompt,
    when given), written with the run's chat template, the assistant's turn opened. ``ModelError`` naming the
    run when it has no template."""
    tok = run.tokenizer
    if not tok.chat_template:
        raise ModelError(
            f"the run {run.path} has no chat template (its tokenizer {tok.name!r} came without "
            "one), so a chat message cannot be written as a prompt",
            fix="pass the text itself instead of a chat message, or retrofit a chat model "
            "(e.g. prism retrofit --from smollm2-135m-instruct)",
        )
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    return tok.apply_chat_template(turns, add_generation_prompt=True)


def end_of_turn(run: Run) -> tuple[int, ...]:
    """The ids that end a chat answer on this run (``Tokenizer.end_of_turn_ids``)."""
    return run.tokenizer.end_of_turn_ids


@torch.no_grad()
def chat_answer(
    run: Run,
    model: PrismLM,
    prompt_ids: list[int],
    tokens: int = CHAT_ANSWER_TOKENS,
    sampling: Sampling = GREEDY,
) -> list[int]:
    """The answer's ids after ``prompt_ids`` (a chat prompt): at most ``tokens``, greedy unless told, up to and
    including the first end-of-turn token."""
    stops = set(end_of_turn(run))
    x = torch.tensor([prompt_ids], dtype=torch.long, device=run.device)  # (1, p)
    out: list[int] = []
    for _, nxt in model.generate_steps(x, tokens, sampling, generator=sampling.generator(run.device)):
        out.append(int(nxt[0, 0]))
        if out[-1] in stops:
            break
    return out
