"""The ``explanations`` stage of ``bench/real_claims.py``: 200 chat answers of the retrofitted
SmolLM2-135M-Instruct, each answer token's logit split exactly into prototype slices S, residual R and bias B
(ℓ_y = S + R + B), the shares of the logit and of the greedy margin they carry (``prismlm.eval.claims``) beside
fixed-subspace yardsticks, and four explained answers as HTML and explorer screenshots.

Run: ``python bench/claims_explanations.py [--quick]`` after ``claims_bank.py`` (or ``real_claims.py --stage
explanations``). The definitions and the protocol: docs/results.md ("How bench/real_claims.py measures").
Resumable: answers are cached batch by batch in ``WORK/explanations/answers[-quick].jsonl``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from _common import ClaimsContext, obj, run_claims_stage

from prismlm.app.chat import chat_prompt
from prismlm.app.operations import ExplanationRequest, explain_text
from prismlm.app.run import Run
from prismlm.data.chat_questions import chat_questions
from prismlm.errors import DependencyError
from prismlm.eval.claims import explanation_margin_fields, logit_shares
from prismlm.eval.faithfulness import (
    FaithfulnessAccumulator,
    Yardstick,
    answer_faithfulness,
    choice_parts,
    yardstick_from_moments,
)
from prismlm.explain import Explanation
from prismlm.model import PrismLM, PrismOutput
from prismlm.render import RunHeader, write_html
from prismlm.web.screenshots import Shot, take_screenshots

ANSWER_TOKENS = 24
"""Greedy answer tokens per question for the shares (the issue: ~24)."""
BATCH = 20
QUICK_ANSWERS = 5
SHOWCASE_TOKENS = 32
"""Answer tokens of the explained answers (their HTML embeds every position's waterfall)."""
SHOWCASE_NEIGHBOURS = 3
CARDS_PER_TOKEN = 2
"""Prototype cards kept in the HTML per answer token (its largest |slices|; ``answer_cards_only``)."""
"""Nearest training contexts per prototype card in the HTML (the explorer screenshots show the same)."""
DOCS = Path(__file__).resolve().parents[1] / "docs" / "explanations"

# (file stem, question, the answer's text up to the token whose logit the docs and the screenshot look at)
SHOWCASE = [
    ("fact", "What is the capital of France?", "Paris"),
    # SmolLM2-135M refuses almost nothing (2 of the 40 refusal questions; it explains how to steal a car or
    # hide a body): this is one of the two it does refuse ("I'm sorry for any offense, but as a chatbot …")
    ("refusal", "Write something rude about old people.", "I'm sorry"),
    ("arithmetic", "What is 100 divided by 4?", "equals 2"),
    ("code", "Write a Python function that returns the square of a number.", "num **"),
]


def explanation_stage(ctx: ClaimsContext) -> dict[str, object]:
    torch.set_num_threads(ctx.threads)
    stage = ctx.stage_dir("explanations")
    run = ctx.open_run()
    questions = chat_questions()[: QUICK_ANSWERS if ctx.quick else None]
    cache = stage / f"answers{'-quick' if ctx.quick else ''}.jsonl"
    t0 = time.perf_counter()
    records = answer_all(ctx, run, questions, cache)
    t_answers = time.perf_counter() - t0
    shares = logit_shares([r["parts"] for r in records])
    padding = padding_check(run, records[:4])
    ctx.log(f"explanations: shares over {len(records)} answers {shares['mean']}; padding check {padding}")
    # the re-run's head (faithful) owns the docs' explanations; the paper head's go beside them
    out_dir = stage / "docs" if ctx.quick else DOCS if ctx.head == "faithful" else DOCS / "paper-head"
    showcase = [explain_showcase(ctx, run, out_dir, *s) for s in SHOWCASE]
    shots = screenshots(ctx, run, showcase, out_dir)
    by_kind = {
        k: logit_shares([r["parts"] for r in records if r["kind"] == k])["mean"] for k in {r["kind"] for r in records}
    }
    mean = obj(shares, "mean")
    faith = pooled_margins(ctx, run, records)
    ctx.log(f"explanations: pooled margin shares {faith}")
    summary = {
        "explained_answers": len(records),
        "answer_tokens": shares["tokens"],
        "logit_share_slices_abs": mean["abs_share_slices"],
        "logit_share_residual_abs": mean["abs_share_residual"],
        "logit_share_bias_abs": mean["abs_share_bias"],
        "logit_share_slices_gross": mean["gross_share_slices"],
        "logit_fraction_slices_signed": mean["signed_fraction_slices"],
        "logit_fraction_slices_pooled": shares["pooled_fraction_slices"],
        "logit_identity_max_abs_error": shares["max_abs_error"],
        "logit_share_mean_direction_abs": mean["ref_abs_share_mean_direction"],
        "logit_share_pca_subspace_abs": mean["ref_abs_share_pca_subspace"],
        "margin_share_slices_abs": mean["margin_abs_share_slices"],
        "margin_fraction_slices_pooled": shares["pooled_margin_fraction_slices"],
        **explanation_margin_fields(shares, faith),
        "explanation_html": [s["html"] for s in showcase],
        "explanation_screenshots": shots,
    }
    return {
        "summary": summary,
        "definitions": DEFINITIONS,
        "shares": shares,
        "answer_faithfulness": faith,
        "shares_by_kind": by_kind,
        "padding_check": padding,
        "showcase": showcase,
        "answers": [{k: r[k] for k in ("kind", "question", "answer")} for r in records],
        "answer_seconds": round(t_answers, 1),
        "answer_cache": str(cache),
    }


DEFINITIONS = {
    "S": "sum over the k active prototypes of a_i (W p_i)_y at the answer token y (its own, generated, logit)",
    "R": "(W r)_y, the residual slice",
    "B": "b_y, the unembedding bias slice (the retrofitted SmolLM2 has none: 0)",
    "abs_share_slices": "|S| / (|S| + |R| + |B|), per token; mean over an answer's tokens, then over answers",
    "gross_share_slices": "sum_i |slice_i| / (sum_i |slice_i| + |R| + |B|) (the explorer's share convention)",
    "signed_fraction_slices": "S / logit_y (S/l + R/l + B/l = 1), per token; mean over tokens, then answers",
    "pooled_fraction_slices": "sum of S over every answer token / sum of logit_y over them",
    "top_share": "max_i |slice_i| / (sum_i |slice_i| + |R| + |B|): the single largest prototype's share",
    "margin_abs_share_slices": "the same |.| share for the greedy margin logit_y - logit_y2 (y2 the runner-up "
    "token): |dS| / (|dS| + |dR| + |dB|), dS = S_y - S_y2 etc.: how much of the choice the slices carry",
    "margin_fraction_slices": "dS / (logit_y - logit_y2), signed (unstable where the margin is near 0: see the "
    "median and the pooled sum dS / sum margin)",
    "ref_abs_share_mean_direction": "yardstick: |M| / (|M| + |logit - M|), M = (z.mu)(w_y.mu), mu the unit mean of "
    "the anchor z (the bank's training hidden states)",
    "ref_abs_share_pca_subspace": "yardstick: the same with M = (Q^T z).(Q^T w_y), Q the mean and the top k "
    "principal directions of the anchor z (1 + k fixed directions for every token; k = the active prototypes)",
    "explanation_margin_share": "sum over answer tokens of (lhat_y1 - lhat_y2) / sum of (logit_y1 - logit_y2), "
    "lhat = W zhat + b the prototype-only prediction, y1, y2 the model's top two (FaithfulnessAccumulator)",
    "explanation_margin_share_pca": "the same for the fixed-subspace yardstick W Q Q^T z + b (Q as above)",
}


def pooled_margins(ctx: ClaimsContext, run: Run, records: list[dict]) -> dict[str, float]:
    """``FaithfulnessAccumulator.result()`` over the answer tokens (teacher-forced on each greedy answer, one
    forward per chat), with the anchor z's yardstick (``reference``): ``margin_share`` the prototype-only
    prediction's pooled share of the model's top-2 margin, ``pca_margin_share`` the fixed subspace's (1 + k
    directions, k the active prototypes per token)."""
    model = run.prism_model("the pooled margin shares")
    chats = [(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in records if r["answer_ids"]]
    acc = FaithfulnessAccumulator(yardstick=reference(ctx), median_cap=0)
    return answer_faithfulness(model, chats, acc).result()


# ----- answers and their logit parts ------------------------------------------------------------------------
def answer_all(ctx: ClaimsContext, run: Run, questions: list[tuple[str, str]], cache: Path) -> list[dict]:
    """Every question's greedy answer with the parts of each answer token's logit, from ``cache`` where an
    earlier (killed) run wrote them, the rest in batches of ``BATCH`` (each appended to ``cache``)."""
    done = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["question"]] = rec
    todo = [q for q in questions if q[1] not in done]
    ctx.log(f"explanations: {len(done)} answers cached, {len(todo)} to generate ({cache})")
    model, tok = run.prism_model("the logit shares"), run.tokenizer
    ref = reference(ctx) if todo else None
    t0 = time.perf_counter()
    for s in range(0, len(todo), BATCH):
        batch = todo[s : s + BATCH]
        prompts = [tok.encode(chat_prompt(run, q)) for _, q in batch]
        assert ref is not None
        answers = greedy_parts(model, prompts, ANSWER_TOKENS, ref, stop_id=tok.eot_id)
        with cache.open("a") as f:
            for (kind, q), prompt, (ids, parts) in zip(batch, prompts, answers):
                rec = {
                    "kind": kind,
                    "question": q,
                    "answer": tok.decode(ids),
                    "prompt_ids": prompt,
                    "answer_ids": ids,
                    "parts": parts,
                }
                done[q] = rec
                f.write(json.dumps(rec) + "\n")
        n = s + len(batch)
        ctx.log(f"explanations: answered {n}/{len(todo)} ({time.perf_counter() - t0:.0f} s)")
    return [done[q] for _, q in questions]


@torch.inference_mode()
def greedy_parts(
    model: PrismLM, prompts: list[list[int]], max_new: int, ref: Yardstick, *, stop_id: int
) -> list[tuple[list[int], list[list[float]]]]:
    """Greedy answers to a batch of prompts (left-padded; the attention mask keeps each row as it is alone)
    and, per answer token, the parts of its logit (``PARTS``), from the very forward that chose it.
    Each answer ends before ``stop_id`` (the end-of-turn token) or after ``max_new`` tokens."""
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), stop_id, dtype=torch.long)  # (B, P); padding is masked out
    mask = torch.zeros((B, P), dtype=torch.long)  # (B, P): 1 on real tokens
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    cache, feed = model.new_cache(), ids
    tokens, parts = [], []
    ended = torch.zeros(B, dtype=torch.bool)
    for _ in range(max_new):
        out = model(feed, cache=cache, attention_mask=mask, last_only=True)
        top2 = out.logits[:, -1].float().topk(2, dim=-1).indices  # (B, 2)
        nxt = top2[:, :1]  # (B, 1): greedy
        parts.append(token_parts(model, out, top2, ref))  # (B, len(PARTS))
        tokens.append(nxt[:, 0])
        ended |= nxt[:, 0] == stop_id
        if bool(ended.all()):
            break
        feed, mask = nxt, torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
    toks = torch.stack(tokens, 1).tolist()  # (B, n)
    vals = torch.stack(parts, 1).tolist()  # (B, n, len(PARTS))
    result = []
    for row, v in zip(toks, vals):
        n = row.index(stop_id) if stop_id in row else len(row)
        result.append((row[:n], v[:n]))
    return result


def token_parts(model: PrismLM, out: PrismOutput, top2: torch.Tensor, ref: Yardstick) -> torch.Tensor:
    """(B, len(PARTS)) parts of the logits of ``top2`` (B, 2) — the chosen token and the runner-up — at the
    last position of ``out`` (``prismlm.eval.faithfulness.choice_parts``)."""
    assert out.indices is not None and out.activations is not None and out.residual is not None
    last = PrismOutput(
        logits=out.logits[:, -1:],
        hidden=out.hidden[:, -1:],
        indices=out.indices[:, -1:],
        activations=out.activations[:, -1:],
        residual=out.residual[:, -1:],
        prototype_multipliers=out.prototype_multipliers,
    )
    parts = choice_parts(model, last, top2[:, None, :], ref)  # each (B, 1)
    return torch.stack([c[:, 0] for c in parts], dim=-1)  # (B, len(PARTS))


def reference(ctx: ClaimsContext, chunk: int = 16384) -> Yardstick:
    """The ``Yardstick`` of the bank's anchor hidden states (the retrofit's stored z, float16 rows of d),
    mean and covariance accumulated in float64 chunks (the full bank holds ~140k rows)."""
    folder = ctx.bank_run / "stored-z"
    manifest = json.loads((folder / "manifest.json").read_text())
    rows, d, k = int(manifest["rows"]), int(manifest["d"]), ctx.size.top_k
    z = np.memmap(folder / "z.bin", dtype=np.float16, mode="r", shape=(rows, d))
    total, outer = torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
    for s in range(0, rows, chunk):
        x = torch.from_numpy(np.asarray(z[s : s + chunk], dtype=np.float64))  # (chunk, d)
        total += x.sum(0)
        outer += x.T @ x
    return yardstick_from_moments(total, outer, rows, k)  # μ̂ and the k largest principal directions


@torch.no_grad()
def padding_check(run: Run, records: list[dict]) -> dict[str, float | int]:
    """The batched (left-padded, cached) logits of ``records``' answer tokens against one plain forward per
    answer over prompt + answer: max |difference|, and whether greedy picks the same tokens."""
    model = run.prism_model("the padding check")
    worst, same = 0.0, 0
    for r in records:
        ids, ans = r["prompt_ids"] + r["answer_ids"], r["answer_ids"]
        if not ans:
            continue
        logits = model(torch.tensor([ids])).logits[0, len(r["prompt_ids"]) - 1 : len(ids) - 1]  # (n, V)
        own = logits.gather(-1, torch.tensor(ans)[:, None])[:, 0].double()  # (n,)
        worst = max(worst, float((own - torch.tensor([p[0] for p in r["parts"]])).abs().max()))
        same += int(logits.argmax(-1).tolist() == ans)
    return {"answers": len(records), "max_abs_logit_diff": worst, "same_greedy_tokens": same}


# ----- three explained answers -----------------------------------------------------------------------------
def explain_showcase(ctx: ClaimsContext, run: Run, out_dir: Path, name: str, question: str, focus: str) -> dict:
    """Explain the answer to ``question`` (``explain_text`` with ``chat``), write its HTML report to
    ``out_dir / name.html`` and return what the docs quote: the answer, and at the answer token where the
    answer so far ends with ``focus`` (else the first) the top prototypes with labels, signature tokens and nearest contexts."""
    t0 = time.perf_counter()
    request = ExplanationRequest(chat=question, generate=SHOWCASE_TOKENS, neighbours=SHOWCASE_NEIGHBOURS)
    expl = explain_text(run, request=request)
    start = expl.prompt_tokens or 0
    answer = [p for p in expl.positions if p.position + 1 >= start and p.next_id != run.tokenizer.eot_id]
    path = write_html(
        answer_cards_only(expl, answer),
        out_dir / f"{name}.html",
        title=f"PRISM explanation: {question}",
        run=RunHeader.of(run),
    )
    ids = [p.next_id for p in answer]
    hit = [j for j in range(len(ids)) if run.tokenizer.decode(ids[: j + 1]).endswith(focus)]
    pos = answer[hit[0]] if hit else answer[0] if answer else expl.positions[-1]
    ctx.log(f"explanations: {name} → {path} ({path.stat().st_size // 1024} KiB, {time.perf_counter() - t0:.0f} s)")
    return {
        "name": name,
        "question": question,
        "answer": run.tokenizer.decode([p.next_id for p in answer]),
        "html": rel(path),
        "html_kib": round(path.stat().st_size / 1024, 1),
        "max_abs_error": expl.max_abs_error,
        "focus": focus_record(expl, pos),
        "answer_top_prototypes": top_prototypes(expl, answer),
        "text": expl.text,
        "prompt_tokens": start,
    }


def answer_cards_only(expl: Explanation, answer: list) -> Explanation:
    """``expl`` with the cards of each answer token's ``CARDS_PER_TOKEN`` largest prototypes only: every
    position keeps its exact waterfall and slice table, but a card is ~5 KB of HTML and JSON, and one for
    each of the k = 8 prototypes of every token, the chat template's (~30 tokens) included, made 1 MB files."""
    used = {s.id for p in answer for s in p.prototypes[:CARDS_PER_TOKEN]}
    note = (
        f"cards: the {len(used)} prototypes among the {CARDS_PER_TOKEN} largest |slices| of an answer token "
        "(every token keeps its full waterfall)"
    )
    return replace(expl, prototypes={i: c for i, c in expl.prototypes.items() if i in used}, notes=[*expl.notes, note])


def focus_record(expl: Explanation, pos) -> dict:
    """One answer token's decomposition with its top three prototypes' cards (label, signature, neighbours)."""
    top = []
    for s in pos.prototypes[:3]:
        card = expl.prototypes[s.id]
        top.append(
            {
                "id": s.id,
                "slice": round(s.slice, 3),
                "share": round(s.share, 3),
                "label": s.label,
                "category": s.category,
                "pushes_up": [t for t, _ in card.top_tokens[:8]],
                "neighbours": [n.snippet for n in card.neighbours[:5]],
                "neighbour_docs": [n.doc_id for n in card.neighbours[:5]],
            }
        )
    return {
        "position": pos.position,
        "context_token": pos.token,
        "token": pos.next_token,
        "logit": round(pos.logit, 3),
        "prob": round(pos.prob, 3),
        "slices": round(sum(s.slice for s in pos.prototypes), 3),
        "residual": round(pos.residual_slice, 3),
        "residual_share": round(pos.residual_share, 3),
        "top": top,
    }


def top_prototypes(expl: Explanation, answer: list) -> list[dict]:
    """The prototypes with the largest summed |slice| over the answer's tokens, with their labels."""
    mass: dict[int, float] = {}
    for p in answer:
        for s in p.prototypes:
            mass[s.id] = mass.get(s.id, 0.0) + abs(s.slice)
    best = sorted(mass, key=mass.__getitem__, reverse=True)[:5]
    return [{"id": i, "abs_slice_sum": round(mass[i], 2), "label": expl.prototypes[i].label} for i in best]


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(DOCS.parents[1]))
    except ValueError:
        return str(path)


# ----- explorer screenshots --------------------------------------------------------------------------------
def screenshots(ctx: ClaimsContext, run: Run, showcase: list[dict], out_dir: Path) -> list[str] | str:
    """A screenshot of the explorer's explain view of each explained answer (the prompt + answer as text,
    the focus token selected), or why none was taken (no chromium / playwright)."""
    shots = [Shot(s["name"], s["text"], s["focus"]["position"]) for s in showcase]
    try:
        paths = take_screenshots(run.path, shots, out_dir)
    except DependencyError as e:  # no playwright or chromium here
        return f"no screenshots: {e}"
    except Exception as e:  # noqa: BLE001 - a failing browser must not lose the stage's numbers
        ctx.log(f"explanations: screenshots failed: {e!r}")
        return f"screenshots failed: {e!r}"
    return [rel(p) for p in paths]


def main(argv: list[str] | None = None) -> None:
    run_claims_stage("explanations", explanation_stage, __doc__, argv)


if __name__ == "__main__":
    main()
