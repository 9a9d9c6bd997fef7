"""Reports that combine operations: an explanation with the training data behind it, and an attribution
with the explanation of the attributed text — what `prism explain` (with attribution) and `prism attribute`
(with an HTML report) render. Computed here, so a front end (the CLI, a notebook) only renders the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prismlm.app.attribution import (
    DEFAULT_QUERY,
    DEFAULT_SEARCH_SPEC,
    NO_RESCORING,
    attribute_explanation,
    attribute_text,
)
from prismlm.app.operations import explain_text
from prismlm.app.run import Run
from prismlm.explain import Explanation
from prismlm.model.generation import TEXT_SAMPLING, Sampling
from prismlm.tda import Attribution
from prismlm.tda.attribute import QuerySpec, Rescoring, SearchSpec

__all__ = ["AttributionReport", "ExplanationReport", "attribute_report", "explain_report"]


@dataclass
class ExplanationReport:
    """An explanation and, when asked for, the attribution of exactly the tokens it explained."""

    explanation: Explanation
    attribution: Attribution | None = None

    def to_dict(self) -> dict[str, Any]:
        d = self.explanation.to_dict()
        return d if self.attribution is None else {**d, "attribution": self.attribution.to_dict()}


@dataclass
class AttributionReport:
    """An attribution and, when asked for, the explanation of the attributed text (prompt + completion)."""

    attribution: Attribution
    explanation: Explanation | None = None


def explain_report(
    run: Run,
    prompt: str = "",
    *,
    chat: str | None = None,
    generate: int = 0,
    index: Path | None = None,
    use_index: bool = True,
    shards: Path | None = None,
    sampling: Sampling = TEXT_SAMPLING,
    neighbours: int = 5,
    attribute: bool = False,
) -> ExplanationReport:
    """Explain each next-token logit: active prototypes with labels and shares, residual share, exactly.

    Args:
        prompt: Text to explain (empty: the first prediction after end-of-text).
        chat: A chat message instead of a prompt: written with the model's chat template, the assistant's
            answer is generated greedily (at most ``generate`` tokens, default 64, ending at the end-of-turn
            token) and its tokens are explained.
        generate: Sample N tokens after the prompt and explain them.
        index: Index folder (default RUN/index if it exists).
        use_index: Use the prototype index if there is one.
        shards: Token shard folder (default: the index's / the run's).
        sampling: How the ``generate`` tokens are sampled (temperature, top tokens, seed).
        neighbours: Training snippets per prototype card.
        attribute: Add the top training sequences for the text (its generated part with ``generate``) to the
            report: prototype-space influence from the run's attribution cache (`prism attribute-cache`).
    """
    expl = explain_text(
        run,
        prompt,
        chat=chat,
        generate=generate,
        index=index,
        use_index=use_index,
        shards=shards,
        sampling=sampling,
        neighbours=neighbours,
    )
    return ExplanationReport(expl, attribute_explanation(run, expl, shards=shards) if attribute else None)


def attribute_report(
    run: Run,
    text: str,
    query: QuerySpec = DEFAULT_QUERY,
    search: SearchSpec = DEFAULT_SEARCH_SPEC,
    rescoring: Rescoring = NO_RESCORING,
    *,
    cache: Path | None = None,
    shards: Path | None = None,
    explain: bool = False,
) -> AttributionReport:
    """The training sequences that most influenced TEXT (or its completion), with the prototypes that
    connect them and snippets (``attribute_text``, which takes the same arguments), and on request the
    explanation of the attributed text.

    Args:
        text: Prompt (or prompt + completion, measuring its last tokens).
        cache: Cache folder (default RUN/attribution-cache).
        shards: Token shard folder (default: the cache's / the run's).
        explain: Also explain the attributed text (prompt + completion), with the index if there is one.
    """
    att = attribute_text(run, text, query, search, rescoring, cache=cache, shards=shards)
    expl = explain_text(run, att.prompt + att.completion, shards=shards) if explain else None
    return AttributionReport(att, expl)
