"""Streaming corpora (``data.streaming``): lazy reading, on-the-fly tokenisation, a seeded shuffle buffer,
exact resume, jsonl/parquet/hf: sources, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from prismlm import RunConfig
from prismlm.data.corpus import iter_documents
from prismlm.data.stream import StreamSource, TokenStream
from prismlm.errors import ConfigError, PrismError
from prismlm.train import load_checkpoint, train

T = 64


def _texts(n: int, chars: int) -> list[str]:
    return [d.text for d in iter_documents("builtin", max_docs=n, max_chars_per_doc=chars)]


def _write_parquet(folder, texts: list[str], files: int = 3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(texts) // files)
    for k in range(files):
        chunk = texts[k * per : (k + 1) * per]
        pq.write_table(pa.table({"text": chunk}), folder / f"part-{k:02d}.parquet", row_group_size=4)
    return folder


def _write_jsonl(folder, texts: list[str], files: int = 2):
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(texts) // files)
    for k in range(files):
        lines = [json.dumps({"text": t}) for t in texts[k * per : (k + 1) * per]]
        (folder / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def saved_tok(tiny_shards, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    tiny_shards.tokenizer.save(path)
    return str(path)


def stream_cfg(corpus, tok, tmp_path, **overrides) -> RunConfig:
    base = {
        "data.corpus": str(corpus),
        "data.tokenizer": tok,
        "data.streaming": True,
        "data.shuffle_buffer": 16,
        "data.val_fraction": 0.1,
        "data.stream_val_tokens": 3000,
        "data.data_dir": str(tmp_path / "cache"),
        "train.max_steps": 12,
        "train.eval_interval": 6,
        "train.log_interval": 3,
        "train.batch_size": 4,
        "train.warmup_steps": 2,
        "loss.warmup_steps": 4,
    }
    return RunConfig.from_name("tiny").override({**base, **overrides})


def test_training_streams_without_tokenising_the_corpus(saved_tok, tmp_path, monkeypatch):
    import prismlm.data.stream as stream_mod

    corpus = _write_parquet(tmp_path / "pq", _texts(200, 2000), files=4)
    encoded: list[int] = []
    real = stream_mod.encode_documents

    def counting(tok, texts, dtype):
        encoded.append(len(texts))
        return real(tok, texts, dtype)

    monkeypatch.setattr(stream_mod, "encode_documents", counting)
    res = train(stream_cfg(corpus, saved_tok, tmp_path, **{"train.max_steps": 3}), tmp_path / "run", progress=False)
    assert res.step == 3 and np.isfinite(res.metrics["val_loss"])
    # 3 steps × 4 sequences + a buffer of 16 need a few documents (one look-ahead batch of 64), not 200
    assert 0 < sum(encoded) < 120, encoded
    ckpt = load_checkpoint(tmp_path / "run")
    pos = ckpt.trainer_state()["data"]["stream"]
    assert len(pos) == 1 and pos[0]["sequences_drawn"] == 12 and pos[0]["buffer"].shape == (16, T + 1)
    assert ckpt.manifest is not None


@pytest.mark.slow
def test_stream_resume_is_exact(saved_tok, tmp_path):
    # 12 short documents: 12 steps × 4 sequences × 64 tokens wrap the corpus several times
    corpus = _write_parquet(tmp_path / "pq", _texts(14, 500), files=3)
    cfg = stream_cfg(corpus, saved_tok, tmp_path, **{"model.dropout": 0.1})
    full = train(cfg, tmp_path / "full", progress=False)
    part = train(cfg, tmp_path / "split", progress=False, stop_after=5)
    assert part.step == 5
    resumed = train(cfg, tmp_path / "split", progress=False, resume=True)
    assert resumed.step == 12
    for (name, p), (_, q) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(p, q), name

    def lines(run):
        return [
            {k: v for k, v in json.loads(s).items() if k != "tokens_per_s"}
            for s in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        ]

    assert lines("full") == lines("split")
    assert max(r.get("epoch", 0) for r in lines("full")) >= 1  # the stream wrapped around the corpus
    # a stream that does not resume differs: the test can fail
    other = train(cfg.override({"train.seed": 7}), tmp_path / "other", progress=False)
    assert not torch.equal(
        other.model.state_dict()["transformer.wte.weight"], full.model.state_dict()["transformer.wte.weight"]
    )


def _stream(corpus, tok, **kw):
    from prismlm.data.tokenizer import Tokenizer

    args = {"buffer_size": 8, "seed": 3, **kw}
    source = StreamSource(str(corpus), val_fraction=args.pop("val_fraction", 0.1))
    return TokenStream(source, Tokenizer.load(tok), T, **args)


def test_shuffle_buffer_mixes_documents_and_is_seeded(saved_tok, tmp_path):
    corpus = _write_parquet(tmp_path / "pq", _texts(30, 1500), files=3)
    ordered = _stream(corpus, saved_tok, buffer_size=1).batch(60)  # a buffer of 1 keeps corpus order
    # packing: each sequence continues the previous one (stride T)
    assert np.array_equal(ordered[1:, 0], ordered[:-1, -1])
    a = _stream(corpus, saved_tok, buffer_size=16).batch(40)
    b = _stream(corpus, saved_tok, buffer_size=16).batch(40)
    c = _stream(corpus, saved_tok, buffer_size=16, seed=4).batch(40)
    assert np.array_equal(a, b)  # seeded
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, ordered[:40])  # mixed, not file order
    rows = {r.tobytes(): k for k, r in enumerate(ordered)}
    pos = [rows[r.tobytes()] for r in a]  # every drawn sequence is one of the corpus-order ones...
    assert len(set(pos)) == len(pos)
    assert max(pos) >= 20 and max(pos) < 40 + 16  # ...drawn from a bounded window ahead
    assert any(p > q for p, q in zip(pos, pos[1:]))


def test_jsonl_stream_state_round_trip(saved_tok, tmp_path):
    corpus = _write_jsonl(tmp_path / "jl", _texts(10, 700), files=2)
    s = _stream(corpus, saved_tok)
    s.batch(25)
    state = s.state_dict()
    want = s.batch(60)  # crosses the end of the corpus (an epoch) at least once
    assert s.epoch >= 1
    r = _stream(corpus, saved_tok)
    r.load_state_dict(state)
    assert np.array_equal(r.batch(60), want)
    assert r.docs_encoded < s.docs_encoded + 10  # resuming re-encodes only from the current document
    with pytest.raises(PrismError, match="another stream"):
        _stream(corpus, saved_tok, seed=9).load_state_dict(state)


def test_resume_skips_earlier_files_unopened(saved_tok, tmp_path, monkeypatch):
    import prismlm.data.stream as stream_mod

    corpus = _write_parquet(tmp_path / "pq", _texts(24, 700), files=3)
    s = _stream(corpus, saved_tok, buffer_size=4)
    while s._cur_id.split("#")[0] != "part-02.parquet":  # advance into the last file
        s.next_sequence()
    state = s.state_dict()
    want = s.batch(30)
    opened: list[str] = []
    real = stream_mod.file_documents

    def spy(path, rel, text_field):
        opened.append(rel)
        return real(path, rel, text_field)

    monkeypatch.setattr(stream_mod, "file_documents", spy)
    r = _stream(corpus, saved_tok, buffer_size=4)
    r.load_state_dict(state)
    assert opened[0] == "part-02.parquet"  # part-00 and part-01 were not read to get there
    assert np.array_equal(r.batch(30), want)


def test_ranks_get_disjoint_documents(saved_tok, tmp_path):
    corpus = _write_jsonl(tmp_path / "jl", _texts(12, 700), files=1)
    one = {r.tobytes() for r in _stream(corpus, saved_tok, buffer_size=1).batch(20)}
    r0 = _stream(corpus, saved_tok, buffer_size=1, rank=0, world_size=2).batch(6)
    r1 = _stream(corpus, saved_tok, buffer_size=1, rank=1, world_size=2).batch(6)
    assert not {x.tobytes() for x in r0} & {x.tobytes() for x in r1}
    assert not np.array_equal(r0, r1)
    assert len(one) == 20


def test_hf_corpus_streams_through_datasets(saved_tok, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pq_dir = _write_parquet(tmp_path / "pq", _texts(12, 900), files=1)
    files = sorted(str(p) for p in pq_dir.glob("*.parquet"))
    calls = []
    real = datasets.load_dataset

    def fake(name, config=None, *, split, streaming):
        calls.append((name, config, split, streaming))
        return real("parquet", data_files={"train": files}, split=split, streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    got = _stream("hf:someone/corpus@train", saved_tok, val_fraction=0.0, buffer_size=1).batch(10)
    assert calls and calls[0] == ("someone/corpus", None, "train", True)
    want = _stream(pq_dir, saved_tok, val_fraction=0.0, buffer_size=1).batch(10)
    assert np.array_equal(got, want)  # same rows, same tokens


def test_bad_streaming_input_fails_in_one_line(saved_tok, tmp_path):
    with pytest.raises(ConfigError, match="fixed tokenizer") as e:
        RunConfig.from_name("tiny").override({"data.streaming": True})  # the preset's bpe-512
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="shuffle_buffer"):
        RunConfig.from_name("tiny").override({"data.shuffle_buffer": 0})
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text(json.dumps({"text": "  "}) + "\n")
    with pytest.raises(PrismError) as e2:
        train(stream_cfg(empty, saved_tok, tmp_path), tmp_path / "run", progress=False)
    assert "empty corpus" in str(e2.value) and "\n" not in str(e2.value)


def test_default_config_does_not_stream():
    cfg = RunConfig.from_name("tiny")
    assert cfg.data.streaming is False and cfg.data.tokenizer == "bpe-512"


_DDP_WORKER = """
import sys
from prismlm import RunConfig
from prismlm.train import train
cfg_path, out_dir, mode = sys.argv[1:4]
cfg = RunConfig.from_json(cfg_path)
if mode == "resume":
    train(cfg, out_dir, progress=False, resume=True)
else:
    train(cfg, out_dir, progress=False, stop_after=3 if mode == "stop" else None)
"""


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_torchrun_stream_shards_ranks_and_resumes_exactly(saved_tok, tmp_path):
    import os
    import subprocess
    import sys

    corpus = _write_parquet(tmp_path / "pq", _texts(20, 600), files=2)
    cfg = stream_cfg(corpus, saved_tok, tmp_path, **{"train.max_steps": 6, "train.eval_interval": 3})
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    (tmp_path / "worker.py").write_text(_DDP_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(out: str, mode: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(tmp_path / "worker.py"),
            str(tmp_path / "cfg.json"),
            str(tmp_path / out),
            mode,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("full", "full")
    run("split", "stop")
    pos = load_checkpoint(tmp_path / "split").trainer_state()["data"]["stream"]
    assert [p["key"]["rank"] for p in pos] == [0, 1]
    assert not np.array_equal(pos[0]["buffer"], pos[1]["buffer"])  # each rank streams its own documents
    run("split", "resume")
    full, resumed = load_checkpoint(tmp_path / "full").model, load_checkpoint(tmp_path / "split").model
    for (name, p), (_, q) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(p, q), name
