"""The attribution cache's manifest: its kind and format, and ``cache_manifest``, the one place that
assembles a cache's manifest from its postings (used by ``build_cache``, ``merge_caches`` and
``compress_cache``).

Invariant: a manifest's postings statistics (postings, bytes) describe the arrays saved next to it.
The keys are listed in docs/architecture.md ("The attribution cache").
"""

from __future__ import annotations

import time
from typing import cast

import numpy as np

from prismlm.artifacts import JSON, FileRecord
from prismlm.config import AttributionConfig
from prismlm.tda.cache.codecs import DeltaIds, Ids, Sketches, StorageEntries
from prismlm.tda.cache.encoding import EncodedEntries

__all__ = ["FORMAT_VERSION", "KIND", "REBUILD", "CacheManifest", "cache_manifest", "created", "lossless"]

KIND = "prismlm-attribution-cache"
FORMAT_VERSION = 2
"""1: int32 ids + float sketches (no storage options in the manifest); 2: adds ``id_encoding``, quantised
sketches, pruning and document aggregation (a format-2 cache with the default options has format 1's files)."""
REBUILD = "prism attribute-cache RUN"
"""The command a user runs to make a damaged or outdated cache again (named in error messages)."""


class CacheManifest(EncodedEntries, total=False):
    """``manifest.json`` of an attribution cache, in the order ``cache_manifest`` writes it: identity and fit
    options, storage options, ``encode_postings``' entries, postings statistics, timings and provenance,
    then ``files``. Every key but ``files`` is present in a cache this prismlm builds; a format-1 cache lacks
    the storage options (their defaults apply)."""

    kind: str
    format_version: int
    model_sha256: str
    shard_key: str
    shards_root: str
    split: str
    num_prototypes: int
    d: int
    block_size: int
    r: int
    projection: str
    seed: int
    pca_sequences: int | None
    curvature_mode: str
    damping: float
    curvature_sample: int | None
    curvature_tokens: int
    batch_size: int
    universe: int
    part: list[int]
    prune: float
    prune_by: str
    aggregate: str
    units: int
    covered: list[list[int]]
    """Sequence ranges [a, b) whose postings the cache holds."""
    tokens: int
    postings: int
    postings_per_sequence: float
    bytes_postings: int
    bytes_per_token: float
    curvature_seconds: float
    postings_seconds: float
    created: str
    prismlm_version: str
    torch_version: str
    compressed_from: str | None
    """``compress_cache``: the folder of the cache it re-encoded."""
    merged_from: int
    """``merge_caches``: how many parts."""
    files: dict[str, FileRecord]


def lossless(manifest: CacheManifest) -> bool:
    """Whether a cache keeps every sequence posting at float32/64 (can be merged and re-encoded)."""
    return (
        manifest.get("dtype") in ("float32", "float64")
        and not manifest.get("prune", 0)
        and manifest.get("aggregate", "sequence") == "sequence"
    )


def created() -> str:
    """The ``created`` entry: the local time now."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def cache_manifest(
    base: CacheManifest,
    *,
    ids: Ids,
    sketches: Sketches,
    units_of: np.ndarray | None,
    universe: int,
    tokens: int,
    covered: list[list[int]],
    storage: AttributionConfig | None = None,
    encoded: StorageEntries | None = None,
    **entries: JSON,
) -> CacheManifest:
    """The manifest of a cache holding postings ``ids``/``sketches``: ``base`` (identity and fit options; its
    ``files`` record dropped, ``save`` writes a new one), then the format and storage options of ``storage``
    (a build or a re-encoding; a merge keeps its parts'), ``encoded`` (``encode_postings``' entries), the
    postings statistics over the ``covered`` sequence ranges and their ``tokens``, and ``entries`` (other
    ``CacheManifest`` keys: timings, provenance, ``part``, ``merged_from``…).
    ``units_of`` (universe,): the document of each sequence (document aggregation), else None."""
    m: dict[str, object] = {k: v for k, v in base.items() if k != "files"}
    if storage is not None:
        m.update(
            {
                "format_version": FORMAT_VERSION,
                "dtype": storage.dtype,
                "prune": storage.prune,
                "prune_by": storage.prune_by,
                "aggregate": storage.aggregate,
                "id_encoding": storage.id_encoding,
                "units": universe if units_of is None else int(units_of[-1]) + 1,
            }
        )
    m.update(encoded or {})
    P = len(ids.gaps) if isinstance(ids, DeltaIds) else len(ids.seq)
    bytes_postings = int(ids.nbytes + sketches.nbytes) + (4 * universe if units_of is not None else 0)
    m.update(
        {
            "covered": covered,
            "tokens": tokens,
            "postings": P,
            "postings_per_sequence": P / max(1, sum(b - a for a, b in covered)),
            "bytes_postings": bytes_postings,
            "bytes_per_token": bytes_postings / max(1, tokens),
            **entries,
        }
    )
    return cast("CacheManifest", m)  # base's keys, then the ones above and ``entries``: all CacheManifest's
