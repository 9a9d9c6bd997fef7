"""PRISM model: GPT backbone, prototype layer, losses, exact logit decomposition."""

from prismlm.model.gpt import LogitDecomposition, PrismLM, PrismOutput, decompose
from prismlm.model.prototypes import PrototypeLayer, PrototypeOutput

__all__ = ["LogitDecomposition", "PrismLM", "PrismOutput", "PrototypeLayer", "PrototypeOutput", "decompose"]
