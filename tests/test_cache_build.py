"""Building the attribution cache at scale: torchrun builds equal to one process, `--compress-from`, and a
memory ceiling that does not grow with the postings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import train_tiny_run
from typer.testing import CliRunner

from prismlm.cli.main import app
from prismlm.config import AttributionConfig
from prismlm.errors import ConfigError
from prismlm.tda.cache import AttributionCache, PostingSketcher, build_cache, compress_cache

_SAME_MANIFEST = (
    "postings",
    "covered",
    "tokens",
    "universe",
    "units",
    "r",
    "projection",
    "dtype",
    "prune",
    "aggregate",
    "id_encoding",
    "id_width",
    "id_exceptions",
    "scale_unit",
    "pruned",
    "postings_raw",
    "postings_aggregated",
    "bytes_postings",
    "curvature_tokens",
    "curvature_sample",
    "model_sha256",
    "shard_key",
    "num_prototypes",
    "batch_size",
    "pca_sequences",
)


@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("cache_build"), steps=20, batch_size=4, warmup_steps=2)


def assert_same_cache(a: AttributionCache, b: AttributionCache) -> None:
    """Every stored array equal bit for bit, and the manifest fields that describe the content."""
    assert np.array_equal(a.offsets, b.offsets)
    arrays_a, arrays_b = a._arrays(), b._arrays()
    assert sorted(arrays_a) == sorted(arrays_b)
    for name in arrays_a:
        x, y = np.asarray(arrays_a[name]), np.asarray(arrays_b[name])
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert np.array_equal(a.projection, b.projection)
    assert torch.equal(a.curvature.F, b.curvature.F) and torch.equal(a.curvature.m, b.curvature.m)
    for key in _SAME_MANIFEST:
        assert a.manifest.get(key) == b.manifest.get(key), key


COMPACT = [
    "--projection",
    "pca-local",
    "--sketch-size",
    "8",
    "--dtype",
    "int4",
    "--prune",
    "0.1",
    "--id-encoding",
    "delta",
]


@pytest.mark.parametrize(
    "options",
    [[], COMPACT, ["--dtype", "float16", "--aggregate", "document"]],
    ids=["default", "compact", "float16-document"],
)
@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_torchrun_cache_two_processes_equal_one_pass(trained, tiny_shards, tmp_path, options):
    """`torchrun --nproc_per_node 2 -m prismlm.cli attribute-cache`: both gloo processes compute the same
    (subsampled) curvature and pca bases, each builds half of the postings, rank 0 merges them into --out,
    applies the storage options and removes the parts: bit for bit the cache of one process."""
    ckpt, run = trained
    out = tmp_path / "cache"
    base = ["--max-sequences", "22", "--batch-size", "4", "--curvature-sample", "9", "--pca-sequences", "6"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "prismlm.cli",
        "attribute-cache",
        str(run),
        "--shards",
        str(tiny_shards.root),
        *base,
        *options,
        "--out",
        str(out),
        "--device",
        "cpu",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = dict(zip(options[0::2], options[1::2], strict=True))
    cfg = AttributionConfig(
        max_sequences=22,
        batch_size=4,
        curvature_sample=9,
        pca_sequences=6,
        projection=flags.get("--projection", "orthogonal"),  # type: ignore[arg-type]
        r=int(flags["--sketch-size"]) if "--sketch-size" in flags else None,
        dtype=flags.get("--dtype", "float32"),  # type: ignore[arg-type]
        prune=float(flags.get("--prune", 0)),
        aggregate=flags.get("--aggregate", "sequence"),  # type: ignore[arg-type]
        id_encoding=flags.get("--id-encoding", "int32"),
    )  # type: ignore[arg-type]
    one = build_cache(ckpt.model, tiny_shards, cfg, out=tmp_path / "one", model_sha256=ckpt.manifest["model_sha256"])
    merged = AttributionCache.load(out, model_sha256=ckpt.manifest["model_sha256"])
    assert merged.manifest["merged_from"] == 2  # two shares were built, not one whole cache per process
    assert merged.manifest["covered"] == [[0, 22]] and merged.manifest["curvature_tokens"] < 22 * 64
    assert_same_cache(merged, one)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "one"]  # the parts are gone


def test_compress_from_cli(trained, tiny_shards, tmp_path):
    """`prism attribute-cache RUN --compress-from CACHE --dtype int8 …` re-encodes a lossless cache without a
    pass over the data: equal to `compress_cache`; a lossy source is refused naming the fix."""
    ckpt, run = trained
    r = CliRunner()
    src = tmp_path / "src"
    common = ["--shards", str(tiny_shards.root), "--device", "cpu", "--no-progress"]
    res = r.invoke(app, ["attribute-cache", str(run), "--max-sequences", "16", "--out", str(src), *common])
    assert res.exit_code == 0, res.output
    before = (src / "manifest.json").read_text()
    res = r.invoke(app, ["attribute-cache", str(run), "--max-sequences", "16", "--out", str(src), "--resume", *common])
    assert res.exit_code == 0 and (src / "manifest.json").read_text() == before, res.output  # finished: kept as is
    for other in (["--max-sequences", "12"], ["--max-sequences", "16", "--r", "8"]):
        res = r.invoke(app, ["attribute-cache", str(run), *other, "--out", str(src), "--resume", *common])
        assert res.exit_code == 2 and "other options or sequences" in res.output, res.output
    small = tmp_path / "small"
    res = r.invoke(
        app,
        [
            "attribute-cache",
            str(run),
            "--compress-from",
            str(src),
            "--dtype",
            "int8",
            "--prune",
            "0.2",
            "--id-encoding",
            "delta",
            "--aggregate",
            "document",
            "--out",
            str(small),
            *common,
        ],
    )
    assert res.exit_code == 0, res.output
    assert "attribution cache" in res.output
    expected = compress_cache(
        AttributionCache.load(src),
        AttributionConfig(dtype="int8", prune=0.2, id_encoding="delta", aggregate="document"),
        shards=tiny_shards,
    )
    got = AttributionCache.load(small, model_sha256=ckpt.manifest["model_sha256"])
    assert got.manifest["dtype"] == "int8" and got.manifest["aggregate"] == "document"
    assert_same_cache(got, expected)
    res = r.invoke(
        app,
        [
            "attribute-cache",
            str(run),
            "--compress-from",
            str(small),
            "--dtype",
            "int4",
            "--out",
            str(tmp_path / "again"),
            *common,
        ],
    )
    assert res.exit_code == 2 and "lossless" in res.output and "default options" in res.output, res.output
    res = r.invoke(app, ["attribute-cache", str(run), "--compress-from", str(tmp_path / "nowhere"), *common])
    assert res.exit_code == 2 and "no attribution cache" in res.output, res.output


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, tracemalloc
    import numpy as np
    import torch
    from pathlib import Path
    import prismlm.tda.cache.encoding as encoding_mod
    import prismlm.tda.cache.store as store_mod
    from prismlm import RunConfig
    from prismlm.config import AttributionConfig
    from prismlm.data.shards import load_shards
    from prismlm.model import PrismLM
    from prismlm.tda.cache import AttributionCache, build_cache
    from prismlm.tda.influence import query_gradients

    encoding_mod.CHUNK = store_mod.QUERY_CHUNK = 512  # small chunks: the ceiling shows at a test's size
    torch.set_num_threads(1)
    shards_root, n, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    shards = load_shards(shards_root)
    cfg = RunConfig.from_name("tiny").override({"model.vocab_size": 512, "model.n_embd": 128})  # r = d = 128
    torch.manual_seed(0)
    model = PrismLM(cfg.model).eval()
    tracemalloc.start()  # numpy's allocations are traced (torch's are not: a batch's tensors are fixed-size)
    c = build_cache(model, shards, AttributionConfig(max_sequences=n, dtype="int8", id_encoding="delta"), out=out,
                    model_sha256="memtest")
    c = AttributionCache.load(out)
    q = query_gradients(model, [(shards.train.sequences(np.arange(1), 64)[0].tolist(), 1)])
    scores = c.scores(q, 1)
    peak = tracemalloc.get_traced_memory()[1]
    P = c.num_postings
    print(json.dumps({"peak": peak, "postings": P, "raw_bytes": P * (4 + 4 * c.r), "scores": int(scores.numel())}))
""")


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_build_and_query_memory_does_not_grow_with_postings(tiny_shards, tmp_path):
    """Building a cache (postings streamed to files, grouped and encoded in chunks) and querying it
    (memory-mapped, decoded in chunks) keep the traced peak nearly flat as the corpus grows 4×: its growth
    is a small fraction of the growth of the raw postings (4 + 4r bytes each); materialising the postings
    in memory would make it at least as large."""
    script = tmp_path / "mem.py"
    script.write_text(_MEMORY_SCRIPT)
    stats = []
    for n in (200, 800):
        proc = subprocess.run(
            [sys.executable, str(script), str(tiny_shards.root), str(n), str(tmp_path / f"c{n}")],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        stats.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    small, large = stats
    assert large["postings"] > 3 * small["postings"] and large["scores"] == 800
    grown_postings = large["raw_bytes"] - small["raw_bytes"]
    grown_peak = large["peak"] - small["peak"]
    assert grown_peak < 0.35 * grown_postings, (stats, grown_peak / grown_postings)


def test_sampled_curvature_spreads_and_defaults_to_all(trained, tiny_shards):
    """``curvature_sample``: 0/None or more than the cached sequences is the full curvature pass, bit for
    bit; a smaller sample takes whole batches spread over the sequences (``fit_ranges``)."""
    from prismlm.tda.cache import fit_ranges, sampled_curvature
    from prismlm.tda.influence import curvature_pass

    ckpt, _ = trained
    full = curvature_pass(ckpt.model, tiny_shards, sequences=(0, 22), batch_size=4)
    for n in (0, None, 22, 1000):
        c = sampled_curvature(ckpt.model, tiny_shards, AttributionConfig(batch_size=4, curvature_sample=n), 22)
        assert torch.equal(c.F, full.F) and torch.equal(c.m, full.m) and c.tokens == full.tokens
    part = sampled_curvature(ckpt.model, tiny_shards, AttributionConfig(batch_size=4, curvature_sample=9), 22)
    ranges = fit_ranges(22, 9, 4)
    assert len(ranges) > 1 and ranges[-1][1] == 22  # spread to the end, not the first 9
    assert part.tokens == sum(b - a for a, b in ranges) * 64 < full.tokens
    with pytest.raises(ConfigError, match="curvature_sample"):
        AttributionConfig(curvature_sample=-1)


def test_postings_gradients_equal_block_gradients(trained, tiny_shards):
    """The cache's loss-free block gradients are ``block_gradients``' rows and gradients, bit for bit."""
    from prismlm.tda.cache import postings_gradients
    from prismlm.tda.gradients import block_gradients
    from prismlm.tda.influence import forward_batch

    ckpt, _ = trained
    out, y = forward_batch(ckpt.model, tiny_shards, 8, 12, 64, torch.device("cpu"))
    ids = torch.arange(8, 12)
    a, b = postings_gradients(ckpt.model, out, y, ids), block_gradients(ckpt.model, out, y, seq_ids=ids)
    assert torch.equal(a.seq, b.seq) and torch.equal(a.proto, b.proto) and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("on_disk", [True, False], ids=["out", "in-memory"])
def test_fitted_batches_are_not_run_again(trained, tiny_shards, tmp_path, monkeypatch, on_disk):
    """The batches the curvature and pca-local fits ran through the model give the postings pass their
    block gradients: one forward fewer per distinct fitted batch, and a cache equal bit for bit to one
    whose postings pass runs every batch itself."""
    from prismlm.tda.cache import passes as passes_mod

    ckpt, _ = trained
    cfg = AttributionConfig(
        max_sequences=22,
        batch_size=4,
        curvature_sample=5,
        projection="pca-local",
        r=8,
        pca_sequences=9,
        dtype="int4",
        id_encoding="delta",
    )
    forwards: list[tuple[int, int]] = []
    real_forward = passes_mod.forward_batch

    def counting(net, shards, j0, j1, T, dev):
        forwards.append((j0, j1))
        return real_forward(net, shards, j0, j1, T, dev)

    monkeypatch.setattr(passes_mod, "forward_batch", counting)
    kept = build_cache(ckpt.model, tiny_shards, cfg, out=tmp_path / "kept" if on_disk else None)
    with_reuse = list(forwards)
    forwards.clear()
    monkeypatch.setattr(passes_mod.BatchStore, "wants", lambda self, j0, j1: False)
    every = build_cache(ckpt.model, tiny_shards, cfg, out=tmp_path / "every" if on_disk else None)
    curvature_batches, pca_batches = (
        {b for a0, a1 in passes_mod.fit_ranges(22, n, 4) for b in passes_mod.batch_grid(a0, a1, 4)} for n in (5, 9)
    )
    assert pca_batches - curvature_batches  # a batch only the pca-local fit ran
    assert len(forwards) - len(with_reuse) == len(curvature_batches | pca_batches) >= 3
    assert_same_cache(kept, every)
    assert not on_disk or not (tmp_path / "kept.build").exists()  # the kept gradients went with the build folder


_RESUMED = AttributionConfig(
    max_sequences=22,
    batch_size=4,
    curvature_sample=5,
    projection="pca-local",
    r=8,
    pca_sequences=9,
    dtype="int4",
    prune=0.1,
    id_encoding="delta",
)


def _interrupted_build(net, shards, cfg, out, monkeypatch, after: int) -> None:
    """A build that dies (KeyboardInterrupt) in its postings pass after ``after`` batches were written."""

    real = PostingSketcher.__call__
    calls = []

    def dying(self, proto, G):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(self, proto, G)

    with monkeypatch.context() as mp:
        mp.setattr(PostingSketcher, "__call__", dying)
        with pytest.raises(KeyboardInterrupt):
            build_cache(net, shards, cfg, out=out)


def test_resumed_build_equals_one_uninterrupted_build(trained, tiny_shards, tmp_path, monkeypatch):
    """A build killed in its postings pass, with a torn last write, resumes from its build folder after
    the last recorded batch: no curvature or pca pass again, only the remaining batches through the model,
    and the cache equals an uninterrupted build bit for bit."""
    from prismlm.tda.cache import passes as passes_mod

    ckpt, _ = trained
    net = ckpt.model
    whole = build_cache(net, tiny_shards, _RESUMED, out=tmp_path / "whole")
    out = tmp_path / "cache"
    _interrupted_build(net, tiny_shards, _RESUMED, out, monkeypatch, after=2)
    build = tmp_path / "cache.build"
    last = json.loads((build / "batches.jsonl").read_text().splitlines()[-1])
    assert last["j1"] == 8 and not out.exists()  # batches [0, 4) and [4, 8) recorded
    with open(build / "sketch.raw", "ab") as f:  # a write torn by the kill: bytes past the recorded rows
        f.write(b"\x00" * 13)
    forwards: list[int] = []
    real_forward = passes_mod.forward_batch

    def counting(net_, shards_, j0, j1, T, dev):
        forwards.append(j0)
        return real_forward(net_, shards_, j0, j1, T, dev)

    monkeypatch.setattr(passes_mod, "forward_batch", counting)
    resumed = build_cache(net, tiny_shards, _RESUMED, out=out, resume=True)
    assert forwards == [8, 12, 16, 20]  # the rest of the postings pass only
    assert_same_cache(resumed, whole)
    assert not build.exists()
    forwards.clear()
    again = build_cache(net, tiny_shards, _RESUMED, out=out, resume=True)  # finished: returned as it is
    assert forwards == [] and again.num_postings == whole.num_postings


def test_resume_refuses_a_build_started_otherwise(trained, tiny_shards, tmp_path, monkeypatch):
    from prismlm.config import replace
    from prismlm.errors import ArtifactError

    ckpt, _ = trained
    out = tmp_path / "cache"
    _interrupted_build(ckpt.model, tiny_shards, _RESUMED, out, monkeypatch, after=1)
    with pytest.raises(ArtifactError, match=r"cache\.build.*options") as e:
        build_cache(ckpt.model, tiny_shards, replace(_RESUMED, damping=0.3), out=out, resume=True)
    assert "without resuming" in str(e.value)
    with pytest.raises(ConfigError, match="output folder"):
        build_cache(ckpt.model, tiny_shards, _RESUMED, resume=True)
    fresh = build_cache(ckpt.model, tiny_shards, replace(_RESUMED, damping=0.3), out=out)  # no --resume: start over
    assert fresh.manifest["damping"] == 0.3 and not (tmp_path / "cache.build").exists()
