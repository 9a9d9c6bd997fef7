"""The index's uniform sample of each prototype's firings (``prismlm.explain.activation_sample``): exactly the
S largest hash keys of every active (offset, prototype) pair, as a brute-force pass over the model's outputs
finds them; the same after merging parts or resuming; saved and loaded; an index without it still loads and
the Prototype view falls back; the view's activation intervals hold what they say."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from prismlm import RunConfig
from prismlm.app.prototype_view import RANK_NOTE, example_bands
from prismlm.errors import ArtifactError
from prismlm.explain import IndexSettings, PrototypeIndex, build_index, merge_indexes
from prismlm.explain.activation_sample import ActivationSample, sample_key, top_s
from prismlm.model import PrismLM
from prismlm.train.state import round_vocab

S = 5  # small against the firings of most prototypes (tens), so the cut matters
SETTINGS = dict(top_n=4, batch_size=3, max_sequences=10, sample_size=S)
KW = dict(progress=False, model_sha256="test")
U64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """splitmix64's output function on Python ints (the published constants), the reference for the hash."""
    z = (x + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def _ref_key(offset: int, proto: int) -> int:
    v = _splitmix64(_splitmix64(offset) ^ proto)
    return v - (1 << 64) if v >= 1 << 63 else v  # as int64


@pytest.fixture(scope="module")
def model(tiny_shards):
    cfg = RunConfig.from_name("tiny").override({"model.vocab_size": round_vocab(tiny_shards.tokenizer.vocab_size)})
    torch.manual_seed(0)
    return PrismLM(cfg.model).eval()


@pytest.fixture(scope="module")
def full(model, tiny_shards):
    return build_index(model, tiny_shards, IndexSettings(**SETTINGS), **KW)


def _brute_force_sample(model, shards, n_seq: int, batch: int, size: int) -> dict[int, list[tuple[int, float, int]]]:
    """Per prototype, the (offset, a, key) of its ``size`` largest-key firings, from every (B, T, k) slot of
    the model's outputs over the same batches, one pair at a time."""
    T = model.config.block_size
    fired: dict[int, list[tuple[int, float, int]]] = {}
    for j0 in range(0, n_seq, batch):
        ids = np.arange(j0, min(n_seq, j0 + batch))
        x = torch.from_numpy(shards.train.sequences(ids, T)[:, :-1])
        with torch.no_grad():
            out = model(x)
        for b, j in enumerate(ids.tolist()):
            for t in range(T):
                for i, a in zip(out.indices[b, t].tolist(), out.activations[b, t].float().tolist()):
                    if a > 0:
                        off = j * T + t
                        fired.setdefault(i, []).append((off, a, _ref_key(off, i)))
    return {i: sorted(v, key=lambda r: (-r[2], r[0]))[:size] for i, v in fired.items()}


def _rows(sample: ActivationSample) -> dict[int, list[tuple[int, float, int]]]:
    K = sample.key.shape[0]
    out = {}
    for i in range(K):
        filled = sample.offset[i] >= 0
        if bool(filled.any()):
            out[i] = list(
                zip(sample.offset[i][filled].tolist(), sample.act[i][filled].tolist(), sample.key[i][filled].tolist())
            )
    return out


def _same(a: ActivationSample, b: ActivationSample) -> bool:
    return all(torch.equal(x, y) for x, y in zip((a.key, a.offset, a.act), (b.key, b.offset, b.act)))


def test_hash_is_splitmix64_bit_for_bit():
    offs = [0, 1, 2, 63, 64, 12345678901234, (1 << 40) + 7, (1 << 62) + 3]
    ids = [0, 5, 3, 1000, 7, 1 << 20, 63, 1]
    got = sample_key(torch.tensor(offs), torch.tensor(ids)).tolist()
    assert got == [_ref_key(o, i) for o, i in zip(offs, ids)]


def test_sample_equals_brute_force_top_keys(model, tiny_shards, full):
    """Every prototype's sample is the S largest keys of all its firings (offset, activation exact); the
    prototypes that fired fewer than S times keep all of them."""
    ref = _brute_force_sample(model, tiny_shards, 10, 3, S)
    got = _rows(full.sample)
    assert got == ref
    filled = (full.sample.offset >= 0).sum(1)
    assert torch.equal(filled, full.counts.clamp(max=S))
    assert int((full.counts > S).sum()) > 10  # the cut at S is exercised
    assert full.manifest["sample_size"] == S


def test_top_s_is_a_uniform_sample():
    """4000 firings of each of 50 prototypes, keep 100 each: the kept offsets spread evenly over the range
    (chi-square over 10 deciles) and their activations are unbiased (a = offset here)."""
    K, n, s = 50, 4000, 100
    off = torch.arange(n).repeat(K)
    proto = torch.arange(K).repeat_interleave(n)
    key = sample_key(off, proto)
    t_key, t_off, t_act = top_s(proto, key, off, off.float(), K, s)
    assert bool((t_off >= 0).all()) and all(len(set(r)) == s for r in t_off.tolist())  # without replacement
    counts = np.bincount((t_off.reshape(-1) * 10 // n).numpy(), minlength=10)
    expected = K * s / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, counts  # 9 degrees of freedom, p = 0.001
    assert abs(float(t_act.mean()) - (n - 1) / 2) < 3 * n / np.sqrt(12 * K * s)  # 3 standard errors
    assert torch.equal(t_key, t_key.sort(dim=1, descending=True).values)


def test_merged_parts_and_resumed_build_equal_one_pass(model, tiny_shards, full, tmp_path):
    parts = [build_index(model, tiny_shards, IndexSettings(**SETTINGS, part=(i, 3)), **KW) for i in range(3)]
    merged = merge_indexes([parts[1], parts[2], parts[0]])
    assert _same(merged.sample, full.sample) and merged.manifest["sample_size"] == S
    out = tmp_path / "partial"
    build_index(model, tiny_shards, IndexSettings(**SETTINGS), out=out, stop_after_batches=2, **KW)
    assert PrototypeIndex.load(out).manifest["covered"] == [[0, 6]]
    resumed = build_index(model, tiny_shards, IndexSettings(**SETTINGS), resume_from=out, out=out, **KW)
    assert resumed.complete and _same(resumed.sample, full.sample)
    with pytest.raises(ArtifactError, match="cannot resume.*sample_size=7"):
        build_index(model, tiny_shards, IndexSettings(**{**SETTINGS, "sample_size": 7}), resume_from=out, **KW)
    old = build_index(model, tiny_shards, IndexSettings(**{**SETTINGS, "sample_size": 0}, part=(0, 3)), **KW)
    assert old.sample is None and merge_indexes([old, parts[1], parts[2]]).sample is None  # no partial sample


def test_sample_round_trips_and_an_index_without_it_loads(model, tiny_shards, full, tmp_path):
    full.save(tmp_path / "new")
    back = PrototypeIndex.load(tmp_path / "new", shards=tiny_shards)
    assert _same(back.sample, full.sample) and back.sample.act.dtype == torch.float32
    # an index written before the sample: no tables, no sample_size in its manifest
    old = PrototypeIndex.load(tmp_path / "new")
    old.sample = None
    old.manifest.pop("sample_size")
    old.save(tmp_path / "old")
    loaded = PrototypeIndex.load(tmp_path / "old", shards=tiny_shards)
    assert loaded.sample is None
    i = int(loaded.counts.argmax())
    bands = example_bands(loaded, i)
    assert [b["band"] for b in bands] == ["top", "middle", "bottom"]
    assert all(b["kind"] == "rank" and b["note"] == RANK_NOTE for b in bands)
    with pytest.raises(ArtifactError, match="activation sample tables"):
        ActivationSample.from_tensors({"sample_key": full.sample.key}, full.num_prototypes, S, "X")


def test_example_bands_are_activation_intervals_of_the_sample(tiny_shards, full):
    full.attach(tiny_shards)
    shard = tiny_shards.train
    checked = 0
    for i in (full.counts > 0).nonzero().squeeze(1).tolist():
        bands = example_bands(full, i, per_band=2)
        offs, acts = full.sample.row(i)
        sample = dict(zip(offs, acts))
        assert len(bands) == 4 and all(b["kind"] == "activation" for b in bands)
        assert sum(b["count"] for b in bands) == len(offs) == min(S, int(full.counts[i])) == bands[0]["sampled"]
        assert bands[0]["interval"][1] == max(acts) and bands[-1]["interval"][0] == 0.0
        assert all(a["interval"][0] == b["interval"][1] for a, b in zip(bands, bands[1:]))  # contiguous, high first
        for b in bands:
            lo, hi = b["interval"]
            assert b["count"] == sum(lo < a <= hi for a in acts)
            assert len(b["examples"]) == min(2, b["count"])
            for e in b["examples"]:
                assert lo < e["activation"] <= hi and sample[e["offset"]] == e["activation"]
                assert e["target_id"] == int(shard.tokens[e["offset"] + 1])  # the marked token follows the context
        checked += 1
    assert checked > 20
    for i in (full.counts == 0).nonzero().squeeze(1).tolist():  # never fired: nothing to show
        assert example_bands(full, i) == []


def test_prism_verify_accepts_indexes_with_and_without_the_sample(tiny_shards, tmp_path):
    def cli(*args: object):
        from prismlm.cli import app

        return CliRunner().invoke(app, [str(a) for a in args])

    from prismlm.train import train

    run = tmp_path / "run"
    cfg = RunConfig.from_name("tiny").override(
        {"train.max_steps": 2, "train.eval_interval": 1000, "train.batch_size": 2, "train.warmup_steps": 1}
    )
    train(cfg, run, shards=tiny_shards, progress=False)
    shards = ["--shards", tiny_shards.root]
    index = ["--max-sequences", "6", "--batch-size", "3", "--no-progress", "--top-n", "4"]
    assert cli("index", run, *index, *shards).exit_code == 0
    idx = PrototypeIndex.load(run / "index")
    assert idx.sample is not None and idx.manifest["sample_size"] == 64
    res = cli("verify", run, *shards)
    assert res.exit_code == 0 and str(run / "index") in res.output, res.output
    idx.sample = None
    idx.manifest.pop("sample_size")
    idx.save(run / "index")
    res = cli("verify", run, *shards)
    assert res.exit_code == 0 and str(run / "index") in res.output, res.output
