"""A key/value cache for incremental decoding with ``PrismLM`` (``model(idx, cache=cache)``).

Each layer appends the keys and values (B, n_head, T, head_dim) of the tokens just processed, so a decode
step runs only the new tokens. ``update``/``get_seq_length`` follow transformers' ``Cache`` API, so a
``DynamicCache`` works too (``CacheLike``). Invariant: after a forward every layer holds the same number
of positions, ``get_seq_length()``. See docs/architecture.md (KV cache).
"""

from __future__ import annotations

from typing import Protocol

import torch

from prismlm.errors import ModelError

__all__ = ["CacheLike", "KVCache"]


class CacheLike(Protocol):
    """What ``PrismLM`` needs from a cache: our ``KVCache`` or a transformers ``DynamicCache``."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def batch_repeat_interleave(self, repeats: int) -> None: ...


class KVCache:
    """Per-layer keys and values of every token processed so far.

    ``cache = KVCache(); model(prompt, cache=cache); model(next_token, cache=cache)`` — the second call
    sees the prompt through the cache. A cache belongs to one sequence batch: reuse it only with the
    same batch rows, and start a new one (or ``reset()``) for a new prompt.

    Storage: each layer's keys and values live in a buffer (B, n_head, capacity, head_dim) that doubles
    when full, and ``update`` writes only the new positions. Why not ``torch.cat`` per call (as
    transformers' ``DynamicCache`` does): that copies the whole cache at every decode step — O(T) bytes per
    layer and step, at cpu-small about as much memory traffic as the layer's weights. The returned
    keys/values are views of the first T positions of the buffer; later updates write past them, so
    a view once returned never changes.
    """

    def __init__(self) -> None:
        self._keys: list[torch.Tensor] = []
        """_keys[l]: (B, n_head, capacity, head_dim) buffer of layer l; positions ≥ length are unused."""
        self._values: list[torch.Tensor] = []
        """_values[l]: (B, n_head, capacity, head_dim), as _keys."""
        self._lengths: list[int] = []
        """_lengths[l]: positions of layer l filled so far."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` (B, n_head, T_new, head_dim) to layer ``layer_idx`` and
        return that layer's full keys and values (B, n_head, T_past + T_new, head_dim).

        Layers are filled in order by the first call (layer 0, 1, …), as the model's forward does."""
        if key_states.shape != value_states.shape or key_states.dim() != 4:
            raise ModelError(
                f"keys and values must both be (B, n_head, T, head_dim), got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if layer_idx == len(self._keys):
            B, H, _, D = key_states.shape
            empty = key_states.new_empty((B, H, 0, D))
            self._keys.append(empty)
            self._values.append(empty)
            self._lengths.append(0)
        elif not 0 <= layer_idx < len(self._keys):
            raise ModelError(
                f"cache update for layer {layer_idx}, but only layers 0–{len(self._keys) - 1} "
                f"are filled: layers must be updated in order"
            )
        past, new = self._lengths[layer_idx], key_states.shape[2]
        end = past + new
        buf_k, buf_v = self._keys[layer_idx], self._values[layer_idx]
        if buf_k.shape[:2] != key_states.shape[:2] or buf_k.shape[3] != key_states.shape[3]:
            raise ModelError(
                f"layer {layer_idx} caches (B, n_head, ·, head_dim) = {tuple(buf_k.shape)}, "
                f"got keys {tuple(key_states.shape)}"
            )
        if end > buf_k.shape[2]:  # grow: double (amortised O(1) copies per position), at least 64 positions
            cap = max(end, 2 * buf_k.shape[2], 64)
            B, H, _, D = key_states.shape
            grown_k = key_states.new_empty((B, H, cap, D))
            grown_v = value_states.new_empty((B, H, cap, D))
            grown_k[:, :, :past] = buf_k[:, :, :past]
            grown_v[:, :, :past] = buf_v[:, :, :past]
            self._keys[layer_idx], self._values[layer_idx] = buf_k, buf_v = grown_k, grown_v
        buf_k[:, :, past:end] = key_states
        buf_v[:, :, past:end] = value_states
        self._lengths[layer_idx] = end
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions of layer ``layer_idx`` (0 when it holds nothing yet)."""
        return self._lengths[layer_idx] if layer_idx < len(self._lengths) else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times in place (as transformers' caches do): one prompt's keys
        and values shared by ``repeats`` continuations scored as one batch."""
        for layer, n in enumerate(self._lengths):
            self._keys[layer] = self._keys[layer][:, :, :n].repeat_interleave(repeats, dim=0)
            self._values[layer] = self._values[layer][:, :, :n].repeat_interleave(repeats, dim=0)

    def reset(self) -> None:
        """Drop every cached key and value (start a new sequence)."""
        self._keys.clear()
        self._values.clear()
        self._lengths.clear()

    def __len__(self) -> int:
        """Number of layers holding keys and values (as ``len()`` of a transformers cache)."""
        return len(self._keys)
