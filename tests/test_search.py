"""Approximate attribution search (issue 13, ``prismlm.tda.search``): candidates from per-list
inner-product indexes (faiss), rescored exactly.

Independent references: the exact scan (``AttributionCache.scores``) and a dense score matrix computed
here from the decoded postings, one posting at a time with numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import attribution_setup, train_tiny_run

from prismlm import AttributionConfig
from prismlm.config import SearchConfig
from prismlm.errors import ArtifactCorrupt, ArtifactError, ArtifactMismatch, ConfigError
from prismlm.tda.cache import AttributionCache, FloatSketches, PlainIds, QuantSketches, build_cache, quantise
from prismlm.tda.cache.store import exact_top
from prismlm.tda.search import SearchIndex, SearchManifest, build_search_index

N_SEQ = 40


@pytest.fixture(scope="module")
def tiny(tiny_shards, tmp_path_factory):
    return attribution_setup(
        tiny_shards, tmp_path_factory.mktemp("search"), steps=60, num_queries=6, curvature_sequences=N_SEQ
    )


def _dense(cache: AttributionCache, sq: torch.Tensor, query) -> np.ndarray:
    """(Q, U) scores from every decoded posting, one query-prototype table lookup per posting."""
    K = cache.num_prototypes
    ids, sk = np.asarray(cache.seq, dtype=np.int64), np.asarray(cache.sketch, dtype=np.float64)
    proto = np.repeat(np.arange(K), np.diff(cache.offsets))
    Q = int(query.seq.max()) + 1
    out = np.zeros((Q, cache.num_train))
    for q in range(Q):
        table = np.zeros((K, sk.shape[1]))
        sel = (query.seq == q).numpy()
        table[query.proto[sel].numpy()] = sq[sel].numpy()
        np.add.at(out[q], ids, (sk * table[proto]).sum(1))
    return out


def _synthetic(template: AttributionCache, U: int, seed: int = 0, quant: bool = False) -> AttributionCache:
    """A larger cache with the template's prototypes, projection and curvature (so real queries sketch the
    same way) and synthetic postings: list lengths 300–2500 over U units, sketches = a per-prototype mean
    direction + noise, with log-normal norms (heavy-tailed, like real sketches)."""
    rng = np.random.default_rng(seed)
    K, r = template.num_prototypes, template.r
    n = rng.integers(300, min(U, 2500), size=K)
    ids = np.concatenate([np.sort(rng.choice(U, size=int(c), replace=False)) for c in n])  # K lists: set-up only
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(n, out=offsets[1:])
    proto = np.repeat(np.arange(K), n)
    mean = rng.normal(size=(K, r))
    x = 0.7 * mean[proto] + rng.normal(size=(len(ids), r))
    x *= (np.exp(rng.normal(scale=0.8, size=len(ids))) / np.linalg.norm(x, axis=1))[:, None]
    m = {**template.manifest, "units": U, "universe": U, "tokens": U * 64}
    sk: FloatSketches | QuantSketches
    if quant:
        unit = float(np.abs(x).max()) / 7 / 2**15
        codes, scales = quantise(x, "int4", unit)
        sk, m["dtype"] = QuantSketches(codes, scales, unit, "int4", r), "int4"
    else:
        sk, m["dtype"] = FloatSketches(x.astype(np.float32)), "float32"
    return AttributionCache(
        offsets=offsets,
        ids=PlainIds(ids.astype(np.int32)),
        sketches=sk,
        projection=template.projection,
        curvature=template.curvature,
        manifest=m,
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "int4", "pq"])
@pytest.mark.parametrize("kind", ["ivf", "ivf-sq8", "hnsw"])
def test_exhaustive_settings_equal_the_exact_scan(tiny, tiny_shards, dtype, kind):
    """m >= the longest list: every unit with a posting in A_q is a candidate, and the top-k (ids and
    scores, bit for bit: the rescoring adds the same products in the same order) is the exact scan's —
    also with k = every unit (zero-score units fill in as in the scan)."""
    cache = build_cache(
        tiny.net,
        tiny_shards,
        AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8, dtype=dtype, id_encoding="delta"),
        curvature=tiny.curv,
    )
    idx = build_search_index(
        cache,
        SearchConfig(
            kind="hnsw" if kind == "hnsw" else "ivf", min_list=4, encoding="sq8" if kind == "ivf-sq8" else "cache"
        ),
    )
    assert idx.manifest["lists_indexed"] > 0
    for k in (10, N_SEQ):
        ref_s, ref_i = exact_top(cache, tiny.q, tiny.Q, k)
        s, i = idx.top(cache, tiny.q, tiny.Q, k, m=idx.exhaustive_m(cache))
        assert np.array_equal(i, ref_i) and np.array_equal(s, ref_s)
        s2, i2 = cache.top(tiny.q, tiny.Q, k, search=idx, m=idx.exhaustive_m(cache))
        assert np.array_equal(i2, ref_i) and np.array_equal(s2, ref_s)
        assert all(np.array_equal(a, b) for a, b in zip(cache.top(tiny.q, tiny.Q, k), (ref_s, ref_i)))


@pytest.mark.parametrize("encoding", ["flat", "cache"])
def test_ivf_probing_every_cell_is_an_exact_per_list_search(tiny, tiny_shards, encoding):
    """IVF (flat, or cells over the cache's own postings) with nprobe = nlist ranks a list exactly: the
    top-k equals the one from exactly scanned lists (no index) at the same m < list length."""
    cache = build_cache(
        tiny.net, tiny_shards, AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8), curvature=tiny.curv
    )
    big = _synthetic(cache, 3000, seed=3, quant=encoding == "cache")
    ivf = build_search_index(big, SearchConfig(min_list=100, encoding=encoding))
    scan = build_search_index(big, SearchConfig(min_list=10**6))  # no index: each list scanned, top m exactly
    assert scan.manifest["lists_indexed"] == 0 and ivf.manifest["lists_indexed"] == big.num_prototypes
    a = ivf.top(big, tiny.q, tiny.Q, 10, m=5, nprobe=10**6)
    b = scan.top(big, tiny.q, tiny.Q, 10, m=5)
    assert np.array_equal(a[1], b[1]) and np.allclose(a[0], b[0], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ivf", "ivf-sq8", "hnsw"])
def test_approximate_search_recalls_the_exact_top10(tiny, tiny_shards, kind):
    """On a larger synthetic cache (lists of 300–2500 postings over 4000 units), a moderate effort (m = 40
    per list, nprobe 16 of ~50 cells / ef 64) reads a fraction of the postings and recalls >= 0.9 of the exact top-10; the
    scores it returns are the exact ones."""
    cache = build_cache(
        tiny.net, tiny_shards, AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8), curvature=tiny.curv
    )
    big = _synthetic(cache, 4000, seed=1)
    idx = build_search_index(
        big,
        SearchConfig(
            kind="hnsw" if kind == "hnsw" else "ivf", min_list=500, encoding="sq8" if kind == "ivf-sq8" else "cache"
        ),
    )
    ref_s, ref_i = exact_top(big, tiny.q, tiny.Q, 10)
    s, i = idx.top(big, tiny.q, tiny.Q, 10, m=40, nprobe=16, ef=64)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(i.tolist(), ref_i.tolist())])
    assert recall >= 0.9, recall
    if kind == "ivf":  # cells over the cache copy no vector: 4 bytes a posting (+ centroids and offsets)
        assert idx.cells is not None and idx.blobs.nbytes == 0
        assert idx.cells.positions.nbytes == 4 * idx.manifest["postings_indexed"]
        assert idx.manifest["bytes_indexes"] < 4.5 * idx.manifest["postings_indexed"] + 4 * big.r * len(
            idx.cells.centroids
        )
    dense = _dense(big, big.sketch_query(tiny.q), tiny.q)
    np.testing.assert_allclose(s, np.take_along_axis(dense, i, 1), rtol=1e-12, atol=1e-12 * np.abs(dense).max())
    # fewer candidates than the units the exact scan touches: the search did not degenerate into a scan
    sq, qs, qp = big.sketch_query(tiny.q), tiny.q.seq.numpy(), tiny.q.proto.numpy()
    sel = np.flatnonzero(qs == 0)
    cand = idx.candidates(big, qp[sel], sq[torch.from_numpy(sel)], m=40, nprobe=16, ef=64)
    touched = np.count_nonzero(dense[0])
    assert len(cand) < 0.8 * touched, (len(cand), touched)


@pytest.mark.parametrize("quant", [False, True])
def test_rescoring_sums_every_active_prototype(tiny, tiny_shards, quant):
    """Rescored scores equal a dense matrix computed independently from the decoded postings, for any
    candidate set (dropping one prototype's contribution would break it: a unit's postings span many lists)."""
    cache = build_cache(
        tiny.net, tiny_shards, AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8), curvature=tiny.curv
    )
    big = _synthetic(cache, 2000, seed=2, quant=quant)
    idx = build_search_index(big, SearchConfig(min_list=10**6))
    sq = big.sketch_query(tiny.q)
    dense = _dense(big, sq, tiny.q)
    qs, qp = tiny.q.seq.numpy(), tiny.q.proto.numpy()
    rng = np.random.default_rng(0)
    for q in range(tiny.Q):
        sel = np.flatnonzero(qs == q)
        assert len(sel) >= 2  # several prototypes contribute
        cand = np.sort(rng.choice(big.num_train, size=300, replace=False))
        got = idx.rescore(big, qp[sel], sq[torch.from_numpy(sel)], cand)
        np.testing.assert_allclose(got, dense[q, cand], rtol=1e-12, atol=1e-12 * np.abs(dense[q]).max())
        partial = idx.rescore(big, qp[sel[1:]], sq[torch.from_numpy(sel[1:])], cand)  # one prototype dropped
        assert not np.allclose(partial, dense[q, cand], rtol=1e-9, atol=0)


def test_sidecar_round_trips_and_refuses_another_cache(tiny, tiny_shards, tmp_path):
    cfg = AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8, dtype="int8", id_encoding="delta")
    cache = build_cache(tiny.net, tiny_shards, cfg, curvature=tiny.curv, out=tmp_path / "cache")
    idx = build_search_index(cache, SearchConfig(min_list=4), out=tmp_path / "cache" / "search")
    mem = build_search_index(cache, SearchConfig(min_list=4))
    assert idx.manifest["bytes"] == idx.nbytes() > 0 and idx.manifest["build_seconds"] >= 0
    assert list(idx.manifest) == list(SearchManifest.__annotations__)  # the declared keys, in order
    loaded = SearchIndex.load(tmp_path / "cache" / "search", AttributionCache.load(tmp_path / "cache"))
    for a, b in ((loaded, mem), (idx, mem)):
        x, y = a.top(cache, tiny.q, tiny.Q, 10, m=3, nprobe=2), b.top(cache, tiny.q, tiny.Q, 10, m=3, nprobe=2)
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
    # the sidecar of another cache (other sequences) is refused, naming the manifest and the fix
    other = build_cache(
        tiny.net,
        tiny_shards,
        AttributionConfig(max_sequences=N_SEQ - 8, batch_size=8, r=8, dtype="int8", id_encoding="delta"),
        curvature=tiny.curv,
    )
    with pytest.raises(ArtifactMismatch, match="manifest.json.*another attribution cache") as e:
        SearchIndex.load(tmp_path / "cache" / "search", other)
    assert "build_search_index" in str(e.value)
    with pytest.raises(ArtifactMismatch):
        mem.top(other, tiny.q, tiny.Q, 10)
    # a flipped byte, a missing file, no sidecar
    f = tmp_path / "cache" / "search" / "fwd_rows.npy"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(ArtifactCorrupt, match="fwd_rows.npy"):
        SearchIndex.load(tmp_path / "cache" / "search", cache)
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    SearchIndex.load(tmp_path / "cache" / "search", cache)  # restored: loads again
    (tmp_path / "cache" / "search" / "indexes.bin").unlink()
    with pytest.raises(ArtifactCorrupt, match="indexes.bin is missing"):
        SearchIndex.load(tmp_path / "cache" / "search", cache)
    with pytest.raises(ArtifactError, match="no search index"):
        SearchIndex.load(tmp_path / "nothing", cache)


def test_search_config_validates():
    for bad in ({"kind": "lsh"}, {"min_list": 0}, {"nlist_factor": 0.0}, {"encoding": "pq"}, {"hnsw_m": 1}):
        with pytest.raises(ConfigError):
            SearchConfig(**bad)
    assert SearchConfig.from_dict(SearchConfig(kind="hnsw").to_dict()) == SearchConfig(kind="hnsw")


def test_attribute_with_the_search_index_from_the_cli_and_the_app(tiny_shards, tmp_path):
    """`prism attribute-search RUN` builds CACHE/search; `prism attribute` then uses it (``--search auto``) or
    is told to (``approximate``, refused without one). With candidates covering every list it returns the
    exact scan's ranking, scores and contributions; with a tiny budget the sequences it returns still carry
    their exact scores."""
    from typer.testing import CliRunner

    from prismlm.app import Run, attribute_text, build_run_search
    from prismlm.cli.main import app
    from prismlm.tda.attribute import SearchSpec

    _, run_dir = train_tiny_run(tiny_shards, tmp_path / "run", steps=20, batch_size=4, warmup_steps=2)
    r = CliRunner()
    common = ["--shards", str(tiny_shards.root), "--device", "cpu"]
    res = r.invoke(
        app,
        [
            "attribute-cache",
            str(run_dir),
            "--max-sequences",
            "64",
            "--r",
            "8",
            "--dtype",
            "int8",
            "--id-encoding",
            "delta",
            "--no-progress",
            *common,
        ],
    )
    assert res.exit_code == 0, res.output
    text = ["The President said that the nation"]
    res = r.invoke(app, ["attribute", str(run_dir), *text, "--search", "approximate", *common])
    assert res.exit_code == 2 and "no search index" in res.output and "prism attribute-search" in res.output
    res = r.invoke(app, ["attribute-search", str(run_dir), "--min-list", "4", "--no-progress", *common])
    assert res.exit_code == 0 and "search index" in res.output, res.output
    res = r.invoke(app, ["attribute", str(run_dir), *text, "--candidates", "4", "--nprobe", "1", *common])
    assert res.exit_code == 0 and "cached-search" in res.output, res.output

    run = Run.open(run_dir, device="cpu")
    shards = tiny_shards.root
    exact = attribute_text(run, text[0], search=SearchSpec(top=20, search="exact"), shards=shards)
    side = run.search(shards_dir=shards, required=True)
    assert side is not None
    every = side.exhaustive_m(run.cache(shards_dir=shards))
    approx = attribute_text(
        run, text[0], search=SearchSpec(top=20, search="approximate", candidates=every, nprobe=10**6), shards=shards
    )
    assert exact.method == "cached" and approx.method == "cached-search"
    assert [(a.sequence, a.score, a.prototypes, a.snippet) for a in approx.top] == [
        (a.sequence, a.score, a.prototypes, a.snippet) for a in exact.top
    ]
    # a tiny search budget: maybe other sequences, but every score is the exact scan's score of that sequence
    cache = run.cache(shards_dir=shards)
    full = {
        a.sequence: a.score
        for a in attribute_text(run, text[0], search=SearchSpec(top=cache.num_train, search="exact"), shards=shards).top
    }
    small = attribute_text(
        run, text[0], search=SearchSpec(top=10, candidates=1, nprobe=1), shards=shards
    )  # auto: the sidecar
    assert small.method == "cached-search" and len(small.top) == 10
    assert all(a.score == full[a.sequence] for a in small.top), [
        (a.sequence, a.score, full[a.sequence]) for a in small.top
    ]
    assert [a.score for a in small.top] == sorted((a.score for a in small.top), reverse=True)
    # rebuilt through the app (progress callback), the run re-reads it
    events = []
    build_run_search(
        run, SearchConfig(min_list=4, kind="hnsw"), shards=shards, progress=events.append, overwrite=True
    )  # replacing the ivf one: only with overwrite
    assert events and events[-1].stage == "search index"
    assert run.search(shards_dir=shards).config.kind == "hnsw"
