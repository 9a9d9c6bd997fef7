"""Explanations through prototypes (spec §3.1): the prototype index (each prototype's nearest training
contexts, activation statistics and coverage in one streaming pass), exact per-token explanations, and
prototype labels."""

from prismlm.artifacts import model_identity
from prismlm.explain.explanation import (
    Explanation,
    PrototypeCard,
    PrototypeSlice,
    TokenExplanation,
    explain,
    explain_generation,
    prototype_card,
)
from prismlm.explain.index import IndexSettings, Neighbour, PrototypeIndex, build_index, merge_indexes
from prismlm.explain.labels import llm_labels, load_labels, pushed_tokens, rule_labels, save_labels

__all__ = [
    "Explanation",
    "IndexSettings",
    "Neighbour",
    "PrototypeCard",
    "PrototypeIndex",
    "PrototypeSlice",
    "TokenExplanation",
    "build_index",
    "explain",
    "explain_generation",
    "llm_labels",
    "load_labels",
    "merge_indexes",
    "model_identity",
    "prototype_card",
    "pushed_tokens",
    "rule_labels",
    "save_labels",
]
