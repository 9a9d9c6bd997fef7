"""Data pipeline: corpora -> documents -> tokenizer -> memory-mapped token shards.

Typical use::

    from prismlm.data import prepare_shards
    ss = prepare_shards("builtin", "bpe-8192")      # cached under $PRISM_DATA
    x = ss.train.sequences(np.array([0, 5]), 256)    # (2, 257) int64
"""

from .corpus import CorpusError, Document, corpus_fingerprint, iter_documents, split_of
from .shards import ShardError, ShardSet, TokenShard, default_data_dir, load_shards, prepare_shards
from .tokenizer import (
    Tokenizer,
    TokenizerError,
    gpt2_tokenizer,
    hf_tokenizer,
    resolve_tokenizer,
    token_dtype,
    train_bpe,
)

__all__ = [
    "CorpusError", "Document", "corpus_fingerprint", "iter_documents", "split_of",
    "ShardError", "ShardSet", "TokenShard", "default_data_dir", "load_shards", "prepare_shards",
    "Tokenizer", "TokenizerError", "gpt2_tokenizer", "hf_tokenizer", "resolve_tokenizer",
    "token_dtype", "train_bpe",
]
