"""The anchor corpus of the claims' bank (``bench/claims_bank.py``): the documents a pretrained model is retrofitted
on so that its prototypes can specialise on the concepts the suppression experiments switch off — Gutenberg and
State-of-the-Union documents, the LM split of the FreeBSD fortunes (clean and offensive) and King James Bible
documents, one jsonl per source. A document's id in the corpus is ``<file>#L<line>``, so the file names are the
concepts' document regexes (``prismlm.control.concept.doc_regex``).
"""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

from prismlm.control.judges import FortuneSplits
from prismlm.data.corpus import Document, gutenberg_documents, sotu_documents

KJV_ID = "gutenberg/bible-kjv"
"""Document-id prefix of the King James Bible in ``gutenberg_documents()``."""
GUTENBERG_STRIDE = 7
"""``gutenberg.jsonl`` draws from every 7th Gutenberg document (j % 7 == 0), so many books appear; the
held-out documents of the experiments take j % 7 == 1."""
KJV_ANCHOR_STRIDES = (3, 5)
"""``kjv.jsonl`` draws the KJV documents whose position j in ``gutenberg_documents()`` has j % 7 in these, so
the anchor, judge and held-out KJV text never overlap."""
SOTU_STRIDE = 3


def kjv_anchor_documents(n: int) -> list[Document]:
    """The first ``n`` King James Bible documents of ``kjv.jsonl`` (positions j % 7 in ``KJV_ANCHOR_STRIDES``),
    in corpus order."""
    docs = enumerate(gutenberg_documents())
    return [d for j, d in docs if j % GUTENBERG_STRIDE in KJV_ANCHOR_STRIDES and d.id.startswith(KJV_ID)][:n]


def anchor_corpus(
    fortunes: FortuneSplits,
    *,
    gutenberg_docs: int,
    sotu_docs: int,
    clean_fortunes: int,
    offensive_fortunes: int,
    kjv_docs: int,
    chars_per_doc: int,
    seed: int = 0,
) -> dict[str, list[str]]:
    """file name → texts: a random sample of ``gutenberg_docs`` of every 7th Gutenberg document and
    ``sotu_docs`` of every 3rd SOTU address (each cut to ``chars_per_doc``), of the LM split of the clean and
    the offensive fortunes, and the first ``kjv_docs`` King James Bible documents (``kjv_anchor_documents``).
    Deterministic in ``seed`` (one generator, drawn in file order)."""
    rng = random.Random(seed)
    gutenberg = [d.text[:chars_per_doc] for d in islice(gutenberg_documents(), 0, None, GUTENBERG_STRIDE)]
    sotu = [d.text[:chars_per_doc] for d in islice(sotu_documents(), 0, None, SOTU_STRIDE)]
    lm_clean, lm_off = fortunes.lm_clean, fortunes.lm_offensive
    return {
        "gutenberg.jsonl": rng.sample(gutenberg, min(gutenberg_docs, len(gutenberg))),
        "sotu.jsonl": rng.sample(sotu, min(sotu_docs, len(sotu))),
        "fortunes_clean.jsonl": rng.sample(lm_clean, min(clean_fortunes, len(lm_clean))),
        "fortunes_offensive.jsonl": rng.sample(lm_off, min(offensive_fortunes, len(lm_off))),
        "kjv.jsonl": [d.text[:chars_per_doc] for d in kjv_anchor_documents(kjv_docs)],
    }


def write_text_files(folder: Path, texts: dict[str, list[str]]) -> dict[str, int]:
    """Each file of ``texts`` as ``{"text": ...}`` lines under ``folder`` (written whole, then renamed, so a
    killed run leaves no half file); documents per file."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs in texts.items():
        tmp = folder / (name + ".tmp")
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        tmp.replace(folder / name)
    return {name: len(docs) for name, docs in texts.items()}
