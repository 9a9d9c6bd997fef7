"""One count for one thing (issue 35, item 5): a dead-prototype count always says how many tokens it was
counted on (one rule: never active over that sample) and warns when they are too few to tell; ``decompose``
after a no-grad forward returns detached values; the retrofit holds out enough validation text."""

from __future__ import annotations

import pytest
import torch
from test_control import _concept_model

from prismlm.eval.metrics import dead_text, evaluate
from prismlm.model import decompose
from prismlm.train.records import format_eval_line


def test_decompose_tracks_gradients_only_when_the_forward_did():
    model = _concept_model()
    x = torch.randint(0, 500, (1, 12))
    with torch.no_grad():
        out = model(x)
    dec = decompose(model, out, x)
    assert not dec.prototype_slices.requires_grad and not dec.residual_slice.requires_grad
    out = model(x)  # a forward with autograd: the slices stay differentiable
    dec = decompose(model, out, x)
    assert dec.prototype_slices.requires_grad
    dec.prototype_slices.sum().backward()
    assert model.prototypes.weight.grad is not None


def test_a_dead_count_says_what_it_was_counted_on(tiny_shards):
    model = _concept_model(top_k=2)
    K = model.require_prototypes().num_prototypes
    m = evaluate(model, tiny_shards.val, seq_len=16, batch_size=2, max_batches=1)
    assert m["coverage_tokens"] == m["val_tokens"] == 32
    line = format_eval_line(10, m, top_k=2)
    assert f"dead {m['dead_prototypes']} of {K} on 32 tokens" in line
    assert "too few tokens to tell" in line  # 32 tokens × 2 slots < 8 per prototype
    big = {**m, "coverage_tokens": 8 * K}
    assert "too few" not in dead_text(big, top_k=2)


def test_the_retrofit_holds_out_five_percent_and_checks_it():
    from prismlm.app.retrofit import RetrofitRecipe

    assert RetrofitRecipe().val_fraction == 0.05
    with pytest.raises(ValueError, match="val_fraction"):
        RetrofitRecipe(val_fraction=1.5).checked()
