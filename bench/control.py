#!/usr/bin/env python
"""Sparse controllers on multiple-choice tasks: PRISM prototypes vs TopK-SAE latents of the dense baseline
(spec §4; paper: +2.72 points average over four tasks for PRISM vs +0.32 for the SAE controller).

In one process, on the same inputs: a PRISM model and its matched dense baseline trained on the built-in corpus
for the same steps; a TopK SAE with PRISM's K and k on the dense model's hidden states; then for each task of
``prismlm.eval.tasks`` and each side, test accuracy before and after a controller fitted on train with the LM
frozen (λ chosen on validation from ``--l1``), beside the choice-prior baseline (one bias per choice string),
the paired statistics, PRISM's accuracy through its own forward (``with model.control(c)``, must agree) and the
trace of each non-zero PRISM coefficient to its prototype.

Run: ``PYTHONPATH=src python bench/control.py [--quick]`` (``--quick``: tiny models, ~5 min; default ~20 min on
2 idle cores). Writes ``bench/results/control[-quick].json`` and one summary line; the measurements:
docs/results.md (controllers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _common import (
    RESULTS_DIR,
    RUNS_DIR,
    Json,
    add_set_option,
    environment,
    load_average,
    num,
    obj,
    parse_sets,
    write_json,
)

from prismlm.config import RunConfig
from prismlm.control.controller import (
    ControlFeatures,
    Encoder,
    accuracy,
    correct,
    extract_features,
    fit_and_test,
    fit_choice_prior,
    prism_encoder,
    request_scores,
    trace_prism_controller,
)
from prismlm.control.sae import SAEResult, train_sae
from prismlm.data.shards import ShardSet, prepare_shards
from prismlm.data.tokenizer import Tokenizer
from prismlm.eval.scoring import mc_accuracy
from prismlm.eval.stats import paired_stats
from prismlm.eval.tasks import TASKS, MCExample, build_task
from prismlm.model import PrismLM
from prismlm.train.trainer import train

SIZES = {
    "quick": (
        {
            "model.n_layer": 2,
            "model.n_head": 2,
            "model.n_embd": 64,
            "model.block_size": 128,
            "model.prototypes.num_prototypes": 256,
            "model.prototypes.top_k": 8,
            "train.batch_size": 8,
            "train.eval_interval": 10000,
            "train.eval_batches": 4,
            "loss.warmup_steps": 50,
        },
        150,
        400,
        {"train": 160, "validation": 80, "test": 200},
    ),
    "small": (
        {
            "model.n_layer": 4,
            "model.n_head": 4,
            "model.n_embd": 128,
            "model.block_size": 128,
            "model.prototypes.num_prototypes": 512,
            "model.prototypes.top_k": 8,
            "train.batch_size": 8,
            "train.eval_interval": 10000,
            "train.eval_batches": 4,
        },
        400,
        2400,
        {"train": 300, "validation": 100, "test": 300},
    ),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", choices=sorted(SIZES), default=None)
    ap.add_argument("--steps", type=int, default=None, help="LM training steps (each model)")
    ap.add_argument("--docs", type=int, default=None, help="built-in documents to train on")
    ap.add_argument("--tasks", nargs="*", default=list(TASKS))
    ap.add_argument("--l1", type=float, nargs="*", default=[3e-3, 1e-2, 3e-2])
    ap.add_argument("--ctl-steps", type=int, default=60)
    ap.add_argument("--ctl-lr", type=float, default=0.1)
    ap.add_argument("--sae-steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    add_set_option(ap)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def train_models(
    args: argparse.Namespace, base: RunConfig, root: Path, shards: ShardSet, steps: int
) -> tuple[dict[str, PrismLM], dict[str, float], dict[str, object]]:
    """PRISM and its dense twin, trained the same steps: the models, seconds and final metrics."""
    models: dict[str, PrismLM] = {}
    train_s: dict[str, float] = {}
    train_metrics: dict[str, object] = {}
    for name, cfg in (("prism", base), ("dense", base.dense())):
        t = time.time()
        res = train(cfg, root / name, shards=shards, progress=False)
        train_s[name] = time.time() - t
        train_metrics[name] = res.metrics
        assert res.model is not None
        models[name] = res.model.eval()
        print(
            f"[control] {name}: {steps} steps in {train_s[name]:.0f}s, val ppl {res.metrics.get('val_ppl', 0):.1f}",
            file=sys.stderr,
        )
    return models, train_s, train_metrics


def side_row(
    args: argparse.Namespace,
    side: str,
    model: PrismLM,
    tok: Tokenizer,
    enc: Encoder,
    directions: torch.Tensor,
    splits: dict[str, list[MCExample]],
) -> Json:
    """One side of one task: accuracy before and after its controller, the choice prior, the paired statistics;
    for PRISM also the forward check and the trace."""
    feats: dict[str, ControlFeatures] = {s: extract_features(model, tok, d, enc) for s, d in splits.items()}
    W = model.lm_head.weight
    res = fit_and_test(feats, W, directions, l1_grid=args.l1, steps=args.ctl_steps, lr=args.ctl_lr)
    ctl, trials, s0, s1 = res.controller, res.trials, res.test_scores_before, res.test_scores_after
    before, after = res.before, res.after
    prior = fit_choice_prior(feats["train"], request_scores(feats["train"], W.double(), directions.double(), None))
    prior_acc = accuracy(feats["test"], prior.scores(feats["test"], s0))
    r: Json = {
        "test_before": before,
        "test_after": after,
        "delta_acc": after["acc"] - before["acc"],
        "choice_prior": prior_acc,
        "delta_acc_choice_prior": prior_acc["acc"] - before["acc"],
        "paired": paired_stats(correct(feats["test"], s0), correct(feats["test"], s1), seed=args.seed),
        "nonzero": len(ctl.nonzero),
        "l1": ctl.l1,
        "selection": trials,
    }
    if side == "prism":
        # the same numbers through the model's own forward pass
        fwd_before = mc_accuracy(model, tok, splits["test"]).to_dict()
        with model.control(ctl.coefficients.to(torch.float32)):
            fwd_after = mc_accuracy(model, tok, splits["test"]).to_dict()
        r["forward_check"] = {"before": fwd_before, "after": fwd_after}
        r["trace"] = trace_prism_controller(model, tok, ctl, feats["train"], splits["train"], top=10)
    return r


def task_row(
    args: argparse.Namespace,
    task: str,
    caps: dict[str, int],
    prism: PrismLM,
    dense: PrismLM,
    sae: SAEResult,
    tok: Tokenizer,
) -> Json:
    t = time.time()
    splits = build_task(task, caps)
    row: Json = {"n": {s: len(v) for s, v in splits.items()}}

    def sae_encoder(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return sae.sae.encode(z.float())

    for side, model, enc, directions in (
        ("prism", prism, prism_encoder(prism), prism.require_prototypes().weight),
        ("sae", dense, sae_encoder, sae.sae.directions),
    ):
        row[side] = side_row(args, side, model, tok, enc, directions, splits)
    row["seconds"] = time.time() - t
    p, s = obj(row, "prism"), obj(row, "sae")
    print(
        f"[control] {task}: PRISM {num(p, 'test_before', 'acc'):.3f} → {num(p, 'test_after', 'acc'):.3f} "
        f"({p['nonzero']} nz) | SAE {num(s, 'test_before', 'acc'):.3f} → {num(s, 'test_after', 'acc'):.3f} "
        f"({s['nonzero']} nz) | McNemar p PRISM {num(p, 'paired', 'mcnemar_p'):.3f} SAE "
        f"{num(s, 'paired', 'mcnemar_p'):.3f} [{num(row, 'seconds'):.0f}s]",
        file=sys.stderr,
    )
    return row


def summary_line(
    size: str, rows: dict[str, Json], avg: dict[str, float], avg_prior: dict[str, float], total: float, out: Path
) -> str:
    def pct(r: Json, side: str, *keys: str) -> str:
        return f"{100 * num(r, side, *keys):.1f}"

    per = "; ".join(
        f"{t} P {pct(r, 'prism', 'test_before', 'acc')}→{pct(r, 'prism', 'test_after', 'acc')} "
        f"({obj(r, 'prism')['nonzero']}, prior {pct(r, 'prism', 'choice_prior', 'acc')}) S "
        f"{pct(r, 'sae', 'test_before', 'acc')}→{pct(r, 'sae', 'test_after', 'acc')} "
        f"({obj(r, 'sae')['nonzero']}, prior {pct(r, 'sae', 'choice_prior', 'acc')})"
        for t, r in rows.items()
    )
    return (
        f"control[{size}]: avg Δacc PRISM {avg['prism']:+.2f} pts vs SAE {avg['sae']:+.2f} pts (paper +2.72 vs +0.32); "
        f"choice-prior baseline PRISM {avg_prior['prism']:+.2f} SAE {avg_prior['sae']:+.2f}; "
        f"{per}; {total:.0f}s → {out}"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    size = args.size or ("quick" if args.quick else "small")
    overrides, docs, steps, caps = SIZES[size]
    steps, docs = args.steps or steps, args.docs or docs
    t0 = time.time()
    env = environment("cpu", args.seed)
    root = RUNS_DIR / f"control-{size}"
    shards = prepare_shards("builtin", "bpe-4096", root / f"shards-{docs}", max_docs=docs, show_progress=False)
    base = RunConfig.from_name("cpu-small").override(
        {
            **overrides,
            "train.max_steps": steps,
            "train.device": "cpu",
            "train.num_threads": args.threads,
            "train.seed": 1337 + args.seed,
            "data.tokenizer": "bpe-4096",
            **parse_sets(args.sets),
        }
    )
    models, train_s, train_metrics = train_models(args, base, root, shards, steps)
    prism, dense = models["prism"], models["dense"]
    K, k = prism.require_prototypes().num_prototypes, prism.require_prototypes().cfg.top_k
    t = time.time()
    sae_res = train_sae(
        dense, shards, num_latents=K, k=k, steps=args.sae_steps or 2 * steps, batch_size=8, seed=args.seed
    )
    sae_s = time.time() - t
    print(
        f"[control] SAE K={K} k={k}: FVU {sae_res.fvu:.3f}, dead {sae_res.dead_fraction:.2f} ({sae_s:.0f}s)",
        file=sys.stderr,
    )
    rows = {task: task_row(args, task, caps, prism, dense, sae_res, shards.tokenizer) for task in args.tasks}
    sides = ("prism", "sae")
    avg = {side: 100 * sum(num(r, side, "delta_acc") for r in rows.values()) / len(rows) for side in sides}
    avg_prior = {
        side: 100 * sum(num(r, side, "delta_acc_choice_prior") for r in rows.values()) / len(rows) for side in sides
    }
    sae_rec = {"num_latents": K, "k": k, "fvu": sae_res.fvu, "dead_fraction": sae_res.dead_fraction}
    payload = {
        "benchmark": "control",
        "size": size,
        "steps": steps,
        "docs": docs,
        "config": base.to_dict(),
        "environment": env,
        "train_seconds": train_s,
        "train_metrics": train_metrics,
        "sae": {**sae_rec, "steps": sae_res.steps, "seconds": sae_s},
        "tasks": rows,
        "avg_delta_points": avg,
        "avg_delta_points_choice_prior": avg_prior,
        "paper_avg_delta_points": {"prism": 2.72, "sae": 0.32},
        "total_seconds": time.time() - t0,
        "load_average_end": load_average(),
    }
    out = args.out or RESULTS_DIR / f"control{'-quick' if size == 'quick' else ''}.json"
    write_json(out, payload)
    print(summary_line(size, rows, avg, avg_prior, num(payload, "total_seconds"), out))


if __name__ == "__main__":
    main()
