"""The attribution cache (spec §3.2): an inverted index prototype → postings ``(j, s_{j,i})`` with sketches
``s_{j,i} = R_i H_i^{-1/2} G_{j,i}``, so a query's influence is a scan of its active prototypes' lists.

One job per module: ``codecs`` (ids, float/quantised/PQ sketches), ``projection`` (R and the sketch map),
``passes`` (the model passes of a build), ``encoding`` (postings → stored arrays), ``manifest`` (the one
manifest builder), ``store`` (the artifact: open, verify, query), ``build`` (``build_cache``, resume) and
``merge`` (``merge_caches``, ``compress_cache``). Invariant: a cache's scores are exact when RᵀR = I.
The method and the on-disk format: docs/architecture.md ("The attribution cache").
"""

from prismlm.tda.cache.build import build_cache
from prismlm.tda.cache.codecs import (
    DeltaIds,
    FloatSketches,
    PlainIds,
    PQSketches,
    QuantSketches,
    concat_ranges,
    dequantise,
    pq_encode,
    pq_layout,
    pq_train,
    quantise,
)
from prismlm.tda.cache.encoding import document_of_sequences, prune_keep
from prismlm.tda.cache.manifest import FORMAT_VERSION, KIND
from prismlm.tda.cache.merge import compress_cache, merge_caches
from prismlm.tda.cache.passes import postings_gradients, sampled_curvature
from prismlm.tda.cache.projection import PostingSketcher, fit_ranges, make_projection, pca_bases, project
from prismlm.tda.cache.store import AttributionCache, Searcher

__all__ = [
    "FORMAT_VERSION",
    "KIND",
    "AttributionCache",
    "DeltaIds",
    "FloatSketches",
    "PQSketches",
    "PlainIds",
    "PostingSketcher",
    "QuantSketches",
    "Searcher",
    "build_cache",
    "compress_cache",
    "concat_ranges",
    "dequantise",
    "document_of_sequences",
    "fit_ranges",
    "make_projection",
    "merge_caches",
    "pca_bases",
    "postings_gradients",
    "pq_encode",
    "pq_layout",
    "pq_train",
    "project",
    "prune_keep",
    "quantise",
    "sampled_curvature",
]
