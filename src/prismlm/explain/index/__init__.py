"""The prototype index (spec §3.1): every prototype's top-N nearest training contexts, in one pass.

``build`` streams a model over its training shard (``build_index``, ``merge_indexes`` of parts);
``artifact`` is the saved ``PrototypeIndex`` (tables, activation statistics, coverage, labels);
``snippets`` decodes its ``Neighbour`` contexts. Invariant: a merge of parts equals one pass bit for bit
at the same batch size. Definitions, memory bound and format: docs/architecture.md (prototype index).
"""

from __future__ import annotations

from prismlm.artifacts import part_range
from prismlm.explain.index.artifact import (
    FORMAT_VERSION,
    KIND,
    LABELS_FILE,
    MANIFEST_FILE,
    TENSORS_FILE,
    IndexManifest,
    LabelEntry,
    Labels,
    PrototypeIndex,
    PrototypeStats,
)
from prismlm.explain.index.build import IndexSettings, build_index, merge_indexes
from prismlm.explain.index.snippets import Neighbour, NeighbourDict

__all__ = [
    "FORMAT_VERSION",
    "KIND",
    "LABELS_FILE",
    "MANIFEST_FILE",
    "TENSORS_FILE",
    "IndexManifest",
    "IndexSettings",
    "LabelEntry",
    "Labels",
    "Neighbour",
    "NeighbourDict",
    "PrototypeIndex",
    "PrototypeStats",
    "build_index",
    "merge_indexes",
    "part_range",
]
