"""TopK sparse autoencoder on the dense baseline's final hidden states — the controller baseline (spec §4).

Same budget as PRISM: K latents, exactly k active per token, ``f = TopK_k(ReLU(W_enc (z − b_dec) +
b_enc))``, ``ẑ = W_dec f + b_dec``, with the AuxK loss against dead latents and unit-norm decoder rows.
The controller acts on ``z + Σ c_j f_j W_dec[:, j]`` as PRISM's acts on prototypes. Details and the
measured AuxK weight: docs/architecture.md (controllers), docs/results.md (Controllers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

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

    def pre_activations(self, z: torch.Tensor) -> torch.Tensor:
        """(N, K) ReLU(W_enc (z − b_dec) + b_enc), before the TopK (shared by the code and AuxK)."""
        return F.relu(F.linear(z - self.b_dec, self.W_enc, self.b_enc))

    def aux_loss(
        self, z: torch.Tensor, recon: torch.Tensor, dead: torch.Tensor, aux_k: int, pre: torch.Tensor | None = None
    ) -> torch.Tensor:
        """AuxK: mean squared error of reconstructing the error z − ẑ (N, d) with the top-``aux_k`` of the
        ``dead`` (K,) latents (0 when no latent is dead); ``pre``: this z's ``pre_activations`` if computed."""
        n_dead = int(dead.sum())
        if n_dead == 0:
            return z.new_zeros(())
        pre = self.pre_activations(z) if pre is None else pre
        act, idx = pre.masked_fill(~dead, 0.0).topk(min(aux_k, n_dead), dim=-1)
        # dense (N, K) @ (K, d): gathering the rows (N, aux_k, d) costs more at aux_k = d/2
        aux = torch.zeros_like(pre).scatter(1, idx, act) @ self.W_dec
        return F.mse_loss(aux, (z - recon).detach())


class SAECheckpoint(TypedDict):
    """Held-out quality of an SAE after ``steps`` optimizer steps (``sae_quality``)."""

    steps: int
    fvu: float
    """Fraction of variance unexplained on the held-out hidden states."""
    dead_fraction: float
    """Share of latents never active on them."""


@dataclass(frozen=True)
class SAERecipe:
    """How a TopK SAE is trained: MSE + AuxK (Gao et al.) with b_dec at the data mean and unit decoder rows;
    optionally the data initialisation (``data_init``) and resampling of dead latents (``resample_dead``)."""

    steps: int = 300
    """Optimizer steps (Adam)."""
    batch: int = 16
    """Draws of the sampler per step (hidden-state rows, or sequences: the sampler's unit)."""
    lr: float = 1e-3
    aux_k: int | None = None
    """Dead latents that reconstruct the error in AuxK (None: d/2, as Gao et al.)."""
    aux_weight: float = 1.0
    dead_steps: int = 50
    """A latent is dead after this many steps without firing (AuxK's and resampling's definition)."""
    data_init: bool = False
    """Start every decoder row at a random centred training row (``data_init``): fewer dead latents."""
    resample_every: int = 0
    """Every this many steps, up to 3/4 of the run, move the dead latents to high-error rows (0: never)."""
    mean_draws: int | None = None
    """Draws whose mean starts b_dec (None: ``batch``)."""


@dataclass
class SAEFit:
    sae: TopKSAE
    """The trained autoencoder (eval mode)."""
    curve: list[SAECheckpoint]
    """Held-out quality at each checkpoint (empty without held-out rows)."""
    resampled: int
    """Latents moved by resampling over the run."""


def data_init(sae: TopKSAE, z: torch.Tensor, probe: torch.Tensor) -> None:
    """Each decoder row a centred training row z (K, d) (unit norm), W_enc = s·W_decᵀ, b_enc = 0, so every
    latent starts where the data is; s is the least-squares scale of the reconstruction of ``probe`` (N, d)
    (TopK and ReLU commute with s > 0)."""
    with torch.no_grad():
        sae.W_dec.copy_(z - sae.b_dec)
        sae.normalize_decoder()
        sae.W_enc.copy_(sae.W_dec)
        sae.b_enc.zero_()
        r, x = sae.decode(*sae.encode(probe)), probe - sae.b_dec  # (N, d) each
        sae.W_enc.mul_((r * x).sum() / (r * r).sum().clamp_min(1e-12))


def resample_dead(
    sae: TopKSAE, opt: torch.optim.Optimizer, dead: torch.Tensor, z: torch.Tensor, err: torch.Tensor
) -> int:
    """Dead latents (K,) bool moved to the highest-error rows of a batch (z, err (N, d)): W_dec row = that row's
    unit error, W_enc row = the same scaled to the live encoder rows' mean norm, b_enc = 0; their Adam moments
    reset. At most N latents move (a random subset, global RNG). Returns how many moved."""
    ids = dead.nonzero().squeeze(-1)
    n = min(len(ids), len(z))
    if n == 0:
        return 0
    ids = ids[torch.randperm(len(ids))[:n]]
    rows = (err**2).sum(-1).topk(n).indices  # the n worst-reconstructed rows of the batch
    with torch.no_grad():
        u = err[rows] / err[rows].norm(dim=-1, keepdim=True).clamp_min(1e-8)  # (n, d)
        sae.W_dec[ids] = u
        sae.W_enc[ids] = u * sae.W_enc[~dead].norm(dim=-1).mean()
        sae.b_enc[ids] = 0.0
        for p in (sae.W_enc, sae.W_dec, sae.b_enc):
            for m in ("exp_avg", "exp_avg_sq"):
                if m in opt.state.get(p, {}):
                    opt.state[p][m][ids] = 0.0
    return n


@torch.no_grad()
def sae_quality(sae: TopKSAE, z: torch.Tensor, chunk: int = 4096) -> tuple[float, float]:
    """(FVU, dead fraction) of ``sae`` on held-out hidden states z (N, d): Σ‖ẑ − z‖² / Σ‖z − z̄‖², and the
    share of latents never active on z."""
    used = torch.zeros(sae.W_dec.shape[0], dtype=torch.bool, device=z.device)
    sse = 0.0
    for s in range(0, len(z), chunk):
        idx, act = sae.encode(z[s : s + chunk])
        sse += float(((sae.decode(idx, act) + sae.b_dec - z[s : s + chunk]) ** 2).sum())
        used[idx[act > 0]] = True
    return sse / float(((z - z.mean(0)) ** 2).sum()), float((~used).float().mean())


def row_sampler(rows: torch.Tensor, seed: int) -> Callable[[int], torch.Tensor]:
    """n → n random rows (with replacement) of ``rows`` (M, d), from a generator seeded here."""
    g = torch.Generator().manual_seed(seed)
    return lambda n: rows[torch.randint(0, len(rows), (n,), generator=g)]


def fit_sae(
    d: int,
    num_latents: int,
    k: int,
    sample: Callable[[int], torch.Tensor],
    recipe: SAERecipe,
    *,
    seed: int = 0,
    held: torch.Tensor | None = None,
    checkpoints: tuple[int, ...] = (),
    log: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
    start: TopKSAE | None = None,
) -> SAEFit:
    """Train a TopK SAE (d → ``num_latents``, k active) on hidden states drawn by ``sample(n)`` ((rows, d) for
    n draws), following ``recipe``; ``held`` (N, d): held-out rows scored at each of ``checkpoints`` and at the
    end. The initial weights come from the global RNG seeded with ``seed``; the draws from ``sample``'s own.
    ``start``: train this autoencoder further (in place; no initialisation) instead of a new one."""
    torch.manual_seed(seed)
    sae = TopKSAE(d, num_latents, k).to(device) if start is None else start
    opt = torch.optim.Adam(sae.parameters(), lr=recipe.lr)
    if start is None:
        with torch.no_grad():
            sae.b_dec.copy_(sample(recipe.mean_draws or recipe.batch).mean(0))
        if recipe.data_init:
            data_init(sae, sample(num_latents)[:num_latents], sample(recipe.batch))
    aux_k = recipe.aux_k or max(1, d // 2)
    since = torch.zeros(num_latents, dtype=torch.long, device=device)  # steps since each latent fired
    curve: list[SAECheckpoint] = []
    resampled = 0
    for step in range(1, recipe.steps + 1):
        z = sample(recipe.batch)
        pre = sae.pre_activations(z)  # (N, K), shared by TopK and AuxK
        act, idx = pre.topk(k, dim=-1)
        recon = sae.decode(idx, act) + sae.b_dec
        fired = torch.zeros(num_latents, dtype=torch.bool, device=device)
        fired[idx[act > 0]] = True
        since = torch.where(fired, 0, since + 1)
        dead = since > recipe.dead_steps
        loss = F.mse_loss(recon, z)
        if bool(dead.any()):
            loss = loss + recipe.aux_weight * sae.aux_loss(z, recon, dead, aux_k, pre)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sae.normalize_decoder()
        every = recipe.resample_every
        if every and step % every == 0 and step <= 3 * recipe.steps // 4 and bool(dead.any()):
            resampled += resample_dead(sae, opt, dead, z, (z - recon).detach())
            since[dead] = 0
        if held is not None and (step in checkpoints or step == recipe.steps):
            fvu, dead_fraction = sae_quality(sae, held)
            curve.append({"steps": step, "fvu": fvu, "dead_fraction": dead_fraction})
            if log:
                log(f"SAE step {step}/{recipe.steps}: held-out FVU {fvu:.3f}, dead {dead_fraction:.2f}")
    return SAEFit(sae=sae.eval(), curve=curve, resampled=resampled)


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
    dev = next(model.parameters()).device

    @torch.no_grad()
    def hidden(n: int) -> torch.Tensor:  # the hidden states of n random training sequences
        ids = torch.randint(0, n_seq, (n,), generator=g)
        x = torch.from_numpy(shards.train.sequences(ids.numpy(), T)).to(dev)[:, :-1]
        return model.backbone(x).reshape(-1, model.config.n_embd).float()

    recipe = SAERecipe(steps=steps, batch=batch_size, lr=lr, aux_k=aux_k, aux_weight=aux_weight, dead_steps=dead_steps)
    sae = fit_sae(model.config.n_embd, num_latents, k, hidden, recipe, seed=seed, device=dev).sae
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
