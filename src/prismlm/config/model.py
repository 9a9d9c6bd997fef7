"""The model's configs: the GPT backbone and the PRISM prototype head (spec §1.2–1.4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prismlm.config.validation import check, from_dict


@dataclass
class PrototypeConfig:
    """The PRISM prototype head (spec §1.2–1.4)."""

    num_prototypes: int = 512
    """K: number of learned prototypes in the bank P (K × d)."""
    top_k: int = 8
    """k: prototypes kept per token after ReLU(cos); activations are exactly k-sparse or fewer."""
    init_std: float = 0.1
    """Prototype entries start as N(0, init_std²). Why small: AdamW moves each entry by about the
    learning rate per step whatever its scale, so a prototype's *angle* moves ∝ lr/‖p‖. With
    init_std=1 (‖p‖≈√d) the prototypes barely left their random init in 300 cpu-small steps
    (R̄1 0.27, 64 dead); with 0.1 they settled on the data (R̄1 0.98, R2 0.98, residual 0.12) at the
    same validation loss. See docs/results.md."""
    chunk_size: int | None = None
    """Tokens per chunk when computing the (tokens × K) cosine matrix, so memory stays bounded for
    large K: peak extra memory is chunk_size × K floats, never B·T × K. ``None`` (default): chosen from
    the memory available on the device (``prismlm.model.prototypes.auto_chunk_size``: ≤ 1/8 of it, and
    ≤ 2^22 entries on CPU, 2^28 on CUDA). Chunking never changes the result."""

    def __post_init__(self) -> None:
        check(self.num_prototypes >= 1, f"num_prototypes must be >= 1, got {self.num_prototypes}")
        check(
            1 <= self.top_k <= self.num_prototypes,
            f"top_k must be in [1, num_prototypes={self.num_prototypes}], got {self.top_k}",
        )
        check(
            self.chunk_size is None or self.chunk_size >= 1, f"chunk_size must be >= 1 or null, got {self.chunk_size}"
        )
        check(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")


@dataclass
class ModelConfig:
    """GPT backbone (GPT-2 layout) plus an optional prototype head."""

    vocab_size: int = 8192
    """Vocabulary size V; set from the tokenizer when data is prepared."""
    block_size: int = 128
    """Context length T (maximum sequence length)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Model width d."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and MLP outputs (0 for small-data runs)."""
    bias: bool = True
    """Use biases in Linear and LayerNorm layers (GPT-2 does)."""
    tie_weights: bool = True
    """Tie the token embedding and the output head W (GPT-2 does)."""
    prototypes: PrototypeConfig | None = field(default_factory=PrototypeConfig)
    """Prototype head; ``None`` gives the matched dense baseline (same backbone, plain linear head)."""
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    """MLP non-linearity of the built-in GPT: exact GELU, or GPT-2's tanh approximation (``gelu_tanh``) so
    GPT-2 weights load with equal logits (the two differ by ~2e-3 in the logits)."""
    layer_norm_eps: float = 1e-5
    """ε of the built-in GPT's LayerNorms (GPT-2 and PyTorch's default: 1e-5)."""
    lm_head_bias: bool = False
    """The unembedding has a bias b (ℓ = W z + b), as some Hugging Face models do; b is then its own,
    constant slice of every logit's decomposition."""
    backbone: Literal["gpt", "hf"] = "gpt"
    """``gpt``: the built-in GPT-2-layout decoder; ``hf``: a Hugging Face causal LM's base model rebuilt from
    ``hf_config`` (``prism retrofit``), whose final hidden states z feed the prototype head and W."""
    hf_config: dict[str, object] | None = None
    """With ``backbone="hf"``: the transformers config (``PretrainedConfig.to_dict()``) the backbone is
    rebuilt from; ``n_layer``, ``n_head``, ``n_embd`` and ``vocab_size`` are copied from it."""
    lora_rank: int = 0
    """LoRA adapters (``peft``) of this rank on every ``nn.Linear`` of the backbone, scaled by α/r = 2
    (0: none). Retrofit stage 2 with ``train.trainable="lora"`` trains only them and the bank; the adapters' B
    matrices start at zero, so the model starts exactly as the pretrained one."""

    def __post_init__(self) -> None:
        if isinstance(self.prototypes, dict):
            self.prototypes = from_dict(PrototypeConfig, self.prototypes, "model.prototypes")
        check(
            self.activation in ("gelu", "gelu_tanh"), f"activation must be gelu or gelu_tanh, got {self.activation!r}"
        )
        check(self.layer_norm_eps > 0, f"layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        check(self.backbone in ("gpt", "hf"), f"backbone must be gpt or hf, got {self.backbone!r}")
        check(
            (self.backbone == "hf") == (self.hf_config is not None),
            "model.hf_config must be given exactly when model.backbone is 'hf'",
        )
        check(self.lora_rank >= 0, f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.hf_config is not None:
            check(
                isinstance(self.hf_config, dict) and "model_type" in self.hf_config,
                "model.hf_config must be a transformers config dict with a model_type",
            )
        check(self.vocab_size >= 2, f"vocab_size must be >= 2, got {self.vocab_size}")
        check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        check(self.n_layer >= 1, f"n_layer must be >= 1, got {self.n_layer}")
        check(self.n_embd >= 1, f"n_embd must be >= 1, got {self.n_embd}")
        check(
            self.n_head >= 1 and (self.n_embd % self.n_head == 0 or self.backbone == "hf"),
            f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})",
        )  # an HF backbone has its own head_dim
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def is_prism(self) -> bool:
        return self.prototypes is not None
