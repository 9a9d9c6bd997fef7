"""KV-cached forward and generation of the built-in GPT: every cached logit equals the uncached one, greedy and
sampled generation give the same tokens with and without the cache (also past block_size), interventions
apply on the cached path, and a transformers ``DynamicCache`` works in place of ``KVCache`` (tiny configs,
random init, CPU)."""

from __future__ import annotations

import pytest
import torch

from prismlm import ModelConfig, PrismLM, PrototypeConfig
from prismlm.errors import ModelError
from prismlm.explain import explain, explain_generation
from prismlm.model import KVCache
from prismlm.model.generation import Sampling

V, BS = 97, 32


def make_model(prism: bool = True, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> PrismLM:
    """d=32, 2 layers, K=64 (or the dense baseline), eval mode. PRISM prototypes are placed on real hidden
    states plus noise, so activations are large and suppression moves the logits a lot."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=V,
        block_size=BS,
        n_layer=2,
        n_head=2,
        n_embd=32,
        prototypes=PrototypeConfig(num_prototypes=64, top_k=4) if prism else None,
    )
    model = PrismLM(cfg).to(dtype).eval()
    if prism:
        assert model.prototypes is not None
        with torch.no_grad():
            z = model.backbone(torch.randint(0, V, (4, BS))).reshape(-1, 32)
            model.prototypes.weight.copy_(z[torch.randperm(z.shape[0])[:64]] + 0.3 * torch.randn(64, 32, dtype=dtype))
    return model


TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
CASES = [(prism, dt) for prism in (True, False) for dt in (torch.float32, torch.float64)]
CASE_IDS = [f"{'prism' if p else 'dense'}-{str(d).removeprefix('torch.')}" for p, d in CASES]


def run_chunks(model: PrismLM, x: torch.Tensor, cuts: list[int], cache) -> list:
    """Forward x (B, T) through ``cache`` in chunks x[:, cuts[i]:cuts[i+1]]; returns the outputs."""
    return [model(x[:, a:b], cache=cache) for a, b in zip(cuts[:-1], cuts[1:])]


@pytest.mark.parametrize(("prism", "dtype"), CASES, ids=CASE_IDS)
def test_cached_logits_equal_uncached_at_every_position(prism, dtype):
    """Prefill, single-token decode steps, and multi-token chunks after a non-empty cache (the explicit
    mask) all give the uncached logits (and prototype selections) at every position."""
    model = make_model(prism, dtype=dtype)
    x = torch.randint(0, V, (2, BS))
    with torch.no_grad():
        full = model(x)
        # prefill 7 | decode 1 | chunk 9 after a non-empty cache | decode 1 … | chunk 3 up to block_size exactly
        cuts = [0, 7, 8, 17, *range(18, 29), 29, BS]
        cache = KVCache()
        outs = run_chunks(model, x, cuts, cache)
    assert cache.get_seq_length() == BS and len(cache) == 2
    logits = torch.cat([o.logits for o in outs], dim=1)  # (2, BS, V)
    torch.testing.assert_close(logits, full.logits, rtol=0, atol=TOL[dtype])
    torch.testing.assert_close(torch.cat([o.hidden for o in outs], 1), full.hidden, rtol=0, atol=TOL[dtype])
    if prism:
        assert torch.equal(torch.cat([o.indices for o in outs], 1), full.indices)
        torch.testing.assert_close(
            torch.cat([o.activations for o in outs], 1), full.activations, rtol=0, atol=TOL[dtype]
        )


def test_cached_prefill_is_bit_identical_to_uncached_forward():
    model = make_model()
    x = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert torch.equal(model(x, cache=KVCache()).logits, model(x).logits)


def test_chunk_after_a_non_empty_cache_float64():
    """12 tokens after 8 cached ones (the explicit offset mask: SDPA's is_causal would align it top left and
    hide cached positions) equal the uncached logits; neighbouring positions differ by far more than the
    tolerance, so a one-position shift of the mask or of the positions cannot pass."""
    model = make_model(dtype=torch.float64)
    x = torch.randint(0, V, (1, 20))
    with torch.no_grad():
        cache = KVCache()
        model(x[:, :8], cache=cache)
        chunk = model(x[:, 8:], cache=cache).logits
        full = model(x).logits[:, 8:]
    torch.testing.assert_close(chunk, full, rtol=0, atol=1e-12)
    assert (chunk[:, 0] - full[:, 1]).abs().max() > 1e-3  # positions genuinely differ: the comparison is sharp


@pytest.mark.parametrize("prism", [True, False], ids=["prism", "dense"])
def test_transformers_dynamic_cache_gives_the_same_logits(prism):
    transformers = pytest.importorskip("transformers")
    model = make_model(prism)
    x = torch.randint(0, V, (2, 24))
    cuts = [0, 5, 6, 7, 15, 16, 24]
    with torch.no_grad():
        ours = run_chunks(model, x, cuts, KVCache())
        hf_cache = transformers.DynamicCache()
        theirs = run_chunks(model, x, cuts, hf_cache)
    assert hf_cache.get_seq_length() == 24
    for a, b in zip(ours, theirs):  # equal here; a tolerance in case a kernel treats strided keys differently
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([o.logits for o in theirs], 1), model(x).logits, rtol=0, atol=1e-5)


def test_cache_beyond_block_size_is_refused():
    model = make_model()
    cache = KVCache()
    with torch.no_grad():
        model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)  # exactly block_size: fine
        with pytest.raises(ModelError, match="32 cached \\+ 1 new tokens exceeds the context window block_size=32"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ModelError, match="block_size=32"):
            model(torch.zeros(1, 33, dtype=torch.long), cache=KVCache())
    assert cache.get_seq_length() == 32  # the refused call appended nothing


def test_kv_cache_bookkeeping_and_growth():
    """Appends in chunks across the buffer's growth points equal one concatenation; a returned view never
    changes afterwards; shape mismatches and out-of-order layers are refused."""
    cache = KVCache()
    assert cache.get_seq_length() == 0 and cache.get_seq_length(5) == 0 and len(cache) == 0
    k = torch.randn(2, 4, 150, 8)
    cuts = [0, 3, 4, 60, 64, 65, 130, 150]  # crosses the 64- and 128-position capacities
    first = None
    for a, b in zip(cuts[:-1], cuts[1:]):
        keys, values = cache.update(k[:, :, a:b], -k[:, :, a:b], 0)
        cache.update(k[:, :, a:b] * 2, k[:, :, a:b], 1)
        assert torch.equal(keys, k[:, :, :b]) and torch.equal(values, -k[:, :, :b])
        assert cache.get_seq_length() == b == cache.get_seq_length(1)
        first = keys.clone() if first is None else first
        if a == 0:
            view = keys
    assert torch.equal(view, first)  # written past and reallocated since: the early view is unchanged
    assert len(cache) == 2
    with pytest.raises(ModelError, match="in order"):
        cache.update(k, k, 3)
    with pytest.raises(ModelError, match="head_dim"):
        cache.update(k, k[:, :, :1], 0)
    with pytest.raises(ModelError, match="caches"):
        cache.update(torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), 0)  # another batch size
    cache.reset()
    assert cache.get_seq_length() == 0 and len(cache) == 0


GEN_CASES = {
    "inside-window": (5, 20),  # prompt 5, 20 new tokens: ends at 25 ≤ 32
    "up-to-window": (12, 21),  # the last step feeds position 31 exactly; the one after would slide
    "crossing-window": (10, 40),  # slides after 22 steps, 18 window-recomputed steps
    "prompt-longer-than-window": (45, 12),  # prefill of the cropped window, then every step slides
}


@pytest.mark.parametrize("case", list(GEN_CASES))
@pytest.mark.parametrize("prism", [True, False], ids=["prism", "dense"])
def test_greedy_generate_same_tokens_with_and_without_cache(case, prism):
    p, n = GEN_CASES[case]
    model = make_model(prism, dtype=torch.float64)
    prompt = torch.randint(0, V, (2, p))
    cached = model.generate(prompt, n, temperature=0.0)
    uncached = model.generate(prompt, n, temperature=0.0, use_cache=False)
    assert cached.shape == (2, p + n) and torch.equal(cached[:, :p], prompt)
    assert torch.equal(cached, uncached)


def test_greedy_generate_float32_same_tokens_with_and_without_cache():
    model = make_model()
    prompt = torch.randint(0, V, (3, 6))
    assert torch.equal(
        model.generate(prompt, 50, temperature=0.0), model.generate(prompt, 50, temperature=0.0, use_cache=False)
    )


def test_sampled_generate_same_tokens_with_and_without_cache():
    model = make_model(dtype=torch.float64)
    prompt = torch.randint(0, V, (2, 8))
    a = model.generate(prompt, 40, temperature=0.8, top_tokens=20, generator=torch.Generator().manual_seed(3))
    b = model.generate(
        prompt, 40, temperature=0.8, top_tokens=20, generator=torch.Generator().manual_seed(3), use_cache=False
    )
    assert torch.equal(a, b)


def test_generate_steps_yield_the_sampling_logits():
    """Each step's logits are those of an uncached forward over the sequence so far (lean steps skip the
    prototype layer; add_prototype_fields then gives forward's prototype fields for all positions)."""
    model = make_model(dtype=torch.float64)
    prompt = torch.randint(0, V, (1, 6))
    steps = list(model.generate_steps(prompt, 10, temperature=0.0, prefill_logits=True))
    seq = torch.cat([prompt] + [nxt for _, nxt in steps], dim=1)  # (1, 16)
    with torch.no_grad():
        full = model(seq[:, :-1])
        joined = torch.cat([o.logits for o, _ in steps], dim=1)
        hidden = torch.cat([o.hidden for o, _ in steps], dim=1)
    torch.testing.assert_close(joined, full.logits, rtol=0, atol=1e-12)
    assert steps[1][0].indices is None  # lean step
    from prismlm.model.outputs import PrismOutput

    filled = model.add_prototype_fields(PrismOutput(logits=joined, hidden=hidden))
    assert torch.equal(filled.indices, full.indices)
    torch.testing.assert_close(filled.residual, full.residual, rtol=0, atol=1e-12)


def _suppressed_generations(model: PrismLM, prompt: torch.Tensor, n: int):
    base = model.generate(prompt, n, temperature=0.0)
    with torch.no_grad():
        # the prototypes active along the generation (first and last window)
        used = torch.cat([model(base[:, :BS]).indices, model(base[:, -BS:]).indices]).unique()
    with model.suppress(used):
        cached = model.generate(prompt, n, temperature=0.0)
        uncached = model.generate(prompt, n, temperature=0.0, use_cache=False)
    return base, cached, uncached


@pytest.mark.parametrize("n", [20, 40], ids=["inside-window", "crossing-window"])
def test_suppression_applies_on_the_cached_path(n):
    model = make_model(dtype=torch.float64)
    prompt = torch.randint(0, V, (2, 6))
    base, cached, uncached = _suppressed_generations(model, prompt, n)
    assert torch.equal(cached, uncached)
    assert not torch.equal(cached, base)  # the suppressed set matters
    # and a controller (1 + c) on the cached path, as uncached
    c = torch.randn(64, dtype=torch.float64)
    with model.control(c):
        assert torch.equal(
            model.generate(prompt, n, temperature=0.0), model.generate(prompt, n, temperature=0.0, use_cache=False)
        )
    assert model.proto_multipliers is None


class CharTokenizer:
    """Just enough of ``prismlm.data.tokenizer.Tokenizer`` for explanations: one id per character."""

    vocab_size, eot_id = V, 0

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % (V - 1) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(33 + i % 90) for i in ids)

    def id_to_token(self, i: int) -> str:
        return self.decode([i])


@pytest.mark.parametrize("suppressed", [False, True], ids=["plain", "suppressed"])
def test_explained_generation_from_the_cached_steps_equals_the_one_forward_explanation(suppressed):
    """explain_generation reads the explanation off the generation's own steps (no second forward); it must
    equal explaining the generated text with one forward, position by position."""
    model = make_model(dtype=torch.float64)
    tok = CharTokenizer()
    ctx = model.suppress(range(0, 64, 3)) if suppressed else model.intervene()
    with ctx:
        gen = explain_generation(model, tok, "hello world", 15, sampling=Sampling(0.9, top_tokens=30, seed=2))  # type: ignore[arg-type]
        ref = explain(model, tok, gen.token_ids, targets=[p.next_id for p in gen.positions])  # type: ignore[arg-type]
        again = model.generate(
            torch.tensor([tok.encode("hello world")]),
            15,
            Sampling(0.9, top_tokens=30),
            generator=torch.Generator().manual_seed(2),
        )
    assert gen.prompt_tokens == 11 and len(gen.positions) == 11 + 15 - 1 and gen.truncated_tokens == 0
    assert gen.token_ids + [gen.positions[-1].next_id] == again[0].tolist()  # the same tokens as generate
    assert [p.chosen_by for p in gen.positions] == ["text"] * 10 + ["sampled"] * 15
    for a, b in zip(gen.positions, ref.positions):
        assert a.next_id == b.next_id and a.logit == pytest.approx(b.logit, abs=1e-10)
        assert a.prob == pytest.approx(b.prob, abs=1e-10) and abs(a.error) < 1e-12
        assert [s.id for s in a.prototypes] == [s.id for s in b.prototypes]
        assert [s.slice for s in a.prototypes] == pytest.approx([s.slice for s in b.prototypes], abs=1e-10)
    assert set(gen.prototypes) == set(ref.prototypes)


def test_generation_returns_ordinary_tensors():
    """The decode loop runs in inference mode; what it hands out can still be modified and trained on."""
    model = make_model()
    prompt = torch.randint(0, V, (1, 4))
    y = model.generate(prompt, 5, temperature=0.0)
    out, nxt = next(model.generate_steps(prompt, 3, temperature=0.0, prefill_logits=True))
    assert not any(t.is_inference() for t in (y, out.logits, out.hidden, nxt))
    out.logits.add_(1.0)  # in place: fine on an ordinary tensor
    model.train()
    model(y[:, :-1], y[:, 1:]).loss.backward()
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("cache_kind", ["ours", "transformers"])
def test_left_padded_rows_equal_each_row_alone_through_the_cache(cache_kind):
    """A left-padded batch (attention_mask 0 on the padding) run as a prompt then two chunks through a cache:
    every real token's logits equal those of its row run alone without padding (float64) — positions count
    real tokens only (cumsum(mask) − 1) and no query attends to a padding key. Greedy generation from the
    padded batch, done by hand through the cache, gives each row the tokens of ``generate`` on that row."""
    if cache_kind == "transformers":
        DynamicCache = pytest.importorskip("transformers").DynamicCache
    model = make_model(dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, V, (n,), generator=g) for n in (12, 5, 9)]
    L = max(len(r) for r in rows)
    x = torch.stack([torch.cat([torch.zeros(L - len(r), dtype=torch.long), r]) for r in rows])  # (3, L), pad 0
    mask = torch.stack([(torch.arange(L) >= L - len(r)).long() for r in rows])  # (3, L)
    cache = KVCache() if cache_kind == "ours" else DynamicCache()
    with torch.no_grad():
        outs = [model(x[:, :a][:, s:], cache=cache, attention_mask=mask[:, :a]) for s, a in ((0, 7), (7, 10), (10, L))]
        got = torch.cat([o.logits for o in outs], dim=1)  # (3, L, V)
        for i, r in enumerate(rows):
            want = model(r[None]).logits[0]  # (n, V)
            torch.testing.assert_close(got[i, L - len(r) :], want, rtol=0, atol=1e-10)
        # greedy decoding continues every row from its own last token
        ids, m, cache = x, mask, KVCache()
        feed = x
        for _ in range(8):
            nxt = model(feed, cache=cache, attention_mask=m, last_only=True).logits[:, -1].argmax(-1, keepdim=True)
            ids, m, feed = torch.cat([ids, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1), nxt
    for i, r in enumerate(rows):
        assert torch.equal(ids[i, L - len(r) :], model.generate(r[None], 8, temperature=0)[0])


def test_attention_mask_must_cover_the_cached_and_new_tokens():
    model = make_model()
    cache = KVCache()
    x = torch.randint(0, V, (2, 6))
    model(x[:, :4], cache=cache)
    with pytest.raises(ModelError, match="attention_mask must be"):
        model(x[:, 4:], cache=cache, attention_mask=torch.ones(2, 2))


def test_sampling_is_one_value_checked_when_made():
    """``Sampling`` refuses what cannot sample, naming the field (the CLI maps it to its flag); the cut-off
    is ``top_tokens`` (``top_k`` is the prototype k only); the shortcuts ``temperature=``/``top_tokens=`` of
    ``PrismLM.generate`` and ``explain_generation(sampling=)`` draw the same tokens, and ``top_k=`` is refused."""
    from prismlm.errors import ConfigError

    for bad, field in (
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_tokens=0), "top_tokens"),
        (dict(seed=2**64), "seed"),
    ):
        with pytest.raises(ConfigError, match=field) as e:
            Sampling(**bad)
        assert e.value.param == field
    model, tok = make_model(), CharTokenizer()
    prompt = torch.tensor([tok.encode("hello")])
    # top_tokens=1 is greedy at any temperature: an independent reference for the cut-off itself
    assert torch.equal(
        model.generate(prompt, 12, Sampling(5.0, top_tokens=1)), model.generate(prompt, 12, Sampling(0.0))
    )
    s = Sampling(0.9, top_tokens=7, seed=4)
    want = model.generate(prompt, 12, s)
    assert not torch.equal(want, model.generate(prompt, 12, Sampling(0.9, top_tokens=7, seed=5)))
    g = torch.Generator().manual_seed(4)
    assert torch.equal(model.generate(prompt, 12, temperature=0.9, top_tokens=7, generator=g), want)
    with pytest.raises(TypeError, match="top_k"):
        model.generate(prompt, 12, temperature=0.9, top_k=7)  # type: ignore[call-overload]
    new = explain_generation(model, tok, "hello", 8, sampling=s)  # type: ignore[arg-type]
    assert new.token_ids == want[0, : 5 + 8 - 1].tolist()  # the context of each sampled token
    assert "top_tokens 7" in new.notes[-1]
