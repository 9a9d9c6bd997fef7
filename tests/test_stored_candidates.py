"""Stored candidates (``build_stored_candidates``): each stored row's c most likely tokens, ranked once, so the
candidate KL of the stages on stored activations (``loss.kl_candidates``) never forms the (rows × V) product —
checked against an independent full forward, read by stage 2 and the bank stage with the same numbers as the
per-step ranking, refused when damaged or made by another head, and made by the retrofit."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from test_stage2 import _hf_llama, _retrofit, dense_run  # noqa: F401 (dense_run: a fixture)

from prismlm.config import PrototypeConfig, RunConfig
from prismlm.errors import ArtifactCorrupt, ArtifactError, ArtifactMismatch, ConfigError
from prismlm.model import PrismLM
from prismlm.model.stored_activations import (
    CANDIDATES_FILE,
    CANDIDATES_MANIFEST,
    build_stored_candidates,
    build_stored_z,
    open_stored_z,
)
from prismlm.train.bank_stage import bank_losses
from prismlm.train.sampler import SequenceSampler
from prismlm.train.stage2 import stage2_step
from prismlm.train.state import build_optimizer, set_trainable, trainable_names


@pytest.fixture
def prism_and_store(tiny_shards, tmp_path):
    """A tiny 3-layer PRISM model and its float32 store of 12 training sequences with block 2's input."""
    torch.manual_seed(0)
    cfg = RunConfig.from_name("tiny").override(
        {"model.n_layer": 3, "model.prototypes": {"num_prototypes": 16, "top_k": 4}, "model.dropout": 0.0}
    )
    model = PrismLM(cfg.model).eval()
    with torch.no_grad():  # an untrained head ranks the same few tokens first everywhere: spread the rows' tops
        model.lm_head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    store = build_stored_z(
        model, tiny_shards, tmp_path / "z", dtype="float32", batch_size=4, max_sequences=12, boundary_layer=2,
        progress=False,
    )  # fmt: skip
    return cfg, model, store


def test_stored_candidates_are_the_full_forwards_top_tokens_and_are_made_once(prism_and_store, tiny_shards):
    cfg, model, store = prism_and_store
    T = cfg.model.block_size
    assert store.candidates is None and not store.candidates_for(4, model.lm_head)
    store = build_stored_candidates(store, model.lm_head, 4, batch_rows=100, progress=False)
    assert store.candidates_for(4, model.lm_head) and store.candidates_for(2, model.lm_head)
    assert not store.candidates_for(5, model.lm_head)  # fewer stored per row than asked: rank on the fly
    ids = np.array([0, 7, 11])
    with torch.no_grad():  # independent: the model's own forward on the token ids, not the stored z
        logits = model(torch.from_numpy(tiny_shards.train.sequences(ids, T)[:, :-1])).logits.reshape(len(ids) * T, -1)
    got = store.candidate_ids(ids, 4)
    assert got.shape == (len(ids) * T, 4) and got.dtype == torch.int64
    assert torch.equal(got, logits.topk(4, dim=-1).indices)  # most likely first
    assert torch.equal(store.candidate_ids(ids, 2), got[:, :2])
    # kept as they are for a smaller c; made again for a larger one
    before = (store.path / CANDIDATES_FILE).stat().st_mtime_ns
    assert (
        build_stored_candidates(store, model.lm_head, 3, progress=False).candidate_manifest == store.candidate_manifest
    )
    assert (store.path / CANDIDATES_FILE).stat().st_mtime_ns == before
    wider = build_stored_candidates(store, model.lm_head, 6, progress=False)
    assert wider.candidates is not None and wider.candidates.shape == (12 * T, 6)
    with pytest.raises(ConfigError, match="`candidates` must be >= 1"):
        build_stored_candidates(wider, model.lm_head, 0, progress=False)


def test_damaged_foreign_or_half_made_candidates_are_never_read(prism_and_store):
    cfg, model, store = prism_and_store
    store = build_stored_candidates(store, model.lm_head, 4, progress=False)
    path = store.path
    with pytest.raises(ArtifactError, match="call candidates_for"):
        open_stored_z(path).candidate_ids(np.array([0]), 4)  # not checked yet
    other = copy.deepcopy(model.lm_head)
    with torch.no_grad():
        other.weight[3] += 1.0
    with pytest.raises(ArtifactMismatch, match="ranked by another model's head"):
        open_stored_z(path).candidates_for(4, other)
    raw = bytearray((path / CANDIDATES_FILE).read_bytes())
    raw[40:44] = (int.from_bytes(raw[40:44], "little") ^ 1).to_bytes(4, "little")
    (path / CANDIDATES_FILE).write_bytes(bytes(raw))
    with pytest.raises(ArtifactCorrupt, match="does not match its sha256"):
        open_stored_z(path).candidates_for(4, model.lm_head)
    # a pass killed before its manifest: the file is not read, and the next pass makes it again
    (path / CANDIDATES_MANIFEST).unlink()
    assert open_stored_z(path).candidates is None
    assert build_stored_candidates(open_stored_z(path), model.lm_head, 4, progress=False).candidates_for(
        4, model.lm_head
    )


def _one_step(cfg: RunConfig, model: PrismLM, store, layer: int) -> tuple[dict[str, float], PrismLM]:
    model = copy.deepcopy(model).train()
    set_trainable(model, trainable_names(model, "last-1"))
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    sampler = SequenceSampler(store.num_sequences, 4, 1, 1, 0)
    return stage2_step(model, optimizer, store, layer, cfg, sampler, 0, torch.device("cpu")), model


def test_stage2_and_the_bank_stage_read_stored_candidates_with_the_same_numbers(prism_and_store, tmp_path):
    cfg, model, store = prism_and_store
    cfg = cfg.override(
        {"loss.kl_candidates": 3, "loss.lambda_proto_kl": 1.0, "train.trainable": "last-1", "train.batch_size": 4}
    )
    plain = open_stored_z(shutil.copytree(store.path, tmp_path / "plain"))
    ranked = build_stored_candidates(store, model.lm_head, 5, progress=False)
    assert ranked.candidates_for(3, model.lm_head)
    union = ranked.candidate_ids(np.arange(12), 3).unique().numel()
    assert 3 < union < cfg.model.vocab_size  # a real restriction, and rows that differ
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    want, m_plain = _one_step(cfg, model, plain, 2)
    assert calls  # ranked on the fly: the (N, V) product of the source
    calls.clear()
    got, m_ranked = _one_step(cfg, model, ranked, 2)
    assert not calls  # read from the store: no product with the whole vocabulary
    for k in ("source_kl", "proto_kl", "rec", "loss"):
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    for (name, a), b in zip(m_plain.named_parameters(), m_ranked.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    # the bank stage's prototype-only KL on ranked candidates equals its on-the-fly ranking
    z = ranked.hidden(np.arange(4)).reshape(-1, cfg.model.n_embd)
    ids = ranked.candidate_ids(np.arange(4), 3)
    on_the_fly = bank_losses(model, z, proto_kl_rows=64, candidates=3)["proto_kl"]
    stored = bank_losses(model, z, proto_kl_rows=64, candidates=3, candidate_ids=ids)["proto_kl"]
    assert float(stored) == pytest.approx(float(on_the_fly), rel=1e-6)
    shuffled = bank_losses(model, z, proto_kl_rows=64, candidates=3, candidate_ids=ids.roll(1, 0))["proto_kl"]
    assert float(shuffled) != pytest.approx(float(on_the_fly), rel=1e-4)  # the rows' own ids are what count


def test_the_retrofit_ranks_the_candidates_once_after_its_z_pass(dense_run, tmp_path):  # noqa: F811
    _retrofit(dense_run, tmp_path / "r", "loss.lambda_proto_kl=1.0", "loss.kl_candidates=4", steps=4, frozen=2)
    manifest = json.loads((tmp_path / "r" / "stored-z" / CANDIDATES_MANIFEST).read_text())
    assert manifest["candidates"] == 4
    assert open_stored_z(tmp_path / "r" / "stored-z").candidates is not None


def test_stage2_terms_on_ranked_ids_equal_the_on_the_fly_ranking_on_a_llama_backbone():
    """``stage2_losses`` with ranked ids on a model built outside a run (the llama backbone of the stage-2
    tests): equal terms with and without them."""
    from prismlm.train.stage2 import stage2_losses

    model = _hf_llama(prototypes=PrototypeConfig(num_prototypes=16, top_k=4))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.backbone_outputs(x, output_hidden_states=True)
        assert out.hidden_states is not None
        ids = model.lm_head(out.z.reshape(-1, 32)).topk(6, -1).indices
    a = stage2_losses(model, out.hidden_states[1], out.z, 1, proto_kl=True, candidates=4)
    b = stage2_losses(model, out.hidden_states[1], out.z, 1, proto_kl=True, candidates=4, candidate_ids=ids)
    for k in ("source_kl", "proto_kl", "proto_top1"):
        assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-6), k
