"""Model identities, loss references, and basic learning behaviour (tiny configs, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prismlm import ModelConfig, PrismLM, PrototypeConfig, RunConfig, decompose
from prismlm.config import LossConfig, TrainConfig
from prismlm.errors import ConfigError
from prismlm.model import losses as L
from prismlm.model.prototypes import PrototypeLayer


def tiny_model_config(**proto) -> ModelConfig:
    return ModelConfig(
        vocab_size=97,
        block_size=32,
        n_layer=2,
        n_head=2,
        n_embd=32,
        prototypes=PrototypeConfig(**{"num_prototypes": 64, "top_k": 4, **proto}),
    )


def test_logits_equal_prototype_slices_plus_residual_float64():
    torch.manual_seed(0)
    model = PrismLM(tiny_model_config()).double().eval()
    # make activations non-trivial: place prototypes on real hidden states plus noise
    x = torch.randint(0, 97, (3, 32))
    with torch.no_grad():
        z = model.backbone(x).reshape(-1, 32)
        model.prototypes.weight.copy_(
            z[torch.randperm(z.shape[0])[:64]] + 0.3 * torch.randn(64, 32, dtype=torch.float64)
        )
    out = model(x)
    assert (out.activations > 0).any()
    for tokens in (x, torch.randint(0, 97, (3, 32))):  # actual next tokens and arbitrary tokens
        dec = decompose(model, out, tokens)
        torch.testing.assert_close(dec.prototype_slices.sum(-1) + dec.residual_slice, dec.logit, rtol=0, atol=1e-10)
    # the full logit vector too: ℓ = W r + Σ a_i W p_i
    sig = model.signatures()  # (K, V)
    full = model.lm_head(out.residual) + torch.einsum("btk,btkv->btv", out.activations, sig[out.indices])
    torch.testing.assert_close(full, out.logits, rtol=0, atol=1e-10)


def _full_cosines(z: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """(N, K) cos(z_t, p_i) from explicitly normalised vectors (independent of the layer's code)."""
    zn = torch.stack([v / torch.sqrt((v * v).sum()) for v in z])
    pn = torch.stack([v / torch.sqrt((v * v).sum()) for v in P])
    return zn @ pn.T


def test_prototype_layer_exact_topk_relu_cosines_float64():
    """k non-zeros per token, indices by decreasing cosine, a = ReLU(cos) of the selected prototypes."""
    torch.manual_seed(1)
    N, d, K, k = 40, 32, 64, 5
    z = torch.randn(N, d, dtype=torch.float64)
    layer = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k, chunk_size=16)).double()
    with torch.no_grad():
        layer.weight.mul_(torch.rand(K, 1, dtype=torch.float64) * 3 + 0.1)  # norms differ: cos ≠ dot product
    out = layer(z)
    cos = _full_cosines(z, layer.weight.detach())
    order = cos.argsort(dim=-1, descending=True)
    assert out.indices.dtype == torch.int64 and out.indices.shape == (N, k)
    assert torch.equal(out.indices, order[:, :k])  # the top-k, sorted by decreasing cosine (PrototypeOutput doc)
    sel = cos.gather(1, out.indices)
    assert (sel.diff(dim=-1) <= 0).all()
    assert (sel > 0).all()  # with K=64 random directions every token's top 5 cosines are positive ...
    assert ((out.activations > 0).sum(-1) == k).all()  # ... so exactly k non-zeros per token
    assert (out.activations >= 0).all() and out.activations.dtype == torch.float64
    torch.testing.assert_close(out.activations, torch.relu(sel), rtol=0, atol=1e-14)
    recon = torch.stack(
        [sum(out.activations[t, s] * layer.weight[out.indices[t, s]] for s in range(k)) for t in range(N)]
    ).detach()
    torch.testing.assert_close(out.reconstruction, recon, rtol=0, atol=1e-13)
    assert torch.equal(out.residual, z - out.reconstruction)  # z = ẑ + r exactly
    torch.testing.assert_close(out.token_max_cos, cos.max(1).values, rtol=0, atol=1e-14)
    torch.testing.assert_close(out.proto_max_cos, cos.max(0).values, rtol=0, atol=1e-14)
    assert torch.equal(out.proto_argmax, cos.argmax(0))
    # tokens anti-aligned with every prototype: still k indices, all activations exactly 0, r = z
    pos = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k)).double()
    with torch.no_grad():
        pos.weight.copy_(torch.rand(K, d, dtype=torch.float64) + 0.05)  # positive orthant
    neg = -torch.rand(3, d, dtype=torch.float64) - 0.05
    o = pos(neg)
    assert o.indices.shape == (3, k) and torch.equal(
        o.indices, _full_cosines(neg, pos.weight.detach()).argsort(-1, descending=True)[:, :k]
    )
    assert (o.activations == 0).all() and torch.equal(o.residual, neg)
    # low precision (bf16 bank and inputs) is decomposed in float32 (spec §6: selection and cosines in fp32)
    lo = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k)).bfloat16()
    zb = z.bfloat16()
    ob = lo(zb)
    assert ob.activations.dtype == torch.float32 and ob.residual.dtype == torch.float32
    cos_b = _full_cosines(zb.double(), lo.weight.detach().double())
    assert torch.equal(ob.indices, cos_b.argsort(dim=-1, descending=True)[:, :k])
    torch.testing.assert_close(ob.activations.double(), torch.relu(cos_b.gather(1, ob.indices)), rtol=1e-6, atol=1e-6)


def test_prototype_layer_gradients_equal_a_dense_reference():
    """REC, R1 and R2 gradients w.r.t. P and z equal autograd through the N × K definitions (top-k fixed)."""
    torch.manual_seed(11)
    N, d, K, k = 30, 32, 64, 4
    z0 = torch.randn(N, d, dtype=torch.float64)
    layer = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k, chunk_size=8)).double()
    z = z0.clone().requires_grad_(True)
    out = layer(z)
    loss = (
        L.reconstruction_loss(out.residual, z) + 0.7 * L.r1_loss(out.proto_max_cos) + 0.3 * L.r2_loss(out.token_max_cos)
    )
    gP, gz = torch.autograd.grad(loss, [layer.weight, z])
    P = layer.weight.detach().clone().requires_grad_(True)
    z2 = z0.clone().requires_grad_(True)
    cos = (z2 / z2.norm(dim=-1, keepdim=True)) @ (P / P.norm(dim=-1, keepdim=True)).T  # (N, K)
    top = cos.detach().topk(k, dim=-1).indices
    a = torch.zeros(N, K, dtype=torch.float64).scatter(1, top, 1.0) * torch.relu(cos)  # dense a, zeros off top-k
    r = z2 - a @ P
    ref = (
        ((r**2).sum(-1) / (z2**2).sum(-1)).mean()
        + 0.7 * (1 - cos.max(0).values).mean()
        + 0.3 * (1 - cos.max(1).values).mean()
    )
    rP, rz = torch.autograd.grad(ref, [P, z2])
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-13, atol=0)
    torch.testing.assert_close(gP, rP, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(gz, rz, rtol=1e-10, atol=1e-13)


def test_r1_gives_gradient_to_prototypes_never_selected():
    """R1 (prototype → data) pulls every prototype toward its nearest token, also one in no top-k."""
    torch.manual_seed(12)
    d, K, k = 32, 64, 2
    z = torch.randn(20, d, dtype=torch.float64)
    layer = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k)).double()
    with torch.no_grad():
        layer.weight[:40].copy_(z.repeat(2, 1) + 0.01 * torch.randn(40, d, dtype=torch.float64))  # 2 near each token
    out = layer(z)
    unused = sorted(set(range(K)) - set(out.indices.flatten().tolist()))
    assert len(unused) >= 10
    L.r1_loss(out.proto_max_cos).backward()
    g = layer.weight.grad
    assert (g[unused].norm(dim=-1) > 0).all()
    # the gradient moves each unused prototype toward its best token: cos rises along −g
    with torch.no_grad():
        p = layer.weight[unused]
        zt = z[out.proto_argmax[unused]]
        before = F.cosine_similarity(p, zt)
        after = F.cosine_similarity(p - 1e-3 * g[unused], zt)
    assert (after > before).all()
    # R2 and REC give an unused prototype no gradient (they only see the selected ones)
    layer.weight.grad = None
    (L.r2_loss(layer(z).token_max_cos) + L.reconstruction_loss(layer(z).residual, z)).backward()
    assert (layer.weight.grad[unused] == 0).all()


def test_loss_functions_edge_cases():
    # REC: a zero hidden state is divided by eps, not by 0; float64 stays float64 (no float32 rounding)
    r = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    h = torch.tensor([[0.0, 0.0], [0.0, 1.0 + 1e-9]], dtype=torch.float64)
    want = (25.0 / 1e-8 + 1.0 / (1.0 + 1e-9) ** 2) / 2
    assert L.reconstruction_loss(r, h).item() == pytest.approx(want, rel=1e-15)
    r32, hb = torch.randn(6, 8), torch.randn(6, 8).bfloat16()  # a bf16 hidden state is lifted to fp32 first
    want32 = (r32.pow(2).sum(-1) / hb.float().pow(2).sum(-1)).mean()
    assert L.reconstruction_loss(r32, hb).item() == pytest.approx(want32.item(), rel=1e-6)
    assert L.reconstruction_loss(r, h, eps=1.0).item() == pytest.approx((25.0 + 1.0 / (1.0 + 1e-9) ** 2) / 2, rel=1e-15)
    # R1 / R2 are means of 1 − max cos
    assert L.r1_loss(torch.tensor([1.0, 0.5, -1.0])).item() == pytest.approx((0 + 0.5 + 2.0) / 3)
    assert L.r2_loss(torch.tensor([0.25, 0.75])).item() == pytest.approx(0.5)
    # CE: ignore_index −1 by default, targets of any shape, bf16 logits computed in fp32
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    y = torch.tensor([[0, -1, 4], [2, 2, -1]])
    keep = y.reshape(-1) != -1
    lp = torch.log_softmax(logits.reshape(-1, 5), -1)[keep]
    want_ce = -lp[torch.arange(int(keep.sum())), y.reshape(-1)[keep]].mean()
    assert L.cross_entropy(logits, y).item() == pytest.approx(want_ce.item(), rel=1e-14)
    y7 = torch.where(y == -1, 7, y)
    assert L.cross_entropy(logits, torch.where(y == -1, -7, y), ignore_index=-7).item() == pytest.approx(want_ce.item())
    assert L.cross_entropy(logits, y7.clamp_max(4)).item() != pytest.approx(want_ce.item())
    assert L.cross_entropy(logits.bfloat16(), y.clamp_min(0)).dtype == torch.float32
    # total: ce weighted by weights["ce"] (default 1), other terms only with a non-zero weight
    terms = {"ce": torch.tensor(2.0), "rec": torch.tensor(3.0), "r1": torch.tensor(5.0), "r2": torch.tensor(7.0)}
    assert L.total_loss(terms, {}).item() == 2.0
    assert L.total_loss(terms, {"ce": 0.5, "rec": 2.0, "r1": 0.0}).item() == 1.0 + 6.0
    assert L.total_loss(terms, {"r2": -1.0, "r1": 0.1}).item() == pytest.approx(2.0 - 7.0 + 0.5)
    assert L.total_loss({"ce": torch.tensor(2.0)}, {"rec": 4.0}).item() == 2.0


def naive_prototype_reference(z: torch.Tensor, P: torch.Tensor, k: int):
    """Loop-based reference of the spec's formulas, for small N and K."""
    N, K = z.shape[0], P.shape[0]
    cos = torch.empty(N, K, dtype=z.dtype)
    for t in range(N):
        for i in range(K):
            cos[t, i] = torch.dot(z[t], P[i]) / (z[t].norm() * P[i].norm())
    recon = torch.zeros_like(z)
    for t in range(N):
        top = torch.topk(cos[t], k).indices
        for i in top:
            recon[t] += torch.relu(cos[t, i]) * P[i]
    r = z - recon
    rec = torch.stack([r[t].pow(2).sum() / z[t].pow(2).sum() for t in range(N)]).mean()
    r1 = torch.stack([min(1 - cos[t, i] for t in range(N)) for i in range(K)]).mean()
    r2 = torch.stack([min(1 - cos[t, i] for i in range(K)) for t in range(N)]).mean()
    return recon, rec, r1, r2


@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_losses_match_naive_reference(chunk_size):
    torch.manual_seed(2)
    N, K, d, k = 23, 11, 8, 3
    z = torch.randn(N, d, dtype=torch.float64)
    layer = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k, chunk_size=chunk_size)).double()
    out = layer(z)
    recon, rec, r1, r2 = naive_prototype_reference(z, layer.weight.detach(), k)
    torch.testing.assert_close(out.reconstruction, recon)
    torch.testing.assert_close(L.reconstruction_loss(out.residual, z), rec)
    torch.testing.assert_close(L.r1_loss(out.proto_max_cos), r1)
    torch.testing.assert_close(L.r2_loss(out.token_max_cos), r2)
    logits, targets = torch.randn(5, 7, dtype=torch.float64), torch.randint(0, 7, (5,))
    ce_ref = torch.stack([-torch.log_softmax(logits[i], -1)[targets[i]] for i in range(5)]).mean()
    torch.testing.assert_close(L.cross_entropy(logits, targets), ce_ref)


def test_loss_gradients_reach_prototypes_and_backbone():
    torch.manual_seed(3)
    model = PrismLM(tiny_model_config())
    x = torch.randint(0, 97, (2, 32))
    out = model(x, x, loss_weights=LossConfig().weights_at(10))
    for name in ("rec", "r1", "r2"):
        model.zero_grad()
        out2 = model(x, x)
        out2.losses[name].backward()
        assert model.prototypes.weight.grad.abs().sum() > 0, name
        assert model.transformer.h[0].mlp.c_fc.weight.grad.abs().sum() > 0, name
    assert set(out.losses) == {"ce", "rec", "r1", "r2"}


def test_dense_baseline_matches_backbone_and_has_no_prototypes():
    cfg = tiny_model_config()
    torch.manual_seed(4)
    prism = PrismLM(cfg)
    torch.manual_seed(4)
    dense = PrismLM(ModelConfig(**{**cfg.__dict__, "prototypes": None}))
    x = torch.randint(0, 97, (2, 32))
    assert dense.num_parameters() == prism.num_parameters(prototypes=False)
    assert prism.num_parameters() - dense.num_parameters() == 64 * 32  # overhead d·K
    out = dense(x, x)
    assert out.indices is None and set(out.losses) == {"ce"}
    torch.testing.assert_close(out.logits, prism(x).logits)  # same backbone init → same logits


def test_overfits_tiny_batch():
    torch.manual_seed(5)
    model = PrismLM(tiny_model_config())
    x = torch.randint(0, 97, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    weights = LossConfig(lambda_rec=0.5, lambda_r1=0.05, lambda_r2=0.05).weights_at(0)
    first = None
    for _ in range(150):
        out = model(x[:, :-1], x[:, 1:], loss_weights=weights)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else out.losses["ce"].item()
    assert out.losses["ce"].item() < 0.2 * first
    assert float(out.losses["rec"].detach()) < 0.7  # prototypes learned to reconstruct part of z


def test_chunked_selection_equals_unchunked():
    torch.manual_seed(6)
    z = torch.randn(50, 16)
    a = PrototypeLayer(16, PrototypeConfig(num_prototypes=30, top_k=4, chunk_size=7))
    b = PrototypeLayer(16, PrototypeConfig(num_prototypes=30, top_k=4, chunk_size=1000))
    b.load_state_dict(a.state_dict())
    oa, ob = a(z), b(z)
    assert torch.equal(oa.indices, ob.indices) and torch.equal(oa.proto_argmax, ob.proto_argmax)
    torch.testing.assert_close(oa.residual, ob.residual)


def test_chunk_size_is_chosen_from_available_memory(monkeypatch):
    """chunk_size=None: the (chunk × K) block stays within 1/8 of the available memory and the CPU cap, at
    least 64 rows, at most the tokens there are; selection is the same as one unchunked pass."""
    from prismlm.model import prototypes as P

    cpu = torch.device("cpu")
    monkeypatch.setattr(P, "_AVAILABLE", {"cpu": 64 * 2**20})  # 64 MiB free → 2^21 float32 entries
    assert P.auto_chunk_size(10_000, 16_384, cpu) == 2**21 // 16_384 == 128
    assert P.auto_chunk_size(10_000, 16_384, cpu, element_bytes=8) == 64  # float64 blocks take twice the bytes
    assert P.auto_chunk_size(100, 512, cpu) == 100  # never more rows than tokens
    monkeypatch.setattr(P, "_AVAILABLE", {"cpu": 2**40})  # plenty: the CPU cap (2^22 entries) decides
    assert P.auto_chunk_size(10_000, 16_384, cpu) == 2**22 // 16_384 == 256
    monkeypatch.setattr(P, "_AVAILABLE", {"cpu": 2**10})  # almost nothing: still 64 rows per block
    assert P.auto_chunk_size(10_000, 16_384, cpu) == 64

    torch.manual_seed(8)
    z = torch.randn(300, 16)
    auto = PrototypeLayer(16, PrototypeConfig(num_prototypes=40, top_k=4))
    assert auto.cfg.chunk_size is None and auto.chunk_size_for(300, cpu) == 64  # five blocks over 300 tokens
    whole = PrototypeLayer(16, PrototypeConfig(num_prototypes=40, top_k=4, chunk_size=4096))
    whole.load_state_dict(auto.state_dict())
    oa, ob = auto(z), whole(z)
    assert torch.equal(oa.indices, ob.indices) and torch.equal(oa.proto_argmax, ob.proto_argmax)
    torch.testing.assert_close(oa.activations, ob.activations, rtol=0, atol=0)


def test_outputs_do_not_depend_on_batch_composition():
    torch.manual_seed(7)
    model = PrismLM(tiny_model_config()).double().eval()
    x = torch.randint(0, 97, (4, 32))
    full = model(x)
    for i in range(4):
        one = model(x[i : i + 1])
        torch.testing.assert_close(one.logits[0], full.logits[i])
        assert torch.equal(one.indices[0], full.indices[i])


def test_generate_shapes_and_context_crop():
    torch.manual_seed(8)
    model = PrismLM(tiny_model_config()).eval()
    y = model.generate(torch.zeros(2, 30, dtype=torch.long), 10, temperature=0.0)
    assert y.shape == (2, 40)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_config_validation_and_unknown_keys():
    with pytest.raises(ConfigError, match="unknown key"):
        RunConfig.from_dict({"model": {"n_embed": 3}})
    with pytest.raises(ConfigError, match="top_k"):
        PrototypeConfig(num_prototypes=4, top_k=5)
    with pytest.raises(ConfigError, match="must divide"):
        ModelConfig(n_embd=30, n_head=4)
    with pytest.raises(ConfigError, match="unknown preset"):
        RunConfig.from_name("huge")
    cfg = RunConfig.from_name("tiny").override({"train.lr": 1e-4, "model.prototypes.top_k": 2})
    assert cfg.train.lr == 1e-4 and cfg.model.prototypes.top_k == 2
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.dense().model.prototypes is None
    assert cfg.dense().override({"model.prototypes.num_prototypes": 8}).model.prototypes.num_prototypes == 8


def test_schedules():
    tc = TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert tc.lr_at(0) == pytest.approx(0.1) and tc.lr_at(9) == pytest.approx(1.0)
    assert tc.lr_at(99) == pytest.approx(0.1, abs=1e-3)
    wsd = TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert wsd.lr_at(50) == 1.0 and wsd.lr_at(90) == pytest.approx(0.5)
    lc = LossConfig(lambda_rec=1.0, warmup_steps=10)
    assert lc.weights_at(0)["rec"] == pytest.approx(0.1) and lc.weights_at(100)["rec"] == 1.0


def test_presets_parameter_counts():
    """The paper's reference point: a 124M GPT-2 with K = 8,192 prototypes has ≈130M parameters."""
    with torch.device("meta"):
        m = PrismLM(RunConfig.from_name("gpt2-124m").model)
    assert 124e6 < m.num_parameters(prototypes=False) < 125e6
    assert 130e6 < m.num_parameters() < 131.5e6


def test_prototype_layer_ignores_autocast_same_topk_and_exact_reconstruction():
    """Under CPU bf16 autocast the layer computes in float32: the same top-k, activations and residual as
    without autocast, bit for bit, and z = ẑ + r to float32 precision."""
    from prismlm.config import PrototypeConfig
    from prismlm.model.prototypes import PrototypeLayer

    torch.manual_seed(0)
    layer = PrototypeLayer(64, PrototypeConfig(num_prototypes=256, top_k=8, init_std=1.0))
    z = torch.randn(96, 64)
    ref = layer(z)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(z)
    assert got.activations.dtype == torch.float32 and got.residual.dtype == torch.float32
    assert torch.equal(got.indices, ref.indices)
    assert torch.equal(got.activations, ref.activations) and torch.equal(got.residual, ref.residual)
    torch.testing.assert_close(got.reconstruction + got.residual, z, rtol=0, atol=1e-5)


def _reference_prototype_layer(layer: PrototypeLayer, z: torch.Tensor) -> dict[str, torch.Tensor]:
    """The previous formulation of the layer (gather (N, k, d) + einsums + column ``max(dim=0)``), kept here
    to pin the sparse head: same selections, same values, same gradients."""
    p = layer.weight
    z_unit = F.normalize(z, dim=-1)
    p_norm = p.norm(dim=-1).clamp_min(1e-12)
    p_unit = p / p_norm[:, None]
    with torch.no_grad():
        sim = z_unit @ p_unit.T
        indices = sim.topk(layer.cfg.top_k, dim=-1).indices
        proto_argmax = sim.max(dim=0).indices
    p_sel = p[indices]
    cos = torch.einsum("nd,nkd->nk", z_unit, p_sel) / p_norm[indices]
    activations = F.relu(cos)
    reconstruction = torch.einsum("nk,nkd->nd", activations, p_sel)
    return dict(
        indices=indices,
        activations=activations,
        reconstruction=reconstruction,
        residual=z - reconstruction,
        token_max_cos=cos[:, 0],
        proto_max_cos=(p_unit * z_unit[proto_argmax]).sum(-1),
        proto_argmax=proto_argmax,
    )


@pytest.mark.parametrize("chunk_size,argmax_block", [(5, 2**20), (4096, 2**20), (4096, 60)])
def test_sparse_head_equals_gather_einsum_reference_values_and_gradients_float64(chunk_size, argmax_block, monkeypatch):
    """The sparse head (cosines from the similarity pass, CSR products, first-maximiser column argmax) gives
    the outputs and the gradients of the gather + einsum formulation, with duplicate tokens (ties in the
    column maxima) and prototypes whose cosines are negative (ReLU zeros)."""
    monkeypatch.setattr("prismlm.model.prototypes._ARGMAX_BLOCK", argmax_block)  # 60 → row blocks of 2 tokens
    torch.manual_seed(3)
    N, d, K, k = 37, 12, 29, 14
    layer = PrototypeLayer(d, PrototypeConfig(num_prototypes=K, top_k=k, chunk_size=chunk_size)).double()
    z0 = torch.randn(N, d, dtype=torch.float64)
    z0[20] = z0[3]  # exact ties: prototype best tokens must be the first maximiser, as max(dim=0) gives
    z0[31] = z0[3]
    with torch.no_grad():
        layer.weight[:6] = 2.5 * z0[[3, 7, 11, 20, 24, 31]]
    gw = {
        name: torch.randn(shape, dtype=torch.float64)
        for name, shape in [
            ("activations", (N, k)),
            ("reconstruction", (N, d)),
            ("residual", (N, d)),
            ("token_max_cos", (N,)),
            ("proto_max_cos", (K,)),
        ]
    }
    results = []
    for fn in (lambda zz: vars(layer(zz)), lambda zz: _reference_prototype_layer(layer, zz)):
        z = z0.clone().requires_grad_(True)
        layer.weight.grad = None
        out = fn(z)
        loss = sum((out[name] * g).sum() for name, g in gw.items())
        loss.backward()
        results.append((out, z.grad.clone(), layer.weight.grad.clone()))
    (new, gz_new, gp_new), (ref, gz_ref, gp_ref) = results
    assert (ref["activations"] == 0).any() and (ref["activations"] > 0).any()
    assert torch.equal(new["indices"], ref["indices"]) and torch.equal(new["proto_argmax"], ref["proto_argmax"])
    assert new["proto_argmax"][0].item() == 3  # tie among tokens 3, 20, 31 → the first
    for name in gw:
        torch.testing.assert_close(new[name], ref[name], rtol=0, atol=1e-13)
    torch.testing.assert_close(gz_new, gz_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gp_new, gp_ref, rtol=0, atol=1e-12)


def test_sparse_pattern_products_equal_dense_and_fallback():
    """The CSR products of the head equal the dense gather / index_add formulas (and the non-CPU/CUDA
    fallback path computes the same)."""
    from prismlm.model.prototypes import _Pattern

    torch.manual_seed(0)
    N, K, k, d = 23, 17, 4, 6
    indices = torch.stack([torch.randperm(K)[:k] for _ in range(N)])
    v, p, zz = (
        torch.randn(N, k, dtype=torch.float64),
        torch.randn(K, d, dtype=torch.float64),
        torch.randn(N, d, dtype=torch.float64),
    )
    dense = torch.zeros(N, K, dtype=torch.float64).scatter_(1, indices, v)  # the N × K matrix S
    for sparse in (True, False):
        pat = _Pattern(indices, K)
        if not sparse:
            pat.sparse = False
        torch.testing.assert_close(pat.mm(v, p), dense @ p, rtol=0, atol=1e-13)
        torch.testing.assert_close(pat.t_mm(v, zz), dense.T @ zz, rtol=0, atol=1e-13)
        torch.testing.assert_close(pat.sampled(zz, p), (zz @ p.T).gather(1, indices), rtol=0, atol=1e-13)


def test_hidden_states_attentions_and_inputs_embeds_float64():
    """``output_hidden_states``: the embedding output, then each block's output, the last one after the final
    norm — the z the head reads (logits = lm_head(hidden_states[-1])). ``output_attentions``: each layer's
    softmax(q kᵀ/√hs) under the causal mask, recomputed here from the layer's own projections; asking for
    them leaves the logits as they are. ``inputs_embeds = wte(ids)`` gives the logits of ``ids``."""
    torch.manual_seed(0)
    model = PrismLM(tiny_model_config()).double().eval()
    tr = model.transformer
    x = torch.randint(0, 97, (2, 11))
    T = x.shape[1]
    plain = model(x)
    assert plain.hidden_states is None and plain.attentions is None
    with torch.no_grad():
        out = model(x, output_hidden_states=True, output_attentions=True)
        hs = out.hidden_states
        assert len(hs) == model.config.n_layer + 1 and all(h.shape == (2, T, 32) for h in hs)
        torch.testing.assert_close(hs[0], tr.wte(x) + tr.wpe(torch.arange(T)), rtol=0, atol=0)
        torch.testing.assert_close(hs[1], tr.h[0](hs[0]), rtol=0, atol=1e-12)
        torch.testing.assert_close(hs[2], tr.ln_f(tr.h[1](hs[1])), rtol=0, atol=1e-12)
        assert torch.equal(hs[-1], out.hidden)
        assert torch.equal(model.lm_head(hs[-1]), out.logits)
        torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=1e-12)
        assert len(out.attentions) == model.config.n_layer
        for layer, (att, h) in enumerate(zip(out.attentions, hs)):
            blk = tr.h[layer]
            q, k, _ = blk.attn.c_attn(blk.ln_1(h)).split(32, dim=2)  # (B, T, C) each
            q, k = (t.view(2, T, 2, 16).transpose(1, 2) for t in (q, k))  # (B, nh, T, hs)
            scores = (q @ k.transpose(-2, -1)) / 4.0  # √16
            want = torch.softmax(scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1)
            assert att.shape == (2, 2, T, T)
            torch.testing.assert_close(att, want, rtol=0, atol=1e-12)
        emb = model(None, inputs_embeds=tr.wte(x))
        torch.testing.assert_close(emb.logits, plain.logits, rtol=0, atol=1e-12)
        assert torch.equal(emb.indices, plain.indices)


def test_scale_and_control_take_id_value_mappings_and_check_at_construction():
    """``Scale({id: factor})`` and ``Control({id: c})`` (the web API's form) mean the (K,) tensors with those
    entries (the rest 1, resp. 0): the same logits; bad arguments fail when the value is made, naming
    the class, not later with an AttributeError."""
    from prismlm.errors import ModelError, UnknownPrototypeError
    from prismlm.model import Control, Scale, Suppress

    torch.manual_seed(0)
    model = PrismLM(tiny_model_config()).double().eval()
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        ids = model(x).indices[..., 0].flatten().unique()[:2].tolist()  # prototypes that fire here
        f, c = torch.ones(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
        f[ids[0]], f[ids[1]] = 2.0, 0.5
        c[ids[1]] = -0.75
        with model.intervene(Scale(f), Control(c)) as m:
            want = m(x).logits
        with model.intervene(Scale({ids[0]: 2.0, str(ids[1]): 0.5}), Control({ids[1]: -0.75})) as m:
            got = m(x).logits
        assert torch.equal(got, want)
        assert (got - model(x).logits).abs().max().item() > 1e-3  # the mapping did change the logits
    assert Scale({3: 2, 1: 0.5}).factors == {1: 0.5, 3: 2.0} and Suppress(torch.tensor([4, 2])).ids == (4, 2)
    for bad, match in (
        (lambda: Scale({"a": 2.0}), "Scale: prototype ids"),
        (lambda: Scale({1: "x"}), "finite"),
        (lambda: Control({-1: 1.0}), "Control: prototype ids"),
        (lambda: Scale({1: float("nan")}), "finite"),
        (lambda: Scale(torch.ones(2, 2)), "1-D"),
        (lambda: Scale("2.0"), "mapping"),
        (lambda: Suppress({1: 0.0}), "Scale\\(\\{id: factor\\}\\)"),
        (lambda: Suppress([1.5]), "integers"),
    ):
        with pytest.raises(ModelError, match=match):
            bad()
    with pytest.raises(UnknownPrototypeError, match="64 prototypes"), model.intervene(Scale({64: 2.0})):
        pass


class _CharCodec:
    """A stand-in tokenizer: one id per character (mod 96, +1), eot 0."""

    eot_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % 96 + 1 for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - 1 + 32) if i else "<eot>" for i in ids)


def test_generate_takes_text_with_an_attached_tokenizer_or_says_what_to_call():
    from prismlm.errors import ModelError

    torch.manual_seed(0)
    model = PrismLM(tiny_model_config()).eval()
    with pytest.raises(ModelError, match="no tokenizer is attached") as e:
        model.generate("Hello", 3)
    assert "model.generate(torch.tensor([tok.encode(text)]), n)" in (e.value.fix or "")
    codec = _CharCodec()
    model.tokenizer = codec
    ids = model.generate(torch.tensor([codec.encode("Hello")]), 6, temperature=0)
    assert model.generate("Hello", 6, temperature=0) == "Hello" + codec.decode(ids[0, 5:].tolist())
    assert model.generate("", 2, temperature=0) == codec.decode(
        model.generate(torch.tensor([[0]]), 2, temperature=0)[0, 1:].tolist()
    )
