"""Find the prototypes of a concept from labelled examples (spec §4) and turn them into a suppression set.

Per prototype: log-likelihood contribution (concept minus neutral text, nats per token), activation
enrichment and, with an index, neighbourhood purity; ``ConceptSelection`` filters and ranks them, and
every chosen prototype carries its evidence into the ``SuppressionSet``. Definitions: docs/architecture.md
(concepts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from prismlm.control.suppress import PrototypeEvidence, SuppressionSet
from prismlm.errors import ConfigError, DataError, ModelError
from prismlm.eval.scoring import text_batches
from prismlm.model.decomposition import decompose

if TYPE_CHECKING:
    from prismlm.data.tokenizer import Tokenizer
    from prismlm.explain.index import PrototypeIndex
    from prismlm.model import PrismLM


@dataclass
class ActivationStats:
    """Per-prototype activation totals over a set of texts."""

    mass: np.ndarray
    """(K,) Σ over tokens of a_{t,i}."""
    count: np.ndarray
    """(K,) tokens where prototype i is active (a > 0)."""
    tokens: int
    """Tokens the totals are over (mask-valid positions)."""
    contribution: np.ndarray
    """(K,) Σ over scored positions of c_{t,i}, the slice's first-order effect on log p(next token)."""
    target_effect: np.ndarray | None = None
    """(K,) Σ over positions whose next token is a target token of the slice a_{t,i} (W p_i)_y on it: how much
    prototype i raises the concept's target tokens where they are predicted (None: no targets)."""
    target_positions: int = 0
    """Positions whose next token is a target token."""

    @property
    def rate(self) -> np.ndarray:
        return self.mass / max(1, self.tokens)


@torch.no_grad()
def activation_stats(
    model: PrismLM,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
    max_tokens_per_text: int | None = None,
    targets: Sequence[int] = (),
) -> ActivationStats:
    """Stream ``texts`` through the (frozen) model and total each prototype's activations and its
    log-likelihood contribution (docs/architecture.md, concepts); with ``targets`` (token ids), also its
    slice on them where they are the next token (``ActivationStats.target_effect``)."""
    if model.prototypes is None:
        raise ModelError("concept search needs a PRISM model; this is the dense baseline")
    K = model.prototypes.num_prototypes
    mass = torch.zeros(K, dtype=torch.float64)
    count = torch.zeros(K, dtype=torch.float64)
    contrib = torch.zeros(K, dtype=torch.float64)
    effect = torch.zeros(K, dtype=torch.float64)
    n = n_target = 0
    tset = torch.tensor(sorted(set(targets)), dtype=torch.long)
    dev = next(model.parameters()).device
    W = model.lm_head.weight  # (V, d)
    P = model.prototypes.weight  # (K, d)
    for x, mask in text_batches(
        tokenizer, texts, model.config.block_size, batch_size, max_tokens_per_text=max_tokens_per_text
    ):
        x, mask = x.to(dev), mask.to(dev)
        out = model(x)
        assert out.activations is not None and out.indices is not None  # a PRISM model (checked above)
        m = mask[..., None] & (out.activations > 0)  # (B, T, k)
        idx = out.indices[m].cpu()
        a = out.activations[m].double().cpu()
        mass += torch.bincount(idx, weights=a, minlength=K)
        count += torch.bincount(idx, minlength=K).double()
        n += int(mask.sum())
        # contribution = exact slice of the next token − the slice's expectation under the model's own
        # distribution, at positions whose next token is inside the same text window
        nxt = torch.roll(x, -1, dims=1)  # (B, T): next token (the last column is never scored)
        scored = mask & torch.roll(mask, -1, dims=1)
        scored[:, -1] = False
        target_slices = decompose(model, out, nxt).prototype_slices  # (B, T, k): a_{t,i} p_i·W[y_{t+1}]
        expected_row = torch.softmax(out.logits, -1).to(W.dtype) @ W  # (B, T, d): E_{v~p_t} W[v]
        expected_slices = out.activations.to(W.dtype) * torch.einsum(
            "btkd,btd->btk", P[out.indices], expected_row
        )  # (B, T, k)
        pm = m & scored[..., None]  # (B, T, k)
        c = (target_slices.to(W.dtype) - expected_slices)[pm]  # (pairs,)
        contrib += torch.bincount(out.indices[pm].cpu(), weights=c.double().cpu(), minlength=K)
        if len(tset):
            at = scored & torch.isin(nxt, tset.to(dev))  # (B, T): a target token comes next
            n_target += int(at.sum())
            tm = m & at[..., None]  # (B, T, k)
            effect += torch.bincount(out.indices[tm].cpu(), weights=target_slices[tm].double().cpu(), minlength=K)
    return ActivationStats(
        mass=mass.numpy(),
        count=count.numpy(),
        tokens=n,
        contribution=contrib.numpy(),
        target_effect=effect.numpy() if len(tset) else None,
        target_positions=n_target,
    )


def concept_targets(
    tokenizer: Tokenizer, concept_texts: Sequence[str], neutral_texts: Sequence[str], n: int = 8, min_count: int = 2
) -> list[int]:
    """The concept's target tokens: the ``n`` tokens most over-represented in the concept texts against the
    neutral ones (log ratio of their add-½ smoothed frequencies > 0), each at least ``min_count`` times —
    " Paris", " Madrid" for capitals. What suppressing the concept should lower."""
    from collections import Counter

    c = Counter(t for text in concept_texts for t in tokenizer.encode(text))
    m = Counter(t for text in neutral_texts for t in tokenizer.encode(text))
    nc, nm = max(1, sum(c.values())), max(1, sum(m.values()))
    score = {t: math.log((k + 0.5) / nc) - math.log((m[t] + 0.5) / nm) for t, k in c.items() if k >= min_count}
    best = sorted(score.items(), key=lambda kv: (-kv[1], kv[0]))
    return [t for t, v in best if v > 0][:n]


RANKINGS = {
    "target": "target-effect",
    "contribution": "loglik-contribution",
    "enrichment": "activation-enrichment",
}


def neighbourhood_purity(
    index: PrototypeIndex, is_concept_doc: Callable[[str], bool], ids: Sequence[int] | None = None, n: int | None = None
) -> dict[int, float]:
    """Share of each prototype's nearest training contexts that are in concept documents (needs the
    index's shards attached so offsets resolve to document ids)."""
    out: dict[int, float] = {}
    for i in range(index.num_prototypes) if ids is None else ids:
        nbs = index.neighbours(int(i), n, before=0, after=0)
        docs = [nb.doc_id for nb in nbs if nb.doc_id is not None]
        out[int(i)] = (sum(bool(is_concept_doc(d)) for d in docs) / len(docs)) if docs else float("nan")
    return out


def doc_regex(pattern: str) -> Callable[[str], bool]:
    rx = re.compile(pattern)
    return lambda doc_id: rx.search(doc_id) is not None


def signature_tokens(model: PrismLM, tokenizer: Tokenizer, i: int, n: int = 8) -> list[str]:
    """Top tokens of prototype i's logit signature W p_i."""
    with torch.no_grad():
        sig = model.signatures(torch.tensor([i]))[0]
    return [tokenizer.decode([int(t)]) for t in sig.topk(n).indices]


@dataclass(frozen=True)
class ConceptSelection:
    """Which ranked prototypes a concept search selects (docs/architecture.md, concepts). Checked when made
    (``ConfigError`` naming the field)."""

    budget: int | None = 32
    """At most this many prototypes are selected (None: no cap; 0: none)."""
    rank_by: str = "target"
    """``target`` (the slice on the concept's target tokens where they are predicted, logits per target
    position: what suppressing the prototype takes off them; a candidate also needs a positive one; without
    target tokens, ``contribution``), ``contribution`` (log-likelihood contribution; a candidate also needs a
    positive one) or ``enrichment`` (log2 activation enrichment)."""
    threshold: float = 1.0
    """Minimum log2 enrichment of a candidate."""
    min_count: int = 3
    """Minimum active concept tokens of a candidate."""
    min_purity: float = 0.5
    """Minimum neighbourhood purity of a selected prototype (only with an index and a document predicate)."""

    def __post_init__(self) -> None:
        if self.rank_by not in RANKINGS:
            raise ConfigError(f"`rank_by` must be one of {', '.join(RANKINGS)}, got {self.rank_by!r}", param="rank_by")
        if self.budget is not None and self.budget < 0:
            raise ConfigError(f"`budget` must be >= 0, got {self.budget}", param="budget")
        if not math.isfinite(self.threshold):
            raise ConfigError(f"`threshold` must be a finite number, got {self.threshold!r}", param="threshold")
        if not 0.0 <= self.min_purity <= 1.0:
            raise ConfigError(f"`min_purity` must be in [0, 1], got {self.min_purity!r}", param="min_purity")


def find_concept(
    model: PrismLM,
    tokenizer: Tokenizer,
    concept_texts: Sequence[str],
    neutral_texts: Sequence[str],
    selection: ConceptSelection = ConceptSelection(),
    *,
    index: PrototypeIndex | None = None,
    is_concept_doc: Callable[[str], bool] | None = None,
    concept: str | None = None,
    model_sha256: str | None = None,
    batch_size: int = 16,
    neighbours: int = 3,
) -> tuple[SuppressionSet, list[PrototypeEvidence]]:
    """Rank prototypes by log-likelihood contribution or activation enrichment on concept vs neutral text
    (filtered by neighbourhood purity, with an index and ``is_concept_doc``) and select them by
    ``selection``; returns the chosen suppression set and the full ranking (one dict per candidate with
    its evidence). ``neighbours``: training snippets recorded per selected prototype."""
    if not concept_texts or not neutral_texts:
        raise DataError("need at least one concept text and one neutral text")
    targets = concept_targets(tokenizer, concept_texts, neutral_texts)
    c = activation_stats(model, tokenizer, concept_texts, batch_size=batch_size, targets=targets)
    n = activation_stats(model, tokenizer, neutral_texts, batch_size=batch_size)
    scores = _concept_scores(c, n)
    if selection.rank_by == "target" and not c.target_positions:  # no target token: the likelihood ranks
        selection = replace(selection, rank_by="contribution")
    cand = _candidates(scores, c, selection)
    purity: dict[int, float] = {}
    if index is not None and is_concept_doc is not None:
        purity = neighbourhood_purity(index, is_concept_doc, cand.tolist())
    labels = index.labels() if index is not None and hasattr(index, "labels") else {}
    ranking: list[PrototypeEvidence] = []
    chosen: list[int] = []
    budget = selection.budget
    for i in cand.tolist():
        ev = _evidence(i, scores, c, n)
        if purity:
            ev["purity"] = purity.get(i)
        p = purity.get(i)
        pure = not purity or (p is not None and not math.isnan(p) and p >= selection.min_purity)
        ev["selected"] = bool(pure and (budget is None or len(chosen) < budget))
        if ev["selected"]:
            _add_selected_evidence(ev, model, tokenizer, index, labels, neighbours)
            chosen.append(i)
        ranking.append(ev)
    sset = SuppressionSet(
        ids=chosen,
        num_prototypes=len(c.mass),
        model_sha256=model_sha256,
        concept=concept,
        evidence={e["id"]: _without_selected(e) for e in ranking if e["selected"]},
        meta={
            "method": RANKINGS[selection.rank_by] + ("+purity" if purity else ""),
            "rank_by": selection.rank_by,
            "budget": budget,
            "threshold_log2_enrichment": selection.threshold,
            "min_count": selection.min_count,
            "min_purity": selection.min_purity if purity else None,
            "concept_texts": len(concept_texts),
            "neutral_texts": len(neutral_texts),
            "concept_tokens": c.tokens,
            "neutral_tokens": n.tokens,
            "candidates": len(ranking),
            "target_tokens": list(targets),
            "target_strings": [tokenizer.id_to_token(t) for t in targets],
            "target_positions": c.target_positions,
        },
    )
    return sset, ranking


def _without_selected(e: PrototypeEvidence) -> PrototypeEvidence:
    """``e`` without its ``selected`` flag (a set's evidence holds only selected prototypes), keys in order."""
    kept = e.copy()
    kept.pop("selected", None)
    return kept


@dataclass
class _Scores:
    """Per-prototype scores of concept (c) vs neutral (n) statistics, each (K,)."""

    enrichment: np.ndarray
    """(rate_c + α) / (rate_n + α)."""
    log2_enrichment: np.ndarray
    contribution: np.ndarray
    """Contribution per token on concept text minus on neutral text (nats per token)."""
    target_effect: np.ndarray
    """Slice on the target tokens per target position (logits; 0 without targets)."""


def _concept_scores(c: ActivationStats, n: ActivationStats) -> _Scores:
    mean_act = (n.mass.sum() / max(1.0, n.count.sum())) if n.count.sum() else 0.5
    alpha = 0.5 * mean_act / max(1, n.tokens)  # pseudo-rate: half an average activation per neutral corpus
    enrich = (c.rate + alpha) / (n.rate + alpha)
    contribution = c.contribution / max(1, c.tokens) - n.contribution / max(1, n.tokens)  # (K,) nats/token
    effect = c.target_effect / max(1, c.target_positions) if c.target_effect is not None else np.zeros_like(enrich)
    return _Scores(enrich, np.log2(enrich), contribution, effect)


def _candidates(s: _Scores, c: ActivationStats, selection: ConceptSelection) -> np.ndarray:
    """Ids of the candidate prototypes, best first (stable among equal scores)."""
    ok = (c.count >= selection.min_count) & (s.log2_enrichment >= selection.threshold)
    if selection.rank_by == "contribution":
        ok &= s.contribution > 0
    if selection.rank_by == "target":
        ok &= s.target_effect > 0
    key = {"contribution": s.contribution, "target": s.target_effect}.get(selection.rank_by, s.log2_enrichment)
    cand = np.nonzero(ok)[0]
    return cand[np.argsort(-key[cand], kind="stable")]


def _evidence(i: int, s: _Scores, c: ActivationStats, n: ActivationStats) -> PrototypeEvidence:
    return {
        "id": i,
        "contribution_nats_per_token": float(s.contribution[i]),
        "target_effect": float(s.target_effect[i]),
        "log2_enrichment": float(s.log2_enrichment[i]),
        "enrichment": float(s.enrichment[i]),
        "concept_rate": float(c.rate[i]),
        "neutral_rate": float(n.rate[i]),
        "concept_count": int(c.count[i]),
        "neutral_count": int(n.count[i]),
    }


def _add_selected_evidence(
    ev: PrototypeEvidence,
    model: PrismLM,
    tokenizer: Tokenizer | None,
    index: PrototypeIndex | None,
    labels: Mapping[int, Mapping[str, object]],
    neighbours: int,
) -> None:
    """What a selected prototype's evidence adds: signature tokens, label and training snippets."""
    i = ev["id"]
    if tokenizer is not None:
        ev["signature_top_tokens"] = signature_tokens(model, tokenizer, i)
    if i in labels:
        ev["label"] = cast("str | None", labels[i].get("label"))  # labels.json holds strings (`prism label`)
    if index is not None and getattr(index, "shards", None) is not None and neighbours:
        ev["neighbours"] = [
            {"doc_id": nb.doc_id, "snippet": nb.snippet, "similarity": nb.similarity}
            for nb in index.neighbours(i, neighbours)
        ]


def _read_utf8(path: Path) -> str:
    """A text file's contents; ``DataError`` naming the file and the byte offset if it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}: not valid UTF-8 at byte {e.start} (line {line}): {e.reason}", fix="re-save the file as UTF-8"
        ) from None


def read_texts(path: str | Path, text_field: str = "text") -> list[str]:
    """Texts from a .jsonl (one object per line, ``text_field``), a .txt (blank-line separated; a fortune
    file's ``%`` lines also separate), or a folder of .txt files (one text each)."""
    import json

    path = Path(path)
    if not path.exists():
        raise DataError(f"no such file or folder: {path}", fix="check the concept / neutral texts' path")
    if path.is_dir():
        return [_read_utf8(p) for p in sorted(path.glob("*.txt"))]
    if path.suffix == ".jsonl":
        out = []
        for ln, line in enumerate(_read_utf8(path).splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line)[text_field])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(f"{path}:{ln}: expected a JSON object with a {text_field!r} field ({e})") from e
        return out
    parts = re.split(r"\n\s*(?:%\s*)?\n|\n%\n", _read_utf8(path))
    return [p.strip() for p in parts if p.strip()]
