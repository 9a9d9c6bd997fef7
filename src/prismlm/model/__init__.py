"""PRISM model: GPT backbone, prototype layer, losses, exact logit decomposition."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prismlm.model.decomposition import LogitDecomposition, decompose
    from prismlm.model.generation import Sampling
    from prismlm.model.gpt import PrismLM
    from prismlm.model.interventions import Control, Intervention, ResidualProjection, Scale, Suppress
    from prismlm.model.kv_cache import KVCache
    from prismlm.model.modes import eval_mode
    from prismlm.model.outputs import PrismOutput
    from prismlm.model.prototypes import PrototypeLayer, PrototypeOutput

__all__ = [
    "Control",
    "Intervention",
    "ResidualProjection",
    "Scale",
    "Suppress",
    "KVCache",
    "LogitDecomposition",
    "PrismLM",
    "PrismOutput",
    "PrototypeLayer",
    "PrototypeOutput",
    "Sampling",
    "decompose",
    "eval_mode",
]

# Why lazy (PEP 562): `prismlm.integrations.hf_auto` (imported by `import prismlm`) needs only the standard library,
# and importing this package must not import torch for it; each name is imported on first use.
_LAZY = {
    **dict.fromkeys(["LogitDecomposition", "decompose"], "prismlm.model.decomposition"),
    "PrismLM": "prismlm.model.gpt",
    "PrismOutput": "prismlm.model.outputs",
    **dict.fromkeys(
        ["Control", "Intervention", "ResidualProjection", "Scale", "Suppress"], "prismlm.model.interventions"
    ),
    "KVCache": "prismlm.model.kv_cache",
    "Sampling": "prismlm.model.generation",
    "eval_mode": "prismlm.model.modes",
    **dict.fromkeys(["PrototypeLayer", "PrototypeOutput"], "prismlm.model.prototypes"),
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'prismlm.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
