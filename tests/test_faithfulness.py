"""Faithfulness metrics (prismlm.eval.faithfulness) against an independent float64 reference written
differently: a Python loop over tokens, ẑ rebuilt from the prototypes (not z − r), torch.distributions' KL,
numpy's eigh/lstsq for the yardsticks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from prismlm.config import ModelConfig, PrototypeConfig
from prismlm.errors import ModelError
from prismlm.eval.faithfulness import (
    FaithfulnessAccumulator,
    answer_faithfulness,
    choice_parts,
    choice_shares,
    fit_yardstick,
    prototype_prediction,
)
from prismlm.eval.metrics import CoverageAccumulator
from prismlm.model import PrismLM

V, D, K, k = 61, 24, 48, 4


def tiny_model(bias: bool = False, seed: int = 0) -> PrismLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=V,
        block_size=16,
        n_layer=1,
        n_head=2,
        n_embd=D,
        lm_head_bias=bias,
        prototypes=PrototypeConfig(num_prototypes=K, top_k=k),
    )
    model = PrismLM(cfg).double().eval()
    with torch.no_grad():  # prototypes on real hidden states, so activations are non-trivial
        z = model.backbone(torch.randint(0, V, (4, 16))).reshape(-1, D)
        model.prototypes.weight.copy_(z[torch.randperm(z.shape[0])[:K]] + 0.5 * torch.randn(K, D, dtype=z.dtype))
        if bias:
            model.lm_head.bias.copy_(torch.randn(V, dtype=z.dtype))
    return model


def forward(model: PrismLM, seed: int = 1, batch: int = 3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return model(torch.randint(0, V, (batch, 16), generator=g))


def reference(model: PrismLM, out, basis: np.ndarray, mu: np.ndarray) -> dict[str, float]:
    """Token by token, float64: ẑ = Σ_i a_i p_i from the bank, the yardsticks' projections by least squares."""
    W = model.lm_head.weight.detach().double()
    b = model.lm_head.bias.detach().double() if model.lm_head.bias is not None else torch.zeros(V, dtype=torch.float64)
    P = model.prototypes.weight.detach().double()
    B_np = torch.from_numpy(basis)
    unit = torch.from_numpy(mu / np.linalg.norm(mu))
    acc = {n: [] for n in ("top1", "kl", "gap", "gap_hat", "share", "centred", "mt", "mg", "pt", "pg", "mk", "pk")}
    for bi in range(out.hidden.shape[0]):
        for t in range(out.hidden.shape[1]):
            z = out.hidden[bi, t].double()
            zhat = sum(float(a) * P[int(i)] for i, a in zip(out.indices[bi, t], out.activations[bi, t]))
            lg, lh = out.logits[bi, t].double(), W @ zhat + b
            order = sorted(range(V), key=lambda v: -float(lg[v]))
            y1, y2 = order[0], order[1]
            acc["top1"].append(float(int(lh.argmax()) == y1))
            acc["kl"].append(float(kl_divergence(Categorical(logits=lg), Categorical(logits=lh))))
            acc["gap"].append(float(lg[y1] - lg[y2]))
            acc["gap_hat"].append(float(lh[y1] - lh[y2]))
            S, R = float(W[y1] @ zhat), float(W[y1] @ out.residual[bi, t].double())
            acc["share"].append(abs(S) / (abs(S) + abs(R) + abs(float(b[y1]))))
            acc["centred"].append(float(out.residual[bi, t].double().norm() / (z - torch.from_numpy(mu)).norm()))
            coef = np.linalg.lstsq(basis, z.numpy(), rcond=None)[0]  # projection on the span of ``basis``
            for key, zx in (("m", float(z @ unit) * unit), ("p", B_np @ torch.from_numpy(coef))):
                lx = W @ zx + b
                acc[key + "t"].append(float(int(lx.argmax()) == y1))
                acc[key + "g"].append(float(lx[y1] - lx[y2]))
                acc[key + "k"].append(float(kl_divergence(Categorical(logits=lg), Categorical(logits=lx))))
    gap = sum(acc["gap"])
    return {
        "top1_agreement": float(np.mean(acc["top1"])),
        "kl": float(np.mean(acc["kl"])),
        "margin_share": sum(acc["gap_hat"]) / gap,
        "margin_share_median": float(np.median([h / g for h, g in zip(acc["gap_hat"], acc["gap"]) if g > 0])),
        "slice_logit_share": float(np.mean(acc["share"])),
        "centred_residual_share": float(np.mean(acc["centred"])),
        "mean_dir_top1_agreement": float(np.mean(acc["mt"])),
        "mean_dir_margin_share": sum(acc["mg"]) / gap,
        "mean_dir_kl": float(np.mean(acc["mk"])),
        "pca_top1_agreement": float(np.mean(acc["pt"])),
        "pca_margin_share": sum(acc["pg"]) / gap,
        "pca_kl": float(np.mean(acc["pk"])),
    }


def numpy_yardstick(sample: torch.Tensor, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(d, 1 + m) a (non-orthonormal) basis of μ and the top m eigenvectors of the sample covariance; μ (d,)."""
    x = sample.reshape(-1, D).double().numpy()
    mu = x.mean(0)
    vals, vecs = np.linalg.eigh(np.cov(x.T, bias=True))
    return np.concatenate([mu[:, None], vecs[:, -m:]], axis=1), mu


@pytest.mark.parametrize("bias", [False, True])
def test_faithfulness_matches_a_token_by_token_reference(bias):
    model = tiny_model(bias)
    fit_out, out = forward(model, seed=7), forward(model, seed=1)
    ys = fit_yardstick(fit_out.hidden, directions=k)
    acc = FaithfulnessAccumulator(yardstick=ys)
    acc.update(model, out)
    got = acc.result()
    want = reference(model, out, *numpy_yardstick(fit_out.hidden, k))
    assert got["faithfulness_tokens"] == 48 and got["pca_directions"] == 1 + k
    for name, value in want.items():
        tol = 1e-6 if name == "margin_share_median" else 1e-9  # the median keeps float32 ratios
        assert got[name] == pytest.approx(value, rel=tol, abs=1e-10), name
    assert 0 < got["top1_agreement"] < 1 and got["kl"] > 1e-3  # a non-trivial case


def test_batch_splitting_and_chunks_do_not_change_the_sums():
    model = tiny_model(bias=True)
    out = forward(model, batch=4)
    ys = fit_yardstick(out.hidden, directions=2)
    one = FaithfulnessAccumulator(yardstick=ys)
    one.update(model, out)
    split = FaithfulnessAccumulator(yardstick=ys, chunk=5)
    for b in range(4):
        part = dataclasses.replace(
            out,
            logits=out.logits[b : b + 1],
            hidden=out.hidden[b : b + 1],
            residual=out.residual[b : b + 1],
            indices=out.indices[b : b + 1],
            activations=out.activations[b : b + 1],
        )
        split.update(model, part)
    a, b_ = one.result(), split.result()
    assert a.keys() == b_.keys()
    for name in a:
        assert b_[name] == pytest.approx(a[name], rel=1e-12, abs=1e-12), name


def _replaced(model: PrismLM, out, zhat: torch.Tensor):
    """``out`` as if the bank reconstructed ẑ = ``zhat`` (and r = z − ẑ): hidden kept, residual set."""
    return dataclasses.replace(out, residual=out.hidden - zhat)


@pytest.mark.parametrize("bias", [False, True])
def test_exact_reconstruction_and_an_empty_bank(bias):
    model = tiny_model(bias)
    out = forward(model)
    exact = FaithfulnessAccumulator()
    exact.update(model, _replaced(model, out, out.hidden))  # ẑ = z: ℓ̂ = ℓ bit for bit
    m = exact.result()
    assert m["top1_agreement"] == 1.0 and m["kl"] == pytest.approx(0.0, abs=1e-12)
    assert m["margin_share"] == pytest.approx(1.0, rel=1e-12) and m["margin_share_median"] == pytest.approx(1.0)
    assert m["centred_residual_share"] == 0.0
    empty = FaithfulnessAccumulator()
    empty.update(model, _replaced(model, out, torch.zeros_like(out.hidden)))  # ẑ = 0: ℓ̂ = b (0 without bias)
    m0 = empty.result()
    assert m0["slice_logit_share"] == 0.0
    if not bias:
        assert m0["margin_share"] == 0.0 and m0["margin_share_median"] == 0.0
    else:  # the bias is part of ℓ̂: its margin share is the bias's own
        lg = out.logits.reshape(-1, V).double()
        b = model.lm_head.bias.detach().double()
        top2 = lg.topk(2, dim=-1).indices
        want = float(
            (b[top2[:, 0]] - b[top2[:, 1]]).sum() / (lg.gather(1, top2) @ torch.tensor([1.0, -1.0]).double()).sum()
        )
        assert m0["margin_share"] == pytest.approx(want, rel=1e-12)
        assert m0["top1_agreement"] == pytest.approx(float((lg.argmax(-1) == b.argmax()).double().mean()))


def test_prototype_prediction_follows_suppression():
    """Under ``suppress`` the logits drop the suppressed slices, and so does ℓ̂: ℓ − ℓ̂ stays W r."""
    model = tiny_model()
    x = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        base = model(x)
        S = base.indices[base.activations > 0].unique()[:6].tolist()
        with model.suppress(S):
            sup = model(x)
            pred = prototype_prediction(model, sup)
    W, P = model.lm_head.weight.detach().double(), model.prototypes.weight.detach().double()
    keep = (~torch.isin(sup.indices, torch.tensor(S))).double() * sup.activations  # (B, T, k)
    zhat = torch.einsum("btk,btkd->btd", keep, P[sup.indices])
    assert torch.equal(pred, (zhat @ W.T).argmax(-1))


def test_choice_parts_are_exact_and_the_shares_read_them():
    model = tiny_model(bias=True)
    out = forward(model)
    top2 = out.logits.topk(2, dim=-1).indices  # (B, T, 2)
    p = choice_parts(model, out, top2, fit_yardstick(out.hidden, k))
    assert torch.allclose(p.slices + p.residual + p.bias, p.logit, atol=1e-10)
    assert torch.all(p.logit >= p.runner_up_logit)
    s = choice_shares(p)
    assert torch.allclose(s["abs_share_slices"] + s["abs_share_residual"] + s["abs_share_bias"], torch.ones(1).double())
    acc = FaithfulnessAccumulator(yardstick=fit_yardstick(out.hidden, k))
    acc.update(model, out)  # the accumulator's slice share is the parts' abs share, at the model's argmax
    assert acc.result()["slice_logit_share"] == pytest.approx(float(s["abs_share_slices"].mean()), rel=1e-9)


def test_residual_share_matches_a_loop_reference():
    """``CoverageAccumulator``'s residual share = mean_t ‖r_t‖/‖z_t‖ (a mutant halving it used to survive)."""
    model = tiny_model()
    outs = [forward(model, seed=s) for s in (1, 2)]
    cov = CoverageAccumulator(K)
    for o in outs:
        cov.update(o)
    ratios = [
        float(o.residual[b, t].double().norm() / o.hidden[b, t].double().norm())
        for o in outs
        for b in range(o.hidden.shape[0])
        for t in range(o.hidden.shape[1])
    ]
    assert cov.result()["residual_share"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)


def test_evaluate_reports_faithfulness_and_the_validation_line_shows_it(tiny_shards):
    from prismlm import RunConfig
    from prismlm.eval.metrics import evaluate
    from prismlm.train.records import format_eval_line

    torch.manual_seed(0)
    model = PrismLM(RunConfig.from_name("tiny").model)
    m = evaluate(model, tiny_shards.val, seq_len=32, batch_size=2, max_batches=2)
    assert m["faithfulness_tokens"] == m["val_tokens"] == 2 * 2 * 32
    for key in ("top1_agreement", "kl", "margin_share", "margin_share_median", "slice_logit_share"):
        assert np.isfinite(m[key]), key
    assert 0 <= m["top1_agreement"] <= 1 and m["kl"] >= 0 and m["centred_residual_share"] > 0
    assert 0 <= m["pca_top1_agreement"] <= 1 and m["pca_directions"] == 1 + model.config.prototypes.top_k
    line = format_eval_line(3, m)
    assert f"top1 {m['top1_agreement']:.2f} kl {m['kl']:.2f}" in line and "pca" in line


@pytest.mark.parametrize("bias", [False, True])
def test_every_explained_token_carries_the_prototype_only_prediction(bias):
    from prismlm.explain import explain

    model = tiny_model(bias)
    ids = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    expl = explain(model, None, ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    W, P = model.lm_head.weight.detach().double(), model.prototypes.weight.detach().double()
    b = model.lm_head.bias.detach().double() if bias else torch.zeros(V, dtype=torch.float64)
    differ = 0
    for t, pos in enumerate(expl.positions):
        zhat = sum(float(a) * P[int(i)] for i, a in zip(out.indices[0, t], out.activations[0, t]))
        lh = W @ zhat + b
        assert pos.prototype_top_id == int(lh.argmax()) and pos.prototype_top_token == f"<{int(lh.argmax())}>"
        assert pos.model_top_id == int(out.logits[0, t].argmax())
        assert pos.prototype_prob == pytest.approx(float(torch.softmax(lh, 0)[pos.next_id]), rel=1e-9)
        d = pos.to_dict()
        assert d["prototype_top_id"] == pos.prototype_top_id and d["model_top_id"] == pos.model_top_id
        differ += pos.prototype_top_id != pos.model_top_id
    assert 0 < differ < len(ids)  # both cases occur, so the check above is not vacuous


def test_the_reports_show_the_prototype_only_prediction():
    import io

    from rich.console import Console

    from prismlm.explain import explain
    from prismlm.render import render_html
    from prismlm.render.report import render_terminal

    model = tiny_model()
    ids = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    expl = explain(model, None, ids)
    agree = sum(p.prototype_top_id == p.model_top_id for p in expl.positions)
    assert 0 < agree < len(ids)
    buf = io.StringIO()
    render_terminal(expl, Console(file=buf, width=200))
    text = buf.getvalue()
    assert f"the prototypes alone predict the model's own token at {agree} of {len(ids)}" in text
    assert text.count("≠ '<") == len(ids) - agree  # every disagreeing row is flagged with the prototypes' token
    page = render_html(expl)
    assert page.count('class="t pdiff"') + page.count('class="t ghost pdiff"') == len(ids) - agree
    assert "prototypes alone would predict" in page and '"prototype_top_id"' in page


def test_the_index_pass_reports_faithfulness_and_parts_merge_to_one_pass(tiny_shards, tmp_path):
    from prismlm import RunConfig
    from prismlm.explain import IndexSettings, PrototypeIndex, build_index, merge_indexes
    from prismlm.train.state import round_vocab

    cfg = RunConfig.from_name("tiny").override({"model.vocab_size": round_vocab(tiny_shards.tokenizer.vocab_size)})
    torch.manual_seed(0)
    model = PrismLM(cfg.model).eval()
    kw = dict(progress=False, model_sha256="test")
    settings = dict(top_n=2, batch_size=3, max_sequences=9, sample_size=0)
    full = build_index(model, tiny_shards, IndexSettings(**settings), **kw)
    T = model.config.block_size
    ref = FaithfulnessAccumulator(yardsticks=False, median_cap=0)  # the same tokens, one forward per sequence
    with torch.no_grad():
        for j in range(9):
            x = torch.from_numpy(tiny_shards.train.sequences(np.array([j]), T)[:, :-1])
            ref.update(model, model(x))
    cov, want = full.coverage(), ref.result()
    assert cov["faithfulness_tokens"] == 9 * T and "centred_residual_share" not in cov
    for name in ("top1_agreement", "kl", "margin_share", "slice_logit_share"):
        assert cov[name] == pytest.approx(want[name], rel=1e-6), name
    parts = [build_index(model, tiny_shards, IndexSettings(**settings, part=(i, 3)), **kw) for i in range(3)]
    merged = merge_indexes(parts)
    full.save(tmp_path / "idx")
    for other in (merged.coverage(), PrototypeIndex.load(tmp_path / "idx").coverage()):
        for name in ("top1_agreement", "kl", "margin_share", "faithfulness_tokens"):
            assert other[name] == pytest.approx(cov[name], rel=1e-12), name


def test_the_pure_functions_against_torch_distributions_and_sorting():
    from prismlm.eval.faithfulness import kl, margins, top1_agreement

    g = torch.Generator().manual_seed(0)
    lg, ap = torch.randn(20, V, generator=g) * 3, torch.randn(20, V, generator=g) * 3
    want = kl_divergence(Categorical(logits=lg.double()), Categorical(logits=ap.double()))
    assert torch.allclose(kl(lg, ap), want, rtol=1e-10)
    assert torch.equal(top1_agreement(lg, lg + 1e-3 * ap), lg.argmax(-1) == (lg + 1e-3 * ap).argmax(-1))
    gap, gap_hat = margins(lg, ap)
    for t in range(20):
        order = sorted(range(V), key=lambda v: -float(lg[t, v]))
        assert float(gap[t]) == pytest.approx(float(lg[t, order[0]] - lg[t, order[1]]))
        assert float(gap_hat[t]) == pytest.approx(float(ap[t, order[0]] - ap[t, order[1]]))


def test_answer_faithfulness_scores_only_the_answer_positions():
    """Chats of different lengths, one forward each: the same sums as the answer positions picked by hand from
    a separate forward of each chat, and a changed answer changes the result while prompt-only edits that keep
    the answer's context do not enter the count."""
    model = tiny_model()
    g = torch.Generator().manual_seed(5)
    chats = [(torch.randint(0, V, (n,), generator=g).tolist(), p) for n, p in ((12, 5), (16, 9), (7, 2))]
    ref = fit_yardstick(forward(model).hidden, k)
    got = answer_faithfulness(model, chats, FaithfulnessAccumulator(yardstick=ref)).result()
    want = FaithfulnessAccumulator(yardstick=ref)
    for ids, p in chats:
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        sl = slice(p - 1, len(ids) - 1)  # the positions whose next token is an answer token
        want.update(model, dataclasses.replace(
            out, logits=out.logits[:, sl], hidden=out.hidden[:, sl], residual=out.residual[:, sl],
            indices=out.indices[:, sl], activations=out.activations[:, sl],
        ))  # fmt: skip
    assert got["faithfulness_tokens"] == sum(len(ids) - p for ids, p in chats) == want.tokens
    for key, value in want.result().items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    shifted = answer_faithfulness(model, [(ids, p + 1) for ids, p in chats], FaithfulnessAccumulator(yardstick=ref))
    assert shifted.tokens == want.tokens - len(chats)
    with pytest.raises(ModelError, match="cannot have a prompt of 7"):
        answer_faithfulness(model, [(chats[2][0], 7)], FaithfulnessAccumulator(yardstick=ref))
