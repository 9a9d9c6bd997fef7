"""``prism export`` and the transformers interface (``prismlm.integrations.hf_model``): an exported run loads with
``AutoModelForCausalLM`` (registered by ``import prismlm``, or through ``trust_remote_code``), gives the run's
logits and prototype decomposition, generates the same greedy tokens as ``PrismLM.generate`` (with the KV
cache, also past block_size), ships a tokenizer that encodes as the run's, keeps the run's suppression set,
and is scored by lm-eval's own ``HFLM`` as by our scorer (tiny trained run, CPU, offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import train_tiny_run

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from prismlm.app import Run  # noqa: E402
from prismlm.config import RunConfig  # noqa: E402
from prismlm.errors import DependencyError, ModelError, PrismError  # noqa: E402
from prismlm.integrations.export import export_run  # noqa: E402
from prismlm.integrations.hf_model import PrismConfig, PrismForCausalLM  # noqa: E402
from prismlm.model import Control, PrismLM, Suppress  # noqa: E402

PACKAGING = Path(__file__).resolve().parents[1] / "packaging"
HOOK = PACKAGING / "prismlm-transformers.pth"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TEXTS = [
    "It is a truth universally acknowledged, that a single man",
    "The President said that the Union is strong.",
    "Hello",
]


@pytest.fixture(scope="module")
def run_folder(tiny_shards, tmp_path_factory) -> Path:
    """The tiny PRISM preset trained 5 steps (block_size 64, K=64, top-4, tied embeddings)."""
    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("hf_run"), steps=5, batch_size=4, warmup_steps=1)[1]


@pytest.fixture(scope="module")
def run(run_folder) -> Run:
    return Run.open(run_folder, device="cpu")


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    return export_run(run, tmp_path_factory.mktemp("hf_out") / "prism")


@pytest.fixture(scope="module")
def hf(exported) -> PrismForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert isinstance(model, PrismForCausalLM)
    return model.eval()


@pytest.fixture(scope="module")
def dense_run(run, tmp_path_factory) -> Run:
    """A dense baseline with an *untied* head (random weights, the run's tokenizer): transformers must not
    tie what the model does not tie."""
    from prismlm.train.checkpoint import save_checkpoint

    d = run.config.to_dict()
    d["model"] = {**d["model"], "prototypes": None, "tie_weights": False}
    cfg = RunConfig.from_dict(d)
    torch.manual_seed(3)
    model = PrismLM(cfg.model).eval()
    folder = tmp_path_factory.mktemp("dense") / "run"
    save_checkpoint(folder, 0, model, cfg, tokenizer=run.tokenizer)
    return Run.open(folder, device="cpu")


def batch(run: Run, texts: list[str] = TEXTS) -> torch.Tensor:
    """Right-padded (with eot) ids of ``texts`` (B, T)."""
    ids = [run.tokenizer.encode(t) for t in texts]
    T = max(len(i) for i in ids)
    return torch.tensor([i + [run.tokenizer.eot_id] * (T - len(i)) for i in ids])


# ----- the exported folder loads with the run's outputs ----------------------------------------------------
def test_export_writes_a_transformers_folder(exported, run):
    names = {p.name for p in exported.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "configuration_prism.py",
        "modeling_prism.py",
    } <= names
    cfg = json.loads((exported / "config.json").read_text())
    eot = run.tokenizer.eot_id
    assert cfg["model_type"] == "prism" and cfg["architectures"] == ["PrismForCausalLM"]
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_prism.PrismConfig",
        "AutoModelForCausalLM": "modeling_prism.PrismForCausalLM",
    }
    m = run.config.model
    assert (
        cfg["vocab_size"],
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["max_position_embeddings"],
    ) == (m.vocab_size, m.n_embd, m.n_layer, m.n_head, m.block_size)
    assert cfg["tie_word_embeddings"] is True and cfg["suppressed_prototypes"] == []
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (eot, eot, eot)
    assert cfg["prism_source"]["model_sha256"] == run.identity
    gen = json.loads((exported / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"], gen["bos_token_id"]) == (eot, eot, eot)
    assert "max_length" not in gen  # it made every generate(max_new_tokens=…) warn that both are set


def test_exported_and_checkpoint_files_respect_the_umask(exported, run):
    """Every file of the export (and of the run's checkpoint) has the mode a plain ``open()`` gives — 0644
    under umask 022 — not the 0600 that safetensors' mkstemp staging leaves."""
    umask = os.umask(0o022)
    os.umask(umask)
    files = [p for p in exported.iterdir() if p.is_file()] + [p for p in run.checkpoint.path.iterdir() if p.is_file()]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert "model.safetensors" in modes
    assert all(int(m, 8) & 0o666 == 0o666 & ~umask for m in modes.values()), modes


def test_generate_does_not_warn(hf, run):
    """``generate(max_new_tokens=…)`` on the exported model logs no transformers warning (the saved
    generation config set max_length too, so every call warned that both were set)."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, root = Keep(logging.WARNING), logging.getLogger("transformers")
    prompt = torch.tensor([run.tokenizer.encode(TEXTS[0])[:6]])
    root.addHandler(handler)
    try:
        hf.generate(prompt, max_new_tokens=3, do_sample=False)
    finally:
        root.removeHandler(handler)
    assert not [r.getMessage() for r in records]


def test_auto_model_gives_the_runs_logits_and_prototypes(hf, run):
    x = batch(run)
    with torch.no_grad():
        want = run.model(x)
        got = hf(x)
    assert got.logits.dtype == torch.float32
    assert (got.logits - want.logits).abs().max().item() <= 1e-5
    assert torch.equal(got.prototype_indices, want.indices)
    torch.testing.assert_close(got.prototype_activations, want.activations, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.residual, want.residual, rtol=0, atol=1e-6)
    assert hf.prism.lm_head.weight is hf.prism.transformer.wte.weight  # tied again after loading
    # labels: the shifted next-token loss; return_dict=False: a tuple with the logits first
    with torch.no_grad():
        loss = hf(x, labels=x).loss
        tup = hf(x, return_dict=False)
    ref = torch.nn.functional.cross_entropy(want.logits[:, :-1].reshape(-1, want.logits.size(-1)), x[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    assert torch.equal(tup[0], got.logits)


def test_dense_untied_model_round_trips_untied(dense_run, tmp_path):
    out = export_run(dense_run, tmp_path / "dense")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.prism.lm_head.weight is not model.prism.transformer.wte.weight
    model.tie_weights()  # what lm-eval calls after loading: must not tie an untied model
    x = batch(dense_run)
    with torch.no_grad():
        got, want = model(x), dense_run.model(x)
    assert (got.logits - want.logits).abs().max().item() <= 1e-5
    assert got.prototype_indices is None and got.prototype_activations is None and got.residual is None


def test_wrapping_a_live_model_leaves_it_as_it_is(run):
    """``PrismForCausalLM(config, prism=model)`` wraps without copying and without re-initialising anything."""
    from dataclasses import asdict

    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    wrapped = PrismForCausalLM(PrismConfig(asdict(run.model.config)), prism=run.model).eval()
    assert wrapped.prism is run.model
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())
    x = batch(run)
    with torch.no_grad():
        assert torch.equal(wrapped(x).logits, run.model(x).logits)
    with pytest.raises(ModelError, match="another config"):
        PrismForCausalLM(PrismConfig({**asdict(run.model.config), "block_size": 32}), prism=run.model)


def test_save_pretrained_round_trip(hf, run, tmp_path):
    hf.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "modeling_prism.py").exists()
    again = PrismForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert isinstance(again.config, PrismConfig) and again.config.prism_model == hf.config.prism_model
    x = batch(run)
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf(x).logits)
    sd, sd2 = hf.state_dict(), again.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


# ----- generation --------------------------------------------------------------------------------------------
def test_greedy_generate_equals_prism_generate_with_the_cache(hf, run):
    """70 new tokens after an 8-token prompt crosses block_size=64: the prompt runs once, then one token per
    step against the cache, then (past block_size) the sliding window of 64 without a cache."""
    prompt = torch.tensor([run.tokenizer.encode("It is a truth universally acknowledged, that")[:8]])
    want = run.model.generate(prompt, 70, temperature=0)
    fed: list[int] = []
    handle = hf.prism.register_forward_pre_hook(lambda m, a, kw: fed.append(a[0].shape[1]), with_kwargs=True)
    try:
        got = hf.generate(prompt, max_new_tokens=70, do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(got, want)
    assert fed == [8] + [1] * (64 - 8) + [64] * (70 - 1 - (64 - 8))
    no_cache = hf.generate(prompt, max_new_tokens=70, do_sample=False, use_cache=False)
    assert torch.equal(no_cache, want)
    two = torch.tensor([run.tokenizer.encode(t)[:5] for t in TEXTS[:2]])
    assert torch.equal(hf.generate(two, max_new_tokens=12, do_sample=False), run.model.generate(two, 12, temperature=0))


@pytest.mark.parametrize("tie", [False, True])
def test_hugging_face_backbone_wraps_the_same_way(tie, tmp_path):
    """A PrismLM whose backbone is a transformers base model (a tiny random Llama): same logits after
    save/load (the tie read off the weights: embed_tokens ↔ lm_head), same greedy tokens past block_size."""
    import transformers

    from prismlm.config import ModelConfig, PrototypeConfig

    hf_cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    ).to_dict()
    cfg = ModelConfig(
        vocab_size=300,
        block_size=32,
        n_layer=2,
        n_head=4,
        n_embd=32,
        tie_weights=tie,
        backbone="hf",
        hf_config=hf_cfg,
        prototypes=PrototypeConfig(num_prototypes=16, top_k=2),
    )
    torch.manual_seed(0)
    model = PrismLM(cfg).eval()
    PrismForCausalLM.from_prism(model, eos_token_id=0).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.prism.lm_head.weight is loaded.prism.transformer.get_input_embeddings().weight) == tie
    x = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = loaded(x), model(x)
    assert (got.logits - want.logits).abs().max().item() <= 1e-5
    assert torch.equal(got.prototype_indices, want.indices)
    assert torch.equal(
        loaded.generate(x[:1, :5], max_new_tokens=40, do_sample=False, eos_token_id=None),
        model.generate(x[:1, :5], 40, temperature=0),
    )
    # left padding: positions from the mask (position_ids = cumsum − 1) and padding masked in the base model
    rows = [x[0, :9].tolist(), x[1, :4].tolist(), x[1, 3:9].tolist()]
    ids, mask = padded(rows, 0)
    out = loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    for i, r in enumerate(rows):
        assert torch.equal(out[i, ids.shape[1] - len(r) :], model.generate(torch.tensor([r]), 30, temperature=0)[0]), i
    # probing: the base model's hidden states (the last one is z), eager attentions, inputs_embeds
    with torch.no_grad():
        probe = loaded(x, output_hidden_states=True, output_attentions=True)
        emb = loaded(inputs_embeds=loaded.get_input_embeddings()(x))
    assert len(probe.hidden_states) == 3 and torch.equal(loaded.prism.lm_head(probe.hidden_states[-1]), probe.logits)
    assert [a.shape for a in probe.attentions] == [(2, 4, 12, 12)] * 2
    torch.testing.assert_close(probe.attentions[0].sum(-1), torch.ones(2, 4, 12))
    assert (probe.logits - got.logits).abs().max().item() <= 1e-5
    assert (emb.logits - got.logits).abs().max().item() <= 1e-5
    assert loaded.prism.transformer.config._attn_implementation == "sdpa"  # eager only for that call


def padded(rows: list[list[int]], pad: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) (B, L) of ``rows`` padded with ``pad`` on ``side``."""
    L = max(len(r) for r in rows)
    ids = [[pad] * (L - len(r)) + r if side == "left" else r + [pad] * (L - len(r)) for r in rows]
    mask = [[0] * (L - len(r)) + [1] * len(r) if side == "left" else [1] * len(r) + [0] * (L - len(r)) for r in rows]
    return torch.tensor(ids), torch.tensor(mask)


def test_padding_on_either_side_gives_each_rows_own_logits(hf, run):
    """A padded batch (left: what transformers' generation uses; right) gives every real token of a row the
    logits of that row run alone, unpadded — positions count real tokens only, padding is never attended."""
    rows = [run.tokenizer.encode(t) for t in TEXTS]
    for side in ("left", "right"):
        ids, mask = padded(rows, run.tokenizer.eot_id, side)
        with torch.no_grad():
            got = hf(ids, attention_mask=mask).logits
            for i, r in enumerate(rows):
                want = run.model(torch.tensor([r])).logits[0]  # (n, V)
                real = got[i][mask[i].bool()]  # (n, V)
                assert (real - want).abs().max().item() <= 1e-5, (side, i)
    # position_ids are the model's own (cumsum(mask) − 1) or refused, never silently ignored
    ids, mask = padded(rows, run.tokenizer.eot_id)
    with torch.no_grad():
        same = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        assert torch.equal(same, hf(ids, attention_mask=mask).logits)
        with pytest.raises(ModelError, match="position_ids differ"):
            hf(ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None])


@pytest.fixture(scope="module")
def noisy(exported) -> PrismForCausalLM:
    """The exported model with seeded noise on its matrices: greedy decoding of the 5-step model collapses
    into one repeated token, which would let a shifted position or a leaked pad pass unseen."""
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.prism.named_parameters():
            if p.dim() == 2 and not name.startswith("prototypes."):
                p.add_(torch.randn(p.shape, generator=g))
    return model


def test_left_padded_batched_generate_equals_each_row_alone(noisy, run, exported):
    """The exported tokenizer pads on the left; greedy ``generate`` on the padded batch gives every row the
    tokens of ``PrismLM.generate`` on that row alone — 70 new tokens, so the cached steps and (past
    block_size=64) the sliding window both run with padding in the batch."""
    tok = AutoTokenizer.from_pretrained(exported)
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    assert tok.padding_side == "left" and not bool(enc["attention_mask"].all())
    out = noisy.generate(**enc, max_new_tokens=70, do_sample=False, eos_token_id=None)
    L = enc["input_ids"].shape[1]
    for i, text in enumerate(TEXTS):
        want = noisy.prism.generate(torch.tensor([run.tokenizer.encode(text)]), 70, temperature=0)[0]
        n = int(enc["attention_mask"][i].sum())
        assert torch.equal(out[i, L - n :], want), i
        assert len(set(want[n:].tolist())) > 5  # a varied continuation: the comparison can tell rows apart


def test_hidden_states_attentions_and_inputs_embeds(hf, run, exported):
    """``model(**ids, output_hidden_states=True, output_attentions=True)`` as on transformers' models:
    n_layer + 1 hidden states, the last the final-norm output the head reads (logits = lm_head of it, the
    run's own z); n_layer attention maps, causal rows summing to 1; ``inputs_embeds`` = the token
    embeddings of the ids gives their logits."""
    tok = AutoTokenizer.from_pretrained(exported)
    enc = tok(TEXTS[:2], return_tensors="pt", padding=True)
    n_layer = run.config.model.n_layer
    with torch.no_grad():
        out = hf(**enc, output_hidden_states=True, output_attentions=True)
        want = run.model(torch.tensor([run.tokenizer.encode(TEXTS[0])]))
        emb = hf(inputs_embeds=hf.get_input_embeddings()(enc["input_ids"]), attention_mask=enc["attention_mask"])
    B, T = enc["input_ids"].shape
    assert len(out.hidden_states) == n_layer + 1 and all(
        h.shape == (B, T, run.config.model.n_embd) for h in out.hidden_states
    )
    assert torch.equal(hf.prism.lm_head(out.hidden_states[-1]), out.logits)
    assert (out.hidden_states[-1][0] - want.hidden[0]).abs().max().item() <= 1e-5  # row 0 is unpadded
    assert len(out.attentions) == n_layer
    heads = run.config.model.n_head
    for att in out.attentions:
        assert att.shape == (B, heads, T, T)
        torch.testing.assert_close(att.sum(-1), torch.ones(B, heads, T))
        assert not att.triu(1).any()  # causal
        real = enc["attention_mask"][1].bool()
        assert not att[1][:, real][:, :, ~real].any()  # real tokens give padding keys no weight
    assert torch.equal(emb.logits, hf(**enc).logits)
    assert hf(**enc).hidden_states is None  # only when asked


# ----- tokenizer ---------------------------------------------------------------------------------------------
def test_tokenizer_loads_and_encodes_like_the_run(exported, run):
    tok = AutoTokenizer.from_pretrained(exported)
    eot = run.tokenizer.eot_id
    assert tok.eos_token_id == eot and tok.bos_token_id == eot and tok.pad_token_id == eot
    assert tok.model_max_length == run.config.model.block_size and tok.padding_side == "left"
    for text in TEXTS + ["  spaces\tand\nnewlines  ", "ünïcödé — “quotes”"]:
        ids = run.tokenizer.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids
        assert tok(text)["input_ids"] == ids  # no BOS/EOS added by default
        assert tok.decode(ids) == run.tokenizer.decode(ids)


def test_a_loaded_run_generates_from_text(run):
    """``Run.open``/``load_checkpoint`` attach the run's tokenizer, so ``run.model.generate("text", n)`` returns
    the text plus the decoded continuation of its ids."""
    prompt = TEXTS[1]
    ids = run.tokenizer.encode(prompt)
    want = run.model.generate(torch.tensor([ids]), 5, temperature=0)[0, len(ids) :].tolist()
    assert run.model.generate(prompt, 5, temperature=0) == prompt + run.tokenizer.decode(want)


# ----- interventions are baked in ----------------------------------------------------------------------------
def test_suppressed_run_exports_suppressed_logits(run_folder, run, tmp_path):
    """`prism export RUN OUT --suppress FILE`: config.json lists the ids, the loaded model's logits are the
    suppressed run's (and differ from the unsuppressed ones)."""
    from typer.testing import CliRunner

    from prismlm.cli.main import app
    from prismlm.control.suppress import SuppressionSet

    x = batch(run)
    with torch.no_grad():
        active = run.model(x).indices
    ids = sorted(set(active[..., 0].flatten().tolist()))[:3]  # top prototypes of these tokens
    sfile = SuppressionSet(ids=ids, num_prototypes=64, model_sha256=run.identity, concept="test").save(
        tmp_path / "s.json"
    )
    out = tmp_path / "suppressed"
    res = CliRunner().invoke(app, ["export", str(run_folder), str(out), "--suppress", str(sfile), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert str(out) in res.output and "model.safetensors" in res.output
    assert json.loads((out / "config.json").read_text())["suppressed_prototypes"] == ids
    suppressed = Run.open(run_folder, device="cpu", suppress=sfile)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad(), suppressed.intervened() as m:
        want = m(x).logits
    with torch.no_grad():
        got = model(x).logits
        plain = run.model(x).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - plain).abs().max().item() > 1e-3
    assert torch.equal(
        model.generate(x[:1, :6], max_new_tokens=10, do_sample=False), _generate_intervened(suppressed, x[:1, :6], 10)
    )


def _generate_intervened(run: Run, prompt: torch.Tensor, n: int) -> torch.Tensor:
    with run.intervened() as m:
        return m.generate(prompt, n, temperature=0)


def test_controller_multipliers_are_baked_in(run, tmp_path):
    c = torch.zeros(64)
    c[[1, 5, 9]] = torch.tensor([0.5, -1.0, 2.0])
    iv = Control(c)
    hf = PrismForCausalLM.from_prism(run.model, interventions=(iv, Suppress.of([7])))
    assert hf.config.suppressed_prototypes == [5, 7] and len(hf.config.prototype_multipliers) == 64
    hf.save_pretrained(tmp_path / "ctl")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ctl").eval()
    x = batch(run)
    with torch.no_grad(), run.model.intervene(iv, Suppress.of([7])) as m:
        want = m(x).logits
    with torch.no_grad():
        assert (loaded(x).logits - want).abs().max().item() <= 1e-5
    with pytest.raises(ModelError, match="dense baseline"):
        PrismForCausalLM.from_prism(
            PrismLM(RunConfig.from_name("tiny").override({"model.prototypes": None}).model),
            interventions=(Suppress.of([1]),),
        )


# ----- lm-eval --model hf --------------------------------------------------------------------------------------
def test_lm_eval_hflm_scores_like_our_scorer(exported, run):
    """lm-eval's own ``HFLM(pretrained=OUT)`` — what ``lm_eval --model hf --model_args pretrained=OUT`` runs —
    gives the log-likelihoods of ``prismlm.eval.scoring.loglikelihoods`` on the run."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from prismlm.eval.scoring import loglikelihoods

    reqs = [
        ("", "It is a truth"),
        ("It is a truth", " universally acknowledged"),
        ("The President said", " that the Union"),
    ]
    lm = HFLM(pretrained=str(exported), device="cpu", batch_size=1)
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)])
    want = loglikelihoods(run.model, run.tokenizer, reqs, batch_size=1)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)


def test_lm_eval_hflm_generate_until_task_at_batch_size_4(noisy, run, exported, tmp_path, monkeypatch):
    """``lm_eval --model hf --batch_size 4`` on a local generate_until task (in process: lm-eval's own
    ``simple_evaluate`` with ``HFLM``): lm-eval left-pads each batch of 4 contexts and calls ``generate``;
    every logged answer is the greedy continuation of its context alone (cut at the end-of-text token,
    as lm-eval cuts), and exact_match scores them."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    contexts = [*TEXTS, "We the people of the United States", "In the beginning", "Congress shall make no law"]
    eot = run.tokenizer.decode([run.tokenizer.eot_id])
    want = [
        run.tokenizer.decode(
            noisy.prism.generate(torch.tensor([run.tokenizer.encode(c)]), 12, temperature=0)[0, -12:].tolist()
        ).split(eot)[0]
        for c in contexts
    ]
    targets = [w if i % 2 == 0 else "no" for i, w in enumerate(want)]  # exact_match 3/6
    folder = tmp_path / "gen_task"
    folder.mkdir()
    (folder / "test.jsonl").write_text(
        "".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in zip(contexts, targets))
    )
    (folder / "gen.yaml").write_text(
        f"task: prism_tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(folder / 'test.jsonl'))}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\ntarget_delimiter: ''\n"
        "generation_kwargs:\n  until: []\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    tok = AutoTokenizer.from_pretrained(exported)
    lm = HFLM(pretrained=noisy, tokenizer=tok, device="cpu", batch_size=4)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["prism_tiny_gen"],
        log_samples=True,
        cache_requests=False,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
    )
    samples = sorted(out["samples"]["prism_tiny_gen"], key=lambda x: x["doc_id"])
    assert [s["resps"][0][0] for s in samples] == want
    assert len(set(want)) == len(want)  # varied answers: the comparison can tell rows apart
    assert out["results"]["prism_tiny_gen"]["exact_match,none"] == pytest.approx(3 / 6)


# ----- registration: import prismlm (either order), or trust_remote_code without it ----------------------
_CHECK = """
ref = torch.load({ref!r})
out = model(ref["x"])
assert type(model).__name__ == "PrismForCausalLM", type(model)
assert (out.logits - ref["logits"]).abs().max().item() <= 1e-5
print("ok")
"""
_SCRIPTS = {
    "prismlm first": """
        import sys, torch
        import prismlm
        assert "transformers" not in sys.modules, "import prismlm imported transformers"
        from transformers import AutoModelForCausalLM
        assert not [f for f in sys.meta_path if type(f).__name__ == "_RegisterAfterImport"], "hook still installed"
        model = AutoModelForCausalLM.from_pretrained({out!r})
        from transformers import AutoTokenizer
        assert AutoTokenizer.from_pretrained({out!r}).padding_side == "left"  # no [y/N] prompt (checked below)
        """,
    "transformers first": """
        import torch
        from transformers import AutoModelForCausalLM
        import prismlm
        model = AutoModelForCausalLM.from_pretrained({out!r})
        """,
    "prismlm.integrations.hf_model first (as prism export)": """
        import sys, torch, warnings
        warnings.simplefilter("error", RuntimeWarning)  # 'could not register the prism model type' fails
        import prismlm
        from prismlm.integrations.hf_model import PrismForCausalLM
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({out!r})
        """,
    "no prismlm, no remote code (the startup hook)": """
        import site, sys, torch
        site.addsitedir({packaging!r})  # what site-packages does with the installed copy at interpreter start
        assert "prismlm" not in sys.modules, "the startup hook imported prismlm before transformers"
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        assert type(AutoConfig.from_pretrained({out!r})).__name__ == "PrismConfig"  # no [y/N]: 'prism' is known
        assert AutoTokenizer.from_pretrained({out!r}).padding_side == "left"
        model = AutoModelForCausalLM.from_pretrained({out!r})
        """,
    "remote code, no prismlm": """
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True)
        assert "prismlm.integrations.hf_model" in sys.modules  # imported by the shipped modeling_prism.py
        """,
}


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_auto_classes_know_prism_in_fresh_interpreters(exported, run, tmp_path):
    """Four fresh interpreters, run side by side: ``import prismlm`` then transformers (the import hook
    registers, transformers is not imported by prismlm itself), transformers then ``import prismlm``
    (registers at once), ``prismlm.integrations.hf_model`` importing transformers first (what ``prism export``
    does: the hook fires inside that half-executed module, and must neither warn nor skip the
    registration), the startup hook ``prismlm-transformers.pth`` without importing prismlm (Auto classes
    and AutoTokenizer with no ``trust_remote_code`` and no ``[y/N]`` prompt), and ``trust_remote_code=True``
    without prismlm at all (the hook switched off)."""
    x = batch(run)
    with torch.no_grad():
        torch.save({"x": x, "logits": run.model(x).logits}, tmp_path / "ref.pt")
    env = {
        **os.environ,
        **OFFLINE,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    procs = {}
    for name, body in _SCRIPTS.items():
        code = textwrap.dedent(body).format(out=str(exported), packaging=str(PACKAGING))
        code += _CHECK.format(ref=str(tmp_path / "ref.pt"))
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "PRISMLM_NO_STARTUP_HOOK": "1"} if name.startswith("remote code") else env,
            cwd=tmp_path,
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    failed = []
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=240)
        if p.returncode != 0 or stdout.strip().splitlines()[-1:] != ["ok"] or "[y/N]" in stdout + stderr:
            failed.append(f"{name}: rc {p.returncode}\n{stderr[-2000:]}")
    assert not failed, "\n\n".join(failed)


def test_the_startup_hook_is_installed_where_site_runs_it():
    """``scripts/setup.sh`` (editable) and the wheel (``setup.py``) put ``prismlm-transformers.pth`` in
    site-packages; a stale or missing copy would bring transformers' ``[y/N]`` prompt back."""
    import sysconfig

    installed = Path(sysconfig.get_paths()["purelib"]) / HOOK.name
    assert installed.is_file(), f"{installed} is missing: run scripts/setup.sh"
    assert installed.read_text() == HOOK.read_text()


# ----- refusals ------------------------------------------------------------------------------------------------
def test_export_refuses_an_existing_folder_unless_overwrite(run, exported, tmp_path):
    """An export is replaced only with overwrite; a run folder, a checkpoint, another run's folder and a user's
    folder never (old main replaced another run or a user's folder with overwrite=True)."""
    before = (exported / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(PrismError, match="already") as e:
        export_run(run, exported)
    assert "`overwrite`" in (e.value.fix or "")
    assert (exported / "model.safetensors").stat().st_mtime_ns == before  # untouched
    for mine in (run.folder, run.checkpoint.path, run.folder / "checkpoints"):
        with pytest.raises(PrismError, match="run folder|checkpoint|holds the run"):
            export_run(run, mine, overwrite=True)
    assert run.checkpoint.path.exists() and (run.folder / "checkpoints" / "latest").exists()
    (tmp_path / "empty").mkdir()
    assert export_run(run, tmp_path / "empty") == tmp_path / "empty"  # an empty folder is fine
    assert export_run(run, tmp_path / "empty", overwrite=True) == tmp_path / "empty"  # an export: replaced
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "old.txt").write_text("x")
    with pytest.raises(PrismError, match="not empty.*even with `overwrite`"):
        export_run(run, tmp_path / "busy", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["old.txt"]
    assert not (tmp_path / "busy.tmp").exists() and not (tmp_path / "empty.old").exists()


def test_missing_transformers_is_a_dependency_error(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    monkeypatch.delitem(sys.modules, "prismlm.integrations.hf_model")
    with pytest.raises(DependencyError) as e:
        importlib.import_module("prismlm.integrations.hf_model")
    assert "pip install" in (e.value.fix or "")


def test_folders_exported_before_the_move_still_import_their_module():
    # an older export's modeling_prism.py says `from prismlm.model.hf_model import PrismConfig, PrismForCausalLM`
    import importlib

    import prismlm.integrations.hf_model as new

    old = importlib.import_module("prismlm.model.hf_model")
    assert old.PrismForCausalLM is new.PrismForCausalLM and old.PrismConfig is new.PrismConfig
