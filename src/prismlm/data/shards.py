"""Token shards: a tokenised corpus on disk, memory-mapped for training.

The corpus is encoded once into flat ``.bin`` token files (documents concatenated, each followed by the
end-of-text id) plus per-document offsets and ids, so any training position maps back to its document.
Invariant: ``manifest.json`` is written last, atomically; its presence with a matching cache key means the
folder is complete, and re-runs with the same corpus/tokenizer/split reuse it. Layout: docs/modules.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from prismlm.artifacts import JSON, FileLock, atomic_write_text, sampled_sha256, sha256_file
from prismlm.data.corpus import Document, corpus_fingerprint, iter_documents, package_version, split_hash
from prismlm.data.tokenizer import Tokenizer, describe_tokenizer, resolve_tokenizer, token_dtype
from prismlm.errors import ConfigError, CorpusError, ShardError
from prismlm.progress import Progress, Reporter

__all__ = ["TokenShard", "ShardSet", "prepare_shards", "load_shards", "default_data_dir"]

FORMAT_VERSION = 1
SPLITS = ("train", "val")
_BATCH_DOCS = 64  # documents per encode_batch call
_BATCH_CHARS = 2_000_000  # ...or fewer, to bound memory with long documents
_COPY_CHUNK = 1 << 24  # tokens per chunk when moving a document between splits


if TYPE_CHECKING:
    from prismlm.config import DataConfig


class TokenShard:
    """One split on disk: memory-mapped tokens + document boundaries.

    ``tokens`` is a read-only memmap (an empty array for an empty split, which
    ``np.memmap`` cannot map). Training reads fixed, aligned sequences
    (``sequence``/``sequences``); ``locate`` maps a token offset back to its
    document for prototype/data displays.
    """

    def __init__(
        self, bin_path: str | Path, docs_path: str | Path, ids_path: str | Path, dtype: np.dtype | str
    ) -> None:
        self.bin_path = Path(bin_path)
        self.ids_path = Path(ids_path)
        self.dtype = np.dtype(dtype)
        size = self.bin_path.stat().st_size
        if size % self.dtype.itemsize:
            raise ShardError(f"{self.bin_path}: size {size} is not a multiple of {self.dtype} item size")
        self.tokens: np.ndarray = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r") if size else np.zeros(0, dtype=self.dtype)
        )
        self.doc_offsets: np.ndarray = np.load(docs_path).astype(np.int64, copy=False)
        if len(self.doc_offsets) == 0 or self.doc_offsets[-1] != len(self.tokens):
            raise ShardError(
                f"{docs_path}: document offsets end at "
                f"{self.doc_offsets[-1] if len(self.doc_offsets) else 'nothing'}, "
                f"but {self.bin_path.name} holds {len(self.tokens)} tokens"
            )
        self._doc_ids: list[str] | None = None

    @property
    def doc_ids(self) -> list[str]:
        """Document id per document (read from the JSON file on first use)."""
        if self._doc_ids is None:
            self._doc_ids = json.loads(self.ids_path.read_text(encoding="utf-8"))
        return self._doc_ids

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenShard({self.bin_path.name}, tokens={len(self)}, docs={self.num_docs})"

    def num_sequences(self, seq_len: int) -> int:
        """Number of aligned training sequences of ``seq_len`` (+1 target token)."""
        return max(0, (len(self) - 1) // seq_len)

    def sequence(self, j: int, seq_len: int) -> np.ndarray:
        """Sequence ``j``: ``tokens[j*seq_len : j*seq_len + seq_len + 1]`` as int64."""
        n = self.num_sequences(seq_len)
        if not 0 <= j < n:
            raise IndexError(f"sequence {j} out of range [0, {n}) for seq_len {seq_len}")
        s = j * seq_len
        return np.asarray(self.tokens[s : s + seq_len + 1], dtype=np.int64)

    def sequences(self, js: np.ndarray, seq_len: int) -> np.ndarray:
        """Many sequences at once, shape ``(len(js), seq_len + 1)`` int64 (one gather)."""
        js = np.asarray(js, dtype=np.int64).reshape(-1)
        n = self.num_sequences(seq_len)
        if len(js) and (js.min() < 0 or js.max() >= n):
            raise IndexError(f"sequence indices out of range [0, {n}) for seq_len {seq_len}")
        idx = js[:, None] * seq_len + np.arange(seq_len + 1, dtype=np.int64)[None, :]
        return self.tokens[idx].astype(np.int64)

    def locate(self, offset: int) -> tuple[int, int]:
        """(document index, position within the document) of token ``offset``.

        The eot after a document belongs to that document (position = its length).
        """
        if not 0 <= offset < len(self):
            raise IndexError(f"token offset {offset} out of range [0, {len(self)})")
        d = int(np.searchsorted(self.doc_offsets, offset, side="right")) - 1
        return d, int(offset - self.doc_offsets[d])

    def document(self, i: int, *, with_eot: bool = False) -> np.ndarray:
        """Tokens of document ``i`` (a memmap view)."""
        s, e = int(self.doc_offsets[i]), int(self.doc_offsets[i + 1])
        return self.tokens[s : e if with_eot else e - 1]


@dataclass
class ShardSet:
    """Both splits of a prepared corpus, its tokenizer and manifest.

    ``reused`` is True when ``prepare_shards`` found a complete cache and did
    not tokenise anything.
    """

    root: Path
    train: TokenShard
    val: TokenShard
    tokenizer: Tokenizer
    manifest: dict
    reused: bool = False


def default_data_dir() -> Path:
    """``$PRISM_DATA`` or ``~/.cache/prismlm/data``."""
    return Path(os.environ.get("PRISM_DATA") or "~/.cache/prismlm/data").expanduser()


def _slug(spec: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", spec.rstrip("/\\")).strip("-")
    return (s[-40:] if len(s) > 40 else s) or "corpus"


def _tokenizer_key(tokenizer: str) -> str:
    """What identifies a tokenizer spec in the cache key: a saved tokenizer
    path is identified by its contents (fingerprint), the others by name."""
    p = Path(tokenizer).expanduser()
    if p.exists():
        return "fp:" + Tokenizer.load(p).fingerprint
    return tokenizer


class _SplitWriter:
    """Streams one split's tokens to ``<split>.bin.tmp`` with a running sha256."""

    def __init__(self, root: Path, split: str, dtype: np.dtype) -> None:
        self.root, self.split, self.dtype = root, split, dtype
        self.tmp = root / f"{split}.bin.{os.getpid()}.tmp"  # unique per process
        self.f: BinaryIO = open(self.tmp, "wb")
        self.sha = hashlib.sha256()
        self.offsets: list[int] = [0]
        self.ids: list[str] = []
        self.keys: list[float] = []
        self.num_bytes = 0
        self.num_chars = 0

    def write(
        self, arr: np.ndarray, doc_ids: list[str], lengths: np.ndarray, keys: list[float], nbytes: int, nchars: int
    ) -> None:
        buf = np.ascontiguousarray(arr).data.cast("B")
        self.f.write(buf)
        self.sha.update(buf)
        ends = self.offsets[-1] + np.cumsum(lengths)
        self.offsets.extend(ends.tolist())
        self.ids.extend(doc_ids)
        self.keys.extend(keys)
        self.num_bytes += nbytes
        self.num_chars += nchars

    def close(self) -> None:
        self.f.close()


def _move_doc(src: _SplitWriter, dst: _SplitWriter, k: int) -> None:
    """Move document ``k`` from split ``src`` to the end of split ``dst`` (rare:
    only to avoid an empty split on tiny corpora). Files are rewritten in
    chunks so memory stays bounded."""
    src.close()
    dst.close()
    s, e = src.offsets[k], src.offsets[k + 1]
    data = np.fromfile(src.tmp, dtype=src.dtype) if src.offsets[-1] <= _COPY_CHUNK else None
    tokens = data if data is not None else np.memmap(src.tmp, dtype=src.dtype, mode="r")
    moved = np.array(tokens[s:e])
    with open(dst.tmp, "ab") as f:
        f.write(moved.tobytes())
    dst.sha.update(moved.tobytes())
    dst.offsets.append(dst.offsets[-1] + (e - s))
    dst.ids.append(src.ids[k])
    dst.keys.append(src.keys[k])
    new = src.root / f"{src.split}.bin.tmp2"
    sha = hashlib.sha256()
    with open(new, "wb") as f:
        for a, b in ((0, s), (e, src.offsets[-1])):
            for c in range(a, b, _COPY_CHUNK):
                chunk = np.ascontiguousarray(tokens[c : min(b, c + _COPY_CHUNK)]).tobytes()
                f.write(chunk)
                sha.update(chunk)
    del tokens, data
    os.replace(new, src.tmp)
    src.sha = sha
    n = e - s
    src.offsets = src.offsets[: k + 1] + [o - n for o in src.offsets[k + 2 :]]
    del src.ids[k], src.keys[k]


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d.text)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# Why 256 K characters: the tokenizer's working memory grows with the length of one input (a 9.6 MB
# one-line document peaked at 1.3 GB); pieces of this size keep it small, and there are few enough of them
# that the per-call overhead does not matter.
PIECE_CHARS = 1 << 18


def text_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut just before a single space that
    follows a non-space character and precedes one — a boundary where byte-level (GPT-2-style) and
    Metaspace pre-tokenizers already split, so encoding the pieces gives the same ids as the whole text.
    Text with no such space in a window is cut at the window (the rare case of a megabyte without spaces)."""
    if len(text) <= size:
        return [text]
    pieces, start = [], 0
    while len(text) - start > size:
        cut = start + size
        while cut > start and not (
            text[cut] == " " and not text[cut - 1].isspace() and cut + 1 < len(text) and not text[cut + 1].isspace()
        ):
            cut -= 1
        if cut == start:
            cut = start + size
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def encode_documents(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """Token ids of each text as a ``dtype`` array; long texts are encoded in pieces (``text_pieces``), a few
    pieces per call, and each piece's ids become an array at once, so memory stays bounded whatever the
    length of one document (Python int lists cost ~36 bytes a token)."""
    pieces = [text_pieces(t) for t in texts]
    flat: list[np.ndarray] = []
    call: list[str] = []
    chars = 0
    for piece in (p for ps in pieces for p in ps):  # calls of at most ~2 pieces' worth of characters
        if call and chars + len(piece) > 2 * PIECE_CHARS:
            flat.extend(np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(call))
            call, chars = [], 0
        call.append(piece)
        chars += len(piece)
    flat.extend(np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(call))
    out, i = [], 0
    for ps in pieces:
        out.append(flat[i] if len(ps) == 1 else np.concatenate(flat[i : i + len(ps)]))
        i += len(ps)
    return out


@dataclass(frozen=True)
class ShardRecipe:
    """What a shard folder is made of: its key is the hash of these (and of the corpus's fingerprint)."""

    corpus: str
    """The corpus spec (``prismlm.data.corpus``)."""
    tokenizer: str
    """The tokenizer spec (``prismlm.data.tokenizer.resolve_tokenizer``)."""
    val_fraction: float
    """Share of documents held out for validation, by the hash of their id (``split_hash``)."""
    seed: int
    """Seed of that hash."""
    text_field: str
    """Text field of .jsonl/.parquet/HF corpora."""
    max_docs: int | None
    """Only the first N documents."""
    max_chars_per_doc: int | None
    """Each document cut to N characters."""

    @property
    def options(self) -> dict[str, JSON]:
        """How the documents are read (recorded with the corpus in the manifest)."""
        return {"text_field": self.text_field, "max_docs": self.max_docs, "max_chars_per_doc": self.max_chars_per_doc}

    def key(self, fingerprint: str) -> str:
        """The shard folder's key: sha256 of the format, the corpus's fingerprint, the tokenizer and the split."""
        key_src = {
            "format": FORMAT_VERSION,
            "corpus_fingerprint": fingerprint,
            "tokenizer": _tokenizer_key(self.tokenizer),
            "val_fraction": self.val_fraction,
            "seed": self.seed,
            **self.options,
        }
        return hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()

    def documents(self) -> Iterator[Document]:
        return iter_documents(
            self.corpus, text_field=self.text_field, max_docs=self.max_docs, max_chars_per_doc=self.max_chars_per_doc
        )

    def is_val(self, doc_id: str) -> bool:
        return split_hash(doc_id, self.seed) < self.val_fraction

    def train_texts(self) -> Iterator[str]:
        """The training split's text, for a tokenizer trained on it (never on validation documents)."""
        for d in self.documents():
            if not self.is_val(d.id):
                yield from text_pieces(d.text)  # a huge one-line document, in bounded pieces


def prepare_shards(
    corpus: str = "builtin",
    tokenizer: str = "bpe-8192",
    out_dir: str | Path | None = None,
    *,
    val_fraction: float = 0.02,
    seed: int = 0,
    text_field: str = "text",
    max_docs: int | None = None,
    max_chars_per_doc: int | None = None,
    show_progress: Progress = True,
    cache_dir: str | Path | None = None,
    replace: bool = True,
) -> ShardSet:
    """Tokenise ``corpus`` into train/val shards, or reuse a matching cache.

    The split is per document (:func:`~prismlm.data.corpus.split_of` on the
    id); a trained tokenizer sees the train split only. If a split would be
    empty and the corpus has at least 2 documents, the document with the
    extreme split hash is moved over, so both splits are usable.

    ``replace=False``: refuse (``ShardError``) a folder that holds complete shards of another corpus or
    tokenizer instead of rebuilding it (what ``prism prepare`` does with a folder it is given, unless told to
    overwrite it).
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise ConfigError(f"`val_fraction` must be in [0, 1], got {val_fraction}", param="val_fraction")
    recipe = ShardRecipe(corpus, tokenizer, val_fraction, seed, text_field, max_docs, max_chars_per_doc)
    fp = corpus_fingerprint(corpus, text_field=text_field, max_docs=max_docs, max_chars_per_doc=max_chars_per_doc)
    key = recipe.key(fp)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_data_dir()
    root = Path(out_dir) if out_dir is not None else cache / f"{_slug(corpus)}-{key[:12]}"
    mpath = root / "manifest.json"
    done = _reuse(root, key)
    if done is not None:
        return done
    if not replace:
        _refuse_other_shards(root, key)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ShardError(
            f"cannot create the shard folder {root}: {e}",
            fix="give `out` a writable folder or set PRISM_DATA",
            param="out",
        ) from e
    # One writer per shard folder: a second process preparing the same key waits here, then reuses the
    # shards the first one finished (the manifest is written last, so it marks them complete).
    with FileLock(root / ".lock", f"shard folder {root}", wait=True):
        done = _reuse(root, key)
        if done is not None:
            return done
        if not replace:
            _refuse_other_shards(root, key)
        mpath.unlink(missing_ok=True)  # a crash mid-rebuild must not leave a stale "complete" marker
        _remove_stale_temps(root)
        try:
            return _build(root, key, fp, recipe, show_progress)
        except BaseException:
            for tmp in root.glob("*.tmp"):  # a failed build leaves no half-written files behind
                tmp.unlink(missing_ok=True)
            raise


_SHARD_FILE = re.compile(
    r"(train|val)\.(bin|docs\.npy|ids\.json)(\.\d+\.tmp|\.tmp2?)?|tokenizer|\.lock"
    r"|manifest\.json(\.tmp)?"
)


def is_shard_folder(folder: Path) -> bool:
    """A folder ``prepare_shards`` wrote: its manifest has a key and splits, or (a build that was stopped)
    it has no manifest and holds nothing but shard files."""
    try:
        m = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        return isinstance(m, dict) and "key" in m and "splits" in m
    except FileNotFoundError:
        return folder.is_dir() and all(_SHARD_FILE.fullmatch(p.name) for p in folder.iterdir())
    except (OSError, ValueError):
        return False


def _refuse_other_shards(root: Path, key: str) -> None:
    """``ShardError`` if ``root`` holds shards made with another key (corpus, tokenizer or options)."""
    try:
        old = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # none, or a damaged build of prismlm's own: rebuilt
    if isinstance(old, dict) and old.get("key") not in (None, key):
        spec = f"{old.get('corpus', {}).get('spec')!r} with tokenizer {old.get('tokenizer', {}).get('spec')!r}"
        raise ShardError(
            f"{root} holds the shards of another corpus or tokenizer ({spec})",
            fix="pass `overwrite` to replace them, or choose another `out`",
            path=root,
            param=("overwrite", "out"),
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale_temps(root: Path) -> None:
    """Remove what killed builds left (``<split>.bin.<pid>.tmp`` of a dead process, ``*.tmp2``). Called
    holding the folder's lock: no live writer of this folder is between its temp files and their rename."""
    for p in root.iterdir():
        m = re.fullmatch(r"(?:train|val)\.bin\.(\d+)\.tmp", p.name)
        if (m and not _pid_alive(int(m.group(1)))) or p.name.endswith(".tmp2"):
            p.unlink(missing_ok=True)


def _reuse(root: Path, key: str) -> ShardSet | None:
    """The complete shards at ``root`` if their manifest has ``key``; None if absent, another key, or damaged."""
    mpath = root / "manifest.json"
    if not mpath.exists():
        return None
    try:
        old = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if old.get("key") != key:
        return None
    try:
        ss = load_shards(root)
    except ShardError:
        return None  # incomplete or damaged: rebuild
    ss.reused = True
    return ss


def _build(root: Path, key: str, fingerprint: str, recipe: ShardRecipe, show_progress: Progress) -> ShardSet:
    """Tokenize the corpus into ``root`` (holding its lock); the manifest is written last."""
    t0 = time.perf_counter()
    tok = resolve_tokenizer(recipe.tokenizer, recipe.train_texts, show_progress=show_progress is True)
    t_tok = time.perf_counter() - t0
    dtype = token_dtype(tok.vocab_size)
    writers = {s: _SplitWriter(root, s, dtype) for s in SPLITS}
    t1 = time.perf_counter()
    try:
        _encode_corpus(recipe, tok, writers, show_progress)
    finally:
        for w in writers.values():
            w.close()
    tr, va = writers["train"], writers["val"]
    if not tr.ids and len(va.ids) >= 1:
        _move_doc(va, tr, int(np.argmax(va.keys)))
    if not va.ids and len(tr.ids) >= 2:
        _move_doc(tr, va, int(np.argmin(tr.keys)))
    t_enc = time.perf_counter() - t1
    tok.save(root / "tokenizer")
    manifest = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "corpus": {"spec": recipe.corpus, "fingerprint": fingerprint, **recipe.options},
        "tokenizer": {"spec": recipe.tokenizer, **describe_tokenizer(tok)},
        "dtype": dtype.name,
        "splits": {split: _finish_split(root, split, w) for split, w in writers.items()},
        "seed": recipe.seed,
        "val_fraction": recipe.val_fraction,
        "timing_s": {"tokenizer": round(t_tok, 3), "encode": round(t_enc, 3)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prismlm_version": package_version(),
    }
    atomic_write_text(root / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return load_shards(root)


def _encode_corpus(
    recipe: ShardRecipe, tok: Tokenizer, writers: dict[str, _SplitWriter], show_progress: Progress
) -> None:
    """Encode the documents in batches, each followed by end-of-text, into their split's writer; refuses a
    duplicate document id."""
    dtype = writers["train"].dtype
    eot = np.array([tok.eot_id], dtype=dtype)
    seen: set[str] = set()
    n_tokens = 0
    t1 = time.perf_counter()
    bar = Reporter(show_progress, f"tokenize {recipe.corpus}", unit="doc")
    try:
        for batch in _batches(recipe.documents()):
            encoded = encode_documents(tok, [d.text for d in batch], dtype)
            for split in SPLITS:
                sel = [i for i, d in enumerate(batch) if recipe.is_val(d.id) == (split == "val")]
                if not sel:
                    continue
                parts: list[np.ndarray] = []
                for i in sel:
                    parts.append(np.asarray(encoded[i], dtype=dtype))
                    parts.append(eot)
                arr = np.concatenate(parts)
                lengths = np.array([len(encoded[i]) + 1 for i in sel], dtype=np.int64)
                ids = [batch[i].id for i in sel]
                writers[split].write(
                    arr,
                    ids,
                    lengths,
                    [split_hash(i_, recipe.seed) for i_ in ids],
                    sum(len(batch[i].text.encode("utf-8")) for i in sel),
                    sum(len(batch[i].text) for i in sel),
                )
                n_tokens += len(arr)
            for d in batch:
                if d.id in seen:
                    raise CorpusError(f"duplicate document id {d.id!r} in corpus {recipe.corpus!r}")
                seen.add(d.id)
            bar.update(len(batch), tokens=n_tokens, tokens_per_s=round(n_tokens / (time.perf_counter() - t1)))
    finally:
        bar.close()


def _finish_split(root: Path, split: str, w: _SplitWriter) -> dict[str, JSON]:
    """Move a split's tokens into place, write its document offsets and ids; its manifest entry."""
    os.replace(w.tmp, root / f"{split}.bin")
    sample = sampled_sha256(root / f"{split}.bin")
    np.save(root / f"{split}.docs.npy", np.asarray(w.offsets, dtype=np.int64))
    (root / f"{split}.ids.json").write_text(json.dumps(w.ids), encoding="utf-8")
    return {
        "num_docs": len(w.ids),
        "num_tokens": int(w.offsets[-1]),
        "num_bytes": w.num_bytes,
        "num_chars": w.num_chars,
        "sha256": w.sha.hexdigest(),
        "sample_sha256": sample,
    }


def load_shards(path: str | Path, *, verify: bool = False) -> ShardSet:
    """Open a shard directory written by :func:`prepare_shards`.

    Always checks that every file exists, sizes match the manifest and the
    saved tokenizer has the recorded fingerprint; ``verify=True`` also
    re-hashes the .bin files (reads everything).
    """
    root = Path(path)
    mpath = root / "manifest.json"
    if not root.is_dir():
        raise ShardError(f"shard directory {root} does not exist")
    if not mpath.exists():
        raise ShardError(
            f"{root} has no manifest.json: not a prepared shard directory, or preparation "
            f"did not finish (run prepare_shards again)"
        )
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ShardError(f"{mpath}: invalid JSON ({e})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ShardError(
            f"{mpath}: format version {manifest.get('format_version')!r}, "
            f"this prismlm reads {FORMAT_VERSION}; prepare the shards again"
        )
    needed = [f"{s}{ext}" for s in SPLITS for ext in (".bin", ".docs.npy", ".ids.json")]
    needed.append("tokenizer/tokenizer.json")
    missing = [n for n in needed if not (root / n).exists()]
    if missing:
        raise ShardError(f"{root}: missing file(s) {', '.join(missing)}; prepare the shards again")
    tok = Tokenizer.load(root / "tokenizer")
    want = manifest["tokenizer"]["fingerprint"]
    if tok.fingerprint != want:
        raise ShardError(
            f"{root}/tokenizer: fingerprint {tok.fingerprint[:12]} does not match the "
            f"manifest's {want[:12]}: the tokenizer was changed after the shards were written"
        )
    dtype = np.dtype(manifest["dtype"])
    if dtype != token_dtype(tok.vocab_size):
        raise ShardError(f"{mpath}: dtype {dtype} does not fit vocabulary size {tok.vocab_size}")
    shards = {}
    for s in SPLITS:
        info = manifest["splits"][s]
        bin_path = root / f"{s}.bin"
        size = bin_path.stat().st_size
        if size != info["num_tokens"] * dtype.itemsize:
            raise ShardError(
                f"{bin_path}: {size} bytes, manifest says {info['num_tokens']} tokens of "
                f"{dtype}; the file is truncated or was replaced"
            )
        if verify and sha256_file(bin_path) != info["sha256"]:
            raise ShardError(
                f"{bin_path}: sha256 checksum mismatch with manifest.json",
                fix="prepare the shards again (delete the folder, then `prism prepare`)",
            )
        if not verify and info.get("sample_sha256") and sampled_sha256(bin_path) != info["sample_sha256"]:
            raise ShardError(
                f"{bin_path}: its content differs from manifest.json (sampled checksum); the file was overwritten",
                fix="prepare the shards again (delete the folder, then `prism prepare`)",
            )
        shards[s] = TokenShard(bin_path, root / f"{s}.docs.npy", root / f"{s}.ids.json", dtype)
        if shards[s].num_docs != info["num_docs"]:
            raise ShardError(
                f"{root / f'{s}.docs.npy'}: {shards[s].num_docs} documents, manifest says {info['num_docs']}"
            )
    return ShardSet(root, shards["train"], shards["val"], tok, manifest)


def prepare_from_config(data: DataConfig, *, show_progress: Progress = True) -> ShardSet:
    """``prepare_shards`` for a :class:`~prismlm.config.DataConfig` (the trainer's and CLI's entry point)."""
    return prepare_shards(
        data.corpus,
        data.tokenizer,
        val_fraction=data.val_fraction,
        seed=data.seed,
        text_field=data.text_field,
        max_docs=data.max_docs,
        max_chars_per_doc=data.max_chars_per_doc,
        show_progress=show_progress,
        cache_dir=data.data_dir,
    )
