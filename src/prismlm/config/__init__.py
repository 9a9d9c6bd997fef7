"""Typed configuration: one dataclass per concern, validated on construction.

Every field is documented where it is declared, and ``from_dict`` rejects unknown keys, so a typo in a
config file or an override fails loudly instead of silently training the wrong model. Messages name the
config field (``train.lr``), never a command-line flag: the CLI maps fields to its flags. Files:
``model`` (backbone, prototype head), ``training`` (loss, data, optimiser), ``attribution`` (cache, search),
``run`` (``RunConfig``, overrides), ``presets``, ``overrides`` (string → typed value), ``validation``.
"""

from __future__ import annotations

from prismlm.config.attribution import AttributionConfig, SearchConfig
from prismlm.config.model import ModelConfig, PrototypeConfig
from prismlm.config.presets import PRESETS
from prismlm.config.run import RunConfig, parse_overrides
from prismlm.config.training import DataConfig, LossConfig, TrainConfig
from prismlm.config.validation import from_dict, replace

__all__ = [
    "PRESETS",
    "AttributionConfig",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "PrototypeConfig",
    "RunConfig",
    "SearchConfig",
    "TrainConfig",
    "from_dict",
    "parse_overrides",
    "replace",
]
