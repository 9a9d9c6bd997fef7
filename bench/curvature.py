#!/usr/bin/env python
"""Hessian diagnostics in prototype space (spec §3.2): does clustering localise curvature?

For tiny PRISM models trained with growing clustering weights (λ1 = ``loss.lambda_r1``, λ2 = ``loss.lambda_r2``;
same seed, data and steps otherwise), on ``--tokens`` training tokens: the exact prototype-space Gauss–Newton
matrix ``GN`` (Kd × Kd) of the mean token CE and the exact Hessian ``C`` of λ1·R1 + λ2·R2 (block-diagonal,
analytic, checked against autograd); for ``GN`` and ``GN + C`` the share of squared Frobenius mass in the
diagonal blocks, damped condition numbers (also after the block-diagonal preconditioner), the error of the
shared form m_i F; and the prototypes' co-usage. The paper's claim: ``diag_share`` grows and
``cond_block_preconditioned`` falls towards 1 as λ grows; whatever the numbers say is reported.

Run: ``PYTHONPATH=src python bench/curvature.py [--quick] [--grid]``. Writes ``bench/results/curvature[-quick].json``,
a PNG beside it (with matplotlib) and one summary line; the definitions in full and the measurements:
docs/results.md (curvature).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _common import (
    RESULTS_DIR,
    RUNS_DIR,
    Json,
    add_set_option,
    environment,
    load_average,
    log,
    num,
    obj,
    parse_sets,
    write_json,
)

from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, prepare_shards
from prismlm.model import PrismLM
from prismlm.model.outputs import PrismOutput
from prismlm.train import load_checkpoint, train


@torch.no_grad()
def gauss_newton(net: PrismLM, x: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, PrismOutput]:
    """Exact (Kd × Kd) prototype-space GN of the mean token CE over inputs x (B, T), float64."""
    out = net(x)
    K, d = net.require_prototypes().num_prototypes, net.config.n_embd
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
def clustering_hessian(net: PrismLM, out: PrismOutput, lam1: float, lam2: float) -> torch.Tensor:
    """Block-diagonal exact Hessian of λ1 R1 + λ2 R2 w.r.t. P at this batch: (K, d, d)."""
    P = net.require_prototypes().weight.double()
    K, d = P.shape
    z = out.hidden.double().reshape(-1, d)  # (N, d)
    N = z.shape[0]
    H = torch.zeros(K, d, d, dtype=torch.float64)
    assert out.indices is not None  # a PRISM forward
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


def parse_args() -> argparse.Namespace:
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
    add_set_option(ap, "config override of the tiny preset (d=32, K=64 by default: the matrix is (Kd)²)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.lambdas, args.steps, args.tokens = [0.0, 0.3, 3.0], 100, 512
    return args


def trained(args: argparse.Namespace, shards: ShardSet, lam1: float, lam2: float) -> PrismLM:
    """The tiny model trained with clustering weights (λ1, λ2) (cached under bench/runs/curvature), float64."""
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
    return load_checkpoint(run).model.double().eval()


def measure(net: PrismLM, x: torch.Tensor, lam1: float, lam2: float) -> Json:
    """The diagnostics of one model on inputs x (B, T)."""
    K, d = net.require_prototypes().num_prototypes, net.config.n_embd
    GN, out = gauss_newton(net, x)
    assert out.indices is not None and out.activations is not None
    a = torch.zeros(x.numel(), K, dtype=torch.float64)
    a.scatter_(1, out.indices.reshape(x.numel(), -1), out.activations.double().reshape(x.numel(), -1))
    m = (a**2).mean(0)
    active = m > 0
    C = clustering_hessian(net, out, lam1, lam2)
    Hc = GN.clone()
    for i in range(K):
        Hc[i * d : (i + 1) * d, i * d : (i + 1) * d] += C[i]
    # the shared form m_i F vs the exact diagonal blocks
    W = net.lm_head.weight.double()
    with torch.no_grad():
        pi = torch.softmax(out.logits.double().reshape(x.numel(), -1), -1)
        mu = pi @ W
        Fm = (W.T * pi.mean(0)) @ W - mu.T @ mu / x.numel()
    blocks = torch.stack([GN.view(K, d, K, d)[i, :, i, :] for i in range(K)])
    rel = [float((blocks[i] - m[i] * Fm).norm() / blocks[i].norm()) for i in active.nonzero().squeeze(1).tolist()]
    co = a.T @ a / x.numel()  # E[a_i a_i']
    return {
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


def plot(rows: list[Json], out_path: Path) -> Path | None:
    """diag share and preconditioned condition number against λ1 = λ2 (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sel = [r for r in rows if r["lambda_r1"] == r["lambda_r2"]]
    lam = [num(r, "lambda_r1") + 1e-3 for r in sel]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    for key, lab in (("gn", "GN"), ("gn_plus_clustering", "GN + clustering")):
        ax[0].plot(lam, [num(r, key, "diag_share") for r in sel], "o-", label=lab)
        ax[1].plot(lam, [num(r, key, "cond_block_preconditioned") for r in sel], "o-", label=lab)
    ax[0].set(xscale="log", xlabel="λ1 = λ2 (+1e-3)", ylabel="diagonal-block mass share")
    ax[1].set(xscale="log", yscale="log", xlabel="λ1 = λ2 (+1e-3)", ylabel="cond(D^-1/2 H D^-1/2)")
    ax[0].legend()
    fig.tight_layout()
    png = out_path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    return png


def main() -> None:
    args = parse_args()
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
        net = trained(args, shards, lam1, lam2)
        T = net.config.block_size
        x = torch.from_numpy(shards.train.sequences(np.arange(max(1, args.tokens // T)), T)[:, :-1])
        row = measure(net, x, lam1, lam2)
        rows.append(row)
        gn, gc = obj(row, "gn"), obj(row, "gn_plus_clustering")
        log(
            f"λ1={lam1:g} λ2={lam2:g}: diag share GN {num(gn, 'diag_share'):.3f} (+C {num(gc, 'diag_share'):.3f}); "
            f"cond(D^-½HD^-½) {num(gn, 'cond_block_preconditioned'):.3g}; active {gn['active_prototypes']}/{row['K']}"
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
    png = plot(rows, out_path)
    print(
        "curvature: "
        + "; ".join(
            f"λ={r['lambda_r1']:g}/{r['lambda_r2']:g} diag {num(r, 'gn', 'diag_share'):.2f}→"
            f"{num(r, 'gn_plus_clustering', 'diag_share'):.2f} κ_pre {num(r, 'gn', 'cond_block_preconditioned'):.2g}"
            for r in rows
        )
        + f" → {out_path}"
        + (f", {png}" if png else "")
    )


if __name__ == "__main__":
    main()
