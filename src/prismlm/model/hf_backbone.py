"""Hugging Face causal LMs as PRISM backbones, and GPT-2 weights in the built-in GPT.

The prototype head decomposes only the final hidden state (ℓ = W z + b, z = ẑ + r), so it fits any causal
LM whose logits are linear in one hidden vector (spec §6). GPT-2 weights are copied into the built-in GPT;
other families keep their own base model as ``PrismLM.transformer``. Invariant: ``check_same_logits``
compares with the original model, so a model whose logits are not ``W z + b`` is refused, never silently
decomposed wrongly. See docs/modules.md. ``transformers`` is optional (``DependencyError`` without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from prismlm.errors import DependencyError, ModelError

if TYPE_CHECKING:  # transformers is optional
    from transformers import PretrainedConfig

# Config fields that make logits something other than W z + b (value that is harmless → why it is not)
_NONLINEAR_FIELDS: dict[str, tuple[float | None, str]] = {
    "final_logit_softcapping": (None, "soft-caps the logits (tanh)"),
    "logit_scale": (None, "multiplies the logits by a scale"),
    "logits_scaling": (1.0, "divides the logits by a scale"),
    "output_multiplier_scale": (None, "scales the logits"),
}


def transformers_module() -> ModuleType:
    """``import transformers``, or ``DependencyError`` with the install command."""
    try:
        import transformers
    except ImportError as e:
        raise DependencyError(
            f"Hugging Face models need the transformers package ({e})", fix="pip install 'prismlm[hf]'"
        ) from e
    return transformers


def check_linear_logits_config(config: PretrainedConfig, source: str) -> None:
    """Refuse a config whose logits are not W z + b (e.g. Gemma-2's final soft-capping), naming the field."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, (harmless, effect) in _NONLINEAR_FIELDS.items():
        value = getattr(text, name, harmless)
        if value is not None and value != harmless:
            raise ModelError(
                f"{source}: {text.model_type} {effect} ({name}={value}), so its logits are not a "
                "linear function W z + b of the final hidden state and PRISM's decomposition "
                "would not be exact",
                fix="retrofit a model without it",
            )


def hidden_size_of(config: PretrainedConfig) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


def build_base_model(hf_config: Mapping[str, object]) -> nn.Module:
    """The base model (no LM head) described by a transformers config dict, randomly initialised in float32
    (the checkpoint's weights are loaded over it)."""
    tf = transformers_module()
    data = dict(hf_config)
    model_type = data.pop("model_type")
    try:
        config = tf.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as e:
        raise ModelError(
            f"transformers {tf.__version__} does not know the model type {model_type!r}: {e}",
            fix="install the transformers version the model was made with",
        ) from e
    check_linear_logits_config(config, f"model type {model_type}")
    base = tf.AutoModel.from_config(config)
    return base.float()


def split_causal_lm(hf_lm: nn.Module, source: str) -> tuple[nn.Module, nn.Linear]:
    """(base model, unembedding) of a transformers ``*ForCausalLM``; ``ModelError`` if it has no linear head."""
    prefix = getattr(hf_lm, "base_model_prefix", "")
    base = getattr(hf_lm, prefix, None) if prefix else None
    get_head = getattr(hf_lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if base is None or not isinstance(head, nn.Linear):
        raise ModelError(
            f"{source}: {type(hf_lm).__name__} has no base model + linear output layer that prismlm "
            "can split (expected a decoder-only *ForCausalLM)",
            fix="use a GPT-2, Llama-family or GPT-NeoX causal LM",
        )
    return base, head


def input_embedding_weight(base: nn.Module) -> torch.Tensor:
    """The token-embedding matrix of a transformers base model (what a tied unembedding shares)."""
    get = getattr(base, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, nn.Embedding):
        raise ModelError(f"{type(base).__name__} has no token embedding (get_input_embeddings)")
    return emb.weight


def gpt2_activation(config: PretrainedConfig, source: str) -> str:
    """The built-in GPT's ``activation`` for a GPT-2 config; ``ModelError`` for variants it does not have."""
    act = getattr(config, "activation_function", "gelu_new")
    table = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
    unsupported = [
        (act not in table, f"activation_function={act!r}"),
        (getattr(config, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=True"),
        (not getattr(config, "scale_attn_weights", True), "scale_attn_weights=False"),
        (getattr(config, "add_cross_attention", False), "add_cross_attention=True"),
        (getattr(config, "n_inner", None) not in (None, 4 * config.n_embd), f"n_inner={config.n_inner}"),
    ]
    bad = [what for flag, what in unsupported if flag]
    if bad:
        raise ModelError(
            f"{source}: this GPT-2 variant ({', '.join(bad)}) is not the built-in GPT's layout",
            fix="report it; other model types use the Hugging Face backbone",
        )
    return table[act]


def gpt2_state_dict(hf_state: dict[str, torch.Tensor], block_size: int) -> dict[str, torch.Tensor]:
    """A transformers ``GPT2LMHeadModel`` state dict → the built-in GPT's (``PrismLM`` keys, no prototypes).

    GPT-2 stores ``c_attn``/``c_proj``/``c_fc`` as ``Conv1D`` with (in, out) weights; ``nn.Linear`` wants
    (out, in), so those are transposed. The causal-mask buffers are dropped, and the position table is cut to
    ``block_size`` rows (positions below it are unchanged, so are the outputs of sequences that fit)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of old checkpoints, not weights
        name = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            value = value.t()
        if name == "transformer.wpe.weight":
            if value.shape[0] < block_size:
                raise ModelError(f"block_size {block_size} exceeds the model's {value.shape[0]} positions")
            value = value[:block_size]
        out[name] = value.contiguous()
    if "lm_head.weight" not in out:  # tied: stored once, as the token embedding
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


@torch.no_grad()
def check_same_logits(
    reference: nn.Module, ours: nn.Module, vocab_size: int, block_size: int, source: str, *, tolerance: float = 1e-3
) -> float:
    """Run the original model and ours on one random probe batch (2 × min(16, block_size) ids) and refuse
    (``ModelError``) if their logits differ by more than ``tolerance`` relative to the logits' scale — the
    check that catches a head that is not W z + b. Returns the relative difference."""
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(0, vocab_size, (2, min(16, block_size)), generator=g)
    device = next(ours.parameters()).device
    ref = reference(input_ids=probe.to(device)).logits.float()  # (2, T, V)
    got = ours(probe.to(device)).logits.float()[..., : ref.shape[-1]]  # (2, T, V)
    rel = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-6))
    if not rel <= tolerance:
        raise ModelError(
            f"{source}: prismlm's logits (lm_head applied to the final hidden state) differ from the "
            f"model's own by {rel:.2e} (relative): its logits are not a linear function of the last "
            "hidden state, so PRISM cannot decompose them exactly",
            fix="retrofit a model whose head is a plain linear unembedding",
        )
    return rel
