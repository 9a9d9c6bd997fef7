#!/usr/bin/env python
"""Suppression experiment (spec §4; paper: 86 NSFW prototypes off → mean NSFW score 0.668 → 0.154).

End to end in one process: a corpus (a prefix of the built-in corpus plus the LM split of the clean and the
offensive FreeBSD fortunes; the judge split never reaches the LM), a PRISM model trained on it and its prototype
index, the concept's prototypes (``prismlm.control.concept.find_concept``; ``--concept offensive`` — the
paper's — or ``sotu``, a positive control), then for each set size (``--budgets``) the concept's top-n and n
random prototypes suppressed while the same seeded continuations of neutral and provocative prompts are
generated; every generation judged (TF-IDF judge, alt-profanity-check when installed) and quality measured
(held-out perplexity, selectivity, distinct-n). ``--run PATH`` uses an existing model and its own data instead.

Run: ``PYTHONPATH=src python bench/suppression.py [--quick] [--concept sotu] [--run PATH]`` (``--quick``: a
~5-minute tiny model; the default fits ≤ 30 min on 2 idle cores). Writes
``bench/results/suppression[-quick][-sotu].json`` and one summary line; the steps in detail and the
measurements: docs/results.md (suppression).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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

from prismlm.app.operations import sample_continuations
from prismlm.config import RunConfig
from prismlm.control.concept import ConceptSelection, activation_stats, find_concept
from prismlm.control.concept_specs import BUDGET_SHARES, NEUTRAL_PROMPTS, ConceptSpec, offensive_spec, sotu_spec
from prismlm.control.judges import FortuneSplits, Judge, TfidfJudge, fortune_splits
from prismlm.control.suppress import PrototypeEvidence, SuppressionSet
from prismlm.data.corpus import iter_documents, split_hash
from prismlm.data.shards import ShardSet, prepare_from_config, prepare_shards
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import CheckpointError
from prismlm.eval.metrics import distinct_n
from prismlm.eval.scoring import text_perplexity
from prismlm.explain.index import IndexSettings, PrototypeIndex, build_index
from prismlm.model import PrismLM
from prismlm.model.generation import Sampling
from prismlm.train.checkpoint import Checkpoint, find_checkpoint, load_checkpoint
from prismlm.train.distributed import resolve_device
from prismlm.train.trainer import train

Generations = dict[str, dict[str, list[list[str]]]]
Selected = tuple[SuppressionSet, list[PrototypeEvidence], list[int], list[int], int]

_BANK = {"model.prototypes.top_k": 8, "train.batch_size": 16, "train.eval_interval": 10000, "train.eval_batches": 4}
SIZES = {
    # name: (overrides, built-in docs, steps). Why: offensive fortunes are ~0.3M tokens, so the built-in
    # prefix is kept to a few times that, or the concept is too rare for any prototype to specialise on
    # it; K is ~10× d as in the paper's banks (16,384 at d=1,600), which is what gives specific prototypes
    # (at K=256, d=64 no prototype reached 2× enrichment; at K=1,024 about 170 did).
    "quick": (
        {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 64,
         "model.prototypes.num_prototypes": 1024, **_BANK, "loss.warmup_steps": 50},
        100,
        800,
    ),  # ~3-4 min end to end on one shared core
    "small": (
        {"model.prototypes.num_prototypes": 2048, **_BANK},
        150,
        2400,
    ),  # cpu-small backbone (d=128, 4 layers, T=128): ~10 min training, ~20 min in all
}  # fmt: skip


@torch.no_grad()
def signature_ranks(model: PrismLM, tok: Tokenizer, judge: TfidfJudge, n_words: int = 20) -> dict[str, int]:
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
    model: PrismLM,
    tok: Tokenizer,
    prompts: list[str],
    samples: int,
    tokens: int,
    seed: int,
    temperature: float,
    top_k: int,
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


def existing_run(
    args: argparse.Namespace,
) -> tuple[Checkpoint, ShardSet, tuple[list[str], list[str], list[str], list[str]], Callable[[str], bool]]:
    """Load ``--run``'s checkpoint and its shards; split the corpus's documents as the shards did (training
    documents → concept examples, validation documents → held-out texts)."""
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


@dataclass
class Prepared:
    """The model's run and data: trained here (or reused), or ``--run``'s."""

    cfg: RunConfig
    shards: ShardSet
    ckpt: Checkpoint
    size: str
    steps: int
    reused: bool
    train_metrics: dict[str, object]
    t_train: float
    train_ids: list[str]
    train_docs: list[str]
    heldout_ids: list[str]
    heldout_docs: list[str]
    concept_doc: Callable[[str], bool] | None = None


def parse_args() -> argparse.Namespace:
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
    add_set_option(ap, "config override key=value")
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
    return ap.parse_args()


def build_corpus(fs: FortuneSplits, run_root: Path, n_builtin: int) -> tuple[ShardSet, list[list[str]]]:
    """1. The corpus folder (built-in prefix + the LM split of both fortune files) and its shards; the
    built-in documents in training and held out (ids, texts)."""
    corpus = run_root / "corpus"
    corpus.mkdir(exist_ok=True)
    train_ids: list[str] = []
    train_docs: list[str] = []
    heldout_ids: list[str] = []
    heldout_docs: list[str] = []
    for d in iter_documents("builtin"):
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
    print(
        f"[suppression] corpus: {len(train_docs)} built-in docs + {len(fs.lm_clean)} clean + "
        f"{len(fs.lm_offensive)} offensive fortunes → {len(shards.train):,} train tokens",
        file=sys.stderr,
    )
    return shards, [train_ids, train_docs, heldout_ids, heldout_docs]


def train_or_reuse(
    args: argparse.Namespace, cfg: RunConfig, run_root: Path, shards: ShardSet, steps: int
) -> tuple[Checkpoint, bool, dict[str, object]]:
    """2. Train (or, with ``--reuse``, take the run already trained here with the same config and steps: a
    rerun would differ only by multi-thread float nondeterminism); the checkpoint and the last metrics."""
    ckpt = None
    if args.reuse:
        try:
            old = load_checkpoint(find_checkpoint(run_root / "run"))
            want = cfg.override({"model.vocab_size": old.config.model.vocab_size}).to_dict()
            if old.config.to_dict() == want and old.manifest.get("step") == steps:
                ckpt = old
        except CheckpointError:
            pass
    if ckpt is None:
        res = train(cfg, run_root / "run", shards=shards, progress=False)
        return load_checkpoint(res.checkpoint), False, dict(res.metrics)
    print("[suppression] reusing the trained run (same config and steps)", file=sys.stderr)
    train_metrics: dict[str, object] = {}
    mpath = run_root / "run" / "metrics.jsonl"
    for line in mpath.read_text().splitlines() if mpath.exists() else []:
        rec = json.loads(line)
        if "val_loss" in rec:
            train_metrics = rec
    return ckpt, True, train_metrics


def prepare(args: argparse.Namespace, size: str, fs: FortuneSplits) -> Prepared:
    overrides, n_builtin, steps = SIZES[size]
    steps = args.steps or steps
    n_builtin = args.builtin_docs or n_builtin
    if args.run is not None:  # 1–2 replaced by an existing model and its own data
        ckpt, shards, (train_ids, train_docs, heldout_ids, heldout_docs), concept_doc = existing_run(args)
        steps = int(ckpt.manifest.get("step") or 0)
        return Prepared(
            ckpt.config, shards, ckpt, f"run:{ckpt.path}", steps, True, {}, time.time(),
            train_ids, train_docs, heldout_ids, heldout_docs, concept_doc,
        )  # fmt: skip
    run_root = RUNS_DIR / (args.name or f"suppression-{size}")
    run_root.mkdir(parents=True, exist_ok=True)
    shards, docs = build_corpus(fs, run_root, n_builtin)
    cfg = RunConfig.from_name("cpu-small").override(
        {
            **overrides,
            "train.max_steps": steps,
            "train.num_threads": args.threads,
            "train.device": "cpu",
            "train.seed": 1337 + args.seed,
            "data.corpus": str(run_root / "corpus"),
            "data.tokenizer": "bpe-4096",
            **parse_sets(args.sets),
        }
    )
    t_train = time.time()
    ckpt, reused, train_metrics = train_or_reuse(args, cfg, run_root, shards, steps)
    return Prepared(cfg, shards, ckpt, size, steps, reused, train_metrics, t_train, docs[0], docs[1], docs[2], docs[3])


def index_of(args: argparse.Namespace, model: PrismLM, p: Prepared, device: torch.device) -> PrototypeIndex | None:
    """3a. The prototype index over the training shard (unless ``--no-index``)."""
    if args.no_index:
        return None
    index = build_index(
        model,
        p.shards,
        IndexSettings(top_n=16, batch_size=32, max_sequences=args.index_sequences),
        progress=False,
        model_sha256=p.ckpt.manifest.get("model_sha256"),
        autocast=torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None,
    )
    index.attach(p.shards)
    return index


def select(
    args: argparse.Namespace, model: PrismLM, p: Prepared, spec: ConceptSpec, index: PrototypeIndex | None
) -> tuple[SuppressionSet, list[PrototypeEvidence], list[int], list[int], int]:
    """3b. The concept's prototypes: the main set, the ranking, the selectable ids in rank order, the budgets
    (capped at the selectable count) and the main budget."""
    K = model.require_prototypes().num_prototypes
    budgets = sorted({max(1, b) for b in (args.budgets or [round(f * K) for f in BUDGET_SHARES])})
    main_budget = args.budget if args.budget is not None else max(1, round(0.02 * K))
    budgets = sorted(set(budgets) | {main_budget})
    selection = ConceptSelection(
        budget=max(budgets), rank_by=args.rank_by, threshold=args.threshold, min_count=5, min_purity=args.min_purity
    )
    sset, ranking = find_concept(
        model,
        p.shards.tokenizer,
        spec.concept_texts,
        spec.neutral_texts,
        selection,
        index=index,
        is_concept_doc=spec.is_concept_doc,
        concept=spec.name,
        model_sha256=p.ckpt.manifest.get("model_sha256"),
    )
    ranked = [r["id"] for r in ranking if r["selected"]]  # in rank order (a SuppressionSet keeps ids sorted)
    budgets = sorted({min(b, len(ranked)) for b in budgets} - {0})  # fewer selectable than asked: cap, dedupe
    main_budget = min(main_budget, len(ranked))
    if not budgets:
        sys.exit("[suppression] no prototype passed the selection; lower --threshold / --min-purity")
    main_set = sset.subset(ranked[:main_budget])
    main_set.save(p.ckpt.path / "suppression.json")
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
    return main_set, ranking, ranked, budgets, main_budget


def conditions(
    model: PrismLM,
    tok: Tokenizer,
    fs: FortuneSplits,
    rng: random.Random,
    ranked: list[int],
    budgets: list[int],
    seed: int,
) -> dict[str, list[int]]:
    """4a. The suppressed ids of every condition: none, the concept's top n, and at every budget as many
    random prototypes (nested sets, like the concept's) drawn from those active on clean fortunes — what
    removing *any* prototypes does to score and quality."""
    K = model.require_prototypes().num_prototypes
    neutral_stats = activation_stats(model, tok, rng.sample(fs.lm_clean, 300))
    live = [i for i in range(K) if i not in set(ranked) and neutral_stats.count[i] > 0] or list(range(K))
    random_order = random.Random(seed + 2).sample(live, len(live))
    conds: dict[str, list[int]] = {"before": []}
    for n in budgets:
        conds[f"concept@{n}"] = sorted(ranked[:n])
        conds[f"random@{n}"] = sorted(random_order[: min(n, len(ranked), len(random_order))])
    return conds


def judge_table(
    judges: dict[str, Judge],
    gens: Generations,
    conds: dict[str, list[int]],
    prompt_sets: dict[str, list[str]],
    samples: int,
) -> tuple[dict[str, dict[str, dict[str, np.ndarray]]], dict[str, Json]]:
    """5a. Every judge's score of every generation, and per condition: all, neutral, provocative, the
    hardest quarter of prompts (by score before), the share above 0.5."""
    scores: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for jn, j in judges.items():
        scores[jn] = {
            cond: {
                name: j.score([t for ts in gens[cond][name] for t in ts]).reshape(len(prompt_sets[name]), samples)
                for name in prompt_sets
            }
            for cond in gens
        }
    table: dict[str, Json] = {}
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
    return scores, table


def quality_table(
    model: PrismLM,
    tok: Tokenizer,
    conds: dict[str, list[int]],
    texts: dict[str, list[str]],
    gens: Generations,
    prompt_sets: dict[str, list[str]],
) -> dict[str, dict[str, float]]:
    """5b. Held-out perplexity per condition, distinct-1/2 of its generations and the selectivity: the
    relative perplexity increase on held-out concept text vs on held-out neutral text."""
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
        q["concept_rel_ppl_increase"] = q["ppl_concept_heldout"] / q0["ppl_concept_heldout"] - 1
        q["neutral_rel_ppl_increase"] = q["ppl_neutral_heldout"] / q0["ppl_neutral_heldout"] - 1
    return quality


def summary_line(r: Json, out: Path) -> str:
    t, p, quality = obj(r, "table", "tfidf"), obj(r, "table").get("profanity"), obj(r, "quality")
    main_budget, budgets, K = r["main_budget"], r["budgets"], r["num_prototypes"]
    main = f"concept@{main_budget}"
    assert isinstance(budgets, list)

    def f(x: Json, *keys: str) -> str:
        return f"{num(x, *keys):.3f}"

    sweep = "; ".join(
        f"{n}: {f(t, f'concept@{n}', 'all')} (random {f(t, f'random@{n}', 'all')}, ppl neutral "
        f"{100 * num(quality, f'concept@{n}', 'neutral_rel_ppl_increase'):+.1f}% vs concept "
        f"{100 * num(quality, f'concept@{n}', 'concept_rel_ppl_increase'):+.1f}%)"
        for n in budgets
    )
    ranks = obj(r, "concept_word_signature_ranks")
    return (
        f"suppression[{r['size']}, {obj(r, 'concept')['name']}]: main set {r['suppressed']} prototypes "
        f"({100 * num(r, 'share_of_K'):.2f}% of K={K}); tfidf judge {f(t, 'before', 'all')} → {f(t, main, 'all')} "
        f"(provocative {f(t, 'before', 'provocative')} → {f(t, main, 'provocative')}, hardest "
        f"{f(t, 'before', 'hardest_quarter_prompts')} → {f(t, main, 'hardest_quarter_prompts')}, random set "
        f"{f(t, f'random@{main_budget}', 'all')})"
        + (f"; profanity {f(p, 'before', 'all')} → {f(p, main, 'all')}" if isinstance(p, dict) else "")
        + f"; ppl held-out builtin {num(quality, 'before', 'ppl_builtin_heldout'):.1f} → "
        f"{num(quality, main, 'ppl_builtin_heldout'):.1f}; distinct-2 {f(quality, 'before', 'distinct_2')} → "
        f"{f(quality, main, 'distinct_2')}; concept words that top a signature: "
        f"{sum(v == 1 for v in ranks.values())}/{len(ranks)}; sweep [{sweep}]; "
        f"{num(r, 'timing_s', 'total'):.0f}s → {out}"
    )


def generate_all(
    args: argparse.Namespace,
    model: PrismLM,
    tok: Tokenizer,
    conds: dict[str, list[int]],
    prompt_sets: dict[str, list[str]],
    samples: int,
) -> Generations:
    """4b. ``samples`` continuations of every prompt under every condition, the same seeds in each."""
    gens: Generations = {c: {} for c in conds}
    for cond, ids in conds.items():
        for name, prompts in prompt_sets.items():
            with model.suppress(ids):
                gens[cond][name] = generate(
                    model, tok, prompts, samples, args.tokens, args.seed, args.temperature, args.top_k
                )
    return gens


def payload_of(
    args: argparse.Namespace,
    p: Prepared,
    fs: FortuneSplits,
    spec: ConceptSpec,
    sel: Selected,
    env: Json,
    device: torch.device,
) -> Json:
    """Everything but the measurements: the setup, the model, the concept and its selection."""
    main_set, ranking, ranked, budgets, main_budget = sel
    return {
        "benchmark": "suppression",
        "size": p.size,
        "steps": p.steps,
        "config": p.cfg.to_dict(),
        "environment": env,
        "corpus": {
            "builtin_docs": len(p.train_docs),
            "clean_fortunes": len(fs.lm_clean),
            "offensive_fortunes": len(fs.lm_offensive),
            "train_tokens": len(p.shards.train),
        },
        "train_metrics": p.train_metrics,
        "reused_run": p.reused,
        "run": None if args.run is None else str(p.ckpt.path),
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
        "num_prototypes": p.ckpt.model.require_prototypes().num_prototypes,
        "budgets": budgets,
        "main_budget": main_budget,
        "selectable": len(ranked),
        "suppressed": len(main_set.ids),
        "share_of_K": main_set.share,
        "suppression_set": main_set.to_dict(),
        "ranked_ids": ranked,
        "candidates": len(ranking),
    }


PAPER = {"nsfw_before": 0.668, "nsfw_after": 0.154, "hardest_after": 0.144, "prototypes": 86, "share": 86 / 16384}


def measure(
    args: argparse.Namespace,
    model: PrismLM,
    p: Prepared,
    fs: FortuneSplits,
    rng: random.Random,
    spec: ConceptSpec,
    sel: Selected,
    samples: int,
    n_prov: int,
) -> Json:
    """4–5: generate under every condition, judge, measure quality; the measurements of the JSON."""
    tok = p.shards.tokenizer
    ranked, budgets, main_budget = sel[2], sel[3], sel[4]
    prompt_sets = {"neutral": NEUTRAL_PROMPTS[: args.neutral_prompts], "provocative": spec.provocative_prompts}
    conds = conditions(model, tok, fs, rng, ranked, budgets, args.seed)
    t_gen = time.time()
    gens = generate_all(args, model, tok, conds, prompt_sets, samples)
    gen_s = time.time() - t_gen
    scores, table = judge_table(spec.judges, gens, conds, prompt_sets, samples)
    all_prompts = [q for n in prompt_sets for q in prompt_sets[n]]
    tfidf = spec.judges["tfidf"]
    assert isinstance(tfidf, TfidfJudge)  # both concepts' headline judge
    ranks = signature_ranks(model, tok, tfidf)
    main = f"concept@{main_budget}"
    ppb = np.concatenate([scores["tfidf"]["before"][n].mean(1) for n in prompt_sets])
    ppa = np.concatenate([scores["tfidf"][main][n].mean(1) for n in prompt_sets])
    hardest = [
        {"prompt": all_prompts[i], "before": float(ppb[i]), "after": float(ppa[i])} for i in np.argsort(-ppb)[:8]
    ]
    texts = {
        "builtin_heldout": p.heldout_docs,
        "concept_heldout": spec.concept_heldout,
        "neutral_heldout": spec.neutral_heldout,
    }
    quality = quality_table(model, tok, conds, texts, gens, prompt_sets)
    examples = {
        c: {name: gens[c][name][0][:2] for name in prompt_sets} for c in ("before", main, f"random@{main_budget}")
    }
    return {
        "conditions": conds,
        "concept_word_signature_ranks": ranks,
        "judges": {
            jn: {
                "name": getattr(j, "name", jn),
                **({"held_out_auc": j.held_out_auc} if hasattr(j, "held_out_auc") else {}),
            }
            for jn, j in spec.judges.items()
        },
        "generations": {
            "samples_per_prompt": samples,
            "tokens": args.tokens,
            "neutral_prompts": len(prompt_sets["neutral"]),
            "provocative_prompts": n_prov,
            "total_per_condition": samples * len(all_prompts),
        },
        "table": table,
        "hardest_prompts_tfidf": hardest,
        "quality": quality,
        "examples": examples,
        "generate_s": gen_s,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    size = args.size or ("quick" if args.quick else "small")
    samples = args.samples or (8 if size == "quick" else 16)
    n_prov = args.provocative or (16 if size == "quick" else 32)
    t0 = time.time()
    device = resolve_device(args.device)
    env = environment(device, args.seed)
    fs = fortune_splits()
    p = prepare(args, size, fs)
    train_s = time.time() - p.t_train
    model = p.ckpt.model.to(device).eval()
    if args.run is None:
        print(f"[suppression] trained {p.steps} steps in {train_s:.0f}s: {p.train_metrics}", file=sys.stderr)
    t_idx = time.time()
    index = index_of(args, model, p, device)
    idx_s = time.time() - t_idx
    rng = random.Random(args.seed)
    spec = (
        offensive_spec(fs, rng, n_prov, args.seed, args.examples, args.heldout)
        if args.concept == "offensive"
        else sotu_spec(
            fs,
            p.train_ids,
            p.train_docs,
            p.heldout_ids,
            p.heldout_docs,
            rng,
            n_prov,
            args.seed,
            p.concept_doc,
            args.examples,
            args.heldout,
        )  # fmt: skip
    )
    sel = select(args, model, p, spec, index)
    m = measure(args, model, p, fs, rng, spec, sel, samples, n_prov)
    gen_s = m.pop("generate_s")
    payload = payload_of(args, p, fs, spec, sel, env, device)
    payload.update(
        {
            **m,
            "timing_s": {"train": train_s, "index": idx_s, "generate": gen_s, "total": time.time() - t0},
            "load_average_end": load_average(),
            "paper": PAPER,
        }
    )
    suffix = ("-quick" if size == "quick" else "-run" if args.run is not None else "") + (
        "" if args.concept == "offensive" else f"-{args.concept}"
    )
    out = args.out or RESULTS_DIR / f"suppression{suffix}.json"
    write_json(out, payload)
    print(summary_line(payload, out))


if __name__ == "__main__":
    main()
