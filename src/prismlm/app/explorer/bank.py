"""The explorer's views of the whole prototype bank: the Map (a 2-D projection of the unit prototypes, with
category and use per prototype) and Search (prototypes by label, nearest-context text or token).

Invariant: the map is deterministic — UMAP with a fixed seed, or PCA with a fixed sign per component.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F

from prismlm.app.explorer.plain import Plain
from prismlm.app.explorer.session import Session
from prismlm.explain.index import Labels
from prismlm.explain.labels import CATEGORIES

__all__ = ["MapView", "SearchHit", "SearchView", "bank_map", "search_view"]


@dataclass
class MapView(Plain):
    """What ``Explorer.map`` returns: per prototype (K entries each) its 2-D position, category, use, label."""

    method: str
    """``pca`` or ``umap``."""
    x: list[float]
    """(K,) first coordinate, rounded to 5 decimals."""
    y: list[float]
    """(K,) second coordinate."""
    category: list[int]
    """Index into ``categories`` (−1: unlabelled)."""
    categories: list[str]
    count: list[int] | None
    """Indexed tokens each prototype is active on (None without an index)."""
    label: list[str]
    """(K,) label ("" unlabelled)."""
    quality: list[float | None]
    """(K,) the label's quality: how often a token it names is the next token where the prototype fires."""
    explained_variance: list[float] | None
    """PCA's share of the variance of its two components (None: UMAP)."""


class SearchHit(TypedDict):
    id: int
    label: str
    category: str
    why: str
    """What matched: ``label``, ``nearest context``, a token search's reason, or "" (no query)."""
    count: int | None


@dataclass
class SearchView(Plain):
    """What ``Explorer.search`` returns."""

    query: str
    """The query (or the token) searched."""
    hits: list[SearchHit]
    """The first ``limit`` matches."""
    matched: int
    """How many prototypes match."""
    ids: list[int]
    """Every match (what the map highlights)."""


def project(P: torch.Tensor) -> tuple[torch.Tensor, str, list[float] | None]:
    """(xy (K, 2), method, explained variance of PCA's two components) of unit prototypes ``P`` (K, d):
    UMAP when ``umap-learn`` is installed and K ≥ 16, else PCA."""
    K = P.shape[0]
    if importlib.util.find_spec("umap") is not None and K >= 16:
        import umap

        return torch.from_numpy(umap.UMAP(n_components=2, random_state=0).fit_transform(P.numpy())), "umap", None
    X = P - P.mean(0, keepdim=True)
    cov = X.T @ X / max(1, K - 1)  # (d, d): cheaper than an SVD of (K, d) for K ≫ d
    ev, vec = torch.linalg.eigh(cov)  # ascending
    comp = vec[:, -2:].flip(1)  # (d, 2): the two leading directions
    # a deterministic sign: the largest-|loading| entry of each component is positive
    sign = torch.sign(comp.gather(0, comp.abs().argmax(0, keepdim=True)))
    tot = float(ev.clamp(min=0).sum()) or 1.0
    return X @ (comp * sign), "pca", [float(ev[-1]) / tot, float(ev[-2]) / tot]


def bank_map(s: Session) -> MapView:
    """``Explorer.map`` (which keeps it): the bank's projection with each prototype's category, label and
    indexed use. Call under ``s.lock``."""
    with torch.no_grad():
        P = F.normalize(s.model.require_prototypes().weight.detach().double().cpu(), dim=-1)  # (K, d)
        xy, method, evr = project(P)
    K = P.shape[0]
    labs = s.labels()
    cats = list(CATEGORIES)
    cat_ix = {c: j for j, c in enumerate(cats)}
    xy = xy.float()
    return MapView(
        method=method,
        x=[round(v, 5) for v in xy[:, 0].tolist()],
        y=[round(v, 5) for v in xy[:, 1].tolist()],
        category=[cat_ix.get(labs.get(i, {}).get("category", ""), -1) for i in range(K)],
        categories=cats,
        count=s.index.counts.tolist() if s.index is not None else None,
        label=[labs.get(i, {}).get("label", "") for i in range(K)],
        quality=[labs.get(i, {}).get("quality") for i in range(K)],
        explained_variance=evr,
    )


def search_view(s: Session, query: str, *, token: str | None, limit: int) -> SearchView:
    """``Explorer.search``: the matches of ``query`` (or of ``token``), the first ``limit`` with labels."""
    s.limits.check_top(limit, "limit")
    s.limits.check_text(query, "query")
    labs = s.labels()
    counts = s.index.counts.tolist() if s.index is not None else None
    if token is not None:
        s.limits.check_text(token, "token")
        hits = s.token_search().hits(token)
    else:
        hits = query_matches(s, query, labs, counts)
    rows: list[SearchHit] = [
        {
            "id": i,
            "label": labs.get(i, {}).get("label", ""),
            "category": labs.get(i, {}).get("category", ""),
            "why": why,
            "count": counts[i] if counts is not None else None,
        }
        for i, why in hits[:limit]
    ]
    return SearchView(
        query=token if token is not None else query,
        hits=rows,
        matched=len(hits),
        ids=[i for i, _ in hits] if (query.strip() or token is not None) else [],
    )


def query_matches(s: Session, query: str, labs: Labels, counts: list[int] | None) -> list[tuple[int, str]]:
    """(id, why) of the prototypes whose label or category holds ``query`` (or whose id it is), then those
    whose nearest context does, then — for a one-token query — those with the token in a context. An
    empty query: every prototype, most used first."""
    q = query.strip().lower()
    if not q:
        order = list(range(s.num_prototypes))
        if counts is not None:
            order.sort(key=lambda i: -counts[i])
        return [(i, "") for i in order]
    hits: list[tuple[int, str]] = []
    for i in range(s.num_prototypes):
        lab = labs.get(i, {})
        if q in f"{lab.get('label', '')} {lab.get('category', '')}".lower() or q == str(i):
            hits.append((i, "label"))
    if s.index is not None and s.index.shards is not None:
        seen = {i for i, _ in hits}
        hits += [(i, "nearest context") for i, t in enumerate(s.neighbour_texts()) if i not in seen and q in t.lower()]
    seen = {i for i, _ in hits}  # a one-token query also finds the prototypes with it in a context
    more = s.token_search().hits(query.strip(), strict=False, signature=False)
    return hits + [(i, w) for i, w in more if i not in seen]
