"""Chat everywhere (issue 35, item 2): a chat message is written with the run's chat template and every
generation of an answer — ``generate``, ``explain``, ``attribute``, ``concept``, the explorer's Explain and
Steer, ``Run.chat`` — stops at the template's end-of-turn token, which is not the end-of-text token.

The tiny run gets a ChatML-like template whose end-of-turn token is one the model really produces in its
greedy answer (registered as a special token): an answer that ran past it would be longer than the tokens up
to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from test_explorer_api import LIMITS, build_explorer_run

from prismlm.app import Run
from prismlm.app.attribution import attribute_text
from prismlm.app.explorer import Explorer
from prismlm.app.operations import ExplanationRequest, explain_text, generate
from prismlm.model.generation import GREEDY, Sampling
from prismlm.tda.attribute import SearchSpec

MESSAGE = "What is the capital of France?"
N = 24


@dataclass
class ChatRun:
    run: Run
    prompt_ids: list[int]
    answer: list[int]
    """The greedy answer up to and including the end-of-turn token."""
    end: int
    """The end-of-turn token's id."""


def _template(end: str) -> str:
    e = "{{ " + json.dumps(end) + " }}"
    return (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}" + e + "\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


@pytest.fixture(scope="module")
def chat(tiny_shards, tmp_path_factory) -> ChatRun:
    folder, _ = build_explorer_run(tiny_shards, tmp_path_factory.mktemp("chat"))
    run = Run.open(folder, device="cpu")
    tok = run.tokenizer
    # the end-of-turn token: one whose vocabulary entry never occurs in plain text (ByteLevel's "Ġ…"), so that
    # registering it as a special token changes no other text's tokens
    vocab = sorted(tok.backend.get_vocab().items(), key=lambda kv: kv[1])
    end = next(i for s, i in vocab if s.startswith("Ġ") and len(s) >= 3)
    raw = tok.backend.id_to_token(end)
    tok.backend.add_special_tokens([raw])
    assert tok.backend.token_to_id(raw) == end
    tok.chat_template = _template(raw)
    ids = tok.encode(run.chat_prompt(MESSAGE))
    with torch.no_grad():
        g = run.model.generate(torch.tensor([ids]), N, GREEDY)[0, len(ids) :].tolist()
        assert end != g[0]
        # the toy repeats its first token: make the end-of-turn token out-rank it, so that the model really
        # produces it — and, unstopped, goes on after it
        W = run.model.lm_head.weight
        W[end] = 2.0 * W[g[0]]
        g = run.model.generate(torch.tensor([ids]), N, GREEDY)[0, len(ids) :].tolist()
    j = g.index(end)
    assert len(g) > j + 1
    return ChatRun(run, ids, g[: j + 1], end)


def test_the_end_of_turn_token_is_read_off_the_template(chat):
    tok = chat.run.tokenizer
    assert tok.end_of_turn_ids == (tok.eot_id, chat.end)
    template, tok.chat_template = tok.chat_template, None
    try:
        assert tok.end_of_turn_ids == (tok.eot_id,)  # no template: end-of-text only
    finally:
        tok.chat_template = template


def test_every_chat_answer_stops_at_the_end_of_turn_token(chat):
    run, tok = chat.run, chat.run.tokenizer
    want = tok.decode(chat.answer[:-1])  # the answer's text, the end-of-turn token cut
    assert run.chat(MESSAGE, tokens=N) == want  # the Python API
    assert generate(run, chat=MESSAGE, tokens=N, sampling=GREEDY) == [want]  # prism generate --chat
    expl = explain_text(run, request=ExplanationRequest(chat=MESSAGE, generate=N))  # prism explain --chat
    assert expl.token_ids[expl.prompt_tokens :] + [expl.positions[-1].next_id] == chat.answer
    ex = Explorer(run, limits=LIMITS)
    view = ex.explain(MESSAGE, chat=True, generate=N)  # the explorer's chat box
    assert view.token_ids[view.prompt_tokens :] + [view.positions[-1].chosen.id] == chat.answer
    steer = ex.steer(MESSAGE, chat=True, tokens=N, sampling=GREEDY, steering=ex_steering())  # Steer
    assert len(steer.steered) == len(steer.base) == len(chat.answer)
    assert steer.steered[-1] == tok.id_to_token(chat.end)


def ex_steering():
    from prismlm.app.explorer import Steering

    return Steering(suppress=(0,))


def test_a_system_prompt_is_written_before_the_message(chat):
    ex = Explorer(chat.run, limits=LIMITS)
    view = ex.explain(MESSAGE, chat=True, generate=4, system="Answer in one word.")
    assert "system\nAnswer in one word." in view.text  # (the toy's window may drop the first tokens)
    assert view.text.index("Answer in one word.") < view.text.index(MESSAGE)


def test_attribute_measures_the_chat_answer(chat, tiny_shards):
    att = attribute_text(
        chat.run, chat=MESSAGE, search=SearchSpec(method="full", max_sequences=8), shards=tiny_shards.root
    )
    assert att.measured_tokens == len(chat.answer)
    assert att.completion == chat.run.tokenizer.decode(chat.answer)
    with pytest.raises(ValueError, match="chat"):
        attribute_text(chat.run, "a text too", chat=MESSAGE)


def test_explanations_are_greedy_by_default(chat):
    """One default for explanations: ``explain_text --generate`` and the explorer agree with a greedy run."""
    run = chat.run
    expl = explain_text(run, "It is a truth", ExplanationRequest(generate=6))
    ids = run.tokenizer.encode("It is a truth")
    with torch.no_grad():
        greedy = run.model.generate(torch.tensor([ids]), 6, Sampling(temperature=0.0))[0].tolist()
    stop = next((j for j in range(len(ids), len(greedy)) if greedy[j] in run.tokenizer.end_of_turn_ids), None)
    greedy = greedy if stop is None else greedy[: stop + 1]  # (on this chat run, up to the end of the turn)
    assert expl.token_ids + [expl.positions[-1].next_id] == greedy
    view = Explorer(run, limits=LIMITS).explain("It is a truth", generate=6)
    assert view.token_ids == expl.token_ids


def test_concept_finding_reads_the_texts_as_chats(chat, tmp_path):
    from prismlm.app.chat import chat_texts
    from prismlm.app.control import find_run_concept

    (tmp_path / "concept.txt").write_text("What is the capital of France?\n\nWhere is Paris?\n")
    (tmp_path / "neutral.txt").write_text("How do I boil an egg?\n\nWhat time is it?\n")
    res = find_run_concept(chat.run, tmp_path / "concept.txt", tmp_path / "neutral.txt", chat=True)
    chats = chat_texts(chat.run, ["What is the capital of France?", "Where is Paris?"])
    assert all(c.endswith(chat.run.tokenizer.decode([chat.end])) for c in chats)  # each answer up to end-of-turn
    tokens = sum(min(len(chat.run.tokenizer.encode(c)), chat.run.model.config.block_size) for c in chats)
    assert res.suppression.meta["concept_tokens"] == tokens


def test_a_plain_generation_on_a_chat_run_ends_with_the_turn_too(chat):
    """The template pasted by hand (or any text) on a run with a chat template: generation still stops at the
    end-of-turn token — past it the model would write the next turn."""
    run = chat.run
    prompt = run.chat_prompt(MESSAGE)
    want = run.tokenizer.decode(chat.answer[:-1])
    assert generate(run, prompt, tokens=N, sampling=GREEDY) == [prompt + want]
    expl = explain_text(run, prompt, ExplanationRequest(generate=N))
    assert expl.token_ids[expl.prompt_tokens :] + [expl.positions[-1].next_id] == chat.answer
