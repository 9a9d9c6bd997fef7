"""Reports that combine operations: an explanation with the training data behind it, and an attribution
with the explanation of the attributed text — what ``prism explain --attribute`` and ``prism attribute
--html`` render. Computed here, so a front end (the CLI, a notebook) only renders the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prismlm.app.attribution import attribute_explanation, attribute_text
from prismlm.app.operations import explain_text
from prismlm.app.run import Run
from prismlm.explain import Explanation
from prismlm.model.generation import TEXT_SAMPLING, Sampling
from prismlm.tda import Attribution

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
    *,
    answer: str | None = None,
    completion: int | None = None,
    generate: int = 0,
    top: int = 10,
    method: str = "cached",
    cache: Path | None = None,
    search: str = "auto",
    candidates: int = 32,
    nprobe: int = 16,
    rescore: str = "none",
    rescore_top: int = 128,
    shards: Path | None = None,
    max_sequences: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    explain: bool = False,
) -> AttributionReport:
    """The training sequences that most influenced TEXT (or its completion), with the prototypes that
    connect them and snippets.

    Args:
        text: Prompt (or prompt + completion with --completion N).
        answer: A completion to attribute: only its tokens are measured.
        completion: Measure only the last N tokens of TEXT.
        generate: Generate N tokens after TEXT and attribute them.
        top: Training sequences to show.
        method: cached (postings cache) or full (exact block gradients).
        cache: Cache folder (default RUN/attribution-cache).
        search: --method cached: auto (the cache's search index, CACHE/search from `prism attribute-search`,
            when it exists, else the exact scan), exact (scan every posting of the query's prototypes) or
            approximate (the search index, required).
        candidates: Approximate search: sequences proposed per long posting list, then rescored exactly.
        nprobe: Approximate search (IVF): cells probed per list.
        rescore: The hybrid: re-rank the --rescore-top best sequences by prototype space with a
            whole-network score — none, ekfac (kronfluence EK-FAC; factors fitted once per run into
            RUN/attribution-factors, then reused; pip install 'prismlm[attribution]') or gradient
            (whole-network gradient dot products). See ``attribute_text``.
        rescore_top: Candidates re-scored per query (--rescore).
        shards: Token shard folder (default: the cache's / the run's).
        max_sequences: --method full: first N training sequences only.
        temperature: Sampling temperature for --generate (0 = greedy).
        seed: Sampling seed.
        explain: Also explain the attributed text (prompt + completion), with the index if there is one.
    """
    att = attribute_text(
        run,
        text,
        answer=answer,
        completion=completion,
        generate=generate,
        top=top,
        method=method,
        cache=cache,
        search=search,
        candidates=candidates,
        nprobe=nprobe,
        rescore=rescore,
        rescore_top=rescore_top,
        shards=shards,
        max_sequences=max_sequences,
        temperature=temperature,
        seed=seed,
    )
    expl = explain_text(run, att.prompt + att.completion, shards=shards) if explain else None
    return AttributionReport(att, expl)
