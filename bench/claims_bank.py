"""The ``bank`` stage of ``bench/real_claims.py``: retrofit SmolLM2-135M-Instruct on an anchor corpus that
holds the claims' concepts (Gutenberg, State-of-the-Union, the LM split of the FreeBSD fortunes, King James
Bible documents), stage 1 on stored z, and build its prototype index. Every later stage opens this model.

Run: ``python bench/claims_bank.py [--quick] [--head paper|faithful]`` (or ``python bench/real_claims.py --stage bank``). Resumable:
the retrofit resumes its z pass, the index its parts, under ``WORK/bank``.
"""

from __future__ import annotations

import json
import time

import torch
from _common import ClaimsContext, Json, has_checkpoint, run_claims_stage

from prismlm.app.demos import DEMO_MODEL
from prismlm.app.indexing import build_run_index
from prismlm.app.retrofit import RetrofitRecipe, retrofit_model
from prismlm.control.anchor_corpus import anchor_corpus, write_text_files


def write_corpus(ctx: ClaimsContext) -> dict[str, int]:
    """The anchor corpus (``prismlm.control.anchor_corpus``) at ``ctx``'s size under ``ctx.corpus_dir``;
    documents per file."""
    s = ctx.size
    texts = anchor_corpus(
        ctx.fortunes(),
        gutenberg_docs=s.gutenberg_docs,
        sotu_docs=s.sotu_docs,
        clean_fortunes=s.clean_fortunes,
        offensive_fortunes=s.offensive_fortunes,
        kjv_docs=s.kjv_docs,
        chars_per_doc=s.chars_per_doc,
        seed=ctx.seed,
    )
    return write_text_files(ctx.corpus_dir, texts)


def bank_stage(ctx: ClaimsContext) -> Json:
    """Retrofit SmolLM2-135M-Instruct on the anchor corpus (stage 1 on stored z: logits unchanged) and build
    its prototype index from the stored z. Resumable: the retrofit resumes its z pass, the index its parts."""
    torch.set_num_threads(ctx.threads)
    size, stage = ctx.size, ctx.stage_dir("bank")
    t0 = time.perf_counter()
    docs = write_corpus(ctx)
    ctx.log(f"anchor corpus {ctx.corpus_dir}: {docs}")
    if not has_checkpoint(ctx.bank_run):
        recipe = RetrofitRecipe(
            corpus=str(ctx.corpus_dir),
            steps=size.steps,
            prototypes=size.prototypes,
            top_k=size.top_k,
            batch_size=8,
            block_size=size.block_size,
        )
        # a folder holding only a partial z pass (killed earlier) continues it: same call, no overwrite
        retrofit_model(
            DEMO_MODEL,
            out=ctx.bank_run,
            recipe=recipe,
            # the head (--head): the paper's objective, or + the prototype-only KL of the faithful head
            overrides=["train.eval_batches=2", "data.val_fraction=0.1", *ctx.head_overrides],
            device=ctx.device,
            progress=True,
        )
    t1 = time.perf_counter()
    run = ctx.open_run()
    index = build_run_index(run, progress=True, resume=(ctx.bank_run / "index").exists())
    metrics_path = ctx.bank_run / "metrics.jsonl"
    last_eval = {}
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            rec = json.loads(line)
            if "val_loss" in rec or rec.get("kind") == "eval":
                last_eval = rec
    return {
        "source": DEMO_MODEL,
        "run": str(ctx.bank_run),
        "corpus_docs": docs,
        "size": size.__dict__,
        "retrofit_seconds": round(t1 - t0, 1),
        "index_seconds": round(time.perf_counter() - t1, 1),
        "index": str(getattr(index, "path", index)),
        "last_eval": last_eval,
        "stage_dir": str(stage),
    }


def main(argv: list[str] | None = None) -> None:
    run_claims_stage("bank", bank_stage, __doc__, argv)


if __name__ == "__main__":
    main()
