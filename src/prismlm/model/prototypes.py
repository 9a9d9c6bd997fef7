"""The PRISM prototype layer (spec §1.2–1.5): cosine → top-k → ReLU, reconstruction, residual.

Shapes: N tokens (N = B·T flattened), width d, K prototypes, k active per token.

Memory: the N × K cosine matrix is the only thing of that size, computed once per forward in chunks of
``chunk_size`` tokens *without* autograd (selection is a discrete choice). Everything that needs a
gradient is recomputed on the selected pairs only: the k cosines per token (N × k × d gather), the best
token of each prototype (K × d) for R1, and the best prototype of each token (the top-1 of the top-k)
for R2. So peak extra memory is chunk_size × K + N × k × d, never N × K with a graph attached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from prismlm.config import PrototypeConfig


@dataclass
class PrototypeOutput:
    """What the prototype layer computes for N flattened tokens."""

    indices: torch.Tensor
    """(N, k) int64: the top-k prototypes of each token, by decreasing cosine."""
    activations: torch.Tensor
    """(N, k): a = relu(cos(z, p_i)) for the selected prototypes (≥ 0; 0 when the cosine is ≤ 0)."""
    reconstruction: torch.Tensor
    """(N, d): ẑ = Σ_i a_i p_i."""
    residual: torch.Tensor
    """(N, d): r = z − ẑ, so z = ẑ + r exactly."""
    token_max_cos: torch.Tensor
    """(N,): max_i cos(z_t, p_i) — the R2 / coverage quantity (carries gradient)."""
    proto_max_cos: torch.Tensor
    """(K,): max_t cos(p_i, z_t) over the N tokens of this call — the R1 / R̄1 quantity (carries gradient)."""
    proto_argmax: torch.Tensor
    """(K,) int64: the token index achieving proto_max_cos (into the N flattened tokens)."""


class PrototypeLayer(nn.Module):
    """A bank of K learned prototypes P ∈ R^{K×d} (rows are prototypes; the spec's P is its transpose)."""

    def __init__(self, d: int, cfg: PrototypeConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.randn(cfg.num_prototypes, d) * cfg.init_std)  # (K, d)

    @property
    def num_prototypes(self) -> int:
        return self.weight.shape[0]

    @torch.no_grad()
    def select(self, z_unit: torch.Tensor, p_unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k prototypes per token and the best token per prototype, chunked over tokens.

        z_unit: (N, d) and p_unit: (K, d), both L2-normalised. Returns indices (N, k) and proto_argmax (K,).
        This is the single place the N × K similarity matrix exists (one chunk at a time).
        """
        n, k = z_unit.shape[0], self.cfg.top_k
        indices = torch.empty(n, k, dtype=torch.long, device=z_unit.device)
        best_val = torch.full((p_unit.shape[0],), -2.0, device=z_unit.device, dtype=z_unit.dtype)
        best_arg = torch.zeros(p_unit.shape[0], dtype=torch.long, device=z_unit.device)
        step = self.cfg.chunk_size
        for start in range(0, n, step):  # loop over chunks of tokens, not tokens
            sim = z_unit[start:start + step] @ p_unit.T  # (n_chunk, K)
            indices[start:start + step] = sim.topk(k, dim=-1).indices
            col_val, col_arg = sim.max(dim=0)  # (K,) best token of this chunk per prototype
            col_val = col_val.to(best_val.dtype)
            better = col_val > best_val
            best_val = torch.where(better, col_val, best_val)
            best_arg = torch.where(better, col_arg + start, best_arg)
        return indices, best_arg

    def forward(self, z: torch.Tensor) -> PrototypeOutput:
        """z: (N, d) hidden states (the backbone's final LayerNorm output)."""
        # Autocast off inside the layer: under bf16 autocast the similarity matmul and the einsums would run
        # in bf16 even on float32 inputs, changing which prototypes are selected (measured: 4 of 96 tokens)
        # and breaking the z = ẑ + r identity at ~1e-3. Selection, cosines and the decomposition are float32.
        with torch.autocast(device_type=z.device.type, enabled=False):
            return self._forward(z)

    def _forward(self, z: torch.Tensor) -> PrototypeOutput:
        p = self.weight  # (K, d)
        # bf16/fp16 inputs are lifted to float32; float64 stays float64 (exactness tests).
        dt = torch.promote_types(z.dtype, torch.float32)
        z32, p32 = z.to(dt), p.to(dt)
        z_unit = F.normalize(z32, dim=-1)  # (N, d)
        p_norm = p32.norm(dim=-1).clamp_min(1e-12)  # (K,)
        p_unit = p32 / p_norm[:, None]  # (K, d)
        indices, proto_argmax = self.select(z_unit.detach(), p_unit.detach())
        p_sel = p32[indices]  # (N, k, d) — the only gather of prototypes
        cos = torch.einsum("nd,nkd->nk", z_unit, p_sel) / p_norm[indices]  # (N, k)
        activations = F.relu(cos)  # (N, k)
        reconstruction = torch.einsum("nk,nkd->nd", activations, p_sel)  # (N, d)
        residual = z32 - reconstruction  # (N, d)
        proto_max_cos = (p_unit * z_unit[proto_argmax]).sum(-1)  # (K,)
        return PrototypeOutput(
            indices=indices,
            activations=activations,
            reconstruction=reconstruction,
            residual=residual,
            token_max_cos=cos[:, 0],  # top-1 of the top-k is the argmax over all K
            proto_max_cos=proto_max_cos,
            proto_argmax=proto_argmax,
        )


@torch.no_grad()
def seed_prototypes(hidden: torch.Tensor, num_prototypes: int, top_k: int, *,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Prototypes anchored to real data from step 0: k-means++ seeding in cosine distance over sampled final
    hidden states, then one scale fitted so the layer's k-sparse reconstruction matches z on the sample.

    hidden: (N, d) hidden states z of real training tokens, N >= num_prototypes. Returns (K, d): each row is
    s · z_j for a chosen token j (a real context, up to one shared scale s). Why a scale: with a_i = cos ≤ 1
    and k active prototypes, raw z_j would over-reconstruct about k-fold; s = ⟨z, ẑ⟩ / ⟨ẑ, ẑ⟩ over the sample
    is the least-squares fix and leaves every direction (hence every selection) unchanged.
    """
    n, _ = hidden.shape
    if n < num_prototypes:
        raise ValueError(f"need at least {num_prototypes} hidden states to seed {num_prototypes} prototypes, got {n}")
    x = hidden.double()
    unit = F.normalize(x, dim=-1)  # (N, d)
    chosen = torch.empty(num_prototypes, dtype=torch.long)
    chosen[0] = torch.randint(n, (1,), generator=generator)
    dist = (1.0 - unit @ unit[chosen[0]]).clamp_min(0.0)  # (N,) cosine distance to the nearest pick so far
    # k-means++ is sequential by definition (each pick is drawn given all previous ones): K iterations of an
    # (N,) vector update, never a loop over tokens.
    for i in range(1, num_prototypes):
        total = dist.sum()
        weights = dist / total if total > 0 else torch.full_like(dist, 1.0 / n)
        chosen[i] = torch.multinomial(weights, 1, generator=generator)
        dist = torch.minimum(dist, (1.0 - unit @ unit[chosen[i]]).clamp_min(0.0))
    protos = x[chosen]  # (K, d)
    p_unit = F.normalize(protos, dim=-1)  # (K, d)
    cos = unit @ p_unit.T  # (N, K)
    top = cos.topk(min(top_k, num_prototypes), dim=-1)
    recon = torch.einsum("nk,nkd->nd", F.relu(top.values), protos[top.indices])  # (N, d)
    scale = (x * recon).sum() / (recon * recon).sum().clamp_min(1e-30)
    return (scale * protos).to(hidden.dtype)
