"""The ``attribution`` stage of ``bench/real_claims.py``: a fine-tune of the retrofitted SmolLM2-135M-Instruct
on planted facts (``prismlm.tda.planted``) among neutral documents, then recall@10 and MRR of the planted
sequences for the prototype cache (default and compact), the hybrids (the compact cache's top M re-scored by
the gradient dot product or by EK-FAC), EK-FAC, TRAK, bergson and BM25, and each method's per-query cost over
the cache's (``prismlm.eval.claims.attribution_summary``).

Run: ``python bench/claims_attribution.py [--quick]`` after ``claims_bank.py`` (or ``real_claims.py --stage
attribution``; ``BERGSON_PYTHON``: bergson's own venv). The protocol: docs/results.md ("How bench/real_claims.py
measures"). Each method's scores are saved under the stage folder and reused. ``--planted nonlexical
[--train-sequences 1000]``: the set lexical match cannot solve (``prismlm.tda.nonlexical``: aliases, two-hop
facts, synonym paraphrases among filler), recall@1 / MRR / recall@10 per kind, the cache and EK-FAC timed batched
and one query at a time (cost model: that module's docstring), into ``real-claims[-quick]-attribution-nonlexical
.json``. ``--planted landmark``: the same with made-up facts about real cities, each in three wordings, asked
through a sight the model knows (``...-attribution-landmark.json``). ``--finished-only``: run no method, record
the finished ones and name the rest in ``not_run`` (``...-partial.json``), the record of a run that resumes later.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from _common import ClaimsContext, Json, has_checkpoint, num, run_claims_stage, sync

from prismlm.app.demos import DEMO_MODEL
from prismlm.app.retrofit import RetrofitRecipe, retrofit_model
from prismlm.app.run import Run
from prismlm.config import AttributionConfig
from prismlm.data.shards import ShardSet
from prismlm.data.tokenizer import Tokenizer
from prismlm.eval.claims import attribution_summary, earlier_method_rows
from prismlm.model import PrismLM
from prismlm.tda.baselines import KronfluenceBaseline, TrakBaseline, WholeNetworkGradients, hybrid_scores
from prismlm.tda.cache import build_cache
from prismlm.tda.influence import Curvature, curvature_pass, query_gradients
from prismlm.tda.lexical import bm25_scores
from prismlm.tda.nonlexical import (
    NonlexicalCorpus,
    NonlexicalSize,
    Query,
    build_nonlexical_corpus,
    content_overlap,
    lexical_report,
    nonlexical_summary,
    per_query_seconds,
)
from prismlm.tda.nonlexical import answer_accuracy as nonlexical_accuracy
from prismlm.tda.nonlexical import relevant_sequences as nonlexical_relevant
from prismlm.tda.planted import (
    LanguageModel,
    PlantedCorpus,
    answer_accuracy,
    build_planted_corpus,
    chance_recall,
    planted_queries,
    relevant_sequences,
    retrieval_by_part,
    trim_planted,
)
from prismlm.train.checkpoint import find_checkpoint


@dataclass(frozen=True)
class PlantSize:
    """How big the planted corpus and the fine-tune are (``--quick``: a smoke size)."""

    facts: int
    copies: int
    background: int
    doc_chars: int
    filler_chars: int
    steps: int
    frozen_steps: int
    batch_size: int
    block_size: int
    prototypes: int
    hybrid_m: int
    scope: str
    """A substring of the fine-tuned parameter / module names EK-FAC and TRAK are restricted to ("" = all)."""
    trak_proj_dim: int
    timing_queries: int
    factor_examples: int | None = None
    """EK-FAC's factors are fitted on the first this many training sequences (None: all; its scores cover all)."""


SIZES = {
    # The smoke size runs every method in a few minutes: 2 facts + 4 distractors × 2 documents among 4 neutral
    # ones (~700 tokens: 8 training sequences of 64), 4 steps; EK-FAC and TRAK on the last block's attention output projection.
    "quick": PlantSize(2, 2, 4, 300, 40, 4, 2, 4, 64, 64, 4, "layers.29.self_attn.o_proj", 128, 1),
    # Why this small: on this shared 2-core CPU the 135M model trains at ~50-80 tokens/s (forward of all 30
    # blocks, backward of the last 2), an attribution pass runs ~60 tokens/s and EK-FAC's factors ~10 s per
    # sequence. 12 facts + 24 distractors × 3 documents (≤ 60 filler characters each side of the sentence)
    # among 40 neutral documents of ≤ 300 characters ≈ 7k tokens (~110 sequences of 64); stage 2 runs 80 steps
    # of 8 sequences (≈ 6 epochs) at 3× the usual backbone learning rate so the last 2 blocks learn the facts.
    # TRAK: proj_dim 200 > N with the ridge (two of the CPU projector's 100-dimension blocks).
    "full": PlantSize(12, 3, 40, 300, 60, 120, 40, 8, 64, 256, 16, "", 200, 4),
}
NONLEXICAL = {
    # --planted nonlexical (prismlm.tda.nonlexical): the smoke size is one query of each kind, one other fact per
    # name, answers not shared; the full size 8 of each kind (24 queries, as many as the named set's paraphrases),
    # 3 documents per sentence, 3 other facts per name, 3 facts per answer word, in ~1,000 training sequences.
    "quick": NonlexicalSize(1, 2, 1, 1, train_sequences=24, doc_chars=300, filler_chars=40, val_fraction=0.2),
    "full": NonlexicalSize(8, 3, 3, 3, train_sequences=1000, doc_chars=300, filler_chars=60, val_fraction=0.02),
}
LANDMARK = {
    # --planted landmark (prismlm.tda.nonlexical, kinds=("landmark",)): a made-up fact about a real city in three
    # wordings, asked through a sight the model knows (the city never named). The smoke size: one city asked
    # twice; the full size: 12 cities asked twice (24 queries), each fact in 3 wordings × 3 documents, in
    # ~1,000 training sequences.
    "quick": replace(NONLEXICAL["quick"], n_per_kind=2, kinds=("landmark",)),
    "full": replace(NONLEXICAL["full"], n_per_kind=24, kinds=("landmark",)),
}
NONLEXICAL_FACTOR_EXAMPLES = 256
"""EK-FAC's factors on the non-lexical corpus come from its first 256 training sequences (kronfluence's
``covariance_max_examples``): fitted on all 1,000 they cost ~10 s a sequence here, hours, and a factor fit
on a subset is how kronfluence is used on large corpora; the scores still cover every sequence, so the
per-query cost grows with the corpus as it should."""
NONLEXICAL_EPOCHS = 9
"""Fine-tune steps on the non-lexical corpus: this many passes over its training sequences (the named set's
full size makes ~8 over 114; about a fifth of the non-lexical corpus is planted). 3 passes (2026-12-07) left the
statements half learned (verbatim top-1 0.42, chance 0.14) and the queries at chance (0.17, chance 0.19)."""
UNFREEZE = "last-2"
NOT_FINISHED = "not finished yet: the stage resumes it when run without --finished-only"
NOT_SELECTED = "not selected (--methods)"
METHODS = ("bm25", "cached", "cached-compact", "grad-dot", "ekfac", "hybrid-ekfac", "trak", "bergson")
"""``--methods`` names, in the order ``run_all`` runs them (``hybrid-grad`` runs whenever its two inputs exist;
``hybrid-ekfac`` stands for ``hybrid-ekfac-m<M>``)."""


def add_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--planted",
        choices=("named", "nonlexical", "landmark"),
        default="named",
        help="named: queries name their entity (prismlm.tda.planted); nonlexical: aliases, two-hop facts and "
        "synonym paraphrases among filler (prismlm.tda.nonlexical), written to ...-attribution-nonlexical.json; "
        "landmark: facts about real cities asked through a sight the model knows, ...-attribution-landmark.json",
    )
    ap.add_argument(
        "--train-sequences",
        type=int,
        default=None,
        help="--planted nonlexical|landmark: training sequences of 64 tokens (default 1000; --quick 24)",
    )
    ap.add_argument(
        "--methods",
        default=None,
        metavar="NAME[,NAME]",
        help=f"run only these methods ({', '.join(METHODS)}); finished ones are still read back, the rest named "
        "in not_run",
    )
    ap.add_argument(
        "--merge-from",
        type=Path,
        default=None,
        metavar="RECORD",
        help="an earlier record of this stage (e.g. a partial one): its rows of the methods this run has not, "
        "kept only if its fine-tune learned exactly what this run's did (prismlm.eval.claims.earlier_method_rows)",
    )
    ap.add_argument(
        "--finished-only",
        action="store_true",
        help="record the methods finished so far and run none (written to ...-partial.json; the stage resumes "
        "the rest when run without it)",
    )


@dataclass
class PlantedSet:
    """The planted set a run attributes: the named one (``prismlm.tda.planted``) or the non-lexical one."""

    named: PlantedCorpus | None = None
    nonlexical: NonlexicalCorpus | None = None
    name: str = "named"
    """``--planted``: named, nonlexical or landmark (the record's ``planted_set`` and its summary's field names)."""

    @property
    def corpus(self) -> Path:
        return self.named.path if self.named else self.nonlexical_set().path

    def nonlexical_set(self) -> NonlexicalCorpus:
        assert self.nonlexical is not None
        return self.nonlexical

    def view(self, shards: ShardSet, T: int) -> tuple[list[Query], np.ndarray, np.ndarray, list[set[int]]]:
        """Queries, the ground-truth set of each (Q,), each query's part (Q,) and the relevant sequences."""
        tok = shards.tokenizer
        if self.named is not None:
            queries, fact_of, part = planted_queries(self.named, tok)
            return queries, fact_of, part, relevant_sequences(self.named, shards, T)
        nl = self.nonlexical_set()
        queries = nl.token_queries(tok)
        return queries, np.arange(len(queries)), nl.kinds(), nonlexical_relevant(nl, shards, T)

    def accuracy(self, net: LanguageModel, tok: Tokenizer) -> dict[str, object]:
        if self.named is not None:
            return answer_accuracy(self.named, net, tok)
        return nonlexical_accuracy(self.nonlexical_set(), net, tok)


def plant(ctx: ClaimsContext, size: PlantSize) -> tuple[PlantedSet, PlantSize, Path]:
    """The planted set, the size of its fine-tune and the stage folder (a non-lexical set of N sequences: its
    own folder, ``attribution-nonlexical-N``; the landmark set ``attribution-landmark-N``)."""
    if getattr(ctx.options, "planted", "named") == "named":
        stage = ctx.stage_dir("attribution")
        raw = build_planted_corpus(
            stage / "planted-raw",
            n_facts=size.facts,
            copies=size.copies,
            n_background=size.background,
            doc_chars=size.doc_chars,
            filler_chars=size.filler_chars,
            seed=ctx.seed,
        )
        return PlantedSet(named=trim_planted(raw, stage / "planted", size.filler_chars)), size, stage
    which = ctx.options.planted
    nls = (LANDMARK if which == "landmark" else NONLEXICAL)["quick" if ctx.quick else "full"]
    n = getattr(ctx.options, "train_sequences", None) or nls.train_sequences
    nls = replace(nls, train_sequences=n, block_size=size.block_size)
    stage = ctx.stage_dir(f"attribution-{which}-{n}")
    from prismlm.model.pretrained import load_pretrained

    tok = load_pretrained(DEMO_MODEL).tokenizer  # the corpus is sized with the model's own tokenizer
    nl = build_nonlexical_corpus(stage / "planted", nls, count_tokens=lambda t: len(tok.encode(t)), seed=ctx.seed)
    steps = size.steps if ctx.quick else math.ceil(NONLEXICAL_EPOCHS * n / size.batch_size)  # smoke: as named
    fit = None if ctx.quick else NONLEXICAL_FACTOR_EXAMPLES
    return (
        PlantedSet(nonlexical=nl, name=which),
        replace(size, steps=steps, timing_queries=2, factor_examples=fit),
        stage,
    )


def attribution_stage(ctx: ClaimsContext) -> dict[str, object]:
    """Plant, fine-tune, check learning, attribute with every method; see the module docstring."""
    torch.set_num_threads(ctx.threads)
    t0 = time.perf_counter()
    ps, size, stage = plant(ctx, SIZES["quick" if ctx.quick else "full"])
    run_dir = finetune(ctx, size, ps.corpus, stage / "run")
    t_ft = time.perf_counter() - t0
    run = Run.open(run_dir, device=ctx.device, suppress=None)
    net, shards = run.prism_model("attribution").eval(), run.shards()
    tok, T = shards.tokenizer, net.config.block_size
    N = shards.train.num_sequences(T)
    queries, fact_of, part, relevant = ps.view(shards, T)
    ctx.log(
        f"attribution: {N} training sequences of {T}; {len(queries)} queries; relevant {[len(r) for r in relevant]}"
    )
    retire_stale(stage, int(run.step or 0), ctx.log)
    learned = cached_json(stage / "learning.json", lambda: learning(ps, net, tok, T))
    ctx.log(f"attribution: learning {learned['summary']}")
    methods = Methods(ctx, size, stage / "methods", net, shards, queries, run_dir)
    finished_only = bool(getattr(ctx.options, "finished_only", False))
    methods.run_all(finished_only, selected_methods(getattr(ctx.options, "methods", None)))
    planted: dict[str, Mapping[str, Mapping[str, object]]] = {
        name: retrieval_by_part(S, fact_of, part, relevant) for name, S in methods.scores.items()
    }
    for name, m in planted.items():
        ctx.log(f"attribution: {name}: R@10 {m['all']['recall@10']:.2f} R@1 {m['all']['recall@1']:.2f}")
    matched = {"num_train": N, "block_size": T, "relevant_per_fact": [sorted(r) for r in relevant], "learning": learned}
    merged = merge_earlier(getattr(ctx.options, "merge_from", None), matched, planted, methods)
    nl = ps.nonlexical
    return {
        "summary": nonlexical_summary(planted, methods.costs, ps.name)
        if nl
        else attribution_summary(planted, methods.costs),
        "planted_set": ps.name,
        "partial": finished_only,
        "size": asdict(size),
        "unfreeze": UNFREEZE,
        "source": DEMO_MODEL,
        "run": str(run_dir),
        **matched,
        "train_tokens": N * T,
        "queries": {str(k): int((part == k).sum()) for k in dict.fromkeys(part.tolist())},
        "chance_recall10": chance_recall(N, [len(relevant[f]) for f in fact_of], 10),
        "merged_from": merged,
        "planted": planted,
        "lexical": lexical_report(nl) if nl else None,
        "lexical_sequences": sequence_overlap(shards, T, queries, relevant) if nl else None,
        "costs": methods.costs,
        "not_run": methods.not_run,
        "finetune_seconds": round(t_ft, 1),
        "stage_dir": str(stage),
    }


def selected_methods(option: str | None) -> set[str] | None:
    """``--methods a,b``: the names, checked against ``METHODS``; None runs every method."""
    if option is None:
        return None
    names = {n.strip() for n in option.split(",") if n.strip()}
    if unknown := names - set(METHODS):
        raise SystemExit(f"[real-claims] --methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    return names


def merge_earlier(
    path: Path | None, matched: Json, planted: dict[str, Mapping[str, Mapping[str, object]]], methods: Methods
) -> Json | None:
    """``--merge-from``: the earlier record's rows of the methods this run has not, added to ``planted`` and the
    costs, and dropped from ``not_run``; what came from where is returned for the record (None: no merge)."""
    if path is None:
        return None
    earlier = json.loads(path.read_text())
    # this run's methods are those with scores (costs.json may name one whose scores were set aside) and its own
    # cost entries (``_curvature``)
    have = {*methods.scores, *(k for k in methods.costs if k.startswith("_"))}
    rows, costs = earlier_method_rows(earlier, matched, have, source=str(path))
    planted.update(rows)
    methods.costs.update(costs)
    for name in rows:
        methods.not_run.pop(name, None)
    env = earlier.get("environment", {})
    merged = {"file": path.name, "git_revision": env.get("git_revision"), "methods": sorted(rows)}
    # a record that was itself completed from another keeps that provenance one level down
    return merged | ({"earlier": earlier["merged_from"]} if earlier.get("merged_from") else {})


def sequence_overlap(shards: ShardSet, T: int, queries: list[Query], relevant: list[set[int]]) -> list[Json]:
    """``content_overlap`` of each query's text (prompt + answer) with the training sequences, as BM25 sees them."""
    tok = shards.tokenizer
    seqs = [tok.decode(shards.train.sequence(j, T).tolist()) for j in range(shards.train.num_sequences(T))]
    return [dict(content_overlap(seqs, tok.decode(ids[1:]), r)) for (ids, _), r in zip(queries, relevant, strict=True)]


def finetune(ctx: ClaimsContext, size: PlantSize, corpus: Path, out: Path) -> Path:
    """Retrofit the shipped model on the planted corpus: stage 1 the bank on stored z, stage 2 ``UNFREEZE`` + the
    bank. Resumable: a partial z pass continues (same call), a checkpoint short of ``steps`` trains on."""
    recipe = RetrofitRecipe(
        corpus=str(corpus),
        steps=size.steps,
        frozen_steps=size.frozen_steps,
        unfreeze=UNFREEZE,
        prototypes=size.prototypes,
        top_k=8,
        batch_size=size.batch_size,
        block_size=size.block_size,
        backbone_lr_ratio=0.3,
    )
    # the smoke corpus (~700 tokens, 16 documents) needs a larger share to give the validation split a block
    val = 0.2 if ctx.quick else 0.02
    overrides = [
        "train.eval_batches=2",
        f"data.val_fraction={val}",
        f"train.ckpt_interval={size.steps if ctx.quick else max(size.steps // 8, 1)}",
        # stage 2 learns the planted facts: CE on the corpus (not distillation to the source model, which would
        # keep the model from learning them), on stored boundary activations (2 blocks a step, not 30)
        "train.stage2_target=data",
        *ctx.head_overrides,  # --head: the fine-tune's bank learns the same objective as the claims' bank
    ]
    if has_checkpoint(out):
        step = json.loads((find_checkpoint(out) / "manifest.json").read_text()).get("step", 0)
        if step >= size.steps:
            return out  # finished earlier (the trainer refuses to "extend" a run to the step it is at)
        ctx.log(f"attribution: resuming the fine-tune in {out} at step {step}")
        retrofit_model(out=out, recipe=recipe, resume=True, device=ctx.device, progress=True)
    else:
        ctx.log(f"attribution: fine-tuning {DEMO_MODEL} ({UNFREEZE}, {size.steps} steps) → {out}")
        retrofit_model(DEMO_MODEL, out=out, recipe=recipe, overrides=overrides, device=ctx.device, progress=True)
    return out


def retire_stale(stage: Path, step: int, log: Callable[[str], None]) -> None:
    """Results of an earlier, shorter fine-tune (``learning.json``, ``methods/``) renamed aside (``-step<N>``)
    when the fine-tune has trained on since (``fine_tune_step.json`` records the step they belong to; a folder
    without it is taken to belong to the present fine-tune, the only one there was)."""
    marker = stage / "fine_tune_step.json"
    before = json.loads(marker.read_text())["step"] if marker.exists() else step
    if before != step:
        for name in ("learning.json", "methods"):
            if (stage / name).exists():
                (stage / name).rename(stage / f"{name}-step{before}")
        log(f"attribution: the fine-tune moved from step {before} to {step}; its earlier results set aside")
    marker.write_text(json.dumps({"step": step}) + "\n")


def cached_json(path: Path, fn: Callable[[], Json]) -> Json:
    """``fn()``'s dict, saved at ``path`` (a rerun reads it)."""
    if path.exists():
        return json.loads(path.read_text())
    out = fn()
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def learning(ps: PlantedSet, net: PrismLM, tok: Tokenizer, T: int) -> Json:
    """Held-out accuracy of the fine-tuned model and of the source (stage 1 leaves its logits unchanged, so the
    source with an untrained bank stands for "before")."""
    from prismlm.model.pretrained import build_model, load_pretrained

    after = ps.accuracy(net, tok)
    pre = load_pretrained(DEMO_MODEL, block_size=T)
    before = ps.accuracy(build_model(pre, net.config).eval(), tok)
    del pre
    nll = ""
    if "answer_nll_per_token" in after:
        nll = f"; answer NLL/token {before['answer_nll_per_token']:.2f} → {after['answer_nll_per_token']:.2f}"
    if after.get("statement_top1") is not None:  # the non-lexical set: the statements completed verbatim
        nll += (f"; statements top-1 {before['statement_top1']:.2f} → {after['statement_top1']:.2f} (chance "
                f"{after['statement_chance_top1']:.2f})")  # fmt: skip
    return {
        "before": before,
        "after": after,
        "summary": f"top-1 {before['top1']:.2f} → {after['top1']:.2f} (chance {after['chance_top1']:.2f}){nll}",
    }


# ----- the methods ---------------------------------------------------------------------------------------
class Methods:
    """Every method's (Q, N) scores and costs; each method's result is saved under ``folder`` as it finishes
    (``<name>.npy`` + ``costs.json``), so a rerun skips the finished ones."""

    def __init__(
        self,
        ctx: ClaimsContext,
        size: PlantSize,
        folder: Path,
        net: PrismLM,
        shards: ShardSet,
        queries: list,
        run_dir: Path,
    ):
        self.ctx, self.size, self.folder, self.net, self.shards, self.queries = ctx, size, folder, net, shards, queries
        self.run_dir = run_dir
        folder.mkdir(parents=True, exist_ok=True)
        self.T = net.config.block_size
        self.N = shards.train.num_sequences(self.T)
        self.scores: dict[str, np.ndarray] = {}
        self.costs: dict[str, Json] = (
            json.loads((folder / "costs.json").read_text()) if (folder / "costs.json").exists() else {}
        )
        self.not_run: dict[str, str] = {}
        self._curv: Curvature | None = None
        self._kb: KronfluenceBaseline | None = None

    def sync(self) -> None:
        sync(torch.device(self.ctx.device))

    def done(self, name: str) -> bool:
        if (self.folder / f"{name}.npy").exists() and name in self.costs:
            self.scores[name] = np.load(self.folder / f"{name}.npy")
            return True
        return False

    def save(self, name: str, S: np.ndarray, cost: Mapping[str, object]) -> None:
        self.scores[name], self.costs[name] = S, dict(cost)
        np.save(self.folder / f"{name}.npy", S)
        (self.folder / "costs.json").write_text(json.dumps(self.costs, indent=1) + "\n")
        self.ctx.log(f"attribution: {name} done ({cost})")

    def run_all(self, finished_only: bool = False, selected: set[str] | None = None) -> None:
        """Run each method not finished yet, in order. ``finished_only``: run none; the finished ones' scores are
        read back and the rest named in ``not_run`` (a partial record of a run that resumes later). ``selected``
        (``--methods``): run only these; the others are read back where finished, else named in ``not_run``."""

        def skipped(name: str) -> str | None:
            if finished_only:
                return NOT_FINISHED
            key = "hybrid-ekfac" if name.startswith("hybrid-ekfac") else name
            return NOT_SELECTED if selected is not None and key not in selected else None

        def run(name: str, fn: Callable[[], None]) -> None:
            if self.done(name):
                return
            if why := skipped(name):
                self.not_run[name] = why
            else:
                fn()

        for name, fn in (
            ("bm25", self.bm25),
            ("cached", self.cached),
            ("cached-compact", self.cached_compact),
            ("grad-dot", self.grad_dot),
        ):
            run(name, fn)
        self.done("bm25-prompt")  # saved by bm25()
        if "cached-compact" in self.scores and "grad-dot" in self.scores:
            self.hybrid()
        try:  # the two share one factor fit (``kronfluence``), whose scratch folder goes even if one fails
            run("ekfac", self.ekfac)
            if "cached-compact" in self.scores:
                run(f"hybrid-ekfac-m{self.size.hybrid_m}", self.hybrid_ekfac)
        finally:
            if self._kb is not None:
                self._kb.close()
                self._kb = None
        run("trak", self.trak)
        bergson = os.environ.get("BERGSON_PYTHON")
        if self.done("bergson") and self.costs["bergson"].get("modules") == list(self.finetuned_modules()):
            pass  # scores saved on other modules (before bergson was given EK-FAC's) are not reused
        elif bergson and not skipped("bergson"):
            self.bergson(bergson)
        else:
            self.scores.pop("bergson", None)
            self.not_run["bergson"] = (
                skipped("bergson")
                or "not run: set BERGSON_PYTHON to a python with bergson==2.5.1 installed (a separate venv; "
                "prismlm.integrations.bergson says how to make it)"
            )

    def bm25(self) -> None:
        tok = self.shards.tokenizer
        t0 = time.perf_counter()
        docs = [tok.decode(self.shards.train.sequence(j, self.T).tolist()) for j in range(self.N)]
        texts = [tok.decode(ids[1:]) for ids, _ in self.queries]  # the query text (prompt + answer)
        prompts = [tok.decode(ids[1:start]) for ids, start in self.queries]  # the question alone
        t1 = time.perf_counter()
        S = bm25_scores(docs, texts)
        per = (time.perf_counter() - t1) / len(texts)
        self.save("bm25-prompt", bm25_scores(docs, prompts), {"per_query_s": per, "oneoff_s": t1 - t0})
        self.save("bm25", S, {"per_query_s": per, "oneoff_s": t1 - t0, "note": "includes building the term matrix"})

    def curvature(self) -> Curvature:
        if self._curv is None:
            t0 = time.perf_counter()
            self._curv = curvature_pass(self.net, self.shards)
            self.costs.setdefault("_curvature", {})["seconds"] = time.perf_counter() - t0
        return self._curv

    def _cache(self, name: str, cfg: AttributionConfig) -> None:
        curv = self.curvature()
        t0 = time.perf_counter()
        cache = build_cache(self.net, self.shards, cfg, curvature=curv)
        oneoff = time.perf_counter() - t0 + num(self.costs, "_curvature", "seconds")
        timing, S_t = per_query_seconds(
            lambda qs: cache.scores(query_gradients(self.net, qs), len(qs)),
            self.queries,
            max(self.size.timing_queries, 2),
            self.sync,
        )
        S = S_t.numpy()
        cost = {
            "per_query_s": timing["single_query_s"],
            **timing,
            "oneoff_s": oneoff,
            "bytes_per_token": cache.manifest["bytes_per_token"],
            "r": cache.r,
        }
        self.save(name, S, cost)

    def cached(self) -> None:
        self._cache("cached", AttributionConfig(seed=self.ctx.seed))

    def cached_compact(self) -> None:
        # app.build_run_cache's compact recipe (bench/attribution.py "cached-compact")
        cfg = AttributionConfig(projection="pca-local", r=40, dtype="pq", id_encoding="delta", seed=self.ctx.seed)
        self._cache("cached-compact", cfg)

    def finetuned_net(self) -> PrismLM:
        """The model with ``requires_grad`` on the fine-tuned parameters only (the last blocks, final norm, bank):
        what the gradient methods differentiate."""
        from prismlm.train.state import set_trainable, trainable_names

        set_trainable(self.net, trainable_names(self.net, UNFREEZE))
        return self.net

    def grad_dot(self) -> None:
        """Whole fine-tune gradient dot products g_qᵀ g_j (float32), streamed over the training sequences."""
        wn = WholeNetworkGradients(self.finetuned_net(), self.shards, memo=False)
        t0 = time.perf_counter()
        gq = torch.stack([wn.query(ids, st).float() for ids, st in self.queries])  # (Q, P)
        t_q = (time.perf_counter() - t0) / len(self.queries)
        S = np.zeros((len(self.queries), self.N))
        t0 = time.perf_counter()
        for j in range(self.N):
            S[:, j] = (gq @ wn.train(j).float()).numpy()
            if j % 50 == 0:
                self.ctx.log(f"attribution: grad-dot {j}/{self.N} ({time.perf_counter() - t0:.0f} s)")
        t_t = (time.perf_counter() - t0) / self.N
        cost = {
            "per_query_s": t_q + self.N * t_t,
            "query_gradient_s": t_q,
            "train_gradient_s": t_t,
            "parameters": int(gq.shape[1]),
            "note": "per query: its gradient + one backward pass per training sequence (no store)",
        }
        self.save("grad-dot", S, cost)

    def hybrid(self) -> None:
        """The compact cache's top-M re-scored by ``grad-dot`` (the app's ``--rescore``); the scores are read off
        the grad-dot matrix, the per-query cost is the cache's + computing the M candidates' gradients."""
        m = self.size.hybrid_m
        name = f"hybrid-grad-m{m}"
        base = torch.from_numpy(self.scores["cached-compact"])
        R = torch.from_numpy(self.scores["grad-dot"])
        H, cands = hybrid_scores(base, lambda q, ids: R[q, ids], m)
        cost = self.costs.get(name)
        if cost is None:
            wn = WholeNetworkGradients(self.finetuned_net(), self.shards, memo=False)
            times = []
            for q in range(min(self.size.timing_queries, len(self.queries))):
                t0 = time.perf_counter()
                wn.dot(wn.query(*self.queries[q]), cands[q].tolist())
                times.append(time.perf_counter() - t0)
            rescore = statistics.median(times)
            cost = {
                "per_query_s": num(self.costs, "cached-compact", "per_query_s") + rescore,
                "rescore_s": rescore,
                "m": m,
            }
        self.save(name, H.numpy(), cost)

    def finetuned_modules(self) -> tuple[str, ...]:
        """The fine-tuned blocks' ``nn.Linear`` modules (``size.scope`` of them), in ``named_modules`` order: what
        EK-FAC and bergson are given (the unembedding's V×V factor is out of EK-FAC's reach; the bank is not a
        Linear)."""
        net = self.finetuned_net()
        prefixes = tuple(net.block_prefixes()[-int(UNFREEZE.removeprefix("last-")) :])
        return tuple(
            n
            for n, m in net.named_modules()
            if isinstance(m, torch.nn.Linear) and (n + ".").startswith(prefixes) and self.size.scope in n
        )

    def ekfac(self) -> None:
        """kronfluence EK-FAC on the fine-tuned blocks' ``nn.Linear`` modules (``finetuned_modules``)."""
        kb = self.kronfluence()
        t_f = kb.timings["factors_seconds"]
        eot = self.shards.tokenizer.eot_id
        # timed as the cache is (per_query_seconds): all queries in one call ÷ Q, and one query per call
        timing, S_t = per_query_seconds(
            lambda qs: kb.scores(qs, eot, query_batch_size=len(qs)), self.queries, self.size.timing_queries, self.sync
        )
        S = S_t.numpy()
        cost = {
            "per_query_s": timing["batched_per_query_s"],
            **timing,
            "batch_scores_s": timing["batched_per_query_s"] * len(self.queries),
            "oneoff_s": t_f,
            "factor_examples": self.size.factor_examples or self.N,
            "modules": list(self.finetuned_modules()),
        }
        self.save("ekfac", S, cost)

    def kronfluence(self) -> KronfluenceBaseline:
        """kronfluence's EK-FAC factors on the fine-tuned blocks' ``nn.Linear`` modules (``finetuned_modules``),
        fitted once a run and shared by ``ekfac`` and ``hybrid_ekfac`` (seeded: a second fit gives the same
        factors); ``run_all`` closes it."""
        if self._kb is None:
            mods = self.finetuned_modules()
            self.ctx.log(f"attribution: EK-FAC on {len(mods)} modules; fitting factors")
            self._kb = KronfluenceBaseline(
                self.finetuned_net(), self.shards, strategy="ekfac", batch_size=8, modules=mods,
                seed=self.ctx.seed, factor_examples=self.size.factor_examples,
            )  # fmt: skip
        return self._kb

    def hybrid_ekfac(self) -> None:
        """The compact cache's top-M re-scored by EK-FAC: each query's M candidates scored by kronfluence
        against those M sequences only (``KronfluenceBaseline.scores_on``, with the factors ``ekfac`` uses),
        one query per call, each call timed; then batched as EK-FAC is: all queries in one call against the union
        of their candidates (the scores at each query's own candidates must equal the one-query calls'). Cost
        model: per query, the compact cache's + that re-scoring (``per_query_s`` = ``single_query_s``: one query
        alone; ``batched_per_query_s``: the batched call ÷ queries); one-off, the cache's build + the factors'
        fit."""
        m = self.size.hybrid_m
        kb = self.kronfluence()
        eot = self.shards.tokenizer.eot_id
        times: list[float] = []

        def rescore(q: int, ids: list[int]) -> torch.Tensor:
            t0 = time.perf_counter()
            s = kb.scores_on([self.queries[q]], ids, eot)[0]  # (M,)
            self.sync()
            times.append(time.perf_counter() - t0)
            return s

        H, cands = hybrid_scores(torch.from_numpy(self.scores["cached-compact"]), rescore, m)
        rescore_s = statistics.median(times)
        union = torch.unique(cands)  # (U,) sorted: every query's candidates
        t0 = time.perf_counter()
        batch = kb.scores_on(self.queries, union.tolist(), eot)  # (Q, U)
        self.sync()
        batch_s = time.perf_counter() - t0
        at_cands = batch.double().gather(1, torch.searchsorted(union, cands))  # (Q, M): each query's own
        single = num(self.costs, "cached-compact", "single_query_s") + rescore_s
        cost = {
            "per_query_s": single,
            "single_query_s": single,
            "batched_per_query_s": num(self.costs, "cached-compact", "batched_per_query_s") + batch_s / len(H),
            "rescore_s": rescore_s,
            "batch_rescore_s": batch_s,
            "union": len(union),
            "batched_max_abs_diff": float((at_cands - H.gather(1, cands)).abs().max()),
            "m": m,
            "oneoff_s": num(self.costs, "cached-compact", "oneoff_s") + kb.timings["factors_seconds"],
            "note": "per query: the compact cache's + EK-FAC on its top M (one query alone: the median of one call "
            "per query; batched: all queries in one call against the union of their candidates, ÷ queries)",
        }
        self.save(f"hybrid-ekfac-m{m}", H.numpy(), cost)

    def trak(self) -> None:
        """TRAK (traker 0.3.2, TRAK's CPU projector) on the fine-tuned parameters (``size.scope`` of them): one
        checkpoint, proj_dim ``size.trak_proj_dim`` > N with a ridge of 0.1 × the mean eigenvalue of XᵀX
        (kronfluence's damping heuristic, EK-FAC's here): TRAK refuses proj_dim ≥ N without one, and with
        proj_dim > N the ridge solve is kernel ridge regression on the projected gradients' Gram matrix. The
        per-query cost: all queries in one scoring call ÷ queries, and a single-query call (each call draws the
        projector's Gaussian blocks again: ~18 s per 100 dimensions for 7.2M parameters on one thread)."""
        from prismlm.train.state import trainable_names

        net = self.finetuned_net()
        names = sorted(n for n in trainable_names(net, UNFREEZE) if self.size.scope in n)
        eot = self.shards.tokenizer.eot_id
        batch = max(len(self.queries), 64)  # one call per 64 training sequences / for all queries
        self.ctx.log(f"attribution: TRAK on {len(names)} parameter tensors; featurising {self.N} sequences")
        tb = TrakBaseline(
            net,
            self.shards,
            proj_dim=self.size.trak_proj_dim,
            lambda_reg=0.1,
            lambda_relative=True,
            parameters=names,
            batch_size=batch,
            seed=self.ctx.seed,
        )
        t0 = time.perf_counter()
        S = tb.scores(self.queries, eot).numpy()
        t_all = time.perf_counter() - t0
        t0 = time.perf_counter()
        tb.scores(self.queries[:1], eot)
        t_one = time.perf_counter() - t0
        cost = {
            "per_query_s": t_all / len(self.queries),
            "single_query_s": t_one,
            "batch_scores_s": t_all,
            "oneoff_s": tb.timings["features_seconds"],
            "parameters": int(tb.traker.num_params_for_grad),
            "proj_dim": self.size.trak_proj_dim,
            "lambda_reg": "0.1 x mean eigenvalue of XtX",
            "lambda_abs": tb.lambda_abs,
        }
        tb.close()
        self.save("trak", S, cost)

    def bergson(self, python: str) -> None:
        """bergson==2.5.1 from its own venv (``BERGSON_PYTHON``; ``prismlm.integrations.bergson`` says how to make
        it) on EK-FAC's modules (``finetuned_modules``), 16 dimensions per module. Per-query cost: the query index
        (all queries, one bergson process) ÷ queries + the dot products, and one single-query index build (a
        process start and model load included, as a user of the CLI pays); one-off: the export and the training
        index."""
        from prismlm.integrations.bergson import bergson_scores, build_index

        work = self.folder / "bergson"
        mods = self.finetuned_modules()
        self.ctx.log(f"attribution: bergson on {len(mods)} modules")
        try:
            S, secs = bergson_scores(
                python, self.run_dir, self.shards, self.queries, self.N, self.T, work, threads=self.ctx.threads,
                modules=mods,
            )  # fmt: skip
            (work / "one.jsonl").write_text((work / "query.jsonl").read_text().splitlines()[0] + "\n")
            one = build_index(
                python, work / "model", work / "one.jsonl", work / "one-idx", self.T, 16, self.ctx.threads, mods
            )
        except Exception as e:  # recorded: the JSON says why bergson is missing
            self.not_run["bergson"] = f"failed: {type(e).__name__}: {e}"
            self.ctx.log(f"attribution: bergson {self.not_run['bergson']}")
            return
        cost = {
            "per_query_s": (secs["query_index_s"] + secs["scores_s"]) / len(self.queries),
            "single_query_s": one + secs["scores_s"] / len(self.queries),
            "oneoff_s": secs["export_s"] + secs["train_index_s"],
            "projection_dim": 16,
            "modules": list(mods),
            **secs,
        }
        self.save("bergson", S, cost)


def main(argv: list[str] | None = None) -> None:
    def variant(args: argparse.Namespace) -> str:
        return ("" if args.planted == "named" else f"-{args.planted}") + ("-partial" if args.finished_only else "")

    run_claims_stage("attribution", attribution_stage, __doc__, argv, add_options, variant)


if __name__ == "__main__":
    main()
