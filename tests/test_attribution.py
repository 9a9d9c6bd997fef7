"""Prototype index, explanations, labels and their CLI: identities checked exactly, edge cases never crash."""

from __future__ import annotations

import copy
import http.server
import json
import math
import threading
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import train_tiny_run

from prismlm.errors import ArtifactError, ArtifactMismatch, UnknownPrototypeError
from prismlm.explain import (
    IndexSettings,
    PrototypeIndex,
    build_index,
    explain,
    explain_generation,
    llm_labels,
    merge_indexes,
    prototype_card,
    rule_labels,
    save_labels,
)
from prismlm.explain.labels import CATEGORIES
from prismlm.model.generation import Sampling

T = 64  # tiny preset block_size


@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    """A tiny PRISM trained for 20 steps on the tiny shards, loaded back as a Checkpoint."""
    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("attr"), steps=20, batch_size=4, warmup_steps=2)


def _double(ckpt):
    """A float64 copy of the checkpoint's model, with its manifest (for ``model_sha256``) and tokenizer."""
    return SimpleNamespace(
        model=copy.deepcopy(ckpt.model).double(), manifest=ckpt.manifest, tokenizer=ckpt.tokenizer, path=ckpt.path
    )


def test_neighbourhood_equals_brute_force(trained, tiny_shards):
    ckpt, _ = trained
    c64 = _double(ckpt)
    n_seq, top_n = 10, 6
    # chunk_size smaller than a batch so the streaming merge runs inside and across batches
    idx = build_index(
        c64.model,
        tiny_shards,
        IndexSettings(top_n=top_n, batch_size=3, max_sequences=n_seq, chunk_size=50),
        progress=False,
    )
    assert idx.top_sim.dtype == torch.float64 and idx.tokens == n_seq * T
    x = torch.from_numpy(tiny_shards.train.sequences(np.arange(n_seq), T)[:, :-1])
    with torch.no_grad():
        z = c64.model(x).hidden.reshape(-1, c64.model.config.n_embd)  # (n_seq·T, d) float64
    cos = F.normalize(z, dim=-1) @ F.normalize(c64.model.prototypes.weight.detach(), dim=-1).T  # (n, K)
    offsets = np.arange(n_seq * T)  # sequence j, position t ↔ j·T + t
    for i in range(idx.num_prototypes):
        order = np.lexsort((offsets, -cos[:, i].numpy()))[:top_n]  # similarity desc, then offset asc
        assert idx.top_offset[i].tolist() == offsets[order].tolist(), f"prototype {i}"
        assert torch.allclose(idx.top_sim[i], cos[order, i], atol=1e-12)
    # coverage mirrors the evaluation definitions
    assert idx.coverage()["r1_bar"] == pytest.approx(float(cos.max(0).values.mean()), abs=1e-12)
    assert idx.coverage()["r2"] == pytest.approx(float(cos.max(1).values.mean()), abs=1e-9)


def test_partial_indexes_merge_to_one_pass_and_resume(trained, tiny_shards, tmp_path):
    ckpt, _ = trained
    settings = IndexSettings(top_n=8, batch_size=4, max_sequences=22)
    kw = dict(progress=False, model_sha256=ckpt.manifest["model_sha256"])
    full = build_index(ckpt.model, tiny_shards, settings, **kw)
    parts = [build_index(ckpt.model, tiny_shards, replace(settings, part=(i, 3)), **kw) for i in range(3)]
    assert sum(p.tokens for p in parts) == full.tokens and not parts[0].covers_all and parts[0].complete
    merged = merge_indexes([parts[2], parts[0], parts[1]])  # order does not matter
    for name in ("top_sim", "top_offset", "counts", "hist"):
        assert torch.equal(getattr(merged, name), getattr(full, name)), name
    assert torch.allclose(merged.act_sum, full.act_sum, rtol=1e-12)
    assert merged.covers_all and merged.manifest["covered"] == [[0, 22]]
    for k, v in full.coverage().items():
        assert merged.coverage()[k] == pytest.approx(v, rel=1e-12)
    with pytest.raises(ArtifactError, match="overlap"):
        merge_indexes([parts[0], parts[0]])
    # interrupted after 2 batches, saved, resumed from disk: same as one pass
    out = tmp_path / "partial"
    half = build_index(ckpt.model, tiny_shards, settings, out=out, stop_after_batches=2, **kw)
    assert not half.complete and PrototypeIndex.load(out).manifest["covered"] == [[0, 8]]
    resumed = build_index(ckpt.model, tiny_shards, settings, resume_from=out, out=out, **kw)
    assert resumed.complete and torch.equal(resumed.top_offset, full.top_offset)
    assert torch.equal(resumed.counts, full.counts)
    with pytest.raises(ArtifactError, match="cannot resume"):
        build_index(ckpt.model, tiny_shards, replace(settings, top_n=4), resume_from=out, **kw)


def test_index_save_load_round_trip(trained, tiny_shards, tmp_path):
    ckpt, _ = trained
    idx = build_index(
        ckpt.model,
        tiny_shards,
        IndexSettings(top_n=5, batch_size=4, max_sequences=8),
        progress=False,
        model_sha256=ckpt.manifest["model_sha256"],
    )
    idx.save(tmp_path / "index")
    labels = rule_labels(idx)
    save_labels(labels, tmp_path / "index")
    back = PrototypeIndex.load(tmp_path / "index", model_sha256=ckpt.manifest["model_sha256"], shards=tiny_shards)
    for name in ("top_sim", "top_offset", "counts", "act_sum", "hist"):
        a, b = getattr(idx, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert back.manifest["model_sha256"] == ckpt.manifest["model_sha256"]
    assert back.manifest["shard_key"] == tiny_shards.manifest["key"] and back.complete
    assert back.coverage() == idx.coverage()
    assert [n.to_dict() for n in back.neighbours(3)] == [n.to_dict() for n in idx.neighbours(3)]
    assert back.labels() == {int(k): v for k, v in json.loads(json.dumps(labels)).items()}  # tuples → lists
    back.save(tmp_path / "index")  # re-saving keeps labels.json
    assert (tmp_path / "index" / "labels.json").exists()
    # snippets: the marked target is the token after the stored offset, in its document
    nb = back.neighbours(0, 1)[0]
    assert nb.target_id == int(tiny_shards.train.tokens[nb.offset + 1]) and "⟦" in nb.snippet
    assert nb.doc_id == tiny_shards.train.doc_ids[nb.doc_index]


def test_mismatch_and_unknown_prototype_errors(trained, tiny_shards, tmp_path):
    ckpt, _ = trained
    idx = build_index(
        ckpt.model,
        tiny_shards,
        IndexSettings(top_n=4, batch_size=4, max_sequences=4),
        progress=False,
        model_sha256=ckpt.manifest["model_sha256"],
    )
    idx.save(tmp_path / "index")
    other = "f" * 64
    with pytest.raises(ArtifactMismatch) as e:
        PrototypeIndex.load(tmp_path / "index", model_sha256=other)
    assert other in str(e.value) and ckpt.manifest["model_sha256"] in str(e.value)
    with pytest.raises(ArtifactMismatch, match="token shards"):
        PrototypeIndex.load(tmp_path / "index", shard_key="0" * 64)
    with pytest.raises(ArtifactMismatch, match=other):
        explain(ckpt.model, ckpt.tokenizer, "hello", model_sha256=other, index=idx)
    with pytest.raises(UnknownPrototypeError, match="unknown prototype id 9999"):
        idx.neighbours(9999)
    with pytest.raises(UnknownPrototypeError, match="unknown prototype id -1"):
        idx.stats(-1)
    with pytest.raises(UnknownPrototypeError, match="unknown prototype id 9999"):
        prototype_card(ckpt.model, None, 9999)
    with pytest.raises(ArtifactError, match="not a prototype index"):
        PrototypeIndex.load(tmp_path)


def test_slices_plus_residual_equal_logit_float64(trained, tiny_shards):
    ckpt, _ = trained
    c64 = _double(ckpt)
    sha = c64.manifest["model_sha256"]
    idx = build_index(
        c64.model, tiny_shards, IndexSettings(top_n=4, batch_size=4, max_sequences=4), progress=False, model_sha256=sha
    )
    expl = explain(
        c64.model,
        c64.tokenizer,
        "It is a truth universally acknowledged, that a single man",
        model_sha256=sha,
        index=idx,
        labels=rule_labels(idx),
    )
    assert len(expl.positions) == len(
        ckpt.tokenizer.encode("It is a truth universally acknowledged, that a single man")
    )
    for p in expl.positions:
        assert math.fsum([s.slice for s in p.prototypes] + [p.residual_slice]) == pytest.approx(p.logit, abs=1e-10)
        assert abs(p.error) < 1e-12 and all(s.activation > 0 for s in p.prototypes)
        assert math.fsum(abs(s.share) for s in p.prototypes) + abs(p.residual_share) == pytest.approx(1.0)
    assert [p.chosen_by for p in expl.positions][-1] == "argmax"
    assert all(p.next_id == expl.token_ids[p.position + 1] for p in expl.positions[:-1])
    card = expl.prototypes[expl.positions[0].prototypes[0].id]
    assert card.neighbours and card.stats and len(card.top_tokens) == 10 and card.label is not None
    # generation: the sampled tokens are the chosen tokens, one forward explains them exactly
    gen = explain_generation(
        c64.model, c64.tokenizer, "The ", 6, model_sha256=sha, sampling=Sampling(0.8, 50, seed=1), index=idx
    )
    sampled = [p for p in gen.positions if p.chosen_by == "sampled"]
    assert len(sampled) == 6 and gen.prompt_tokens == len(ckpt.tokenizer.encode("The "))
    assert [p.next_id for p in sampled] == gen.token_ids[gen.prompt_tokens :] + [sampled[-1].next_id]
    assert max(abs(p.error) for p in gen.positions) < 1e-12
    json.loads(gen.to_json())  # serialisable


def test_explain_edge_cases_never_crash(trained):
    ckpt, _ = trained
    tok = ckpt.tokenizer
    empty = explain(ckpt.model, tok, "")
    assert len(empty.positions) == 1 and empty.token_ids == [tok.eot_id] and "empty" in empty.notes[0]
    long_text = "the quick brown fox jumps over the lazy dog. " * 20
    n = len(tok.encode(long_text))
    longer = explain(ckpt.model, tok, long_text)
    assert n > T and longer.truncated_tokens == n - T and len(longer.positions) == T
    weird = "日本語 🦄 ∮ E⋅da = Q — ǅ"
    ids = tok.encode(weird)
    assert tok.decode(ids) == weird  # byte-level BPE: bytes, never an unknown token
    out = explain(ckpt.model, tok, weird)
    assert len(out.positions) == len(ids) and out.max_abs_error < 1e-4
    assert len(explain(ckpt.model, tok, [5, 6, 7]).positions) == 3  # ids work too
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        explain(ckpt.model, tok, [10**6])
    long_gen = explain_generation(ckpt.model, tok, long_text, 3, sampling=Sampling(0.8, 50, seed=0))
    assert long_gen.truncated_tokens > 0 and len(long_gen.positions) == T


def test_labels_rules_and_optional_llm(trained, tiny_shards):
    ckpt, _ = trained
    idx = build_index(ckpt.model, tiny_shards, IndexSettings(top_n=6, batch_size=4, max_sequences=8), progress=False)
    labels = rule_labels(idx)
    assert set(labels) == set(range(idx.num_prototypes))
    assert all(v["category"] in CATEGORIES and v["label"] for v in labels.values())

    replies = []

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            replies.append((self.path, body["model"], self.headers.get("Authorization")))
            msg = {"choices": [{"message": {"content": '{"label": "stub label", "category": "number"}'}}]}
            data = json.dumps(msg).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        out = llm_labels(idx, labels, endpoint=url, model="m", ids=[0, 1], api_key_env="PRISM_TEST_NO_KEY")
    finally:
        server.shutdown()
    assert out[0]["label"] == "stub label" and out[0]["category"] == "number"
    assert replies[0] == ("/v1/chat/completions", "m", None) and out[2] == labels[2]
    # an unreachable endpoint keeps the rule label and records why
    bad = llm_labels(idx, labels, endpoint="http://127.0.0.1:9", model="m", ids=[0], timeout=2)
    assert bad[0]["label"] == labels[0]["label"] and "llm_error" in bad[0]["evidence"]


def test_cli_index_explain_prototypes(trained, tiny_shards, tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    _, run = trained
    r = CliRunner()
    sh = str(tiny_shards.root)
    res = r.invoke(
        app,
        [
            "index",
            str(run),
            "--shards",
            sh,
            "--max-sequences",
            "12",
            "--top-n",
            "6",
            "--batch-size",
            "4",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    assert (run / "index" / "manifest.json").exists() and (run / "index" / "labels.json").exists()
    for i in (0, 1):
        res = r.invoke(
            app,
            [
                "index",
                str(run),
                "--shards",
                sh,
                "--max-sequences",
                "12",
                "--top-n",
                "6",
                "--batch-size",
                "4",
                "--part",
                f"{i}/2",
                "--no-progress",
            ],
        )
        assert res.exit_code == 0, res.output
    res = r.invoke(
        app, ["index-merge", str(tmp_path / "merged"), str(run / "index-part-0-of-2"), str(run / "index-part-1-of-2")]
    )
    assert res.exit_code == 0, res.output
    a, b = PrototypeIndex.load(run / "index"), PrototypeIndex.load(tmp_path / "merged")
    assert torch.equal(a.top_offset, b.top_offset) and (tmp_path / "merged" / "labels.json").exists()
    res = r.invoke(
        app, ["index-merge", str(tmp_path / "bad"), str(run / "index-part-0-of-2"), str(run / "index-part-0-of-2")]
    )
    assert res.exit_code == 2 and "overlap" in res.output
    res = r.invoke(
        app,
        [
            "explain",
            str(run),
            "It is a truth",
            "--generate",
            "3",
            "--json",
            str(tmp_path / "e.json"),
            "--html",
            str(tmp_path / "e.html"),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["index"] and data["prototypes"] and data["max_abs_error"] < 1e-4
    page = (tmp_path / "e.html").read_text()
    assert "<mark>" in page and "<svg" in page and "http://" not in page and "https://" not in page
    res = r.invoke(app, ["prototypes", str(run), "--search", "→", "--limit", "3"])
    assert res.exit_code == 0 and "prototypes of" in res.output, res.output
    res = r.invoke(app, ["prototypes", str(run), "--token", " the", "--limit", "3"])
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["prototypes", str(run), "--id", "3"])
    assert res.exit_code == 0 and "⟦" in res.output, res.output
    res = r.invoke(app, ["prototypes", str(run), "--id", "9999"])
    assert res.exit_code == 2 and "unknown prototype id 9999" in res.output
    res = r.invoke(app, ["explain", str(run), "x", "--index", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "no prototype index" in res.output
    res = r.invoke(app, ["index", str(run), "--part", "3/2"])
    assert res.exit_code == 2 and "--part" in res.output
    res = r.invoke(app, ["label", str(run), "--labeller", "openai"])
    assert res.exit_code == 2 and "--endpoint" in res.output
    for cmd in ("index", "index-merge", "label", "explain", "prototypes"):
        assert r.invoke(app, [cmd, "--help"]).exit_code == 0


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_torchrun_index_two_processes_equal_one_pass(trained, tiny_shards, tmp_path):
    """`torchrun --nproc_per_node 2 -m prismlm.cli index`: each gloo process builds half, rank 0 merges into
    --out and removes the parts; the result equals one process with the same batch size (the tables and
    counts bit for bit) and carries labels."""
    import os
    import subprocess
    import sys

    ckpt, run = trained
    out = tmp_path / "index"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "prismlm.cli",
        "index",
        str(run),
        "--shards",
        str(tiny_shards.root),
        "--max-sequences",
        "22",
        "--top-n",
        "8",
        "--batch-size",
        "4",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = build_index(
        ckpt.model,
        tiny_shards,
        IndexSettings(top_n=8, batch_size=4, max_sequences=22),
        progress=False,
        model_sha256=ckpt.manifest["model_sha256"],
    )
    merged = PrototypeIndex.load(out, model_sha256=ckpt.manifest["model_sha256"])
    for name in ("top_sim", "top_offset", "counts", "hist"):
        assert torch.equal(getattr(merged, name), getattr(full, name)), name
    for name, t in full.sample.tensors().items():  # the uniform sample of firings too
        assert torch.equal(t, merged.sample.tensors()[name]), name
    torch.testing.assert_close(merged.act_sum, full.act_sum, rtol=1e-12, atol=0)
    assert merged.covers_all and merged.manifest["covered"] == [[0, 22]]
    assert merged.manifest["merged_from"] == 2  # two parts were built, not one whole index per process
    assert (out / "labels.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["index"]
