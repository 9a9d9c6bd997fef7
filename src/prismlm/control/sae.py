"""TopK sparse autoencoder on the dense baseline's final hidden states — the controller baseline (spec §4).

Same budget as PRISM: K latents, exactly k active per token, ``f = TopK_k(ReLU(W_enc (z − b_dec) +
b_enc))``, ``ẑ = W_dec f + b_dec``, with the AuxK loss against dead latents and unit-norm decoder rows.
The controller acts on ``z + Σ c_j f_j W_dec[:, j]`` as PRISM's acts on prototypes. Details and the
measured AuxK weight: docs/architecture.md (controllers), docs/results.md (Controllers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from prismlm.errors import ConfigError

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM


class TopKSAE(nn.Module):
    def __init__(self, d: int, num_latents: int, k: int):
        super().__init__()
        if not 1 <= k <= num_latents:
            raise ConfigError(f"k must be in [1, num_latents={num_latents}], got {k}")
        self.k = k
        self.W_enc = nn.Parameter(torch.randn(num_latents, d) / d**0.5)  # (K, d)
        self.b_enc = nn.Parameter(torch.zeros(num_latents))
        self.W_dec = nn.Parameter(self.W_enc.detach().clone())  # (K, d): rows are directions
        self.b_dec = nn.Parameter(torch.zeros(d))
        self.normalize_decoder()

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec.div_(self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-8))

    @property
    def directions(self) -> torch.Tensor:
        return self.W_dec  # (K, d)

    def encode(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z (N, d) → (indices (N, k), activations (N, k) ≥ 0)."""
        pre = F.relu(F.linear(z - self.b_dec, self.W_enc, self.b_enc))  # (N, K)
        act, idx = pre.topk(self.k, dim=-1)
        return idx, act

    def decode(self, idx: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """(indices (N, k), activations (N, k)) → Σ_j f_j W_dec[j] (N, d), without b_dec."""
        return torch.einsum("nk,nkd->nd", act, self.W_dec[idx])

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        idx, act = self.encode(z)
        return self.decode(idx, act) + self.b_dec  # (N, d)

    def aux_loss(self, z: torch.Tensor, recon: torch.Tensor, dead: torch.Tensor, aux_k: int) -> torch.Tensor:
        """AuxK: mean squared error of reconstructing the error z − ẑ (N, d) with the top-``aux_k`` of the
        ``dead`` (K,) latents (0 when no latent is dead)."""
        n_dead = int(dead.sum())
        if n_dead == 0:
            return z.new_zeros(())
        err = (z - recon).detach()
        pre = F.relu(F.linear(z - self.b_dec, self.W_enc, self.b_enc)).masked_fill(~dead, 0.0)  # (N, K)
        act, idx = pre.topk(min(aux_k, n_dead), dim=-1)
        return F.mse_loss(self.decode(idx, act), err)


@dataclass
class SAEResult:
    sae: TopKSAE
    """The trained autoencoder."""
    fvu: float
    """Fraction of variance unexplained on held-out hidden states (lower is better)."""
    dead_fraction: float
    """Share of the K latents never active on the held-out hidden states."""
    steps: int
    """Optimizer steps run."""


def train_sae(
    model: PrismLM,
    shards: ShardSet,
    *,
    num_latents: int,
    k: int,
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    max_sequences: int | None = None,
    aux_k: int | None = None,
    aux_weight: float = 1.0,
    dead_steps: int = 50,
    eval_sequences: int = 64,
) -> SAEResult:
    """Fit a TopK SAE on the final hidden states of the (frozen) dense ``model`` over ``shards.train``
    (MSE + AuxK; ``aux_k`` defaults to d/2 as in Gao et al.). The dead fraction is measured on
    ``eval_sequences`` validation sequences."""
    T = model.config.block_size
    n_seq = shards.train.num_sequences(T)
    if max_sequences:
        n_seq = min(n_seq, max_sequences)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    sae = TopKSAE(model.config.n_embd, num_latents, k)
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    dev = next(model.parameters()).device
    sae.to(dev)

    @torch.no_grad()
    def hidden(ids: torch.Tensor) -> torch.Tensor:
        x = torch.from_numpy(shards.train.sequences(ids.numpy(), T)).to(dev)[:, :-1]
        return model.backbone(x).reshape(-1, model.config.n_embd).float()

    with torch.no_grad():  # start b_dec at the mean (standard)
        sae.b_dec.copy_(hidden(torch.randint(0, n_seq, (batch_size,), generator=g)).mean(0))
    aux_k = aux_k or max(1, model.config.n_embd // 2)
    since_fired = torch.zeros(num_latents, dtype=torch.long, device=dev)  # steps since each latent fired
    for _ in range(steps):
        z = hidden(torch.randint(0, n_seq, (batch_size,), generator=g))
        idx, act = sae.encode(z)
        recon = sae.decode(idx, act) + sae.b_dec
        fired = torch.zeros(num_latents, dtype=torch.bool, device=dev)
        fired[idx[act > 0]] = True
        since_fired = torch.where(fired, 0, since_fired + 1)
        loss = F.mse_loss(recon, z) + aux_weight * sae.aux_loss(z, recon, since_fired > dead_steps, aux_k)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sae.normalize_decoder()
    with torch.no_grad():
        vz = torch.from_numpy(
            shards.val.sequences(torch.arange(min(eval_sequences, shards.val.num_sequences(T))).numpy(), T)
        )
        z = model.backbone(vz.to(dev)[:, :-1]).reshape(-1, model.config.n_embd).float()
        fvu = float(((sae(z) - z) ** 2).sum() / ((z - z.mean(0)) ** 2).sum())
        idx, act = sae.encode(z)
        used = torch.zeros(num_latents, dtype=torch.bool, device=dev)
        used[idx[act > 0]] = True
    return SAEResult(sae=sae.eval(), fvu=fvu, dead_fraction=float((~used).float().mean()), steps=steps)
