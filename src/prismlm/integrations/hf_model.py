"""PRISM as a Hugging Face transformers model: ``PrismConfig`` + ``PrismForCausalLM``.

``PrismForCausalLM`` wraps one ``PrismLM`` behind the transformers interface (``from_pretrained``,
``generate()``, lm-eval's ``hf`` model) and only calls its forward: the logits are the run's own, bit for bit.
``PrismConfig.prism_model`` (the ``ModelConfig`` as a dict) is the source of truth; the standard fields are
derived from it. Baked-in interventions, padding, the KV cache and tied weights: docs/modules.md.
transformers is optional: importing this module without it raises ``DependencyError``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from prismlm.artifacts import JSON
from prismlm.config import ModelConfig, from_dict
from prismlm.errors import ConfigError, DependencyError, ModelError
from prismlm.model.gpt import PrismLM
from prismlm.model.interventions import (
    PROJECTING_MODES,
    Intervention,
    check_ids,
    combined_multipliers,
    projected_ids,
    projection_mode,
)

try:
    from transformers import (
        GenerationConfig,
        GenerationMixin,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerFast,
    )
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise DependencyError(
        f"the Hugging Face interface of prismlm needs the transformers package ({e})", fix="pip install 'prismlm[hf]'"
    ) from e

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import Cache

    from prismlm.model.outputs import PrismOutput

__all__ = [
    "MODEL_TYPE",
    "PrismCausalLMOutput",
    "PrismConfig",
    "PrismForCausalLM",
    "fast_tokenizer",
    "register",
    "write_remote_code",
]

MODEL_TYPE = "prism"
AUTO_MAP = {"AutoConfig": "configuration_prism.PrismConfig", "AutoModelForCausalLM": "modeling_prism.PrismForCausalLM"}
_REMOTE_CODE = {
    "configuration_prism.py": '"""`trust_remote_code=True` entry point: PrismConfig lives in the installed prismlm package '
    '(pip install prismlm)."""\n\nfrom prismlm.integrations.hf_model import PrismConfig\n\n'
    '__all__ = ["PrismConfig"]\n',
    "modeling_prism.py": '"""`trust_remote_code=True` entry point: PrismForCausalLM lives in the installed prismlm package '
    '(pip install prismlm)."""\n\nfrom prismlm.integrations.hf_model import PrismConfig, PrismForCausalLM\n\n'
    '__all__ = ["PrismConfig", "PrismForCausalLM"]\n',
}
# transformers ≥ 5.x (late) names the cache `cache`; earlier releases `past_key_values`
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# derived from prism_model on every construction; values saved in config.json are recomputed, not trusted
_DERIVED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def write_remote_code(folder: str | os.PathLike[str]) -> list[Path]:
    """Write the ``trust_remote_code`` shims into ``folder``; returns their paths."""
    out = []
    for name, text in _REMOTE_CODE.items():
        p = Path(folder) / name
        p.write_text(text, encoding="utf-8")
        out.append(p)
    return out


class PrismConfig(PretrainedConfig):
    """transformers config of a PRISM (or dense) model: the prismlm ``ModelConfig`` plus the standard fields."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        prism_model: dict[str, JSON] | None = None,
        *,
        suppressed_prototypes: Sequence[int] | None = None,
        prototype_multipliers: Sequence[float] | None = None,
        residual_projected_prototypes: Sequence[int] | None = None,
        residual_projection_mode: str | None = None,
        prism_source: dict[str, JSON] | None = None,
        **kwargs: Any,  # Any: PretrainedConfig's own fields, each typed by transformers, passed through
    ) -> None:
        """``prism_model``: ``dataclasses.asdict(ModelConfig)`` (default: ``ModelConfig()``).
        ``suppressed_prototypes``: prototype ids whose logit slices are removed in every forward.
        ``prototype_multipliers``: K per-prototype multipliers (controllers, scaling); when given, the
        suppressed ids are the ones with multiplier 0. ``residual_projected_prototypes``: ids whose span
        the residual is projected off in every forward (``Suppress(ids, residual="project")``; the basis is
        recomputed from the saved bank, as prismlm computes it). ``residual_projection_mode``: ``project``
        (their span; the default, and what exports without the field meant), ``mean`` (their unit mean
        direction, ``Suppress(ids, residual="mean")``) or ``contrast`` (their mean minus the bank's mean, made
        unit; ``Suppress(ids, residual="contrast")``). ``prism_source``: where the weights came from."""
        cfg = self._model_config(prism_model if prism_model is not None else asdict(ModelConfig()))
        for k in _DERIVED:
            kwargs.pop(k, None)
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        # generation fields: transformers' base config drops them from kwargs, so they are set here
        use_cache = bool(kwargs.pop("use_cache", True))
        bos, eos, pad = (kwargs.pop(k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
        super().__init__(**kwargs)
        self.use_cache = use_cache
        self.prism_model = asdict(cfg)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.n_embd
        self.num_hidden_layers = cfg.n_layer
        self.num_attention_heads = cfg.n_head
        self.max_position_embeddings = cfg.block_size
        self.tie_word_embeddings = bool(cfg.tie_weights)  # re-checked against the weights by PrismForCausalLM
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos, eos, pad
        if prototype_multipliers is not None:
            mult = [float(m) for m in prototype_multipliers]
            self.prototype_multipliers: list[float] | None = mult
            self.suppressed_prototypes: list[int] = [i for i, m in enumerate(mult) if m == 0.0]
        else:
            self.prototype_multipliers = None
            self.suppressed_prototypes = sorted({int(i) for i in suppressed_prototypes or ()})
        projected = sorted({int(i) for i in residual_projected_prototypes or ()})
        self.residual_projected_prototypes: list[int] | None = projected or None
        # None without a projection; exports from before the mean mode recorded ids only, all of them "project"
        self.residual_projection_mode: str | None = (residual_projection_mode or "project") if projected else None
        self.prism_source = prism_source

    @staticmethod
    def _model_config(data: dict[str, JSON]) -> ModelConfig:
        try:
            return from_dict(ModelConfig, dict(data), "prism_model")
        except ConfigError as e:
            raise ConfigError(f"config.json: {e.message}", fix="export the run again with this prismlm version") from e

    def model_config(self) -> ModelConfig:
        """The prismlm ``ModelConfig`` this config describes."""
        return self._model_config(self.prism_model)

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs: object) -> None:
        """``config.json`` plus the ``trust_remote_code`` shims its ``auto_map`` names."""
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        write_remote_code(save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class: str | type = "AutoConfig") -> None:
        """Kept a no-op: transformers calls it after a ``trust_remote_code`` load and would then copy this
        module into every saved folder; ``save_pretrained`` ships the import shims instead."""


@dataclasses.dataclass
class PrismCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus the PRISM decomposition of every position of the forward's input.

    The prototype fields cover all input positions even when ``logits_to_keep`` trims the logits."""

    prototype_indices: torch.Tensor | None = None
    """(B, T, k) the top-k prototype ids of each token; None for the dense baseline."""
    prototype_activations: torch.Tensor | None = None
    """(B, T, k) their non-negative activations a_i."""
    residual: torch.Tensor | None = None
    """(B, T, d) r = z − Σ a_i p_i; with a baked-in residual projection the edited r' = r − Q Qᵀ r."""


def _shared_parameters(module: torch.nn.Module) -> dict[str, str]:
    """{name: first name} for every parameter that is the same object as an earlier one (tied weights)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _check_position_ids(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, past: int) -> None:
    """The model derives positions itself (P … P + T − 1, or cumsum(attention_mask) − 1 with padding);
    ``position_ids`` (B or 1, T) that say otherwise are refused rather than silently ignored."""
    if position_ids is None:
        return
    T = position_ids.shape[-1]
    if attention_mask is None:
        own = torch.arange(past, past + T, device=position_ids.device)[None]  # (1, T)
    else:
        own = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:].to(position_ids.device)  # (B, T)
    if position_ids.shape[-1] != own.shape[-1] or not bool((position_ids == own).all()):
        raise ModelError(
            "position_ids differ from the positions the model uses: PRISM models have learned "
            "absolute positions, P … P + T − 1 after P cached tokens, counted over the real tokens "
            "of attention_mask",
            fix="leave position_ids out (pass attention_mask for padding)",
        )


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor, *, every_position: bool) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) at t against labels (B, T) at t + 1 (-100 ignored), in float32;
    ``every_position``: False when the forward kept only the last logits, which labels cannot use."""
    if not every_position:
        raise ModelError("labels need the logits of every position (logits_to_keep=0)")
    return F.cross_entropy(
        logits[:, :-1, :].float().reshape(-1, logits.size(-1)),
        labels[:, 1:].reshape(-1).to(logits.device),
        ignore_index=-100,
    )


class PrismForCausalLM(PreTrainedModel, GenerationMixin):
    """A ``PrismLM`` (``self.prism``) as a transformers causal LM."""

    config_class = PrismConfig
    base_model_prefix = "prism"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules: list[str] = []

    def __init__(self, config: PrismConfig, prism: PrismLM | None = None) -> None:
        """``prism``: an existing ``PrismLM`` to wrap as is (its config must be ``config.model_config()``);
        default a new one (weights from ``from_pretrained`` or ``from_prism``)."""
        super().__init__(config)
        cfg = config.model_config()
        if prism is not None and asdict(prism.config) != asdict(cfg):
            raise ModelError("the PrismLM to wrap has another config than config.prism_model")
        self.prism = prism if prism is not None else PrismLM(cfg)
        # transformers drops the targets of this mapping when saving and re-ties them when loading; read off
        # the weights, so a dense model with an untied head is never tied (and a tied one always is)
        tied = _shared_parameters(self)
        self._tied_weights_keys = tied or None  # type: ignore[assignment]
        config.tie_word_embeddings = bool(tied)
        self._multipliers = self._baked_multipliers(config)
        self._multiplier_tensor: torch.Tensor | None = None
        self._projected = self._baked_projection(config)
        self.post_init()

    def _baked_multipliers(self, config: PrismConfig) -> tuple[float, ...] | None:
        """The (K,) multipliers recorded in the config, checked against the bank; None when there are none."""
        mult, ids = config.prototype_multipliers, config.suppressed_prototypes
        if mult is None and not ids:
            return None
        if self.prism.prototypes is None:
            raise ModelError(
                "config.json suppresses or scales prototypes, but the model is a dense baseline (it has no prototypes)"
            )
        K = self.prism.prototypes.num_prototypes
        if mult is not None:
            if len(mult) != K:
                raise ModelError(
                    f"config.json: prototype_multipliers has {len(mult)} entries, the model has {K} prototypes"
                )
            return tuple(mult)
        out = [1.0] * K
        for i in check_ids(list(ids), K):
            out[i] = 0.0
        return tuple(out)

    def _baked_projection(self, config: PrismConfig) -> tuple[tuple[int, ...], str]:
        """The ids whose span (or mean) the residual is projected off and the mode (config.json), checked
        against the bank; ((), "project") when there is no projection."""
        ids = getattr(config, "residual_projected_prototypes", None) or []  # absent in older exports
        mode = getattr(config, "residual_projection_mode", None) or "project"  # absent before the mean mode
        if not ids:
            return (), mode
        if self.prism.prototypes is None:
            raise ModelError("config.json projects the residual off prototypes, but the model is a dense baseline")
        if mode not in PROJECTING_MODES:
            raise ModelError(
                f"config.json: residual_projection_mode must be one of {', '.join(PROJECTING_MODES)}, got {mode!r}",
                fix="export the model again with this prismlm (prism export --suppress … --suppress-residual …)",
            )
        return tuple(check_ids(list(ids), self.prism.prototypes.num_prototypes)), mode

    @property
    def prototype_multipliers(self) -> torch.Tensor | None:
        """(K,) the baked-in multipliers (0: suppressed) on the bank's device and dtype, or None."""
        if self._multipliers is None or self.prism.prototypes is None:
            return None
        w = self.prism.prototypes.weight
        t = self._multiplier_tensor
        if t is None or t.device != w.device or t.dtype != w.dtype:
            # combined in float64 and cast once, as PrismLM.intervene does: the same tensor as the run's
            t = torch.tensor(self._multipliers, dtype=torch.float64).to(device=w.device, dtype=w.dtype)
            self._multiplier_tensor = t
        return t

    # ----- construction from prismlm ---------------------------------------------------------------------------
    @classmethod
    def from_prism(
        cls,
        model: PrismLM,
        *,
        interventions: Sequence[Intervention] = (),
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        prism_source: dict[str, JSON] | None = None,
    ) -> PrismForCausalLM:
        """A float32 CPU copy of ``model`` with ``interventions`` (suppression sets, controllers, scaling)
        baked in: its logits are those of ``with model.intervene(*interventions): model(x)``."""
        mult = None
        if interventions:
            if model.prototypes is None:
                raise ModelError("the dense baseline has no prototypes to suppress or control")
            m = combined_multipliers(interventions, model.prototypes.num_prototypes)
            assert m is not None
            mult = m.tolist()
        projected, mode = list(projected_ids(interventions)), projection_mode(interventions)
        binary = mult is not None and all(v in (0.0, 1.0) for v in mult)
        config = PrismConfig(
            asdict(model.config),
            suppressed_prototypes=[i for i, v in enumerate(mult) if v == 0.0] if binary and mult else None,
            prototype_multipliers=None if binary else mult,
            residual_projected_prototypes=projected or None,
            residual_projection_mode=mode if projected else None,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            prism_source=prism_source,
        )
        hf = cls(config)
        state = {
            k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
            for k, v in model.state_dict().items()
        }
        hf.prism.load_state_dict(state)
        hf.float()
        # no max_length: set here, every generate(max_new_tokens=…) warns that both are set (the context
        # window is config.max_position_embeddings, and generation slides past it anyway)
        hf.generation_config = GenerationConfig(
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id
        )
        return hf.eval()

    # ----- transformers hooks ------------------------------------------------------------------------------------
    def _init_weights(self, module: torch.nn.Module) -> None:
        """PrismLM initialises itself; weights come from ``from_pretrained``/``from_prism``."""

    @classmethod
    def register_for_auto_class(cls, auto_class: str | type = "AutoModel") -> None:
        """A no-op, as ``PrismConfig.register_for_auto_class``."""

    def get_input_embeddings(self) -> torch.nn.Module:
        backbone = self.prism.transformer  # the built-in GPT's, or a transformers base model
        get = getattr(backbone, "get_input_embeddings", None)
        emb = get() if callable(get) else backbone.wte
        assert isinstance(emb, torch.nn.Module)
        return emb

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.prism.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        *,
        cache: Cache | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs: object,  # what generate() adds (position_ids is checked, the rest unused)
    ) -> PrismCausalLMOutput | tuple:
        """input_ids (B, T) (or ``inputs_embeds`` (B, T, d)) → logits (B, T, V) (the last ``logits_to_keep``
        positions when > 0).

        ``cache``/``past_key_values``: a transformers ``Cache`` holding the P earlier tokens; input_ids are
        then the T tokens after them (P + T <= block_size). ``use_cache`` (default ``config.use_cache``)
        creates one when none is given and returns it. ``labels`` (B, T): mean next-token cross-entropy
        (shifted inside, -100 ignored). ``attention_mask`` (B, P + T) 0/1: padding on either side; positions
        are counted over the real tokens (cumsum − 1) and padding is never attended to, so a left-padded row
        gives the logits of the unpadded one (``position_ids``, if given, must be those positions).
        ``output_hidden_states``: n_layer + 1 tensors (B, T, d), the
        embedding output and each block's output, the last one after the final norm (the z that
        ``lm_head`` reads, as in transformers' GPT-2 and Llama). ``output_attentions``: n_layer tensors
        (B, n_head, T, P + T), computed with eager attention for that call."""
        cache = self._step_cache(cache if cache is not None else past_key_values, use_cache)
        _check_position_ids(
            cast("torch.Tensor | None", kwargs.pop("position_ids", None)),
            attention_mask,
            cache.get_seq_length() if cache is not None else 0,
        )
        last_only = logits_to_keep == 1
        out = self._run_prism(
            input_ids, cache, attention_mask, inputs_embeds, last_only, output_hidden_states, output_attentions
        )
        logits = out.logits
        if logits_to_keep and not last_only:
            logits = logits[:, -logits_to_keep:, :]
        loss = None if labels is None else _next_token_loss(out.logits, labels, every_position=not logits_to_keep)
        result = PrismCausalLMOutput(
            loss=loss,
            logits=logits,
            prototype_indices=out.indices,
            prototype_activations=out.activations,
            residual=out.residual,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            **{_CACHE_FIELD: cache},
        )
        use_dict = return_dict if return_dict is not None else self.config.return_dict
        return result if use_dict else result.to_tuple()

    def _run_prism(
        self,
        input_ids: torch.LongTensor | None,
        cache: Cache | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        last_only: bool,
        output_hidden_states: bool | None,
        output_attentions: bool | None,
    ) -> PrismOutput:
        """The wrapped model's forward under the baked-in interventions; the output flags default to the config's."""
        want_hidden = bool(self.config.output_hidden_states if output_hidden_states is None else output_hidden_states)
        want_attn = bool(self.config.output_attentions if output_attentions is None else output_attentions)
        with self.baked_in():
            return self.prism(
                input_ids,
                last_only=last_only,
                cache=cache,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_hidden_states=want_hidden,
                output_attentions=want_attn,
            )

    def _step_cache(self, cache: Cache | None, use_cache: bool | None) -> Cache | None:
        """The cache ``forward`` runs with: the given one, a new ``DynamicCache`` when ``use_cache`` (default
        ``config.use_cache``) and none is given, or None when caching is off."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if not use_cache:
            return None
        if cache is None:
            from transformers import DynamicCache

            try:
                cache = DynamicCache(config=self.config)
            except TypeError:  # releases whose DynamicCache takes no config
                cache = DynamicCache()
        return cache

    @contextmanager
    def baked_in(self) -> Iterator[PrismLM]:
        """``with model.baked_in() as prism:`` the wrapped ``PrismLM`` with the config's suppression set or
        multipliers and residual projection applied (what ``forward`` runs under)."""
        m = self.prototype_multipliers
        with self.prism.scale_prototypes(m) if m is not None else nullcontext(self.prism) as prism:
            ids, mode = self._projected
            with prism.project_residual(ids, mode) if ids else nullcontext(prism):
                yield prism

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        past_key_values: Cache | None = None,
        **kwargs: object,  # generate()'s model kwargs, passed on to forward
    ) -> dict[str, object]:
        """What the next generation step runs: the tokens the cache has not seen, or — once the sequence is
        longer than block_size (or without a cache) — the last block_size tokens, uncached (a stale cache
        is left unused, as in ``PrismLM.generate_steps``). ``attention_mask`` (B, L) covers the whole
        sequence; a window step gets its last block_size columns (positions restart from the window's first
        real token, as the unpadded window's do)."""
        if inputs_embeds is not None:
            raise ModelError(
                "PRISM models generate from input_ids, not inputs_embeds",
                fix="call generate(input_ids=...); inputs_embeds is accepted by forward()",
            )
        cache = cache if cache is not None else past_key_values
        bs = self.prism.config.block_size
        L = input_ids.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        mask = attention_mask
        if cache is not None and L <= bs and past < L:
            feed, step_cache = input_ids[:, past:], cache
        else:
            feed, step_cache = input_ids[:, -bs:], None
            mask = attention_mask[:, -bs:] if attention_mask is not None else None
        inputs: dict[str, object] = {"input_ids": feed.contiguous(), "attention_mask": mask, _CACHE_FIELD: step_cache}
        skip = {"labels", "position_ids", "token_type_ids", "cache_position", "next_sequence_length"}
        for k, v in kwargs.items():
            if k not in skip and k not in inputs:
                inputs[k] = v
        if step_cache is None:
            inputs["use_cache"] = False  # a window step: nothing to append to, nothing to return
        return inputs


def fast_tokenizer(backend: BackendTokenizer, eot_token: str, *, max_length: int) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer over (a copy of) a ``tokenizers.Tokenizer`` whose end-of-text token is
    its eos, bos and pad token (GPT-2's convention; an empty context starts from it, as prismlm's scoring
    does), padding on the left (batched generation continues every row from its last real token)."""
    from tokenizers import Tokenizer as BackendTokenizer

    # a copy: the transformers wrapper may change the backend's padding/truncation settings
    return PreTrainedTokenizerFast(
        tokenizer_object=BackendTokenizer.from_str(backend.to_str()),
        eos_token=eot_token,
        bos_token=eot_token,
        pad_token=eot_token,
        model_max_length=max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def register() -> None:
    """Teach ``AutoConfig`` and ``AutoModelForCausalLM`` the ``prism`` model type (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, PrismConfig, exist_ok=True)
    AutoModelForCausalLM.register(PrismConfig, PrismForCausalLM, exist_ok=True)


# Importing this module imports transformers; when that import is the first one, the hook of
# ``prismlm.integrations.hf_auto`` fires while this module is half executed and leaves the registration to here.
register()
