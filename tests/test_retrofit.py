"""Retrofitting a prototype head onto pretrained causal LMs (tiny random transformers models, offline)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from prismlm.app import Run  # noqa: E402
from prismlm.cli import app as cli_app  # noqa: E402
from prismlm.config import ModelConfig  # noqa: E402
from prismlm.errors import ModelError, PrismError, TokenizerError  # noqa: E402
from prismlm.model import PrismLM, decompose  # noqa: E402
from prismlm.model.generation import Sampling  # noqa: E402
from prismlm.model.hf_backbone import gpt2_state_dict  # noqa: E402

V, CTX = 512, 64
SMALL_DATA = ["--set", "data.max_docs=60", "--set", "data.max_chars_per_doc=4000"]


def hf_tokenizer_from(tok):
    """A transformers fast tokenizer around one of our tokenizers (the tiny BPE), eos = its end-of-text."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, eos_token=tok.backend.id_to_token(tok.eot_id)
    )


def tiny_hf_model(arch: str, vocab: int = V):
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=CTX,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(cfg)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CTX,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.LlamaForCausalLM(cfg)
    if arch == "neox":
        cfg = transformers.GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=CTX,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPTNeoXForCausalLM(cfg)
    if arch == "phi":  # Phi's unembedding has a bias: the decomposition's bias slice
        cfg = transformers.PhiConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=CTX,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        )
        model = transformers.PhiForCausalLM(cfg)
        with torch.no_grad():
            model.lm_head.bias.normal_(0.0, 1.0)  # a visible bias (it starts at zero)
        return model
    raise ValueError(arch)


@pytest.fixture(scope="module")
def hf_folders(tiny_shards, tmp_path_factory):
    """arch → a saved tiny random causal LM with the tiny BPE as its tokenizer."""
    root = tmp_path_factory.mktemp("hf_models")
    tok = hf_tokenizer_from(tiny_shards.tokenizer)
    out = {}
    for arch in ("gpt2", "llama", "neox", "phi"):
        path = root / arch
        tiny_hf_model(arch).save_pretrained(path)
        tok.save_pretrained(path)
        out[arch] = path
    return out


def retrofit_cli(source, out, *extra):
    args = [
        "retrofit",
        "--from",
        str(source),
        "--out",
        str(out),
        "--prototypes",
        "64",
        "--top-k",
        "4",
        "--batch-size",
        "4",
        "--no-progress",
        "--device",
        "cpu",
        *SMALL_DATA,
        *extra,
    ]
    res = CliRunner().invoke(cli_app, args)
    assert res.exit_code == 0, res.output
    return out


class _Retrofits(dict):
    """arch → run folder retrofitted with a frozen backbone (stage 1 only, 6 steps), made when first asked for:
    the fast test reads one architecture, the slow ones all four."""

    def __init__(self, sources, root):
        super().__init__()
        self.sources, self.root = sources, root

    def __missing__(self, arch):
        self[arch] = retrofit_cli(self.sources[arch], self.root / arch, "--steps", "6")
        return self[arch]


@pytest.fixture(scope="module")
def retrofitted(hf_folders, tmp_path_factory):
    return _Retrofits(hf_folders, tmp_path_factory.mktemp("retrofits"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox", "phi"])
def test_frozen_retrofit_keeps_the_models_logits_and_decomposes_them(arch, hf_folders, retrofitted):
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_folders[arch]).double().eval()
    run = Run.open(retrofitted[arch], device="cpu")
    model = run.model.double()
    assert model.is_prism and model.config.backbone == ("gpt" if arch == "gpt2" else "hf")
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids).logits  # (2, 40, V)
        out = model(ids)
    got = out.logits[..., :V]
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max())), float((got - want).abs().max())
    # every logit is k prototype slices plus the residual plus W's bias (Phi has one), exactly
    dec = decompose(model, out, ids)
    assert (dec.bias_slice != 0).any() == (arch == "phi")
    assert torch.allclose(
        dec.prototype_slices.sum(-1) + dec.residual_slice + dec.bias_slice,
        dec.logit,
        rtol=0,
        atol=1e-9 * float(dec.logit.abs().max()),
    )
    # the bank trained: it is no longer the seed (stage 1 moved it)
    assert (out.activations > 0).any()


def test_retrofit_trains_only_the_bank_in_stage_1_and_anchors_it_to_data(hf_folders, retrofitted):
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_folders["llama"])
    run = Run.open(retrofitted["llama"], device="cpu")
    ours = run.model.state_dict()
    for name, value in reference.model.state_dict().items():
        assert torch.equal(ours[f"transformer.{name}"], value), name
    assert torch.equal(ours["lm_head.weight"], reference.lm_head.weight)
    # the reconstruction loss fell while the bank trained
    lines = [json.loads(x) for x in (retrofitted["llama"] / "metrics.jsonl").read_text().splitlines()]
    rec = [x["train_rec"] for x in lines if "train_rec" in x]
    assert len(rec) >= 2 and rec[-1] < rec[0]
    cfg = json.loads((retrofitted["llama"] / "config.json").read_text())
    assert cfg["train"]["trainable"] == "prototypes" and cfg["model"]["hf_config"]["model_type"] == "llama"


@pytest.mark.slow
def test_stage_2_unfreezes_only_the_last_blocks(hf_folders, tmp_path):
    out = retrofit_cli(
        hf_folders["gpt2"], tmp_path / "joint", "--steps", "4", "--frozen-steps", "2", "--unfreeze", "last-1"
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_folders["gpt2"])
    ref = gpt2_state_dict(reference.state_dict(), CTX)
    ours = Run.open(out, device="cpu").model.state_dict()
    assert torch.equal(ours["transformer.h.0.attn.c_attn.weight"], ref["transformer.h.0.attn.c_attn.weight"])
    assert torch.equal(ours["transformer.wte.weight"], ref["transformer.wte.weight"])
    assert not torch.equal(ours["transformer.h.1.mlp.c_fc.weight"], ref["transformer.h.1.mlp.c_fc.weight"])
    assert not torch.equal(ours["transformer.ln_f.weight"], ref["transformer.ln_f.weight"])


@pytest.mark.slow
def test_stage_2_with_lora_trains_only_the_adapters_and_the_bank(hf_folders, tmp_path):
    pytest.importorskip("peft")
    out = retrofit_cli(
        hf_folders["llama"],
        tmp_path / "lora",
        "--steps",
        "4",
        "--frozen-steps",
        "2",
        "--unfreeze",
        "lora",
        "--lora-rank",
        "2",
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_folders["llama"]).eval()
    run = Run.open(out, device="cpu")
    ours, keys = run.model.state_dict(), run.model.base_state_keys()
    for name, value in reference.model.state_dict().items():  # the pretrained weights are untouched
        assert torch.equal(ours[keys[f"transformer.{name}"]], value), name
    adapters_b = [k for k in ours if ".lora_B." in k]
    assert adapters_b and any(ours[k].abs().sum() > 0 for k in adapters_b)  # B started at 0 and trained
    ids = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = run.model(ids).logits[..., :V]
        want = reference(input_ids=ids).logits
        assert not torch.allclose(got, want, atol=1e-6)  # the adapters changed the model
        again = Run.open(out, device="cpu").model(ids).logits[..., :V]
        assert torch.equal(got, again)  # adapters saved and restored with the run


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_gpt2_weights_load_into_the_builtin_gpt_with_equal_logits(activation):
    hf = tiny_hf_model("gpt2")
    hf.config.activation_function = activation
    hf = transformers.GPT2LMHeadModel(hf.config)
    with torch.no_grad():  # GPT-2-sized pre-activations (random init's are ~0.02, where both GELUs agree)
        for block in hf.transformer.h:
            block.mlp.c_fc.weight.mul_(100.0)
    hf.double().eval()
    mine = "gelu_tanh" if activation == "gelu_new" else "gelu"
    cfg = ModelConfig(vocab_size=V, block_size=CTX, n_layer=2, n_head=4, n_embd=32, activation=mine, prototypes=None)
    model = PrismLM(cfg).double().eval()
    model.load_state_dict(gpt2_state_dict(hf.state_dict(), CTX))
    ids = torch.randint(0, V, (3, CTX), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits, model(ids).logits
        assert torch.allclose(got, want, rtol=0, atol=1e-10)
        # the activation matters: the other GELU would not load GPT-2 exactly (why ModelConfig.activation exists)
        other = PrismLM(ModelConfig(**{**vars(cfg), "activation": "gelu" if mine == "gelu_tanh" else "gelu_tanh"}))
        other.double().eval().load_state_dict(gpt2_state_dict(hf.state_dict(), CTX))
        assert (other(ids).logits - want).abs().max() > 1e-5


def test_a_retrofitted_dense_prismlm_run_keeps_its_logits_bit_for_bit(tiny_shards, tmp_path):
    from prismlm import RunConfig
    from prismlm.train import train

    dense = tmp_path / "dense"
    cfg = RunConfig.from_name("tiny").dense().override({"train.max_steps": 3, "train.batch_size": 4})
    train(cfg, dense, shards=tiny_shards, progress=False)
    out = retrofit_cli(dense, tmp_path / "retro", "--steps", "3")
    base, retro = Run.open(dense, device="cpu").model, Run.open(out, device="cpu").model
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(base(ids).logits, retro(ids).logits)


def test_bad_sources_are_one_line_errors(hf_folders, tmp_path):
    from prismlm.model.pretrained import load_pretrained

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="neither a prismlm run nor a transformers model"):
        load_pretrained(str(tmp_path / "empty"))
    no_tok = tmp_path / "no_tokenizer"
    tiny_hf_model("gpt2").save_pretrained(no_tok)
    with pytest.raises(TokenizerError, match="no usable tokenizer"):
        load_pretrained(str(no_tok))
    encoder = tmp_path / "encoder"
    transformers.DistilBertModel(
        transformers.DistilBertConfig(vocab_size=V, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    ).save_pretrained(encoder)
    with pytest.raises(ModelError, match="not a causal language model"):
        load_pretrained(str(encoder))
    capped = tmp_path / "softcapped"
    transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            final_logit_softcapping=30.0,
        )
    ).save_pretrained(capped)
    with pytest.raises(ModelError, match="soft-caps the logits"):
        load_pretrained(str(capped))
    res = CliRunner().invoke(cli_app, ["retrofit", "--from", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output
    with pytest.raises(PrismError, match="^`unfreeze` must be"):
        from prismlm.app.retrofit import RetrofitRecipe, retrofit_model

        retrofit_model(str(hf_folders["gpt2"]), out=tmp_path / "x", recipe=RetrofitRecipe(unfreeze="some"))


def test_downstream_operations_work_on_a_retrofitted_hf_backbone(retrofitted):
    from prismlm.app import ExplanationRequest, build_run_index, explain_text, generate

    run = Run.open(retrofitted["llama"], device="cpu")
    res = build_run_index(run, max_sequences=8, progress=False)
    assert res.path.exists()
    run = Run.open(retrofitted["llama"], device="cpu")  # the index is picked up by explanations
    exp = explain_text(run, "The people of the", ExplanationRequest(generate=4))
    assert exp.prompt_tokens is not None and len(exp.token_ids) > exp.prompt_tokens
    assert exp.max_abs_error < 1e-3 and exp.index is not None
    assert isinstance(generate(run, "The people", tokens=5, samples=1, sampling=Sampling(temperature=0.0))[0], str)
    html = retrofitted["llama"] / "report.html"  # the static explorer page, through the CLI
    res = CliRunner().invoke(
        cli_app,
        [
            "explain",
            str(retrofitted["llama"]),
            "The people of",
            "--generate",
            "3",
            "--html",
            str(html),
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "The people" in html.read_text()
    # training-data attribution in prototype space, exact (full) and through the postings cache
    from prismlm.app import attribute_text, build_run_cache
    from prismlm.config import AttributionConfig
    from prismlm.tda.attribute import QuerySpec, SearchSpec

    full = attribute_text(
        run,
        "The people of the United States",
        QuerySpec(completion=2),
        SearchSpec(top=3, method="full", max_sequences=16),
    )
    build_run_cache(run, AttributionConfig(max_sequences=16), progress=False)
    cached = attribute_text(
        Run.open(retrofitted["llama"], device="cpu"),
        "The people of the United States",
        QuerySpec(completion=2),
        SearchSpec(top=3),
    )
    assert len(full.top) == 3 and [t.sequence for t in full.top] == [t.sequence for t in cached.top]
    # suppression removes exactly the suppressed prototype's slice from the logit it contributed to
    x = torch.tensor([run.tokenizer.encode("The people of the United States")])
    model = run.model.double()
    with torch.no_grad():
        out = model(x)
        top = int(out.indices[0, -1, 0])
        y = out.logits[:, -1:].argmax(-1).expand(1, x.shape[1])  # (1, T): one token scored at every position
        dec = decompose(model, out, y)
        with model.suppress([top]):
            sup = model(x)
    removed = dec.prototype_slices[0, -1, 0]
    assert torch.allclose(sup.logits[0, -1, y[0, -1]], dec.logit[0, -1] - removed, atol=1e-9)
    assert abs(float(removed)) > 0


@pytest.mark.slow
def test_a_frozen_backbone_trains_the_bank_without_dropout(tiny_shards, tmp_path):
    """Stage 1 runs the frozen backbone in eval mode: with attention dropout 0.9 in the model's config the bank
    learns exactly what it learns without dropout (train mode would feed it noised hidden states)."""
    tok = hf_tokenizer_from(tiny_shards.tokenizer)
    banks = []
    for p_drop in (0.0, 0.9):
        model = tiny_hf_model("llama")
        model.config.attention_dropout = p_drop
        folder = tmp_path / f"llama-{p_drop}"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out = retrofit_cli(folder, tmp_path / f"run-{p_drop}", "--steps", "3")
        banks.append(Run.open(out, device="cpu").model.prototypes.weight)
    assert torch.equal(banks[0], banks[1])


def test_explanations_carry_the_unembedding_bias(retrofitted):
    """Phi's W has a bias: explanations report it as its own slice, so slices + residual + bias = logit."""
    from prismlm.app import explain_text

    exp = explain_text(Run.open(retrofitted["phi"], device="cpu"), "The people of the United States")
    assert any(abs(p.bias_slice) > 1e-3 for p in exp.positions)
    assert exp.max_abs_error < 1e-4 * max(abs(p.logit) for p in exp.positions)


def _broken_copy(src, dst, *, config: dict | None = None, weights: str | None = None):
    """A copy of a saved model folder with config.json keys changed and/or its weights removed or cut."""
    import shutil

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    w = dst / "model.safetensors"
    if weights == "missing":
        w.unlink()
    elif weights == "truncated":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 3])
    return dst


@pytest.mark.parametrize(
    "case, expected",
    [
        ({"config": {"vocab_size": 0}}, "vocab_size must be a positive integer, got 0"),
        ({"config": {"vocab_size": -7}}, "vocab_size must be a positive integer, got -7"),
        ({"config": {"vocab_size": "big"}}, "vocab_size must be a positive integer, got 'big'"),
        ({"weights": "missing"}, "no weights to load"),
        ({"weights": "truncated"}, "weights file cannot be read"),
        ({"config": {"n_embd": 64}}, "do not match its config.json"),
    ],
)
def test_broken_transformers_folders_are_one_line_errors(hf_folders, tmp_path, case, expected):
    """Issue 23 item 4: each of these crashed inside transformers/safetensors with a traceback."""
    src = _broken_copy(hf_folders["gpt2"], tmp_path / "broken", **case)
    res = CliRunner().invoke(cli_app, ["retrofit", "--from", str(src), "--out", str(tmp_path / "r"), "--no-progress"])
    assert res.exit_code == 2, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error:") and expected in last and "fix:" in last, res.output


def test_a_config_file_for_from_points_to_its_folder(hf_folders, tmp_path):
    res = CliRunner().invoke(
        cli_app, ["retrofit", "--from", str(hf_folders["gpt2"] / "config.json"), "--out", str(tmp_path / "r")]
    )
    assert res.exit_code == 2 and "is a file" in res.output and f"--from {hf_folders['gpt2']}" in res.output, res.output


def test_a_bert_folder_is_not_a_causal_lm(hf_folders, tmp_path):
    """transformers maps BERT to BertLMHeadModel, which loads (missing its decoder-only parts); the error
    must say what is wrong: an encoder, not "weights do not fit (missing pooler)"."""
    bert = tmp_path / "bert"
    transformers.BertModel(
        transformers.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    ).save_pretrained(bert)
    hf_tokenizer_from_folder = transformers.AutoTokenizer.from_pretrained(hf_folders["gpt2"])
    hf_tokenizer_from_folder.save_pretrained(bert)
    from prismlm.model.pretrained import load_pretrained

    with pytest.raises(ModelError, match="not a causal LM"):
        load_pretrained(str(bert))
