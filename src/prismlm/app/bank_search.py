"""Token search over the prototype bank: which prototypes have to do with a token (the explorer's map
search "as a token"), with tables built once per opened run (``TokenSearch``).

A prototype matches a token when the token is among the ``signature_top`` largest entries of its
signature W p_i, or occurs (as the target or the token before it) in one of its nearest training
contexts; matches are ordered by contexts holding the token, then by signature rank. Why, and what the
tables cost: docs/attribution.md ("Token search over the bank").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import DataError
from prismlm.explain import PrototypeIndex
from prismlm.model import PrismLM

__all__ = ["TokenMatch", "TokenSearch"]

_BLOCK_ELEMS = 1 << 22
"""Entries of one (prototypes × V) signature block: 16 MiB in float32."""


@dataclass(frozen=True)
class TokenMatch:
    id: int
    contexts: int
    """Nearest contexts (of ``of_contexts``) holding the token as target or as the token before it."""
    of_contexts: int
    signature_rank: int | None
    """0-based rank of the token in W p_i (None: not among the top ``signature_top``)."""
    token: int
    """The token (of the query's variants) that matched."""

    def why(self, token_str: str) -> str:
        parts = []
        if self.contexts:
            parts.append(f"{token_str!r} in {self.contexts} of its {self.of_contexts} nearest contexts")
        if self.signature_rank is not None:
            parts.append(f"pushes {token_str!r} (rank {self.signature_rank + 1} of W p_i)")
        return "; ".join(parts)


class TokenSearch:
    """The tables of one model (and index), built on first use, then kept; thread-safe."""

    def __init__(
        self, model: PrismLM, tokenizer: Tokenizer, index: PrototypeIndex | None, signature_top: int = 20
    ) -> None:
        self.model, self.tokenizer, self.index, self.m = model, tokenizer, index, signature_top
        self.valid = min(tokenizer.vocab_size, model.config.vocab_size)
        self._lock = threading.Lock()
        self._sig: torch.Tensor | None = None
        self._ctx: torch.Tensor | None = None
        self._ctx_done = False

    @torch.no_grad()
    def _signature_table(self) -> torch.Tensor:
        """(K, m) int64: every prototype's m top signature tokens, by decreasing (W p_i)_v (built once)."""
        with self._lock:
            if self._sig is None:
                K = self.model.require_prototypes().num_prototypes
                V = self.model.lm_head.weight.shape[0]
                rows = max(1, _BLOCK_ELEMS // V)
                m = min(self.m, self.valid)
                dev = self.model.lm_head.weight.device
                tops = [
                    self.model.signatures(torch.arange(s, min(K, s + rows), device=dev))[:, : self.valid]
                    .float()
                    .topk(m, dim=-1)
                    .indices.cpu()
                    for s in range(0, K, rows)
                ]
                self._sig = torch.cat(tops)
            return self._sig

    def _context_table(self) -> torch.Tensor | None:
        with self._lock:
            if self._ctx is None and not self._ctx_done:
                self._ctx, self._ctx_done = self._context_tokens(), True
            return self._ctx

    def _context_tokens(self) -> torch.Tensor | None:
        """(K, N, 2) int64: the last context token and the target of every nearest context (−1: empty)."""
        idx = self.index
        if idx is None or idx.shards is None:
            return None
        toks = idx.shards.train.tokens
        off = idx.top_offset.numpy()  # (K, N): global offset of the context's last token, -1 empty
        ok = (off >= 0) & (off + 1 < len(toks))
        pos = np.where(ok, off, 0)
        pair = np.stack([np.asarray(toks[pos], dtype=np.int64), np.asarray(toks[pos + 1], dtype=np.int64)], -1)
        pair[~ok] = -1
        return torch.from_numpy(pair)

    def hits(self, token: str, *, strict: bool = True, signature: bool = True) -> list[tuple[int, str]]:
        """(prototype id, why) of every match of ``token`` as typed and with a leading space ("President"
        also finds " President"): of those variants that are one token; when none is, ``DataError``
        (``strict``) or no hits. ``signature=False``: by the nearest contexts only (no K × V table)."""
        tok = self.tokenizer
        variants = [token] + ([" " + token] if not token.startswith(" ") else []) if token else []
        ids = [t[0] for v in variants if len(t := tok.encode(v)) == 1]
        if not ids and not strict:
            return []
        if not ids:
            raise DataError(
                f"token {token!r} is {len(tok.encode(token))} tokens; give a single token (e.g. with its "
                f"leading space: ' the')"
            )
        return [(h.id, h.why(tok.id_to_token(h.token))) for h in self.find(ids, signature=signature)]

    def find(self, token_ids: Sequence[int], *, signature: bool = True) -> list[TokenMatch]:
        """Every prototype matching any of ``token_ids`` (variants of one query), best first;
        ``signature=False``: by the nearest contexts only."""
        K = self.model.require_prototypes().num_prototypes
        t = torch.tensor(list(token_ids), dtype=torch.long)
        sig = self._signature_table() if signature else torch.zeros(K, 1, dtype=torch.long)
        in_sig = torch.isin(sig, t) & signature  # (K, m)
        has_sig = in_sig.any(-1)
        m = sig.shape[1]
        rank = torch.where(has_sig, in_sig.float().argmax(-1), torch.full((K,), m))  # first (best) hit
        sig_tok = sig.gather(1, rank.clamp(max=m - 1)[:, None]).squeeze(1)
        ctx = self._context_table()
        if ctx is not None:
            in_ctx = torch.isin(ctx, t)  # (K, N, 2)
            count = in_ctx.any(-1).sum(-1)  # (K,)
            ctx_tok = torch.where(in_ctx[..., 1], ctx[..., 1], ctx[..., 0])  # (K, N)
            ctx_tok = ctx_tok.gather(1, in_ctx.any(-1).float().argmax(-1, keepdim=True)).squeeze(1)
            n_ctx = (ctx[..., 1] >= 0).sum(-1)
        else:
            count = torch.zeros(K, dtype=torch.long)
            ctx_tok = sig_tok
            n_ctx = count
        hit = has_sig | (count > 0)
        ids = hit.nonzero().squeeze(1)
        # best first: most contexts, then best signature rank, then id (a total order: deterministic)
        key = torch.stack([-count[ids], rank[ids], ids], 1).tolist()
        order = [int(row[2]) for row in sorted(key)]
        return [
            TokenMatch(
                id=i,
                contexts=int(count[i]),
                of_contexts=int(n_ctx[i]),
                signature_rank=int(rank[i]) if bool(has_sig[i]) else None,
                token=int(ctx_tok[i] if count[i] > 0 else sig_tok[i]),
            )
            for i in order
        ]
