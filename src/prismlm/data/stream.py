"""Streaming corpora: documents read lazily, tokenised on the fly, packed and shuffled in a bounded buffer.

With ``data.streaming`` the trainer draws its sequences from a :class:`TokenStream` instead of shards: memory
is the buffer, a batch of look-ahead documents and the current document. Invariant: a resumed stream
(:meth:`TokenStream.load_state_dict`) draws bit for bit the sequences of an uninterrupted one, and
validation-split documents are never trained on (:func:`prepare_stream_val` materialises them).
Packing, DDP sharding and the resume position: docs/modules.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from prismlm.artifacts import JSON, FileLock, atomic_write_text
from prismlm.data.corpus import (
    Document,
    corpus_fingerprint,
    file_documents,
    iter_documents,
    resolve_files,
    split_hash,
)
from prismlm.data.shards import TokenShard, default_data_dir, encode_documents
from prismlm.data.tokenizer import Tokenizer, describe_tokenizer, resolve_tokenizer, token_dtype
from prismlm.errors import ConfigError, DataError

if TYPE_CHECKING:
    from prismlm.config import DataConfig

__all__ = ["TokenStream", "StreamingData", "prepare_stream", "prepare_stream_val", "stream_tokenizer"]

STREAM_FORMAT = 1


class StreamState(TypedDict):
    """``TokenStream.state_dict()``: the exact position of a stream, saved in every checkpoint."""

    format: int
    key: dict[str, object]
    """The stream's settings (corpus, tokenizer, seq_len, split, buffer, seed, rank, world): a resume must match."""
    epoch: int
    doc: int
    """Number (in corpus order) of the document being packed."""
    doc_id: str
    offset: int
    """Token offset inside that document."""
    partial: np.ndarray
    """(< seq_len + 1,) tokens of the sequence being packed."""
    buffer: np.ndarray
    """(buffer_size, seq_len + 1) the shuffle buffer."""
    rng: Mapping[str, object]
    """The shuffle generator's ``bit_generator.state``."""
    sequences_drawn: int


_ENCODE_DOCS = 64  # look-ahead documents per encode_batch call
_ENCODE_CHARS = 2_000_000  # ...or fewer, to bound memory with long documents
_BPE = re.compile(r"^bpe(?:[-:](\d+))?$")


def stream_tokenizer(spec: str) -> Tokenizer:
    """The fixed tokenizer of a streaming run: ``gpt2``, ``hf:NAME`` or a saved tokenizer. A ``bpe-N`` spec
    is refused: training it would need a pass over the corpus, which streaming exists to avoid."""
    if _BPE.match(spec):
        raise ConfigError(
            f"data.streaming needs a fixed tokenizer, but data.tokenizer={spec!r} must be trained on the corpus first",
            fix="use data.tokenizer=gpt2, hf:NAME, or a saved tokenizer folder "
            "(e.g. the tokenizer/ of prepared shards)",
        )
    return resolve_tokenizer(spec)


@dataclass(frozen=True)
class StreamSource:
    """Which documents a stream reads: the corpus, how its documents are read, and the hash split that holds
    out the validation documents (the same as a prepared shard set's)."""

    corpus: str
    """The corpus spec (``prismlm.data.corpus``)."""
    text_field: str = "text"
    """Text field of .jsonl/.parquet/HF corpora."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (``split_hash(id, split_seed) < val_fraction``)."""
    split_seed: int = 0
    """Seed of that hash (``data.seed``)."""
    max_docs: int | None = None
    """Only the first N documents."""
    max_chars_per_doc: int | None = None
    """Each document cut to N characters."""

    @classmethod
    def of(cls, data: DataConfig) -> StreamSource:
        return cls(data.corpus, data.text_field, data.val_fraction, data.seed, data.max_docs, data.max_chars_per_doc)


class TokenStream:
    """An endless, seeded, resumable stream of training sequences (``seq_len + 1`` int64 tokens) of one
    rank; see the module docstring. ``docs_encoded`` counts the documents tokenised so far."""

    def __init__(
        self,
        source: StreamSource,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        buffer_size: int = 1024,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
        if buffer_size < 1:
            raise ConfigError(f"the shuffle buffer must hold at least 1 sequence, got {buffer_size}")
        self.corpus, self.tok, self.T = source.corpus, tokenizer, seq_len
        self.text_field, self.val_fraction, self.split_seed = source.text_field, source.val_fraction, source.split_seed
        self.max_docs, self.max_chars_per_doc = source.max_docs, source.max_chars_per_doc
        self.buffer_size, self.seed, self.rank, self.world = buffer_size, seed, rank, world_size
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.eot = np.array([tokenizer.eot_id], dtype=self.dtype)
        self.docs_encoded = 0
        self.sequences_drawn = 0
        self._rng = np.random.default_rng([seed, rank, 0x5EED])
        self._buf = np.zeros((0, seq_len + 1), dtype=self.dtype)
        self._partial = np.zeros(0, dtype=self.dtype)
        self._cur: np.ndarray | None = None  # tokens + eot of the document being packed
        self._cur_pos = (0, -1)  # (epoch, document number) of _cur
        self._cur_id = ""  # its document id (where a resume skips to)
        self._off = 0  # tokens of _cur already packed
        self._docs: Iterator[tuple[int, int, str, str]] | None = None
        self._queue: deque[tuple[int, int, str, np.ndarray]] = deque()

    # -- documents -------------------------------------------------------------------------------------

    def _documents_from(self, start: int, start_id: str) -> Iterator[tuple[int, Document]]:
        """(number, document) of the corpus from document ``start`` (whose id is ``start_id``) on. Local files:
        the files before that document's file are skipped unopened; otherwise documents are re-read (not
        tokenised) up to it."""
        files = (
            []
            if start == 0 or self.corpus == "builtin" or self.corpus.startswith(("builtin:", "hf:"))
            else resolve_files(self.corpus)
        )
        rels = [rel for _, rel in files]
        first = next((k for k, rel in enumerate(rels) if rel in (start_id, start_id.rsplit("#", 1)[0])), None)
        if first is None:
            for i, d in enumerate(
                iter_documents(
                    self.corpus,
                    text_field=self.text_field,
                    max_docs=self.max_docs,
                    max_chars_per_doc=self.max_chars_per_doc,
                )
            ):
                if i >= start:
                    yield i, d
            return
        i, found = start, False
        for path, rel in files[first:]:
            for d in file_documents(path, rel, self.text_field):  # the filtering of iter_documents
                text = d.text
                if self.max_chars_per_doc is not None and len(text) > self.max_chars_per_doc:
                    text = text[: self.max_chars_per_doc]
                if not text.strip():
                    continue
                if not found:
                    if d.id != start_id:
                        continue
                    found = True
                if self.max_docs is not None and i >= self.max_docs:
                    return
                yield i, Document(d.id, text, d.meta)
                i += 1
        if not found:
            raise DataError(
                f"corpus {self.corpus!r} changed since the checkpoint: document {start_id!r} is gone",
                fix="resume on the unchanged corpus",
            )

    def _doc_iter(self, epoch: int, start: int, start_id: str = "") -> Iterator[tuple[int, int, str, str]]:
        """(epoch, number, id, text) of this rank's training documents, from document ``start`` of ``epoch``
        on, then the following epochs. Documents before ``start`` are not tokenised."""
        while True:
            found = False
            for i, d in self._documents_from(start, start_id):
                if i % self.world != self.rank or split_hash(d.id, self.split_seed) < self.val_fraction:
                    continue
                found = True
                yield epoch, i, d.id, d.text
            if not found and start == 0:
                raise DataError(
                    f"corpus {self.corpus!r} has no training document for rank {self.rank} of "
                    f"{self.world} (all are held out for validation or the corpus is too small)",
                    fix="use more documents or a smaller data.val_fraction",
                )
            epoch, start, start_id = epoch + 1, 0, ""

    def _next_doc(self) -> None:
        if not self._queue:
            if self._docs is None:
                self._docs = self._doc_iter(0, 0)
            items: list[tuple[int, int, str, str]] = []
            chars = 0
            while len(items) < _ENCODE_DOCS and chars < _ENCODE_CHARS:
                items.append(next(self._docs))
                chars += len(items[-1][3])
                if items[-1][0] != items[0][0]:  # do not look ahead across an epoch boundary
                    break
            encoded = encode_documents(self.tok, [t for *_, t in items], self.dtype)
            self.docs_encoded += len(items)
            self._queue.extend((e, i, d, ids) for (e, i, d, _), ids in zip(items, encoded))
        e, i, d, ids = self._queue.popleft()
        self._cur, self._cur_pos, self._cur_id, self._off = np.concatenate([ids, self.eot]), (e, i), d, 0

    def _pack(self) -> np.ndarray:
        """The next packed sequence, in corpus order."""
        need = self.T + 1
        while True:
            if self._cur is None or self._off >= len(self._cur):
                self._next_doc()
            assert self._cur is not None
            take = min(need - len(self._partial), len(self._cur) - self._off)
            self._partial = np.concatenate([self._partial, self._cur[self._off : self._off + take]])
            self._off += take
            if len(self._partial) == need:
                out = self._partial
                self._partial = out[-1:].copy()  # stride T: the last target is the next input's first token
                return out

    # -- public --------------------------------------------------------------------------------------------

    def next_sequence(self) -> np.ndarray:
        """The next shuffled training sequence, ``(seq_len + 1,)`` int64."""
        if len(self._buf) < self.buffer_size:
            self._buf = np.stack([self._pack() for _ in range(self.buffer_size)])
        j = int(self._rng.integers(self.buffer_size))
        out = self._buf[j].astype(np.int64)
        self._buf[j] = self._pack()
        self.sequences_drawn += 1
        return out

    def batch(self, n: int) -> np.ndarray:
        """``(n, seq_len + 1)`` int64: the next ``n`` sequences."""
        return np.stack([self.next_sequence() for _ in range(n)])

    @property
    def epoch(self) -> int:
        """Epoch of the document being packed (how many times the corpus has been read through)."""
        return self._cur_pos[0]

    def _key(self) -> dict[str, object]:
        return {
            "corpus": self.corpus,
            "tokenizer": self.tok.fingerprint,
            "seq_len": self.T,
            "text_field": self.text_field,
            "val_fraction": self.val_fraction,
            "split_seed": self.split_seed,
            "max_docs": self.max_docs,
            "max_chars_per_doc": self.max_chars_per_doc,
            "buffer_size": self.buffer_size,
            "seed": self.seed,
            "rank": self.rank,
            "world": self.world,
        }

    def state_dict(self) -> StreamState:
        """The exact position (small: the buffer is at most ``buffer_size × (seq_len + 1)`` tokens)."""
        return {
            "format": STREAM_FORMAT,
            "key": self._key(),
            "epoch": self._cur_pos[0],
            "doc": self._cur_pos[1],
            "doc_id": self._cur_id,
            "offset": self._off,
            "partial": self._partial.copy(),
            "buffer": self._buf.copy(),
            "rng": self._rng.bit_generator.state,
            "sequences_drawn": self.sequences_drawn,
        }

    def load_state_dict(self, state: StreamState) -> None:
        if state.get("format") != STREAM_FORMAT or state.get("key") != self._key():
            diff = sorted(k for k, v in self._key().items() if state.get("key", {}).get(k) != v)
            raise DataError(
                "the checkpoint's stream position belongs to another stream (differs in: "
                f"{', '.join(diff) or 'format'})",
                fix="resume with the run's own data settings and number of processes",
            )
        epoch, doc = int(state["epoch"]), int(state["doc"])
        self._queue.clear()
        self._cur, self._cur_pos, self._off = None, (epoch, doc), 0
        self._docs = None
        if doc >= 0:
            self._docs = self._doc_iter(epoch, doc, str(state["doc_id"]))
            self._next_doc()
            if self._cur_pos != (epoch, doc) or self._cur_id != state["doc_id"]:
                raise DataError(
                    f"corpus {self.corpus!r} changed since the checkpoint: document {doc} is not "
                    "where the stream stopped",
                    fix="resume on the unchanged corpus",
                )
            self._off = int(state["offset"])
        self._partial = np.asarray(state["partial"], dtype=self.dtype).copy()
        self._buf = np.asarray(state["buffer"], dtype=self.dtype).copy()
        self._rng.bit_generator.state = state["rng"]
        self.sequences_drawn = int(state["sequences_drawn"])


@dataclass
class StreamingData:
    """What a streaming run needs besides its :class:`TokenStream`: the tokenizer, a small materialised
    validation shard and a manifest (recorded in checkpoints like a shard set's)."""

    root: Path
    val: TokenShard
    tokenizer: Tokenizer
    manifest: dict[str, JSON]

    def stream(self, data: DataConfig, seq_len: int, *, seed: int, rank: int = 0, world_size: int = 1) -> TokenStream:
        return TokenStream(
            StreamSource.of(data),
            self.tokenizer,
            seq_len,
            buffer_size=data.shuffle_buffer,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )


def prepare_stream_val(
    corpus: str,
    tok: Tokenizer,
    root: Path,
    *,
    val_fraction: float,
    seed: int,
    text_field: str,
    max_docs: int | None,
    max_chars_per_doc: int | None,
    val_tokens: int,
) -> TokenShard:
    """Write the validation shard (``val.bin``/``val.docs.npy``/``val.ids.json``) of a streaming corpus: its
    validation-split documents in corpus order until ``val_tokens`` tokens; only they are tokenised."""
    dtype = token_dtype(tok.vocab_size)
    parts: list[np.ndarray] = []
    ids: list[str] = []
    n = 0
    for d in iter_documents(corpus, text_field=text_field, max_docs=max_docs, max_chars_per_doc=max_chars_per_doc):
        if split_hash(d.id, seed) >= val_fraction:
            continue
        arr = np.concatenate([encode_documents(tok, [d.text], dtype)[0], np.array([tok.eot_id], dtype=dtype)])
        parts.append(arr)
        ids.append(d.id)
        n += len(arr)
        if n >= val_tokens:
            break
    if not ids:
        raise DataError(
            f"corpus {corpus!r} has no validation document (val_fraction={val_fraction})",
            fix="use more documents or a larger data.val_fraction",
        )
    tokens = np.concatenate(parts)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    tmp = root / "val.bin.tmp"
    tokens.tofile(tmp)
    np.save(root / "val.docs.npy", offsets)
    atomic_write_text(root / "val.ids.json", json.dumps(ids))
    os.replace(tmp, root / "val.bin")
    return TokenShard(root / "val.bin", root / "val.docs.npy", root / "val.ids.json", dtype)


def prepare_stream(data: DataConfig) -> StreamingData:
    """The tokenizer and validation shard of a streaming run, cached under ``data.data_dir`` (a folder keyed
    by corpus, tokenizer and split, like shard folders). The training documents are not read here."""
    if not data.streaming:
        raise ConfigError("prepare_stream needs data.streaming=true")
    tok = stream_tokenizer(data.tokenizer)
    opts = {"text_field": data.text_field, "max_docs": data.max_docs, "max_chars_per_doc": data.max_chars_per_doc}
    key_src = {
        "format": STREAM_FORMAT,
        "corpus_fingerprint": corpus_fingerprint(data.corpus, **opts),
        "tokenizer": tok.fingerprint,
        "val_fraction": data.val_fraction,
        "seed": data.seed,
        "val_tokens": data.stream_val_tokens,
        **opts,
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()
    cache = Path(data.data_dir).expanduser() if data.data_dir is not None else default_data_dir()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", data.corpus).strip("_")[-40:] or "corpus"
    root = cache / f"stream-{slug}-{key[:12]}"
    root.mkdir(parents=True, exist_ok=True)
    mpath = root / "manifest.json"
    dtype = token_dtype(tok.vocab_size)
    with FileLock(root / ".lock", f"stream folder {root}", wait=True):
        manifest: dict[str, JSON] | None = None
        if mpath.exists():
            try:
                manifest = json.loads(mpath.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                manifest = None
        if manifest is not None and manifest.get("key") == key and (root / "val.bin").exists():
            val = TokenShard(root / "val.bin", root / "val.docs.npy", root / "val.ids.json", dtype)
        else:
            mpath.unlink(missing_ok=True)
            val = prepare_stream_val(
                data.corpus,
                tok,
                root,
                val_fraction=data.val_fraction,
                seed=data.seed,
                text_field=data.text_field,
                max_docs=data.max_docs,
                max_chars_per_doc=data.max_chars_per_doc,
                val_tokens=data.stream_val_tokens,
            )
            tok.save(root / "tokenizer")
            manifest = {
                "format_version": STREAM_FORMAT,
                "key": key,
                "streaming": True,
                "corpus": {"spec": data.corpus, **opts},
                "tokenizer": {"spec": data.tokenizer, **describe_tokenizer(tok)},
                "dtype": dtype.name,
                "seed": data.seed,
                "val_fraction": data.val_fraction,
                "splits": {"val": {"num_docs": val.num_docs, "num_tokens": len(val)}},
            }
            atomic_write_text(mpath, json.dumps(manifest, indent=1) + "\n")
    return StreamingData(root, val, tok, manifest)
