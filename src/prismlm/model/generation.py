"""Autoregressive generation for ``PrismLM``: the ``Sampling`` settings and the decode loop.

``PrismLM.generate`` / ``generate_steps`` delegate here. Invariant: with or without the KV cache, and past
the context window, the same tokens come out at the same ``Sampling`` (the window slides exactly as a
fresh forward over the last ``block_size`` tokens would see it). See ``decode_steps``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from prismlm.config import ModelConfig
from prismlm.errors import ConfigError, ModelError
from prismlm.model.kv_cache import CacheLike
from prismlm.model.outputs import PrismOutput

__all__ = [
    "GREEDY",
    "TEXT_SAMPLING",
    "Decoder",
    "Sampling",
    "TextCodec",
    "decode_steps",
    "generate",
    "generate_steps",
    "generate_text",
    "resolve_sampling",
    "sample_next",
]


class TextCodec(Protocol):
    """What ``PrismLM.generate`` needs to take text: prismlm's ``Tokenizer`` satisfies it."""

    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Decoder(Protocol):
    """What the decode loop needs of a model: ``PrismLM`` satisfies it (this module does not import it)."""

    config: ModelConfig
    lm_head: nn.Linear
    tokenizer: TextCodec | None

    def new_cache(self) -> CacheLike: ...

    def decode_step(self, feed: torch.Tensor, cache: CacheLike | None, last_only: bool) -> PrismOutput: ...


@dataclass(frozen=True)
class Sampling:
    """How each next token is drawn from the logits (B, V) of the last position. Checked when made
    (``ConfigError`` naming the field)."""

    temperature: float = 1.0
    """Sampling temperature: the logits are divided by it before the softmax; 0 is greedy (argmax)."""
    top_tokens: int | None = None
    """Sample only among the N most likely tokens (None: the whole vocabulary)."""
    seed: int | None = None
    """Seed of the sampling generator (None: torch's global generator, as ``torch.multinomial`` uses)."""

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"`temperature` must be a finite number >= 0, got {t!r}", param="temperature")
        k = self.top_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise ConfigError(
                f"`top_tokens` must be >= 1 (or None for the whole vocabulary), got {k!r}", param="top_tokens"
            )
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or not -(2**63) <= s < 2**64):
            # the range torch.Generator.manual_seed accepts
            raise ConfigError(f"`seed` must be an integer in [-2^63, 2^64), got {s!r}", param="seed")

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """A generator on ``device`` seeded with ``seed``, or None (the global generator) without one."""
        return None if self.seed is None else torch.Generator(device=device).manual_seed(int(self.seed))

    def describe(self) -> str:
        """``temperature 0.8, top_tokens 50, seed 0``: how a sample was drawn, for notes."""
        return f"temperature {self.temperature}, top_tokens {self.top_tokens}, seed {self.seed}"


TEXT_SAMPLING = Sampling(temperature=0.8, top_tokens=50, seed=0)
"""What the CLI and the explorer sample free text with (``generate``, Steer) unless told otherwise."""

GREEDY = Sampling(temperature=0.0, top_tokens=None, seed=0)
"""What an explanation generates with unless told otherwise (``explain_text``, the explorer's Explain, chat
answers): the model's most probable token at every step, so the same question gets the same answer."""


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) float32 → next tokens (B, 1): argmax at temperature 0, else sampling among the
    ``top_tokens`` most likely tokens."""
    if sampling.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / sampling.temperature
    if sampling.top_tokens is not None:
        v, _ = torch.topk(logits, min(sampling.top_tokens, logits.size(-1)))  # (B, top_tokens)
        logits[logits < v[:, [-1]]] = -float("inf")
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)


@torch.inference_mode()
def decode_steps(
    model: Decoder,
    idx: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    prefill_logits: bool = False,
) -> Iterator[tuple[PrismOutput, torch.Tensor]]:
    """The decode loop of ``generate_steps``, yielding inference tensors ``(out, next_tokens (B, 1))``.

    Why inference mode rather than no_grad: a cached step is a few hundred small kernels, and skipping
    autograd's version counters and view tracking makes it faster (docs/results.md). ``generator``: None
    uses ``sampling.generator``. Past block_size the cache is dropped and every step recomputes the window
    (learned absolute positions: once the window slides, every cached key and value changes).
    """
    gen = generator if generator is not None else sampling.generator(idx.device)
    bs = model.config.block_size
    cache = model.new_cache() if use_cache else None
    feed = idx[:, -bs:]  # (B, ≤ bs): what the next forward runs; the first runs the whole cropped prompt
    for step in range(max_new_tokens):
        if cache is not None and cache.get_seq_length() + feed.shape[1] > bs:
            cache = None  # the window slides from here on (see the docstring)
        if cache is None:
            feed = idx[:, -bs:]  # (B, ≤ bs)
        out = model.decode_step(feed, cache, last_only=not (prefill_logits and step == 0))
        nxt = sample_next(out.logits[:, -1, :].float(), sampling, gen)  # (B, 1)
        # idx keeps the whole sequence: the window is rebuilt from it once the cache is dropped.
        idx = torch.cat([idx, nxt], dim=1)  # (B, T + step + 1)
        feed = nxt  # with the cache only the new token runs next
        yield out, nxt


def generate(
    model: Decoder,
    idx: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Token ids idx (B, T) → (B, T + max_new_tokens): ``PrismLM.generate`` for tensors."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
        raise ModelError(
            f"generate takes token ids (B, T) as a tensor, or a text, got {type(idx).__name__}",
            fix="model.generate(torch.tensor([tokenizer.encode(text)]), n)",
        )
    out = [idx]
    for _, nxt in decode_steps(model, idx, max_new_tokens, sampling, generator=generator, use_cache=use_cache):
        out.append(nxt)  # (B, 1) inference tensors
    return torch.cat(out, dim=1)  # outside inference mode: an ordinary tensor


def generate_text(
    model: Decoder,
    text: str,
    max_new_tokens: int,
    sampling: Sampling,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> str:
    """``generate`` of a text through the model's attached tokenizer: the text plus its continuation."""
    tok = model.tokenizer
    if tok is None:
        raise ModelError(
            "PrismLM.generate got a text, but no tokenizer is attached to this model",
            fix="pass token ids: model.generate(torch.tensor([tok.encode(text)]), n) with the "
            "run's tokenizer (Run.open(RUN).tokenizer), or attach it: model.tokenizer = tok",
        )
    ids = tok.encode(text) or [tok.eot_id]  # (T,)
    x = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)  # (1, T)
    y = generate(model, x, max_new_tokens, sampling, generator=generator, use_cache=use_cache)  # (1, T + n)
    return text + tok.decode(y[0, len(ids) :].tolist())


def generate_steps(
    model: Decoder,
    idx: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    *,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    prefill_logits: bool = False,
) -> Iterator[tuple[PrismOutput, torch.Tensor]]:
    """``decode_steps`` with every yielded tensor an ordinary one (``PrismLM.generate_steps``)."""
    for out, nxt in decode_steps(
        model,
        idx,
        max_new_tokens,
        sampling,
        generator=generator,
        use_cache=use_cache,
        prefill_logits=prefill_logits,
    ):
        # the steps run in inference mode; a clone made outside it is an ordinary tensor, which callers
        # may modify in place or feed to autograd
        yield _ordinary(out), nxt.clone()


def _ordinary(out: PrismOutput) -> PrismOutput:
    """``out`` with every inference tensor replaced by an ordinary clone (call outside inference mode)."""
    changes: dict[str, Any] = {}  # Any: each value is a clone of its own field, whose type differs per field
    for f in fields(out):
        v = getattr(out, f.name)
        if isinstance(v, torch.Tensor) and v.is_inference():
            changes[f.name] = v.clone()
    return replace(out, **changes)


def resolve_sampling(
    sampling: Sampling | None, temperature: float | None, top_tokens: int | None, *, default: Sampling
) -> Sampling:
    """The ``Sampling`` of a call that also gives the shortcuts ``temperature=`` / ``top_tokens=``: they
    override ``sampling`` (or ``default``); each value is checked by ``Sampling``."""
    out = sampling if sampling is not None else default
    if temperature is not None:
        out = replace(out, temperature=temperature)
    if top_tokens is not None:
        out = replace(out, top_tokens=top_tokens)
    return out
