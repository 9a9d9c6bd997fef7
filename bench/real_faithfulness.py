"""Faithfulness of the prototype head on SmolLM2-135M-Instruct (issue 33): would the prototypes alone have
predicted the model's token? Stage 2 on stored boundary activations, long and resumable.

    python bench/real_faithfulness.py --stage stage2 --threads 1    # the long run (run again to continue)
    python bench/real_faithfulness.py --stage curve                 # held-out numbers of its latest checkpoint
    python bench/real_faithfulness.py --stage speed --threads 2     # tokens/s: stored stage 2 vs per-step, same N
    python bench/real_faithfulness.py --stage frozen --lever kl     # a frozen head lever on the run's stored z
    python bench/real_faithfulness.py --stage measure --checkpoint C --name N   # held-out text + chat answers
    python bench/real_faithfulness.py --stage summary               # bench/results/real-faithfulness.json

Runs live under bench/runs/real-faithfulness/; results and their commands: docs/results.md ("Faithfulness").
"""

from __future__ import annotations

import argparse
import json
import lzma
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, write_json

from prismlm.app import Run
from prismlm.app.retrofit import RetrofitRecipe, resume_retrofit, retrofit_model
from prismlm.config import PrototypeConfig, RunConfig, replace
from prismlm.data.chat_anchor import CHAT_FILE, read_chat_answers
from prismlm.data.corpus import BUILTIN_DIR
from prismlm.data.shards import ShardSet
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import CheckpointError
from prismlm.eval.faithfulness import FaithfulnessAccumulator, answer_faithfulness, fit_yardstick
from prismlm.eval.faithfulness_summary import faithfulness_goals, faithfulness_summary
from prismlm.eval.metrics import evaluate
from prismlm.model import PrismLM
from prismlm.model.pretrained import build_model, load_pretrained
from prismlm.model.prototypes import seed_prototypes
from prismlm.model.stored_activations import StoredZ, build_stored_z, open_stored_z
from prismlm.train.bank_stage import bank_losses, train_bank
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint
from prismlm.train.retrofit import seed_sequences
from prismlm.train.sampler import SequenceSampler
from prismlm.train.stage2 import heldout_stage2_metrics, stage2_losses, stage2_step
from prismlm.train.state import build_optimizer, set_trainable, trainable_names

SOURCE = "smollm2-135m-instruct"
ROOT = RUNS_DIR / "real-faithfulness"  # --root overrides it (the GPU campaign writes under its OUT_DIR)
CURVE = RESULTS_DIR / "real-faithfulness-curve.json"


def anchor(args: argparse.Namespace) -> list[str]:
    """Every built-in document (books, speeches, the shipped chat answers), cut to its first
    ``--anchor-chars`` characters (2,000: the sweep's 33k training tokens; the long run reads more)."""
    return [f"data.max_chars_per_doc={args.anchor_chars}", "data.val_fraction=0.05"]


def recipe(args: argparse.Namespace) -> RetrofitRecipe:
    return RetrofitRecipe(
        steps=args.frozen_steps + args.steps,
        frozen_steps=args.frozen_steps,
        corpus="builtin:gutenberg+sotu+chat",
        unfreeze=f"last-{args.last}",
        prototypes=args.prototypes,
        top_k=args.top_k,
        lr=args.lr,
        backbone_lr_ratio=args.block_lr / args.lr,
        batch_size=args.batch_size,
        block_size=256,
    )


def run_dir(args: argparse.Namespace) -> Path:
    cand = f"-c{args.kl_candidates}" if args.kl_candidates else ""
    chars = f"-A{args.anchor_chars}" if args.anchor_chars != 2000 else ""
    return args.root / f"stage2-K{args.prototypes}-k{args.top_k}-N{args.last}-a{args.alpha:g}{cand}{chars}"


def overrides(args: argparse.Namespace) -> list[str]:
    return [
        *anchor(args),
        f"loss.lambda_proto_kl={args.alpha}",
        f"loss.kl_candidates={args.kl_candidates}",
        "train.eval_interval=200",
        "train.ckpt_interval=50",
        "train.log_interval=10",
        "train.eval_batches=4",
        f"train.num_threads={args.threads}",
        *args.set,
    ]


def stage2_main(args: argparse.Namespace) -> None:
    """Start the long run, or continue it from its latest checkpoint (the same command after a kill)."""
    out = run_dir(args)
    t0 = time.perf_counter()
    try:
        find_checkpoint(out)
        result = resume_retrofit(out, steps=args.frozen_steps + args.steps, device=args.device)
    except CheckpointError:
        out.parent.mkdir(parents=True, exist_ok=True)
        result = retrofit_model(
            args.source, out=out, recipe=recipe(args), overrides=overrides(args), device=args.device
        )
    print(f"stage2: step {result.step} in {time.perf_counter() - t0:.0f} s → {out}")


def heldout_store(args: argparse.Namespace, out: Path) -> StoredZ:
    """The source model's stored z and boundary activations over the run's validation split (made once)."""
    path = args.root / f"val-store-L{30 - args.last}"
    try:
        return open_stored_z(path).check()
    except Exception:  # noqa: BLE001 (absent or unfinished: build or finish it)
        pre = load_pretrained(args.source, block_size=256)
        source = build_model(pre, pre.model)
        shards = Run.open(out, device="cpu").shards()
        return build_stored_z(
            source, shards, path, split="val", dtype="float32", batch_size=4, max_sequences=args.heldout_sequences,
            boundary_layer=30 - args.last,
        )  # fmt: skip


def curve_main(args: argparse.Namespace) -> None:
    """Held-out numbers of the run's latest checkpoint (stored path), appended to the curve file."""
    torch.set_num_threads(args.threads)
    out = run_dir(args)
    store = heldout_store(args, out)
    ckpt = load_checkpoint(args.checkpoint if args.checkpoint is not None else out)  # default: the latest
    step = int(ckpt.manifest["step"])
    yardstick = fit_yardstick(store.hidden(np.arange(8)), args.top_k)  # the source's z: one for every point
    got = heldout_stage2_metrics(
        ckpt.model, store, 30 - args.last, max_sequences=args.heldout_sequences, yardstick=yardstick
    )
    tokens_per_step = args.batch_size * 256
    point = {"step": step, "stage2_tokens": max(0, step - args.frozen_steps) * tokens_per_step, **got}
    curve = json.loads(args.curve.read_text()) if args.curve.exists() else {"points": []}
    curve["points"] = [p for p in curve["points"] if p["step"] != step] + [point]
    curve["points"].sort(key=lambda p: p["step"])
    recipe_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    curve["run"] = {"folder": str(out), "recipe": recipe_args, "overrides": overrides(args)}
    curve["environment"] = environment("cpu", 0)
    write_json(args.curve, curve)
    print(f"curve: step {step} top1 {got['top1_agreement']:.3f} kl {got['kl']:.3f} margin {got['margin_share']:.3f} "
          f"(pca {got['pca_margin_share']:.3f}) CE {got['ce']:.4f} (source {got['ce_source']:.4f}) "
          f"top1 vs source {got['top1_vs_source']:.3f}")  # fmt: skip


def speed_batch(batch_size: int, tok: Tokenizer) -> torch.Tensor:
    """(batch_size, 257) token ids of consecutive windows of a shipped book (real text: how many distinct
    tokens the source ranks high — the candidate set's size — depends on it)."""
    text = lzma.decompress((BUILTIN_DIR / "austen-emma.txt.xz").read_bytes()).decode("utf-8")
    ids = tok.encode(text[20_000:200_000])
    return torch.tensor(ids[: batch_size * 257]).reshape(batch_size, 257)


def speed_main(args: argparse.Namespace) -> None:
    """Stage-2 step time at N=args.last, interleaved round by round on one batch of real text (batch_size ×
    256 tokens, the same trainable parameters, K=512, k=8): a step on stored boundary activations
    (``stage2_losses``: N blocks; KL to the source over the whole vocabulary, or over the candidate set of
    ``loss.kl_candidates`` = c, ranked in the step or read as ranked once after the z pass) against today's
    per-step path (the whole model's forward, CE; backward through the last N blocks), each without and with
    the prototype-only KL. Forward + backward, no optimizer step. The one-off ranking is timed apart."""
    torch.set_num_threads(args.threads)
    pre = load_pretrained(args.source, block_size=256)
    model = build_model(pre, replace(pre.model, prototypes=PrototypeConfig(num_prototypes=512, top_k=8))).train()
    set_trainable(model, trainable_names(model, f"last-{args.last}"))
    layer, x = 30 - args.last, speed_batch(args.batch_size, pre.tokenizer)
    with torch.no_grad():
        bo = model.backbone_outputs(x[:, :-1], output_hidden_states=True)
        t0 = time.perf_counter()
        ranked = model.lm_head(bo.z.reshape(-1, pre.model.n_embd)).topk(max(args.candidates), -1).indices
        ranking_seconds = time.perf_counter() - t0  # once per stored token (build_stored_candidates)
        union = {c: int(ranked[:, :c].unique().numel()) for c in args.candidates}
    assert bo.hidden_states is not None
    h = bo.hidden_states[layer].half().float()  # as read from a float16 store
    base = {"rec": 1.0, "r1": 0.5, "r2": 0.5}

    def stored(alpha: float, c: int, ids: torch.Tensor | None = None) -> None:
        terms = stage2_losses(model, h, bo.z, layer, proto_kl=alpha > 0, candidates=c, candidate_ids=ids)
        loss = terms["source_kl"] + sum(w * terms[k] for k, w in {**base, "proto_kl": alpha}.items() if k in terms)
        loss.backward()

    def per_step(alpha: float, c: int) -> None:
        out = model(x[:, :-1], x[:, 1:], loss_weights={"ce": 1.0, **base, "proto_kl": alpha})
        assert out.loss is not None
        out.loss.backward()

    def read(alpha: float, c: int) -> None:
        stored(alpha, c, ranked)

    sides: list[tuple[str, Callable[[float, int], None], int]] = [("per_step", per_step, 0), ("stored", stored, 0)]
    for c in args.candidates:
        sides += [(f"stored_c{c}", stored, c), (f"ranked_c{c}", read, c)]
    times: dict[str, list[float]] = {f"{n}_a{a:g}": [] for n, _, _ in sides for a in (0.0, 1.0)}
    for r in range(args.speed_steps + 1):  # round 0 warms up; odd rounds run the sides in reverse order
        for name, fn, c in sides if r % 2 == 0 else sides[::-1]:
            for alpha in (0.0, 1.0):
                t0 = time.perf_counter()
                fn(alpha, c)
                model.zero_grad(set_to_none=True)
                if r:
                    times[f"{name}_a{alpha:g}"].append(time.perf_counter() - t0)
    tokens = int(x[:, :-1].numel())
    rates = {k: tokens / float(np.median(v)) for k, v in times.items()}
    ratio = {k: rates[k] / rates["per_step_" + k.rsplit("_", 1)[1]] for k in rates if not k.startswith("per_step")}
    payload = {"N": args.last, "tokens_per_step": tokens, "rounds": args.speed_steps, "tokens_per_s": rates,
               "ratio": ratio, "candidate_union": union, "vocab": pre.model.vocab_size, "step_seconds": times,
               "ranking_seconds_per_token": ranking_seconds / tokens, "threads": args.threads,
               "environment": environment("cpu", 0)}  # fmt: skip
    write_json(args.results / "real-faithfulness-speed.json", payload)
    print(f"speed N={args.last} ({tokens} tokens/step): "
          + ", ".join(f"{k} ×{v:.2f}" for k, v in ratio.items()) + f"; union {union}")  # fmt: skip


BANK_SIDES = ((1024, 0), (2048, 0), (1024, 16), (2048, 16))
"""(``loss.proto_kl_rows``, ``loss.kl_candidates``) of the bank steps timed: today's demo first."""


def bank_speed_main(args: argparse.Namespace) -> None:
    """The bank stage's step time (``bank_losses`` forward + backward, K=8,192, k=8: the demo's bank) on the z
    of 8 × 256 tokens of real text, per ``BANK_SIDES``, interleaved round by round (odd rounds reversed)."""
    torch.set_num_threads(args.threads)
    pre = load_pretrained(args.source, block_size=256)
    model = build_model(pre, replace(pre.model, prototypes=PrototypeConfig(num_prototypes=8192, top_k=8)))
    set_trainable(model, trainable_names(model, "prototypes"))
    with torch.no_grad():
        z = model.backbone_outputs(speed_batch(8, pre.tokenizer)[:, :-1]).z.reshape(-1, pre.model.n_embd)
    base = {"rec": 1.0, "r1": 0.5, "r2": 0.5, "proto_kl": 1.0}
    times: dict[str, list[float]] = {f"rows{r}_c{c}": [] for r, c in BANK_SIDES}
    for rnd in range(args.speed_steps + 1):  # round 0 warms up
        for rows, c in BANK_SIDES if rnd % 2 == 0 else BANK_SIDES[::-1]:
            t0 = time.perf_counter()
            terms = bank_losses(model, z, proto_kl_rows=rows, candidates=c)
            torch.stack([w * terms[k] for k, w in base.items()]).sum().backward()
            model.zero_grad(set_to_none=True)
            if rnd:
                times[f"rows{rows}_c{c}"].append(time.perf_counter() - t0)
    seconds = {k: float(np.median(v)) for k, v in times.items()}
    first = next(iter(seconds))
    payload = {"rows_per_step": int(z.shape[0]), "rounds": args.speed_steps, "step_seconds_median": seconds,
               "speedup_vs_" + first: {k: seconds[first] / v for k, v in seconds.items()}, "step_seconds": times,
               "environment": environment("cpu", 0)}  # fmt: skip
    write_json(args.results / "real-faithfulness-bank-speed.json", payload)
    print("bank step: " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()))


def parse_variant(spec: str) -> dict[str, float]:
    """``N2-a1-c16`` → {"N": 2, "alpha": 1.0, "c": 16, "r": 0}: unfrozen blocks, loss.lambda_proto_kl,
    loss.kl_candidates; ``-r8``: LoRA adapters of rank 8 on those blocks' Linear layers train instead of the
    blocks themselves (the bank trains either way)."""
    try:
        parts = {p[0]: p[1:] for p in spec.split("-")}
        return {"N": int(parts["N"]), "alpha": float(parts["a"]), "c": int(parts["c"]), "r": int(parts.get("r", 0))}
    except (KeyError, ValueError) as e:
        raise SystemExit(
            f"--variant {spec!r}: expected N<blocks>-a<alpha>-c<candidates>[-r<rank>], e.g. N2-a1-c16"
        ) from e


def top_block_lora(model: PrismLM, n_last: int, rank: int) -> None:
    """LoRA adapters (peft, W x + (α/r) B A x with B = 0 at the start, α = 2r as ``model.lora_rank``) on every
    Linear of the last ``n_last`` blocks only: what stage 2 on stored boundary activations can train."""
    from peft import LoraConfig, inject_adapter_in_model

    top = tuple(p.removeprefix("transformer.") for p in model.block_prefixes()[-n_last:])
    targets = [n for n, m in model.transformer.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(top)]
    inject_adapter_in_model(  # full module names: a name in the list matches only itself
        LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets),
        model.transformer,
    )


def sweep_main(args: argparse.Namespace) -> None:
    """Stage-2 recipes compared on one store: a retrofit with N = --last (its z pass stores block 30 − N's
    input; its frozen bank trains ``--frozen-steps``), then per ``--variant`` (N ≤ --last unfrozen blocks, the
    prototype-only KL weight, the candidate set) ``--steps`` stage-2 steps from that same frozen checkpoint
    (``stage2_step``: the blocks below 30 − N run frozen), measured on the held-out store every ``--every``
    steps and on the held-out chat answers at the end; merged into real-faithfulness-sweep.json."""
    torch.set_num_threads(args.threads)
    out = run_dir(args).with_name(f"sweep-K{args.prototypes}-N{args.last}")
    try:
        ckpt = load_checkpoint(out)
    except CheckpointError:
        out.parent.mkdir(parents=True, exist_ok=True)
        frozen = replace(recipe(args), steps=args.frozen_steps)
        retrofit_model(args.source, out=out, recipe=frozen, overrides=overrides(args), device="cpu")
        ckpt = load_checkpoint(out)
    store, val, layer = open_stored_z(out / "stored-z").check(), heldout_store(args, out), 30 - args.last
    yardstick = fit_yardstick(val.hidden(np.arange(8)), args.top_k)
    path = args.results / "real-faithfulness-sweep.json"
    results = json.loads(path.read_text()) if path.exists() else {"variants": {}}
    for spec in args.variant:
        v = parse_variant(spec)
        model = load_checkpoint(out).model.train()
        cfg = RunConfig.from_json(out / "config.json").override(
            {"train.trainable": "lora" if v["r"] else f"last-{v['N']}", "loss.lambda_proto_kl": v["alpha"],
             "loss.kl_candidates": v["c"], "train.max_steps": args.frozen_steps + args.steps}
        )  # fmt: skip
        if v["r"]:  # adapters at the block lr × args.lora_lr_scale (LoRA wants a larger step than full weights)
            top_block_lora(model, int(v["N"]), int(v["r"]))
            cfg = cfg.override({"train.backbone_lr_ratio": cfg.train.backbone_lr_ratio * args.lora_lr_scale})
        set_trainable(model, trainable_names(model, cfg.train.trainable))
        optimizer = build_optimizer(model, cfg, torch.device("cpu"))
        sampler = SequenceSampler(store.num_sequences, cfg.train.batch_size, cfg.train.grad_accum, 1, cfg.train.seed)
        points, seconds = [], 0.0
        for step in range(args.frozen_steps, args.frozen_steps + args.steps + 1):
            done = step - args.frozen_steps
            if done % args.every == 0 or done == args.steps:
                got = heldout_stage2_metrics(
                    model, val, layer, max_sequences=args.heldout_sequences, yardstick=yardstick
                )
                points.append({"stage2_steps": done, "seconds": seconds, **got})
                print(f"sweep {spec} step {done}: top1 {got['top1_agreement']:.3f} kl {got['kl']:.3f} "
                      f"CE {got['ce']:.4f} (source {got['ce_source']:.4f}) {seconds:.0f} s", flush=True)  # fmt: skip
                model.train()
            if done == args.steps:
                break
            t0 = time.perf_counter()
            stage2_step(model, optimizer, store, layer, cfg, sampler, step, torch.device("cpu"))
            seconds += time.perf_counter() - t0
        chat = chat_measure(model.eval(), ckpt.require_tokenizer(), store)
        tokens = args.steps * cfg.train.batch_size * cfg.train.grad_accum * store.block_size
        results["variants"][spec] = {**v, "steps": args.steps, "tokens": tokens, "tokens_per_s": tokens / seconds,
                                     "points": points, "chat_answers": chat}  # fmt: skip
        results["run"] = {"folder": str(out), "frozen_steps": args.frozen_steps, "overrides": overrides(args)}
        results["environment"] = environment("cpu", 0)
        write_json(path, results)


LEVERS: dict[str, dict[str, float]] = {
    "paper": {"K": 2048, "k": 8, "alpha": 0.0},
    "kl": {"K": 2048, "k": 8, "alpha": 1.0},
    "kl-K8192-k32": {"K": 8192, "k": 32, "alpha": 1.0},
    "paper-K8192-k32": {"K": 8192, "k": 32, "alpha": 0.0},
}
"""Frozen heads compared on the same stored z, steps and held-out tokens: the paper's objective (REC + R1 + R2)
and the prototype-only KL added (``loss.lambda_proto_kl``), at two bank sizes."""


def frozen_main(args: argparse.Namespace) -> None:
    """Train one frozen bank per ``--lever`` on the long run's stored z (the source backbone) and measure the
    prototype-only prediction on the held-out store; results merged into real-faithfulness-frozen.json."""
    torch.set_num_threads(args.threads)
    out = run_dir(args)
    store, val = open_stored_z(out / "stored-z").check(), heldout_store(args, out)
    base = RunConfig.from_json(out / "config.json")
    pre = load_pretrained(args.source, block_size=256)
    path = args.results / "real-faithfulness-frozen.json"
    results = json.loads(path.read_text()) if path.exists() else {"levers": {}}
    for name in args.lever:
        lever = LEVERS[name]
        cfg = base.override(
            {
                "model.prototypes": {"num_prototypes": int(lever["K"]), "top_k": int(lever["k"])},
                "loss.lambda_proto_kl": lever["alpha"],
                "train.max_steps": args.frozen_steps,
                "train.frozen_steps": args.frozen_steps,
                "train.trainable": "prototypes",
            }
        )
        torch.manual_seed(0)
        model = build_model(pre, cfg.model)
        seeds = seed_sequences(store.num_sequences, 256, 16 * int(lever["K"]), 0)
        bank = seed_prototypes(store.hidden(seeds).reshape(-1, 576)[: 16 * int(lever["K"])], int(lever["K"]),
                               int(lever["k"]), generator=torch.Generator().manual_seed(0))  # fmt: skip
        with torch.no_grad():
            model.require_prototypes().weight.copy_(bank)
        t0 = time.perf_counter()
        train_bank(model, store, cfg, steps=args.frozen_steps, device=torch.device("cpu"))
        got = heldout_stage2_metrics(model, val, None, max_sequences=args.heldout_sequences)
        results["levers"][name] = {**lever, "steps": args.frozen_steps, "seconds": time.perf_counter() - t0, **got}
        results["environment"] = environment("cpu", 0)
        write_json(path, results)
        print(f"frozen {name}: top1 {got['top1_agreement']:.3f} kl {got['kl']:.3f} margin {got['margin_share']:.3f} "
              f"residual {got['residual_share']:.3f}")  # fmt: skip


def chat_sequences(tok: Tokenizer) -> list[tuple[list[int], int]]:
    """The held-out chat transcripts as (token ids, prompt length): the answers no anchor set saw."""
    end = tok.backend.id_to_token(tok.eot_id) if tok.eot_id is not None else None
    if end is None:
        raise SystemExit("the model's tokenizer has no end-of-turn token: the chat answers cannot be cut")
    chats = []
    for record in read_chat_answers(BUILTIN_DIR / CHAT_FILE, heldout=True):
        ids, prompt = tok.encode(record["text"]), tok.encode(record["text"][: -len(record["answer"] + end)])
        if ids[: len(prompt)] == prompt:  # the template's last token ends the prompt: a clean boundary
            chats.append((ids, len(prompt)))
    return chats


def measure(
    model: PrismLM, tok: Tokenizer, shards: ShardSet, store: StoredZ, batches: int
) -> dict[str, dict[str, float]]:
    """Faithfulness and coverage of a model on held-out text (``batches`` × 4 sequences of its validation
    split: ``evaluate``) and on the held-out chat answers (yardsticks fitted on 16 stored anchor sequences)."""
    text = evaluate(model, shards.val, seq_len=256, batch_size=4, max_batches=batches)
    return {"heldout_text": text, "chat_answers": chat_measure(model, tok, store)}


def chat_measure(model: PrismLM, tok: Tokenizer, store: StoredZ) -> dict[str, float]:
    """Faithfulness on the held-out chat answers (yardsticks fitted on 16 stored anchor sequences)."""
    k = model.require_prototypes().cfg.top_k
    acc = FaithfulnessAccumulator(yardstick=fit_yardstick(store.hidden(np.arange(16)), k))
    chats = chat_sequences(tok)
    return answer_faithfulness(model, chats, acc).result() | {"chats": len(chats)}


def measure_main(args: argparse.Namespace) -> None:
    """``--checkpoint`` (a checkpoint or run folder) measured by ``measure``; merged into
    real-faithfulness-measures.json under ``--name``."""
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.checkpoint)
    run = args.run if args.run is not None else run_dir(args)
    shards = Run.open(run, device="cpu").shards()
    store = open_stored_z(run / "stored-z")
    t0 = time.perf_counter()
    got = measure(ckpt.model, ckpt.require_tokenizer(), shards, store, args.eval_batches)
    path = args.results / "real-faithfulness-measures.json"
    results = json.loads(path.read_text()) if path.exists() else {"models": {}}
    # each model keeps its own environment: models are measured at different revisions, one at a time
    env = environment("cpu", 0)
    results["models"][args.name] = {"checkpoint": str(ckpt.path), "step": ckpt.manifest["step"],
                                    "seconds": time.perf_counter() - t0, **got, "environment": env}  # fmt: skip
    results["environment"] = env
    write_json(path, results)
    t, c = got["heldout_text"], got["chat_answers"]
    print(f"measure {args.name}: text top1 {t['top1_agreement']:.3f} kl {t['kl']:.2f} margin {t['margin_share']:.3f} "
          f"(pca {t['pca_margin_share']:.3f}) | chat top1 {c['top1_agreement']:.3f} margin {c['margin_share']:.3f} "
          f"(pca {c['pca_margin_share']:.3f})")  # fmt: skip


def summary_main(args: argparse.Namespace) -> None:
    """bench/results/real-faithfulness.json: the summary over the measures, the speed, the curve and the
    frozen levers (each file's revision kept with it)."""
    sources = {name: json.loads((args.results / f"real-faithfulness-{name}.json").read_text())
               for name in ("measures", "speed", "curve", "frozen") if (args.results / f"real-faithfulness-{name}.json").exists()}  # fmt: skip
    models = sources["measures"]["models"]
    speed = sources["speed"]["ratio"]
    ratio = next(speed[k] for k in (f"ranked_c{args.kl_candidates}_a1", f"stored_c{args.kl_candidates}_a1",
                                    "stored_a1", "a1") if k in speed)  # fmt: skip
    fields = faithfulness_summary(
        models, ratio, frozen=args.frozen_name, stage2=args.stage2_name, source=args.source_name, demo=args.frozen_name
    )
    summary: dict[str, object] = {**fields}
    summary["recipe"] = {
        "coefficients": "relu(cos) (the paper's)", "prototypes": args.prototypes, "top_k": args.top_k,
        "objective": f"REC + 0.5 R1 + 0.5 R2 + {args.alpha:g} KL(p || softmax(W z_hat))",
        "kl_candidates": args.kl_candidates,
        "anchor": f"builtin:gutenberg+sotu+chat, {anchor(args)}", "stage2": f"last-{args.last}, block lr {args.block_lr:g}, "
        f"KL to the source + {args.alpha:g} prototype KL",
    }  # fmt: skip
    payload = {"summary": summary, "goals_met": faithfulness_goals(fields),
               "sources": {k: {"file": f"real-faithfulness-{k}.json", "git_revision": v.get("environment", {}).get("git_revision")}
                           for k, v in sources.items()},  # fmt: skip
               "environment": environment("cpu", 0)}  # fmt: skip
    write_json(args.results / "real-faithfulness.json", payload)
    print("faithfulness: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if isinstance(v, float)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--stage",
        choices=["stage2", "curve", "speed", "frozen", "measure", "summary", "sweep", "bank-speed"],
        required=True,
    )
    p.add_argument("--checkpoint", type=Path, help="measure, curve: the checkpoint (or run) folder to measure")
    p.add_argument(
        "--run", type=Path, help="measure: the run whose shards and stored z it uses (default: the long run)"
    )
    p.add_argument("--name", default="model", help="measure: its key in real-faithfulness-measures.json")
    p.add_argument(
        "--frozen-name", default="demo", help="summary: the measured key of the kept frozen head (the demo's)"
    )
    p.add_argument("--stage2-name", default="stage2", help="summary: the measured key of the stage-2 model")
    p.add_argument(
        "--source-name", default="frozen", help="summary: the source model on the stage-2 run's held-out text"
    )
    p.add_argument("--eval-batches", type=int, default=8, help="measure: held-out text batches of 4 × 256 tokens")
    p.add_argument("--lever", action="append", choices=sorted(LEVERS), default=[], help="frozen: which heads")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--source", default=SOURCE, help="the model: the shipped name, a .gguf file or a transformers folder"
    )
    p.add_argument("--device", default="cpu", help="stage2: cpu or cuda")
    p.add_argument("--root", type=Path, default=ROOT, help="where the runs and stores live")
    p.add_argument("--curve", type=Path, default=CURVE, help="curve: the JSON file the points are merged into")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="where measure/speed/frozen/summary write")
    p.add_argument("--prototypes", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--last", type=int, default=4, help="unfrozen blocks N (the boundary is block 30 − N)")
    p.add_argument("--alpha", type=float, default=1.0, help="loss.lambda_proto_kl")
    p.add_argument("--variant", action="append", default=[], help="sweep: N<blocks>-a<alpha>-c<candidates>")
    p.add_argument("--every", type=int, default=50, help="sweep: held-out points every this many steps")
    p.add_argument("--lora-lr-scale", type=float, default=10.0, help="sweep: LoRA adapters' lr over the blocks' lr")
    p.add_argument("--set", action="append", default=[], help="stage2, sweep: extra retrofit overrides (key=value)")
    p.add_argument("--kl-candidates", type=int, default=0, help="loss.kl_candidates of the stage-2 run")
    p.add_argument("--lr", type=float, default=3e-3, help="the bank's learning rate")
    p.add_argument("--block-lr", type=float, default=1e-4, help="the unfrozen blocks' learning rate")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--anchor-chars", type=int, default=2000, help="the first this many characters of each document")
    p.add_argument("--frozen-steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=4000, help="stage-2 steps")
    p.add_argument("--heldout-sequences", type=int, default=32)
    p.add_argument("--speed-steps", type=int, default=6)
    p.add_argument("--candidates", type=int, nargs="*", default=[64, 16], help="speed: loss.kl_candidates values timed")
    args = p.parse_args()
    stages = {
        "stage2": stage2_main,
        "curve": curve_main,
        "speed": speed_main,
        "frozen": frozen_main,
        "sweep": sweep_main,
        "bank-speed": bank_speed_main,
    }
    {**stages, "measure": measure_main, "summary": summary_main}[args.stage](args)


if __name__ == "__main__":
    main()
