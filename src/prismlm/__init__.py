"""prismlm — prototype language models (PRISM): predictions as sparse mixtures of data-anchored prototypes."""

from prismlm._version import __version__
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

__all__ = ["AttributionConfig", "DataConfig", "LossConfig", "ModelConfig", "PrismLM", "PrismOutput", "PrototypeConfig",
           "RunConfig", "TrainConfig", "decompose", "__version__"]
