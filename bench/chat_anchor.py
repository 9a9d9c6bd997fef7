"""Generate the built-in chat anchor text (``prismlm/data/builtin/chat-answers.jsonl.xz``): SmolLM2-135M-Instruct's
greedy answers to the fixed questions of ``prismlm.data.chat_anchor.anchor_questions``. Run once; the file's
header line records the command, model, date and revision.

    python bench/chat_anchor.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import lzma
import time

import torch
from _common import environment

from prismlm.app.operations import sample_continuations
from prismlm.data.chat_anchor import CHAT_FILE, anchor_questions, is_heldout
from prismlm.data.corpus import BUILTIN_DIR, sotu_documents
from prismlm.model.generation import Sampling
from prismlm.model.pretrained import build_model, load_pretrained
from prismlm.progress import Reporter

SOURCE = "smollm2-135m-instruct"
ANSWER_TOKENS = 64


def presidents() -> list[tuple[str, int]]:
    """(president, year of their first State of the Union speech), in order of that year."""
    first: dict[str, int] = {}
    for doc in sotu_documents():
        name, year = doc.meta.get("president_full") or doc.meta.get("president"), doc.meta.get("year")
        if isinstance(name, str) and isinstance(year, int) and name not in first:
            first[name] = year
    return sorted(first.items(), key=lambda item: item[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sources = json.loads((BUILTIN_DIR / "SOURCES.json").read_text())
    questions = anchor_questions(sources, presidents())
    pre = load_pretrained(SOURCE, block_size=256)
    model, tok = build_model(pre, pre.model).eval(), pre.tokenizer
    greedy = Sampling(temperature=0.0)
    end = tok.backend.id_to_token(tok.eot_id)
    assert end is not None  # the end-of-turn token is in the vocabulary
    env = environment("cpu", 0)
    header = {"model": SOURCE, "sampling": "greedy", "answer_tokens": ANSWER_TOKENS, "questions": len(questions),
              "command": env["command_line"], "git_revision": env.get("git_revision"), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    lines = [json.dumps(header)]
    with Reporter(True, "answers", len(questions), unit="q") as bar:
        for q in questions:  # one chat at a time: prompts differ in length
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            answer = sample_continuations(model, tok, prompt, samples=1, tokens=ANSWER_TOKENS, sampling=greedy,
                                          stop_id=tok.eot_id)[0]  # fmt: skip
            lines.append(json.dumps({"question": q, "answer": answer, "text": prompt + answer + end,
                                     "heldout": is_heldout(q)}))  # fmt: skip
            bar.update(1)
    with lzma.open(BUILTIN_DIR / CHAT_FILE, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"chat anchor: {len(questions)} answers → {BUILTIN_DIR / CHAT_FILE}")


if __name__ == "__main__":
    main()
