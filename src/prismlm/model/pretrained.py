"""Pretrained causal LMs in prismlm's terms: a transformers model (a ``save_pretrained`` folder, or a hub name
when online), a GGUF file or the short name of a shipped model (``prismlm.model.gguf``) → ``Pretrained``
(architecture, weights under ``PrismLM``'s names, tokenizer); ``build_model`` puts them in a ``PrismLM``,
checked against the original model's logits. A prismlm run as the backbone: ``prismlm.train.checkpoint.
pretrained_from_run``. A retrofit then seeds a prototype bank on it and trains it (``prismlm.train.retrofit``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from prismlm.config import ModelConfig
from prismlm.data.tokenizer import Tokenizer, from_transformers, hf_tokenizer
from prismlm.errors import ModelError, TokenizerError
from prismlm.model.gguf import SourceInfo, gguf_path, load_causal_lm
from prismlm.model.gpt import PrismLM
from prismlm.model.hf_backbone import (
    check_linear_logits_config,
    check_same_logits,
    gpt2_activation,
    gpt2_state_dict,
    hidden_size_of,
    input_embedding_weight,
    split_causal_lm,
    transformers_module,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_MAX_BLOCK = 1024
"""Longest context a retrofit uses by default (training windows, generation crop): the model's own if shorter."""


@dataclass
class Pretrained:
    """A pretrained causal LM, in prismlm's terms, ready to carry a prototype head."""

    source: str
    """What the user named (a run folder, a transformers folder or a hub name)."""
    model: ModelConfig
    """Its architecture as a ``ModelConfig`` (``prototypes=None``)."""
    state: dict[str, torch.Tensor]
    """Backbone and unembedding weights under ``PrismLM``'s names."""
    tokenizer: Tokenizer
    """The model's own tokenizer."""
    reference: nn.Module | None = None
    """The original transformers model, kept to check that prismlm reproduces its logits."""
    info: SourceInfo | None = None
    """For a GGUF source: the file, its sha256 and quantisation (recorded in the run)."""


def load_pretrained(source: str, *, block_size: int | None = None) -> Pretrained:
    """A transformers causal LM (folder, or hub name when online) or a GGUF file (or a shipped model's short
    name, e.g. ``smollm2-135m-instruct``) as a ``Pretrained``. ``block_size``: context to use (default: the
    model's, at most ``DEFAULT_MAX_BLOCK``)."""
    if gguf_path(source) is not None:
        hf_lm, hf_tok, info = load_causal_lm(source)
        tokenizer = from_transformers(hf_tok, f"gguf:{Path(info.path).name}")
        return _from_causal_lm(source, hf_lm.config, hf_lm, tokenizer, block_size, info)
    path = Path(source).expanduser()
    if path.is_file():
        raise ModelError(
            f"`source` {source} is a file; the source is the folder holding the model (its config.json, "
            "weights and tokenizer) or a run folder",
            fix=f"`source` {path.parent}",
            param="source",
            path=path,
        )
    return _from_transformers(source, block_size)


def is_transformers_folder(path: Path) -> bool:
    """A folder written by ``save_pretrained``: its config.json names a model_type (a prismlm checkpoint's
    config.json is a RunConfig, which has none)."""
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def from_prism_weights(
    source: str, cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer, block_size: int | None
) -> Pretrained:
    """A prismlm model's config and weights (its bank dropped) as a ``Pretrained``, its context cropped to
    ``block_size`` (a learned position table can be cut shorter, never made longer)."""
    state = {k: v for k, v in weights.items() if not k.startswith("prototypes.")}
    if block_size is not None and block_size != cfg.block_size:
        if cfg.backbone != "gpt" or block_size > cfg.block_size:
            raise ModelError(
                f"`block_size` {block_size}: {source} has a context of {cfg.block_size}",
                fix=f"use a block size <= {cfg.block_size}",
                param="block_size",
            )
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:block_size].clone()
        cfg = replace(cfg, block_size=block_size)
    return Pretrained(source=source, model=replace(cfg, prototypes=None), state=state, tokenizer=tokenizer)


def _check_vocab_size(folder: Path) -> None:
    """A local config.json whose ``vocab_size`` (top level or ``text_config``) is not a positive integer is
    refused by name: transformers would fail deep inside (a negative tensor dimension, a validation error)."""
    cfg_file = folder / "config.json"
    try:
        data = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return  # AutoConfig reports an unreadable config itself
    for where, section in (("", data), ("text_config.", data.get("text_config") if isinstance(data, dict) else None)):
        if not isinstance(section, dict) or "vocab_size" not in section:
            continue
        v = section["vocab_size"]
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ModelError(
                f"{cfg_file}: {where}vocab_size must be a positive integer, got {v!r}",
                fix="set it to the vocabulary size the weights were saved with",
                path=cfg_file,
            )


def _load_causal_lm(tf: ModuleType, source: str, model_type: str) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(source)`` in float32, with its failures as one-line errors: no
    weights file, a truncated file, weights whose shapes are not config.json's, or an encoder model."""
    try:
        hf_lm = tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    except ValueError as e:
        raise ModelError(
            f"{source} is a {model_type} model, not a causal language model ({str(e).splitlines()[0]})",
            fix="retrofit a decoder-only *ForCausalLM",
        ) from e
    except OSError as e:  # no model.safetensors / pytorch_model.bin
        raise ModelError(
            f"{source}: no weights to load ({str(e).splitlines()[0]})",
            fix="save the model with save_pretrained(folder) so that its weights file is there",
        ) from e
    except RuntimeError as e:  # transformers: "ignore_mismatched_sizes ... see the report above"
        raise ModelError(
            f"{source}: the shapes of its weights do not match its config.json",
            fix="use the config.json the weights were saved with",
        ) from e
    except Exception as e:  # noqa: BLE001 — safetensors and torch raise their own types for damaged bytes
        raise ModelError(
            f"{source}: its weights file cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})",
            fix="the file is damaged or truncated: save or download the model again",
        ) from e
    # BERT-like encoders map to a *LMHeadModel but are no causal LM: their layers say is_decoder=False
    if any(getattr(m, "is_decoder", None) is False for m in hf_lm.modules()):
        raise ModelError(
            f"{source} is a {model_type} encoder, not a causal LM (its layers attend both ways)",
            fix="retrofit a decoder-only causal LM (a *ForCausalLM such as GPT-2 or Llama)",
        )
    return hf_lm.eval()


def _from_transformers(source: str, block_size: int | None) -> Pretrained:
    tf = transformers_module()
    local = Path(source).expanduser()
    if (local / "config.json").is_file():
        _check_vocab_size(local)
    try:
        config = tf.AutoConfig.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 — OSError, ValueError, huggingface_hub's strict validation errors
        raise ModelError(
            f"{source} is neither a prismlm run nor a transformers model (a folder with a config.json "
            f"naming a model_type, or a hub name): {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            fix="pass a run folder, a saved transformers causal LM, or a hub name when online",
            path=Path(source),
        ) from e
    check_linear_logits_config(config, source)
    hf_lm = _load_causal_lm(tf, source, config.model_type)
    # transformers 5 makes an empty tokenizer for a folder without tokenizer files instead of failing
    if local.is_dir() and not any((local / f).exists() for f in _TOKENIZER_FILES):
        raise TokenizerError(
            f"{source} has no usable tokenizer: none of {', '.join(_TOKENIZER_FILES)} is there",
            fix="save the model's tokenizer next to it (tokenizer.save_pretrained(folder))",
            path=local,
        )
    try:
        tokenizer = hf_tokenizer(source)
    except TokenizerError as e:
        raise TokenizerError(
            f"{source} has no usable tokenizer: {e.message}",
            fix="save the model's tokenizer next to it (tokenizer.save_pretrained(folder))",
        ) from e
    return _from_causal_lm(source, config, hf_lm, tokenizer, block_size, None)


def _from_causal_lm(
    source: str,
    config: PretrainedConfig,
    hf_lm: nn.Module,
    tokenizer: Tokenizer,
    block_size: int | None,
    info: SourceInfo | None,
) -> Pretrained:
    """A loaded transformers ``*ForCausalLM`` (float32, eval) and its tokenizer in prismlm's terms."""
    check_linear_logits_config(config, source)
    text = config.get_text_config()
    context = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None) or DEFAULT_MAX_BLOCK
    bs = block_size if block_size is not None else min(int(context), DEFAULT_MAX_BLOCK)
    if bs > context:
        raise ModelError(
            f"`block_size` {bs}: {source} has a context of {context}", fix=f"use <= {context}", param="block_size"
        )
    base, head = split_causal_lm(hf_lm, source)
    vocab = int(head.weight.shape[0])
    if tokenizer.vocab_size > vocab:
        raise TokenizerError(f"{source}: its tokenizer has {tokenizer.vocab_size} ids but the model only {vocab}")
    tied = head.weight is input_embedding_weight(base)
    common = functools.partial(  # the fields both layouts share
        ModelConfig,
        vocab_size=vocab,
        block_size=bs,
        n_layer=int(text.num_hidden_layers),
        n_embd=hidden_size_of(config),
        dropout=0.0,
        tie_weights=tied,
        prototypes=None,
    )
    if config.model_type == "gpt2":  # GPT-2's layout is the built-in GPT's: copy the weights in
        model_cfg = common(
            n_head=int(text.n_head),
            bias=True,
            lm_head_bias=head.bias is not None,
            activation=gpt2_activation(text, source),  # type: ignore[arg-type]
            layer_norm_eps=float(text.layer_norm_epsilon),
        )
        state = gpt2_state_dict(hf_lm.state_dict(), bs)
    else:
        hf_config = config.to_dict()
        hf_config.pop("quantization_config", None)  # a GGUF source is stored dequantised
        model_cfg = common(
            n_head=int(text.num_attention_heads),
            backbone="hf",
            hf_config=hf_config,
            lm_head_bias=head.bias is not None,
        )
        state = {f"transformer.{k}": v for k, v in base.state_dict().items()}
        state["lm_head.weight"] = head.weight.detach()
        if head.bias is not None:
            state["lm_head.bias"] = head.bias.detach()
    return Pretrained(source=source, model=model_cfg, state=state, tokenizer=tokenizer, reference=hf_lm, info=info)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def build_model(pre: Pretrained, cfg: ModelConfig) -> PrismLM:
    """``PrismLM(cfg)`` — ``pre``'s architecture plus an untrained bank and/or LoRA adapters — holding the
    pretrained weights, checked against the original transformers model's logits when there is one."""
    model = PrismLM(cfg)
    ours = model.base_state_keys()  # pretrained key → ours (they differ under LoRA adapters)
    unexpected = [k for k in pre.state if k not in ours]
    missing, _ = model.load_state_dict({ours[k]: v for k, v in pre.state.items() if k in ours}, strict=False)
    missing = [m for m in missing if not m.startswith("prototypes.") and ".lora_" not in m]
    if missing or unexpected:
        raise ModelError(
            f"{pre.source}: weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.eval()
    if pre.reference is not None:
        check_same_logits(pre.reference, model, cfg.vocab_size, cfg.block_size, pre.source)
    return model
