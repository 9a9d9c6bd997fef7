"""GPT decoder with an optional PRISM prototype head — one model class for PRISM and the dense baseline.

Module names follow GPT-2 (``wte``, ``wpe``, ``h.N.attn.c_attn``, ``c_proj``, ``ln_f``, ``lm_head``) so
GPT-2 checkpoints map 1:1. Every projection is a plain ``nn.Linear`` called as a module: whole-network
influence libraries (kronfluence) only track exact ``nn.Linear`` modules.

Logits are ``lm_head(z)`` for both models. For PRISM, ``z = ẑ + r`` exactly, so by linearity
``ℓ = W r + Σ_i a_i (W p_i)``: every logit is k prototype slices plus one residual slice (spec §1.5);
``prismlm.model.decompose`` computes those slices from the same forward output.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast, overload

import torch
import torch.nn as nn
import torch.nn.functional as F

from prismlm.config import ModelConfig
from prismlm.errors import ModelError
from prismlm.model import generation
from prismlm.model import losses as L
from prismlm.model.generation import Sampling, TextCodec, resolve_sampling
from prismlm.model.interventions import (
    Intervention,
    ResidualProjection,
    Suppress,
    check_ids,
    check_one_mode,
    combined_multipliers,
    edited_hidden,
    projected_ids,
    projection_mode,
)
from prismlm.model.kv_cache import CacheLike, KVCache
from prismlm.model.outputs import PrismOutput
from prismlm.model.prototypes import PrototypeLayer, PrototypeOutput

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: CacheLike | None = None,
        layer_idx: int = 0,
        *,
        attn_mask: torch.Tensor | None = None,
        weights_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) → (B, T, C). With ``cache``, x holds the T newest tokens: their keys/values are
        appended to layer ``layer_idx`` of the cache and the queries attend to every cached position.

        ``attn_mask`` (B or 1, 1, T, P + T) bool, True = attend: replaces the causal mask (padding, see
        ``_attention_mask``). ``weights_out``: when a list, the attention weights (B, nh, T, P + T) of this
        call are appended to it — computed explicitly, since SDPA cannot return them."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        past = 0
        if cache is not None:
            k_all, v_all = cache.update(k, v, layer_idx)  # (B, nh, P + T, hs): the P cached positions, then these T
            past = k_all.shape[2] - T
            if past:  # (with P = 0 the new k, v themselves: a prefill runs exactly the uncached kernel)
                k, v = k_all, v_all
        if weights_out is not None:  # the eager path: softmax(q kᵀ / √hs) written out, its weights kept
            mask = attn_mask if attn_mask is not None else _attention_mask(None, past, T, x.device)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))  # (B, nh, T, P + T)
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            weights_out.append(att)
            y = F.dropout(att, dropout_p, self.training) @ v  # (B, nh, T, hs)
        elif attn_mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)  # (B, nh, T, hs)
        elif past == 0:  # no cache, or a prefill into an empty one: plain causal attention (the training path)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)  # (B, nh, T, hs)
        elif T == 1:  # one new token: it sees every cached position and itself, so no mask at all
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)  # (B, nh, 1, hs)
        else:
            # T > 1 new tokens after P cached ones: query i sits at position P + i and sees keys 0 … P + i.
            # SDPA's is_causal aligns the mask top-left (query i → keys 0 … i) when T ≠ P + T, which would
            # hide cached positions, hence the explicit (T, P + T) mask.
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=_attention_mask(None, past, T, x.device), dropout_p=dropout_p
            )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


def _attention_mask(keys: torch.Tensor | None, past: int, T: int, device: torch.device) -> torch.Tensor:
    """The bool mask (True = attend) of T queries at positions P … P + T − 1 over P + T keys: causal, and
    with ``keys`` (B, P + T) bool (False: a padding token) no query sees a padding key — except a padding
    query its own, so that no softmax row is empty (an all −inf row is NaN, and NaN values would reach
    the real tokens through 0 · NaN). Shape (T, P + T) without keys, else (B, 1, T, P + T)."""
    q_pos = torch.arange(past, past + T, device=device)  # (T,)
    k_pos = torch.arange(past + T, device=device)  # (P + T,)
    causal = k_pos[None, :] <= q_pos[:, None]  # (T, P + T)
    if keys is None:
        return causal
    own = k_pos[None, :] == q_pos[:, None]  # (T, P + T)
    return ((causal[None] & keys[:, None, :]) | own[None])[:, None]  # (B, 1, T, P + T)


def _padding_keys(mask: torch.Tensor | None, B: int, length: int) -> torch.Tensor | None:
    """An attention_mask (B, P + T) of 0/1 → (B, P + T) bool (False: padding), or None when it has no
    padding (the unpadded kernels then run, bit for bit as without a mask)."""
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] != length:
        raise ModelError(
            f"attention_mask must be (batch, cached + new tokens) = ({B}, {length}) of 0/1, got "
            f"shape {tuple(mask.shape)}"
        )
    keys = mask.bool()
    return None if bool(keys.all()) else keys


def _positions(keys: torch.Tensor) -> torch.Tensor:
    """(B, L) bool real-token mask → (B, L) int64 positions: the number of real tokens before each one
    (cumsum − 1; 0 on leading padding), so a left-padded row has the positions of the unpadded one."""
    return (keys.long().cumsum(-1) - 1).clamp_min(0)


@dataclass
class BackboneOutput:
    """What ``PrismLM.backbone_outputs`` returns."""

    z: torch.Tensor
    """(B, T, d) the final-norm hidden states the head reads."""
    hidden_states: tuple[torch.Tensor, ...] | None = None
    """n_layer + 1 × (B, T, d): the embedding output, then each block's output; the last is z."""
    attentions: tuple[torch.Tensor, ...] | None = None
    """n_layer × (B, n_head, T, P + T) attention weights."""


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        # "gelu_tanh" is GPT-2's approximation: needed for GPT-2 weights to give GPT-2's logits exactly
        self.gelu = nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cache: CacheLike | None = None,
        layer_idx: int = 0,
        *,
        attn_mask: torch.Tensor | None = None,
        weights_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) → (B, T, C); the other arguments as in ``CausalSelfAttention.forward``."""
        x = x + self.attn(self.ln_1(x), cache, layer_idx, attn_mask=attn_mask, weights_out=weights_out)
        return x + self.mlp(self.ln_2(x))


class Backbone(nn.ModuleDict):
    """The GPT-2 ``transformer`` container: a ``ModuleDict`` whose entries are declared here for the type
    checker only (the modules live in the dict, so state-dict keys stay ``transformer.wte.weight`` …)."""

    wte: nn.Embedding
    wpe: nn.Embedding
    drop: nn.Dropout
    h: nn.ModuleList
    ln_f: nn.LayerNorm


class PrismLM(nn.Module):
    """A causal LM backbone + prototype head. ``PrismLM(cfg)`` with ``cfg.prototypes=None`` is the dense
    baseline. The backbone is the built-in GPT (``cfg.backbone="gpt"``) or a Hugging Face base model rebuilt
    from ``cfg.hf_config`` (``"hf"``, see ``prismlm.model.hf_backbone``); either way it yields the final
    hidden states z and ``lm_head`` is the unembedding (W, and a bias b with ``cfg.lm_head_bias``)."""

    prototypes: PrototypeLayer | None
    proto_multipliers: torch.Tensor | None  # a non-persistent buffer, see __init__
    tokenizer: TextCodec | None
    """The tokenizer ``generate`` uses for text (attached by ``load_checkpoint``); None: ids only."""
    transformer: nn.Module

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        if cfg.backbone == "hf":
            from prismlm.model.hf_backbone import build_base_model, input_embedding_weight

            assert cfg.hf_config is not None  # ModelConfig checks it
            self.transformer = build_base_model(cfg.hf_config)
            # transformers 5 renamed past_key_values to cache; older releases only know the old name
            forward_args = inspect.signature(self.transformer.forward).parameters
            self._hf_cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=cfg.lm_head_bias)
            if cfg.tie_weights:
                weight = input_embedding_weight(self.transformer)
                assert isinstance(weight, nn.Parameter)
                self.lm_head.weight = weight
        else:
            self.transformer = Backbone(
                dict(
                    wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                    wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                    drop=nn.Dropout(cfg.dropout),
                    h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                    ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias),
                )
            )
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=cfg.lm_head_bias)
            if cfg.tie_weights:
                self.transformer.wte.weight = self.lm_head.weight
            self.apply(self._init_weights)
            # GPT-2 scaled init of residual projections: keeps the residual stream's variance flat with depth.
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        # Created last so that, at the same seed, PRISM and the dense baseline start from the same backbone.
        self.prototypes = PrototypeLayer(cfg.n_embd, cfg.prototypes) if cfg.prototypes is not None else None
        if cfg.lora_rank > 0:  # after everything else: the other parameters keep their init at a given seed
            self._add_lora(cfg.lora_rank)
        # Per-prototype logit multipliers m (K,) used by suppression (m_i = 0) and controllers (m_i = 1 + c_i);
        # None is the unmodified model. Non-persistent: never saved in model.safetensors (suppression sets
        # and controllers are their own artifacts), and it follows .to(device). Set it through
        # ``prismlm.control`` (``with model.suppress(ids):`` / ``with model.control(c):``), which restores it.
        self.register_buffer("proto_multipliers", None, persistent=False)
        # Under Suppress(ids, residual="project"|"mean"|"contrast"): r' = r − Q Qᵀ r (``project_residual`` sets and restores it).
        self.residual_projection: ResidualProjection | None = None
        self.tokenizer = None

    def _add_lora(self, rank: int) -> None:
        """Wrap every ``nn.Linear`` of the backbone with a LoRA adapter (``peft``): W x + (α/r) B A x, B = 0 at
        the start. The wrapped weight moves to ``….base_layer.weight``; ``load_state_dict`` of a checkpoint
        saved with adapters restores them, and ``base_state_keys`` maps plain backbone weights onto it."""
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError as e:
            from prismlm.errors import DependencyError

            raise DependencyError(
                f"model.lora_rank={rank} needs the peft package ({e})", fix="pip install 'peft>=0.15'"
            ) from e
        targets = sorted(
            {name.rsplit(".", 1)[-1] for name, m in self.transformer.named_modules() if isinstance(m, nn.Linear)}
        )
        inject_adapter_in_model(
            LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets), self.transformer
        )

    def base_state_keys(self) -> dict[str, str]:
        """Our state-dict key for every key of the same model without LoRA adapters (identity without them):
        how pretrained weights are loaded into a model that carries adapters."""
        return {k.replace(".base_layer.", "."): k for k in self.state_dict() if "lora_" not in k}

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def is_prism(self) -> bool:
        return self.prototypes is not None

    @property
    def is_intervened(self) -> bool:
        """A PRISM model inside ``intervene``/``suppress``/``control``: its logits come from the prototype layer."""
        return self.prototypes is not None and (
            self.proto_multipliers is not None or self.residual_projection is not None
        )

    def block_prefixes(self) -> list[str]:
        """Parameter-name prefixes of the transformer blocks, first to last (``transformer.h.0.`` …)."""
        name, layers = self._layer_list()
        return [f"transformer.{name}.{i}." for i in range(len(layers))]

    def final_norm_prefixes(self) -> list[str]:
        """Parameter-name prefixes of the backbone's final norm (``transformer.ln_f.``, ``transformer.norm.`` …):
        the modules directly under the backbone that are neither the blocks nor embeddings."""
        block_list, _ = self._layer_list()
        embeddings = (nn.Embedding,)
        return [
            f"transformer.{name}."
            for name, m in self.transformer.named_children()
            if name != block_list and not isinstance(m, embeddings) and any(True for _ in m.parameters())
        ]

    def _layer_list(self) -> tuple[str, nn.ModuleList]:
        """(name, list) of the backbone's block list: the first ``nn.ModuleList`` directly under it."""
        for name, m in self.transformer.named_children():
            if isinstance(m, nn.ModuleList):
                return name, m
        raise ModelError(f"cannot find the transformer blocks of {type(self.transformer).__name__}")

    def new_cache(self) -> CacheLike:
        """An empty KV cache for this backbone: ours for the built-in GPT, transformers' ``DynamicCache``
        for a Hugging Face one (it is what its attention layers update)."""
        if self.config.backbone == "hf":
            from prismlm.model.hf_backbone import transformers_module

            return transformers_module().DynamicCache()
        return KVCache()

    def require_prototypes(self, what: str = "prototypes") -> PrototypeLayer:
        """The prototype layer, or ``ModelError`` ("the dense baseline has no {what}")."""
        if self.prototypes is None:
            raise ModelError(f"the dense baseline has no {what}")
        return self.prototypes

    def num_parameters(self, *, prototypes: bool = True) -> int:
        """Unique parameters (tied weights counted once); ``prototypes=False`` leaves out the bank."""
        seen: set[int] = set()
        total = 0
        for name, p in self.named_parameters():
            if id(p) in seen or (not prototypes and name.startswith("prototypes.")):
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    def backbone(
        self,
        idx: torch.Tensor | None,
        cache: CacheLike | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """idx (B, T) int64 → z (B, T, d), the final-LayerNorm hidden states.

        With ``cache`` (a ``KVCache`` or a transformers ``DynamicCache``) idx holds the T tokens that follow
        the P = ``cache.get_seq_length()`` cached ones: they get positions P … P + T − 1, attend to the
        cached keys/values, and their own are appended. z covers the T new tokens only. P + T may not
        exceed block_size (the position embeddings are learned and absolute). ``attention_mask`` and
        ``inputs_embeds``: see ``backbone_outputs``."""
        return self.backbone_outputs(idx, cache, attention_mask=attention_mask, inputs_embeds=inputs_embeds).z

    def backbone_outputs(
        self,
        idx: torch.Tensor | None,
        cache: CacheLike | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> BackboneOutput:
        """``backbone`` with everything transformers' models can return.

        ``attention_mask`` (B, P + T) of 0/1 over the cached and the new tokens (0: padding, e.g. on the
        left of a batch of prompts): a token's position is the number of real tokens before it
        (cumsum(mask) − 1), and no token attends to a padding token, so each row computes what it would
        alone, unpadded. ``inputs_embeds`` (B, T, d) replaces the token embeddings ``wte(idx)``.
        ``output_hidden_states``: n_layer + 1 tensors (B, T, d), the embedding output and each block's
        output, the last one after the final norm (= z, transformers' convention). ``output_attentions``:
        n_layer tensors (B, n_head, T, P + T) of attention weights (computed outside SDPA for that call)."""
        if (idx is None) == (inputs_embeds is None):
            raise ModelError("give exactly one of input_ids (B, T) and inputs_embeds (B, T, d)")
        B, T = idx.shape if idx is not None else inputs_embeds.shape[:2]  # type: ignore[union-attr]
        past = cache.get_seq_length() if cache is not None else 0
        if past + T > self.config.block_size:
            what = f"sequence length {T}" if cache is None else f"{past} cached + {T} new tokens"
            raise ModelError(f"{what} exceeds the context window block_size={self.config.block_size}")
        keys = _padding_keys(attention_mask, B, past + T)  # (B, P + T) bool, or None without padding
        if self.config.backbone == "hf":
            return self._hf_backbone(idx, cache, keys, inputs_embeds, output_hidden_states, output_attentions)
        assert isinstance(self.transformer, Backbone)
        device = self.transformer.wpe.weight.device
        pos = torch.arange(past, past + T, device=device) if keys is None else _positions(keys)[:, -T:]  # (T,) | (B, T)
        emb = self.transformer.wte(idx) if inputs_embeds is None else inputs_embeds  # (B, T, d)
        x = self.transformer.drop(emb + self.transformer.wpe(pos))  # (B, T, d)
        mask = _attention_mask(keys, past, T, device) if keys is not None else None
        hidden: list[torch.Tensor] | None = [x] if output_hidden_states else None
        weights: list[torch.Tensor] | None = [] if output_attentions else None
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i, attn_mask=mask, weights_out=weights)  # (B, T, d)
            if hidden is not None:
                hidden.append(x)
        z = self.transformer.ln_f(x)  # (B, T, d)
        if hidden is not None:
            hidden[-1] = z  # as transformers' GPT-2: the last hidden state is the final norm's output
        return BackboneOutput(
            z, tuple(hidden) if hidden is not None else None, tuple(weights) if weights is not None else None
        )

    def hidden_from_layer(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """z (B, T, d) from h (B, T, d), the residual stream entering block ``layer`` (what
        ``backbone_outputs(..., output_hidden_states=True).hidden_states[layer]`` holds) of sequences that start
        at position 0, with no cache and no padding: blocks ``layer … n_layer − 1`` and the final norm.

        Why: stage 2 on stored boundary activations trains the last N blocks without re-running the first
        n_layer − N ones. The built-in GPT and transformers models whose positions enter inside attention
        (rotary: Llama, Mistral, Qwen, SmolLM2 …) are supported; a model that adds learned absolute position
        embeddings to its input (GPT-2 in transformers) is refused (``ModelError``): its input embeddings
        cannot be replaced by a mid-stack residual stream."""
        name, layers = self._layer_list()
        if not 0 <= layer < len(layers):
            raise ModelError(
                f"boundary layer {layer} is outside the model's {len(layers)} blocks",
                fix=f"unfreeze between 1 and {len(layers)} blocks (last-N)",
            )
        if self.config.backbone != "hf":
            assert isinstance(self.transformer, Backbone)
            x = h
            for i in range(layer, len(layers)):
                x = self.transformer.h[i](x, None, i)  # (B, T, d)
            return self.transformer.ln_f(x)
        base = self.transformer
        if not hasattr(base, "rotary_emb"):
            raise ModelError(
                f"{type(base).__name__} adds position embeddings to its input, so it cannot start from a stored "
                "mid-stack residual stream",
                fix="set train.stage2_from_stored=false (stage 2 then runs the whole backbone every step)",
            )
        # The base model runs ``self.layers[:num_hidden_layers]`` on ``inputs_embeds``: for this call it holds
        # only the top blocks (positions come from the rotary embedding inside attention, as in a full pass).
        top = nn.ModuleList(list(layers)[layer:])
        setattr(base, name, top)
        try:
            return cast("PreTrainedModel", base)(inputs_embeds=h, use_cache=False).last_hidden_state
        finally:
            setattr(base, name, layers)

    def _hf_backbone(
        self,
        idx: torch.Tensor | None,
        cache: CacheLike | None,
        keys: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        output_hidden_states: bool,
        output_attentions: bool,
    ) -> BackboneOutput:
        """``backbone_outputs`` of a transformers base model (its last_hidden_state has been through its
        final norm; its hidden_states follow the same convention as ours)."""
        kwargs: dict[str, object] = {"use_cache": cache is not None}
        if cache is not None:
            kwargs[self._hf_cache_kwarg] = cache
        if keys is not None:  # positions from the mask, as transformers' generate computes them
            T = idx.shape[1] if idx is not None else inputs_embeds.shape[1]  # type: ignore[union-attr]
            kwargs["attention_mask"] = keys.long()  # (B, P + T)
            kwargs["position_ids"] = _positions(keys)[:, -T:]  # (B, T)
        if output_hidden_states:
            kwargs["output_hidden_states"] = True
        backbone = cast("PreTrainedModel", self.transformer)  # this branch: a transformers base model
        eager = output_attentions and backbone.config._attn_implementation != "eager"
        previous = backbone.config._attn_implementation
        if eager:  # SDPA kernels cannot return attention weights: the eager implementation for this call
            backbone.set_attn_implementation("eager")
        try:
            out = backbone(input_ids=idx, inputs_embeds=inputs_embeds, output_attentions=output_attentions, **kwargs)
        finally:
            if eager:
                backbone.set_attn_implementation(previous)
        return BackboneOutput(
            out.last_hidden_state,
            out.hidden_states if output_hidden_states else None,
            out.attentions if output_attentions else None,
        )

    def forward(
        self,
        idx: torch.Tensor | None,
        targets: torch.Tensor | None = None,
        *,
        loss_weights: dict[str, float] | None = None,
        last_only: bool = False,
        cache: CacheLike | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> PrismOutput:
        """idx (B, T); targets (B, T) or None. ``loss_weights`` (see ``LossConfig.weights_at``) sets the
        weighted total; ``last_only`` computes logits for the last position only (generation).

        ``cache`` (``KVCache`` or transformers ``DynamicCache``): idx continues the cached tokens (see
        ``backbone``); every output field then covers the T new tokens only (``proto_max_cos`` is over
        them too), and the logits equal those of an uncached forward over the whole sequence.
        ``attention_mask`` (B, P + T) 0/1 (padding), ``inputs_embeds`` (B, T, d) instead of idx,
        ``output_hidden_states``/``output_attentions``: as in ``backbone_outputs``; they fill
        ``PrismOutput.hidden_states``/``attentions``."""
        bo = self.backbone_outputs(
            idx,
            cache,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        z = bo.z  # (B, T, d)
        B, T, d = z.shape
        out_z = z[:, -1:, :] if last_only else z
        mult = self.proto_multipliers
        # Unmodified model: logits straight from z (ℓ = W z = W r + Σ a_i W p_i since z = ẑ + r). Why lm_head
        # runs before the prototype layer: the order fixes how autograd sums the two gradients into z, and
        # keeping it keeps training bit-for-bit reproducible across versions (a reordering moved losses by 1e-8).
        proj = self.residual_projection
        logits = self.lm_head(out_z) if not self.is_intervened else None  # (B, T, V)
        po = self.prototypes(z.reshape(B * T, d)) if self.prototypes is not None else None
        removed = None
        if logits is None:
            assert po is not None
            # ℓ' = W r' + Σ_i m_i a_i W p_i: the slices scaled, r' = r − Q Qᵀ r when the residual is projected
            z_mod, removed = edited_hidden(z.reshape(B * T, d), po, self.require_prototypes().weight, mult, proj)
            z_mod = z_mod.view(B, T, d)
            logits = self.lm_head(z_mod[:, -1:, :] if last_only else z_mod)  # (B, T, V)
        out = PrismOutput(logits=logits, hidden=z, hidden_states=bo.hidden_states, attentions=bo.attentions)
        if po is not None:
            _set_prototype_fields(out, po, mult, removed, proj if removed is not None else None)
            if targets is not None:
                out.losses["rec"] = L.reconstruction_loss(po.residual, z.reshape(B * T, d))
                out.losses["r1"] = L.r1_loss(po.proto_max_cos)
                out.losses["r2"] = L.r2_loss(po.token_max_cos)
                if loss_weights and loss_weights.get("proto_kl", 0.0) and not last_only:
                    # the prototype-only prediction W ẑ (+ bias) distilled toward the model's own logits
                    out.losses["proto_kl"] = L.prototype_kl(
                        logits.reshape(B * T, -1), self.lm_head(po.reconstruction.to(z.dtype))
                    )
        if targets is not None:
            out.losses["ce"] = L.cross_entropy(logits, targets if not last_only else targets[:, -1:])
            out.loss = L.total_loss(out.losses, loss_weights or {"ce": 1.0})
        return out

    def decode_step(self, feed: torch.Tensor, cache: CacheLike | None, last_only: bool) -> PrismOutput:
        """One step of the decode loop over feed (B, T): under an intervention the full ``forward`` (its
        logits come from the prototype layer); otherwise the backbone and ``lm_head`` only, the prototype
        fields left empty (``add_prototype_fields`` fills them later, for all steps at once)."""
        if self.is_intervened:
            return self(feed, last_only=last_only, cache=cache)
        z = self.backbone(feed, cache)  # (B, T, d)
        return PrismOutput(logits=self.lm_head(z[:, -1:, :] if last_only else z), hidden=z)  # as forward's

    def add_prototype_fields(self, out: PrismOutput) -> PrismOutput:
        """Fill the prototype fields of an output that has only ``logits`` and ``hidden`` (B, T, d) — the
        lean steps of ``generate_steps``, possibly joined along the sequence — as ``forward`` computes them
        (per token; ``proto_max_cos`` over these tokens), with one prototype-layer call for all T tokens.
        Valid for the unmodified model only: under ``suppress``/``control`` the logits themselves come
        from the prototype layer, and ``generate_steps`` then yields complete forward outputs."""
        prototypes = self.require_prototypes()
        if self.is_intervened:
            raise ModelError("add_prototype_fields is for the unmodified model: an intervention is active")
        B, T, d = out.hidden.shape
        _set_prototype_fields(out, prototypes(out.hidden.reshape(B * T, d)), None)
        return out

    # ----- suppression and control (spec §4): the forward output itself is modified, nothing else ----------
    def check_prototype_ids(self, ids: Iterable[int] | torch.Tensor) -> torch.Tensor:
        """Validate prototype ids → (n,) int64 tensor; ``ModelError`` naming the bad ids otherwise."""
        if self.prototypes is None:
            raise ModelError("the dense baseline has no prototypes to suppress or control")
        ids_list = ids if isinstance(ids, torch.Tensor) else list(ids)
        return torch.tensor(check_ids(ids_list, self.prototypes.num_prototypes), dtype=torch.long)

    def intervene(self, *interventions: Intervention) -> AbstractContextManager[PrismLM]:
        """``with model.intervene(Suppress.of(ids), Control(c)):`` applies interventions (values from
        ``prismlm.model.interventions``) for the block, multiplied together; the model is restored on exit.
        With no interventions it is a no-op (also on the dense baseline)."""
        if not interventions:
            return nullcontext(self)
        if self.prototypes is None:
            raise ModelError("the dense baseline has no prototypes to suppress or control")
        m = combined_multipliers(interventions, self.prototypes.num_prototypes)
        assert m is not None
        ids, mode = projected_ids(interventions), projection_mode(interventions)
        if not ids or mode is None:
            return self.scale_prototypes(m.to(self.prototypes.weight.dtype))
        return self._scaled_and_projected(m.to(self.prototypes.weight.dtype), ids, mode)

    @contextmanager
    def _scaled_and_projected(self, multipliers: torch.Tensor, ids: tuple[int, ...], mode: str) -> Iterator[PrismLM]:
        with self.scale_prototypes(multipliers), self.project_residual(ids, mode):
            yield self

    @contextmanager
    def project_residual(self, ids: Iterable[int], mode: str = "project") -> Iterator[PrismLM]:
        """Within the block, the residual is projected off span{p_i : i ∈ ids} (``mode="project"``) or off
        their unit mean u = Σ p_i / ‖Σ p_i‖ (``mode="mean"``) or off v = unit(p̄_ids − p̄_bank)
        (``mode="contrast"``): r' = r − Q Qᵀ r, and the logits use r'
        (``PrismOutput.residual`` is r'). Nested blocks project off the union of their ids (in one mode:
        nesting the other mode is refused, ``ModelError``); the previous state is always restored. Alone it
        leaves the slices; ``Suppress(ids, residual=mode)`` (through ``intervene``) removes both."""
        bank = self.require_prototypes("prototypes to suppress").weight
        previous = self.residual_projection
        if previous is not None:
            check_one_mode((previous.mode, mode))
        union = sorted(set(check_ids(list(ids), bank.shape[0])) | set(previous.ids if previous else ()))
        self.residual_projection = ResidualProjection.of(union, bank, mode) if union else previous
        try:
            yield self
        finally:
            self.residual_projection = previous

    @contextmanager
    def scale_prototypes(self, multipliers: torch.Tensor) -> Iterator[PrismLM]:
        """Within the block, prototype i's logit slice is multiplied by ``multipliers[i]`` (K,):
        ℓ' = W r + Σ_i m_i a_i W p_i. Nested blocks compose multiplicatively; the previous state is
        always restored on exit, also when the body raises. Gradients flow into ``multipliers``."""
        if self.prototypes is None:
            raise ModelError("the dense baseline has no prototypes to suppress or control")
        K = self.prototypes.num_prototypes
        if multipliers.shape != (K,):
            raise ModelError(f"multipliers must have shape ({K},), got {tuple(multipliers.shape)}")
        previous = self.proto_multipliers
        dev = self.prototypes.weight.device
        m = multipliers.to(dev)
        self.proto_multipliers = m if previous is None else previous * m
        try:
            yield self
        finally:
            self.proto_multipliers = previous

    def suppress(self, ids: Iterable[int] | torch.Tensor) -> AbstractContextManager[PrismLM]:
        """``with model.suppress(ids):`` removes the slices a_i W p_i of the given prototypes from every
        logit (spec §4), exactly; unknown ids raise ``ModelError`` before anything changes. Shorthand for
        ``model.intervene(Suppress.of(ids))``."""
        return self.intervene(Suppress.of(self.check_prototype_ids(ids).tolist()))

    def control(self, coefficients: torch.Tensor) -> AbstractContextManager[PrismLM]:
        """``with model.control(c):`` re-weights prototype slices by (1 + c_i) (a sparse linear controller,
        spec §4); ``c = 0`` is exactly the base model."""
        return self.scale_prototypes(1.0 + coefficients)

    def signatures(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logit–token signatures W p_i: (K, V), or (len(ids), V) for selected prototypes."""
        if self.prototypes is None:
            raise ModelError("the dense baseline has no prototypes")
        p = self.prototypes.weight if ids is None else self.prototypes.weight[ids]
        return p @ self.lm_head.weight.T  # (n, V): W p_i, without W's bias (which is not any prototype's)

    @overload
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        temperature: float | None = None,
        top_tokens: int | None = None,
    ) -> torch.Tensor: ...

    @overload
    def generate(
        self,
        idx: str,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        temperature: float | None = None,
        top_tokens: int | None = None,
    ) -> str: ...

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor | str,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        temperature: float | None = None,
        top_tokens: int | None = None,
    ) -> torch.Tensor | str:
        """Sample ``max_new_tokens`` continuations of idx (B, T); returns (B, T + max_new_tokens).

        ``sampling``: a ``prismlm.model.generation.Sampling`` (default ``Sampling()``: temperature 1, the
        whole vocabulary, torch's global generator; temperature 0 is greedy); ``generator`` overrides its
        seed. ``temperature`` / ``top_tokens``: shortcuts for those fields of ``sampling`` (they override it). The
        context is cropped to the last block_size tokens. ``use_cache`` (default) runs the prompt once and
        then one token per step against a ``KVCache``; ``use_cache=False`` recomputes the whole window at
        every step. Both give the same tokens (see ``generate_steps`` for what happens past block_size).

        ``idx`` may be text when a tokenizer is attached (``model.tokenizer``: ``load_checkpoint`` and
        ``Run.open`` attach the run's): it is encoded (an empty text starts from end-of-text) and the text
        plus its continuation is returned.
        """
        s = resolve_sampling(sampling, temperature, top_tokens, default=Sampling())
        if isinstance(idx, str):
            return generation.generate_text(self, idx, max_new_tokens, s, generator=generator, use_cache=use_cache)
        return generation.generate(self, idx, max_new_tokens, s, generator=generator, use_cache=use_cache)

    def generate_steps(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        *,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        prefill_logits: bool = False,
        temperature: float | None = None,
        top_tokens: int | None = None,
    ) -> Iterator[tuple[PrismOutput, torch.Tensor]]:
        """``generate`` one step at a time (same arguments): yields ``(out, next_tokens)`` per new token,
        where next_tokens (B, 1) was sampled from ``out.logits[:, -1]``, the output for exactly the tokens
        that step ran (with the cache: the cropped prompt on the first step, then the one previous token;
        without it: the window). ``out.hidden`` covers those tokens; ``out.logits`` the last one, or with
        ``prefill_logits`` every token of the first step (what an explanation of a generation needs).

        Under ``suppress``/``control`` each step is a full forward (the logits come from the prototype
        layer) and ``out`` has every field. Otherwise the prototype fields are left empty: the logits of
        the unmodified model are ``lm_head(z)``, the same op ``forward`` runs, and the prototype layer would
        be pure overhead; ``add_prototype_fields`` computes them afterwards, for all steps at once.

        Past block_size the sliding-window semantics of ``use_cache=False`` are kept exactly: the window is
        the last block_size tokens with positions restarting at 0. The position embeddings are learned and
        absolute, so once the window slides every token's position — and with it every key and value in
        every layer — changes; nothing cached is reusable, and those steps recompute the window.
        """
        s = resolve_sampling(sampling, temperature, top_tokens, default=Sampling())
        return generation.generate_steps(
            self, idx, max_new_tokens, s, generator=generator, use_cache=use_cache, prefill_logits=prefill_logits
        )


def _set_prototype_fields(
    out: PrismOutput,
    po: PrototypeOutput,
    mult: torch.Tensor | None,
    removed: torch.Tensor | None = None,
    projection: ResidualProjection | None = None,
) -> None:
    """Copy the prototype layer's output for the B·T flattened tokens of ``out.hidden`` into ``out``; with
    ``removed`` (N, d) Q Qᵀ r the residual is the edited one, r' = r − Q Qᵀ r (what the logits were made of)."""
    B, T, d = out.hidden.shape
    k = po.indices.shape[-1]
    out.indices = po.indices.view(B, T, k)
    out.activations = po.activations.view(B, T, k)
    if mult is not None:
        out.prototype_multipliers = mult
    out.residual = (po.residual if removed is None else po.residual - removed).view(B, T, d)
    if removed is not None:
        out.residual_removed = removed.view(B, T, d)
        if projection is not None:
            out.residual_projected_ids, out.residual_projection_mode = projection.ids, projection.mode
    out.token_max_cos = po.token_max_cos.view(B, T)
    out.proto_max_cos = po.proto_max_cos
