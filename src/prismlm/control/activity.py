"""Did an intervention do anything here? Which of the prototypes a suppression set, a steering or a controller
changes are active on a text, and which are active where the concept's target tokens are predicted.

Why: activations do not depend on the multipliers, so a changed prototype that is not active at a position
changes none of that position's logits — a suppression of prototypes that never fire where " Paris" is
predicted leaves " Paris" exactly where it was. ``Activity.warning`` says so in one line; every front end
(CLI, API, explorer) shows it instead of an unexplained identical answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prismlm.data.tokenizer import Tokenizer
from prismlm.model import Intervention, PrismLM
from prismlm.model.interventions import combined_multipliers

__all__ = ["Activity", "changed_prototypes", "merged", "prototype_activity"]


@dataclass(frozen=True)
class Activity:
    """Which of an intervention's prototypes are active on one text."""

    ids: list[int]
    """The prototypes the intervention changes (multiplier ≠ 1)."""
    active: list[int]
    """Those active (a > 0) at some position of the text."""
    targets: list[str] = field(default_factory=list)
    """The target tokens (a concept's, e.g. " Paris"); empty: none given."""
    target_positions: int = 0
    """Positions where a target token is predicted: the text's next token, or the model's most probable one."""
    active_at_targets: list[int] = field(default_factory=list)
    """Those of ``ids`` active at one of those positions."""

    def summary(self, what: str = "suppressed") -> str:
        """``3 of the 16 suppressed prototypes are active on this text (#4, #9, #12); 1 where ' Paris' is
        predicted (2 positions)``."""
        shown = ", ".join(f"#{i}" for i in self.active[:12]) + (" …" if len(self.active) > 12 else "")
        out = f"{len(self.active)} of the {len(self.ids)} {what} prototypes are active on this text" + (
            f" ({shown})" if shown else ""
        )
        if self.targets and self.target_positions:
            out += f"; {len(self.active_at_targets)} where {self.target_text} is predicted ({self.target_positions} positions)"
        return out

    @property
    def target_text(self) -> str:
        return " or ".join(repr(t) for t in self.targets[:6]) + (" …" if len(self.targets) > 6 else "")

    def warning(self, what: str = "suppressed") -> str | None:
        """One line when the intervention can change nothing that matters here (None otherwise): none of its
        prototypes is active on the text, or none where a target token is predicted."""
        if not self.ids:
            return None
        if not self.active:
            return (
                f"warning: none of the {len(self.ids)} {what} prototypes is active on this text, so the "
                f"intervention changes none of its logits"
            )
        if self.targets and self.target_positions and not self.active_at_targets:
            return (
                f"warning: none of the {len(self.ids)} {what} prototypes is active where {self.target_text} is "
                f"predicted ({self.target_positions} positions), so the intervention cannot change those logits"
            )
        return None


def changed_prototypes(interventions: Sequence[Intervention], num_prototypes: int) -> list[int]:
    """The prototypes whose multiplier ``interventions`` set to anything but 1 (suppressed, scaled, controlled)."""
    mult = combined_multipliers(tuple(interventions), num_prototypes)
    return [] if mult is None else (mult != 1).nonzero().squeeze(1).tolist()


@torch.no_grad()
def prototype_activity(
    model: PrismLM,
    ids: Sequence[int],
    token_ids: Sequence[int],
    *,
    targets: Sequence[int] = (),
    tokenizer: Tokenizer | None = None,
) -> Activity:
    """Which of the prototypes ``ids`` are active on ``token_ids`` (one forward of the last ``block_size``
    tokens; activations do not depend on interventions), and which where one of the ``targets`` (token ids)
    is predicted — the text's next token or the model's most probable one."""
    toks = list(token_ids)[-model.config.block_size :]
    want = sorted({int(i) for i in ids})
    if not toks or not want:
        return Activity(want, [])
    x = torch.tensor([toks], dtype=torch.long, device=next(model.parameters()).device)  # (1, n)
    out = model(x)
    assert out.indices is not None and out.activations is not None
    on = out.activations[0] > 0  # (n, k)
    idx = out.indices[0]  # (n, k)
    steered = torch.zeros(model.require_prototypes().num_prototypes, dtype=torch.bool, device=x.device)
    steered[want] = True
    hit = on & steered[idx]  # (n, k)
    active = sorted(set(idx[hit].tolist()))
    if not targets:
        return Activity(want, active)
    tset = torch.tensor(sorted({int(t) for t in targets}), device=x.device)
    nxt = torch.cat([x[0, 1:], x.new_full((1,), -1)])  # (n,) the text's next token (none after the last)
    at = torch.isin(nxt, tset) | torch.isin(out.logits[0].argmax(-1), tset)  # (n,)
    names = [tokenizer.id_to_token(int(t)) if tokenizer is not None else f"<{int(t)}>" for t in tset.tolist()]
    return Activity(
        ids=want,
        active=active,
        targets=names,
        target_positions=int(at.sum()),
        active_at_targets=sorted(set(idx[hit & at[:, None]].tolist())),
    )


def merged(parts: Sequence[Activity]) -> Activity:
    """One ``Activity`` of many texts (the same prototypes): active on any, active where any target is predicted."""
    if not parts:
        return Activity([], [])
    targets: list[str] = []
    for a in parts:
        targets += [t for t in a.targets if t not in targets]
    return Activity(
        ids=parts[0].ids,
        active=sorted({i for a in parts for i in a.active}),
        targets=targets,
        target_positions=sum(a.target_positions for a in parts),
        active_at_targets=sorted({i for a in parts for i in a.active_at_targets}),
    )
