"""PRISM model: GPT backbone, prototype layer, losses, exact logit decomposition."""

from prismlm.model.gpt import LogitDecomposition, PrismLM, PrismOutput, decompose
from prismlm.model.interventions import Control, Intervention, Scale, Suppress
from prismlm.model.kv_cache import KVCache
from prismlm.model.modes import eval_mode
from prismlm.model.prototypes import PrototypeLayer, PrototypeOutput

__all__ = ["Control", "Intervention", "Scale", "Suppress", "KVCache", "LogitDecomposition", "PrismLM", "PrismOutput", "PrototypeLayer", "PrototypeOutput", "decompose", "eval_mode"]
