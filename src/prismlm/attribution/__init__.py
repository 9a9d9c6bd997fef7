"""Training-data attribution through prototypes (spec §3.1): the prototype index (neighbourhoods in one
pass), exact per-token explanations, and automatic prototype labels."""

from prismlm.attribution.explain import (Explanation, PrototypeCard, PrototypeSlice, TokenExplanation, explain,
                                         explain_generation, prototype_card)
from prismlm.attribution.index import (IndexError_, IndexMismatchError, Neighbour, PrototypeIndex,
                                       UnknownPrototypeError, build_index, merge_indexes, model_identity)
from prismlm.attribution.labels import llm_labels, load_labels, rule_labels, save_labels

__all__ = ["Explanation", "IndexError_", "IndexMismatchError", "Neighbour", "PrototypeCard", "PrototypeIndex",
           "PrototypeSlice", "TokenExplanation", "UnknownPrototypeError", "build_index", "explain",
           "explain_generation", "llm_labels", "load_labels", "merge_indexes", "model_identity", "prototype_card",
           "rule_labels", "save_labels"]
