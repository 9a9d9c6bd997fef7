"""Faithfulness: would the prototypes alone have predicted the model's token? (issue 33, item 1)

Every logit of a PRISM model splits exactly, ℓ = W z + b = W r + Σ_i a_i W p_i + b, with ẑ = Σ_i a_i p_i = z − r.
The **prototype-only prediction** is what the same head makes of ẑ alone:

    ℓ̂ = W ẑ + b   (``lm_head(ẑ)``: the bias b is included when ``lm_head`` has one; a model without a bias —
                   GPT-2, Llama, SmolLM2, this library's own — has ℓ̂ = W ẑ),

so ẑ = z gives ℓ̂ = ℓ bit for bit, and ẑ = 0 gives ℓ̂ = b (0 without a bias). Under an intervention
(``suppress``/``control``: ``PrismOutput.prototype_multipliers`` m) ẑ is Σ_i m_i a_i p_i, the slices the
logits were computed with. With p = softmax(ℓ), p̂ = softmax(ℓ̂) and y1, y2 the model's top two tokens:

- ``top1_agreement``: argmax ℓ̂ == argmax ℓ (= y1);
- ``kl``: KL(p ‖ p̂) = Σ_v p_v (log p_v − log p̂_v), per token;
- margin share: pooled Σ(ℓ̂[y1] − ℓ̂[y2]) / Σ(ℓ[y1] − ℓ[y2]), and the per-token median of the same ratio
  (over tokens with ℓ[y1] > ℓ[y2]; the accumulator keeps the first ``median_cap`` ratios, float32);
- ``slice_logit_share``: |S| / (|S| + |R| + |B|) at y1, S = (W ẑ)_y1 the slices' sum, R = (W r)_y1, B = b_y1
  (the bench's ``abs_share_slices``: "slices carry 0.535 of an answer token's logit by magnitude");
- ``centred_residual_share``: ‖r‖ / ‖z − μ‖, μ the mean hidden state.

**Yardsticks** on the same tokens (``Yardstick``): the same top-1, KL and margin share of two fixed, non-sparse
summaries of z — (a) the mean direction alone, ẑ_μ = (z·μ̂) μ̂, and (b) a fixed subspace, ẑ_Q = Q Qᵀ z, Q an
orthonormal basis of μ̂ and the top m principal directions of a sample of z (m = k by default: 1 + k fixed
directions, where the prototypes pick k of K per token; ``bench/claims_explanations.py``'s 9 for k = 8). Their
logits are ℓ̂ = W ẑ_X + b too. A share of the prototypes means something only beside these.

Which μ and Q: ``evaluate`` (``prism eval``, the training validation) fits them on the first validation batch
(B·T tokens) and keeps them fixed for the rest; the bench fits them on the bank's stored anchor z
(``yardstick_from_moments``); ``FaithfulnessAccumulator(yardstick=…)`` takes any given one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from prismlm.errors import ModelError
from prismlm.model import PrismLM, PrismOutput, decompose

__all__ = [
    "ChoiceParts",
    "FaithfulnessAccumulator",
    "Yardstick",
    "answer_faithfulness",
    "centred_residual_share",
    "choice_parts",
    "choice_shares",
    "fit_yardstick",
    "kl",
    "margins",
    "positions",
    "prototype_choice",
    "prototype_hidden",
    "prototype_logits",
    "prototype_prediction",
    "slice_logit_share",
    "top1_agreement",
    "yardstick_from_moments",
]


# ----- the prototype-only prediction -----------------------------------------------------------------------
def _aligned(out: PrismOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, r) (B, T', d) for the T' positions ``out.logits`` (B, T', V) covers (the last one with ``last_only``)."""
    if out.residual is None or out.indices is None or out.activations is None:
        raise ModelError("faithfulness needs a PRISM forward output (the dense baseline has no prototypes)")
    t = out.logits.shape[1]
    return out.hidden[:, -t:], out.residual[:, -t:]


def prototype_hidden(model: PrismLM, out: PrismOutput) -> torch.Tensor:
    """ẑ (B, T', d) = z − r, the prototypes' part of z at the positions of ``out.logits``; under an intervention
    Σ_i m_i a_i p_i (the multipliers the logits were computed with), as ``forward`` builds its logits."""
    z, r = _aligned(out)
    zhat = z - r  # (B, T', d)
    mult = out.prototype_multipliers
    if mult is not None:
        assert out.indices is not None and out.activations is not None
        t = zhat.shape[1]
        idx, act = out.indices[:, -t:], out.activations[:, -t:]  # (B, T', k)
        a = act * (mult[idx].to(act.dtype) - 1.0)  # (B, T', k)
        p = model.require_prototypes().weight[idx].to(a.dtype)  # (B, T', k, d)
        zhat = zhat + torch.einsum("btk,btkd->btd", a, p).to(zhat.dtype)
    return zhat


def prototype_logits(model: PrismLM, out: PrismOutput) -> torch.Tensor:
    """ℓ̂ (B, T', V) = lm_head(ẑ) = W ẑ (+ b when ``lm_head`` has a bias), in the head's dtype."""
    zhat = prototype_hidden(model, out)
    return model.lm_head(zhat.to(model.lm_head.weight.dtype))


def prototype_prediction(model: PrismLM, out: PrismOutput, valid: int | None = None) -> torch.Tensor:
    """(B, T') int64 argmax of ℓ̂ over the first ``valid`` token ids (None: all): what the prototypes alone
    would have predicted at each position of ``out.logits``."""
    return prototype_logits(model, out)[..., :valid].argmax(-1)


@torch.no_grad()
def prototype_choice(
    model: PrismLM, out: PrismOutput, tokens: torch.Tensor, valid: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an explanation shows per position: ((B, T') int64 argmax of ℓ̂ over the first ``valid`` ids,
    (B, T') float64 softmax(ℓ̂)[y] of ``tokens`` y (B, T')) — the prototype-only prediction and the
    probability it gives the chosen token."""
    approx = prototype_logits(model, out)[..., :valid].double()  # (B, T', V')
    prob = torch.softmax(approx, dim=-1).gather(-1, tokens[..., None].to(approx.device))[..., 0]
    return approx.argmax(-1), prob


# ----- per-token metrics: logits (N, V) of the model, approx (N, V) of a predictor ------------------------
def top1_agreement(logits: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """(N,) bool: argmax approx == argmax logits."""
    return approx.argmax(-1) == logits.argmax(-1)


def kl(logits: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """(N,) float64 KL(softmax(logits) ‖ softmax(approx)), computed in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # (N, V)
    logq = torch.log_softmax(approx.double(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def margins(logits: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((N,), (N,)) float64: the model's margin ℓ[y1] − ℓ[y2] (≥ 0) and the predictor's ℓ̂[y1] − ℓ̂[y2] on
    the same two tokens (y1, y2 the model's top two; ties broken as ``topk`` breaks them)."""
    top2 = logits.topk(2, dim=-1).indices  # (N, 2)
    lm, am = logits.gather(-1, top2).double(), approx.gather(-1, top2).double()  # (N, 2)
    return lm[:, 0] - lm[:, 1], am[:, 0] - am[:, 1]


def slice_logit_share(slices: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(N,) |S| / (|S| + |R| + |B|) from the chosen token's summed slices S, residual slice R and bias slice B
    (each (N,)); 0 where all three are 0."""
    s, r, b = slices.double().abs(), residual.double().abs(), bias.double().abs()
    return s / (s + r + b).clamp_min(torch.finfo(torch.float64).tiny)


def centred_residual_share(hidden: torch.Tensor, residual: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(N,) float64 ‖r‖ / ‖z − μ‖ for hidden z (N, d), residual r (N, d), mean μ (d,)."""
    centred = (hidden.double() - mean.double()).norm(dim=-1)
    return residual.double().norm(dim=-1) / centred.clamp_min(1e-12)


# ----- yardsticks ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Yardstick:
    """Fixed, non-sparse summaries of hidden states, fitted once on a sample (float64):
    ``mean`` (d,) μ; ``direction`` (d,) μ̂ = μ/‖μ‖; ``basis`` (d, 1 + m) orthonormal: μ̂ and the top m principal
    directions of the centred sample (the same for every token)."""

    mean: torch.Tensor
    direction: torch.Tensor
    basis: torch.Tensor

    @property
    def directions(self) -> int:
        """1 + m: the subspace's dimension."""
        return int(self.basis.shape[1])


def yardstick_from_moments(total: torch.Tensor, outer: torch.Tensor, rows: int, directions: int) -> Yardstick:
    """The ``Yardstick`` of ``rows`` hidden states from their float64 sums: ``total`` (d,) Σ z, ``outer`` (d, d)
    Σ z zᵀ; ``directions`` m principal directions (of the covariance, by ``eigh``) beside μ̂."""
    mu = total.double() / rows  # (d,)
    cov = outer.double() / rows - torch.outer(mu, mu)  # (d, d)
    top = torch.linalg.eigh(cov).eigenvectors[:, -directions:] if directions else cov[:, :0]  # (d, m)
    unit = mu / mu.norm()
    basis = torch.linalg.qr(torch.cat([unit[:, None], top], dim=1)).Q  # (d, 1 + m)
    return Yardstick(mean=mu, direction=unit, basis=basis)


def fit_yardstick(hidden: torch.Tensor, directions: int) -> Yardstick:
    """``yardstick_from_moments`` of a sample of hidden states (…, d)."""
    z = hidden.detach().reshape(-1, hidden.shape[-1]).double()  # (N, d)
    return yardstick_from_moments(z.sum(0), z.T @ z, z.shape[0], directions)


# ----- the parts of a chosen token's logit (what bench/claims_explanations.py records) ------------------------
class ChoiceParts(NamedTuple):
    """Per position (B, T') float64, for the chosen token y and the runner-up y2 of ``choice_parts``."""

    logit: torch.Tensor
    """ℓ_y."""
    slices: torch.Tensor
    """S = Σ_i a_i (W p_i)_y."""
    abs_slices: torch.Tensor
    """Σ_i |a_i (W p_i)_y|."""
    residual: torch.Tensor
    """R = (W r)_y."""
    bias: torch.Tensor
    """B = b_y (0 without a bias)."""
    top_slice: torch.Tensor
    """max_i |a_i (W p_i)_y|."""
    mean_dir: torch.Tensor
    """(z·μ̂)(w_y·μ̂): the mean-direction yardstick's part of ℓ_y."""
    subspace: torch.Tensor
    """(Qᵀz)·(Qᵀw_y): the fixed subspace's part of ℓ_y."""
    runner_up_logit: torch.Tensor
    runner_up_slices: torch.Tensor
    runner_up_bias: torch.Tensor


@torch.no_grad()
def choice_parts(model: PrismLM, out: PrismOutput, top2: torch.Tensor, ref: Yardstick) -> ChoiceParts:
    """The ``ChoiceParts`` of the chosen tokens ``top2[..., 0]`` and runner-ups ``top2[..., 1]`` (B, T, 2) at
    every position of ``out`` (exact: ``prismlm.model.decompose``)."""
    d = decompose(model, out, top2[..., 0])  # slices (B, T, k); the rest (B, T)
    d2 = decompose(model, out, top2[..., 1])
    sl = d.prototype_slices.double()  # (B, T, k)
    z = out.hidden.double()  # (B, T, d)
    w = model.lm_head.weight[top2[..., 0]].double()  # (B, T, d): the chosen tokens' rows of W
    mean_dir = (z @ ref.direction) * (w @ ref.direction)  # (B, T)
    subspace = ((z @ ref.basis) * (w @ ref.basis)).sum(-1)  # (B, T)
    cols = (
        *(d.logit, sl.sum(-1), sl.abs().sum(-1), d.residual_slice, d.bias_slice, sl.abs().amax(-1)),
        *(mean_dir, subspace, d2.logit, d2.prototype_slices.sum(-1), d2.bias_slice),
    )
    return ChoiceParts(*(c.double() for c in cols))


def choice_shares(p: ChoiceParts) -> dict[str, torch.Tensor]:
    """Per-token shares of a chosen token's logit and of its margin over the runner-up (each of p's shape);
    the definitions are the bench's ``DEFINITIONS`` (``bench/claims_explanations.py``)."""
    gap, dS, dB = p.logit - p.runner_up_logit, p.slices - p.runner_up_slices, p.bias - p.runner_up_bias
    dR = gap - dS - dB  # the greedy margin's residual part
    net = p.slices.abs() + p.residual.abs() + p.bias.abs()
    gross = p.abs_slices + p.residual.abs() + p.bias.abs()
    M, Q = p.mean_dir, p.subspace
    return {
        "abs_share_slices": p.slices.abs() / net,
        "abs_share_residual": p.residual.abs() / net,
        "abs_share_bias": p.bias.abs() / net,
        "gross_share_slices": p.abs_slices / gross,
        "top_share": p.top_slice / gross,
        "signed_fraction_slices": p.slices / p.logit,
        "signed_fraction_residual": p.residual / p.logit,
        "signed_fraction_bias": p.bias / p.logit,
        "ref_abs_share_mean_direction": M.abs() / (M.abs() + (p.logit - M).abs()),
        "ref_abs_share_pca_subspace": Q.abs() / (Q.abs() + (p.logit - Q).abs()),
        "margin_abs_share_slices": dS.abs() / (dS.abs() + dR.abs() + dB.abs()),
        "margin_fraction_slices": dS / gap,
    }


# ----- the streaming accumulator ---------------------------------------------------------------------------
PREDICTORS = ("proto", "mean_dir", "pca")
"""The prototype-only prediction and the two yardsticks, in the order of the accumulator's sums."""


@dataclass
class FaithfulnessAccumulator:
    """Streams PRISM forward outputs into the faithfulness metrics of the module docstring: per-token values in
    the logits' precision (at least float32; float64 for a float64 model), float64 sums, memory O(chunk · V) per step plus the median's ≤ ``median_cap`` float32 ratios. Batch splitting does not
    change the result (given a fixed ``yardstick``).

    ``yardstick``: None — fitted on the first ``update``'s tokens (``directions`` principal directions, default
    k) and kept. ``yardsticks=False``: the prototype-only metrics alone (no μ: no centred residual share), whose
    sums (``sums``/``from_sums``) add across parts. ``valid``: score only the first ``valid`` token ids (a padded
    vocabulary); None: all. ``median_cap`` 0: no median."""

    yardstick: Yardstick | None = None
    directions: int | None = None
    yardsticks: bool = True
    valid: int | None = None
    chunk: int = 256
    median_cap: int = 1_000_000
    tokens: int = 0
    top1: list[float] = field(default_factory=lambda: [0.0] * len(PREDICTORS))
    kl_sum: list[float] = field(default_factory=lambda: [0.0] * len(PREDICTORS))
    margin_hat: list[float] = field(default_factory=lambda: [0.0] * len(PREDICTORS))
    margin_sum: float = 0.0
    slice_share_sum: float = 0.0
    centred_sum: float = 0.0
    ratios: list[torch.Tensor] = field(default_factory=list)
    kept: int = 0
    _heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @torch.no_grad()
    def update(self, model: PrismLM, out: PrismOutput) -> None:
        """Add the positions of ``out.logits`` (``out`` from ``model``)."""
        z, r = _aligned(out)
        d = z.shape[-1]
        zhat = prototype_hidden(model, out).reshape(-1, d)  # (N, d)
        logits = out.logits.reshape(-1, out.logits.shape[-1])  # (N, V)
        z, r = z.reshape(-1, d), r.reshape(-1, d)
        W, bias = model.lm_head.weight, model.lm_head.bias
        for s in range(0, z.shape[0], self.chunk):
            approx = [F.linear(zhat[s : s + self.chunk].to(W.dtype), W, bias)]  # (n, V) ℓ̂ = lm_head(ẑ)
            if self.yardsticks:
                zc, rc = z[s : s + self.chunk].double(), r[s : s + self.chunk].double()  # (n, d)
                approx += self._yardstick_logits(model, out, zc, rc)
            self._chunk(logits[s : s + self.chunk], approx, bias)
        self.tokens += z.shape[0]

    def _yardstick_logits(
        self, model: PrismLM, out: PrismOutput, z: torch.Tensor, r: torch.Tensor
    ) -> list[torch.Tensor]:
        """[(n, V) W ẑ_μ + b, (n, V) W Q Qᵀ z + b] of hidden states z (n, d), in the head's dtype (and the
        centred residual's sum)."""
        if self.yardstick is None:
            k = out.indices.shape[-1] if out.indices is not None else 0
            self.yardstick = fit_yardstick(_aligned(out)[0], self.directions if self.directions is not None else k)
        ref, W, bias = self.yardstick, model.lm_head.weight, model.lm_head.bias
        if self._heads is None:  # the yardsticks' heads W [μ̂, Q] (V, 2 + m) and b, once (W is fixed meanwhile)
            b0 = bias.detach() if bias is not None else W.new_zeros(W.shape[0])
            basis = torch.cat([ref.direction[:, None], ref.basis], dim=1).to(W.device)  # (d, 2 + m)
            self._heads = ((W.detach().double() @ basis).to(W.dtype), basis.to(W.dtype), b0)
        WB, basis, b0 = self._heads
        self.centred_sum += float(centred_residual_share(z, r, ref.mean.to(z.device)).sum())
        coef = z.to(W.dtype) @ basis  # (n, 2 + m): z·μ̂, then Qᵀz
        return [torch.addmm(b0, coef[:, :1], WB[:, :1].T), torch.addmm(b0, coef[:, 1:], WB[:, 1:].T)]

    def _chunk(self, logits: torch.Tensor, approx: list[torch.Tensor], bias: torch.Tensor | None) -> None:
        """The sums of one chunk: ``logits`` (n, V) the model's, ``approx`` one (n, V) per predictor. KL(p ‖ p̂) as
        Σ p log p − Σ p log p̂ (= ``kl``), the model's side computed once per chunk."""
        ct = torch.promote_types(logits.dtype, torch.float32)  # per token in the logits' precision (≥ float32)
        lg = logits[:, : self.valid].to(ct)  # (n, V')
        y1, top2 = lg.argmax(-1), lg.topk(2, dim=-1).indices  # (n,), (n, 2)
        logp = torch.log_softmax(lg, dim=-1)  # (n, V')
        p = logp.exp()
        plogp = torch.linalg.vecdot(p, logp)  # (n,)
        l2 = lg.gather(-1, top2)
        gap = l2[:, 0] - l2[:, 1]  # (n,) the model's margin
        self.margin_sum += float(gap.double().sum())
        for j, a in enumerate(approx):
            a = a[:, : self.valid].to(ct)
            self.top1[j] += float((a.argmax(-1) == y1).double().sum())
            kl_t = plogp - torch.linalg.vecdot(p, torch.log_softmax(a, dim=-1))  # (n,) both terms O(entropy)
            self.kl_sum[j] += float(kl_t.double().sum())
            a2 = a.gather(-1, top2)
            gap_hat = a2[:, 0] - a2[:, 1]  # (n,)
            self.margin_hat[j] += float(gap_hat.double().sum())
            if j == 0:
                self._keep_ratios(gap, gap_hat)
                b = bias.detach().to(ct)[y1] if bias is not None else torch.zeros_like(gap)  # (n,)
                s_hat = a.gather(-1, y1[:, None])[:, 0] - b  # (n,) S = (W ẑ)_y1
                resid = lg.gather(-1, y1[:, None])[:, 0] - s_hat - b  # (n,) R = (W r)_y1
                self.slice_share_sum += float(slice_logit_share(s_hat, resid, b).sum())  # float64

    def _keep_ratios(self, gap: torch.Tensor, gap_hat: torch.Tensor) -> None:
        room = self.median_cap - self.kept
        if room > 0:
            ratio = (gap_hat[gap > 0] / gap[gap > 0]).float()[:room].cpu()
            self.ratios.append(ratio)
            self.kept += ratio.numel()

    def sums(self) -> dict[str, float]:
        """The prototype-only sums, which add across parts: tokens, top1, kl, margin_hat, margin, slice_share."""
        return {
            "tokens": self.tokens,
            "top1": self.top1[0],
            "kl": self.kl_sum[0],
            "margin_hat": self.margin_hat[0],
            "margin": self.margin_sum,
            "slice_share": self.slice_share_sum,
        }

    @classmethod
    def from_sums(cls, sums: dict[str, float], *, valid: int | None = None) -> FaithfulnessAccumulator:
        """A prototype-only accumulator (no yardsticks, no median) continuing from ``sums``."""
        acc = cls(yardsticks=False, median_cap=0, valid=valid, tokens=int(sums["tokens"]))
        acc.top1[0], acc.kl_sum[0], acc.margin_hat[0] = (
            float(sums["top1"]),
            float(sums["kl"]),
            float(sums["margin_hat"]),
        )
        acc.margin_sum, acc.slice_share_sum = float(sums["margin"]), float(sums["slice_share"])
        return acc

    def result(self) -> dict[str, float]:
        """The metrics (empty before any token): ``top1_agreement``, ``kl``, ``margin_share`` (pooled),
        ``margin_share_median`` (with ``median_cap``), ``slice_logit_share``, ``faithfulness_tokens``; with
        yardsticks also ``centred_residual_share``, ``{mean_dir,pca}_{top1_agreement,kl,margin_share}`` and
        ``pca_directions`` (1 + m)."""
        n = self.tokens
        if n == 0:
            return {}
        m: dict[str, float] = {}
        share = self.margin_sum > 0
        for j, name in enumerate(PREDICTORS if self.yardsticks else PREDICTORS[:1]):
            pre = "" if name == "proto" else f"{name}_"
            m[f"{pre}top1_agreement"] = self.top1[j] / n
            m[f"{pre}kl"] = self.kl_sum[j] / n
            m[f"{pre}margin_share"] = self.margin_hat[j] / self.margin_sum if share else float("nan")
            if j == 0:  # the prototypes' other metrics before the yardsticks'
                if self.median_cap:
                    ratios = torch.cat(self.ratios) if self.ratios else torch.zeros(0)
                    m["margin_share_median"] = float(ratios.double().quantile(0.5)) if ratios.numel() else float("nan")
                m["slice_logit_share"] = self.slice_share_sum / n
                if self.yardsticks and self.yardstick is not None:
                    m["centred_residual_share"] = self.centred_sum / n
        if self.yardsticks and self.yardstick is not None:
            m["pca_directions"] = self.yardstick.directions
        m["faithfulness_tokens"] = n
        return m


def positions(out: PrismOutput, rows: torch.Tensor, cols: torch.Tensor) -> PrismOutput:
    """The positions (rows[i], cols[i]) of a full forward output as one (1, n, …) output, so an accumulator
    scores only them (e.g. the answer tokens of chats). rows, cols: (n,) int64."""
    if out.residual is None or out.indices is None or out.activations is None:
        raise ModelError("faithfulness needs a PRISM forward output (the dense baseline has no prototypes)")

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[rows, cols][None]

    return PrismOutput(
        logits=pick(out.logits),
        hidden=pick(out.hidden),
        indices=pick(out.indices),
        activations=pick(out.activations),
        residual=pick(out.residual),
        prototype_multipliers=out.prototype_multipliers,
    )


@torch.no_grad()
def answer_faithfulness(
    model: PrismLM, chats: list[tuple[list[int], int]], acc: FaithfulnessAccumulator
) -> FaithfulnessAccumulator:
    """Add the answer positions of chats to ``acc``: each chat is (token ids of the whole transcript, the
    prompt's length P); the positions P − 1 … len − 2 are scored (their next token is an answer token, the
    end-of-turn included). One forward per chat (transcripts differ in length; no padding to reason about)."""
    device = next(model.parameters()).device
    for ids, prompt_len in chats:  # one transcript at a time
        if not 1 <= prompt_len < len(ids):
            raise ModelError(f"a chat of {len(ids)} tokens cannot have a prompt of {prompt_len} and an answer")
        out = model(torch.tensor([ids], device=device))
        cols = torch.arange(prompt_len - 1, len(ids) - 1, device=device)
        acc.update(model, positions(out, torch.zeros_like(cols), cols))
    return acc
