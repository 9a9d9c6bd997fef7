"""A controller on the dense residual stream, the strongest simple baseline for the sparse ones (issue 37).

The prototype controller moves the final hidden state by ``Σ c_i a_i d_i`` over the K prototypes; this one
moves it along K' fixed orthonormal directions u_j of the hidden state itself (top principal components of
the task's training hidden states, or random ones):

    z' = z + Σ_j c_j (u_j · z) u_j            (c_j = -1 removes z's component along u_j, c_j > 0 amplifies it)

It is a code like any other: every direction is "active" at every token with activation ``u_j · z``
(``DenseBasis.encode``), so it is fitted and scored by the same functions as the prototype and SAE
controllers (``prismlm.control.surrogate``: the same surrogate objective, L1 penalty, λ grid and validation
split), with K' trainable coefficients. "The same size" is K' = the prototype controller's support (its
non-zero count, ``matched_directions``) unless a fixed K' is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from prismlm.errors import ConfigError, DataError

Basis = Literal["pca", "random"]
BASES: tuple[Basis, ...] = ("pca", "random")


@dataclass(frozen=True)
class DenseControlConfig:
    """How the dense-residual controller's directions are chosen."""

    basis: Basis = "pca"
    """"pca": the top K' principal components of the training split's hidden states (the directions along
    which the task's z varies most); "random": K' orthonormalised Gaussian directions (seeded)."""
    num_directions: int | None = None
    """K' (the controller's trainable parameters); None: matched to the prototype controller's support
    (``matched_directions``)."""
    min_directions: int = 1
    """The smallest matched K' (a prototype controller with no non-zero coefficient still gets a baseline)."""
    seed: int = 0
    """Seed of the random basis (unused by "pca")."""

    def __post_init__(self) -> None:
        if self.basis not in BASES:
            raise ConfigError(f"`basis` must be one of {', '.join(BASES)}, got {self.basis!r}", param="basis")
        if self.num_directions is not None and self.num_directions < 1:
            raise ConfigError(
                f"`num_directions` must be >= 1 or None, got {self.num_directions}", param="num_directions"
            )
        if self.min_directions < 1:
            raise ConfigError(f"`min_directions` must be >= 1, got {self.min_directions}", param="min_directions")

    def describe(self) -> str:
        """A short stable name for cache keys and logs (``pca-matched``, ``random-64-s0``)."""
        size = "matched" if self.num_directions is None else str(self.num_directions)
        return f"{self.basis}-{size}" + (f"-s{self.seed}" if self.basis == "random" else "")


def matched_directions(support: int, d: int, cfg: DenseControlConfig) -> int:
    """K': ``cfg.num_directions`` if set, else the prototype controller's support (non-zero count), at least
    ``cfg.min_directions``; never more than d (the hidden state has no more orthonormal directions)."""
    k = cfg.num_directions if cfg.num_directions is not None else max(support, cfg.min_directions)
    if k > d:
        if cfg.num_directions is not None:
            raise ConfigError(f"`num_directions` must be <= d={d}, got {k}", param="num_directions")
        k = d  # a matched support above d: the full basis is the largest dense controller there is
    return k


def pca_directions(z: torch.Tensor, n: int) -> torch.Tensor:
    """(n, d) the top n principal directions of z (N, d) (rows orthonormal, by decreasing variance), each
    signed so that its largest-magnitude entry is positive (an SVD's signs are arbitrary; this fixes them)."""
    if z.ndim != 2 or len(z) < 2:
        raise DataError(f"PCA needs at least 2 hidden states (N, d), got shape {tuple(z.shape)}")
    x = z.double() - z.double().mean(0)
    _, _, Vh = torch.linalg.svd(x, full_matrices=False)  # (min(N, d), d)
    if n > Vh.shape[0]:
        raise DataError(f"{n} principal directions asked of {len(z)} hidden states of width {z.shape[1]}")
    U = Vh[:n]
    sign = torch.sign(U.gather(1, U.abs().argmax(1, keepdim=True)))  # (n, 1)
    return (U * sign).float()


def random_directions(d: int, n: int, seed: int) -> torch.Tensor:
    """(n, d) orthonormal rows: a seeded Gaussian (d, n) orthonormalised by QR."""
    if n > d:
        raise ConfigError(f"`num_directions` must be <= d={d}, got {n}", param="num_directions")
    g = torch.Generator().manual_seed(seed)
    Q, R = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64))
    return (Q * torch.sign(torch.diagonal(R))).T.contiguous().float()  # signs fixed: Q's R has a positive diagonal


@dataclass(frozen=True)
class DenseBasis:
    """K' fixed directions of the hidden state as a dense code (every unit active at every token)."""

    directions: torch.Tensor
    """(K', d) orthonormal rows u_j: the controller moves z by c_j (u_j · z) u_j."""
    basis: Basis
    """How they were chosen (``DenseControlConfig.basis``)."""

    @property
    def num_parameters(self) -> int:
        """The controller's trainable coefficients: one per direction."""
        return int(self.directions.shape[0])

    def encode(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An ``Encoder``: indices (N, K') = 0..K'-1 on every row, activations (N, K') = z · u_j."""
        n = self.num_parameters
        act = z.float() @ self.directions.T  # (N, K')
        return torch.arange(n).expand(len(z), n).contiguous(), act


def dense_basis(train_z: torch.Tensor, num_directions: int, cfg: DenseControlConfig) -> DenseBasis:
    """The basis of ``cfg`` with K' = ``num_directions``, from the training split's hidden states only (the
    validation and test splits never shape it)."""
    d = train_z.shape[1]
    if cfg.basis == "pca":
        U = pca_directions(train_z, num_directions)
    else:
        U = random_directions(d, num_directions, cfg.seed)
    return DenseBasis(U, cfg.basis)


__all__ = [
    "BASES",
    "DenseBasis",
    "DenseControlConfig",
    "dense_basis",
    "matched_directions",
    "pca_directions",
    "random_directions",
]
