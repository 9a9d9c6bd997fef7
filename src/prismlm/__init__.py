"""prismlm — prototype language models (PRISM): predictions as sparse mixtures of data-anchored prototypes."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from prismlm._version import __version__
from prismlm.integrations.hf_auto import alias_moved_modules, register_when_imported

if TYPE_CHECKING:
    from prismlm.config import (
        AttributionConfig,
        DataConfig,
        LossConfig,
        ModelConfig,
        PrototypeConfig,
        RunConfig,
        TrainConfig,
    )
    from prismlm.model import PrismLM, PrismOutput, decompose

__all__ = [
    "AttributionConfig",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "PrismLM",
    "PrismOutput",
    "PrototypeConfig",
    "RunConfig",
    "TrainConfig",
    "decompose",
    "__version__",
]

# Why lazy (PEP 562): `import prismlm` (and so every `prismlm.cli` import, e.g. `prism --help`) must not
# import torch, which costs seconds; each name is imported on first use.
_LAZY = {
    **dict.fromkeys(
        ["AttributionConfig", "DataConfig", "LossConfig", "ModelConfig", "PrototypeConfig", "RunConfig", "TrainConfig"],
        "prismlm.config",
    ),
    **dict.fromkeys(["PrismLM", "PrismOutput", "decompose"], "prismlm.model"),
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'prismlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# AutoConfig / AutoModelForCausalLM learn the "prism" model type (exported runs, `prism export`): now if
# transformers is already imported, else right after it is — never importing it here (it costs seconds).
register_when_imported()
alias_moved_modules()
