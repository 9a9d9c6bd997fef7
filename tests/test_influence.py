"""Prototype-space influence, the postings cache, baselines and ground truth: identities in float64."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import train_tiny_run

from prismlm import AttributionConfig, RunConfig
from prismlm.artifacts import model_identity
from prismlm.errors import ArtifactError, ArtifactMismatch
from prismlm.tda.attribute import QuerySpec as Q
from prismlm.tda.attribute import SearchSpec as S
from prismlm.tda.attribute import attribute
from prismlm.tda.cache import AttributionCache, build_cache, merge_caches
from prismlm.tda.gradients import BlockGradients, block_gradients
from prismlm.tda.influence import (
    FullGradients,
    collect_gradients,
    curvature_pass,
    influence_scores,
    query_gradients,
    self_influence,
)
from prismlm.train import train

N_SEQ = 24


@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    # 150 steps: at 20 the tiny model uses ~6 of its 64 prototypes; at 150 about 20, so block sparsity is real
    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("infl"), steps=150, batch_size=8, warmup_steps=5)


@pytest.fixture(scope="module")
def c64(trained):
    ckpt, _ = trained
    return SimpleNamespace(
        model=copy.deepcopy(ckpt.model).double(), manifest=ckpt.manifest, tokenizer=ckpt.tokenizer, path=ckpt.path
    )


def _queries(tok):
    return [
        ([tok.eot_id] + tok.encode("The President said that the"), 3),
        ([tok.eot_id] + tok.encode("We the people of the United States"), 1),
    ]


def test_block_gradients_equal_autograd(c64, tiny_shards):
    """G_{j,i} from the forward output equals autograd w.r.t. P with r_t and a_t held fixed."""
    net = c64.model
    T = net.config.block_size
    x = torch.from_numpy(tiny_shards.train.sequences(np.arange(3), T))
    out = net(x[:, :-1])
    mask = torch.rand(3, T, generator=torch.Generator().manual_seed(0)) > 0.3
    bg = block_gradients(net, out, x[:, 1:], mask)
    P = net.prototypes.weight.detach().clone().requires_grad_(True)
    zhat = torch.einsum("btk,btkd->btd", out.activations.detach(), P[out.indices])
    logits = net.lm_head(out.residual.detach() + zhat)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
    for b in range(3):
        if P.grad is not None:
            P.grad = None
        (ce.view(3, T)[b] * mask[b]).sum().backward(retain_graph=True)
        G = torch.zeros_like(P).index_add_(0, bg.proto[bg.seq == b], bg.grad[bg.seq == b])
        assert torch.allclose(G, P.grad, atol=1e-12)
        # rows exist exactly for the prototypes active (a > 0) in measured tokens
        act = set(out.indices[b][(out.activations[b] > 0) & mask[b][:, None]].tolist())
        assert set(bg.proto[bg.seq == b].tolist()) == act


def test_curvature_matches_brute_force(c64, tiny_shards):
    net = c64.model
    T = net.config.block_size
    cur = curvature_pass(net, tiny_shards, sequences=(0, 2), batch_size=2, exact=True, damping=0.0)
    x = torch.from_numpy(tiny_shards.train.sequences(np.arange(2), T))[:, :-1]
    with torch.no_grad():
        out = net(x)
    W = net.lm_head.weight.detach().double()
    pi = torch.softmax(out.logits.reshape(-1, W.shape[0]), -1)
    Sig = torch.diag_embed(pi) - pi[:, :, None] * pi[:, None, :]  # (N, V, V)
    GN = torch.einsum("vd,nvw,we->nde", W, Sig, W)  # (N, d, d)
    assert torch.allclose(cur.F, GN.mean(0), atol=1e-12)
    a = torch.zeros(GN.shape[0], net.prototypes.num_prototypes, dtype=torch.float64)
    a.scatter_(1, out.indices.reshape(-1, out.indices.shape[-1]), out.activations.reshape(-1, out.indices.shape[-1]))
    blocks = torch.einsum("ni,nde->ide", a**2, GN) / GN.shape[0]
    assert torch.allclose(cur.blocks, blocks, atol=1e-12)
    assert torch.allclose(cur.m, (a**2).mean(0), atol=1e-15)
    # H_i⁻¹ G against torch.linalg.solve on H_i built explicitly from the definitions (not from dense()):
    # shared: H_i = m̃_i F + λ_i I, exact: H_i = E_t[a_i² Wᵀ Σ_t W] + λ_i I, λ_i = ρ·tr(·)/d, m̃_i = max(m_i, 1/N)
    rho, N, d = 0.1, GN.shape[0], GN.shape[1]
    m_eff = torch.clamp((a**2).mean(0), min=1.0 / N)
    eye = torch.eye(d, dtype=torch.float64)
    sh = curvature_pass(net, tiny_shards, sequences=(0, 2), batch_size=2, damping=rho)
    ex = curvature_pass(net, tiny_shards, sequences=(0, 2), batch_size=2, damping=rho, exact=True)
    used = (a > 0).any(0).nonzero().flatten()
    ids = torch.cat([used[:3], (a == 0).all(0).nonzero().flatten()[:1]])  # seen prototypes and an unseen one
    g = torch.randn(len(ids), d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for c, H in (
        (sh, [m_eff[i] * GN.mean(0) + rho * m_eff[i] * torch.trace(GN.mean(0)) / d * eye for i in ids]),
        (
            ex,
            [
                blocks[i] + rho * torch.trace(blocks[i]) / d * eye
                if (a[:, i] > 0).any()
                else m_eff[i] * (GN.mean(0) + rho * torch.trace(GN.mean(0)) / d * eye)
                for i in ids
            ],
        ),
    ):
        want = torch.stack([torch.linalg.solve(H[r], g[r]) for r in range(len(ids))])
        torch.testing.assert_close(c.apply(ids, g, -1.0), want, rtol=1e-8, atol=1e-9 * float(want.abs().max()))
        torch.testing.assert_close(
            c.apply(ids, g, 1.0), torch.stack([H[r] @ g[r] for r in range(len(ids))]), rtol=1e-9, atol=1e-14
        )


def test_cache_r_equals_d_equals_full_and_self_influence(c64, tiny_shards):
    full = FullGradients.build(c64.model, tiny_shards, max_sequences=N_SEQ, batch_size=5)
    q = query_gradients(c64.model, _queries(c64.tokenizer))
    S = full.scores(q, 2)
    for proj in ("identity", "orthogonal", "pca"):
        cache = build_cache(
            c64.model,
            tiny_shards,
            AttributionConfig(max_sequences=N_SEQ, batch_size=5, projection=proj, dtype="float64"),
            curvature=full.curvature,
        )
        assert torch.allclose(cache.scores(q, 2), S, rtol=1e-10, atol=1e-9)
    # self-influence = diagonal of pairwise train × train
    tr = full.train
    sub = tr.select(tr.seq < 6)
    pair = influence_scores(sub, tr, full.curvature, num_queries=6, num_train=N_SEQ)
    assert torch.allclose(torch.diagonal(pair[:, :6]), full.self_scores()[:6], rtol=1e-12)
    # the exact-block variant is also consistent and the identity variant is the plain dot product
    for mode in ("exact", "identity"):
        f2 = FullGradients.build(c64.model, tiny_shards, max_sequences=N_SEQ, batch_size=5, mode=mode)
        pair = influence_scores(
            f2.train.select(f2.train.seq < 4), f2.train, f2.curvature, num_queries=4, num_train=N_SEQ
        )
        assert torch.allclose(torch.diagonal(pair[:, :4]), f2.self_scores()[:4], rtol=1e-12)


def test_batch_size_and_sharding_invariance(c64, tiny_shards, tmp_path):
    cur = curvature_pass(c64.model, tiny_shards, sequences=(0, N_SEQ), batch_size=4)
    cur7 = curvature_pass(c64.model, tiny_shards, sequences=(0, N_SEQ), batch_size=7)
    assert torch.allclose(cur.F, cur7.F, rtol=1e-12) and torch.allclose(cur.m, cur7.m, rtol=1e-12)
    q = query_gradients(c64.model, _queries(c64.tokenizer))
    opts = dict(max_sequences=N_SEQ, r=16, dtype="float64")
    ref = build_cache(c64.model, tiny_shards, AttributionConfig(batch_size=4, **opts), curvature=cur)
    other = build_cache(c64.model, tiny_shards, AttributionConfig(batch_size=7, **opts), curvature=cur)
    assert np.array_equal(ref.offsets, other.offsets) and np.array_equal(ref.seq, other.seq)
    assert torch.allclose(ref.scores(q, 2), other.scores(q, 2), rtol=1e-10, atol=1e-9)
    parts = [
        build_cache(
            c64.model,
            tiny_shards,
            AttributionConfig(batch_size=4, **opts),
            curvature=cur,
            part=(i, 3),
            out=tmp_path / f"p{i}",
        )
        for i in (2, 0, 1)
    ]
    merged = merge_caches(parts, out=tmp_path / "merged")
    assert np.array_equal(merged.offsets, ref.offsets) and np.array_equal(merged.seq, ref.seq)
    assert np.array_equal(np.asarray(merged.sketch), np.asarray(ref.sketch))
    assert torch.equal(merged.scores(q, 2), ref.scores(q, 2))
    with pytest.raises(ArtifactError, match="overlap"):
        merge_caches([parts[0], parts[0]])
    # full scores do not depend on the batch size either
    g4 = collect_gradients(c64.model, tiny_shards, sequences=(0, N_SEQ), batch_size=4)
    g7 = collect_gradients(c64.model, tiny_shards, sequences=(0, N_SEQ), batch_size=7)
    assert torch.allclose(
        influence_scores(q, g4, cur, num_queries=2, num_train=N_SEQ),
        influence_scores(q, g7, cur, num_queries=2, num_train=N_SEQ),
        rtol=1e-10,
    )


def test_no_shared_prototype_scores_exactly_zero(c64, tiny_shards):
    full = FullGradients.build(c64.model, tiny_shards, max_sequences=N_SEQ, batch_size=8)
    cache = build_cache(
        c64.model, tiny_shards, AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8), curvature=full.curvature
    )
    q = query_gradients(c64.model, _queries(c64.tokenizer)[:1])
    tr = full.train
    # a query whose active prototypes are exactly those training sequence j never activates
    j = int(torch.bincount(tr.seq, minlength=N_SEQ).argmin())
    used = set(tr.proto[tr.seq == j].tolist())
    protos = torch.tensor([p for p in range(c64.model.prototypes.num_prototypes) if p not in used])
    g = torch.randn(len(protos), q.grad.shape[1], dtype=q.grad.dtype, generator=torch.Generator().manual_seed(0))
    qn = BlockGradients(torch.zeros(len(protos), dtype=torch.long), protos, g)
    s_full, s_cache = full.scores(qn, 1)[0], cache.scores(qn, 1)[0]
    assert s_full[j].item() == 0.0 and s_cache[j].item() == 0.0
    others = torch.isin(tr.proto, protos)  # sequences that do share one of them score non-zero
    for k in tr.seq[others].unique().tolist():
        assert s_full[k] != 0 and s_cache[k] != 0
    # and a query with no active prototype scores 0 everywhere
    empty = BlockGradients(
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, q.grad.shape[1], dtype=q.grad.dtype),
    )
    assert torch.count_nonzero(cache.scores(empty, 1)) == 0


def test_cache_round_trip_and_mismatch_refused(trained, tiny_shards, tmp_path):
    ckpt, _ = trained
    cache = build_cache(
        ckpt.model,
        tiny_shards,
        AttributionConfig(max_sequences=N_SEQ, batch_size=8, r=8),
        out=tmp_path / "cache",
        model_sha256=ckpt.manifest["model_sha256"],
    )
    m = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert m["model_sha256"] == ckpt.manifest["model_sha256"] and m["shard_key"] == tiny_shards.manifest["key"]
    assert m["bytes_per_token"] == pytest.approx(m["postings"] * (4 + 8 * 4) / (N_SEQ * 64))
    back = AttributionCache.load(tmp_path / "cache", model_sha256=ckpt.manifest["model_sha256"], shards=tiny_shards)
    assert isinstance(back.sketch, np.memmap)
    q = query_gradients(ckpt.model, _queries(ckpt.tokenizer))
    assert torch.equal(back.scores(q, 2), cache.scores(q, 2))
    with pytest.raises(ArtifactMismatch, match="built for model"):
        AttributionCache.load(tmp_path / "cache", model_sha256="0" * 64)
    other = copy.deepcopy(ckpt.model)
    with torch.no_grad():
        other.prototypes.weight.add_(0.01)
    with pytest.raises(ArtifactMismatch, match="rebuild it"):
        back.check(model_sha256=model_identity(other))
    with pytest.raises(ArtifactMismatch, match="token shards"):
        back.check(shard_key="deadbeef")
    with pytest.raises(ArtifactError, match="no attribution cache"):
        AttributionCache.load(tmp_path / "nowhere")


def test_attribute_api_full_and_cached_agree(trained, tiny_shards):
    ckpt, _ = trained
    net, tok = ckpt.model, ckpt.tokenizer
    full = FullGradients.build(net, tiny_shards, max_sequences=N_SEQ, batch_size=8)
    cache = build_cache(
        net, tiny_shards, AttributionConfig(max_sequences=N_SEQ, batch_size=8), curvature=full.curvature
    )
    a = attribute(
        net, tok, "The President said", Q(answer=" that the"), source=full, shards=tiny_shards, search=S(top=5)
    )
    b = attribute(
        net, tok, "The President said", Q(answer=" that the"), source=cache, shards=tiny_shards, search=S(top=5)
    )
    assert [x.sequence for x in a.top] == [x.sequence for x in b.top]
    assert a.measured_tokens == len(ckpt.tokenizer.encode(" that the"))
    for x in a.top:
        assert (
            sum(p["contribution"] for p in x.prototypes) == pytest.approx(x.score, rel=1e-4) or len(x.prototypes) == 5
        )
        assert "⟦" in x.snippet and x.doc_id is not None
    g = attribute(net, tok, "The", Q(generate=3), source=cache, search=S(top=3))
    assert g.completion and g.measured_tokens == 3 and len(g.top) == 3


def test_planted_facts_rank_top10(tmp_path):
    from prismlm.data.shards import prepare_shards
    from prismlm.tda.planted import build_planted_corpus, relevant_sequences, retrieval_metrics

    pc = build_planted_corpus(tmp_path / "planted", n_facts=4, copies=2, n_background=30, doc_chars=1000, seed=0)
    sh = prepare_shards(str(pc.path), "bpe-512", tmp_path / "shards", val_fraction=0.02, show_progress=False)
    cfg = RunConfig.from_name("tiny").override(
        {"train.max_steps": 60, "train.eval_interval": 1000, "train.batch_size": 8, "train.warmup_steps": 5}
    )
    net = train(cfg, tmp_path / "run", shards=sh, progress=False).model.eval()
    rel = relevant_sequences(pc, sh, net.config.block_size)
    assert sum(len(r) > 0 for r in rel) >= 3
    qs, which = pc.queries(sh.tokenizer)
    q = query_gradients(net, qs)
    full = FullGradients.build(net, sh, batch_size=16)
    m = retrieval_metrics(full.scores(q, len(qs)).numpy(), which, rel, k=10)
    assert m["recall@10"] == 1.0, m
    cache = build_cache(net, sh, AttributionConfig(batch_size=16), curvature=full.curvature)
    assert retrieval_metrics(cache.scores(q, len(qs)).numpy(), which, rel, k=10)["recall@10"] == 1.0


def _linear_grad_dot_products(model, shards, queries, n_train, modules=None):
    """(Q, n_train) Σ over nn.Linear modules of ⟨∇ L_q, ∇ L_j⟩ by torch.autograd: L_j the summed CE of training
    sequence j (all T targets), L_q the summed CE of the query's measured targets ids[measure_from:] only.
    The tied lm_head/wte weight is untied first so that lm_head's gradient is that of its own use only (what
    kronfluence tracks on the lm_head module). ``modules``: only the Linear modules of those names."""
    net = copy.deepcopy(model).float().eval()
    net.transformer.wte.weight = torch.nn.Parameter(net.lm_head.weight.detach().clone())
    params = [
        p
        for n, m in net.named_modules()
        if isinstance(m, torch.nn.Linear) and (modules is None or n in modules)
        for p in m.parameters()
    ]
    T = net.config.block_size

    def grad(ids, measured):
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
        ce = F.cross_entropy(net(x[:, :-1]).logits[0].float(), x[0, 1:], reduction="none")
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad((ce * measured).sum(), params)]).double()

    gq = torch.stack([grad(ids, torch.arange(1, len(ids)) >= s) for ids, s in queries])  # target t = ids[t+1]
    gj = torch.stack([grad(shards.train.sequence(j, T), torch.ones(T, dtype=torch.bool)) for j in range(n_train)])
    return gq @ gj.T


@pytest.mark.slow
def test_kronfluence_ekfac_end_to_end(trained, tiny_shards):
    pytest.importorskip("kronfluence")
    from prismlm.tda.baselines import KronfluenceBaseline

    ckpt, _ = trained
    before = {k: v.clone() for k, v in ckpt.model.state_dict().items()}
    qs = _queries(ckpt.tokenizer)
    for strategy in ("ekfac", "identity"):
        kb = KronfluenceBaseline(ckpt.model, tiny_shards, strategy=strategy, max_sequences=12, batch_size=6)
        S = kb.scores(qs, pad_id=ckpt.tokenizer.eot_id)
        assert S.shape == (2, 12) and torch.isfinite(S).all() and S.abs().max() > 0
        from kronfluence.module.tracked_module import TrackedModule

        tracked = [n for n, m in kb.net.named_modules() if isinstance(m, TrackedModule)]
        assert "lm_head" in tracked and len(tracked) == 4 * ckpt.model.config.n_layer + 1  # every nn.Linear
        kb.close()
        if strategy == "identity":  # no curvature: scores are plain gradient dot products — check them exactly
            torch.testing.assert_close(
                S,
                _linear_grad_dot_products(ckpt.model, tiny_shards, qs, 12),
                rtol=2e-4,
                atol=2e-4 * float(S.abs().max()),
            )
    # the caller's model is untouched (kronfluence rewrites modules of a copy)
    assert all(torch.equal(v, ckpt.model.state_dict()[k]) for k, v in before.items())
    assert type(ckpt.model.lm_head) is torch.nn.Linear


def test_kronfluence_tracks_only_the_named_modules(trained, tiny_shards):
    """``modules``: kronfluence tracks exactly those Linear modules, and its identity scores are the gradient dot
    products over their parameters alone (the last block's, as for a fine-tune of the last blocks)."""
    pytest.importorskip("kronfluence")
    from kronfluence.module.tracked_module import TrackedModule

    from prismlm.tda.baselines import KronfluenceBaseline

    ckpt, _ = trained
    last = ckpt.model.block_prefixes()[-1]
    mods = tuple(
        n for n, m in ckpt.model.named_modules() if isinstance(m, torch.nn.Linear) and (n + ".").startswith(last)
    )
    assert mods and "lm_head" not in mods
    qs = _queries(ckpt.tokenizer)
    kb = KronfluenceBaseline(ckpt.model, tiny_shards, strategy="identity", max_sequences=12, batch_size=6, modules=mods)
    S = kb.scores(qs, pad_id=ckpt.tokenizer.eot_id)
    tracked = {n for n, m in kb.net.named_modules() if isinstance(m, TrackedModule)}
    kb.close()
    assert tracked == set(mods)
    ref = _linear_grad_dot_products(ckpt.model, tiny_shards, qs, 12, modules=set(mods))
    torch.testing.assert_close(S, ref, rtol=2e-4, atol=2e-4 * float(S.abs().max()))
    full = _linear_grad_dot_products(ckpt.model, tiny_shards, qs, 12)
    assert not torch.allclose(S, full, rtol=1e-2)  # the restriction changes the scores


def _autograd_prototype_grad(net, ids, measured):
    """∇_P Σ_{t measured} CE_t by torch.autograd, with r_t and a_t held fixed (spec §3.2): (K, d)."""
    x = torch.as_tensor(ids)[None]
    out = net(x[:, :-1])
    P = net.prototypes.weight.detach().clone().requires_grad_(True)
    logits = net.lm_head(
        out.residual.detach() + torch.einsum("btk,btkd->btd", out.activations.detach(), P[out.indices])
    )
    ce = F.cross_entropy(logits[0], x[0, 1:], reduction="none")
    (g,) = torch.autograd.grad((ce * measured).sum(), P)
    return g


def test_identity_dot_product_matches_autograd_for_one_query(c64, tiny_shards):
    """Identity-mode prototype-space scores equal ⟨∇_P L_q, ∇_P L_j⟩ with both gradients from torch.autograd."""
    net = c64.model
    T = net.config.block_size
    g = collect_gradients(net, tiny_shards, sequences=(0, 4), batch_size=4)
    ((ids, start),) = _queries(c64.tokenizer)[:1]
    q = query_gradients(net, [(ids, start)])
    S = influence_scores(q, g, None, num_queries=1, num_train=4)[0]
    measured = torch.arange(len(ids) - 1) + 1 >= start  # target t is ids[t+1]; targets ids[start:] measured
    Gq = _autograd_prototype_grad(net, ids, measured)
    assert Gq.abs().sum() > 0
    seqs = tiny_shards.train.sequences(np.arange(4), T)
    Gs = [_autograd_prototype_grad(net, seqs[j], torch.ones(T, dtype=torch.bool)) for j in range(4)]
    for j in range(4):
        assert S[j].item() == pytest.approx(float((Gq * Gs[j]).sum()), rel=1e-10, abs=1e-12)
    self_s = self_influence(g, None, 4)
    for j in range(4):
        assert self_s[j].item() == pytest.approx(float((Gs[j] * Gs[j]).sum()), rel=1e-10)


def test_cli_attribute(trained, tiny_shards, tmp_path):
    from typer.testing import CliRunner

    from prismlm.cli import app

    _, run = trained
    r = CliRunner()
    sh = str(tiny_shards.root)
    res = r.invoke(app, ["attribute", str(run), "The President", "--shards", sh])
    assert res.exit_code == 2 and "attribute-cache" in res.output, res.output
    # --overwrite: the run is a module fixture, and another test may have built its cache already
    res = r.invoke(
        app,
        [
            "attribute-cache",
            str(run),
            "--shards",
            sh,
            "--max-sequences",
            "16",
            "--r",
            "8",
            "--batch-size",
            "8",
            "--overwrite",
        ],
    )
    assert res.exit_code == 0 and "bytes/training token" in res.output, res.output
    res = r.invoke(
        app,
        [
            "attribute",
            str(run),
            "The President said that",
            "--completion",
            "2",
            "--top",
            "4",
            "--json",
            str(tmp_path / "a.json"),
            "--html",
            str(tmp_path / "a.html"),
        ],
    )
    assert res.exit_code == 0, res.output
    page = (tmp_path / "a.html").read_text()
    assert "Training data" in page and "<mark>" in page and "http://" not in page
    data = json.loads((tmp_path / "a.json").read_text())
    assert len(data["top"]) == 4 and data["measured_tokens"] == 2 and data["method"] == "cached"
    assert all(x["prototypes"] and "⟦" in x["snippet"] for x in data["top"])
    # the same attribution inside `prism explain`'s report, for a generation's sampled tokens
    res = r.invoke(
        app,
        [
            "explain",
            str(run),
            "The President",
            "--generate",
            "3",
            "--attribute",
            "--shards",
            sh,
            "--json",
            str(tmp_path / "e.json"),
            "--html",
            str(tmp_path / "e.html"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "Training data" in (tmp_path / "e.html").read_text()
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["attribution"]["measured_tokens"] == 3 and data["attribution"]["top"]
    res = r.invoke(
        app,
        [
            "attribute",
            str(run),
            "The",
            "--generate",
            "3",
            "--method",
            "full",
            "--max-sequences",
            "8",
            "--shards",
            sh,
            "--top",
            "2",
        ],
    )
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["attribute", str(run), "x", "--method", "magic"])
    assert res.exit_code == 2 and "--method" in res.output
    res = r.invoke(
        app,
        [
            "attribute-cache",
            str(run),
            "--projection",
            "identity",
            "--r",
            "4",
            "--shards",
            sh,
            "--max-sequences",
            "4",
            "--overwrite",
        ],
    )
    assert res.exit_code == 2 and "r = d" in res.output, res.output
    for cmd in ("attribute", "attribute-cache"):
        assert r.invoke(app, [cmd, "--help"]).exit_code == 0


def test_long_query_is_cropped_keeping_the_measured_tokens(c64, tiny_shards):
    net = c64.model
    T = net.config.block_size
    ids = tiny_shards.train.tokens[: T + 40].astype(np.int64).tolist()  # longer than the context window
    q = query_gradients(net, [(ids, len(ids) - 10)])
    x = torch.tensor(ids[-(T + 1) :])[None]
    out = net(x[:, :-1])
    ce = F.cross_entropy(out.logits[0], x[0, 1:], reduction="none")
    assert q.loss[0].item() == pytest.approx(ce[-10:].sum().item(), rel=1e-12)
