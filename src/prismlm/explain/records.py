"""The JSON forms of explanations (``Explanation.to_dict()`` and its parts): what ``prism explain --json``
writes, the explorer serves and the reports read."""

from __future__ import annotations

from typing import TypedDict

from prismlm.explain.index import NeighbourDict, PrototypeStats

__all__ = ["CardDict", "ExplanationDict", "SliceDict", "TokenDict"]


class SliceDict(TypedDict):
    """``PrototypeSlice.to_dict()``: its fields, in order."""

    id: int
    activation: float
    slice: float
    share: float
    label: str | None
    category: str | None


class TokenDict(TypedDict):
    """``TokenExplanation.to_dict()``: its fields in order, then ``token_index`` (= position + 1)."""

    position: int
    token_id: int
    token: str
    next_id: int
    next_token: str
    chosen_by: str
    logit: float
    prob: float
    residual_slice: float
    residual_share: float
    prototypes: list[SliceDict]
    total: float
    error: float
    bias_slice: float
    model_top_id: int
    prototype_top_id: int
    prototype_top_token: str
    prototype_prob: float
    token_index: int


class CardDict(TypedDict):
    """``PrototypeCard.to_dict()``; token lists as [token, value] pairs."""

    id: int
    label: str | None
    category: str | None
    top_tokens: list[list[str | float]]
    bottom_tokens: list[list[str | float]]
    neighbours: list[NeighbourDict]
    stats: PrototypeStats | None
    evidence: dict[str, object] | None


class ExplanationDict(TypedDict):
    """``Explanation.to_dict()``, the JSON of ``prism explain --json`` (cards keyed by the id as a string)."""

    text: str
    token_ids: list[int]
    tokens: list[str]
    truncated_tokens: int
    prompt_tokens: int | None
    model_sha256: str | None
    index: str | None
    notes: list[str]
    max_abs_error: float
    positions: list[TokenDict]
    prototypes: dict[str, CardDict]
