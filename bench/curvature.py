#!/usr/bin/env python
"""Hessian diagnostics in prototype space (spec §3.2): does clustering localise curvature?

What is measured
    For tiny PRISM models trained with growing clustering weights (λ1 = ``loss.lambda_r1``, λ2 =
    ``loss.lambda_r2``; same seed, data and steps otherwise), on ``--tokens`` training tokens:

    - ``GN``: the exact prototype-space Gauss–Newton matrix of the mean token cross-entropy,
      (Kd × Kd) with blocks ``E_t[a_{t,i} a_{t,i'} Wᵀ Σ_t W]`` (r_t, a_t held fixed, as in attribution);
    - ``C``: the exact Hessian of λ1·R1 + λ2·R2 with respect to P at the same point (the arg-maxes fixed):
      each term is a function of a single prototype, so C is block-diagonal (analytic, checked against
      autograd on a few blocks);
    - for ``GN`` and ``GN + C``: the share of squared Frobenius mass in the K diagonal blocks; the
      condition number over the active prototypes' subspace (blocks with m_i > 0), damped as attribution
      damps (λ_i = 0.1 · tr(D_i)/d, D_i the exact diagonal block); the condition number of
      ``(D+Λ)^{-1/2} (H+Λ) (D+Λ)^{-1/2}`` (1 = the damped block-diagonal preconditioner is exact);
      and how far the exact diagonal blocks are from the shared form ``m_i F`` (mean relative Frobenius
      error).
    - the prototype co-usage: mean number of distinct active prototypes per token and the mass of
      ``E[a_i a_i']`` off the diagonal.

How to read it
    The paper claims that strong clustering shrinks the co-usage coupling, so ``diag_share`` should grow
    and ``cond_block_preconditioned`` fall towards 1 as λ grows. Whatever the numbers say is reported.
    ``GN + C`` can be indefinite (cosine terms are not convex); its ``min_eig`` is reported.

Output: JSON at ``--out`` (default ``bench/results/curvature.json``), a PNG next to it when matplotlib is
installed, and one summary line on stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, parse_sets, write_json

from prismlm.config import RunConfig
from prismlm.data.shards import prepare_shards
from prismlm.train import train


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@torch.no_grad()
def gauss_newton(net, x: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, Any]:
    """Exact (Kd × Kd) prototype-space GN of the mean token CE over inputs x (B, T), float64."""
    out = net(x)
    K, d = net.prototypes.num_prototypes, net.config.n_embd
    W = net.lm_head.weight.double()  # (V, d)
    N = x.numel()
    pi = torch.softmax(out.logits.double().reshape(N, -1), -1)  # (N, V)
    idx = out.indices.reshape(N, -1)
    a = out.activations.double().reshape(N, -1)  # (N, k)
    H = torch.zeros(K, K, d, d, dtype=torch.float64)
    for s in range(0, N, chunk):  # M_t = Wᵀ Σ_t W, then a_i a_i' M_t into block (i, i')
        p = pi[s : s + chunk]
        mu = p @ W  # (n, d)
        M = torch.einsum("vd,nv,ve->nde", W, p, W) - mu[:, :, None] * mu[:, None, :]  # (n, d, d)
        ii, aa = idx[s : s + chunk], a[s : s + chunk]
        w = aa[:, :, None] * aa[:, None, :]  # (n, k, k)
        key = (ii[:, :, None] * K + ii[:, None, :]).reshape(-1)  # (n·k·k,)
        vals = (w[:, :, :, None, None] * M[:, None, None]).reshape(-1, d, d)
        H.view(K * K, d, d).index_add_(0, key, vals)
    H /= N
    return H.permute(0, 2, 1, 3).reshape(K * d, K * d), out


def _cos_hessian(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Hessian w.r.t. p of cos(z, p) for rows z (n, d), p (n, d) → (n, d, d)."""
    zu = F.normalize(z, dim=-1)
    n = p.norm(dim=-1, keepdim=True)  # (n, 1)
    c = (zu * p).sum(-1)  # (n,) = zuᵀp
    eye = torch.eye(p.shape[1], dtype=p.dtype)
    return (
        -(zu[:, :, None] * p[:, None, :] + p[:, :, None] * zu[:, None, :]) / n[:, :, None] ** 3
        - (c / n[:, 0] ** 3)[:, None, None] * eye
        + 3 * (c / n[:, 0] ** 5)[:, None, None] * p[:, :, None] * p[:, None, :]
    )


@torch.no_grad()
def clustering_hessian(net, out, lam1: float, lam2: float) -> torch.Tensor:
    """Block-diagonal exact Hessian of λ1 R1 + λ2 R2 w.r.t. P at this batch: (K, d, d)."""
    P = net.prototypes.weight.double()
    K, d = P.shape
    z = out.hidden.double().reshape(-1, d)  # (N, d)
    N = z.shape[0]
    H = torch.zeros(K, d, d, dtype=torch.float64)
    # R2 = mean_t (1 − cos(z_t, p_{top1(t)}))
    top1 = out.indices.reshape(N, -1)[:, 0]
    H.index_add_(0, top1, -(lam2 / N) * _cos_hessian(z, P[top1]))
    # R1 = mean_i (1 − max_t cos(p_i, z_t)), arg-max over this batch's tokens
    best = (F.normalize(P, dim=-1) @ F.normalize(z, dim=-1).T).argmax(1)  # (K,)
    H += -(lam1 / K) * _cos_hessian(z[best], P)
    return H


def _check_cos_hessian() -> float:
    g = torch.Generator().manual_seed(0)
    z, p = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    err = 0.0
    for r in range(3):
        h = torch.autograd.functional.hessian(lambda q, zr=z[r]: F.cosine_similarity(zr, q, dim=0), p[r])
        err = max(err, float((h - _cos_hessian(z[r : r + 1], p[r : r + 1])[0]).abs().max()))
    return err


def diagnostics(H: torch.Tensor, K: int, d: int, m: torch.Tensor, active: torch.Tensor, rho: float = 0.1) -> dict:
    """Block-diagonal mass share and condition numbers over the active prototypes' subspace, with the
    damping attribution uses: Λ = blockdiag(λ_i I), λ_i = ρ · tr(D_i)/d (D_i: the exact diagonal blocks)."""
    Hb = H.view(K, d, K, d)
    diag = torch.stack([Hb[i, :, i, :] for i in range(K)])  # (K, d, d)
    total = float((H**2).sum())
    dmass = float((diag**2).sum())
    ids = active.nonzero().squeeze(1).tolist()
    sel = torch.cat([torch.arange(i * d, (i + 1) * d) for i in ids])
    lam = torch.cat([torch.full((d,), rho * float(torch.diagonal(diag[i]).sum()) / d, dtype=H.dtype) for i in ids])
    Ha = H[sel][:, sel] + torch.diag(lam)
    ev = torch.linalg.eigvalsh(Ha)
    Da = torch.block_diag(*[diag[i] for i in ids]) + torch.diag(lam)
    de, dv = torch.linalg.eigh(Da)
    Dm = (dv * de.abs().clamp_min(1e-300).rsqrt()) @ dv.T
    evp = torch.linalg.eigvalsh(Dm @ Ha @ Dm)
    cond = lambda e: float(e.abs().max() / e.abs().min().clamp_min(1e-300))  # noqa: E731
    return {
        "diag_share": dmass / total if total else float("nan"),
        "active_prototypes": len(ids),
        "cond_active_damped": cond(ev),
        "min_eig_damped": float(ev.min()),
        "max_eig_damped": float(ev.max()),
        "cond_block_preconditioned": cond(evp),
        "block_preconditioned_eig_range": [float(evp.min()), float(evp.max())],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--lambdas",
        type=float,
        nargs="+",
        default=[0.0, 0.1, 0.3, 1.0, 3.0],
        help="clustering weights λ1 = λ2 to sweep",
    )
    ap.add_argument("--grid", action="store_true", help="sweep λ1 and λ2 independently (all pairs)")
    ap.add_argument("--steps", type=int, default=300, help="training steps per model")
    ap.add_argument("--tokens", type=int, default=2048, help="training tokens the matrices are averaged over")
    ap.add_argument("--quick", action="store_true", help="3 λ values, 100 steps, 512 tokens")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override of the tiny preset (d=32, K=64 by default: the matrix is (Kd)²)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.lambdas, args.steps, args.tokens = [0.0, 0.3, 3.0], 100, 512
    torch.set_num_threads(args.threads)
    out_path = (
        Path(args.out) if args.out else RESULTS_DIR / ("curvature-quick.json" if args.quick else "curvature.json")
    )
    env = environment("cpu", args.seed)
    t0 = time.perf_counter()
    err = _check_cos_hessian()
    assert err < 1e-10, f"analytic cosine Hessian disagrees with autograd ({err})"
    shards = prepare_shards(
        "builtin",
        "bpe-512",
        RUNS_DIR / "curvature" / "shards",
        max_docs=60,
        max_chars_per_doc=4000,
        show_progress=False,
    )
    pairs = [(a, b) for a in args.lambdas for b in args.lambdas] if args.grid else [(x, x) for x in args.lambdas]
    rows = []
    for lam1, lam2 in pairs:
        sets = {
            "train.max_steps": args.steps,
            "train.eval_interval": 100000,
            "train.batch_size": 8,
            "train.warmup_steps": max(1, args.steps // 20),
            "train.device": "cpu",
            "train.seed": 1337 + args.seed,
            "loss.lambda_r1": lam1,
            "loss.lambda_r2": lam2,
            **parse_sets(args.sets),
        }
        cfg = RunConfig.from_name("tiny").override(sets)
        run = RUNS_DIR / "curvature" / f"l1-{lam1:g}-l2-{lam2:g}-s{args.steps}-seed{args.seed}"
        if not (run / "checkpoints" / "latest").exists():
            train(cfg, run, shards=shards, progress=False)
        from prismlm.train import load_checkpoint

        net = load_checkpoint(run).model.double().eval()
        K, d, T = net.prototypes.num_prototypes, net.config.n_embd, net.config.block_size
        nseq = max(1, args.tokens // T)
        x = torch.from_numpy(shards.train.sequences(np.arange(nseq), T)[:, :-1])
        GN, out = gauss_newton(net, x)
        a = torch.zeros(x.numel(), K, dtype=torch.float64)
        a.scatter_(1, out.indices.reshape(x.numel(), -1), out.activations.double().reshape(x.numel(), -1))
        m = (a**2).mean(0)
        active = m > 0
        C = clustering_hessian(net, out, lam1, lam2)
        Hc = GN.clone()
        for i in range(K):
            Hc[i * d : (i + 1) * d, i * d : (i + 1) * d] += C[i]
        # shared form m_i F vs the exact diagonal blocks
        Fm = sum(GN.view(K, d, K, d)[i, :, i, :] for i in range(K))  # Σ_i blocks = E[(Σ a_i²) M_t] ≠ F in general
        W = net.lm_head.weight.double()
        with torch.no_grad():
            pi = torch.softmax(out.logits.double().reshape(x.numel(), -1), -1)
            mu = pi @ W
            Fm = (W.T * pi.mean(0)) @ W - mu.T @ mu / x.numel()
        blocks = torch.stack([GN.view(K, d, K, d)[i, :, i, :] for i in range(K)])
        rel = [float((blocks[i] - m[i] * Fm).norm() / blocks[i].norm()) for i in active.nonzero().squeeze(1).tolist()]
        co = a.T @ a / x.numel()  # E[a_i a_i']
        row = {
            "lambda_r1": lam1,
            "lambda_r2": lam2,
            "tokens": x.numel(),
            "K": K,
            "d": d,
            "active_per_token": float((a > 0).sum(1).double().mean()),
            "coactivation_offdiag_share": float(1 - (torch.diagonal(co) ** 2).sum() / (co**2).sum()),
            "shared_form_rel_error": float(np.mean(rel)),
            "gn": diagnostics(GN, K, d, m, active),
            "gn_plus_clustering": diagnostics(Hc, K, d, m, active),
        }
        rows.append(row)
        log(
            f"λ1={lam1:g} λ2={lam2:g}: diag share GN {row['gn']['diag_share']:.3f} (+C "
            f"{row['gn_plus_clustering']['diag_share']:.3f}); cond(D^-½HD^-½) {row['gn']['cond_block_preconditioned']:.3g}; "
            f"active {row['gn']['active_prototypes']}/{K}"
        )
    payload = {
        "benchmark": "curvature",
        "rows": rows,
        "settings": vars(args),
        "cos_hessian_check_max_err": err,
        "environment": env,
        "load_average_end": load_average(),
        "seconds": time.perf_counter() - t0,
    }
    write_json(out_path, payload)
    png = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        lam = [r["lambda_r1"] + 1e-3 for r in rows if r["lambda_r1"] == r["lambda_r2"]]
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        for key, lab in (("gn", "GN"), ("gn_plus_clustering", "GN + clustering")):
            sel = [r for r in rows if r["lambda_r1"] == r["lambda_r2"]]
            ax[0].plot(lam, [r[key]["diag_share"] for r in sel], "o-", label=lab)
            ax[1].plot(lam, [r[key]["cond_block_preconditioned"] for r in sel], "o-", label=lab)
        ax[0].set(xscale="log", xlabel="λ1 = λ2 (+1e-3)", ylabel="diagonal-block mass share")
        ax[1].set(xscale="log", yscale="log", xlabel="λ1 = λ2 (+1e-3)", ylabel="cond(D^-1/2 H D^-1/2)")
        ax[0].legend()
        fig.tight_layout()
        png = out_path.with_suffix(".png")
        fig.savefig(png, dpi=120)
    except ImportError:
        pass
    print(
        "curvature: "
        + "; ".join(
            f"λ={r['lambda_r1']:g}/{r['lambda_r2']:g} diag {r['gn']['diag_share']:.2f}→{r['gn_plus_clustering']['diag_share']:.2f} "
            f"κ_pre {r['gn']['cond_block_preconditioned']:.2g}"
            for r in rows
        )
        + f" → {out_path}"
        + (f", {png}" if png else "")
    )


if __name__ == "__main__":
    main()
