"""Prototype-space gradients, curvature and influence (spec §3.2) against independent float64 references.

Every expected value here is built from the definitions, not from the library's intermediates:
gradients by ``torch.autograd`` on ``ℓ_t = W(r_t + Σ_i a_{t,i} p_i)`` with r_t, a_t held fixed, curvature as
the explicit d × d matrices ``H_i = m_i F + λ_i I`` / ``E_t[a_{t,i}² Wᵀ Σ_t W] + λ_i I`` (Σ_t formed as a V × V
matrix), inverses by ``torch.linalg.solve``. The model is an untrained tiny PRISM (d=32, 2 layers, K=64) on a
synthetic token stream, so the file runs in a few seconds; it is the test selection of the mutation run
(docs/mutation.md) for ``src/prismlm/tda/influence.py``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prismlm import ModelConfig, PrismLM, PrototypeConfig
from prismlm.errors import ConfigError, ModelError
from prismlm.tda import influence as infl
from prismlm.tda.gradients import BlockGradients, block_gradients, output_gradients, precondition, query_table
from prismlm.tda.influence import (
    Curvature,
    CurvatureAccumulator,
    FullGradients,
    collect_gradients,
    curvature_pass,
    influence_scores,
    query_gradients,
    self_influence,
)

V, T, D, K, TOPK = 97, 16, 32, 64, 4
N_SEQ = 7
RHO = 0.1  # the documented default damping ρ


class _Split:
    """The documented TokenShard contract: sequence j is tokens[j·T : j·T + T + 1]."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def num_sequences(self, seq_len: int) -> int:
        return (len(self.tokens) - 1) // seq_len

    def sequences(self, js, seq_len: int) -> np.ndarray:
        return np.stack([self.tokens[j * seq_len : j * seq_len + seq_len + 1] for j in np.asarray(js)]).astype(np.int64)


@pytest.fixture(scope="module")
def shards():
    rng = np.random.default_rng(0)
    return SimpleNamespace(train=_Split(rng.integers(0, V, size=N_SEQ * T + 1)))


@pytest.fixture(scope="module")
def net(shards):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V,
        block_size=T,
        n_layer=2,
        n_head=2,
        n_embd=D,
        prototypes=PrototypeConfig(num_prototypes=K, top_k=TOPK),
    )
    m = PrismLM(cfg).double().eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)  # O(1) logits: a far-from-uniform softmax, so Σ_t matters
        z = m.backbone(torch.from_numpy(shards.train.sequences(np.arange(N_SEQ), T))[:, :-1]).reshape(-1, D)
        # 40 prototypes near real hidden states (used), 24 random directions (mostly never selected)
        P = torch.randn(K, D, dtype=torch.float64)
        P[:40] = z[torch.randperm(z.shape[0])[:40]] + 0.3 * torch.randn(40, D, dtype=torch.float64)
        m.prototypes.weight.copy_(P)
    return m


def _seqs(shards, j0, j1):
    return torch.from_numpy(shards.train.sequences(np.arange(j0, j1), T))  # (B, T+1)


def autograd_grads(net, x, y, mask=None):
    """(B, K, d): ∇_P Σ_{measured t} CE_t of each sequence, with r_t and a_t held fixed, by autograd."""
    out = net(x)
    P = net.prototypes.weight.detach().clone().requires_grad_(True)
    zhat = torch.einsum("btk,btkd->btd", out.activations.detach(), P[out.indices])
    logits = net.lm_head(out.residual.detach() + zhat)  # equals out.logits at P
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-12)
    mask = torch.ones(y.shape, dtype=torch.bool) if mask is None else mask
    grads, losses = [], []
    for b in range(x.shape[0]):
        ce = F.cross_entropy(logits[b], y[b], reduction="none")
        loss = (ce * mask[b]).sum()
        (g,) = torch.autograd.grad(loss, P, retain_graph=True)
        grads.append(g)
        losses.append(loss.detach())
    return torch.stack(grads), torch.stack(losses)


def query_reference(net, ids, measure_from):
    """Autograd (K, d) gradient and loss of a query: the last T+1 tokens, targets ids[measure_from:]."""
    ids = list(ids)
    dropped = max(0, len(ids) - (T + 1))
    ids, s = ids[dropped:], measure_from - dropped
    x = torch.tensor(ids)[None]
    mask = torch.zeros(1, len(ids) - 1, dtype=torch.bool)
    for t in range(len(ids) - 1):  # target t is ids[t+1]
        mask[0, t] = t + 1 >= s
    g, loss = autograd_grads(net, x[:, :-1], x[:, 1:], mask)
    return g[0], loss[0]


def dense_blocks(bg: BlockGradients, n: int) -> torch.Tensor:
    """Block rows → (n, K, d) by explicit loops over rows."""
    out = torch.zeros(n, K, D, dtype=torch.float64)
    for s, p, g in zip(bg.seq.tolist(), bg.proto.tolist(), bg.grad, strict=True):
        out[s, p] += g
    return out


def explicit_curvature(net, x, damping=RHO):
    """From the definitions: F, m, and the explicit H_i (shared and exact), all (K, d, d) float64."""
    with torch.no_grad():
        out = net(x)
    W = net.lm_head.weight.detach()  # (V, d)
    pi = torch.softmax(out.logits.reshape(-1, V), -1)  # (N, V)
    N = pi.shape[0]
    GN = torch.stack([W.T @ (torch.diag(p) - torch.outer(p, p)) @ W for p in pi])  # (N, d, d)
    A = torch.zeros(N, K, dtype=torch.float64)  # dense activations a_{t,i}
    idx, act = out.indices.reshape(N, -1), out.activations.reshape(N, -1)
    for t in range(N):
        for s in range(idx.shape[1]):
            A[t, idx[t, s]] = act[t, s]
    Fm = GN.mean(0)
    m = (A**2).mean(0)
    m_eff = torch.clamp(m, min=1.0 / N)
    eye = torch.eye(D, dtype=torch.float64)
    H_shared = torch.stack([m_eff[i] * Fm + damping * torch.trace(m_eff[i] * Fm) / D * eye for i in range(K)])
    blocks = torch.einsum("ni,nde->ide", A**2, GN) / N
    H_exact = torch.stack(
        [blocks[i] + damping * torch.trace(blocks[i]) / D * eye if m[i] > 0 else H_shared[i] for i in range(K)]
    )
    return SimpleNamespace(F=Fm, m=m, blocks=blocks, shared=H_shared, exact=H_exact, N=N)


def influence_reference(gq: torch.Tensor, gj: torch.Tensor, H: torch.Tensor | None) -> torch.Tensor:
    """Σ_i G_{q,i}ᵀ H_i⁻¹ G_{j,i} for (K, d) gradients (inactive blocks are zero rows and contribute 0)."""
    if H is None:
        return (gq * gj).sum()
    return (gq * torch.linalg.solve(H, gj)).sum()


# ----- block gradients -------------------------------------------------------------------------------------
def test_block_gradients_of_a_batch_equal_autograd_and_list_exactly_the_active_blocks(net, shards):
    x = _seqs(shards, 0, 3)
    mask = torch.rand(3, T, generator=torch.Generator().manual_seed(1)) > 0.4
    out = net(x[:, :-1])
    bg = block_gradients(net, out, x[:, 1:], mask, seq_ids=torch.tensor([10, 11, 12]))
    ref, loss = autograd_grads(net, x[:, :-1], x[:, 1:], mask)
    got = torch.zeros(3, K, D, dtype=torch.float64)
    for s, p, g in zip(bg.seq.tolist(), bg.proto.tolist(), bg.grad, strict=True):
        got[s - 10, p] += g
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(bg.loss, loss, rtol=1e-13, atol=0)
    # one row per (sequence, prototype active with a > 0 in a measured token), ordered by (sequence, prototype)
    want = sorted(
        {
            (b + 10, int(out.indices[b, t, s]))
            for b in range(3)
            for t in range(T)
            for s in range(TOPK)
            if mask[b, t] and out.activations[b, t, s] > 0
        }
    )
    assert list(zip(bg.seq.tolist(), bg.proto.tolist(), strict=True)) == want
    assert bg.rows == len(want) and bg.grad.dtype == torch.float64
    # default mask: every token measured; default ids: 0..B-1
    bg_all = block_gradients(net, out, x[:, 1:])
    ref_all, loss_all = autograd_grads(net, x[:, :-1], x[:, 1:])
    torch.testing.assert_close(dense_blocks(bg_all, 3), ref_all, rtol=0, atol=1e-12)
    torch.testing.assert_close(bg_all.loss, loss_all, rtol=1e-13, atol=0)


def test_block_gradients_skip_zero_activations_and_use_the_given_logits():
    """A hand-made forward output with zero activations: u_t = Wᵀ(softmax(ℓ_t) − e_y), G = Σ_t a u_t."""
    torch.manual_seed(3)
    W = torch.randn(V, D, dtype=torch.float64)
    model = SimpleNamespace(prototypes=SimpleNamespace(num_prototypes=K), lm_head=SimpleNamespace(weight=W))
    B, L = 2, 5
    logits = torch.randn(B, L, V, dtype=torch.float64)
    indices = torch.stack([torch.randperm(K)[:3] for _ in range(B * L)]).view(B, L, 3)
    acts = torch.rand(B, L, 3, dtype=torch.float64)
    acts[0, 1, 2] = 0.0  # selected but inactive: no row unless another token activates it
    acts[1, :, 0] = 0.0
    y = torch.randint(0, V, (B, L))
    out = SimpleNamespace(logits=logits, indices=indices, activations=acts)
    bg = block_gradients(model, out, y)
    want = torch.zeros(B, K, D, dtype=torch.float64)
    active = set()
    for b in range(B):
        for t in range(L):
            p = torch.exp(logits[b, t] - torch.logsumexp(logits[b, t], 0))
            e = torch.zeros(V, dtype=torch.float64)
            e[y[b, t]] = 1.0
            u = W.T @ (p - e)
            for s in range(3):
                want[b, indices[b, t, s]] += acts[b, t, s] * u
                if acts[b, t, s] > 0:
                    active.add((b, int(indices[b, t, s])))
    torch.testing.assert_close(dense_blocks(bg, B), want, rtol=0, atol=1e-12)
    assert set(zip(bg.seq.tolist(), bg.proto.tolist(), strict=True)) == active
    # float32 outputs are computed in float32 (no silent down-cast below it)
    out32 = SimpleNamespace(logits=logits.float(), indices=indices, activations=acts.float())
    assert block_gradients(model, out32, y).grad.dtype == torch.float32


def test_block_gradients_refuse_the_dense_baseline(net):
    out = SimpleNamespace(indices=None, logits=torch.zeros(1, 2, V), activations=None)
    with pytest.raises(ModelError, match="PRISM model"):
        block_gradients(net, out, torch.zeros(1, 2, dtype=torch.long))


def test_block_gradient_rows_select_and_cat():
    a = BlockGradients(
        torch.tensor([0, 0, 1]), torch.tensor([3, 5, 3]), torch.arange(6.0).view(3, 2), torch.tensor([1.0, 2.0])
    )
    b = BlockGradients(torch.tensor([2]), torch.tensor([7]), torch.ones(1, 2), None)
    c = BlockGradients.cat([a, b])
    assert c.rows == 4 and c.seq.tolist() == [0, 0, 1, 2] and c.proto.tolist() == [3, 5, 3, 7]
    assert c.grad[3].tolist() == [1.0, 1.0] and c.loss.tolist() == [1.0, 2.0]
    s = a.select(a.proto == 3)
    assert s.rows == 2 and s.seq.tolist() == [0, 1] and s.grad.tolist() == [[0.0, 1.0], [4.0, 5.0]]
    assert s.proto.tolist() == [3, 3] and s.loss is a.loss
    assert BlockGradients.cat([b, b]).loss is None


def test_collect_gradients_equal_autograd_on_any_batch_grid(net, shards):
    ref, loss = autograd_grads(net, _seqs(shards, 2, 7)[:, :-1], _seqs(shards, 2, 7)[:, 1:])
    net.train()  # the pass runs in eval mode and restores the caller's mode
    try:
        for bs in (2, 3, 16):
            g = collect_gradients(net, shards, sequences=(2, 7), batch_size=bs)
            assert net.training
            assert int(g.seq.min()) == 2 and int(g.seq.max()) == 6
            torch.testing.assert_close(dense_blocks(g, 7)[2:], ref, rtol=0, atol=1e-12)
            torch.testing.assert_close(g.loss, loss, rtol=1e-13, atol=0)
    finally:
        net.eval()
    g_all = collect_gradients(net, shards)  # default: every training sequence
    assert sorted(set(g_all.seq.tolist())) == list(range(N_SEQ))


def test_batches_form_a_fixed_grid():
    assert list(infl.batch_grid(2, 11, 4)) == [(2, 4), (4, 8), (8, 11)]
    assert list(infl.batch_grid(0, 8, 4)) == [(0, 4), (4, 8)]
    assert list(infl.batch_grid(5, 5, 4)) == []


def test_query_gradients_measure_exactly_the_requested_targets(net):
    rng = np.random.default_rng(5)
    long_ids = rng.integers(0, V, T + 7).tolist()  # longer than the window: the last T+1 tokens are kept
    qs = [
        (rng.integers(0, V, 9).tolist(), 3),
        (rng.integers(0, V, 6).tolist(), 1),
        (long_ids, len(long_ids) - 4),
        (rng.integers(0, V, 5).tolist(), 4),
    ]
    q = query_gradients(net, qs)
    assert sorted(set(q.seq.tolist())) == [0, 1, 2, 3]
    got = dense_blocks(q, len(qs))
    for n, (ids, s) in enumerate(qs):
        g, loss = query_reference(net, ids, s)
        torch.testing.assert_close(got[n], g, rtol=0, atol=1e-12)
        assert q.loss[n].item() == pytest.approx(loss.item(), rel=1e-13)
    # measure_from is clamped into [1, len − 1]: 0 measures every target, beyond the end only the last one
    ids = qs[0][0]
    for s, same_as in ((0, 1), (-3, 1), (len(ids) + 5, len(ids) - 1)):
        a, b = query_gradients(net, [(ids, s)]), query_gradients(net, [(ids, same_as)])
        assert torch.equal(a.proto, b.proto) and torch.equal(a.grad, b.grad) and torch.equal(a.loss, b.loss)
    with pytest.raises(ConfigError, match="at least two"):
        query_gradients(net, [([5], 1)])
    net.train()
    try:
        query_gradients(net, qs[:1])
        assert net.training
    finally:
        net.eval()


# ----- curvature -------------------------------------------------------------------------------------------
def test_curvature_pass_reports_progress_per_batch_and_is_silent_by_default(net, shards, capfd):
    """One event per batch of the fixed grid (sequences [1, 4) with batch 2: [1, 2), [2, 4)), then a
    final one; the default prints nothing."""
    from prismlm.progress import ProgressEvent

    events: list[ProgressEvent] = []
    curvature_pass(net, shards, sequences=(1, 4), batch_size=2, progress=events.append)
    assert [(e.stage, e.done, e.total, e.unit, e.finished) for e in events] == [
        ("curvature", 1, 3, "seq", False),
        ("curvature", 3, 3, "seq", False),
        ("curvature", 3, 3, "seq", True),
    ]
    capfd.readouterr()
    curvature_pass(net, shards, sequences=(1, 4), batch_size=2)
    assert capfd.readouterr() == ("", "")


def test_shared_curvature_is_m_times_F_plus_damping_from_the_definitions(net, shards):
    """H_i = m̃_i F + λ_i I, λ_i = ρ·tr(m̃_i F)/d, m̃_i = max(m_i, 1/N), checked as explicit matrices."""
    ref = explicit_curvature(net, _seqs(shards, 0, 5)[:, :-1])
    cur = curvature_pass(net, shards, sequences=(0, 5), batch_size=2)  # default damping ρ = 0.1
    assert cur.mode == "shared" and cur.tokens == ref.N and cur.damping == RHO
    torch.testing.assert_close(cur.F, ref.F, rtol=0, atol=1e-12)
    torch.testing.assert_close(cur.m, ref.m, rtol=0, atol=1e-14)
    # tokens softmaxed in blocks of 7 (not dividing a batch's 2·T tokens): the same statistics
    acc = CurvatureAccumulator(net, block_rows=7)
    with torch.no_grad():
        for j in (0, 2, 4):
            acc.update(net(_seqs(shards, j, min(5, j + 2))[:, :-1]))
    blocked = acc.finish()
    torch.testing.assert_close(blocked.F, ref.F, rtol=0, atol=1e-12)
    torch.testing.assert_close(blocked.m, ref.m, rtol=0, atol=1e-14)
    # a float32 model: π and Wᵀπ in float32, sums in float64 — F within float32 rounding of the reference
    net32 = copy.deepcopy(net).float()
    acc32 = CurvatureAccumulator(net32, block_rows=7)
    with torch.no_grad():
        acc32.update(net32(_seqs(shards, 0, 5)[:, :-1]))
    torch.testing.assert_close(acc32.finish().F, ref.F, rtol=0, atol=1e-5 * float(ref.F.abs().max()))
    unseen = (ref.m == 0).nonzero().flatten()
    seen = ref.m.argsort(descending=True)
    assert len(unseen) > 0 and int((ref.m > 0).sum()) > 10  # both kinds of prototype are exercised
    ids = torch.cat([seen[:3], seen[10:11], unseen[:2]])
    g = torch.randn(len(ids), D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    H = ref.shared[ids]
    scale = H.abs().max()
    for i in ids.tolist():
        torch.testing.assert_close(cur.dense(i), ref.shared[i], rtol=0, atol=1e-10 * float(scale))
    want = torch.linalg.solve(H, g)
    torch.testing.assert_close(cur.apply(ids, g), want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))
    torch.testing.assert_close(cur.apply(ids, g, power=1.0), torch.einsum("rde,re->rd", H, g), rtol=1e-9, atol=1e-12)
    half = cur.apply(ids, cur.apply(ids, g, -0.5), -0.5)
    torch.testing.assert_close(half, want, rtol=1e-8, atol=1e-9 * float(want.abs().max()))
    torch.testing.assert_close(cur.apply(ids, g, chunk=2), want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))
    # float32 gradients come back as float32; no rows → an empty (0, d) result
    assert cur.apply(ids, g.float()).dtype == torch.float32
    assert cur.apply(ids[:0], g[:0]).shape == (0, D)
    # a different damping changes λ_i exactly as documented
    cur3 = curvature_pass(net, shards, sequences=(0, 5), batch_size=5, damping=0.3)
    ref3 = explicit_curvature(net, _seqs(shards, 0, 5)[:, :-1], damping=0.3)
    torch.testing.assert_close(
        cur3.apply(ids, g), torch.linalg.solve(ref3.shared[ids], g), rtol=1e-9, atol=1e-9 * float(want.abs().max())
    )


def test_exact_block_curvature_from_the_definitions(net, shards):
    """H_i = E_t[a_{t,i}² Wᵀ Σ_t W] + ρ·tr(·)/d·I; prototypes unseen in the statistics fall back to the shared form."""
    ref = explicit_curvature(net, _seqs(shards, 1, 4)[:, :-1])
    cur = curvature_pass(net, shards, sequences=(1, 4), batch_size=2, exact=True)
    assert cur.mode == "exact" and cur.tokens == ref.N
    torch.testing.assert_close(cur.blocks, ref.blocks, rtol=0, atol=1e-12)
    torch.testing.assert_close(cur.F, ref.F, rtol=0, atol=1e-12)
    unseen = (ref.m == 0).nonzero().flatten()
    seen = ref.m.argsort(descending=True)
    ids = torch.cat([seen[:4], unseen[:2]])
    g = torch.randn(len(ids), D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = torch.linalg.solve(ref.exact[ids], g)
    tol = 1e-9 * float(want.abs().max())
    torch.testing.assert_close(cur.apply(ids, g), want, rtol=1e-9, atol=tol)
    torch.testing.assert_close(cur.apply(ids, g, chunk=1), want, rtol=1e-9, atol=tol)
    half = cur.apply(ids, cur.apply(ids, g, -0.5), -0.5)
    torch.testing.assert_close(half, want, rtol=1e-8, atol=tol)
    for i in ids.tolist():
        torch.testing.assert_close(cur.dense(i), ref.exact[i], rtol=0, atol=1e-10 * float(ref.exact[i].abs().max()))
    # the streaming accumulator: token chunks smaller than a batch give the same blocks
    acc = CurvatureAccumulator(net, exact=True, chunk=5)
    with torch.no_grad():
        for j in (1, 2, 3):
            acc.update(net(_seqs(shards, j, j + 1)[:, :-1]))
    small = acc.finish()
    assert small.tokens == ref.N and small.damping == RHO
    torch.testing.assert_close(small.blocks, ref.blocks, rtol=0, atol=1e-12)
    torch.testing.assert_close(small.apply(ids, g), want, rtol=1e-9, atol=tol)


def test_curvature_save_load_round_trip(net, shards, tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.chdir(tmp_path)  # nothing but the given path can be read
    g = torch.randn(3, D, dtype=torch.float64)
    ids = torch.tensor([0, 1, 63])
    for exact in (False, True):
        cur = curvature_pass(net, shards, sequences=(0, 2), exact=exact, damping=0.25)
        cur.save(tmp_path / "c.safetensors", extra={"note": "x"})
        back = Curvature.load(tmp_path / "c.safetensors")
        assert back.mode == cur.mode and back.tokens == cur.tokens and back.damping == 0.25
        assert torch.equal(back.F, cur.F) and torch.equal(back.m, cur.m)
        assert torch.equal(back.apply(ids, g), cur.apply(ids, g))
        with safe_open(str(tmp_path / "c.safetensors"), framework="pt") as f:
            assert f.metadata()["note"] == "x"
    # the dataclass default damping is the documented ρ = 0.1
    plain = Curvature.from_stats(cur.F, cur.m, cur.tokens)
    assert plain.damping == RHO and Curvature(F=cur.F, m=cur.m, tokens=cur.tokens).damping == RHO


# ----- influence -------------------------------------------------------------------------------------------
def _query_set(net):
    rng = np.random.default_rng(9)
    return [(rng.integers(0, V, 12).tolist(), 4), (rng.integers(0, V, T + 3).tolist(), 2)]


@pytest.mark.parametrize("mode", ["identity", "shared", "exact"])
def test_influence_scores_equal_the_definition_with_autograd_gradients(net, shards, mode):
    """I(q, j) = Σ_i G_{q,i}ᵀ H_i⁻¹ G_{j,i} with G by autograd and H_i⁻¹ by a dense solve."""
    n = 5
    qs = _query_set(net)
    ref = explicit_curvature(net, _seqs(shards, 0, n)[:, :-1])
    H = {"identity": None, "shared": ref.shared, "exact": ref.exact}[mode]
    gj, _ = autograd_grads(net, _seqs(shards, 0, n)[:, :-1], _seqs(shards, 0, n)[:, 1:])
    gq = [query_reference(net, ids, s)[0] for ids, s in qs]
    want = torch.stack([torch.stack([influence_reference(gq[a], gj[j], H) for j in range(n)]) for a in range(2)])
    self_want = torch.stack([influence_reference(gj[j], gj[j], H) for j in range(n)])

    full = FullGradients.build(net, shards, max_sequences=n, batch_size=2, mode=mode)
    assert full.num_train == n and (full.curvature is None) == (mode == "identity")
    q = query_gradients(net, qs)
    S = full.scores(q, 2)
    assert S.shape == (2, n)
    tol = 1e-9 if mode != "exact" else 1e-7  # exact blocks of rarely used prototypes are ill-conditioned
    torch.testing.assert_close(S, want, rtol=tol, atol=tol * float(want.abs().max()))
    torch.testing.assert_close(full.self_scores(), self_want, rtol=tol, atol=0)
    torch.testing.assert_close(
        influence_scores(q, full.train, full.curvature, num_queries=2, num_train=n, chunk=3),
        S,
        rtol=1e-12,
        atol=1e-14 * float(want.abs().max()),
    )
    if mode == "identity":  # positive self-influence, and the plain dot product is symmetric
        assert (self_want > 0).all()


def test_influence_of_blocks_sharing_no_prototype_is_exactly_zero(net, shards):
    full = FullGradients.build(net, shards, mode="shared")  # every sequence, default damping
    assert full.num_train == N_SEQ and full.curvature.damping == RHO and full.curvature.tokens == N_SEQ * T
    tr = full.train
    g = torch.randn(2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    j = 0
    mine = sorted(set(tr.proto[tr.seq == j].tolist()))
    other = [p for p in range(K) if p not in mine]
    q = BlockGradients(torch.tensor([0, 1]), torch.tensor([mine[0], other[0]]), g)
    S = full.scores(q, 2)
    assert S[1, j].item() == 0.0 and S[0, j].item() != 0.0
    want = g[0] @ torch.linalg.solve(full.curvature.dense(mine[0]), dense_blocks(tr, N_SEQ)[j, mine[0]])
    assert S[0, j].item() == pytest.approx(want.item(), rel=1e-9)
    empty = BlockGradients(
        torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, D, dtype=torch.float64)
    )
    assert torch.count_nonzero(full.scores(empty, 1)) == 0 and full.scores(empty, 1).shape == (1, N_SEQ)
    # a given curvature is used as is (no second pass) and mode="identity" ignores it
    reuse = FullGradients.build(net, shards, max_sequences=3, curvature=full.curvature)
    assert reuse.curvature is full.curvature and reuse.num_train == 3
    assert (
        FullGradients.build(net, shards, max_sequences=3, mode="identity", curvature=full.curvature).curvature is None
    )


def test_self_influence_is_the_diagonal_of_pairwise_scores(net, shards):
    full = FullGradients.build(net, shards, max_sequences=6, mode="exact")
    tr = full.train
    pair = influence_scores(tr, tr, full.curvature, num_queries=6, num_train=6)
    torch.testing.assert_close(torch.diagonal(pair), self_influence(tr, full.curvature, 6), rtol=1e-12, atol=0)
    torch.testing.assert_close(pair, pair.T, rtol=1e-10, atol=0)  # H_i symmetric ⇒ I(j, j') = I(j', j)


def test_output_gradients_precondition_and_query_table(net, shards):
    """u_t = Wᵀ(π_t − e_y) by autograd of CE w.r.t. the hidden state; table[i, q] = H_i⁻¹ G_{q,i}."""
    x = _seqs(shards, 0, 2)
    out = net(x[:, :-1])
    z = out.hidden.detach().clone().requires_grad_(True)
    ce = F.cross_entropy(net.lm_head(z).reshape(-1, V), x[:, 1:].reshape(-1), reduction="sum")
    (want,) = torch.autograd.grad(ce, z)  # ∂CE_t/∂z_t = Wᵀ(π_t − e_y)
    u = output_gradients(net, out.logits, x[:, 1:])
    torch.testing.assert_close(u, want, rtol=0, atol=1e-12)
    assert output_gradients(net, out.logits.float(), x[:, 1:]).dtype == torch.float32
    # softmaxed a few rows at a time (blocks of 3 rows that do not divide the 2·T rows): the same gradients
    import prismlm.tda.gradients as gradients_mod

    block = gradients_mod.SOFTMAX_BLOCK
    try:
        gradients_mod.SOFTMAX_BLOCK = 3 * V
        torch.testing.assert_close(output_gradients(net, out.logits, x[:, 1:]), want, rtol=0, atol=1e-12)
    finally:
        gradients_mod.SOFTMAX_BLOCK = block
    cur = curvature_pass(net, shards, sequences=(0, 3))
    q = BlockGradients(
        torch.tensor([0, 0, 1]),
        torch.tensor([2, 5, 5]),
        torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4)),
    )
    assert torch.equal(precondition(q, None), q.grad)
    assert precondition(q, None, torch.float32).dtype == torch.float32
    H = [cur.dense(i) for i in (2, 5, 5)]
    pre = torch.stack([torch.linalg.solve(h, g) for h, g in zip(H, q.grad, strict=True)])
    torch.testing.assert_close(precondition(q, cur), pre, rtol=1e-9, atol=0)
    table = query_table(q, cur, 8, 3)
    assert table.shape == (8, 3, D) and table.dtype == torch.float64
    want_t = torch.zeros(8, 3, D, dtype=torch.float64)
    for r, (s, p) in enumerate(zip(q.seq.tolist(), q.proto.tolist(), strict=True)):
        want_t[p, s] = pre[r]
    torch.testing.assert_close(table, want_t, rtol=1e-12, atol=0)
    assert query_table(q, None, 8, 3, dtype=torch.float32).dtype == torch.float32


# ----- edge cases and contracts (each pins a behaviour the reference tests above do not reach) --------------
def test_every_tensor_is_made_on_the_inputs_device(net, shards):
    """Under a different default device (meta), every result still lives on the model's device and is unchanged:
    no tensor is created without an explicit device."""
    ex = curvature_pass(net, shards, sequences=(0, 4), exact=True)  # sparse accumulation: outside the context
    qs = _query_set(net)
    want = {}
    for name, cur in (("shared", None), ("exact", ex)):
        full = FullGradients.build(net, shards, max_sequences=4, batch_size=3, curvature=cur)
        q = query_gradients(net, qs)
        want[name] = (
            full.scores(q, 2),
            full.self_scores(),
            query_table(q, full.curvature, K, 2),
            full.curvature.apply(q.proto, q.grad),
        )
    with torch.device("meta"):
        for name, cur in (("shared", None), ("exact", ex)):
            full = FullGradients.build(net, shards, max_sequences=4, batch_size=3, curvature=cur)
            q = query_gradients(net, qs)
            got = (
                full.scores(q, 2),
                full.self_scores(),
                query_table(q, full.curvature, K, 2),
                full.curvature.apply(q.proto, q.grad),
            )
            for a, b in zip(got, want[name], strict=True):
                assert a.device.type == "cpu"
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * float(b.abs().max()))
            assert full.train.seq.device.type == "cpu" and q.seq.device.type == "cpu"
        x = _seqs(shards, 0, 2)
        bg = block_gradients(net, net(x[:, :-1]), x[:, 1:])  # default mask and sequence ids
        assert bg.seq.device.type == "cpu" and sorted(set(bg.seq.tolist())) == [0, 1]


def test_guards_on_models_outputs_and_queries(net):
    dense = PrismLM(ModelConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=D, prototypes=None))
    with pytest.raises(ModelError, match=r"^prototype-space curvature needs a PRISM model \(the dense baseline"):
        CurvatureAccumulator(dense)
    x = torch.randint(0, V, (1, 4))
    out = net(x)
    msg = r"^prototype-space gradients need a PRISM model \(the dense baseline has no prototypes\)$"
    for bad in (
        SimpleNamespace(indices=None, logits=out.logits, activations=out.activations),
        SimpleNamespace(indices=out.indices, logits=out.logits, activations=None),
    ):
        with pytest.raises(ModelError, match=msg):
            block_gradients(net, bad, x)
    with pytest.raises(ModelError, match=msg):
        block_gradients(dense, out, x)
    # a two-token query is the shortest valid one: one context token, one measured target
    q = query_gradients(net, [([3, 4], 1)])
    g, loss = query_reference(net, [3, 4], 1)
    torch.testing.assert_close(dense_blocks(q, 1)[0], g, rtol=0, atol=1e-12)
    with pytest.raises(ConfigError, match="at least two"):
        query_gradients(net, [([3, 4], 1), ([7], 1)])


def test_curvature_defaults_and_tiny_statistics(net):
    """Defaults: the accumulator is shared-mode with ρ = 0.1; with one token, m̃_i = max(m_i, 1/1) and F is
    that token's Wᵀ Σ_t W."""
    acc = CurvatureAccumulator(net)
    with torch.no_grad():
        out = net(torch.tensor([[5]]))
    acc.update(out)
    cur = acc.finish()
    assert cur.mode == "shared" and cur.tokens == 1 and cur.damping == RHO
    W = net.lm_head.weight.detach()
    p = torch.softmax(out.logits[0, 0], -1)
    Fm = W.T @ (torch.diag(p) - torch.outer(p, p)) @ W
    torch.testing.assert_close(cur.F, Fm, rtol=0, atol=1e-12)
    unseen = next(i for i in range(K) if i not in out.indices.flatten().tolist())
    H = Fm + RHO * torch.trace(Fm) / D * torch.eye(D, dtype=torch.float64)  # m̃ = max(0, 1/1) = 1
    torch.testing.assert_close(cur.dense(unseen), H, rtol=1e-10, atol=1e-12)
    seen = int(out.indices[0, 0, 0])
    m = float(out.activations[0, 0, 0]) ** 2
    torch.testing.assert_close(cur.dense(seen), max(m, 1.0) * H, rtol=1e-10, atol=1e-12)
    # many rows in few chunks (rows > d): every row is transformed
    g = torch.randn(45, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    ids = torch.full((45,), unseen)
    want = torch.linalg.solve(H, g.T).T
    torch.testing.assert_close(cur.apply(ids, g, chunk=4), want, rtol=1e-9, atol=1e-10 * float(want.abs().max()))


def test_curvature_pass_and_collect_default_to_every_sequence(net, shards):
    a = curvature_pass(net, shards)
    b = curvature_pass(net, shards, sequences=(0, N_SEQ))
    assert a.tokens == N_SEQ * T and torch.equal(a.F, b.F) and torch.equal(a.m, b.m)
    g = collect_gradients(net, shards)
    assert torch.equal(g.seq, collect_gradients(net, shards, sequences=(0, N_SEQ)).seq)


def test_full_gradients_mode_checks_and_identity_needs_no_curvature(net, shards, monkeypatch):
    with pytest.raises(ConfigError, match="curvature mode must be shared, exact or identity, got 'dense'"):
        FullGradients.build(net, shards, mode="dense")

    def no_pass(*a, **k):
        raise AssertionError("identity mode computed a curvature")

    # the damping reaches the curvature pass
    assert FullGradients.build(net, shards, max_sequences=3, damping=0.3).curvature.damping == 0.3
    monkeypatch.setattr(infl, "curvature_pass", no_pass)
    full = FullGradients.build(net, shards, max_sequences=3, mode="identity")
    assert full.curvature is None and full.num_train == 3


def test_influence_scores_dtypes_and_prototype_ranges(net, shards):
    full = FullGradients.build(net, shards, max_sequences=4)
    tr, cur = full.train, full.curvature
    g = torch.randn(2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    p_in = int(tr.proto[0])
    p_out = int(tr.proto.max()) + 3  # a query prototype beyond every training row's prototype
    q = BlockGradients(torch.tensor([0, 1]), torch.tensor([p_in, p_out]), g)
    S = influence_scores(q, tr, None, num_queries=2, num_train=4)  # identity: any prototype id is valid
    assert torch.count_nonzero(S[1]) == 0 and torch.count_nonzero(S[0]) > 0
    q = BlockGradients(torch.tensor([0, 1]), torch.tensor([p_in, int(tr.proto.min())]), g)
    # mixed precision: the scores are computed in the wider dtype of the two
    S32q = influence_scores(BlockGradients(q.seq, q.proto, g.float()), tr, cur, num_queries=2, num_train=4)
    want = influence_scores(BlockGradients(q.seq, q.proto, g.float().double()), tr, cur, num_queries=2, num_train=4)
    assert S32q.dtype == torch.float64
    torch.testing.assert_close(S32q, want, rtol=1e-12, atol=0)
    tr32 = BlockGradients(tr.seq, tr.proto, tr.grad.float())
    S32t = influence_scores(q, tr32, cur, num_queries=2, num_train=4)
    want_t = influence_scores(
        q, BlockGradients(tr.seq, tr.proto, tr.grad.float().double()), cur, num_queries=2, num_train=4
    )
    assert S32t.dtype == torch.float64
    torch.testing.assert_close(S32t, want_t, rtol=1e-12, atol=0)
    # no training rows at all: zeros of the right shape
    none = BlockGradients(
        torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, D, dtype=torch.float64)
    )
    assert torch.equal(
        influence_scores(q, none, cur, num_queries=2, num_train=4), torch.zeros(2, 4, dtype=torch.float64)
    )


def test_low_precision_logits_are_lifted_to_float32(net):
    x = torch.randint(0, V, (2, 6))
    out = net(x)
    y = torch.randint(0, V, (2, 6))
    lo = SimpleNamespace(logits=out.logits.bfloat16(), indices=out.indices, activations=out.activations.float())
    want = output_gradients(net, lo.logits.float(), y)
    u = output_gradients(net, lo.logits, y)
    assert u.dtype == torch.float32
    torch.testing.assert_close(u, want, rtol=1e-6, atol=1e-6)
    bg = block_gradients(net, lo, y)
    ref = block_gradients(
        net, SimpleNamespace(logits=lo.logits.float(), indices=out.indices, activations=out.activations.float()), y
    )
    assert bg.grad.dtype == torch.float32
    torch.testing.assert_close(bg.grad, ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bg.loss, ref.loss, rtol=1e-6, atol=1e-6)
