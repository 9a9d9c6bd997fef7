"""The explorer's steering: what a request changes about the model (``Steering``), its checked translation
into the model's intervention values (``interventions``), and the Steer view — a generation of the base model
and one of the steered model with the same seed, side by side, and for every token of the steered text the
change of its logit and the slices that explain it.

Invariants: ids are in range, factors finite and within ``Limits.max_scale``, a concept one of the server's
suppression sets — else a ``ConfigError`` (4xx) before any model call. ``delta`` is ℓ' − ℓ of that token from
two forwards (steered − base), ``delta_from_slices`` is Σ_i (m_i − 1) a_i (W p_i)_y from the base forward —
equal to rounding, since activations do not depend on the multipliers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

import torch

from prismlm.app.chat import chat_prompt, stops_for
from prismlm.app.control import suppression_targets
from prismlm.app.explorer.limits import Limits, RequestLimitError, check_limit
from prismlm.app.explorer.plain import Plain
from prismlm.app.explorer.session import Session
from prismlm.app.prototype_view import never_active
from prismlm.control.activity import Activity, changed_prototypes, prototype_activity
from prismlm.control.suppress import SuppressionSet
from prismlm.errors import ConfigError
from prismlm.model import Intervention, Scale, Suppress, decompose
from prismlm.model.generation import Sampling
from prismlm.model.interventions import check_ids, combined_multipliers
from prismlm.progress import Progress, Reporter

__all__ = [
    "ChangedSlice",
    "SteerStep",
    "SteerView",
    "Steering",
    "SteeringDict",
    "activity",
    "checked_interventions",
    "interventions",
    "steer_view",
]


class SteeringDict(TypedDict):
    """A request's steering as the views echo it."""

    suppress: list[int]
    scale: list[list[int | float]]
    """[prototype id, factor] pairs."""
    concept: str | None


@dataclass(frozen=True)
class Steering:
    """What a request changes about the model: prototypes to suppress, factors to scale by, a concept's
    suppression set (by name, from the sets the server was started with)."""

    suppress: tuple[int, ...] = ()
    scale: tuple[tuple[int, float], ...] = ()
    """(prototype id, factor) pairs; 0 removes the slice, 2 doubles it."""
    concept: str | None = None

    @property
    def empty(self) -> bool:
        return not self.suppress and not self.scale and self.concept is None

    def to_dict(self) -> SteeringDict:
        return {"suppress": list(self.suppress), "scale": [[i, f] for i, f in self.scale], "concept": self.concept}


def interventions(s: Session, steering: Steering) -> tuple[Intervention, ...]:
    """The request's steering as intervention values, checked: ids in range, factors finite and bounded
    (``s.limits``), the concept one of the server's sets."""
    return checked_interventions(steering, s.num_prototypes, s.limits, s.concepts)


def checked_interventions(
    steering: Steering, num_prototypes: int, limits: Limits, concepts: Mapping[str, SuppressionSet]
) -> tuple[Intervention, ...]:
    """``interventions`` from its parts (``num_prototypes`` K, ``limits``, the server's ``concepts``)."""
    K = num_prototypes
    n = len(steering.suppress) + len(steering.scale)
    check_limit(n <= limits.max_steer_ids, "steered prototypes", limits.max_steer_ids, n)
    out: list[Intervention] = []
    if steering.suppress:
        out.append(Suppress.of(check_ids(list(steering.suppress), K), label="request"))
    if steering.scale:
        ids = check_ids([i for i, _ in steering.scale], K)
        f = torch.ones(K, dtype=torch.float64)  # (K,) multipliers
        for i, v in zip(ids, (v for _, v in steering.scale)):
            if not (math.isfinite(v) and abs(v) <= limits.max_scale):
                raise RequestLimitError(
                    f"scale factor of prototype {i} must be finite and within ±{limits.max_scale}, got {v!r}"
                )
            f[i] = f[i] * float(v)
        out.append(Scale(f, label="request"))
    if steering.concept is not None:
        sset = concepts.get(steering.concept)
        if sset is None:
            raise ConfigError(
                f"unknown concept {steering.concept!r}; the server has "
                f"{sorted(concepts) or 'none'} (start it with prism serve RUN --concept FILE)"
            )
        out.append(Suppress.of(sset.ids, label=steering.concept))
    return tuple(out)


def activity(s: Session, steering: Steering, token_ids: list[int]) -> Activity:
    """Which of the prototypes ``steering`` (and the run's own interventions) change are active on
    ``token_ids``, and where the target tokens of its concept set (or the run's suppression set) are
    predicted (``prismlm.control.activity``). Call under ``s.lock``."""
    ids = changed_prototypes((*s.run.interventions, *interventions(s, steering)), s.num_prototypes)
    sets = (s.concepts.get(steering.concept) if steering.concept else None, s.run.suppression)
    return prototype_activity(s.model, ids, token_ids, targets=suppression_targets(*sets), tokenizer=s.run.tokenizer)


class ChangedSlice(TypedDict):
    id: int
    delta: float
    """(m_i − 1) a_i (W p_i)_y: how much steering prototype ``id`` moves the token's logit."""


class SteerStep(TypedDict):
    """One generated token of the steered text."""

    step: int
    """Index among the generated tokens."""
    token: str
    base_token: str | None
    """The base model's token at the same step (None: its generation ended before)."""
    logit_base: float
    logit_steered: float
    delta: float
    """logit_steered − logit_base (two forwards)."""
    delta_from_slices: float
    """Σ of every changed slice (equal to ``delta`` to rounding)."""
    changed: list[ChangedSlice]
    """The 5 largest |changed slices|."""


@dataclass
class SteerView(Plain):
    """What ``Explorer.steer`` returns: both generations side by side and the steered one's logit changes."""

    prompt: str
    base: list[str]
    """Generated tokens of the base model."""
    steered: list[str]
    """Generated tokens of the steered model."""
    base_text: str
    steered_text: str
    first_difference: int | None
    """Index of the first generated token that differs (None: identical)."""
    steps: list[SteerStep]
    """Per generated token of the steered text."""
    steering: SteeringDict
    notes: list[str]
    steered_ids: int = 0
    """How many prototypes the request changes (multiplier ≠ 1)."""
    inactive: list[int] | None = None
    """Those of them never active on the steered text (prompt + generation): steering them changes none of
    its logits (activations do not depend on the multipliers)."""
    activity: Activity | None = None
    """Which steered prototypes are active on the steered text, and where the concept's target tokens are
    predicted (a warning in ``notes`` when none is)."""


class Changes(NamedTuple):
    """Logit changes over one window of the steered text (n predicted tokens, k active slots)."""

    start: int
    """Absolute index (in the steered ids) of the window's first token."""
    logit_base: list[float]
    """(n,) the base model's logit of each next token."""
    logit_steered: list[float]
    """(n,) the steered model's."""
    change: list[list[float]]
    """(n, k) (m_i − 1) · slice of each active slot."""
    pids: list[list[int]]
    """(n, k) the slots' prototype ids."""
    steered_ids: int
    inactive: list[int]
    notes: list[str]


def steer_view(
    s: Session,
    prompt: str,
    *,
    steering: Steering,
    tokens: int,
    sampling: Sampling,
    chat: bool = False,
    system: str | None = None,
    progress: Progress = False,
) -> SteerView:
    """``Explorer.steer``: both generations, the changes and the steered prototypes that never fire. ``chat``:
    ``prompt`` is a chat message (after ``system``); both generations stop at the end-of-turn token (every
    generation does once the run has a chat template: a base-model continuation past it is another turn)."""
    s.limits.check_text(prompt, "prompt")
    s.limits.check_text(system or "", "system")
    s.limits.check_sampling(tokens, sampling)
    ivs = interventions(s, steering)
    tok = s.run.tokenizer
    text = chat_prompt(s.run, prompt, system) if chat else prompt
    ids = tok.encode(text) if text else [tok.eot_id]
    p = len(ids)
    stops = stops_for(s.run, chat)
    with Reporter(progress, "generate", 2 * tokens, unit="tok") as bar:  # the lock is taken per token
        base, steered = [
            _generate(s, ids, use, tokens=tokens, sampling=sampling, stops=stops, bar=bar) for use in ((), ivs)
        ]
    with s.lock, torch.no_grad():
        ch = changes(s, steered, ivs)
        act = activity(s, steering, steered)
    warning = act.warning("steered")
    gb, gs = base[p:], steered[p:]
    return SteerView(
        prompt=text,
        base=[tok.id_to_token(t) for t in gb],
        steered=[tok.id_to_token(t) for t in gs],
        base_text=tok.decode(gb),
        steered_text=tok.decode(gs),
        first_difference=next((j for j, (a, b) in enumerate(zip(gb, gs)) if a != b), None),
        steps=steps(s, ch, base, steered, p),
        steering=steering.to_dict(),
        notes=ch.notes + ([act.summary("steered")] if act.targets else []) + ([warning] if warning else []),
        steered_ids=ch.steered_ids,
        inactive=ch.inactive,
        activity=act,
    )


def _generate(
    s: Session,
    ids: list[int],
    ivs: tuple[Intervention, ...],
    *,
    tokens: int,
    sampling: Sampling,
    stops: tuple[int, ...],
    bar: Reporter,
) -> list[int]:
    """``ids`` and ``tokens`` sampled after them under ``ivs`` (a fresh generator of the sampling's seed),
    up to and including the first of ``stops`` (the end-of-turn tokens). Each step holds the model lock (with
    ``ivs`` applied) on its own, so other requests run between tokens; ``bar`` gets each token."""
    dev = s.run.device
    x = torch.tensor([ids], dtype=torch.long, device=dev)  # (1, p)
    out = list(ids)
    steps = s.model.generate_steps(x, tokens, sampling, generator=sampling.generator(dev))
    while True:
        with s.locked(ivs), torch.no_grad():
            step = next(steps, None)
        if step is None:
            break
        out.append(int(step[1][0, 0]))
        bar.update(1)
        if out[-1] in stops:
            break
    return out


def changes(s: Session, steered: list[int], ivs: tuple[Intervention, ...]) -> Changes:
    """Every next-token logit of ``steered`` by the base and the steered model, over one window (the last
    ``block_size`` tokens), with each active slot's change. Call under ``s.lock``."""
    dev = s.run.device
    T = s.model.config.block_size
    win = steered[:-1][-T:]  # the context of every predicted token, one window
    start = len(steered) - 1 - len(win)  # absolute index of win[0]
    notes: list[str] = []
    if start > 0:
        notes.append(
            f"past the context window ({T} tokens): the logit changes are those of one forward over the last {T} tokens"
        )
    xs = torch.tensor([win], dtype=torch.long, device=dev)  # (1, n)
    y = torch.tensor([steered[start + 1 :]], dtype=torch.long, device=dev)  # (1, n) targets
    with s.run.intervened() as m:
        out_b = m(xs)
        dec_b = decompose(m, out_b, y)
    with s.run.intervened(*ivs) as m:
        out_s = m(xs)
    mult = combined_multipliers(ivs, s.num_prototypes)  # None: nothing steered, no change
    if mult is None:
        mult = torch.ones(s.num_prototypes, dtype=torch.float64)
    assert out_b.indices is not None and out_b.activations is not None
    n_steered, inactive, note = never_active(mult, out_b.indices[0], out_b.activations[0])
    lb = out_b.logits[0].gather(-1, y[0, :, None]).squeeze(-1).double()  # (n,)
    ls = out_s.logits[0].gather(-1, y[0, :, None]).squeeze(-1).double()
    change = dec_b.prototype_slices[0].double() * (mult.to(dev)[out_b.indices[0]].double() - 1.0)  # (n, k)
    notes += [note] if note else []
    return Changes(
        start, lb.tolist(), ls.tolist(), change.tolist(), out_b.indices[0].tolist(), n_steered, inactive, notes
    )


def steps(s: Session, ch: Changes, base: list[int], steered: list[int], p: int) -> list[SteerStep]:
    """A ``SteerStep`` per generated token of ``steered`` (prompt of ``p`` tokens) inside the window."""
    tok = s.run.tokenizer
    first_gen = p - 1 - ch.start  # position in the window that predicts the first generated token
    out: list[SteerStep] = []
    for t in range(max(0, first_gen), len(ch.logit_base)):
        step = ch.start + t + 1 - p
        nz = sorted([(i, c) for i, c in zip(ch.pids[t], ch.change[t]) if c != 0.0], key=lambda ic: -abs(ic[1]))
        out.append(
            {
                "step": step,
                "token": tok.id_to_token(steered[ch.start + t + 1]),
                "base_token": tok.id_to_token(base[p + step]) if p + step < len(base) else None,
                "logit_base": ch.logit_base[t],
                "logit_steered": ch.logit_steered[t],
                "delta": ch.logit_steered[t] - ch.logit_base[t],
                "delta_from_slices": sum(c for _, c in nz),
                "changed": [{"id": i, "delta": c} for i, c in nz[:5]],
            }
        )
    return out
