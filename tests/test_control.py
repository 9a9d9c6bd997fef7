"""Control: suppression, concepts, controllers, tasks/scoring, judges (tiny configs, CPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from prismlm import ModelConfig, PrismLM, PrototypeConfig, decompose


def tiny_model(seed: int = 0, dtype=torch.float64) -> PrismLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=97,
        block_size=32,
        n_layer=2,
        n_head=2,
        n_embd=32,
        prototypes=PrototypeConfig(num_prototypes=64, top_k=4),
    )
    model = PrismLM(cfg).to(dtype).eval()
    x = torch.randint(0, 97, (3, 32))
    with torch.no_grad():  # put prototypes on real hidden states so activations are non-trivial
        z = model.backbone(x).reshape(-1, 32)
        model.prototypes.weight.copy_(z[torch.randperm(z.shape[0])[:64]] + 0.3 * torch.randn(64, 32, dtype=dtype))
    return model


# ----- suppression -------------------------------------------------------------------------------------
def test_suppression_removes_exactly_those_slices_float64():
    model = tiny_model()
    x = torch.randint(0, 97, (2, 32))
    base = model(x)
    active = base.indices[base.activations > 0].unique()
    S = active[:5].tolist()
    with torch.no_grad(), model.suppress(S):
        sup = model(x)
    # same selection, same activations: suppression only touches the logits
    assert torch.equal(sup.indices, base.indices)
    torch.testing.assert_close(sup.activations, base.activations, rtol=0, atol=0)
    sig = model.signatures()  # (K, V)
    mask = torch.isin(base.indices, torch.tensor(S)).to(base.activations.dtype)  # (B, T, k)
    removed = torch.einsum("btk,btkv->btv", base.activations * mask, sig[base.indices])
    torch.testing.assert_close(sup.logits, base.logits - removed, rtol=0, atol=1e-10)
    assert (removed.abs() > 1e-6).any()  # the test is not vacuous
    # decompose stays exact for the modified logits: suppressed slices are zero, others unchanged
    dec = decompose(model, sup, x)  # the output records its multipliers: no context needed
    torch.testing.assert_close(dec.prototype_slices.sum(-1) + dec.residual_slice, dec.logit, rtol=0, atol=1e-10)
    base_dec = decompose(model, base, x)
    torch.testing.assert_close(dec.prototype_slices, base_dec.prototype_slices * (1 - mask), rtol=0, atol=1e-12)
    # generation with last_only gives the same last-position logits
    with model.suppress(S):
        last = model(x, last_only=True).logits[:, -1]
    torch.testing.assert_close(last, sup.logits[:, -1], rtol=0, atol=1e-10)


def test_interventions_compose_as_values_against_a_hand_built_reference():
    """intervene(Suppress, Control, Scale) gives ℓ = W (r + Σ_i m_i a_i p_i) with m the product of the
    three, computed here by hand from the unmodified forward output; the model is restored on exit."""
    from prismlm.errors import ModelError
    from prismlm.model import Control, Scale, Suppress

    model = tiny_model()
    K = model.prototypes.num_prototypes
    x = torch.randint(0, 97, (2, 32))
    base = model(x)
    gen = torch.Generator().manual_seed(0)
    c = torch.zeros(K, dtype=torch.float64)
    c[base.indices[0, :, 0]] = 0.5  # a controller on prototypes that are active
    f = 1.0 + torch.rand(K, generator=gen, dtype=torch.float64)
    ids = base.indices[1, 3].tolist()
    m = torch.ones(K, dtype=torch.float64) * (1.0 + c) * f
    m[ids] = 0.0
    p = model.prototypes.weight[base.indices]  # (B, T, k, d)
    z_ref = base.residual + (m[base.indices] * base.activations).unsqueeze(-1).mul(p).sum(-2)  # (B, T, d)
    want = model.lm_head(z_ref)
    with model.intervene(Suppress.of(ids), Control(c), Scale(f)) as mm:
        got = mm(x).logits
    assert torch.allclose(got, want, atol=1e-10)
    assert model.proto_multipliers is None and torch.equal(model(x).logits, base.logits)
    with model.intervene():  # no interventions: the model as it is
        assert torch.equal(model(x).logits, base.logits)
    with pytest.raises(ModelError, match="shape"):
        with model.intervene(Scale(torch.ones(K + 1))):
            pass
    with pytest.raises(ModelError, match="unknown prototype"):
        with model.intervene(Suppress.of([K])):
            pass
    with pytest.raises(RuntimeError, match="body"):
        with model.intervene(Suppress.of(ids)):
            raise RuntimeError("body")
    assert model.proto_multipliers is None


def test_suppress_restores_even_on_exception_and_nests():
    model = tiny_model()
    x = torch.randint(0, 97, (1, 16))
    base = model(x).logits
    with pytest.raises(RuntimeError, match="boom"):
        with model.suppress([1, 2, 3]):
            raise RuntimeError("boom")
    assert model.proto_multipliers is None
    assert torch.equal(model(x).logits, base)
    with model.suppress([1]):
        with model.suppress([2]):
            assert model.proto_multipliers[1] == 0 and model.proto_multipliers[2] == 0
        assert model.proto_multipliers[2] == 1 and model.proto_multipliers[1] == 0
    assert model.proto_multipliers is None
    with model.suppress([]):  # empty set: identical logits
        assert torch.equal(model(x).logits, base)


def test_unknown_ids_rejected_clearly():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"unknown prototype id\(s\) \[64, 1000\].*64 prototypes"):
        with model.suppress([3, 64, 1000]):
            pass
    with pytest.raises(ValueError, match="integers"):
        model.suppress(["a"])
    assert model.proto_multipliers is None
    dense = PrismLM(ModelConfig(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_embd=32, prototypes=None))
    with pytest.raises(ValueError, match="dense baseline"):
        dense.suppress([0])


def test_suppression_set_round_trip_and_checks(tmp_path):
    from prismlm.control.suppress import SuppressionSet
    from prismlm.errors import SuppressionError

    model = tiny_model()
    s = SuppressionSet(
        ids=[5, 3, 3], num_prototypes=64, model_sha256="abc", concept="x", evidence={3: {"enrichment": 2.0}}
    )
    assert s.ids == [3, 5]
    p = s.save(tmp_path / "s.json")
    s2 = SuppressionSet.load(p)
    assert s2.ids == [3, 5] and s2.evidence[3]["enrichment"] == 2.0 and s2.model_sha256 == "abc"
    with pytest.raises(SuppressionError, match="unknown prototype"):
        SuppressionSet(ids=[64], num_prototypes=64)
    with pytest.raises(SuppressionError, match="not this checkpoint"):
        s2.check(model, "def")
    with pytest.raises(SuppressionError, match="bank of 32"):
        SuppressionSet(ids=[1], num_prototypes=32).check(model)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SuppressionError, match="not a suppression set"):
        SuppressionSet.load(tmp_path / "bad.json")
    x = torch.randint(0, 97, (1, 16))
    with model.suppress([3, 5]):
        want = model(x).logits
    base = model(x).logits
    with model.intervene(s2.intervention()):
        assert torch.equal(model(x).logits, want)
    assert torch.equal(model(x).logits, base)  # restored: nothing changed the model for good
    assert not torch.equal(want, base)


# ----- controllers -------------------------------------------------------------------------------------
def test_zero_controller_changes_nothing_and_features_match_forward(tiny_shards):
    from prismlm.control.controller import extract_features, prism_encoder, request_scores
    from prismlm.eval.scoring import loglikelihoods

    tok = tiny_shards.tokenizer
    torch.manual_seed(0)
    model = (
        PrismLM(
            ModelConfig(
                vocab_size=576,
                block_size=48,
                n_layer=1,
                n_head=2,
                n_embd=32,
                prototypes=PrototypeConfig(num_prototypes=32, top_k=4),
            )
        )
        .double()
        .eval()
    )
    x = torch.randint(0, 576, (2, 48))
    base = model(x).logits
    with model.control(torch.zeros(32, dtype=torch.float64)):
        assert torch.equal(model(x).logits, base)  # bit-identical
    docs = [
        {
            "id": str(i),
            "query": f"Question {i}: the sea is",
            "choices": [" blue", " dark", " wide", " old"],
            "gold": i % 4,
            "label": "x",
        }
        for i in range(3)
    ]
    f = extract_features(model, tok, docs, prism_encoder(model))
    W, P = model.lm_head.weight, model.prototypes.weight
    reqs = [(d["query"], c) for d in docs for c in d["choices"]]
    ll = torch.tensor([v for v, _ in loglikelihoods(model, tok, reqs)], dtype=torch.float64)
    torch.testing.assert_close(request_scores(f, W, P, None), ll, rtol=0, atol=1e-9)
    torch.testing.assert_close(request_scores(f, W, P, torch.zeros(32, dtype=torch.float64)), ll, rtol=0, atol=1e-9)
    # a sparse non-zero controller: cached features == the real forward under model.control(c)
    c = torch.zeros(32, dtype=torch.float64)
    c[f.indices[:, 0].unique()[:3]] = torch.tensor([0.7, -0.5, 2.0], dtype=torch.float64)[
        : len(f.indices[:, 0].unique()[:3])
    ]
    with model.control(c):
        ll_c = torch.tensor([v for v, _ in loglikelihoods(model, tok, reqs)], dtype=torch.float64)
    torch.testing.assert_close(request_scores(f, W, P, c), ll_c, rtol=0, atol=1e-9)
    assert not torch.allclose(ll_c, ll)


def test_controller_learns_planted_signal():
    """Synthetic task: the gold choice is the token that prototype 7's signature favours most, and
    prototype 7 is active at every answer position; the base model is at chance."""
    from prismlm.control.controller import ControlFeatures, accuracy, fit_controller, request_scores

    g = torch.Generator().manual_seed(0)
    K, d, V, k, D, C = 32, 16, 50, 4, 120, 4
    W = torch.randn(V, d, generator=g)
    P = torch.randn(K, d, generator=g)
    sig = W @ P[7]
    z, idx, act, tg, req, doc_of, gold = [], [], [], [], [], [], []
    for di in range(D):
        zi = torch.randn(d, generator=g) * 0.5
        others = torch.randperm(K, generator=g)
        others = others[others != 7][: k - 1]
        ii = torch.cat([torch.tensor([7]), others])
        aa = torch.rand(k, generator=g) * 0.5 + 0.3
        ch = torch.randperm(V, generator=g)[:C]
        gold.append(int(sig[ch].argmax()))
        for ci in range(C):
            z.append(zi)
            idx.append(ii)
            act.append(aa)
            tg.append(ch[ci])
            req.append(di * C + ci)
            doc_of.append(di)
    f = ControlFeatures(
        z=torch.stack(z),
        indices=torch.stack(idx),
        activations=torch.stack(act),
        targets=torch.stack(tg),
        request=torch.tensor(req),
        doc_of_request=torch.tensor(doc_of),
        gold=torch.tensor(gold),
        choice_len=torch.ones(D * C, dtype=torch.float64),
        n_choices=[C] * D,
    )
    base = accuracy(f, request_scores(f, W, P, None))["acc"]
    ctl = fit_controller(f, W, P, l1=0.03, steps=150, lr=0.1)
    after = accuracy(f, request_scores(f, W.double(), P.double(), ctl.coefficients))["acc"]
    assert base < 0.5 and after > 0.85, (base, after)
    top = max(ctl.nonzero, key=lambda i: abs(float(ctl.coefficients[i])))
    assert top == 7 and ctl.coefficients[7] > 0
    assert len(ctl.nonzero) < K // 4  # L1 keeps it sparse


def _choice_features(choice_sets: list[list[str]], gold: list[int], base: torch.Tensor):
    """Features of a synthetic task carrying only what the choice-prior baseline reads."""
    from prismlm.control.controller import ControlFeatures

    doc_of = [d for d, cs in enumerate(choice_sets) for _ in cs]
    R = len(doc_of)
    return ControlFeatures(
        z=torch.zeros(R, 1),
        indices=torch.zeros(R, 1, dtype=torch.long),
        activations=torch.zeros(R, 1),
        targets=torch.zeros(R, dtype=torch.long),
        request=torch.arange(R),
        doc_of_request=torch.tensor(doc_of),
        gold=torch.tensor(gold),
        choice_len=torch.ones(R, dtype=torch.float64),
        n_choices=[len(c) for c in choice_sets],
        choice_text=[t for cs in choice_sets for t in cs],
    ), base[:R]


def test_choice_prior_learns_a_label_preference_and_nothing_else():
    """Gold is always " C" (at a random position) and base scores are noise: the prior alone gets every
    test example right; with unseen choice strings it leaves the scores untouched."""
    from prismlm.control.controller import accuracy, fit_choice_prior

    g = torch.Generator().manual_seed(0)

    def task(n: int):
        sets, gold = [], []
        for _ in range(n):
            cs = [" A", " B", " C", " D"]
            perm = torch.randperm(4, generator=g).tolist()
            cs = [cs[i] for i in perm]
            sets.append(cs)
            gold.append(cs.index(" C"))
        return _choice_features(sets, gold, torch.randn(4 * n, generator=g, dtype=torch.float64))

    (tr, s_tr), (te, s_te) = task(80), task(40)
    prior = fit_choice_prior(tr, s_tr)
    assert accuracy(te, s_te)["acc"] < 0.5
    assert accuracy(te, prior.scores(te, s_te))["acc"] == 1.0
    assert max(prior.bias, key=prior.bias.get) == " C"
    unseen, s_un = _choice_features([[" w", " x", " y", " z"]], [0], torch.randn(4, generator=g, dtype=torch.float64))
    assert torch.equal(prior.scores(unseen, s_un), s_un)


class _TokenSplit:
    """A token stream with the shard contract: sequence j = tokens[j·T : j·T + T + 1]."""

    def __init__(self, tokens):
        self.tokens = tokens

    def num_sequences(self, T):
        return (len(self.tokens) - 1) // T

    def sequences(self, js, T):
        import numpy as np

        return np.stack([self.tokens[j * T : j * T + T + 1] for j in np.asarray(js)]).astype(np.int64)


class _SparseCodeModel(torch.nn.Module):
    """A stand-in dense model whose hidden state for token v is a fixed sparse code: 2 of 12 unit atoms with
    coefficients in [1, 2] — data with known sparse structure for the SAE."""

    def __init__(self, d=16, atoms=12, vocab=300, block_size=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        A = torch.randn(atoms, d, generator=g)
        A = A / A.norm(dim=-1, keepdim=True)
        codes = torch.zeros(vocab, atoms)
        for v in range(vocab):
            codes[v, torch.randperm(atoms, generator=g)[:2]] = 1 + torch.rand(2, generator=g)
        self.register_buffer("table", codes @ A)  # (vocab, d)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # train_sae reads the device from the parameters
        self.config = SimpleNamespace(block_size=block_size, n_embd=d)

    def backbone(self, x):
        return self.table[x]  # (B, T, d)


def test_sae_topk_is_exactly_k_sparse_and_decodes_its_latents():
    from prismlm.control.sae import TopKSAE

    torch.manual_seed(0)
    sae = TopKSAE(16, 32, 4)
    with pytest.raises(ValueError, match="k must be"):
        TopKSAE(16, 32, 33)
    with torch.no_grad():
        sae.b_enc.fill_(0.5)  # every pre-activation positive: exactly k non-zero latents per token
        sae.b_dec.normal_()
    z = torch.randn(10, 16)
    idx, act = sae.encode(z)
    pre = torch.relu((z - sae.b_dec) @ sae.W_enc.T + sae.b_enc)  # (N, K), computed independently
    assert idx.shape == (10, 4) and ((act > 0).sum(-1) == 4).all()
    torch.testing.assert_close(act, pre.gather(1, idx))
    others = pre.scatter(1, idx, -1.0)  # every unselected latent is no larger than the smallest selected one
    assert (others.max(-1).values <= act.min(-1).values).all()
    assert all(len(set(r.tolist())) == 4 for r in idx)
    want = torch.stack([sum(act[n, j] * sae.W_dec[idx[n, j]] for j in range(4)) for n in range(10)]) + sae.b_dec
    torch.testing.assert_close(sae(z), want)
    assert torch.allclose(sae.directions.norm(dim=-1), torch.ones(32))


def test_sae_training_lowers_reconstruction_error_on_sparse_data():
    import numpy as np

    from prismlm.control.sae import train_sae

    model = _SparseCodeModel()
    rng = np.random.default_rng(0)
    shards = SimpleNamespace(
        train=_TokenSplit(rng.integers(0, 300, 8 * 200 + 1)), val=_TokenSplit(rng.integers(0, 300, 8 * 40 + 1))
    )
    before = train_sae(model, shards, num_latents=24, k=2, steps=0, eval_sequences=40)
    after = train_sae(model, shards, num_latents=24, k=2, steps=300, batch_size=16, lr=1e-2, eval_sequences=40)
    assert after.steps == 300 and after.fvu < 0.25 * before.fvu and after.fvu < 0.15, (before.fvu, after.fvu)
    sae = after.sae
    torch.testing.assert_close(sae.directions.norm(dim=-1), torch.ones(24))  # unit decoder rows after training
    z = model.backbone(torch.from_numpy(shards.val.tokens[:64]))
    idx, act = sae.encode(z)
    assert idx.shape == (64, 2) and ((act > 0).sum(-1) <= 2).all() and (act >= 0).all()
    assert 0.0 <= after.dead_fraction < 1.0


def test_sae_aux_loss_trains_only_dead_latents():
    from prismlm.control.sae import TopKSAE

    torch.manual_seed(0)
    sae = TopKSAE(16, 32, 4)
    z = torch.randn(50, 16)
    idx, act = sae.encode(z)
    recon = sae.decode(idx, act) + sae.b_dec
    torch.testing.assert_close(recon, sae(z))
    assert sae.aux_loss(z, recon, torch.zeros(32, dtype=torch.bool), 8) == 0  # nothing dead: no aux term
    dead = torch.zeros(32, dtype=torch.bool)
    dead[[3, 7, 11]] = True
    loss = sae.aux_loss(z, recon.detach(), dead, 8)
    assert loss > 0
    # the value: MSE of the error z − ẑ against the dead latents' own top-min(aux_k, #dead) reconstruction
    pre = torch.relu((z - sae.b_dec) @ sae.W_enc.T + sae.b_enc).detach()[:, dead]  # (N, 3): all dead latents
    want = ((pre @ sae.W_dec.detach()[dead] - (z - recon).detach()) ** 2).mean()
    torch.testing.assert_close(loss.detach(), want)
    two = torch.relu((z - sae.b_dec) @ sae.W_enc.T + sae.b_enc).detach().masked_fill(~dead, 0).topk(2, -1)
    want2 = (torch.einsum("nk,nkd->nd", two.values, sae.W_dec.detach()[two.indices]) - (z - recon).detach()) ** 2
    torch.testing.assert_close(sae.aux_loss(z, recon.detach(), dead, 2).detach(), want2.mean())
    loss.backward()
    touched = sae.W_dec.grad.abs().sum(-1) > 0  # only dead latents' directions get the aux gradient
    assert touched[dead].all() and not touched[~dead].any()


# ----- tasks, scorer and lm-eval ----------------------------------------------------------------------
@pytest.mark.slow  # over 10 s: .ci/run's `-m slow` pass
def test_tasks_deterministic_and_well_formed():
    from prismlm.eval.tasks import TASKS, build_task

    for name in TASKS:
        a = build_task(name, {"train": 20, "validation": 10, "test": 10})
        b = build_task(name, {"train": 20, "validation": 10, "test": 10})
        assert a == b
        ids = [set(d["id"] for d in a[s]) for s in a]
        assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
        for d in a["test"]:
            assert len(d["choices"]) >= 4 and len(set(d["choices"])) == len(d["choices"])
            assert d["choices"][d["gold"]] == " " + d["label"]


@pytest.mark.slow
def test_gutenberg_ending_task_choices_are_passage_continuations():
    from prismlm.data.corpus import gutenberg_documents
    from prismlm.eval.tasks import build_task

    splits = build_task("gutenberg_ending", {"train": 5, "validation": 5, "test": 20})
    books = {d.id: " ".join(d.text.split()) for d in gutenberg_documents()}
    for d in splits["test"]:
        assert all(len(c.split()) == 12 for c in d["choices"])  # equal length: no length cue
        gold = d["query"] + d["choices"][d["gold"]]  # the passage, continued by its gold ending
        assert gold in books[d["id"].rsplit("/p", 1)[0]]
        assert all(
            d["query"] + c not in books[d["id"].rsplit("/p", 1)[0]]
            for i, c in enumerate(d["choices"])
            if i != d["gold"]
        )
    answers = {sp: {c for d in docs for c in d["choices"]} for sp, docs in splits.items()}
    assert not answers["train"] & answers["test"]  # no answer string crosses splits (a prior cannot leak)


@pytest.mark.slow
def test_scorer_and_lm_eval_adapter_agree(tiny_shards, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    from prismlm.eval.scoring import mc_accuracy
    from prismlm.eval.tasks import build_task, write_task
    from prismlm.integrations.lm_eval_adapter import evaluate_with_lm_eval

    tok = tiny_shards.tokenizer
    torch.manual_seed(0)
    model = PrismLM(
        ModelConfig(
            vocab_size=576,
            block_size=128,
            n_layer=1,
            n_head=2,
            n_embd=32,
            prototypes=PrototypeConfig(num_prototypes=32, top_k=4),
        )
    ).eval()
    splits = build_task("fortune_source", {"train": 4, "validation": 4, "test": 16})
    folder = write_task("fortune_source", splits, tmp_path / "tasks")
    for sup in ([], [0, 1, 2, 3, 4, 5]):  # plain and suppressed model
        with model.suppress(sup):
            ours = mc_accuracy(model, tok, splits["test"])
            theirs = evaluate_with_lm_eval(model, tok, {"fortune_source": folder})["fortune_source"]
        assert ours.acc == pytest.approx(theirs["acc"]) and ours.acc_norm == pytest.approx(theirs["acc_norm"])


# ----- judges ------------------------------------------------------------------------------------------
def test_judges_load_and_score_offline(monkeypatch):
    from prismlm.control.judges import ProfanityJudge, TfidfJudge, fortune_splits

    s = fortune_splits()
    assert s.judge_offensive and s.lm_offensive and not (set(s.judge_clean) & set(s.lm_clean))
    j = TfidfJudge(s.judge_clean[:800], s.judge_offensive[:400])
    sc = j.score(["What a lovely garden.", s.judge_offensive[0]])
    assert sc.shape == (2,) and ((0 <= sc) & (sc <= 1)).all()
    assert j.held_out_auc > 0.6
    pytest.importorskip("profanity_check")
    p = ProfanityJudge().score(["What a lovely garden.", "fuck off you idiot"])
    assert p[0] < 0.5 < p[1]


def test_distinct_n_counts_repetition():
    from prismlm.eval.metrics import distinct_n

    assert distinct_n(["a b c d"], 2) == 1.0
    assert distinct_n(["a b a b a b"], 2) == 2 / 5  # (a b), (b a) over 5 bigrams
    assert distinct_n(["one"], 2) == 0.0  # no bigram at all


# ----- concept search ----------------------------------------------------------------------------------
CONCEPT = ["zebra zebra zebra quartz quartz"] * 6
NEUTRAL = ["the king said to the people that the land was good"] * 6


def _concept_model(top_k: int = 2) -> PrismLM:
    torch.manual_seed(0)
    return PrismLM(
        ModelConfig(
            vocab_size=576,
            block_size=64,
            n_layer=1,
            n_head=2,
            n_embd=32,
            prototypes=PrototypeConfig(num_prototypes=32, top_k=top_k),
        )
    ).eval()


def _concept_setup(tiny_shards):
    return tiny_shards.tokenizer, _concept_model(), CONCEPT, NEUTRAL


def test_concept_search_finds_planted_prototypes(tiny_shards, tmp_path):
    from prismlm.control.concept import ConceptSelection, find_concept

    tok, model, concept, neutral = _concept_setup(tiny_shards)
    sset, ranking = find_concept(
        model, tok, concept, neutral, ConceptSelection(budget=3, threshold=0.5, min_count=1), concept="zq"
    )
    assert 0 < len(sset.ids) <= 3 and all(r["log2_enrichment"] >= 0.5 for r in ranking)
    for i in sset.ids:  # chosen prototypes are more active on concept text than on neutral text
        assert sset.evidence[i]["concept_rate"] > sset.evidence[i]["neutral_rate"]
    p = sset.save(tmp_path / "s.json")
    assert json.loads(p.read_text())["ids"] == sset.ids
    # the records are what their types say: the file's keys in SuppressionRecord's order, evidence keys known
    from prismlm.control.suppress import PrototypeEvidence, SuppressionRecord

    # (a set that keeps the residual is written as format 1: every key but the last, ``residual``)
    assert list(json.loads(p.read_text())) == list(SuppressionRecord.__annotations__)[:-1]
    known = PrototypeEvidence.__optional_keys__
    assert all(set(r) <= known for r in ranking) and all(set(e) <= known for e in sset.evidence.values())


def test_concept_contribution_is_the_exact_derivative_of_the_loglikelihood(tiny_shards):
    """contribution_i = ∂/∂m_i Σ_t log p(x_{t+1} | x_≤t) at m = 1, where m_i scales prototype i's slice."""
    from prismlm.control.concept import activation_stats

    tok = tiny_shards.tokenizer
    model = _concept_model(top_k=3).double()
    text = "the king said to the people that the land was good, and zebra quartz"
    stats = activation_stats(model, tok, [text])
    x = torch.tensor([tok.encode(text)])
    m = torch.ones(32, dtype=torch.float64, requires_grad=True)
    with model.scale_prototypes(m):
        logits = model(x).logits[0, :-1]
    ll = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).sum()
    (grad,) = torch.autograd.grad(ll, m)
    assert grad.abs().max() > 1e-4  # not vacuous
    torch.testing.assert_close(torch.from_numpy(stats.contribution), grad, rtol=1e-7, atol=1e-10)


def test_concept_search_ranks_by_the_effect_on_the_target_tokens(tiny_shards):
    """By default prototypes are ranked by their slice on the concept's target tokens (the tokens over-represented
    in the concept texts) where those are predicted: exactly what suppressing one takes off those logits."""
    from prismlm.control.concept import ConceptSelection, concept_targets, find_concept

    tok, model, concept, neutral = _concept_setup(tiny_shards)
    targets = concept_targets(tok, concept, neutral)
    assert targets and all(tok.id_to_token(t).strip() in "zebra quartz" for t in targets)
    sset, ranking = find_concept(
        model, tok, concept, neutral, ConceptSelection(budget=None, threshold=0.0, min_count=1)
    )
    assert sset.meta["rank_by"] == "target" and sset.meta["target_tokens"] == targets
    effects = [r["target_effect"] for r in ranking]
    assert ranking and effects == sorted(effects, reverse=True) and all(e > 0 for e in effects)
    # the effect, independently: the logit drop of the targets where they come next when the prototype is off
    x = torch.tensor([tok.encode(concept[0])])
    y = x[0, 1:]
    at = torch.isin(y, torch.tensor(targets))
    top = ranking[0]["id"]
    with torch.no_grad():
        base = model(x[:, :-1]).logits[0].gather(-1, y[:, None])[:, 0]
        with model.suppress([top]):
            off = model(x[:, :-1]).logits[0].gather(-1, y[:, None])[:, 0]
    drop = float((base - off)[at].double().mean())
    assert drop == pytest.approx(ranking[0]["target_effect"], rel=1e-4, abs=1e-6)  # all texts are the same


def test_concept_search_rank_by_contribution_and_subset(tiny_shards):
    from prismlm.control.concept import ConceptSelection, find_concept
    from prismlm.errors import SuppressionError

    tok, model, concept, neutral = _concept_setup(tiny_shards)
    sset, ranking = find_concept(
        model, tok, concept, neutral, ConceptSelection(budget=None, rank_by="contribution", threshold=0.0, min_count=1)
    )
    keys = [r["contribution_nats_per_token"] for r in ranking]
    assert keys == sorted(keys, reverse=True) and all(k > 0 for k in keys)  # ranked, positive contribution
    assert sset.meta["rank_by"] == "contribution" and sset.ids
    top = [r["id"] for r in ranking if r["selected"]][:1]
    sub = sset.subset(top)
    assert sub.ids == top and set(sub.evidence) == set(top)
    with pytest.raises(SuppressionError, match="not in this suppression set"):
        sset.subset([i for i in range(32) if i not in sset.ids][:1])
    with pytest.raises(ValueError, match="rank_by"):
        find_concept(model, tok, concept, neutral, ConceptSelection(rank_by="magic"))


# ----- CLI ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tiny_shards, tmp_path_factory):
    from prismlm import RunConfig
    from prismlm.train import train

    run = tmp_path_factory.mktemp("ctl") / "run"
    cfg = RunConfig.from_name("tiny").override(
        {
            "train.max_steps": 10,
            "train.eval_interval": 10,
            "train.batch_size": 4,
            "train.warmup_steps": 2,
            "model.block_size": 128,
        }
    )
    train(cfg, run, shards=tiny_shards, progress=False)
    return run


@pytest.mark.slow
def test_cli_concept_suppress_tasks_controller(tiny_run, tiny_shards, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from prismlm.cli import app
    from prismlm.control.suppress import SuppressionSet

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    r = CliRunner()
    (tmp_path / "c.txt").write_text("zebra zebra quartz\n\nquartz zebra zebra zebra\n")
    (tmp_path / "n.txt").write_text("the king said to the people\n\nit was a fine day in the land\n")
    res = r.invoke(
        app,
        [
            "concept",
            str(tiny_run),
            "--concept",
            str(tmp_path / "c.txt"),
            "--neutral",
            str(tmp_path / "n.txt"),
            "--threshold",
            "0",
            "--min-count",
            "1",
            "--budget",
            "3",
            "--out",
            str(tmp_path / "s.json"),
            "--save",
        ],
    )
    assert res.exit_code == 0, res.output
    s = SuppressionSet.load(tmp_path / "s.json")
    assert 0 < len(s.ids) <= 3 and s.model_sha256
    # generate/eval pick up the checkpoint's suppression.json ('auto'), or a file, or none
    res = r.invoke(
        app, ["generate", str(tiny_run), "--prompt", "The", "-n", "5", "--suppress", str(tmp_path / "s.json")]
    )
    assert res.exit_code == 0 and "suppressing" in res.output, res.output
    res = r.invoke(app, ["eval", str(tiny_run), "--batches", "1", "--shards", str(tiny_shards.root)])
    assert res.exit_code == 0 and "suppressing" in res.output, res.output
    (tmp_path / "bad.json").write_text(json.dumps({**s.to_dict(), "ids": [9999]}))
    res = r.invoke(
        app, ["generate", str(tiny_run), "--prompt", "The", "-n", "2", "--suppress", str(tmp_path / "bad.json")]
    )
    assert res.exit_code == 2 and "unknown prototype id" in res.output, res.output
    res = r.invoke(app, ["generate", str(tiny_run), "-n", "2", "--suppress", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "no suppression set" in res.output
    # tasks and controllers
    res = r.invoke(
        app,
        [
            "tasks",
            "build",
            "--out",
            str(tmp_path / "tasks"),
            "--task",
            "sotu_era",
            "--train-cap",
            "12",
            "--val-cap",
            "6",
            "--test-cap",
            "8",
        ],
    )
    assert res.exit_code == 0, res.output
    res = r.invoke(
        app,
        [
            "tasks",
            "eval",
            str(tiny_run),
            "--tasks",
            str(tmp_path / "tasks"),
            "--suppress",
            "none",
            "--json",
            str(tmp_path / "acc.json"),
            "--lm-eval",
        ],
    )
    assert res.exit_code == 0, res.output
    acc = json.loads((tmp_path / "acc.json").read_text())["sotu_era"]
    assert acc["acc"] == pytest.approx(acc["lm_eval"]["acc"])
    res = r.invoke(
        app,
        [
            "controller",
            "fit",
            str(tiny_run),
            "--task",
            str(tmp_path / "tasks" / "sotu_era"),
            "--steps",
            "5",
            "--l1",
            "0.01",
            "--out",
            str(tmp_path / "ctl.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    res = r.invoke(
        app,
        [
            "tasks",
            "eval",
            str(tiny_run),
            "--tasks",
            str(tmp_path / "tasks"),
            "--suppress",
            "none",
            "--controller",
            str(tmp_path / "ctl.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["tasks", "eval", str(tiny_run), "--tasks", str(tmp_path / "nowhere")])
    assert res.exit_code == 2
    # with a prototype index: neighbourhood purity in `concept`, neighbourhoods in the controller trace
    res = r.invoke(
        app,
        [
            "index",
            str(tiny_run),
            "--shards",
            str(tiny_shards.root),
            "--max-sequences",
            "12",
            "--top-n",
            "6",
            "--batch-size",
            "4",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    res = r.invoke(
        app,
        [
            "concept",
            str(tiny_run),
            "--concept",
            str(tmp_path / "c.txt"),
            "--neutral",
            str(tmp_path / "n.txt"),
            "--threshold",
            "0",
            "--min-count",
            "1",
            "--min-purity",
            "0",
            "--index",
            str(tiny_run / "index"),
            "--concept-docs",
            "gutenberg",
            "--out",
            str(tmp_path / "s2.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    s2 = SuppressionSet.load(tmp_path / "s2.json")
    assert s2.ids and all("purity" in e and "neighbours" in e for e in s2.evidence.values())
    res = r.invoke(
        app,
        [
            "controller",
            "fit",
            str(tiny_run),
            "--task",
            str(tmp_path / "tasks" / "sotu_era"),
            "--steps",
            "5",
            "--l1",
            "0.0001",
            "--out",
            str(tmp_path / "ctl2.json"),
            "--index",
            str(tiny_run / "index"),
        ],
    )
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "ctl2.json").read_text())
    trace = saved["trace"]
    assert trace and all("neighbours" in e for e in trace)
    from prismlm.control.controller import ControllerHistory, LambdaTrial, TracedExample, TracedUnit
    from prismlm.control.suppress import Neighbour

    units = TracedUnit.__required_keys__ | TracedUnit.__optional_keys__
    assert all(TracedUnit.__required_keys__ <= set(e) <= units for e in trace)
    assert all(set(x) == TracedExample.__required_keys__ for e in trace for x in e["task_examples"])
    assert all(set(nb) <= Neighbour.__optional_keys__ for e in trace for nb in e["neighbours"])
    assert set(saved["history"]) <= ControllerHistory.__optional_keys__
    assert all(set(t) == LambdaTrial.__required_keys__ for t in saved["history"]["selection"])
    res = r.invoke(
        app,
        [
            "concept",
            str(tiny_run),
            "--concept",
            str(tmp_path / "c.txt"),
            "--neutral",
            str(tmp_path / "n.txt"),
            "--index",
            str(tiny_run / "index"),
        ],
    )
    assert res.exit_code == 2 and "both --index and --concept-docs" in res.output


def test_paired_stats_mcnemar():
    from prismlm.eval.stats import paired_stats

    b = torch.tensor([True, False] * 20)
    assert paired_stats(b, b)["mcnemar_p"] == 1.0 and paired_stats(b, b)["delta"] == 0.0
    a = b.clone()
    a[1:12:2] = True  # 6 gained, 0 lost → exact two-sided p = 2 / 2**6
    s = paired_stats(b, a)
    assert s["gained"] == 6 and s["lost"] == 0 and s["mcnemar_p"] == pytest.approx(2 / 64)
    assert s["ci95"][0] <= s["delta"] <= s["ci95"][1]
