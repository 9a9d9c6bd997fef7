"""The reconstruction term of the prototype-space curvature, the hybrid re-ranker, whole-network gradients
and the TRAK baseline — each against an independent reference (autograd, brute-force ranking)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prismlm import RunConfig
from prismlm.model import PrismLM
from prismlm.tda.baselines import WholeNetworkGradients, hybrid_scores
from prismlm.tda.influence import CurvatureAccumulator, curvature_pass


@pytest.fixture(scope="module")
def net(tiny_shards):
    cfg = RunConfig.from_name("tiny").override({"model.vocab_size": tiny_shards.tokenizer.vocab_size})
    torch.manual_seed(0)
    return PrismLM(cfg.model).double().eval()


def _rec_hessian_block(net, x, i: int, lam: float) -> torch.Tensor:
    """Autograd Hessian of λ·REC w.r.t. prototype i, activations and indices held fixed (spec §3.2)."""
    out = net(x)
    B, T = x.shape
    z = out.hidden.detach().reshape(B * T, -1)
    a = out.activations.detach().reshape(B * T, -1)
    idx = out.indices.reshape(B * T, -1)
    P = net.prototypes.weight.detach().clone()

    def rec(p_i):
        Pm = torch.cat([P[:i], p_i[None], P[i + 1 :]])
        r = z - torch.einsum("nk,nkd->nd", a, Pm[idx])
        return lam * (r.pow(2).sum(-1) / z.pow(2).sum(-1)).mean()

    # the function above is the model's REC (its residual and loss value), so the reference is the real loss
    tgt = torch.zeros_like(x)
    assert torch.allclose(rec(P[i]), lam * net(x, tgt).losses["rec"], rtol=1e-10)
    return torch.autograd.functional.hessian(rec, P[i].clone())


def test_reconstruction_block_equals_autograd_hessian(net, tiny_shards):
    T = net.config.block_size
    x = torch.from_numpy(tiny_shards.train.sequences(np.arange(4), T))[:, :-1]
    acc = CurvatureAccumulator(net)
    acc.update(net(x))
    lam = 1.7
    with_rec = acc.finish(damping=0.1, reconstruction=lam)
    without = acc.finish(damping=0.1)
    counts = torch.bincount(net(x).indices.reshape(-1), minlength=net.prototypes.num_prototypes)
    active = torch.nonzero(counts).reshape(-1)[:3].tolist()
    d = net.config.n_embd
    for i in active:
        H = _rec_hessian_block(net, x, i, lam)
        assert float(H.abs().max()) > 0
        torch.testing.assert_close(with_rec.dense(i) - without.dense(i), H, rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(H, H[0, 0] * torch.eye(d, dtype=H.dtype), rtol=1e-8, atol=1e-12)  # isotropic
    # applying H⁻¹ uses the added term: H_i (H_i⁻¹ g) = g
    g = torch.randn(3, d, dtype=torch.float64)
    pr = torch.tensor(active)
    back = torch.stack([with_rec.dense(i) @ v for i, v in zip(active, with_rec.apply(pr, g, -1.0), strict=True)])
    torch.testing.assert_close(back, g, rtol=1e-8, atol=1e-10)


def test_reconstruction_curvature_round_trips_and_pass(net, tiny_shards, tmp_path):
    from prismlm.tda.influence import Curvature

    c = curvature_pass(net, tiny_shards, sequences=(0, 8), batch_size=4, reconstruction=1.0)
    assert c.rec is not None and c.reconstruction == 1.0
    c.save(tmp_path / "c.safetensors")
    c2 = Curvature.load(tmp_path / "c.safetensors")
    torch.testing.assert_close(c2.dense(3), c.dense(3))
    assert curvature_pass(net, tiny_shards, sequences=(0, 8), batch_size=4).rec is None


def test_whole_network_gradients_equal_autograd_of_the_loss(net, tiny_shards):
    T = net.config.block_size
    wn = WholeNetworkGradients(net, tiny_shards)
    x = torch.from_numpy(tiny_shards.train.sequence(2, T))[None]
    net.zero_grad()
    out = net(x[:, :-1], x[:, 1:])
    (out.losses["ce"] * T).backward()  # summed token CE
    ref = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in net.parameters()
            if p.requires_grad
        ]
    )
    net.zero_grad()
    torch.testing.assert_close(wn.train(2), ref.double(), rtol=1e-6, atol=1e-9)
    gq = wn.query(x[0].tolist(), 1)
    torch.testing.assert_close(wn.dot(gq, [2]), (ref.double() @ ref.double())[None], rtol=1e-6, atol=1e-9)
    assert wn.computed == 1  # memoised


def test_hybrid_with_all_candidates_is_the_whole_network_score():
    g = torch.Generator().manual_seed(0)
    base, whole = torch.randn(3, 20, generator=g), torch.randn(3, 20, generator=g)
    out, cands = hybrid_scores(base, lambda q, ids: whole[q, ids], 20)
    torch.testing.assert_close(out, whole.double())
    assert cands.shape == (3, 20)


def test_hybrid_reranks_only_the_candidates():
    g = torch.Generator().manual_seed(1)
    Q, N, M = 4, 30, 5
    base, whole = torch.randn(Q, N, generator=g).double(), torch.randn(Q, N, generator=g).double()
    out, cands = hybrid_scores(base, lambda q, ids: whole[q, ids], M)
    for q in range(Q):
        top = np.argsort(-base[q].numpy(), kind="stable")[:M]
        assert sorted(cands[q].tolist()) == sorted(top.tolist())
        order = np.argsort(-out[q].numpy(), kind="stable")
        # candidates first, ordered by the whole-network score
        assert order[:M].tolist() == top[np.argsort(-whole[q, top].numpy(), kind="stable")].tolist()
        # then the others in the base order, with the base differences kept up to one positive scale
        rest = np.argsort(-base[q].numpy(), kind="stable")[M:]
        assert order[M:].tolist() == rest.tolist()
        torch.testing.assert_close(out[q, cands[q]], whole[q, cands[q]])
        r = torch.from_numpy(rest)
        ratio = (out[q, r[1:]] - out[q, r[:-1]]) / (base[q, r[1:]] - base[q, r[:-1]])
        assert float(ratio.min()) > 0 and torch.allclose(ratio, ratio[0].expand_as(ratio))
        assert float(out[q, r].max()) < float(whole[q, cands[q]].min())


def test_trak_refuses_a_projection_that_gives_garbage(net, tiny_shards):
    pytest.importorskip("trak")
    from prismlm.errors import ConfigError
    from prismlm.tda.baselines import TrakBaseline

    with pytest.raises(ConfigError, match="proj_dim"):
        TrakBaseline(net, tiny_shards, proj_dim=64)
    with pytest.raises(ConfigError, match="proj_dim"):
        TrakBaseline(net, tiny_shards, proj_dim=512, max_sequences=200)


def test_trak_scores_match_the_trak_formula(net, tiny_shards):
    """TRAK's score is ∝ (Φ (ΦᵀΦ)⁻¹ φ_q)_j · Q_j, Φ the projected margin gradients of the training sequences:
    recomputed here from our own per-sequence autograd of the margin and TRAK's projection matrix."""
    pytest.importorskip("trak")
    import copy

    from prismlm.tda.baselines import TrakBaseline

    n, T = 160, net.config.block_size
    tb = TrakBaseline(net, tiny_shards, proj_dim=128, max_sequences=n, batch_size=32)
    qids = tiny_shards.train.sequence(5, T).tolist()
    S = tb.scores([(qids, 1)])
    assert S.shape == (1, n) and bool(torch.isfinite(S).all())
    m = copy.deepcopy(net).float()
    params = list(m.parameters())

    rows = [_margin_gradient(m, params, tiny_shards.train.sequence(j, T).tolist()) for j in range(n)]
    G = torch.stack([r[0] for r in rows])
    Qw = torch.stack([r[1] for r in rows]).double()
    proj = tb.traker.projector
    Phi = proj.project(G, model_id=0).double()  # (n, k)
    phi_q = proj.project(_margin_gradient(m, params, qids)[0][None], model_id=0).double()  # (1, k)
    ref = (Phi @ torch.linalg.inv(Phi.T @ Phi) @ phi_q.T)[:, 0] * Qw
    # equal up to one positive constant (TRAK rescales its features internally; rankings and LDS ignore it)
    c = float(S[0] @ ref) / float(ref @ ref)
    assert c > 0
    torch.testing.assert_close(S[0], c * ref, rtol=1e-2, atol=1e-2 * float(S[0].abs().max()))
    assert int(torch.argsort(-S[0])[:3].eq(5).sum()) == 1  # the query is training sequence 5 itself
    tb.close()


def test_trak_on_named_parameters_projects_only_their_gradients(net, tiny_shards):
    """``parameters``: TRAK's stored features are the projection (by TRAK's own projector, normalised by the
    √size of the named parameters) of per-sequence margin gradients of those parameters only, concatenated in
    ``named_parameters`` order whatever order they are named in — recomputed here by autograd; the scores are
    the ridge formula Φ (ΦᵀΦ + λI)⁻¹ φ_q · Q_j with λ the relative ridge × mean eigenvalue of ΦᵀΦ."""
    pytest.importorskip("trak")
    import copy

    from prismlm.errors import ConfigError
    from prismlm.tda.baselines import TrakBaseline

    with pytest.raises(ConfigError, match="transformer.h.9.mlp.c_fc.weight"):
        TrakBaseline(net, tiny_shards, proj_dim=128, max_sequences=200, parameters=["transformer.h.9.mlp.c_fc.weight"])
    m = copy.deepcopy(net).float()
    names = ["prototypes.weight", "transformer.h.1.mlp.c_fc.weight", "transformer.ln_f.bias", "transformer.wpe.weight"]
    order = [n for n, _ in m.named_parameters() if n in names]  # wpe, h.1.mlp.c_fc, ln_f.bias, prototypes
    params = [dict(m.named_parameters())[n] for n in order]
    size = sum(p.numel() for p in params)
    n, T = 40, net.config.block_size
    tb = TrakBaseline(
        net, tiny_shards, proj_dim=128, lambda_reg=0.1, lambda_relative=True, parameters=names, max_sequences=n
    )

    rows = [_margin_gradient(m, params, tiny_shards.train.sequence(j, T).tolist()) for j in range(n)]
    G = torch.stack([r[0] for r in rows])  # (n, size)
    assert G.shape == (n, size) and float(G[:, -64 * 32 :].abs().max()) == 0.0  # the bank: ∂ℓ/∂P ≡ 0
    proj = tb.traker.projector
    assert proj.grad_dim == size
    Phi = proj.project(G, model_id=0).double() / size**0.5  # (n, k)
    stored = torch.as_tensor(tb.traker.saver.current_store["grads"]).double()
    torch.testing.assert_close(stored, Phi, rtol=1e-4, atol=1e-5 * float(Phi.abs().max()))
    lam = 0.1 * float(Phi.pow(2).sum()) / 128
    assert tb.lambda_abs == pytest.approx(lam, rel=1e-4)
    qids = tiny_shards.train.sequence(5, T).tolist()
    S = tb.scores([(qids, 1)])
    phi_q = proj.project(_margin_gradient(m, params, qids)[0][None], model_id=0).double() / size**0.5  # (1, k)
    Qw = torch.stack([r[1] for r in rows]).double()
    ref = (Phi @ torch.linalg.inv(Phi.T @ Phi + lam * torch.eye(128, dtype=torch.float64)) @ phi_q.T)[:, 0] * Qw
    c = float(S[0] @ ref) / float(ref @ ref)  # TRAK divides (ΦᵀΦ + λI)⁻¹ by its mean |entry|
    assert c > 0
    torch.testing.assert_close(S[0], c * ref, rtol=1e-3, atol=1e-3 * float(S[0].abs().max()))
    tb.close()
    # a tied weight named under its alias (the unembedding is the token embedding): differentiated once
    tied = TrakBaseline(net, tiny_shards, proj_dim=128, lambda_reg=1.0, parameters=["lm_head.weight"], max_sequences=4)
    assert (
        tied.grad_wrt == ["transformer.wte.weight"]
        and tied.traker.projector.grad_dim == m.transformer.wte.weight.numel()
    )
    tied.close()


def test_kronfluence_scores_on_candidates_equal_the_full_matrix(net, tiny_shards):
    """The hybrid's EK-FAC re-scoring of M candidates gives the same numbers as the full pairwise matrix."""
    pytest.importorskip("kronfluence")
    from prismlm.tda.baselines import KronfluenceBaseline

    T = net.config.block_size
    kb = KronfluenceBaseline(net, tiny_shards, strategy="ekfac", max_sequences=24, batch_size=8)  # copies net
    q = [(tiny_shards.train.sequence(30, T).tolist(), 5)]
    full = kb.scores(q)
    ids = [7, 2, 19]
    torch.testing.assert_close(kb.scores_on(q, ids), full[:, ids], rtol=1e-4, atol=1e-6)
    kb.close()


def test_ekfac_factors_on_the_first_sequences_score_the_whole_corpus(net, tiny_shards):
    """``factor_examples=8``: the factors are those of a fit on the first 8 sequences alone (their scores on
    those 8 are equal), and the scores still cover all 24; the full fit's differ."""
    pytest.importorskip("kronfluence")
    from prismlm.tda.baselines import KronfluenceBaseline

    T = net.config.block_size
    q = [(tiny_shards.train.sequence(30, T).tolist(), 5)]
    scores = {}
    for name, n, fit in (("limited", 24, 8), ("first8", 8, None), ("full", 24, None)):
        kb = KronfluenceBaseline(net, tiny_shards, strategy="ekfac", max_sequences=n, batch_size=8, factor_examples=fit)
        scores[name] = kb.scores(q)
        kb.close()
    assert scores["limited"].shape == (1, 24)
    torch.testing.assert_close(scores["limited"][:, :8], scores["first8"], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(scores["full"][:, :8], scores["first8"], rtol=1e-3)


@pytest.mark.slow  # over 10 s: .ci/run's `-m slow` pass
def test_ekfac_fits_are_seeded_so_repeated_runs_give_the_same_scores(net, tiny_shards):
    """EK-FAC's factor fit samples labels from the model's softmax: two fits (from different global RNG
    states) give identical scores, and the caller's RNG state is left untouched; another seed moves them."""
    pytest.importorskip("kronfluence")
    from prismlm.tda.baselines import KronfluenceBaseline

    T = net.config.block_size
    q = [(tiny_shards.train.sequence(30, T).tolist(), 5), (tiny_shards.train.sequence(31, T).tolist(), 9)]
    got = []
    for global_seed, seed in ((1, 0), (2, 0), (1, 5)):
        torch.manual_seed(global_seed)
        kb = KronfluenceBaseline(net, tiny_shards, strategy="ekfac", max_sequences=16, batch_size=8, seed=seed)
        assert torch.equal(torch.rand(3), (torch.manual_seed(global_seed), torch.rand(3))[1])  # RNG untouched
        got.append(kb.scores(q))
        kb.close()
    assert torch.equal(got[0], got[1])
    assert not torch.equal(got[0], got[2])


def test_hybrid_for_sums_leaves_the_rest_at_the_calibrated_base_score():
    """``keep_order=False``: candidates get the whole-network score, every other sequence α_q · base with
    α_q the least-squares scale from base to whole-network scores on the candidates (computed here by
    ``torch.linalg.lstsq``), unshifted."""
    g = torch.Generator().manual_seed(2)
    Q, N, M = 3, 25, 6
    base = torch.randn(Q, N, generator=g).double()
    whole = 3.0 * base + 0.1 * torch.randn(Q, N, generator=g).double()  # a positive scale
    out, cands = hybrid_scores(base, lambda q, ids: whole[q, ids], M, keep_order=False)
    for q in range(Q):
        c = cands[q]
        alpha = torch.linalg.lstsq(base[q, c][:, None], whole[q, c][:, None]).solution.item()
        rest = torch.ones(N, dtype=torch.bool)
        rest[c] = False
        torch.testing.assert_close(out[q, rest], alpha * base[q, rest])
        torch.testing.assert_close(out[q, c], whole[q, c])
    shifted, _ = hybrid_scores(base, lambda q, ids: whole[q, ids], M)
    assert not torch.allclose(shifted, out)  # the ranking variant shifts the rest below the candidates


@pytest.fixture(scope="module")
def cached_run(tiny_shards, tmp_path_factory):
    """A tiny trained run with a 40-sequence attribution cache."""
    from conftest import train_tiny_run

    from prismlm.app import Run, build_run_cache
    from prismlm.config import AttributionConfig

    _, run_dir = train_tiny_run(tiny_shards, tmp_path_factory.mktemp("hybrid"), steps=20, batch_size=4, warmup_steps=2)
    run = Run.open(run_dir)
    build_run_cache(
        run, AttributionConfig(max_sequences=40, r=16, batch_size=8), shards=tiny_shards.root, progress=False
    )
    return run


def test_attribute_rescored_reranks_the_cached_candidates(cached_run, tiny_shards):
    """`prism attribute --rescore gradient --rescore-top 8`: the 8 best sequences by the cache, ordered by
    their whole-network gradient dot products with the query (``WholeNetworkGradients``, checked against
    autograd above), their scores those dot products."""
    from prismlm.app import attribute_text
    from prismlm.tda.attribute import QuerySpec, Rescoring, SearchSpec, make_query

    run, text = cached_run, "The President said that"
    base = attribute_text(run, text, QuerySpec(completion=2), SearchSpec(top=8), shards=tiny_shards.root)
    hyb = attribute_text(
        run,
        text,
        QuerySpec(completion=2),
        SearchSpec(top=5),
        Rescoring("gradient", candidates=8),
        shards=tiny_shards.root,
    )
    cands = [it.sequence for it in base.top]
    wn = WholeNetworkGradients(run.model, tiny_shards, memo=False)
    ids, start = make_query(run.tokenizer, text, completion_tokens=2)
    whole = wn.dot(wn.query(ids, start), cands).numpy()
    want = [cands[i] for i in np.argsort(-whole, kind="stable")[:5]]
    assert [it.sequence for it in hyb.top] == want
    np.testing.assert_allclose([it.score for it in hyb.top], np.sort(whole)[::-1][:5], rtol=1e-6)
    assert hyb.method == "cached+gradient" and any("re-ranked by gradient" in n for n in hyb.notes)
    assert all(it.prototypes for it in hyb.top)  # their prototype-space contributions stay listed


def test_attribute_rescored_by_ekfac_fits_factors_once(cached_run, tiny_shards):
    """`--rescore ekfac`: kronfluence's EK-FAC scores of the query on the candidates (the same as its scores
    over every cached sequence with the same factors, read at the candidates), with the factors fitted once
    into RUN/attribution-factors and reused by the next query."""
    pytest.importorskip("kronfluence")
    from prismlm.app import attribute_text
    from prismlm.tda.attribute import QuerySpec, Rescoring, SearchSpec, make_query
    from prismlm.tda.baselines import KronfluenceBaseline

    run, text = cached_run, "The President said that"
    hyb = attribute_text(
        run, text, QuerySpec(completion=2), SearchSpec(top=4), Rescoring("ekfac", candidates=6), shards=tiny_shards.root
    )
    factors = [f for f in (run.folder / "attribution-factors").rglob("*") if f.is_file() and "factors_" in str(f)]
    assert factors and hyb.method == "cached+ekfac"
    stamps = {f: f.stat().st_mtime_ns for f in factors}
    again = attribute_text(
        run, text, QuerySpec(completion=2), SearchSpec(top=4), Rescoring("ekfac", candidates=6), shards=tiny_shards.root
    )
    assert {f: f.stat().st_mtime_ns for f in factors} == stamps  # reused, not refitted
    assert [it.sequence for it in again.top] == [it.sequence for it in hyb.top]
    assert not list((run.folder / "attribution-factors").rglob("scores_*"))  # per-query scores are not kept
    base = attribute_text(run, text, QuerySpec(completion=2), SearchSpec(top=6), shards=tiny_shards.root)
    # the same factors (kronfluence samples the labels it fits them with: a new fit differs)
    folder = next((run.folder / "attribution-factors").iterdir())
    kb = KronfluenceBaseline(
        run.model, tiny_shards, strategy="ekfac", max_sequences=40, out_dir=folder, reuse_factors=True
    )
    every = kb.scores([make_query(run.tokenizer, text, completion_tokens=2)], run.tokenizer.eot_id)[0].numpy()
    kb.close()
    cands = np.array([it.sequence for it in base.top])
    want = cands[np.argsort(-every[cands], kind="stable")][:4]
    assert [it.sequence for it in hyb.top] == want.tolist()
    np.testing.assert_allclose([it.score for it in hyb.top], every[want], rtol=1e-4, atol=1e-8)


def test_cli_attribute_rescore(cached_run, tiny_shards):
    from typer.testing import CliRunner

    from prismlm.cli import app

    res = CliRunner().invoke(
        app,
        [
            "attribute",
            str(cached_run.path),
            "The President said that",
            "--completion",
            "2",
            "--top",
            "3",
            "--rescore",
            "gradient",
            "--rescore-top",
            "8",
            "--shards",
            str(tiny_shards.root),
        ],
    )
    assert res.exit_code == 0 and "cached+gradient" in res.output and "re-ranked" in res.output, res.output


def _margin_gradient(model, params, ids):
    """TRAK's training-side quantities for one sequence, by plain autograd: the gradient of the summed log-odds
    margin ℓ_y − logsumexp_{v≠y} ℓ_v with respect to ``params`` (flattened, in their order; zeros where unused)
    and Q = mean_t (1 − p_{t,y_t})."""
    import torch.nn.functional as F

    x = torch.tensor(ids)[None]
    logits = model(x[:, :-1]).logits[0]
    y = x[0, 1:]
    margin = logits.gather(-1, y[:, None])[:, 0] - logits.scatter(-1, y[:, None], float("-inf")).logsumexp(-1)
    g = torch.autograd.grad(margin.sum(), params, allow_unused=True)
    with torch.no_grad():
        q = (1 - F.softmax(logits, -1).gather(-1, y[:, None])[:, 0]).mean()
    return torch.cat([(gi if gi is not None else torch.zeros_like(p)).reshape(-1) for gi, p in zip(g, params)]), q
