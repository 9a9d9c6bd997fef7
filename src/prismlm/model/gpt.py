"""GPT decoder with an optional PRISM prototype head — one model class for PRISM and the dense baseline.

Module names follow GPT-2 (``wte``, ``wpe``, ``h.N.attn.c_attn``, ``c_proj``, ``ln_f``, ``lm_head``) so
GPT-2 checkpoints map 1:1. Every projection is a plain ``nn.Linear`` called as a module: whole-network
influence libraries (kronfluence) only track exact ``nn.Linear`` modules.

Logits are ``lm_head(z)`` for both models. For PRISM, ``z = ẑ + r`` exactly, so by linearity
``ℓ = W r + Σ_i a_i (W p_i)``: every logit is k prototype slices plus one residual slice (spec §1.5);
``prismlm.model.decompose`` computes those slices from the same forward output.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from prismlm.config import ModelConfig
from prismlm.errors import ModelError
from prismlm.model import losses as L
from prismlm.model.interventions import Intervention, Suppress, check_ids, combined_multipliers
from prismlm.model.prototypes import PrototypeLayer


@dataclass
class PrismOutput:
    """The one structured forward output that training, attribution, control, evaluation and the
    explorer all read. Prototype fields are ``None`` for the dense baseline."""

    logits: torch.Tensor
    """(B, T, V) next-token logits (or (B, 1, V) with ``last_only``); inside ``model.suppress(...)`` /
    ``model.control(...)`` these are the suppressed/controlled logits (there is no second output)."""
    hidden: torch.Tensor
    """(B, T, d) z: final-LayerNorm hidden states."""
    indices: torch.Tensor | None = None
    """(B, T, k) int64 top-k prototype ids per token."""
    activations: torch.Tensor | None = None
    """(B, T, k) non-negative activations of those prototypes."""
    residual: torch.Tensor | None = None
    """(B, T, d) r = z − Σ a_i p_i."""
    token_max_cos: torch.Tensor | None = None
    """(B, T) max_i cos(z_t, p_i): how well each token is covered by its nearest prototype."""
    proto_max_cos: torch.Tensor | None = None
    """(K,) max over this batch's tokens of cos(p_i, z_t): how close each prototype is to real data."""
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Unweighted loss terms: ``ce`` (when targets are given), and ``rec``, ``r1``, ``r2`` for PRISM."""
    loss: torch.Tensor | None = None
    """Weighted total loss (when targets and loss weights are given)."""
    prototype_multipliers: torch.Tensor | None = None
    """(K,) the multipliers m the logits were computed with (suppression: 0, controller: 1 + c), or None
    for the unmodified model; ``decompose`` scales the slices by them, so it stays exact."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
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
    """GPT backbone + prototype head. ``PrismLM(cfg)`` with ``cfg.prototypes=None`` is the dense baseline."""

    prototypes: PrototypeLayer | None
    proto_multipliers: torch.Tensor | None  # a non-persistent buffer, see __init__

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = Backbone(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 scaled init of residual projections: keeps the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        # Created last so that, at the same seed, PRISM and the dense baseline start from the same backbone.
        self.prototypes = PrototypeLayer(cfg.n_embd, cfg.prototypes) if cfg.prototypes is not None else None
        # Per-prototype logit multipliers m (K,) used by suppression (m_i = 0) and controllers (m_i = 1 + c_i);
        # None is the unmodified model. Non-persistent: never saved in model.safetensors (suppression sets
        # and controllers are their own artifacts), and it follows .to(device). Set it through
        # ``prismlm.control`` (``with model.suppress(ids):`` / ``with model.control(c):``), which restores it.
        self.register_buffer("proto_multipliers", None, persistent=False)

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

    def backbone(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 → z (B, T, d), the final-LayerNorm hidden states."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ModelError(f"sequence length {T} exceeds the context window block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, d)
        for block in self.transformer.h:
            x = block(x)  # (B, T, d)
        return self.transformer.ln_f(x)  # (B, T, d)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        loss_weights: dict[str, float] | None = None,
        last_only: bool = False,
    ) -> PrismOutput:
        """idx (B, T); targets (B, T) or None. ``loss_weights`` (see ``LossConfig.weights_at``) sets the
        weighted total; ``last_only`` computes logits for the last position only (generation)."""
        z = self.backbone(idx)  # (B, T, d)
        B, T, d = z.shape
        out_z = z[:, -1:, :] if last_only else z
        mult = self.proto_multipliers
        # Unmodified model: logits straight from z (ℓ = W z = W r + Σ a_i W p_i since z = ẑ + r). Why lm_head
        # runs before the prototype layer: the order fixes how autograd sums the two gradients into z, and
        # keeping it keeps training bit-for-bit reproducible across versions (a reordering moved losses by 1e-8).
        logits = self.lm_head(out_z) if mult is None or self.prototypes is None else None  # (B, T, V)
        po = self.prototypes(z.reshape(B * T, d)) if self.prototypes is not None else None
        if logits is None:
            assert po is not None and mult is not None
            # ℓ' = W r + Σ_i m_i a_i W p_i = W (z + Σ_i (m_i − 1) a_i p_i): the slices of prototypes with
            # m_i = 1 are untouched, a suppressed one (m_i = 0) is removed exactly (spec §4).
            a = po.activations * (mult[po.indices].to(po.activations.dtype) - 1.0)  # (N, k)
            delta = torch.einsum("nk,nkd->nd", a, self.require_prototypes().weight[po.indices].to(a.dtype))  # (N, d)
            z_mod = (z.reshape(B * T, d).to(delta.dtype) + delta).to(z.dtype).view(B, T, d)
            logits = self.lm_head(z_mod[:, -1:, :] if last_only else z_mod)  # (B, T, V)
        out = PrismOutput(logits=logits, hidden=z)
        if po is not None:
            k = po.indices.shape[-1]
            out.indices = po.indices.view(B, T, k)
            out.activations = po.activations.view(B, T, k)
            if mult is not None:
                out.prototype_multipliers = mult
            out.residual = po.residual.view(B, T, d)
            out.token_max_cos = po.token_max_cos.view(B, T)
            out.proto_max_cos = po.proto_max_cos
            if targets is not None:
                out.losses["rec"] = L.reconstruction_loss(po.residual, z.reshape(B * T, d))
                out.losses["r1"] = L.r1_loss(po.proto_max_cos)
                out.losses["r2"] = L.r2_loss(po.token_max_cos)
        if targets is not None:
            out.losses["ce"] = L.cross_entropy(logits, targets if not last_only else targets[:, -1:])
            out.loss = L.total_loss(out.losses, loss_weights or {"ce": 1.0})
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
        return self.scale_prototypes(m.to(self.prototypes.weight.dtype))

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
        return self.lm_head(p)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of idx (B, T); returns (B, T + max_new_tokens).

        ``temperature=0`` is greedy decoding. The context is cropped to the last block_size tokens.
        """
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size:]
            logits = self(ctx, last_only=True).logits[:, -1, :].float()  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


@dataclass
class LogitDecomposition:
    """The exact additive decomposition of selected logits (spec §1.5)."""

    prototype_slices: torch.Tensor
    """(B, T, k): a_{t,i} (W p_i)_y for each active prototype i of token t and chosen token y."""
    residual_slice: torch.Tensor
    """(B, T): (W r_t)_y."""
    logit: torch.Tensor
    """(B, T): ℓ_{t,y} from the forward pass; equals slices.sum(-1) + residual_slice to float tolerance."""


def decompose(model: PrismLM, out: PrismOutput, tokens: torch.Tensor) -> LogitDecomposition:
    """Split the logit of ``tokens`` (B, T) at every position into prototype slices plus a residual slice."""
    if out.indices is None or out.activations is None or out.residual is None:
        raise ModelError("decompose needs a PRISM forward output (the dense baseline has no prototypes)")
    W = model.lm_head.weight  # (V, d)
    w_y = W[tokens].to(out.residual.dtype)  # (B, T, d): the output row of each chosen token
    p_sel = model.require_prototypes().weight[out.indices].to(out.residual.dtype)  # (B, T, k, d)
    proto_slices = out.activations * torch.einsum("btkd,btd->btk", p_sel, w_y)  # (B, T, k)
    residual_slice = (out.residual * w_y).sum(-1)  # (B, T)
    if out.prototype_multipliers is not None:  # suppressed/controlled forward: slices scaled by m_i, as there
        proto_slices = proto_slices * out.prototype_multipliers[out.indices].to(proto_slices.dtype)
    logit = out.logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return LogitDecomposition(prototype_slices=proto_slices, residual_slice=residual_slice, logit=logit)
