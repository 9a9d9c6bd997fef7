"""The lexical baseline of attribution: Okapi BM25 of each query's words against each training document's words
(what a planted-fact set must beat to show that attribution does more than lexical match).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

WORD = re.compile(r"[a-z0-9]+")


def bm25_scores(docs: list[str], queries: list[str], k1: float = 1.5, b: float = 0.75) -> np.ndarray:
    """(Q, N) Okapi BM25 of each query against each document (lower-cased alphanumeric words; idf with +1 so it
    stays positive)."""
    toks = [WORD.findall(d.lower()) for d in docs]
    vocab = {w: i for i, w in enumerate(sorted({w for t in toks for w in t}))}
    tf = np.zeros((len(docs), len(vocab)))  # (N, W) term counts
    for j, t in enumerate(toks):
        for w, c in Counter(t).items():
            tf[j, vocab[w]] = c
    dl = tf.sum(1, keepdims=True)
    idf = np.log(1 + (len(docs) - (tf > 0).sum(0) + 0.5) / ((tf > 0).sum(0) + 0.5))  # (W,)
    w_tf = tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / dl.mean()))  # (N, W)
    qv = np.zeros((len(queries), len(vocab)))
    for q, text in enumerate(queries):
        for w, c in Counter(WORD.findall(text.lower())).items():
            if w in vocab:
                qv[q, vocab[w]] = c
    return qv @ (w_tf * idf).T
