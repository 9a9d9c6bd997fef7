"""The attribution cache's compact store (issue 13): exact id encodings, bounded quantisation, pruning,
document aggregation, queries that read only the query's prototypes, verified artifacts, old formats.

Independent references: hand-built postings and bytes, the scoring function of format 1 (kept below,
verbatim), a dense scan of every posting, and the full prototype-space method."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import attribution_setup

from prismlm import AttributionConfig
from prismlm.artifacts import file_records
from prismlm.errors import ArtifactCorrupt, ArtifactError, ConfigError
from prismlm.tda import cache as cache_mod
from prismlm.tda.attribute import QuerySpec, SearchSpec, attribute
from prismlm.tda.cache import (
    AttributionCache,
    DeltaIds,
    PlainIds,
    PostingSketcher,
    PQSketches,
    build_cache,
    compress_cache,
    dequantise,
    document_of_sequences,
    fit_ranges,
    merge_caches,
    pca_bases,
    pq_encode,
    pq_layout,
    pq_train,
    project,
    quantise,
)
from prismlm.tda.cache import store as store_mod
from prismlm.tda.influence import FullGradients, query_gradients

N_SEQ = 40


# ----- references --------------------------------------------------------------------------------------
def _format1_scores(offsets, seq, sketch, sq, query, num_queries, num_train):
    """The query path of format 1 (``AttributionCache.scores`` before issue 13), verbatim."""
    out = torch.zeros(num_queries, num_train, dtype=torch.float64)
    qseq, qproto = query.seq.cpu(), query.proto.cpu()
    for q in range(num_queries):
        sel = qseq == q
        protos = qproto[sel].numpy()
        lo, hi = offsets[protos], offsets[protos + 1]
        n = hi - lo
        if n.sum() == 0:
            continue
        rep = np.repeat(np.arange(len(protos)), n)
        rows = lo[rep] + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
        s = torch.from_numpy(np.asarray(sketch[rows], dtype=np.float64))
        c = (s * sq[sel][torch.from_numpy(rep)]).sum(1)
        out[q].index_add_(0, torch.from_numpy(np.asarray(seq[rows], dtype=np.int64)), c)
    return out


def _dense_scores(offsets, ids, sketch, sq, query, num_queries, num_train):
    """Every posting scanned: score[q, j] = Σ_{postings (j, i, s)} s_{q,i} · s (a table per query)."""
    K = len(offsets) - 1
    proto = np.repeat(np.arange(K), np.diff(offsets))
    out = np.zeros((num_queries, num_train))
    for q in range(num_queries):
        table = np.zeros((K, sketch.shape[1]))
        sel = (query.seq == q).numpy()
        table[query.proto[sel].numpy()] = sq[sel].numpy()
        np.add.at(out[q], np.asarray(ids, dtype=np.int64), (np.asarray(sketch, dtype=np.float64) * table[proto]).sum(1))
    return out


# ----- encodings, no model ------------------------------------------------------------------------------
def _lists(rng, K, universe, dense):
    """Random CSR lists: K prototypes, ascending unique ids < universe; some empty, some with one id."""
    lists = []
    for i in range(K):
        n = 0 if i % 7 == 3 else (1 if i % 7 == 5 else int(rng.integers(2, dense)))
        lists.append(np.sort(rng.choice(universe, size=min(n, universe), replace=False)))
    offsets = np.zeros(K + 1, np.int64)
    offsets[1:] = np.cumsum([len(x) for x in lists])
    return offsets, np.concatenate(lists).astype(np.int64), lists


@pytest.mark.parametrize("universe,dense", [(300, 200), (5000, 40), (200_000, 30)])
def test_delta_ids_round_trip_exactly(universe, dense):
    rng = np.random.default_rng(universe)
    offsets, ids, lists = _lists(rng, 23, universe, dense)
    enc = DeltaIds.encode(ids, offsets)
    assert np.array_equal(enc.decode(offsets), ids)
    # any selection of whole lists, in any order and with repeats (as queries read them)
    pick = rng.integers(0, 23, size=40)
    lo, n = offsets[pick], np.diff(offsets)[pick]
    want = np.concatenate([lists[i] for i in pick])
    assert np.array_equal(enc.gather(lo, n), want)
    assert np.array_equal(PlainIds.encode(ids, offsets).gather(lo, n), want)
    assert enc.gather(offsets[[3]], np.diff(offsets)[[3]]).shape == (0,)  # an empty list
    # gaps that do not fit are exceptions; the narrowest type is chosen when it is smaller
    assert len(enc.exc_pos) == int(np.count_nonzero(enc.gaps == np.iinfo(enc.gaps.dtype).max))
    if universe == 300:
        assert enc.gaps.dtype == np.uint8 and enc.nbytes < 2 * len(ids)


def test_delta_ids_hand_built_bytes():
    """Lists [0, 1, 255, 256, 1000 … 1010] and [7]: gaps 0, 1, 254, 1, 744, 1 × 10 | 7; 744 ≥ 255 is an
    exception (16 + 12 bytes in uint8 < 32 in uint16), and so is a gap of exactly 255 (the marker)."""
    offsets = np.array([0, 15, 15, 16])
    enc = DeltaIds.encode(np.array([0, 1, 255, 256, *range(1000, 1011), 7]), offsets)
    assert enc.gaps.dtype == np.uint8 and enc.gaps.tolist() == [0, 1, 254, 1, 255] + [1] * 10 + [7]
    assert enc.exc_pos.tolist() == [4] and enc.exc_val.tolist() == [744] and enc.nbytes == 16 + 12
    assert DeltaIds.encode(np.array([0, 1000]), np.array([0, 2])).gaps.dtype == np.uint16  # 4 < 2 + 12
    ids = np.array([3, 258, *range(259, 279)])  # a gap of exactly 255
    enc = DeltaIds.encode(ids, np.array([0, 22]))
    assert enc.gaps.dtype == np.uint8 and enc.gaps.tolist()[:3] == [3, 255, 1] and enc.exc_val.tolist() == [255]
    assert enc.decode(np.array([0, 22])).tolist() == ids.tolist()
    with pytest.raises(ArtifactError, match="ascending"):
        DeltaIds.encode(np.array([5, 2]), np.array([0, 2]))


def test_quantisation_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 7)) * np.exp(rng.uniform(-12, 8, size=(500, 1)))  # 9 orders of magnitude
    x[3] = 0.0
    x[4, :] = 0.0
    x[4, 2] = -1e-9
    unit = float(np.abs(x).max()) / 127 / 2**15
    for dtype, qmax, width in (("int8", 127, 7), ("int4", 7, 4), ("int3", 3, 3)):
        u = unit * 127 / qmax
        codes, scales = quantise(x, dtype, u)
        assert codes.shape == (500, width)
        back = dequantise(codes, scales, u, dtype, 7)
        step = scales.astype(np.float64) * u
        assert np.all(np.abs(back - x) <= step[:, None] / 2 * (1 + 1e-12))
        assert np.all(step >= np.abs(x).max(1) / qmax)  # rounded up: nothing clipped
        assert np.all(back[3] == 0)


def test_int4_packing_by_hand():
    codes, scales = quantise(np.array([[-7.0, 0.0, 7.0]]), "int4", 1.0)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [[0x81, 0x8F]]  # nibbles q + 8: (1, 8) and (15, pad 8), low nibble first
    assert dequantise(codes, scales, 1.0, "int4", 3).tolist() == [[-7.0, 0.0, 7.0]]
    codes, _ = quantise(np.array([[-127.0, 3.0]]), "int8", 1.0)
    assert codes.dtype == np.int8 and codes.tolist() == [[-127, 3]]
    # int3: codes q + 4 as a little-endian bit stream, 3 bits each: -3, 0, 3 → 1, 4, 7 → bits 100 001 111
    codes, scales = quantise(np.array([[-3.0, 0.0, 3.0]]), "int3", 1.0)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [[0b11_100_001, 0b1]]  # 1 | 4 << 3 | 7 << 6 = 481 → bytes 0xE1, 0x01
    assert dequantise(codes, scales, 1.0, "int3", 3).tolist() == [[-3.0, 0.0, 3.0]]
    x = np.array([[-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 3.0, -3.0]])  # 9 codes: 27 bits across 4 bytes
    codes, scales = quantise(x, "int3", 1.0)
    assert codes.shape == (1, 4) and dequantise(codes, scales, 1.0, "int3", 9).tolist() == x.tolist()


def test_product_quantisation_by_hand():
    """r = 4 as M = 2 interleaved sub-vectors of 2: sub-vector 0 holds dimensions 0 and 2, sub-vector 1
    dimensions 1 and 3; a posting decodes to its norm times its two centroids put back in place."""
    cb = np.zeros((2, 256, 2), np.float32)
    cb[0, 5], cb[1, 9] = [0.6, 0.0], [0.0, 0.8]
    cb[0, 1], cb[1, 2] = [-0.5, 0.5], [0.5, -0.5]
    codes = np.array([[5, 9], [1, 2]], np.uint8)
    sk = PQSketches(codes, np.array([2.0, 4.0], np.float16), 0.5, cb)
    want = np.array([[0.6, 0.0, 0.0, 0.8], [-1.0, 1.0, 1.0, -1.0]])  # norms 1.0 and 2.0 (scale × unit)
    np.testing.assert_allclose(sk.gather(np.array([0, 1])), want, rtol=1e-6)
    q = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, -1.0, 2.0, 0.5]])
    np.testing.assert_allclose(sk.dots(np.array([0, 1]), q), [0.6 + 3.2, -1.0 - 1.0 + 2.0 - 0.5], rtol=1e-6)
    assert sk.nbytes == codes.nbytes + 2 * 2 + cb.nbytes and sk.manifest()["pq_dims"] == 2
    # the nearest centroid of each sub-vector (a brute-force reference), ties to the lowest index
    rng = np.random.default_rng(0)
    cb2 = rng.normal(size=(2, 256, 2)).astype(np.float32)
    z = rng.normal(size=(300, 4))
    got = pq_encode(z, cb2, chunk=64)
    for m in range(2):
        dist = ((z[:, m::2][:, None, :] - cb2[m][None].astype(np.float64)) ** 2).sum(-1)  # (300, 256)
        assert np.array_equal(got[:, m], dist.argmin(1))
    # at most 256 distinct sub-vectors per sub-quantizer: the codebooks hold them all, encoding is exact
    z = np.repeat(rng.normal(size=(100, 6)), 3, axis=0)
    cb3 = pq_train(z, 3, seed=0)
    rows = np.arange(len(z))
    np.testing.assert_allclose(
        PQSketches(pq_encode(z, cb3), np.ones(len(z), np.float16), 1.0, cb3).gather(rows), z, rtol=1e-6, atol=1e-7
    )
    with pytest.raises(ConfigError, match="AttributionConfig.pq_dims"):
        pq_layout(10, 4)


def test_config_validates_storage_options():
    for bad in (
        {"prune": 1.0},
        {"prune": -0.1},
        {"prune": float("nan")},
        {"dtype": "int2"},
        {"aggregate": "token"},
        {"id_encoding": "varint"},
        {"pq_dims": 0},
        {"pq_sample": 10},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            AttributionConfig(**bad)
    c = AttributionConfig(dtype="int4", prune=0.05, aggregate="document", id_encoding="delta")
    assert AttributionConfig.from_dict(c.to_dict()) == c


def test_cli_offers_the_storage_options():
    from typer.testing import CliRunner

    from prismlm.cli import app

    res = CliRunner().invoke(app, ["attribute-cache", "--help"], terminal_width=200)
    for opt in ("--dtype", "--prune", "--aggregate", "--id-encoding", "--pq-dims", "--pq-sample"):
        assert opt in res.output, res.output


# ----- on a trained tiny model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_shards, tmp_path_factory):
    return attribution_setup(
        tiny_shards, tmp_path_factory.mktemp("store"), steps=80, num_queries=5, curvature_sequences=N_SEQ
    )


def _cfg(**kw):
    return AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8, **kw)


@pytest.mark.slow
def test_query_path_equals_format1_and_a_dense_scan(tiny, tiny_shards, tmp_path, monkeypatch):
    """float32, no pruning: the new query path gives the format-1 path's scores bit for bit, with int32
    or delta ids, from memory and from disk; both equal a scan of every posting."""
    plain = build_cache(tiny.net, tiny_shards, _cfg(), curvature=tiny.curv, out=tmp_path / "plain")
    raw = {n: np.load(tmp_path / "plain" / f"{n}.npy") for n in ("offsets", "seq", "sketch")}
    assert raw["seq"].dtype == np.int32 and raw["sketch"].dtype == np.float32
    sq = plain.sketch_query(tiny.q)
    ref = _format1_scores(raw["offsets"], raw["seq"], raw["sketch"], sq, tiny.q, tiny.Q, N_SEQ)
    assert torch.count_nonzero(ref) > N_SEQ  # the queries reach many sequences
    assert torch.equal(plain.scores(tiny.q, tiny.Q), ref)
    monkeypatch.setattr(store_mod, "QUERY_CHUNK", 7)  # many chunks: the same sums in the same order
    assert torch.equal(plain.scores(tiny.q, tiny.Q), ref)
    monkeypatch.undo()
    dense = _dense_scores(raw["offsets"], raw["seq"], raw["sketch"], sq, tiny.q, tiny.Q, N_SEQ)
    np.testing.assert_allclose(ref.numpy(), dense, rtol=1e-12, atol=1e-12 * np.abs(dense).max())
    delta = build_cache(tiny.net, tiny_shards, _cfg(id_encoding="delta"), curvature=tiny.curv, out=tmp_path / "d")
    assert not (tmp_path / "d" / "seq.npy").exists() and (tmp_path / "d" / "ids_gap.npy").exists()
    assert np.array_equal(delta.seq, raw["seq"]) and np.array_equal(np.asarray(delta.sketch), raw["sketch"])
    assert torch.equal(delta.scores(tiny.q, tiny.Q), ref)
    assert torch.equal(compress_cache(plain, _cfg(id_encoding="delta")).scores(tiny.q, tiny.Q), ref)
    mem = build_cache(tiny.net, tiny_shards, _cfg(id_encoding="delta"), curvature=tiny.curv)
    assert torch.equal(mem.scores(tiny.q, tiny.Q), ref)
    # the id bytes: ~1 per posting instead of 4
    assert delta.manifest["bytes_postings"] < plain.manifest["bytes_postings"] - 2.5 * plain.num_postings


def test_lossless_compact_settings_equal_the_full_method(tiny, tiny_shards):
    """r = d, float64, delta ids: the cache equals the full prototype-space scores, per sequence and —
    aggregated by document — per document (sums of the sequence scores)."""
    full = FullGradients.build(tiny.net, tiny_shards, max_sequences=N_SEQ, batch_size=8)
    S = full.scores(tiny.q, tiny.Q).numpy()
    cfg = AttributionConfig(
        max_sequences=N_SEQ, batch_size=8, projection="identity", dtype="float64", id_encoding="delta"
    )
    seq = build_cache(tiny.net, tiny_shards, cfg, curvature=full.curvature)
    np.testing.assert_allclose(seq.scores(tiny.q, tiny.Q).numpy(), S, rtol=1e-10, atol=1e-9)
    T = tiny.net.config.block_size
    docs = document_of_sequences(tiny_shards, N_SEQ, T)
    assert np.all(np.diff(docs) >= 0) and docs[-1] > docs[0]  # several documents
    want = np.zeros((tiny.Q, docs[-1] + 1))
    np.add.at(want, (slice(None), docs), S)
    for c in (
        build_cache(
            tiny.net,
            tiny_shards,
            AttributionConfig(**{**cfg.to_dict(), "aggregate": "document"}),
            curvature=full.curvature,
        ),
        compress_cache(seq, AttributionConfig(**{**cfg.to_dict(), "aggregate": "document"}), shards=tiny_shards),
    ):
        assert c.num_train == docs[-1] + 1 and c.num_postings < seq.num_postings
        np.testing.assert_allclose(c.scores(tiny.q, tiny.Q).numpy(), want, rtol=1e-10, atol=1e-9)
    # the document of a sequence is the one holding its middle target token
    j = N_SEQ // 2
    assert docs[j] == tiny_shards.train.locate(j * T + 1 + (T - 1) // 2)[0]


def test_quantised_and_pruned_postings(tiny, tiny_shards):
    base = build_cache(tiny.net, tiny_shards, _cfg(dtype="float64"), curvature=tiny.curv)
    x = np.asarray(base.sketch)
    exact = base.scores(tiny.q, tiny.Q).numpy()
    sq = base.sketch_query(tiny.q)
    for dtype, qmax in (("int8", 127), ("int4", 7), ("int3", 3)):
        c = compress_cache(base, _cfg(dtype=dtype))
        assert np.array_equal(c.seq, base.seq) and np.array_equal(c.offsets, base.offsets)
        step = np.asarray(c.sketches.scales, dtype=np.float64) * c.sketches.unit
        assert np.all(np.abs(c.sketch - x) <= step[:, None] / 2 * (1 + 1e-12))
        assert np.all(step * qmax * (1 + 1e-12) >= np.abs(x).max(1))
        # the scores move by at most Σ |s_q| · step/2 over the postings read
        got = c.scores(tiny.q, tiny.Q).numpy()
        bound = _dense_scores(c.offsets, c.seq, np.repeat(step[:, None] / 2, c.r, 1), sq.abs(), tiny.q, tiny.Q, N_SEQ)
        assert np.all(np.abs(got - exact) <= bound * (1 + 1e-9) + 1e-12)
        assert c.manifest["bytes_postings"] == c.sketches.nbytes + c.ids.nbytes
    # pruning keeps exactly the postings with norm >= τ × their list's largest
    tau = 0.3
    norms = np.linalg.norm(x, axis=1)
    proto = np.repeat(np.arange(base.num_prototypes), np.diff(base.offsets))
    top = np.zeros(base.num_prototypes)
    np.maximum.at(top, proto, norms)
    keep = norms >= tau * top[proto]
    assert 0 < keep.sum() < len(keep)
    p = compress_cache(base, _cfg(dtype="float64", prune=tau))
    assert np.array_equal(p.seq, base.seq[keep]) and np.array_equal(p.sketch, x[keep])
    # per unit: each sequence keeps its largest postings until they hold >= 1 - τ of its squared-norm mass
    # (reference: a plain loop over sequences)
    seqs = np.asarray(base.seq)
    want = np.zeros(len(x), dtype=bool)
    for j in np.unique(seqs):
        rows = np.flatnonzero(seqs == j)
        n2 = norms[rows] ** 2
        held = 0.0
        for i in rows[np.argsort(-n2, kind="stable")]:
            if held >= (1 - tau) * n2.sum():
                break
            want[i] = True
            held += norms[i] ** 2
    assert 0 < want.sum() < len(want) and want.sum() != keep.sum()
    pu = compress_cache(base, _cfg(dtype="float64", prune=tau, prune_by="unit"))
    assert np.array_equal(pu.seq, base.seq[want]) and np.array_equal(pu.sketch, x[want])
    assert pu.manifest["prune_by"] == "unit" and pu.manifest["pruned"] == int((~want).sum())
    kept_mass = np.bincount(seqs[want], weights=norms[want] ** 2, minlength=N_SEQ)
    all_mass = np.bincount(seqs, weights=norms**2, minlength=N_SEQ)
    assert np.all(kept_mass >= (1 - tau) * all_mass * (1 - 1e-12))
    assert np.array_equal(np.diff(p.offsets), np.bincount(proto[keep], minlength=base.num_prototypes))
    assert p.manifest["pruned"] == int((~keep).sum())
    np.testing.assert_allclose(
        p.scores(tiny.q, tiny.Q).numpy(),
        _dense_scores(p.offsets, p.seq, p.sketch, sq, tiny.q, tiny.Q, N_SEQ),
        rtol=1e-12,
        atol=1e-12 * np.abs(exact).max(),
    )
    # a lossy cache is neither merged nor compressed again
    with pytest.raises(ArtifactError, match="lossless"):
        compress_cache(p, _cfg(dtype="int8"))


def test_product_quantised_postings(tiny, tiny_shards, tmp_path):
    """dtype='pq': exact where the codebooks hold every sub-vector; otherwise each posting is its norm times
    its nearest centroids, the query path scans exactly those decoded sketches, and the rankings stay
    close to the float ones. Built and compressed caches agree; the codebook is a
    verified file of the artifact."""
    # two sequences: fewer than 256 postings, so every sub-vector is a centroid and only the norms round
    small = build_cache(
        tiny.net,
        tiny_shards,
        AttributionConfig(max_sequences=2, batch_size=2, r=8, dtype="float64"),
        curvature=tiny.curv,
    )
    assert small.num_postings <= 256
    pq = compress_cache(small, AttributionConfig(max_sequences=2, batch_size=2, r=8, dtype="pq", pq_dims=2))
    x = np.asarray(small.sketch)
    np.testing.assert_allclose(pq.sketch, x, rtol=2**-11, atol=1e-6 * np.abs(x).max())
    sq = small.sketch_query(tiny.q)
    exact = small.scores(tiny.q, tiny.Q).numpy()
    bound = _dense_scores(
        small.offsets, small.seq, np.abs(x) * 2**-11 + 1e-6 * np.abs(x).max(), sq.abs(), tiny.q, tiny.Q, 2
    )
    assert np.all(np.abs(pq.scores(tiny.q, tiny.Q).numpy() - exact) <= bound)
    # more postings than centroids (synthetic sketches on the tiny cache's prototypes, projection and
    # curvature, so real queries sketch the same way): codes are nearest centroids of the unit directions
    rng = np.random.default_rng(0)
    K, U = small.num_prototypes, 400
    counts = rng.integers(20, 120, size=K)
    ids = np.concatenate([np.sort(rng.choice(U, size=int(n), replace=False)) for n in counts]).astype(np.int32)
    offsets = np.zeros(K + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    proto = np.repeat(np.arange(K), counts)
    x = rng.normal(size=(K, 8))[proto] * 0.7 + rng.normal(size=(len(ids), 8))
    x *= np.exp(rng.normal(scale=0.8, size=len(ids)))[:, None]
    base = AttributionCache(
        offsets=offsets,
        ids=PlainIds(ids),
        sketches=cache_mod.FloatSketches(x),
        projection=small.projection,
        curvature=small.curvature,
        manifest={**small.manifest, "universe": U, "units": U, "covered": [[0, U]]},
    )
    assert base.num_postings > 4 * 256
    c = compress_cache(base, _cfg(dtype="pq", pq_dims=2))
    assert isinstance(c.sketches, PQSketches) and c.sketches.codes.shape == (base.num_postings, 4)
    norms = np.linalg.norm(x, axis=1)
    np.testing.assert_allclose(np.asarray(c.sketches.scales, np.float64) * c.sketches.unit, norms, rtol=2**-10)
    assert np.array_equal(c.sketches.codes, pq_encode(x / norms[:, None], c.sketches.codebook))
    got = c.scores(tiny.q, tiny.Q).numpy()
    np.testing.assert_allclose(
        got, _dense_scores(c.offsets, c.seq, c.sketch, sq, tiny.q, tiny.Q, U), rtol=1e-9, atol=1e-12 * np.abs(got).max()
    )
    exact = base.scores(tiny.q, tiny.Q).numpy()
    assert c.manifest["bytes_postings"] == c.sketches.nbytes + c.ids.nbytes
    top5 = [[set(np.argsort(-row)[:5].tolist()) for row in m] for m in (got, exact)]
    assert np.mean([len(a & b) / 5 for a, b in zip(*top5, strict=True)]) >= 0.6
    # built = compressed (the same seeded codebooks), through a folder, the codebook verified
    cfg = _cfg(dtype="pq", pq_dims=2, id_encoding="delta")
    built = build_cache(tiny.net, tiny_shards, cfg, curvature=tiny.curv, out=tmp_path / "pq")
    comp = compress_cache(build_cache(tiny.net, tiny_shards, _cfg(), curvature=tiny.curv), cfg)
    assert np.array_equal(np.asarray(built.sketches.codes), comp.sketches.codes)
    assert np.array_equal(np.asarray(built.sketches.codebook), comp.sketches.codebook)
    back = AttributionCache.load(tmp_path / "pq", shards=tiny_shards)
    assert back.manifest["dtype"] == "pq" and (tmp_path / "pq" / "sketch_codebook.npy").exists()
    assert back.manifest["pq_sample"] == cfg.pq_sample and back.manifest["pq_trained_on"] == back.num_postings
    assert torch.equal(back.scores(tiny.q, tiny.Q), comp.scores(tiny.q, tiny.Q))
    f = tmp_path / "pq" / "sketch_codebook.npy"
    good = f.read_bytes()
    f.write_bytes(good[:-8] + bytes(8))
    with pytest.raises(ArtifactCorrupt, match="sketch_codebook"):
        AttributionCache.load(tmp_path / "pq")
    f.write_bytes(good)
    with pytest.raises(ConfigError, match="AttributionConfig.pq_dims"):  # refused before any pass over the data
        build_cache(tiny.net, tiny_shards, _cfg(dtype="pq", pq_dims=3), curvature=tiny.curv)


def test_compact_cache_on_disk_round_trip_verified_and_memory_mapped(tiny, tiny_shards, tmp_path):
    cfg = _cfg(dtype="int4", prune=0.05, aggregate="document", id_encoding="delta")
    mem = build_cache(tiny.net, tiny_shards, cfg, curvature=tiny.curv)
    build_cache(tiny.net, tiny_shards, cfg, curvature=tiny.curv, out=tmp_path / "c")
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert files == [
        "curvature.safetensors",
        "ids_exc_pos.npy",
        "ids_exc_val.npy",
        "ids_gap.npy",
        "manifest.json",
        "offsets.npy",
        "projection.npy",
        "sketch_codes.npy",
        "sketch_scale.npy",
        "units.npy",
    ]
    assert not (tmp_path / "c.build").exists() and not (tmp_path / "c.tmp").exists()
    back = AttributionCache.load(tmp_path / "c", shards=tiny_shards)
    for a in (back.ids.gaps, back.sketches.codes, back.sketches.scales, back.units_of):
        assert isinstance(a, np.memmap)
    assert torch.equal(back.scores(tiny.q, tiny.Q), mem.scores(tiny.q, tiny.Q))
    assert np.array_equal(back.seq, mem.seq)
    m = back.manifest
    assert (m["dtype"], m["prune"], m["aggregate"], m["id_encoding"]) == ("int4", 0.05, "document", "delta")
    arrays = sum(
        (tmp_path / "c" / f).stat().st_size - 128
        for f in (
            "ids_gap.npy",
            "ids_exc_pos.npy",
            "ids_exc_val.npy",
            "sketch_codes.npy",
            "sketch_scale.npy",
            "units.npy",
        )
    )  # the .npy headers are 128 bytes
    assert m["bytes_postings"] == arrays and m["bytes_per_token"] == pytest.approx(arrays / m["tokens"])
    # saving an in-memory cache writes the same files
    mem.save(tmp_path / "m")
    assert torch.equal(AttributionCache.load(tmp_path / "m").scores(tiny.q, tiny.Q), mem.scores(tiny.q, tiny.Q))
    # int3 codes (a bit stream, ⌈3r/8⌉ bytes a posting) round-trip through the folder as well
    c3 = build_cache(
        tiny.net, tiny_shards, _cfg(dtype="int3", id_encoding="delta"), curvature=tiny.curv, out=tmp_path / "c3"
    )
    back3 = AttributionCache.load(tmp_path / "c3", shards=tiny_shards)
    assert back3.manifest["dtype"] == "int3" and back3.sketches.codes.shape[1] == (3 * back3.r + 7) // 8
    assert torch.equal(back3.scores(tiny.q, tiny.Q), c3.scores(tiny.q, tiny.Q))
    assert not torch.equal(back3.scores(tiny.q, tiny.Q), back.scores(tiny.q, tiny.Q))
    # attribute() ranks documents, each shown through its first sequence
    res = attribute(
        tiny.ckpt.model,
        tiny.tok,
        "The President said",
        QuerySpec(answer=" that the"),
        source=back,
        shards=tiny_shards,
        search=SearchSpec(top=3),
    )
    p_ids, c_ids = tiny.tok.encode("The President said"), tiny.tok.encode(" that the")
    s = back.scores(query_gradients(tiny.ckpt.model, [([tiny.tok.eot_id] + p_ids + c_ids, 1 + len(p_ids))]), 1)[0]
    order = np.lexsort((np.arange(back.num_train), -s.numpy()))[:3]
    assert [it.doc_index for it in res.top] == order.tolist()
    assert [it.sequence for it in res.top] == [int(np.searchsorted(back.units_of, d)) for d in order]
    assert res.num_train == back.num_train and any("document" in n for n in res.notes)
    # a flipped or truncated byte of any posting file is refused by name
    for name in ("sketch_codes.npy", "ids_gap.npy", "sketch_scale.npy"):
        f = tmp_path / "c" / name
        good = f.read_bytes()
        bad = bytearray(good)
        bad[-3] ^= 0x04
        f.write_bytes(bytes(bad))
        with pytest.raises(ArtifactCorrupt, match=name.replace(".", r"\.") + ".*prism attribute-cache"):
            AttributionCache.load(tmp_path / "c")
        f.write_bytes(good[: len(good) // 2])
        with pytest.raises(ArtifactCorrupt, match=name.replace(".", r"\.")):
            AttributionCache.load(tmp_path / "c")
        f.write_bytes(good)
    AttributionCache.load(tmp_path / "c")


def test_format1_cache_loads_and_a_newer_one_is_refused(tiny, tiny_shards, tmp_path):
    c = build_cache(tiny.net, tiny_shards, _cfg(), curvature=tiny.curv, out=tmp_path / "c")
    want = c.scores(tiny.q, tiny.Q)
    mpath = tmp_path / "c" / "manifest.json"
    m = json.loads(mpath.read_text())
    v1 = {k: v for k, v in m.items() if k not in ("prune", "aggregate", "id_encoding", "units")}
    v1["format_version"] = 1
    mpath.write_text(json.dumps(v1))  # what a format-1 build wrote
    old = AttributionCache.load(tmp_path / "c")
    assert old.aggregate == "sequence" and old.num_train == N_SEQ
    assert torch.equal(old.scores(tiny.q, tiny.Q), want)
    for change in ({"format_version": 3}, {"id_encoding": "varint"}, {"dtype": "int2"}):
        mpath.write_text(json.dumps({**m, **change}))
        with pytest.raises(ArtifactError, match=r"manifest\.json.*prism attribute-cache"):
            AttributionCache.load(tmp_path / "c")
    mpath.write_text(json.dumps(m))
    # a format-2 cache whose arrays disagree in length is refused too
    np.save(tmp_path / "c" / "offsets.npy", np.asarray(c.offsets) + 1)
    m["files"].update(file_records(tmp_path / "c", ["offsets.npy"]))
    mpath.write_text(json.dumps(m))
    with pytest.raises(ArtifactCorrupt, match="disagree"):
        AttributionCache.load(tmp_path / "c")


def test_built_compact_equals_compressed_and_lossy_parts_do_not_merge(tiny, tiny_shards, tmp_path):
    plain = build_cache(tiny.net, tiny_shards, _cfg(), curvature=tiny.curv)
    cfg = _cfg(dtype="int8", prune=0.1, id_encoding="delta")
    built = build_cache(tiny.net, tiny_shards, cfg, curvature=tiny.curv, out=tmp_path / "b")
    comp = compress_cache(plain, cfg)
    assert np.array_equal(built.offsets, comp.offsets) and np.array_equal(built.seq, comp.seq)
    assert np.array_equal(np.asarray(built.sketches.codes), comp.sketches.codes)
    assert np.array_equal(np.asarray(built.sketches.scales), comp.sketches.scales)
    assert built.manifest["bytes_postings"] == comp.manifest["bytes_postings"]
    parts = [build_cache(tiny.net, tiny_shards, cfg, curvature=tiny.curv, part=(i, 2)) for i in range(2)]
    with pytest.raises(ArtifactError, match="merge them, then compress"):
        merge_caches(parts)
    # lossless parts with delta ids merge into the single pass
    lp = [
        build_cache(tiny.net, tiny_shards, _cfg(id_encoding="delta"), curvature=tiny.curv, part=(i, 2))
        for i in range(2)
    ]
    merged = merge_caches(lp, out=tmp_path / "merged")
    assert merged.manifest["id_encoding"] == "delta"
    # every manifest entry is one CacheManifest declares (built, compressed, merged, saved)
    from prismlm.tda.cache.manifest import CacheManifest

    declared = CacheManifest.__optional_keys__
    for c in (plain, built, comp, merged):
        assert set(c.manifest) <= declared, set(c.manifest) - declared
    assert set(plain.manifest) | {"files", "compressed_from", "merged_from"} >= declared - {
        "id_width",
        "id_exceptions",
        "scale_unit",
        "pq_dims",
        "pq_sample",
        "pq_trained_on",
        "postings_raw",
        "postings_aggregated",
        "pruned",
    }
    assert np.array_equal(merged.seq, plain.seq) and torch.equal(
        merged.scores(tiny.q, tiny.Q), plain.scores(tiny.q, tiny.Q)
    )


def test_fit_ranges_spread_over_the_corpus():
    """Whole batches of the batch grid, spread from the first to the last (the postings pass's batches)."""
    assert fit_ranges(100, 30, 10) == [(0, 10), (40, 50), (90, 100)]  # grid batches 0, round(4.5) = 4, 9
    assert fit_ranges(100, 200, 10) == [(0, 100)]
    assert fit_ranges(25, 24, 10) == [(0, 25)]  # batches 0, 1, 2 (the last one partial): joined
    assert fit_ranges(1000, 64, 16) == [(0, 16), (336, 352), (656, 672), (992, 1000)]  # batches 0, 21, 41, 62
    assert all(a % 16 == 0 for a, _ in fit_ranges(12345, 1024, 16))


def test_pca_bases_by_hand():
    """Per-prototype bases are the top eigenvectors of each moment; a prototype seen fewer than r times
    gets the summed moment's."""
    C = np.zeros((3, 3, 3))
    C[0] = np.diag([1.0, 5.0, 2.0])
    C[1] = np.diag([9.0, 1.0, 3.0])
    C[2] = np.diag([0.0, 0.0, 100.0])
    B = pca_bases(C, 2, count=np.array([10, 10, 1]))
    assert np.allclose(np.abs(B[0]), [[0, 1, 0], [0, 0, 1]]) and np.allclose(np.abs(B[1]), [[1, 0, 0], [0, 0, 1]])
    assert np.allclose(np.abs(B[2]), np.abs(pca_bases(C.sum(0), 2)))  # diag(10, 6, 105): axes 2, 0
    assert np.allclose(np.abs(B[2]), [[0, 0, 1], [1, 0, 0]])
    W = torch.randn(5, 3, dtype=torch.float64)
    proto = torch.tensor([0, 1, 2, 1, 0])
    want = torch.stack([torch.from_numpy(B[p]) @ w for p, w in zip(proto.tolist(), W, strict=True)])
    torch.testing.assert_close(project(W, proto, torch.from_numpy(B), chunk=2), want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("mode", ["shared", "exact"])
@pytest.mark.parametrize("local", [False, True])
def test_posting_sketcher_is_R_times_inverse_square_root_of_H(mode, local):
    """The postings pass's folded map equals R_i H_i^{-1/2} g row by row, with H_i^{-1/2} from an
    eigendecomposition of the block H_i built from the raw statistics (damping and the reconstruction
    term included): in float64 to rounding, in float32 to float32 rounding."""
    from prismlm.tda.influence import Curvature

    g = torch.Generator().manual_seed(0)
    K, d, r, n = 4, 6, 3, 40
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    F = A @ A.T / d
    blocks = None
    if mode == "exact":
        Bk = torch.randn(K, d, d, generator=g, dtype=torch.float64)
        blocks = Bk @ Bk.transpose(1, 2) / d
    cur = Curvature.from_stats(
        F,
        torch.tensor([0.5, 0.2, 0.0, 0.3], dtype=torch.float64),
        100,
        damping=0.1,
        blocks=blocks,
        rec=torch.tensor([0.1, 0.0, 0.3, 0.2], dtype=torch.float64),
        reconstruction=1.0,
    )
    R = torch.randn(*((K,) if local else ()), r, d, generator=g, dtype=torch.float64)
    proto = torch.randint(0, K, (n,), generator=g)
    G = torch.randn(n, d, generator=g, dtype=torch.float64)

    def inv_sqrt(i: int) -> torch.Tensor:  # H_i from the raw statistics (spec §3.3), not from Curvature
        m_i = max(float(cur.m[i]), 1.0 / cur.tokens)
        S = blocks[i] if blocks is not None and cur.m[i] > 0 else m_i * F
        eye = torch.eye(d, dtype=torch.float64)
        H = S + 0.1 * torch.trace(S) / d * eye + float(cur.rec[i]) * eye
        lam, Q = torch.linalg.eigh(H)
        return (Q * lam.rsqrt()) @ Q.T

    want = torch.stack([(R[p] if local else R) @ inv_sqrt(p) @ G[j] for j, p in enumerate(proto.tolist())])
    torch.testing.assert_close(PostingSketcher(cur, R, torch.float64)(proto, G), want, rtol=1e-10, atol=1e-12)
    got32 = PostingSketcher(cur, R, torch.float32)(proto, G.float())
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=1e-4, atol=1e-5)


def test_pca_local_is_exact_at_full_rank_and_sketches_per_prototype(tiny, tiny_shards, tmp_path):
    full = FullGradients.build(tiny.net, tiny_shards, max_sequences=N_SEQ, batch_size=8)
    S = full.scores(tiny.q, tiny.Q)
    cfg = AttributionConfig(
        max_sequences=N_SEQ, batch_size=8, projection="pca-local", dtype="float64", pca_sequences=N_SEQ
    )
    c = build_cache(tiny.net, tiny_shards, cfg, curvature=full.curvature, out=tmp_path / "c")
    d, K = tiny.net.config.n_embd, tiny.net.prototypes.num_prototypes
    assert c.projection.shape == (K, d, d)
    torch.testing.assert_close(c.scores(tiny.q, tiny.Q), S, rtol=1e-9, atol=1e-9 * float(S.abs().max()))
    # r < d: each posting's sketch is its own prototype's basis times its whitened gradient
    small = build_cache(tiny.net, tiny_shards, AttributionConfig(**{**cfg.to_dict(), "r": 4}), curvature=full.curvature)
    assert small.projection.shape == (K, 4, d) and small.r == 4
    tr = full.train
    w = full.curvature.apply(tr.proto, tr.grad.double(), -0.5).numpy()  # (rows, d), ordered by (seq, proto)
    proto = np.repeat(np.arange(K), np.diff(small.offsets))
    key_cache = proto * N_SEQ + small.seq
    key_full = tr.proto.numpy() * N_SEQ + tr.seq.numpy()
    order = np.argsort(key_full)
    assert np.array_equal(key_full[order], key_cache)
    want = np.einsum("nd,nrd->nr", w[order], small.projection[proto])
    np.testing.assert_allclose(np.asarray(small.sketch), want, rtol=1e-10, atol=1e-12 * np.abs(want).max())
