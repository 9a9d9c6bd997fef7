"""The explorer's Explain view: every next-token logit of a text (or of a generation) as a waterfall of
prototype slices + residual (+ bias), for the chosen token and the most probable alternatives.

Invariant: every number is exact, not re-derived — a waterfall is ``prismlm.model.decompose`` of the model's
own forward output for that token (Σ slices + residual + bias = the logit, to rounding: ``max_abs_error``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import NamedTuple, TypedDict

import torch

from prismlm.app.chat import CHAT_ANSWER_TOKENS, chat_prompt, stops_for
from prismlm.app.explorer.plain import Plain
from prismlm.app.explorer.session import Session
from prismlm.app.explorer.steer import Steering, SteeringDict, activity, interventions
from prismlm.control.activity import Activity
from prismlm.explain import Explanation, explain, explain_generation
from prismlm.explain.explanation import StepGuard
from prismlm.explain.records import CardDict
from prismlm.model import PrismLM, PrismOutput, decompose
from prismlm.model.generation import Sampling
from prismlm.progress import Progress

__all__ = ["ActivePrototype", "Candidate", "ExplainView", "PositionView", "explain_view"]


@dataclass
class Candidate:
    """One token's logit at one position, split exactly: ``logit == Σ slices + residual + bias``."""

    id: int
    token: str
    rank: int
    """0 = the most probable token."""
    logit: float
    prob: float
    slices: list[float]
    """One per entry of the position's ``active`` list (same order): a_i (W p_i)_y · m_i."""
    residual: float
    bias: float
    total: float
    """Σ slices + residual + bias, in the model's dtype."""


class ActivePrototype(TypedDict):
    """A prototype active (a > 0) at a position: one step of its waterfalls."""

    id: int
    activation: float
    multiplier: float
    """m_i under the request's steering (1: unchanged)."""
    label: str | None
    category: str | None


@dataclass
class PositionView:
    """Why the model predicted ``chosen`` after the tokens up to ``position`` — and not an alternative.
    Every view's convention: token j stands for the prediction OF it, ``logits[j − 1, tokens[j]]``."""

    position: int
    """The last context token (the hidden state that predicts)."""
    token_index: int
    """Index in ``tokens`` of the explained token: ``position + 1`` (``len(tokens)``: the model's own)."""
    chosen_by: str
    chosen: Candidate
    alternatives: list[Candidate]
    active: list[ActivePrototype]
    """The active prototypes, by decreasing |chosen slice|."""
    top_prototype: int | None
    top_share: float
    residual_share: float
    """residual / (Σ|slices| + |residual|) of the chosen token (signed)."""
    model_top_id: int = -1
    """argmax of the model's logits here: its own prediction (the library explanation's ``model_top_id``)."""
    prototype_top_id: int = -1
    """argmax of the prototype-only logits W ẑ (+ b): what the prototypes alone would have predicted; the
    view flags it when it is not ``model_top_id`` (``TokenExplanation.prototype_top_id``)."""
    prototype_top_token: str = ""
    prototype_prob: float = 0.0
    """softmax(W ẑ (+ b)) of the chosen token."""


@dataclass
class ExplainView(Plain):
    """What ``Explorer.explain`` returns: the text's tokens and a ``PositionView`` per predicting position."""

    text: str
    """The text explained (with a chat request: the prompt written with the chat template)."""
    token_ids: list[int]
    """(n,) the tokens explained, prompt and generation."""
    tokens: list[str]
    """(n,) their strings."""
    prompt_tokens: int | None
    """Tokens of the prompt when a generation follows it (None: no generation)."""
    truncated_tokens: int
    """Tokens cut from the start to fit the context window."""
    positions: list[PositionView]
    """One per predicting position, in order."""
    cards: dict[str, CardDict]
    """Prototype id → card (label, category, top tokens, stats, neighbours) for every active prototype."""
    max_abs_error: float
    """max |Σ slices + residual + bias − logit| over every waterfall shown."""
    steering: SteeringDict
    """The request's steering, echoed."""
    notes: list[str]
    activity: Activity | None = None
    """With steering: which steered prototypes are active on the text, and where the concept's target tokens
    are predicted (a warning in ``notes`` when none is)."""


def explain_view(
    s: Session,
    text: str,
    *,
    generate: int,
    alternatives: int,
    steering: Steering,
    neighbours: int,
    sampling: Sampling,
    chat: bool,
    system: str | None = None,
    progress: Progress = False,
) -> ExplainView:
    """``Explorer.explain``: checks the request, explains ``text`` (or ``generate`` tokens sampled after it)
    under ``steering`` and splits every chosen token's logit and its ``alternatives``. ``chat``: ``text`` is a
    message (after the ``system`` prompt), its answer generated up to the end-of-turn token. A generation
    holds the model lock one token at a time (``progress`` gets each token), so other requests run between."""
    s.limits.check_text(text)
    s.limits.check_text(system or "", "system")
    stop_id = stops_for(s.run, chat)  # on a run with a chat template every generation ends with the turn
    if chat:
        text = chat_prompt(s.run, text, system)
        generate = generate or min(CHAT_ANSWER_TOKENS, s.limits.max_generate)
        sampling = replace(sampling, temperature=0.0)
    s.limits.check_sampling(generate, sampling, "generate")
    s.limits.check_top(alternatives, "alternatives")
    s.limits.check_top(neighbours, "neighbours")
    ivs = interventions(s, steering)
    expl = None
    if generate:
        expl = _explanation(
            s, s.model, text, generate, neighbours, sampling=sampling, stop_id=stop_id, guard=lambda: s.locked(ivs),
            progress=progress,
        )  # fmt: skip
    with s.lock, s.run.intervened(*ivs) as model, torch.no_grad():
        if expl is None:
            expl = _explanation(s, model, text, 0, neighbours, sampling=sampling, stop_id=None)
        x = torch.tensor([expl.token_ids], dtype=torch.long, device=s.run.device)  # (1, n)
        chosen = [p.next_id for p in expl.positions]
        positions, err = waterfalls(s, model, model(x), chosen, [p.chosen_by for p in expl.positions], alternatives)
        act = None if steering.empty else activity(s, steering, [*expl.token_ids, chosen[-1]])
    warning = act.warning("steered") if act is not None else None
    for view, pos in zip(positions, expl.positions):  # the prototype-only prediction: the explanation's one value
        view.model_top_id, view.prototype_top_id = pos.model_top_id, pos.prototype_top_id
        view.prototype_top_token, view.prototype_prob = pos.prototype_top_token, pos.prototype_prob
    return ExplainView(
        text=expl.text,
        token_ids=expl.token_ids,
        tokens=[s.run.tokenizer.id_to_token(i) for i in expl.token_ids],
        prompt_tokens=expl.prompt_tokens,
        truncated_tokens=expl.truncated_tokens,
        positions=positions,
        cards={str(k): c.to_dict() for k, c in sorted(expl.prototypes.items())},
        max_abs_error=err,
        steering=steering.to_dict(),
        # a torn labels.json is served without labels: said beside the answer it affects, not only in /api/info
        notes=list(expl.notes)
        + ([act.summary("steered")] if act is not None else [])
        + ([warning] if warning else [])
        + ([f"served without labels: {lost}"] if (lost := _labels_error(s)) else []),
        activity=act,
    )


def _labels_error(s: Session) -> str | None:
    return s.index.labels_error if s.index is not None else None


def _explanation(
    s: Session,
    model: PrismLM,
    text: str,
    generate: int,
    neighbours: int,
    *,
    sampling: Sampling,
    stop_id: tuple[int, ...] | None,
    guard: StepGuard = nullcontext,
    progress: Progress = False,
) -> Explanation:
    """The library's explanation of ``text`` (or of ``generate`` tokens sampled after it, each step inside
    ``guard``)."""
    if not generate:
        return explain(model, s.run.tokenizer, text, model_sha256=s.run.identity, index=s.index, neighbours=neighbours)
    return explain_generation(
        model,
        s.run.tokenizer,
        text,
        generate,
        model_sha256=s.run.identity,
        sampling=sampling,
        index=s.index,
        neighbours=neighbours,
        stop_id=stop_id,
        guard=guard,
        progress=progress,
    )


# ----- waterfalls -------------------------------------------------------------------------------------------
class Candidates(NamedTuple):
    """The chosen token and the ``A`` alternatives at every one of ``n`` positions."""

    ids: torch.Tensor
    """(n, 1 + A) token ids, the chosen one first."""
    rank: torch.Tensor
    """(n, 1 + A) place among all tokens by logit (0: the most probable)."""
    prob: torch.Tensor
    """(n, 1 + A) softmax probability."""


def candidates(logits: torch.Tensor, chosen: list[int], alternatives: int) -> Candidates:
    """The chosen tokens of ``logits`` (n, V') with the ``alternatives`` best other tokens of each row."""
    n, valid = len(chosen), logits.shape[1]
    chosen_t = torch.tensor(chosen, dtype=torch.long, device=logits.device)  # (n,)
    # the alternatives are the best tokens other than the chosen one; their rank is their place in the top
    top = logits.topk(min(alternatives + 1, valid), dim=-1).indices  # (n, A+1)
    is_c = top == chosen_t[:, None]  # (n, A+1): at most one True per row
    first = ~is_c & (torch.cumsum(~is_c, dim=1) <= alternatives)  # the first A that are not the chosen
    alt = top[first].view(n, -1) if alternatives else top[:, :0]  # (n, A)
    ranks = torch.arange(top.shape[1], device=logits.device).expand_as(top)[first].view(n, -1)
    chosen_logit = logits.gather(1, chosen_t[:, None])  # (n, 1)
    chosen_rank = (logits > chosen_logit).sum(-1, keepdim=True)  # (n, 1)
    cand = torch.cat([chosen_t[:, None], alt], dim=1)  # (n, 1 + A)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (n, 1)
    return Candidates(cand, torch.cat([chosen_rank, ranks], dim=1), (logits.gather(1, cand) - lse).exp())


class Parts(NamedTuple):
    """Every candidate's logit split by ``decompose`` (C = 1 + A candidates, k active slots)."""

    slices: torch.Tensor
    """(n, C, k) float64: a_i (W p_i)_y · m_i per active slot."""
    residual: torch.Tensor
    """(n, C)"""
    bias: torch.Tensor
    """(n, C)"""
    logit: torch.Tensor
    """(n, C) the model's own logit."""
    total: torch.Tensor
    """(n, C) Σ slices + residual + bias, in the model's dtype."""


def parts(model: PrismLM, out: PrismOutput, cand: torch.Tensor) -> Parts:
    """``decompose`` once per candidate rank (a column of ``cand``: (n, C))."""
    decs = [decompose(model, out, cand[None, :, j]) for j in range(cand.shape[1])]
    return Parts(
        torch.stack([d.prototype_slices[0] for d in decs], 1).double(),
        torch.stack([d.residual_slice[0] for d in decs], 1),
        torch.stack([d.bias_slice[0] for d in decs], 1),
        torch.stack([d.logit[0] for d in decs], 1),
        torch.stack([d.prototype_slices[0].sum(-1) + d.residual_slice[0] + d.bias_slice[0] for d in decs], 1),
    )


@dataclass
class Rows:
    """A waterfall's tensors as Python lists, the active slots of each position ordered by |chosen slice|
    (stable: ties by slot). Index [t] is position t; [t][j] candidate j; [t][j][s] slot s."""

    pids: list[list[int]]
    acts: list[list[float]]
    mult: list[list[float]]
    slices: list[list[list[float]]]
    denom: list[float]
    """Σ|slices| + |residual| of the chosen token."""
    cand: list[list[int]]
    rank: list[list[int]]
    prob: list[list[float]]
    residual: list[list[float]]
    bias: list[list[float]]
    logit: list[list[float]]
    total: list[list[float]]


def rows(out: PrismOutput, c: Candidates, p: Parts) -> Rows:
    assert out.indices is not None and out.activations is not None
    mult = out.prototype_multipliers
    pids = out.indices[0]  # (n, k)
    acts = out.activations[0].double()  # (n, k)
    m = mult[pids].double() if mult is not None else torch.ones_like(acts)  # (n, k)
    order = torch.argsort(-p.slices[:, 0].abs(), dim=-1, stable=True)  # (n, k)
    return Rows(
        pids=pids.gather(-1, order).tolist(),
        acts=acts.gather(-1, order).tolist(),
        mult=m.gather(-1, order).tolist(),
        slices=p.slices.gather(-1, order[:, None, :].expand_as(p.slices)).tolist(),  # (n, 1 + A, k)
        denom=(p.slices[:, 0].abs().sum(-1) + p.residual[:, 0].double().abs()).tolist(),
        cand=c.ids.tolist(),
        rank=c.rank.tolist(),
        prob=c.prob.tolist(),
        residual=p.residual.double().tolist(),
        bias=p.bias.double().tolist(),
        logit=p.logit.double().tolist(),
        total=p.total.double().tolist(),
    )


def waterfalls(
    s: Session, model: PrismLM, out: PrismOutput, chosen: list[int], how: list[str], alternatives: int
) -> tuple[list[PositionView], float]:
    """The exact split of the chosen token's logit and of the top ``alternatives`` other tokens at every
    position, from one forward output; with the largest |total − logit| of them."""
    tok = s.run.tokenizer
    valid = min(tok.vocab_size, model.config.vocab_size)
    logits = out.logits[0, :, :valid].float()  # (n, V') padded ids are not tokens
    c = candidates(logits, chosen, min(alternatives, valid - 1))
    p = parts(model, out, c.ids)
    err = float((p.total - p.logit).abs().max()) if len(chosen) else 0.0
    r = rows(out, c, p)
    strs = {i: tok.id_to_token(i) for i in {t for row in r.cand for t in row}}
    labs = s.labelled(sorted({i for row in r.pids for i in row}))
    return [position_view(r, t, how[t], strs, labs) for t in range(len(chosen))], err


def position_view(
    r: Rows, t: int, chosen_by: str, strs: dict[int, str], labs: dict[int, tuple[str | None, str | None]]
) -> PositionView:
    keep = [k for k in range(len(r.pids[t])) if r.acts[t][k] > 0]  # inactive slots contribute 0
    active: list[ActivePrototype] = [
        {
            "id": r.pids[t][k],
            "activation": r.acts[t][k],
            "multiplier": r.mult[t][k],
            "label": labs[r.pids[t][k]][0],
            "category": labs[r.pids[t][k]][1],
        }
        for k in keep
    ]
    cands = [
        Candidate(
            id=r.cand[t][j],
            token=strs[r.cand[t][j]],
            rank=r.rank[t][j],
            logit=r.logit[t][j],
            prob=r.prob[t][j],
            slices=[r.slices[t][j][k] for k in keep],
            residual=r.residual[t][j],
            bias=r.bias[t][j],
            total=r.total[t][j],
        )
        for j in range(len(r.cand[t]))
    ]
    d = r.denom[t] or 1.0
    return PositionView(
        position=t,
        token_index=t + 1,
        chosen_by=chosen_by,
        chosen=cands[0],
        alternatives=cands[1:],
        active=active,
        top_prototype=active[0]["id"] if active else None,
        top_share=cands[0].slices[0] / d if active else 0.0,
        residual_share=r.residual[t][0] / d,
    )
