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
from prismlm.model.hf_auto import register_when_imported

__all__ = ["AttributionConfig", "DataConfig", "LossConfig", "ModelConfig", "PrismLM", "PrismOutput", "PrototypeConfig",
           "RunConfig", "TrainConfig", "decompose", "__version__"]

# AutoConfig / AutoModelForCausalLM learn the "prism" model type (exported runs, `prism export`): now if
# transformers is already imported, else right after it is — never importing it here (it costs seconds).
register_when_imported()
