"""The PRISM prototype layer (spec §1.2–1.5): cosine → top-k → ReLU, reconstruction, residual.

Shapes: N tokens (B·T flattened), width d, K prototypes, k active per token. Invariant: the N × K cosine
matrix is computed once per forward, in chunks of ``chunk_size`` tokens and without autograd; gradients flow
through the k selected cosines and ẑ = Σ a_i p_i (``_SparseHead``, CSR products), so peak extra memory is
chunk_size × K, never N × K with a graph attached. See docs/modules.md.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from prismlm.config import PrototypeConfig

_ARGMAX_BLOCK = 2**20
"""Entries per row block of the CPU column-argmax pass in ``PrototypeLayer.select`` (bounds its temporaries)."""

CHUNK_ENTRIES_CAP = {"cpu": 2**22, "cuda": 2**28}
"""Most entries of one (chunk × K) similarity block by device type (others: the CPU value). Why these: on
CPU a block that stays in cache is as fast or faster than a large one (measured at d=128, N=2,048, one
thread: K=16,384 takes 177 ms in chunks of 256 rows, 190 ms in chunks of 4,096 — 16× the memory); on a GPU
fewer, larger blocks mean fewer kernel launches, up to 1 GiB of float32."""
CHUNK_MEMORY_SHARE = 8
"""A similarity block uses at most 1/8 of the memory available when the layer first runs on a device."""
_MIN_CHUNK = 64


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: CUDA's free memory, else the host's MemAvailable
    (``/proc/meminfo``; free pages where it is missing)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


_AVAILABLE: dict[str, int] = {}


def auto_chunk_size(n_tokens: int, num_prototypes: int, device: torch.device, element_bytes: int = 4) -> int:
    """Tokens per similarity block when ``PrototypeConfig.chunk_size`` is ``None``: the largest chunk whose
    (chunk × K) block fits both the device's entry cap (``CHUNK_ENTRIES_CAP``) and 1/``CHUNK_MEMORY_SHARE``
    of the memory available when first asked on that device (read once per process and device: a reading
    per forward would cost a driver call each step). At least 64 rows, at most ``n_tokens``."""
    key = str(device)
    if key not in _AVAILABLE:
        _AVAILABLE[key] = available_memory(device)
    cap = CHUNK_ENTRIES_CAP.get(device.type, CHUNK_ENTRIES_CAP["cpu"])
    entries = min(cap, _AVAILABLE[key] // (CHUNK_MEMORY_SHARE * element_bytes))
    return max(1, min(n_tokens, max(_MIN_CHUNK, entries // max(1, num_prototypes))))


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

    def chunk_size_for(self, n_tokens: int, device: torch.device, element_bytes: int = 4) -> int:
        """Tokens per similarity block: ``cfg.chunk_size``, or chosen from available memory when it is None."""
        if self.cfg.chunk_size is not None:
            return self.cfg.chunk_size
        return auto_chunk_size(n_tokens, self.num_prototypes, device, element_bytes)

    @torch.no_grad()
    def select(self, z_unit: torch.Tensor, p_unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k prototypes per token and the best token per prototype, chunked over tokens.

        z_unit: (N, d) and p_unit: (K, d), both L2-normalised. Returns indices (N, k), their cosines (N, k)
        (the top-k values of the similarity rows, by decreasing cosine) and proto_argmax (K,).
        This is the single place the N × K similarity matrix exists (one chunk at a time).

        The best token of each prototype is the *first* maximiser (as ``max(dim=0)`` returns it), found as
        ``amax`` over the chunk and then the smallest row index attaining it: a column ``max(dim=0)`` with
        indices is a strided scan ~3× slower than ``amax`` + this on CPU; the result is identical, ties
        included. Off CPU the fused ``max(dim=0)`` is used directly.
        """
        n, k = z_unit.shape[0], self.cfg.top_k
        dev = z_unit.device
        indices = torch.empty(n, k, dtype=torch.long, device=dev)
        values = torch.empty(n, k, dtype=z_unit.dtype, device=dev)
        best_val = torch.full((p_unit.shape[0],), -2.0, device=dev, dtype=z_unit.dtype)
        best_arg = torch.zeros(p_unit.shape[0], dtype=torch.long, device=dev)
        step = self.chunk_size_for(n, dev, z_unit.element_size())
        # rank[r] = m - r: the largest rank marks the first row; int16 (when it fits) keeps the masked copy at
        # half the chunk's size. Off CPU, max(dim=0) is one fused kernel with no extra memory: used as is.
        m = min(step, n)
        fused_argmax = dev.type != "cpu"
        sub = max(1, _ARGMAX_BLOCK // max(1, p_unit.shape[0]))
        rank = torch.arange(m, 0, -1, device=dev, dtype=torch.int16 if m < 2**15 else torch.int32)[:, None]
        for start in range(0, n, step):  # loop over chunks of tokens, not tokens
            sim = z_unit[start : start + step] @ p_unit.T  # (n_chunk, K)
            top = sim.topk(k, dim=-1)
            indices[start : start + step] = top.indices
            values[start : start + step] = top.values
            if fused_argmax:
                col_val, col_arg = sim.max(dim=0)  # (K,) best token of this chunk per prototype
            else:
                col_val = sim.amax(dim=0)  # (K,) best cosine of this chunk per prototype
                # largest rank among the rows attaining it, over row blocks of ~2^20 entries (bounded temporaries)
                top_rank = torch.zeros_like(rank[0].expand(sim.shape[1]))
                for r0 in range(0, sim.shape[0], sub):
                    hit = sim[r0 : r0 + sub] == col_val  # (rows, K)
                    top_rank = torch.maximum(top_rank, torch.where(hit, rank[r0 : r0 + hit.shape[0]], 0).amax(dim=0))
                col_arg = (m - top_rank).long()  # the first row attaining the column max
            better = col_val > best_val
            best_val = torch.where(better, col_val, best_val)
            best_arg = torch.where(better, col_arg + start, best_arg)
        return indices, values, best_arg

    def forward(self, z: torch.Tensor) -> PrototypeOutput:
        """z: (N, d) hidden states (the backbone's final LayerNorm output)."""
        # Autocast off inside the layer: under bf16 autocast the similarity matmul and the einsums would run
        # in bf16 even on float32 inputs, changing which prototypes are selected (measured: 4 of 96 tokens)
        # and breaking the z = ẑ + r identity at ~1e-3. Selection, cosines and the decomposition are float32.
        with torch.autocast(device_type=z.device.type, enabled=False):
            return self._forward(z)

    def _forward(self, z: torch.Tensor) -> PrototypeOutput:
        p = self.weight  # (K, d)
        # bf16/fp16 inputs are lifted to float32; float64 stays float64 (exactness tests). ``.to`` of a
        # tensor already in ``dt`` returns it (no copy).
        dt = torch.promote_types(z.dtype, torch.float32)
        z32, p32 = z.to(dt), p.to(dt)
        z_unit = F.normalize(z32, dim=-1)  # (N, d)
        p_norm = p32.norm(dim=-1).clamp_min(1e-12)  # (K,)
        p_unit = p32 / p_norm[:, None]  # (K, d)
        indices, cos_sel, proto_argmax = self.select(z_unit.detach(), p_unit.detach())
        # cos_nk = ⟨z_unit_n, p_i⟩ / ‖p_i‖ (i = indices_nk) and ẑ_n = Σ_k relu(cos_nk) p_i, with the cosine
        # values taken from the similarity pass and the gradients formed by sparse products (_SparseHead).
        cos, reconstruction = _SparseHead.apply(z_unit, p32, p_norm, cos_sel, indices)  # (N, k), (N, d)
        activations = F.relu(cos)  # (N, k)
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


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A CSR matrix (column indices sorted and unique within each row, by construction of the callers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        return torch.sparse_csr_tensor(crow, col, values, shape, device=values.device, check_invariants=False)


class _Pattern:
    """The sparsity pattern S (N × K, k nonzeros per row: S_ni ≠ 0 iff i ∈ indices_n) in the two layouts the
    products need: row-major (tokens → prototypes) and its transpose (prototypes → tokens). Values are kept
    in the caller's (N, k) order; ``rows``/``cols`` permute them into each layout's storage order."""

    def __init__(self, indices: torch.Tensor, num_prototypes: int):
        n, k = indices.shape
        self.n, self.k, self.K = n, k, num_prototypes
        self.indices = indices
        self.sparse = indices.device.type in ("cpu", "cuda")  # elsewhere: gather / index_add fallback
        if not self.sparse:
            return
        col, self.row_perm = indices.sort(dim=1)  # CSR wants sorted column indices within a row
        self.col = col.reshape(-1)
        self.crow = torch.arange(0, n * k + 1, k, device=indices.device)
        flat = indices.reshape(-1)
        self.t_perm = flat.argsort(stable=True)  # (N·k,) grouped by prototype, tokens ascending within one
        self.t_col = torch.div(self.t_perm, k, rounding_mode="floor")  # token of each entry
        counts = torch.bincount(flat, minlength=num_prototypes)
        self.t_crow = torch.zeros(num_prototypes + 1, dtype=torch.long, device=indices.device)
        self.t_crow[1:] = counts.cumsum(0)

    def rows(self, v: torch.Tensor) -> torch.Tensor:
        return v.gather(1, self.row_perm).reshape(-1)

    def mm(self, v: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """(S with values v (N, k)) @ dense (K, d) → (N, d): out_n = Σ_j v_nj dense_{indices_nj}."""
        if not self.sparse:
            return torch.einsum("nk,nkd->nd", v, dense[self.indices])
        return _csr(self.crow, self.col, self.rows(v), (self.n, self.K)) @ dense

    def t_mm(self, v: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """(S with values v (N, k))ᵀ @ dense (N, d) → (K, d): out_i = Σ_{n,j: indices_nj = i} v_nj dense_n."""
        if not self.sparse:
            src = (v[:, :, None] * dense[:, None, :]).reshape(-1, dense.shape[1])
            return dense.new_zeros(self.K, dense.shape[1]).index_add_(0, self.indices.reshape(-1), src)
        vt = v.reshape(-1)[self.t_perm]
        return _csr(self.t_crow, self.t_col, vt, (self.K, self.n)) @ dense

    def sampled(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(N, k): ⟨a_n, b_{indices_nj}⟩ for a (N, d), b (K, d), without gathering (N, k, d)."""
        if not self.sparse:
            return torch.einsum("nd,nkd->nk", a, b[self.indices])
        pattern = _csr(self.crow, self.col, a.new_zeros(self.n * self.k), (self.n, self.K))
        vals = torch.sparse.sampled_addmm(pattern, a, b.T, beta=0.0).values().view(self.n, self.k)
        return torch.empty_like(vals).scatter_(1, self.row_perm, vals)  # back to the (N, k) order


class _HeadContext(FunctionCtx):
    """What ``_SparseHead.forward`` keeps for its backward: the selection pattern and four saved tensors (torch
    sets ``saved_tensors`` and ``needs_input_grad``; this class only names their types)."""

    pattern: _Pattern
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]


class _SparseHead(torch.autograd.Function):
    """cos_nj = ⟨z_unit_n, p_i⟩ / ‖p_i‖ and ẑ_n = Σ_j relu(cos_nj) p_i (i = indices_nj), as functions of
    (z_unit, p, ‖p‖), with the gradient of the same expression written out. Nothing of size (N, k, d)
    is formed: every contraction is a product with the sparse N × K selection pattern.

    Forward: the cosine values are the selection pass's top-k similarities (⟨z_unit, p_unit⟩, equal to
    ⟨z_unit, p⟩/‖p‖ up to float rounding). Backward, with g_c = ∂L/∂cos + [cos > 0]·⟨∂L/∂ẑ_n, p_i⟩
    and w = g_c/‖p_i‖:
        ∂L/∂z_unit_n = Σ_j w_nj p_i                 (S_w @ P)
        ∂L/∂p_i      = Σ_{n,j→i} w_nj z_unit_n + relu(cos_nj) ∂L/∂ẑ_n   (S_wᵀ @ Z + S_aᵀ @ Ĝ)
        ∂L/∂‖p_i‖    = −Σ_{n,j→i} g_c cos_nj / ‖p_i‖
    the exact derivatives of the previous autograd formulation (gather + einsum), summed in another order.
    """

    @staticmethod
    def forward(
        ctx: _HeadContext,
        z_unit: torch.Tensor,
        p: torch.Tensor,
        p_norm: torch.Tensor,
        cos: torch.Tensor,
        indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pattern = _Pattern(indices, p.shape[0])
        act = F.relu(cos)
        reconstruction = pattern.mm(act, p)  # (N, d)
        ctx.pattern = pattern
        ctx.save_for_backward(z_unit, p, p_norm, cos)
        return cos.clone(), reconstruction

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _HeadContext, g_cos: torch.Tensor | None, g_rec: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        z_unit, p, p_norm, cos = ctx.saved_tensors
        pattern: _Pattern = ctx.pattern
        g_c = g_cos if g_cos is not None else torch.zeros_like(cos)
        if g_rec is not None:
            g_c = g_c + torch.where(cos > 0, pattern.sampled(g_rec, p), 0.0)
        inv = p_norm.reciprocal()
        w = g_c * inv[pattern.indices]  # (N, k)
        gz = pattern.mm(w, p) if ctx.needs_input_grad[0] else None
        gp = gpn = None
        if ctx.needs_input_grad[1]:
            gp = pattern.t_mm(w, z_unit)
            if g_rec is not None:
                gp = gp + pattern.t_mm(F.relu(cos), g_rec)
        if ctx.needs_input_grad[2]:
            gpn = -torch.zeros_like(p_norm).index_add_(0, pattern.indices.reshape(-1), (g_c * cos).reshape(-1)) * inv
        return gz, gp, gpn, None, None


SEED_EXACT_MAX, SEED_ROUNDS = 2048, 256
"""k-means++ draws one prototype per round up to SEED_EXACT_MAX prototypes (the exact algorithm, float64), and
above it K // SEED_ROUNDS per round (float32): each round is then one (N × b) product instead of b (N,) updates.
Why: exact k-means++ is K sequential passes over the N × d sample — 8,192 prototypes over 41k SmolLM2 states took
~5 minutes on 2 cores, the batched draw seconds."""
_SCALE_BLOCK = 2**27
"""Most (N × K) cosine entries the scale fit forms at once (1 GiB of float64); larger ones go by row blocks."""


@torch.no_grad()
def seed_prototypes(
    hidden: torch.Tensor, num_prototypes: int, top_k: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Prototypes anchored to real data from step 0: k-means++ seeding in cosine distance over sampled final
    hidden states, then one scale fitted so the layer's k-sparse reconstruction matches z on the sample.

    hidden: (N, d) hidden states z of real training tokens, N >= num_prototypes. Returns (K, d): each row is
    s · z_j for a chosen token j (a real context, up to one shared scale s). Why a scale: with a_i = cos ≤ 1
    and k active prototypes, raw z_j would over-reconstruct about k-fold; s = ⟨z, ẑ⟩ / ⟨ẑ, ẑ⟩ over the sample
    is the least-squares fix and leaves every direction (hence every selection) unchanged. Large banks draw
    several prototypes per round from the same D² distribution (``SEED_EXACT_MAX``).
    """
    n, _ = hidden.shape
    if n < num_prototypes:
        raise ValueError(f"need at least {num_prototypes} hidden states to seed {num_prototypes} prototypes, got {n}")
    x = hidden.double()
    unit = F.normalize(x, dim=-1)  # (N, d)
    per_round = 1 if num_prototypes <= SEED_EXACT_MAX else num_prototypes // SEED_ROUNDS
    chosen = _kmeanspp(unit if per_round == 1 else unit.float(), num_prototypes, per_round, generator)
    protos = x[chosen]  # (K, d)
    p_unit = F.normalize(protos, dim=-1)  # (K, d)
    num = den = torch.zeros((), dtype=x.dtype)
    step = max(1, _SCALE_BLOCK // num_prototypes)
    for start in range(0, n, step):  # row blocks of the (N, K) cosines: one block below 2^27 entries
        cos = unit[start : start + step] @ p_unit.T  # (n_b, K)
        top = cos.topk(min(top_k, num_prototypes), dim=-1)
        recon = torch.einsum("nk,nkd->nd", F.relu(top.values), protos[top.indices])  # (n_b, d)
        num, den = num + (x[start : start + step] * recon).sum(), den + (recon * recon).sum()
    scale = num / den.clamp_min(1e-30)
    return (scale * protos).to(hidden.dtype)


def _kmeanspp(unit: torch.Tensor, k: int, per_round: int, generator: torch.Generator | None) -> torch.Tensor:
    """(k,) row ids of ``unit`` (N, d) drawn by k-means++ in cosine distance, ``per_round`` at a time (1: the
    exact sequential algorithm: each pick drawn given all previous ones)."""
    n = unit.shape[0]
    chosen = torch.empty(k, dtype=torch.long)
    chosen[0] = torch.randint(n, (1,), generator=generator)
    dist = (1.0 - unit @ unit[chosen[0]]).clamp_min(0.0)  # (N,) cosine distance to the nearest pick so far
    free = torch.ones(n, dtype=torch.bool)  # rows not chosen yet (the batched draw excludes the others)
    free[chosen[0]] = False
    i = 1
    while i < k:  # rounds of picks, each an (N,) or (N, b) update — never a loop over tokens
        if per_round == 1:
            total = dist.sum()
            weights = dist / total if total > 0 else torch.full_like(dist, 1.0 / n)
            pick = torch.multinomial(weights, 1, generator=generator)
        else:  # b distinct rows from D² (rows already chosen are excluded)
            weights = torch.where(free, dist.double().clamp_min(1e-12), 0.0)
            pick = torch.multinomial(weights, min(per_round, k - i), replacement=False, generator=generator)
        chosen[i : i + len(pick)] = pick
        free[pick] = False
        dist = torch.minimum(dist, (1.0 - unit @ unit[pick].T).clamp_min(0.0).amin(dim=1))
        i += len(pick)
    return chosen
