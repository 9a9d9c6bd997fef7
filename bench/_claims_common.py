"""Shared by the stages of ``bench/real_claims.py``: the context each stage gets, and the ``bank`` stage
(the retrofitted SmolLM2-135M-Instruct whose anchor corpus holds the concepts the claims are about).

Not a public API; ``bench/real_claims.py`` imports it as a sibling module.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch

from prismlm.app.demos import DEMO_MODEL
from prismlm.app.indexing import build_run_index
from prismlm.app.retrofit import RetrofitRecipe, retrofit_model
from prismlm.app.run import Run
from prismlm.control.judges import FortuneSplits, fortune_splits
from prismlm.data.corpus import Document, gutenberg_documents, sotu_documents
from prismlm.errors import CheckpointError
from prismlm.train.checkpoint import find_checkpoint

# Corpus files of the anchor set; a document's id is "<file>#L<line>", so these names are the concept regexes.
CORPUS_FILES = ("gutenberg.jsonl", "sotu.jsonl", "fortunes_clean.jsonl", "fortunes_offensive.jsonl", "kjv.jsonl")
KJV_ID = "gutenberg/bible-kjv"
"""Document-id prefix of the King James Bible in ``gutenberg_documents()`` (94 documents of ~8k characters)."""
KJV_ANCHOR_STRIDES = (3, 5)
"""``kjv.jsonl`` draws the KJV documents whose position j in ``gutenberg_documents()`` has j % 7 in these (the
Gutenberg file takes j % 7 == 0, the held-out documents j % 7 == 1), so the anchor, judge and held-out KJV
text never overlap."""


@dataclass(frozen=True)
class BankSize:
    """How big the anchor corpus and the bank are (``--quick``: a smoke size)."""

    gutenberg_docs: int
    sotu_docs: int
    clean_fortunes: int
    offensive_fortunes: int
    kjv_docs: int
    """King James Bible documents of ``kjv.jsonl`` (the style concept the model clearly shows)."""
    chars_per_doc: int
    prototypes: int
    top_k: int
    steps: int
    block_size: int


SIZES = {
    # Why these counts: the concept must be a sizeable share of the anchor tokens or no prototype
    # specialises on it (bench/suppression.py), and the one z pass over them costs ~250 tokens/s here.
    # kjv_docs: the first run (5 KJV documents, only those the every-7th Gutenberg draw happened to hold,
    # ~2.5% of the anchor tokens) found 24 KJV prototypes and cut the judged style by 25% at most; 24
    # documents make it ~12% of the anchor tokens (docs/results.md, "Suppression").
    "quick": BankSize(8, 8, 120, 60, 3, 1500, 256, 8, 40, 128),
    "full": BankSize(40, 40, 1200, 600, 24, 3000, 2048, 8, 400, 128),
}


@dataclass
class ClaimsContext:
    """What every stage of ``real_claims.py`` gets."""

    quick: bool
    threads: int
    work: Path
    """``bench/runs/real-claims[-quick]``: each stage writes under ``work / <stage>``; ``work / bank / run``
    is the retrofitted model (built by the ``bank`` stage)."""
    seed: int = 0
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def size(self) -> BankSize:
        return SIZES["quick" if self.quick else "full"]

    def stage_dir(self, name: str) -> Path:
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def corpus_dir(self) -> Path:
        """The anchor corpus (one jsonl per source; ``CORPUS_FILES``)."""
        return self.work / "bank" / "corpus"

    @property
    def bank_run(self) -> Path:
        """The retrofitted model's run folder."""
        return self.work / "bank" / "run"

    def open_run(self, suppress: str | Path | None = None) -> Run:
        """The retrofitted model (``bank`` stage first), on ``device``."""
        if not has_checkpoint(self.bank_run):
            sys.exit(f"[real-claims] {self.bank_run} holds no model yet: run the bank stage first (--stage bank)")
        return Run.open(self.bank_run, device=self.device, suppress=suppress)

    def fortunes(self) -> FortuneSplits:
        """The FreeBSD fortunes, split: the LM split feeds the anchor corpus, the judge split never does."""
        return fortune_splits()

    def log(self, message: str) -> None:
        print(f"[real-claims] {message}", file=sys.stderr, flush=True)


def has_checkpoint(folder: Path) -> bool:
    try:
        find_checkpoint(folder)
    except CheckpointError:
        return False
    return True


def kjv_anchor_documents(n: int) -> list[Document]:
    """The first ``n`` King James Bible documents of ``kjv.jsonl`` (positions j % 7 in
    ``KJV_ANCHOR_STRIDES``), in corpus order."""
    docs = enumerate(gutenberg_documents())
    return [d for j, d in docs if j % 7 in KJV_ANCHOR_STRIDES and d.id.startswith(KJV_ID)][:n]


def write_corpus(ctx: ClaimsContext) -> dict[str, int]:
    """The anchor corpus: Gutenberg and SOTU documents (every n-th, so many books and presidents appear), a
    random subset of the LM split of the clean and the offensive fortunes, and King James Bible documents
    (``kjv_anchor_documents``). Returns documents per file."""
    size, rng = ctx.size, random.Random(ctx.seed)
    fs = ctx.fortunes()
    gutenberg = [d.text[: size.chars_per_doc] for d in islice(gutenberg_documents(), 0, None, 7)]
    sotu = [d.text[: size.chars_per_doc] for d in islice(sotu_documents(), 0, None, 3)]
    texts = {
        "gutenberg.jsonl": rng.sample(gutenberg, min(size.gutenberg_docs, len(gutenberg))),
        "sotu.jsonl": rng.sample(sotu, min(size.sotu_docs, len(sotu))),
        "fortunes_clean.jsonl": rng.sample(fs.lm_clean, min(size.clean_fortunes, len(fs.lm_clean))),
        "fortunes_offensive.jsonl": rng.sample(fs.lm_offensive, min(size.offensive_fortunes, len(fs.lm_offensive))),
        "kjv.jsonl": [d.text[: size.chars_per_doc] for d in kjv_anchor_documents(size.kjv_docs)],
    }
    ctx.corpus_dir.mkdir(parents=True, exist_ok=True)
    for name, docs in texts.items():
        tmp = ctx.corpus_dir / (name + ".tmp")
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        tmp.replace(ctx.corpus_dir / name)
    return {name: len(docs) for name, docs in texts.items()}


def bank_stage(ctx: ClaimsContext) -> dict[str, object]:
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
            overrides=["train.eval_batches=2", "data.val_fraction=0.1"],
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
