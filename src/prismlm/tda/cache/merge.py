"""Caches made from caches: ``merge_caches`` joins the caches of disjoint parts of a corpus into the one a
single pass gives; ``compress_cache`` re-encodes a lossless cache with other storage options, without
another pass over the data.

Invariant: only lossless sequence-level caches merge or re-encode (pruning, quantisation scales and
documents depend on the whole corpus): merge the parts, then compress (what ``prism attribute-cache``
does under torchrun).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from prismlm.artifacts import merge_ranges, overlap, writes_folder
from prismlm.config import AttributionConfig
from prismlm.errors import ArtifactError, ArtifactMismatch, ConfigError
from prismlm.tda.cache import encoding
from prismlm.tda.cache.codecs import DeltaIds, FloatSketches, Ids, PlainIds
from prismlm.tda.cache.encoding import alloc, check_storage, document_of_sequences, encode_postings
from prismlm.tda.cache.manifest import cache_manifest, created, lossless
from prismlm.tda.cache.store import AttributionCache

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet

__all__ = ["compress_cache", "merge_caches"]


@writes_folder("out")
def compress_cache(
    cache: AttributionCache, config: AttributionConfig, *, shards: ShardSet | None = None, out: str | Path | None = None
) -> AttributionCache:
    """Re-encode a lossless cache (float32/64 sketches, sequence postings, no pruning) with the storage
    options of ``config`` (``dtype``, ``prune``, ``aggregate``, ``id_encoding``), without another pass over
    the data. ``shards``: the cache's token shards (needed for ``aggregate="document"``). ``out``: save it
    there. Equal to building with those options from the same postings."""
    m = cache.manifest
    if not lossless(m):
        raise ArtifactError(
            f"compress_cache needs a lossless cache (float32/float64 sketches, sequence postings, "
            f"no pruning); this one is {m.get('dtype')}, prune {m.get('prune', 0)}, "
            f"aggregate {m.get('aggregate', 'sequence')}",
            fix="build it with the default options",
        )
    if config.aggregate == "document" and shards is None:
        raise ConfigError("aggregate='document' needs the cache's token shards (shards=)")
    if shards is not None:
        cache.check(shards=shards)
    universe, T, K, r = int(m["universe"]), int(m["block_size"]), cache.num_prototypes, cache.r
    check_storage(config, r)
    units_of = document_of_sequences(shards, universe, T) if config.aggregate == "document" and shards else None
    offsets, ids, sks, meta = encode_postings(
        cache.offsets, cache.seq, cache.sketches.decode(), K, r, config, units_of=units_of, work=None
    )
    manifest = cache_manifest(
        m,
        ids=ids,
        sketches=sks,
        units_of=units_of,
        universe=universe,
        tokens=int(m["tokens"]),
        covered=m["covered"],
        storage=config,
        encoded=meta,
        compressed_from=str(cache.path) if cache.path else None,
    )
    c = AttributionCache(
        offsets=offsets,
        ids=ids,
        sketches=sks,
        projection=cache.projection,
        curvature=cache.curvature,
        manifest=manifest,
        units_of=None if units_of is None else units_of.astype(np.int32),
    )
    if out is not None:
        c.save(out)
        c = AttributionCache.load(out)
    return c


@writes_folder("out")
def merge_caches(parts: list[AttributionCache], out: str | Path | None = None) -> AttributionCache:
    """Combine caches of disjoint sequence ranges (same model, shards, curvature, projection) into one,
    equal to a single pass (postings grouped by prototype, ascending sequence id within each). Parts must
    be lossless (float32/64 sketches, no pruning, sequence postings): compress the merged cache after."""
    covered = _check_mergeable(parts)
    first = parts[0].manifest  # the merged manifest's base: the first part given
    parts = sorted(parts, key=lambda p: p.manifest["covered"][0][0] if p.manifest["covered"] else 0)
    K = parts[0].num_prototypes
    seq = np.concatenate([np.asarray(p.seq, dtype=np.int64) for p in parts])
    proto = np.concatenate([np.repeat(np.arange(K, dtype=np.int32), np.diff(p.offsets)) for p in parts])
    order = np.lexsort((seq, proto))  # by prototype, then sequence: the single-pass order
    work = Path(out).with_name(Path(out).name + ".merge") if out is not None else None
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    sketch = _gather_sketches(parts, order, work)
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(proto, minlength=K), out=offsets[1:])
    tokens = sum(int(p.manifest["tokens"]) for p in parts)
    ids: Ids = (DeltaIds if first.get("id_encoding") == "delta" else PlainIds).encode(seq[order], offsets)
    manifest = cache_manifest(
        first,
        ids=ids,
        sketches=FloatSketches(sketch),
        units_of=None,
        universe=int(first["universe"]),
        tokens=tokens,
        covered=covered,
        encoded=ids.manifest(),
        part=[0, 1],
        postings_seconds=sum(float(p.manifest["postings_seconds"]) for p in parts),
        merged_from=len(parts),
        created=created(),
    )
    cache = AttributionCache(
        offsets=offsets,
        ids=ids,
        sketches=FloatSketches(sketch),
        projection=parts[0].projection,
        curvature=parts[0].curvature,
        manifest=manifest,
    )
    if out is not None:
        cache.save(out)
        del cache, sketch
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        cache = AttributionCache.load(out)
    return cache


_SAME_SOURCE: tuple[Literal["model_sha256", "shard_key"], ...] = ("model_sha256", "shard_key")
_SAME_FIT: tuple[Literal["r", "projection", "seed", "dtype", "num_prototypes", "universe", "curvature_mode"], ...] = (
    "r",
    "projection",
    "seed",
    "dtype",
    "num_prototypes",
    "universe",
    "curvature_mode",
)
"""Manifest entries every part of a merge must share (the model and corpus; the fit and layout)."""


def _check_mergeable(parts: list[AttributionCache]) -> list[list[int]]:
    """The merged sequence ranges of ``parts``, once they are lossless, of one model, corpus, curvature and
    projection, and disjoint (``ArtifactError`` / ``ArtifactMismatch`` otherwise)."""
    if not parts:
        raise ArtifactError("nothing to merge")
    first = parts[0].manifest
    for p in parts:
        if not lossless(p.manifest):
            raise ArtifactError(
                f"cannot merge caches stored as {p.manifest.get('dtype')} with prune "
                f"{p.manifest.get('prune', 0)} and aggregate {p.manifest.get('aggregate')}: "
                f"pruning, quantisation scales and documents depend on the whole corpus",
                fix="build the parts with dtype float32 (prune 0, aggregate sequence), "
                "merge them, then compress the merged cache (prismlm.tda.cache.compress_cache)",
            )
    for p in parts[1:]:
        m = p.manifest
        for source in _SAME_SOURCE:
            if m[source] != first[source]:
                raise ArtifactMismatch(f"cannot merge caches: {source} differs ({first[source]} vs {m[source]})")
        for fit in _SAME_FIT:
            if m[fit] != first[fit]:
                raise ArtifactError(f"cannot merge caches: {fit} differs ({first[fit]} vs {m[fit]})")
        if not (
            np.array_equal(p.projection, parts[0].projection)
            and torch.equal(p.curvature.F, parts[0].curvature.F)
            and torch.equal(p.curvature.m, parts[0].curvature.m)
        ):
            raise ArtifactError(
                "cannot merge caches built with different curvature or projection; pass the same "
                "`curvature` to every part",
                param="curvature",
            )
    covered: list[list[int]] = []
    for p in parts:
        ov = overlap(covered, merge_ranges(p.manifest["covered"]))
        if ov is not None:
            raise ArtifactError(f"cannot merge caches: parts overlap on sequences [{ov[0]}, {ov[1]})")
        covered = merge_ranges(covered + p.manifest["covered"])
    parts = sorted(parts, key=lambda p: p.manifest["covered"][0][0] if p.manifest["covered"] else 0)
    return covered


def _gather_sketches(parts: list[AttributionCache], order: np.ndarray, work: Path | None) -> np.ndarray:
    """(P, r) the parts' sketches (concatenated in part order) in ``order``, gathered in chunks: never all
    in memory (memory-mapped under ``work`` when given)."""
    bounds = np.cumsum([0] + [p.num_postings for p in parts])
    P, r = len(order), parts[0].r
    sketch = alloc(work, "sketch.npy", (P, r), np.asarray(parts[0].sketch[:0]).dtype)
    for s in range(0, P, encoding.CHUNK):
        idx = order[s : s + encoding.CHUNK]
        which = np.searchsorted(bounds, idx, side="right") - 1
        dst = sketch[s : s + len(idx)]
        for k, p in enumerate(parts):  # a few parts
            sel = which == k
            if sel.any():
                dst[sel] = p.sketch[idx[sel] - bounds[k]]
    return sketch
