"""Training-data attribution in prototype space (spec §3.2): exact block gradients from the forward pass,
block curvature, the postings cache, ``attribute``; whole-network baselines live in
``prismlm.tda.baselines`` (kronfluence, imported on use)."""

from prismlm.tda.attribute import AttributedSequence, Attribution, QuerySpec, Rescoring, SearchSpec, attribute
from prismlm.tda.cache import AttributionCache, build_cache, merge_caches
from prismlm.tda.gradients import BlockGradients, block_gradients, output_gradients, query_table
from prismlm.tda.influence import Curvature, FullGradients, curvature_pass, influence_scores, query_gradients
from prismlm.tda.search import SearchIndex, build_search_index

__all__ = [
    "Attribution",
    "AttributedSequence",
    "AttributionCache",
    "BlockGradients",
    "Curvature",
    "FullGradients",
    "QuerySpec",
    "Rescoring",
    "SearchSpec",
    "attribute",
    "block_gradients",
    "build_cache",
    "curvature_pass",
    "influence_scores",
    "merge_caches",
    "output_gradients",
    "query_gradients",
    "query_table",
    "SearchIndex",
    "build_search_index",
]
