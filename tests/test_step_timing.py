"""``prismlm.train.step_timing`` (the bare step the throughput and quality benches time) and the timing
helpers of ``prismlm.app.speed`` and ``prismlm.eval.resources``."""

from __future__ import annotations

import pytest
import torch

from prismlm.app.speed import alternate, ratio
from prismlm.config import RunConfig
from prismlm.eval.resources import timed_call
from prismlm.model import PrismLM
from prismlm.train.step_timing import BatchSource, Runner, flops_per_token


def _cfg() -> RunConfig:
    return RunConfig.from_name("tiny").override(
        {"model.n_embd": 32, "model.n_layer": 1, "train.batch_size": 2, "train.grad_accum": 1, "train.device": "cpu"}
    )


def test_flops_per_token_is_six_n_plus_attention():
    cfg = _cfg()
    model = PrismLM(cfg.model)
    wpe = model.transformer.wpe.weight.numel()
    n = sum(p.numel() for p in model.parameters()) - wpe  # unique parameters (the tied head counted once)
    c = cfg.model
    assert flops_per_token(model) == 6 * n + 12 * c.n_layer * c.n_embd * c.block_size


def test_synthetic_batches_are_identical_for_a_seed_and_shifted_by_one():
    cfg = _cfg()
    a, b = (BatchSource(cfg, 3, torch.device("cpu"), synthetic=True, seed=7) for _ in range(2))
    for _ in range(4):  # wraps around after 3
        (xa, ya), (xb, yb) = a.next(), b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (2, cfg.model.block_size) and torch.equal(xa[:, 1:], ya[:, :-1])
    a.reset()
    assert torch.equal(a.next()[0], a.batches[0][:, :-1])


def test_runners_of_one_seed_start_equal_and_a_timed_block_records_its_rate():
    cfg = _cfg()
    data = BatchSource(cfg, 2, torch.device("cpu"), synthetic=True, seed=0)
    cfg = cfg.override({"model.vocab_size": data.vocab})
    r1, r2 = Runner("PRISM", cfg, torch.device("cpu"), 3), Runner("PRISM", cfg, torch.device("cpu"), 3)
    assert all(torch.equal(p, q) for p, q in zip(r1.model.parameters(), r2.model.parameters()))
    before = [p.detach().clone() for p in r1.model.parameters()]
    rate = r1.block(data, 2, timed=False)
    assert rate > 0 and r1.tok_s == [] and r1.peak_mem_mib > 0
    assert any(not torch.equal(p, q) for p, q in zip(before, r1.model.parameters()))  # the steps trained it
    r1.block(data, 1, timed=True)
    assert len(r1.tok_s) == 1


def test_alternate_times_every_callable_in_alternating_order_and_ratio_reads_the_medians():
    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    t = alternate(fns, repeats=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then A B / B A / A B
    assert [len(v) for v in t["seconds"].values()] == [3, 3]
    fake = {"seconds": {"n": [2.0, 4.0, 6.0], "d": [1.0, 1.0, 4.0]}, "median": {"n": 4.0, "d": 1.0}}
    r = ratio(fake, "n", "d")
    assert r == {"of_medians": 4.0, "paired_median": 2.0, "min": 1.5, "max": 4.0}


def test_timed_call_returns_the_result_and_its_time():
    out, seconds, peak = timed_call(lambda: sum(range(1000)))
    assert out == 499500 and seconds >= 0 and peak > 0
    with pytest.raises(ZeroDivisionError):
        timed_call(lambda: 1 / 0)
