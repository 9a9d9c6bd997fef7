"""Influence in prototype space with localised curvature (spec §3.2): the block Gauss–Newton curvature
(``Curvature``, ``curvature_pass``), the exact scores ``I(q, j) = Σ_{i ∈ A_q ∩ A_j} G_{q,i}ᵀ H_i⁻¹ G_{j,i}``
and the full-gradient reference (``FullGradients``).

Invariant: positive = helpful (a gradient step on the training sequence lowers the query's loss), as in
kronfluence; scores are sums over tokens. The block-diagonal curvature is an approximation chosen by
attribution quality; the derivation, the damping and what the reconstruction term did:
docs/attribution.md ("Influence and curvature").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from safetensors.torch import load_file

from prismlm.artifacts import save_tensors
from prismlm.errors import ConfigError, ModelError
from prismlm.model import eval_mode
from prismlm.progress import Progress, Reporter
from prismlm.tda.gradients import BlockGradients, block_gradients, precondition, query_table, softmax_products

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM, PrismOutput

BatchGuard = Callable[[], AbstractContextManager[object]]
"""What each batch of a pass over the training shard runs inside (``contextlib.nullcontext`` by default): a
server passes its model lock, so that a pass of minutes holds the model one batch at a time and other
requests run between batches."""

__all__ = [
    "BatchGuard",
    "Curvature",
    "CurvatureAccumulator",
    "FullGradients",
    "batch_grid",
    "collect_gradients",
    "forward_batch",
    "curvature_pass",
    "influence_scores",
    "query_gradients",
    "self_influence",
]


# ----- curvature ----------------------------------------------------------------------------------------
class CurvatureAccumulator:
    """Streaming sums for F = E[Wᵀ Σ_t W], m_i = E[a_i²], e_i = E[a_i² / ‖z‖²] and (``exact=True``)
    E[a_i² Wᵀ Σ_t W]."""

    def __init__(self, model: PrismLM, exact: bool = False, chunk: int = 1024, block_rows: int | None = None):
        net = model
        if net.prototypes is None:
            raise ModelError("prototype-space curvature needs a PRISM model (the dense baseline has no prototypes)")
        self.K, self.d = net.prototypes.num_prototypes, net.config.n_embd
        self.W = net.lm_head.weight.detach().double()  # (V, d)
        V, dev = self.W.shape[0], self.W.device
        self.sum_pi = torch.zeros(V, dtype=torch.float64, device=dev)
        self.sum_mumu = torch.zeros(self.d, self.d, dtype=torch.float64, device=dev)
        self.sum_a2 = torch.zeros(self.K, dtype=torch.float64, device=dev)
        self.sum_a2_z2 = torch.zeros(self.K, dtype=torch.float64, device=dev)  # Σ_t a_{t,i}² / ‖z_t‖²
        self.exact, self.chunk = exact, chunk
        self.block_rows = block_rows
        """Tokens softmaxed at once in the shared mode (default: ``SOFTMAX_BLOCK`` logits, the blocks of
        ``output_gradients``, so that the μ it returns is that function's, bit for bit)."""
        if exact:
            self.blk_pi = torch.zeros(self.K, V, dtype=torch.float64, device=dev)  # Σ_t a² π_t
            self.blk_mumu = torch.zeros(self.K, self.d * self.d, dtype=torch.float64, device=dev)  # Σ_t a² μμᵀ
        self.tokens = 0

    @torch.no_grad()
    def update(self, out: PrismOutput) -> torch.Tensor | None:
        """Add a batch's statistics; returns μ_t = Wᵀπ_t (B·T, d) of its tokens in the shared mode (the
        product ``softmax_products`` made for the sums: what ``output_gradients`` would compute, bit for bit,
        with the default ``block_rows``), None in the exact mode (float64 blocks)."""
        assert out.activations is not None and out.indices is not None, "a PRISM model's output"
        B, T, V = out.logits.shape
        N = B * T
        logits = out.logits.detach().reshape(N, V)
        a2 = out.activations.detach().double().reshape(N, -1) ** 2  # (N, k)
        idx = out.indices.reshape(N, -1)  # (N, k)
        self.sum_a2.index_add_(0, idx.reshape(-1), a2.reshape(-1))
        z2 = out.hidden.detach().double().reshape(N, -1).pow(2).sum(-1).clamp_min(1e-8)  # (N,) as REC clamps
        self.sum_a2_z2.index_add_(0, idx.reshape(-1), (a2 / z2[:, None]).reshape(-1))
        # π_t and μ_t = Wᵀπ_t a block of tokens at a time (never an (N, V) float64 copy of the logits): in the
        # logits' precision (float32 for a float32 model; float64 for the exact blocks or a float64 model),
        # the sums in float64 — F's damping (10% of its trace) dwarfs float32 rounding
        dt = torch.float64 if self.exact else torch.promote_types(logits.dtype, torch.float32)
        W = self.W.to(dt)
        if not self.exact:

            def add(pi: torch.Tensor, mu: torch.Tensor) -> None:
                self.sum_pi += pi.sum(0, dtype=torch.float64)
                mu64 = mu.double()
                self.sum_mumu += mu64.T @ mu64

            mu_all = softmax_products(logits, W, self.block_rows, add)
            self.tokens += N
            return mu_all
        for s in range(0, N, self.chunk):  # exact: the per-prototype sums too (chunks bound the n × d² products)
            pi = torch.softmax(logits[s : s + self.chunk].to(dt), dim=-1)  # (n, V)
            mu = pi @ W  # (n, d): Wᵀ π_t
            self.sum_pi += pi.sum(0, dtype=torch.float64)
            self.sum_mumu += mu.T @ mu
            n = pi.shape[0]
            ii, a2c = idx[s : s + n].reshape(-1), a2[s : s + n].reshape(-1)
            tok = torch.arange(n, device=idx.device)[:, None].expand(n, idx.shape[1]).reshape(-1)
            A = torch.sparse_coo_tensor(torch.stack([ii, tok]), a2c, (self.K, n), check_invariants=False)  # a²
            self.blk_pi += torch.sparse.mm(A, pi)
            self.blk_mumu += torch.sparse.mm(A, (mu[:, :, None] * mu[:, None, :]).reshape(n, -1))
        self.tokens += N
        return None

    def finish(self, damping: float = 0.1, reconstruction: float = 0.0) -> Curvature:
        """``reconstruction``: the weight λ_rec of the REC term whose diagonal blocks are added
        (``2 λ_rec E[a_i²/‖z‖²] I``); 0 leaves the CE Gauss–Newton alone."""
        n = max(1, self.tokens)
        Fm = (self.W.T * (self.sum_pi / n)) @ self.W - self.sum_mumu / n  # (d, d)
        Fm = 0.5 * (Fm + Fm.T)
        blocks = None
        if self.exact:
            blocks = torch.einsum("vd,kv,ve->kde", self.W, self.blk_pi / n, self.W)
            blocks = blocks - (self.blk_mumu / n).view(self.K, self.d, self.d)
            blocks = 0.5 * (blocks + blocks.transpose(1, 2))
        return Curvature.from_stats(
            Fm,
            self.sum_a2 / n,
            self.tokens,
            damping=damping,
            blocks=blocks,
            rec=2.0 * reconstruction * self.sum_a2_z2 / n,
            reconstruction=reconstruction,
        )


@dataclass
class Curvature:
    """Block curvature H_i (see the module docstring) with its eigendecomposition, ready to apply H_i^{-s}."""

    F: torch.Tensor
    """(d, d) float64: E_t[Wᵀ Σ_t W]."""
    m: torch.Tensor
    """(K,) float64: m_i = E_t[a_{t,i}²]."""
    tokens: int
    """Tokens the statistics were averaged over."""
    damping: float = 0.1
    """ρ: λ_i = ρ · tr(H_i^GN)/d."""
    blocks: torch.Tensor | None = None
    """(K, d, d) float64 exact diagonal blocks E_t[a_{t,i}² Wᵀ Σ_t W] (``mode="exact"``), else None."""
    rec: torch.Tensor | None = None
    """(K,) float64 c_i = 2 λ_rec E_t[a_{t,i}²/‖z_t‖²]: the reconstruction term's diagonal block c_i I, added
    to H_i (None or zeros: CE curvature only)."""
    reconstruction: float = 0.0
    """λ_rec the ``rec`` term was computed with (recorded; 0 = not included)."""
    evals: torch.Tensor = field(init=False, repr=False)
    """(d,) or (K, d): eigenvalues of the damped curvature per unit m̃ (shared) or per block (exact)."""
    evecs: torch.Tensor = field(init=False, repr=False)
    """(d, d) or (K, d, d)."""
    m_eff: torch.Tensor = field(init=False, repr=False)
    """(K,) m̃_i = max(m_i, 1/tokens): the activation weight a never-active prototype is damped with."""

    @property
    def mode(self) -> Literal["shared", "exact"]:
        return "shared" if self.blocks is None else "exact"

    def __post_init__(self) -> None:
        d = self.F.shape[0]
        self.m_eff = self.m.clamp_min(1.0 / max(1, self.tokens))
        if self.blocks is None:
            lam, Q = torch.linalg.eigh(self.F)
            fbar = float(torch.diagonal(self.F).sum()) / d
            self.evals, self.evecs = lam.clamp_min(0) + self.damping * fbar, Q  # H_i = m̃_i Q diag(evals) Qᵀ
        else:
            lam, Q = torch.linalg.eigh(self.blocks)  # (K, d), (K, d, d)
            tr = torch.diagonal(self.blocks, dim1=1, dim2=2).sum(1) / d  # (K,)
            # a block never seen in the statistics falls back to the shared form with weight m̃_i
            unseen = self.m <= 0
            if bool(unseen.any()):
                lf, Qf = torch.linalg.eigh(self.F)
                lam[unseen] = self.m_eff[unseen, None] * lf.clamp_min(0)[None]
                Q[unseen] = Qf
                tr[unseen] = self.m_eff[unseen] * torch.diagonal(self.F).sum() / d
            self.evals, self.evecs = lam.clamp_min(0) + self.damping * tr[:, None], Q

    @classmethod
    def from_stats(
        cls,
        F: torch.Tensor,
        m: torch.Tensor,
        tokens: int,
        *,
        damping: float = 0.1,
        blocks: torch.Tensor | None = None,
        rec: torch.Tensor | None = None,
        reconstruction: float = 0.0,
    ) -> Curvature:
        if rec is not None and reconstruction == 0.0:
            rec = None
        return cls(F=F, m=m, tokens=tokens, damping=damping, blocks=blocks, rec=rec, reconstruction=reconstruction)

    def eigen(self, proto: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eigenvalues (R, d) of H_i for each row's prototype, and per-row eigenvectors (exact mode) or None."""
        proto = proto.to(self.evals.device)
        c = 0.0 if self.rec is None else self.rec.to(self.evals.device)[proto, None]
        if self.blocks is None:
            return self.m_eff[proto, None] * self.evals[None, :] + c, None
        return self.evals[proto] + c, self.evecs[proto]

    def apply(
        self, proto: torch.Tensor, G: torch.Tensor, power: float = -1.0, chunk: int | None = None
    ) -> torch.Tensor:
        """H_i^{power} G_i for each row (power −1: the preconditioned gradient; −½: the whitened one)."""
        dt, dev = G.dtype, G.device
        d = G.shape[1]
        chunk = chunk or (4096 if self.blocks is None else max(1, (1 << 24) // (d * d)))  # ≤ 16M gathered entries
        Gd = G.double().to(self.evals.device)
        outs = []
        for s in range(0, Gd.shape[0], chunk):
            lam, Q = self.eigen(proto[s : s + chunk])
            g = Gd[s : s + chunk]
            if Q is None:
                c = (g @ self.evecs) * lam.pow(power)  # (R, d) in the eigenbasis
                outs.append(c @ self.evecs.T)
            else:
                c = torch.einsum("rd,rde->re", g, Q) * lam.pow(power)
                outs.append(torch.einsum("re,rde->rd", c, Q))
        out = torch.cat(outs) if outs else Gd.new_zeros(0, G.shape[1])
        return out.to(dev, dt)

    def dense(self, i: int) -> torch.Tensor:
        """H_i as a d × d matrix (for tests and diagnostics)."""
        lam, Q = self.eigen(torch.tensor([i]))
        Q = self.evecs if Q is None else Q[0]
        return (Q * lam[0]) @ Q.T

    # ----- persistence ----------------------------------------------------------------------------------
    def save(self, path: str | Path, extra: dict[str, str] | None = None) -> None:
        t = {"F": self.F.cpu().contiguous(), "m": self.m.cpu().contiguous()}
        if self.blocks is not None:
            t["blocks"] = self.blocks.cpu().contiguous()
        if self.rec is not None:
            t["rec"] = self.rec.cpu().contiguous()
        save_tensors(  # sorted metadata: identical builds give identical bytes
            t,
            path,
            {
                "tokens": str(self.tokens),
                "damping": repr(self.damping),
                "reconstruction": repr(self.reconstruction),
                **(extra or {}),
            },
        )

    @classmethod
    def load(cls, path: str | Path) -> Curvature:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        t = load_file(str(path))
        return cls(
            F=t["F"],
            m=t["m"],
            tokens=int(meta["tokens"]),
            damping=float(meta["damping"]),
            blocks=t.get("blocks"),
            rec=t.get("rec"),
            reconstruction=float(meta.get("reconstruction", 0.0)),
        )


# ----- passes over the training shard -------------------------------------------------------------------
def batch_grid(start: int, stop: int, batch_size: int) -> Iterator[tuple[int, int]]:
    """A fixed grid of batches [b·B, (b+1)·B) clipped to [start, stop): results do not depend on where
    a part starts (the same sequences always go through the model together)."""
    j = start
    while j < stop:
        j1 = min(stop, (j // batch_size + 1) * batch_size)
        yield j, j1
        j = j1


def forward_batch(
    net: PrismLM, shards: ShardSet, j0: int, j1: int, T: int, dev: torch.device
) -> tuple[PrismOutput, torch.Tensor]:
    """The model's output on training sequences [j0, j1) of length ``T`` and their targets (B, T)."""
    seqs = torch.from_numpy(shards.train.sequences(np.arange(j0, j1, dtype=np.int64), T)).to(dev)  # (B, T+1)
    with torch.no_grad():
        out = net(seqs[:, :-1])
    return out, seqs[:, 1:]


def curvature_pass(
    model: PrismLM,
    shards: ShardSet,
    *,
    sequences: tuple[int, int] | None = None,
    batch_size: int = 16,
    exact: bool = False,
    damping: float = 0.1,
    reconstruction: float = 0.0,
    progress: Progress = False,
    guard: BatchGuard = nullcontext,
) -> Curvature:
    """One forward pass over training sequences [start, stop) (default all) → ``Curvature``
    (``reconstruction``: λ_rec of the REC blocks to add, see ``CurvatureAccumulator.finish``; ``guard``: what
    each batch runs inside, ``BatchGuard``)."""
    net = model
    T = net.config.block_size
    start, stop = sequences or (0, shards.train.num_sequences(T))
    dev = next(net.parameters()).device
    acc = CurvatureAccumulator(net, exact=exact)
    with eval_mode(net), Reporter(progress, "curvature", stop - start, unit="seq") as bar:
        for j0, j1 in batch_grid(start, stop, batch_size):
            with guard():
                out, _ = forward_batch(net, shards, j0, j1, T, dev)
                acc.update(out)
            bar.update(j1 - j0)
    return acc.finish(damping=damping, reconstruction=reconstruction)


def collect_gradients(
    model: PrismLM,
    shards: ShardSet,
    *,
    sequences: tuple[int, int] | None = None,
    batch_size: int = 16,
    progress: Progress = False,
    guard: BatchGuard = nullcontext,
) -> BlockGradients:
    """Exact block gradients of training sequences [start, stop) (default all), kept in memory (``guard``:
    what each batch runs inside, ``BatchGuard``)."""
    net = model
    T = net.config.block_size
    start, stop = sequences or (0, shards.train.num_sequences(T))
    dev = next(net.parameters()).device
    parts = []
    with eval_mode(net), Reporter(progress, "gradients", stop - start, unit="seq") as bar:
        for j0, j1 in batch_grid(start, stop, batch_size):
            with guard():
                out, y = forward_batch(net, shards, j0, j1, T, dev)
                parts.append(block_gradients(net, out, y, seq_ids=torch.arange(j0, j1, device=dev)))
            bar.update(j1 - j0)
    return BlockGradients.cat(parts)


def query_gradients(model: PrismLM, queries: list[tuple[list[int], int]]) -> BlockGradients:
    """Block gradients of queries given as (token ids, measure_from): the loss of targets
    ``ids[measure_from:]`` is measured (each predicted from the tokens before it; ``measure_from ≥ 1``).
    Row ``seq`` is the query's position in the list. Queries are run one at a time (no padding)."""
    net = model
    dev = next(net.parameters()).device
    parts = []
    with eval_mode(net):
        for q, (ids, start) in enumerate(queries):
            ids = list(ids)
            if len(ids) < 2:
                raise ConfigError(
                    f"query {q} has {len(ids)} token(s); a query needs at least two (a context and a target)"
                )
            cut = max(0, len(ids) - (net.config.block_size + 1))  # keep the last block_size + 1 tokens
            ids, start = ids[cut:], start - cut
            start = max(1, min(start, len(ids) - 1))
            x = torch.tensor(ids, device=dev)[None]  # (1, L)
            with torch.no_grad():
                out = net(x[:, :-1])
            mask = torch.zeros(1, x.shape[1] - 1, dtype=torch.bool, device=dev)
            mask[:, start - 1 :] = True  # target index t predicts ids[t+1]
            parts.append(block_gradients(net, out, x[:, 1:], mask, seq_ids=torch.tensor([q], device=dev)))
    return BlockGradients.cat(parts)


# ----- scores -------------------------------------------------------------------------------------------
def influence_scores(
    query: BlockGradients,
    train: BlockGradients,
    curvature: Curvature | None,
    *,
    num_queries: int,
    num_train: int,
    chunk: int = 8192,
) -> torch.Tensor:
    """Pairwise influence (num_queries, num_train): Σ_{i ∈ A_q ∩ A_j} G_{q,i}ᵀ H_i⁻¹ G_{j,i}.

    ``curvature=None`` gives the plain dot product of block gradients (H_i = I). Training rows whose
    prototype no query uses are skipped; a training sequence sharing no active prototype with a query
    scores exactly 0."""
    dt = torch.promote_types(query.grad.dtype, train.grad.dtype)
    K = int(max(int(query.proto.max()) if query.rows else 0, int(train.proto.max()) if train.rows else 0)) + 1
    dev = train.grad.device
    table = query_table(query, curvature, K, num_queries, dtype=dt, device=dev)  # H_i⁻¹ G_{q,i} for every (i, q)
    used = torch.zeros(K, dtype=torch.bool, device=dev)
    used[query.proto.to(dev)] = True
    scores = torch.zeros(num_train, num_queries, dtype=dt, device=dev)
    keep = used[train.proto]
    seq, proto, G = train.seq[keep], train.proto[keep], train.grad[keep].to(dt)
    for s in range(0, seq.shape[0], chunk):
        contrib = torch.einsum("rd,rqd->rq", G[s : s + chunk], table[proto[s : s + chunk]])  # (R, Q)
        scores.index_add_(0, seq[s : s + chunk], contrib)
    return scores.T.contiguous()


def self_influence(train: BlockGradients, curvature: Curvature | None, num_train: int) -> torch.Tensor:
    """I(j, j) for every training sequence (num_train,)."""
    P = precondition(train, curvature)
    return torch.zeros(num_train, dtype=P.dtype, device=P.device).index_add_(0, train.seq, (P * train.grad).sum(1))


@dataclass
class FullGradients:
    """The reference: exact block gradients of the training sequences in memory + block curvature."""

    train: BlockGradients
    """The block gradients of the first ``num_train`` training sequences: one row per (sequence, active
    prototype), grad (rows, d)."""
    curvature: Curvature | None
    """The block curvature; None: identity (plain gradient dot products)."""
    num_train: int
    """Training sequences scored (ids 0 … num_train − 1)."""

    @classmethod
    def build(
        cls,
        model: PrismLM,
        shards: ShardSet,
        *,
        max_sequences: int | None = None,
        batch_size: int = 16,
        mode: Literal["shared", "exact", "identity"] = "shared",
        damping: float = 0.1,
        curvature: Curvature | None = None,
        progress: Progress = False,
        guard: BatchGuard = nullcontext,
    ) -> FullGradients:
        """Block gradients (and, unless ``mode`` is identity, the curvature) of the first ``max_sequences``
        training sequences: two passes, reported to ``progress`` (stages ``curvature`` and ``gradients``),
        each batch run inside ``guard`` (``BatchGuard``)."""
        if mode not in ("shared", "exact", "identity"):
            raise ConfigError(f"curvature mode must be shared, exact or identity, got {mode!r}")
        net = model
        n = shards.train.num_sequences(net.config.block_size)
        n = n if max_sequences is None else min(n, max_sequences)
        if curvature is None and mode != "identity":
            curvature = curvature_pass(
                net,
                shards,
                sequences=(0, n),
                batch_size=batch_size,
                exact=mode == "exact",
                damping=damping,
                progress=progress,
                guard=guard,
            )
        return cls(
            collect_gradients(net, shards, sequences=(0, n), batch_size=batch_size, progress=progress, guard=guard),
            None if mode == "identity" else curvature,
            n,
        )

    def scores(self, query: BlockGradients, num_queries: int) -> torch.Tensor:
        """(num_queries, num_train) influence scores."""
        return influence_scores(query, self.train, self.curvature, num_queries=num_queries, num_train=self.num_train)

    def self_scores(self) -> torch.Tensor:
        return self_influence(self.train, self.curvature, self.num_train)
