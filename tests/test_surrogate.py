"""prismlm.control.surrogate (controllers at a real vocabulary's scale) against the plain full-softmax scores of
``request_scores`` and the model's own forward: shared-prefix features score as the forward does, the exact
chunked scores equal the full softmax, the surrogate is exact at c = 0 and on the full vocabulary, and the
λ-selected fit lowers its loss and obeys the L1 penalty."""

from __future__ import annotations

import pytest
import torch

from prismlm.config import ModelConfig, PrototypeConfig
from prismlm.control.controller import ControlFeatures, accuracy, prism_encoder, request_scores
from prismlm.control.surrogate import (
    TOP_TOKENS,
    TaskFeatures,
    base_pass,
    build_surrogate,
    encoded,
    exact_scores,
    extract_shared_prefix,
    fit_surrogate,
    fit_surrogate_controller,
    forward_scores,
    surrogate_loss,
    surrogate_scores,
    surrogate_vocab,
)
from prismlm.model import PrismLM

V, D, K, KA = 120, 8, 12, 3


def _features(n_docs: int, seed: int) -> TaskFeatures:
    """Random scored tokens of ``n_docs`` multiple-choice examples (2 or 3 choices, 1–3 tokens each), with the
    base pass of the head ``_W()``."""
    g = torch.Generator().manual_seed(seed)
    n_choices = [2 + int(torch.randint(0, 2, (1,), generator=g)) for _ in range(n_docs)]
    R = sum(n_choices)
    lens = torch.randint(1, 4, (R,), generator=g)
    N = int(lens.sum())
    f = ControlFeatures(
        z=torch.randn(N, D, generator=g),
        indices=torch.stack([torch.randperm(K, generator=g)[:KA] for _ in range(N)]),
        activations=torch.rand(N, KA, generator=g),
        targets=torch.randint(0, V, (N,), generator=g),
        request=torch.repeat_interleave(torch.arange(R), lens),
        doc_of_request=torch.tensor([d for d, c in enumerate(n_choices) for _ in range(c)]),
        gold=torch.tensor([int(torch.randint(0, c, (1,), generator=g)) for c in n_choices]),
        choice_len=lens.double(),
        n_choices=n_choices,
        choice_text=[f"c{r}" for r in range(R)],
    )
    return TaskFeatures(**vars(f) | base_pass(f, _W()), **{})  # type: ignore[arg-type]


def _W() -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(99))


def _dirs() -> torch.Tensor:
    return torch.randn(K, D, generator=torch.Generator().manual_seed(98))


def _c(seed: int = 0) -> torch.Tensor:
    c = torch.zeros(K)
    c[[1, 4, 7]] = torch.randn(3, generator=torch.Generator().manual_seed(seed))
    return c


def test_base_pass_is_the_full_softmax():
    f = _features(6, 0)
    logp = torch.log_softmax(torch.nn.functional.linear(f.z, _W()).double(), -1)
    torch.testing.assert_close(f.base_logp, logp.gather(-1, f.targets[:, None]).squeeze(-1), rtol=0, atol=1e-5)
    assert f.top_ids.shape == (len(f.targets), TOP_TOKENS)
    assert torch.equal(f.top_ids[:, 0].long(), logp.argmax(-1))


@pytest.mark.parametrize("with_c", [False, True])
def test_exact_scores_equal_the_plain_full_softmax(with_c):
    f = _features(8, 1)
    c = _c() if with_c else None
    ref = request_scores(f, _W().double(), _dirs().double(), None if c is None else c.double())
    torch.testing.assert_close(exact_scores(f, _W(), _dirs(), c, chunk=5), ref, rtol=0, atol=1e-4)


def test_surrogate_is_exact_at_zero_and_on_the_full_vocabulary():
    f = _features(8, 2)
    S = surrogate_vocab(f, V, 10)
    assert torch.isin(f.targets, S).all() and len(S) >= 10 and torch.equal(S, S.sort().values)
    small = build_surrogate(f, _W(), _dirs(), S)
    zero = torch.zeros(K)
    torch.testing.assert_close(surrogate_scores(small, f, zero).double(), exact_scores(f, _W(), _dirs(), None),
                               rtol=0, atol=1e-4)  # fmt: skip
    full = build_surrogate(f, _W(), _dirs(), torch.arange(V))  # S = every token: the tail is ~0
    ref = exact_scores(f, _W(), _dirs(), _c(3))
    torch.testing.assert_close(surrogate_scores(full, f, _c(3)).double(), ref, rtol=0, atol=1e-4)
    assert not torch.allclose(ref, exact_scores(f, _W(), _dirs(), None))  # the controller moved the scores


def test_surrogate_fit_lowers_its_loss_and_a_large_penalty_keeps_zero():
    f = _features(20, 3)
    p = build_surrogate(f, _W(), _dirs(), surrogate_vocab(f, V, 20))
    ctl = fit_surrogate(p, f, l1=1e-4, steps=40, lr=0.1)
    assert ctl.history["final_loss"] < ctl.history["loss_first"]
    assert float(surrogate_loss(p, f, ctl.coefficients.float())) < ctl.history["loss_first"]
    assert ctl.history["loss_first"] == pytest.approx(float(surrogate_loss(p, f, torch.zeros(K))))
    assert len(fit_surrogate(p, f, l1=1e3, steps=40, lr=0.1).nonzero) == 0  # the prox keeps exact zeros


def test_lambda_is_chosen_on_validation_and_the_fidelity_is_reported():
    train, val = _features(24, 4), _features(16, 5)
    fit = fit_surrogate_controller(train, val, _W(), _dirs(), l1_grid=(1e3, 1e-4), steps=30, lr=0.1, vocab=20)
    assert [t["l1"] for t in fit.trials] == [1e3, 1e-4]
    best = max(fit.trials, key=lambda t: (t["val_acc"], -t["nonzero"]))
    assert fit.controller.l1 == best["l1"] and fit.fidelity["val_acc_surrogate"] == best["val_acc"]
    exact = accuracy(val, exact_scores(val, _W(), _dirs(), fit.controller.coefficients))["acc"]
    assert fit.fidelity["val_acc_exact"] == exact and fit.trials[0]["nonzero"] == 0


def test_shared_prefix_features_score_as_the_models_forward(tiny_shards):
    tok = tiny_shards.tokenizer
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=576, block_size=24, n_layer=1, n_head=2, n_embd=32,
                      prototypes=PrototypeConfig(num_prototypes=32, top_k=4))  # fmt: skip
    model = PrismLM(cfg).eval()
    docs = [
        {
            "id": str(i),
            "query": f"Question {i}: the sea is very" + " far" * (6 * i),
            "choices": [" blue", " dark grey", " wide"],
            "gold": i % 3,
            "label": "x",
        }
        for i in range(3)
    ]  # fmt: skip  (the last query is cut from the left to fit the window)
    W = model.lm_head.weight.detach().float()
    raw = extract_shared_prefix(model, tok, docs)
    f = encoded(TaskFeatures(**vars(raw) | base_pass(raw, W)), prism_encoder(model))  # type: ignore[arg-type]
    torch.testing.assert_close(exact_scores(f, W, model.prototypes.weight.detach(), None),
                               forward_scores(model, tok, docs), rtol=0, atol=1e-4)  # fmt: skip
    c = torch.zeros(32)
    c[f.indices[:, 0].unique()[:3]] = 1.5
    with torch.no_grad(), model.control(c):
        ref = forward_scores(model, tok, docs)
    torch.testing.assert_close(exact_scores(f, W, model.prototypes.weight.detach(), c), ref, rtol=0, atol=1e-4)
    assert not torch.allclose(ref, forward_scores(model, tok, docs), atol=1e-3)
