"""Data pipeline: corpora -> documents -> tokenizer -> memory-mapped token shards.

Typical use::

    from prismlm.data import prepare_shards
    ss = prepare_shards("builtin", "bpe-8192")      # cached under $PRISM_DATA
    x = ss.train.sequences(np.array([0, 5]), 256)    # (2, 257) int64
"""

from prismlm.data.corpus import Document, corpus_fingerprint, iter_documents, split_of
from prismlm.data.shards import ShardSet, TokenShard, default_data_dir, load_shards, prepare_shards
from prismlm.data.stream import StreamingData, TokenStream, prepare_stream
from prismlm.data.tokenizer import (
    Tokenizer,
    gpt2_tokenizer,
    hf_tokenizer,
    resolve_tokenizer,
    token_dtype,
    train_bpe,
)

__all__ = [
    "Document",
    "corpus_fingerprint",
    "iter_documents",
    "split_of",
    "ShardSet",
    "TokenShard",
    "default_data_dir",
    "load_shards",
    "prepare_shards",
    "StreamingData",
    "TokenStream",
    "prepare_stream",
    "Tokenizer",
    "gpt2_tokenizer",
    "hf_tokenizer",
    "resolve_tokenizer",
    "token_dtype",
    "train_bpe",
]
