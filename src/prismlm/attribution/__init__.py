"""Training-data attribution through prototypes (spec §3.1–3.2): the prototype index (neighbourhoods in one
pass), exact per-token explanations, automatic prototype labels, and prototype-space influence (full block
gradients, the postings cache, ``attribute``); whole-network baselines live in
``prismlm.attribution.baselines`` (kronfluence, imported on use)."""

from prismlm.attribution.explain import (Explanation, PrototypeCard, PrototypeSlice, TokenExplanation, explain,
                                         explain_generation, prototype_card)
from prismlm.attribution.index import (IndexError_, IndexMismatchError, Neighbour, PrototypeIndex,
                                       UnknownPrototypeError, build_index, merge_indexes, model_identity)
from prismlm.attribution.labels import llm_labels, load_labels, rule_labels, save_labels
from prismlm.attribution.influence import (BlockGradients, Curvature, FullGradients, block_gradients,
                                           curvature_pass, influence_scores, query_gradients)
from prismlm.attribution.cache import AttributionCache, build_cache, merge_caches
from prismlm.attribution.attribute import Attribution, AttributedSequence, attribute

__all__ = ["Attribution", "AttributedSequence", "AttributionCache", "BlockGradients", "Curvature", "FullGradients",
           "attribute", "block_gradients", "build_cache", "curvature_pass", "influence_scores", "merge_caches",
           "query_gradients", "Explanation", "IndexError_", "IndexMismatchError", "Neighbour", "PrototypeCard", "PrototypeIndex",
           "PrototypeSlice", "TokenExplanation", "UnknownPrototypeError", "build_index", "explain",
           "explain_generation", "llm_labels", "load_labels", "merge_indexes", "model_identity", "prototype_card",
           "rule_labels", "save_labels"]
