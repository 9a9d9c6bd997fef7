#!/usr/bin/env python
"""Sparse controllers on multiple-choice tasks: PRISM prototypes vs TopK-SAE latents of the dense baseline
(spec §4; paper: +2.72 points average over four tasks for PRISM vs +0.32 for the SAE controller).

What is run, in one process, on the same inputs:
 1. Token shards of the built-in corpus (first ``--docs`` documents, bpe-4096); a PRISM model and its
    matched dense baseline (same backbone config, same seed) trained for the same steps.
 2. A TopK SAE with the same K and k as PRISM's bank, trained on the dense model's final hidden states.
 3. The four tasks of ``prismlm.eval.tasks`` (train/validation/test). For each task and each side:
    base accuracy on test (c = 0), a controller fitted on train with the LM frozen (λ chosen on
    validation from ``--l1``), accuracy on test after. Next to it the *choice-prior* baseline: one
    learned bias per choice string on top of the same base scores (no reading of the query), i.e. how
    much of a controller's gain a label preference alone gives. For PRISM the test accuracy after is also
    measured through the model's own forward (``with model.control(c)`` + our scorer) and must agree
    with the cached-feature computation.
 4. Each non-zero PRISM coefficient of each task is traced to its prototype (signature tokens, the task
    training examples where it is most active).

Output: JSON at ``--out`` (default ``bench/results/control[-quick].json``) and one summary line.
``--quick``: tiny models (~5 min); default: small models (2,400 steps each) in ~20 min on 2 idle cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, parse_sets, write_json

from prismlm.config import RunConfig
from prismlm.control.controller import (
    accuracy,
    correct,
    extract_features,
    fit_and_test,
    fit_choice_prior,
    prism_encoder,
    request_scores,
    trace_prism_controller,
)
from prismlm.control.sae import train_sae
from prismlm.data.shards import prepare_shards
from prismlm.eval.scoring import mc_accuracy
from prismlm.eval.stats import paired_stats
from prismlm.eval.tasks import TASKS, build_task
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


def main() -> None:
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
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = args.size or ("quick" if args.quick else "small")
    overrides, docs, steps, caps = SIZES[size]
    steps, docs = args.steps or steps, args.docs or docs
    t0 = time.time()
    env = environment("cpu", args.seed)
    root = RUNS_DIR / f"control-{size}"
    shards = prepare_shards("builtin", "bpe-4096", root / f"shards-{docs}", max_docs=docs, show_progress=False)
    tok = shards.tokenizer
    base = RunConfig.from_name("cpu-small").override(
        {
            **overrides,
            "train.max_steps": steps,
            "train.device": "cpu",
            "train.num_threads": args.threads,
            "train.seed": 1337 + args.seed,
            "data.tokenizer": "bpe-4096",
            **parse_sets(args.set),
        }
    )
    models, train_s, train_metrics = {}, {}, {}
    for name, cfg in (("prism", base), ("dense", base.dense())):
        t = time.time()
        res = train(cfg, root / name, shards=shards, progress=False)
        train_s[name] = time.time() - t
        train_metrics[name] = res.metrics
        models[name] = res.model.eval()
        print(
            f"[control] {name}: {steps} steps in {train_s[name]:.0f}s, val ppl {res.metrics.get('val_ppl', 0):.1f}",
            file=sys.stderr,
        )
    prism, dense = models["prism"], models["dense"]
    K, k = prism.prototypes.num_prototypes, prism.prototypes.cfg.top_k
    t = time.time()
    sae_res = train_sae(
        dense, shards, num_latents=K, k=k, steps=args.sae_steps or 2 * steps, batch_size=8, seed=args.seed
    )
    sae_s = time.time() - t
    sae = sae_res.sae
    print(
        f"[control] SAE K={K} k={k}: FVU {sae_res.fvu:.3f}, dead {sae_res.dead_fraction:.2f} ({sae_s:.0f}s)",
        file=sys.stderr,
    )

    def sae_encoder(z: torch.Tensor):
        with torch.no_grad():
            return sae.encode(z.float())

    rows = {}
    for task in args.tasks:
        t = time.time()
        splits = build_task(task, caps)
        row: dict = {"n": {s: len(v) for s, v in splits.items()}}
        for side, model, enc, directions in (
            ("prism", prism, prism_encoder(prism), prism.prototypes.weight),
            ("sae", dense, sae_encoder, sae.directions),
        ):
            feats = {s: extract_features(model, tok, d, enc) for s, d in splits.items()}
            W = model.lm_head.weight
            res = fit_and_test(feats, W, directions, l1_grid=args.l1, steps=args.ctl_steps, lr=args.ctl_lr)
            ctl, trials, s0, s1 = res.controller, res.trials, res.test_scores_before, res.test_scores_after
            before, after = res.before, res.after
            prior = fit_choice_prior(
                feats["train"], request_scores(feats["train"], W.double(), directions.double(), None)
            )
            prior_acc = accuracy(feats["test"], prior.scores(feats["test"], s0))
            r = {
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
            row[side] = r
        row["seconds"] = time.time() - t
        rows[task] = row
        print(
            f"[control] {task}: PRISM {row['prism']['test_before']['acc']:.3f} → {row['prism']['test_after']['acc']:.3f} "
            f"({row['prism']['nonzero']} nz) | SAE {row['sae']['test_before']['acc']:.3f} → "
            f"{row['sae']['test_after']['acc']:.3f} ({row['sae']['nonzero']} nz) | McNemar p PRISM "
            f"{row['prism']['paired']['mcnemar_p']:.3f} SAE {row['sae']['paired']['mcnemar_p']:.3f} [{row['seconds']:.0f}s]",
            file=sys.stderr,
        )
    avg = {side: 100 * sum(r[side]["delta_acc"] for r in rows.values()) / len(rows) for side in ("prism", "sae")}
    avg_prior = {
        side: 100 * sum(r[side]["delta_acc_choice_prior"] for r in rows.values()) / len(rows)
        for side in ("prism", "sae")
    }
    payload = {
        "benchmark": "control",
        "size": size,
        "steps": steps,
        "docs": docs,
        "config": base.to_dict(),
        "environment": env,
        "train_seconds": train_s,
        "train_metrics": train_metrics,
        "sae": {
            "num_latents": K,
            "k": k,
            "fvu": sae_res.fvu,
            "dead_fraction": sae_res.dead_fraction,
            "steps": sae_res.steps,
            "seconds": sae_s,
        },
        "tasks": rows,
        "avg_delta_points": avg,
        "avg_delta_points_choice_prior": avg_prior,
        "paper_avg_delta_points": {"prism": 2.72, "sae": 0.32},
        "total_seconds": time.time() - t0,
        "load_average_end": load_average(),
    }
    out = args.out or RESULTS_DIR / f"control{'-quick' if size == 'quick' else ''}.json"
    write_json(out, payload)
    per = "; ".join(
        f"{t} P {100 * r['prism']['test_before']['acc']:.1f}→{100 * r['prism']['test_after']['acc']:.1f} "
        f"({r['prism']['nonzero']}, prior {100 * r['prism']['choice_prior']['acc']:.1f}) S "
        f"{100 * r['sae']['test_before']['acc']:.1f}→{100 * r['sae']['test_after']['acc']:.1f} "
        f"({r['sae']['nonzero']}, prior {100 * r['sae']['choice_prior']['acc']:.1f})"
        for t, r in rows.items()
    )
    print(
        f"control[{size}]: avg Δacc PRISM {avg['prism']:+.2f} pts vs SAE {avg['sae']:+.2f} pts (paper +2.72 vs +0.32); "
        f"choice-prior baseline PRISM {avg_prior['prism']:+.2f} SAE {avg_prior['sae']:+.2f}; "
        f"{per}; {payload['total_seconds']:.0f}s → {out}"
    )


if __name__ == "__main__":
    main()
