"""Reports that combine operations: an explanation with the training data behind it, and an attribution
with the explanation of the attributed text — what `prism explain` (with attribution) and `prism attribute`
(with an HTML report) render. Computed here, so a front end (the CLI, a notebook) only renders the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prismlm.app.attribution import (
    DEFAULT_QUERY,
    DEFAULT_SEARCH_SPEC,
    NO_RESCORING,
    attribute_explanation,
    attribute_text,
)
from prismlm.app.operations import DEFAULT_EXPLANATION, ExplanationRequest, explain_text
from prismlm.app.run import Run
from prismlm.explain import Explanation
from prismlm.explain.records import ExplanationDict
from prismlm.model.generation import TEXT_SAMPLING, Sampling
from prismlm.tda import Attribution
from prismlm.tda.attribute import AttributionRecord, QuerySpec, Rescoring, SearchSpec

__all__ = ["AttributionReport", "ExplanationReport", "attribute_report", "explain_report"]


class ExplanationReportDict(ExplanationDict, total=False):
    """``ExplanationReport.to_dict()``: the explanation's record, with ``attribution`` when it was asked for."""

    attribution: AttributionRecord


@dataclass
class ExplanationReport:
    """An explanation and, when asked for, the attribution of exactly the tokens it explained."""

    explanation: Explanation
    attribution: Attribution | None = None

    def to_dict(self) -> ExplanationReportDict:
        d = ExplanationReportDict(**self.explanation.to_dict())
        if self.attribution is not None:
            d["attribution"] = self.attribution.to_dict()  # last, after the explanation's fields
        return d


@dataclass
class AttributionReport:
    """An attribution and, when asked for, the explanation of the attributed text (prompt + completion)."""

    attribution: Attribution
    explanation: Explanation | None = None


def explain_report(
    run: Run,
    prompt: str = "",
    request: ExplanationRequest = DEFAULT_EXPLANATION,
    sampling: Sampling = TEXT_SAMPLING,
    *,
    attribute: bool = False,
) -> ExplanationReport:
    """Explain each next-token logit: active prototypes with labels and shares, residual share, exactly.

    Args:
        prompt: Text to explain (empty: the first prediction after end-of-text).
        request: What else is explained and what the cards show: ``ExplanationRequest``, one option per field.
        sampling: How the ``generate`` tokens are sampled (temperature, top tokens, seed).
        attribute: Add the top training sequences for the text (its generated part with ``generate``) to the
            report: prototype-space influence from the run's attribution cache (`prism attribute-cache`).
    """
    expl = explain_text(run, prompt, request, sampling)  # the same arguments: the report composes, never copies
    return ExplanationReport(expl, attribute_explanation(run, expl, shards=request.shards) if attribute else None)


def attribute_report(
    run: Run,
    text: str = "",
    query: QuerySpec = DEFAULT_QUERY,
    search: SearchSpec = DEFAULT_SEARCH_SPEC,
    rescoring: Rescoring = NO_RESCORING,
    *,
    cache: Path | None = None,
    shards: Path | None = None,
    explain: bool = False,
    chat: str | None = None,
) -> AttributionReport:
    """The training sequences that most influenced TEXT (or its completion), with the prototypes that
    connect them and snippets (``attribute_text``, which takes the same arguments), and on request the
    explanation of the attributed text.

    Args:
        text: Prompt (or prompt + completion, measuring its last tokens).
        cache: Cache folder (default RUN/attribution-cache).
        shards: Token shard folder (default: the cache's / the run's).
        explain: Also explain the attributed text (prompt + completion), with the index if there is one.
        chat: A chat message instead of TEXT: written with the run's chat template; the model's answer
            (greedy, up to the end-of-turn token) is what is measured.
    """
    att = attribute_text(run, text, query, search, rescoring, cache=cache, shards=shards, chat=chat)
    expl = explain_text(run, att.prompt + att.completion, ExplanationRequest(shards=shards)) if explain else None
    return AttributionReport(att, expl)
