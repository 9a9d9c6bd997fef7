"""The lm-eval adapter as a drop-in: the ``prism-lm-eval`` command line, rolling log-likelihood against
lm-eval's own ``HFLM`` on the same weights, ``generate_until`` against a hand-written greedy loop, and the
errors of bad ``model_args`` (tiny trained run, CPU, offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_tiny_run

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from prismlm.errors import ConfigError, PrismError  # noqa: E402
from prismlm.integrations.lm_eval_adapter import PrismEvalLM, with_device  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    """(Checkpoint, run folder) of the tiny preset trained 30 steps (block_size 64, K=64)."""
    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("lm_eval"), steps=30, batch_size=8, warmup_steps=2)


def rolling(*texts: str) -> list[Instance]:
    return [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]


def long_text(words: int = 200) -> str:
    from prismlm.data.corpus import gutenberg_documents

    return " ".join(next(iter(gutenberg_documents())).text.split()[:words])


def cli() -> list[str]:
    script = Path(sys.executable).parent / "prism-lm-eval"  # installed by scripts/setup.sh
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from prismlm.integrations.lm_eval_adapter import main; main()"]


def run_cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([*cli(), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


# ----- 1. the real command line -------------------------------------------------------------------------
@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_cli_scores_like_our_scorer_and_reports_device_and_tokenizer(trained, tmp_path):
    """``prism-lm-eval --model prism`` (a subprocess, as a user runs it, no ``--device``): per-choice
    log-likelihoods and accuracy equal our own scorer's; the results JSON names the device the model ran
    on (cpu, not lm-eval's default cuda:0) and fills the tokenizer fields."""
    from prismlm.eval.scoring import mc_accuracy
    from prismlm.eval.tasks import build_task, write_task

    ckpt, run = trained
    splits = build_task("sotu_era", {"train": 4, "validation": 4, "test": 12})
    folder = write_task("sotu_era", splits, tmp_path / "tasks")
    res = run_cli(
        [
            "--model",
            "prism",
            "--model_args",
            f"pretrained={run}",
            "--tasks",
            "prism_sotu_era",
            "--include_path",
            str(folder),
            "--limit",
            "8",
            "--batch_size",
            "4",
            "--log_samples",
            "--output_path",
            str(tmp_path / "out"),
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    (samples_file,) = (tmp_path / "out").rglob("samples_prism_sotu_era_*.jsonl")
    out = json.loads(results_file.read_text())

    docs = splits["test"][:8]
    ours = mc_accuracy(ckpt.model, ckpt.tokenizer, docs)
    assert out["results"]["prism_sotu_era"]["acc,none"] == pytest.approx(ours.acc)
    assert out["results"]["prism_sotu_era"]["acc_norm,none"] == pytest.approx(ours.acc_norm)
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(8))
    for s in samples:
        theirs = [float(r[0][0]) for r in s["resps"]]
        assert theirs == pytest.approx(ours.loglikelihoods[s["doc_id"]], rel=1e-5, abs=1e-5)

    tok = ckpt.tokenizer
    eot = [tok.decode([tok.eot_id]), str(tok.eot_id)]
    assert out["config"]["device"] == "cpu" and out["config"]["model_device"] == "cpu"
    assert out["config"]["model_sha"] == ckpt.manifest["model_sha256"]
    assert out["tokenizer_eos_token"] == eot and out["tokenizer_pad_token"] == eot
    assert out["tokenizer_bos_token"] == eot
    assert out["eot_token_id"] == tok.eot_id and out["max_length"] == ckpt.model.config.block_size
    assert out["model_source"] == "prism"


def test_cli_reports_bad_model_args_in_one_line(trained, tmp_path, monkeypatch, capsys):
    """lm-eval's command line (in this process) with a bad ``model_args``: exit code 2 and one line."""
    import lm_eval.__main__
    import lm_eval.tasks

    from prismlm.eval.tasks import write_task
    from prismlm.integrations.lm_eval_adapter import main

    class OurTasksOnly(lm_eval.tasks.TaskManager):  # skips indexing lm-eval's ~14k task files (15 s)
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "include_defaults": False})

    _, run = trained
    docs = [{"id": "a", "query": "Q:", "choices": [" x", " y"], "gold": 0, "label": "x"}]
    folder = write_task("tiny", {"train": docs, "validation": docs, "test": docs}, tmp_path / "tasks")
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", OurTasksOnly)
    monkeypatch.setattr(lm_eval.__main__, "setup_logging", lambda: None)  # no handler on pytest's stderr
    monkeypatch.setattr(sys, "argv", ["prism-lm-eval"])  # main() sets it; restored after the test
    for model_args, what in ((f"pretrained={run},bogus=1", "bogus"), (f"pretrained={tmp_path / 'nowhere'}", "nowhere")):
        with pytest.raises(SystemExit) as e:
            main(
                ["--model", "prism", "--model_args", model_args, "--tasks", "prism_tiny", "--include_path", str(folder)]
            )
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and err.splitlines()[-1].startswith("prism-lm-eval: error:")
        assert what in err.splitlines()[-1]


def test_bad_model_args_are_reported_before_lm_eval_starts(trained, tmp_path, monkeypatch, capsys):
    """A bad key or a missing run was reported only after lm-eval had indexed its task files (~36 s): the
    check now runs on the command line as given, before lm-eval's own CLI is entered at all."""
    import lm_eval.__main__

    from prismlm.integrations.lm_eval_adapter import main

    def entered():
        raise AssertionError("lm-eval's CLI ran before the model_args were checked")

    _, run = trained
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", entered)
    monkeypatch.setattr(sys, "argv", ["prism-lm-eval"])
    cases = [
        (["--model", "prism", "--model_args", f"pretrained={run},bogus=1"], "bogus"),
        (["--model=prism", "--model_args=pretrained=" + str(tmp_path / "nowhere")], "nowhere"),
        (["--model", "prism", "--model_args", "suppress=none"], "pretrained=RUN"),
    ]
    for argv, what in cases:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--tasks", "prism_tiny"])
        assert e.value.code == 2
        assert what in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(AssertionError, match="CLI ran"):  # good args (and any other model) go on to lm-eval
        main(["--model", "prism", "--model_args", f"pretrained={run},batch_size=4", "--tasks", "prism_tiny"])
    with pytest.raises(AssertionError, match="CLI ran"):
        main(["--model", "hf", "--model_args", "pretrained=gpt2,bogus=1", "--tasks", "prism_tiny"])


def test_help_says_how_to_use_model_prism(capsys, monkeypatch):
    """``prism-lm-eval --help`` is lm-eval's help with, first, the one thing this command adds: ``--model prism``
    and its ``model_args``."""
    from prismlm.integrations.lm_eval_adapter import main

    monkeypatch.setattr(sys, "argv", ["prism-lm-eval"])  # main() sets it; restored after the test
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as e:
            main([flag])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "--model prism" in out and "pretrained=RUN" in out and "--model_args" in out
        assert "usage:" in out.lower() and out.index("--model prism") < out.lower().index("usage:")


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_registration_keeps_lm_evals_own_models():
    """lm-eval fills its registry lazily only while it is empty: registering ``prism`` first would hide
    ``hf`` and the rest (fresh interpreter, so no earlier import can mask this)."""
    code = (
        "import prismlm.integrations.lm_eval_adapter as a\n"
        "from lm_eval.api.registry import get_model\n"
        "assert get_model('prism') is a.PrismEvalLM\n"
        "assert get_model('hf').__name__ == 'HFLM'\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE}
    )
    assert res.returncode == 0, res.stderr[-2000:]


def test_default_device_is_added_only_to_evaluations(tmp_path):
    from prismlm.train.distributed import resolve_device

    here = str(resolve_device("auto"))
    args = ["--model", "prism", "--tasks", "x"]
    assert with_device(args) == [*args, "--device", here]
    assert with_device(["run", *args]) == ["run", *args, "--device", here]
    assert with_device([*args, "--device", "cpu"]) == [*args, "--device", "cpu"]
    assert with_device([*args, "--device=cpu"]) == [*args, "--device=cpu"]
    assert with_device(["ls", "tasks"]) == ["ls", "tasks"] and with_device(["--help"]) == ["--help"]
    assert with_device(["run"]) == ["run"]
    (tmp_path / "c.yaml").write_text("model: prism\ndevice: cpu\n")
    assert with_device([*args, "--config", str(tmp_path / "c.yaml")]) == [*args, "--config", str(tmp_path / "c.yaml")]
    (tmp_path / "d.yaml").write_text("model: prism\n")
    assert with_device(["-C", str(tmp_path / "d.yaml")]) == ["-C", str(tmp_path / "d.yaml"), "--device", here]


# ----- 2. rolling log-likelihood == lm-eval's HFLM on the same weights -------------------------------------
def to_hf_gpt2(model):
    """Our GPT backbone + lm_head as a transformers ``GPT2LMHeadModel`` (same module names; GPT-2's Conv1D
    stores Linear weights transposed; exact GELU). For a PRISM model the logits are lm_head(z) exactly,
    so the dense HF model gives the same logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    assert c.dropout == 0.0 and c.bias and not getattr(c, "lm_head_bias", False)
    hc = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=c.tie_weights,
    )
    hf = GPT2LMHeadModel(hc).eval()
    sd = {
        k: (v.t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v)
        for k, v in model.state_dict().items()
        if not k.startswith("prototypes.")
    }
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith(".attn.bias")], (missing, unexpected)
    return hf


def test_rolling_loglikelihood_equals_hflm_on_the_same_weights(trained, monkeypatch):
    pytest.importorskip("transformers")
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    ckpt, run = trained
    model, tok = ckpt.model, ckpt.tokenizer
    T = model.config.block_size
    hf = to_hf_gpt2(model)
    x = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits, rtol=1e-4, atol=1e-4)
    htok = PreTrainedTokenizerFast(
        tokenizer_file=str(ckpt.path / "tokenizer" / "tokenizer.json"), eos_token=tok.decode([tok.eot_id])
    )
    hflm = HFLM(pretrained=hf, tokenizer=htok, batch_size=4, device="cpu")
    assert hflm.max_length == T and hflm.prefix_token_id == tok.eot_id

    text = long_text(200)
    n = len(tok.encode(text))
    assert htok.encode(text) == tok.encode(text) and n > 3 * T  # several windows, the last one partial
    texts = (text, "A short one.", " ".join(text.split()[:60]), "")
    lm = PrismEvalLM(pretrained=str(run), batch_size=3, device="cpu")
    ours, theirs = lm.loglikelihood_rolling(rolling(*texts)), hflm.loglikelihood_rolling(rolling(*texts))
    assert ours[-1] == 0.0 and theirs[-1] == 0.0
    assert ours[:-1] == pytest.approx(theirs[:-1], rel=1e-5)
    # a text inside one window is log p(text | end-of-text): our multiple-choice scorer's number
    from prismlm.eval.scoring import loglikelihoods

    assert ours[1] == pytest.approx(loglikelihoods(model, tok, [("", texts[1])])[0][0], rel=1e-6)


# ----- 3. generate_until ---------------------------------------------------------------------------------
def perturbed(lm: PrismEvalLM) -> PrismEvalLM:
    """The adapter's (freshly loaded) model with seeded noise on its matrices: greedy decoding of the
    30-step tiny model collapses into one repeated token ("eeee…"), which would let an off-by-one in the
    context or a stop check pass unseen. The same noise every call, so two adapters hold equal weights."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if p.dim() == 2 and not name.startswith("prototypes."):
                p.add_(torch.randn(p.shape, generator=g))
    return lm


def greedy_by_hand(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens: argmax of the model's last logits over the growing prefix (last block_size)."""
    ids, new = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids[-model.config.block_size :]])).logits[0, -1].argmax())
            ids.append(nxt)
            new.append(nxt)
    return new


def gen(*reqs: tuple[str, dict]) -> list[Instance]:
    return [Instance("generate_until", {}, r, i) for i, r in enumerate(reqs)]


def test_generate_until_is_greedy_truncates_and_stops(trained):
    ckpt, run = trained
    tok = ckpt.tokenizer
    lm = perturbed(PrismEvalLM(pretrained=str(run), batch_size=2, device="cpu"))
    model = lm.model
    T, eot = model.config.block_size, tok.decode([tok.eot_id])
    words = long_text(150).split()
    # three long contexts (all cut to the same T - 20 tokens: one group, batches of 2) and two short ones
    contexts = [" ".join(words[:70]), " ".join(words[10:90]), " ".join(words[30:110]), "The President said", ""]
    assert all(len(tok.encode(c)) > T - 20 for c in contexts[:3])  # the cut matters
    got = lm.generate_until(gen(*[(c, {"until": [], "max_gen_toks": 20}) for c in contexts]))
    for c, g in zip(contexts, got):
        new = greedy_by_hand(model, (tok.encode(c) or [tok.eot_id])[-(T - 20) :], 20)
        assert len(set(new)) > 5  # not a collapsed repetition: the comparison can tell contexts apart
        assert g == tok.decode(new).split(eot)[0]
    assert len(set(got)) == len(got)
    # a stop string met in the middle of the greedy text: the output ends before it, and generation
    # stops after the chunk in which it appeared
    ids = tok.encode(contexts[0])[-(T - 40) :]
    longer = tok.decode(greedy_by_hand(model, ids, 40)).split(eot)[0]
    first_chunk = tok.decode(greedy_by_hand(model, ids, 16))
    stop = longer[len(first_chunk) // 2 : len(first_chunk) // 2 + 3]
    assert stop in first_chunk and longer.index(stop) > 0
    calls = []
    orig = model.generate

    def counting(*a, **k):
        calls.append(a[1])
        return orig(*a, **k)

    model.generate = counting
    try:
        (stopped,) = lm.generate_until(gen((contexts[0], {"until": [stop], "max_gen_toks": 40, "do_sample": False})))
    finally:
        del model.generate
    assert stopped == longer[: longer.index(stop)] and calls == [16]  # 40 tokens, stopped after the first 16
    # the end-of-text token always stops; max_gen_toks=0 generates nothing
    (none,) = lm.generate_until(gen(("The", {"until": [], "max_gen_toks": 0})))
    assert none == ""
    # sampling draws from the model (seeded: reproducible), unsupported options are refused by name
    req = gen(("The", {"do_sample": True, "temperature": 1.0, "max_gen_toks": 8, "until": []}))
    torch.manual_seed(0)
    a = lm.generate_until(req)
    torch.manual_seed(0)
    assert lm.generate_until(req) == a
    with pytest.raises(ConfigError, match="top_p"):
        lm.generate_until(gen(("The", {"until": [], "top_p": 0.5})))


def test_suppress_model_arg_applies_to_every_request_type(trained, tmp_path):
    """``suppress=FILE``: generation, log-likelihoods and rolling log-likelihoods are the suppressed
    model's (equal to the same model inside ``model.suppress(ids)``), and differ from the plain one's."""
    from prismlm.control.suppress import SuppressionSet
    from prismlm.eval.scoring import loglikelihoods

    ckpt, run = trained
    tok = ckpt.tokenizer
    plain = perturbed(PrismEvalLM(pretrained=str(run), device="cpu", suppress="none"))
    model = plain.model
    T, K = model.config.block_size, model.prototypes.num_prototypes
    context = " ".join(long_text(60).split()[:30])
    ids = tok.encode(context)[-(T - 20) :]
    with torch.no_grad():  # the prototypes most active on this context
        out = model(torch.tensor([ids]))
    act = torch.zeros(K).index_add_(0, out.indices.flatten(), out.activations.flatten())
    sup = act.argsort(descending=True)[:16].tolist()
    f = SuppressionSet(ids=sup, num_prototypes=K, model_sha256=ckpt.manifest["model_sha256"]).save(tmp_path / "s.json")
    lm = perturbed(
        PrismEvalLM.create_from_arg_string(f"pretrained={run},suppress={f}", {"device": "cpu", "batch_size": 2})
    )
    assert lm.interventions and not plain.interventions
    req = gen((context, {"until": [], "max_gen_toks": 20}))
    (g_plain,), (g_sup,) = plain.generate_until(req), lm.generate_until(req)
    ll_req = [Instance("loglikelihood", {}, (context, " the"), 0)]
    with model.suppress(sup):
        want = tok.decode(greedy_by_hand(model, ids, 20)).split(tok.decode([tok.eot_id]))[0]
        ll_want = loglikelihoods(model, tok, [(context, " the")])[0]
        rolling_want = plain.loglikelihood_rolling(rolling(context))
    assert g_sup == want and g_sup != g_plain  # the suppressed model generated, and it made a difference
    assert lm.loglikelihood(ll_req)[0] == pytest.approx(ll_want)
    assert ll_want[0] != pytest.approx(plain.loglikelihood(ll_req)[0][0])
    assert lm.loglikelihood_rolling(rolling(context)) == pytest.approx(rolling_want)
    assert rolling_want != pytest.approx(plain.loglikelihood_rolling(rolling(context)))
    assert model.proto_multipliers is None and lm.model.proto_multipliers is None  # nothing left applied


def test_suppress_residual_model_arg_projects_the_residual(trained, tmp_path):
    """``suppress=FILE,suppress_residual=project``: log-likelihoods are those of the model inside
    ``intervene(Suppress(ids, residual="project"))``; an unknown mode or a mode without a set is refused."""
    from prismlm.control.suppress import SuppressionSet
    from prismlm.eval.scoring import loglikelihoods
    from prismlm.model import Suppress

    ckpt, run = trained
    tok, K = ckpt.tokenizer, ckpt.model.prototypes.num_prototypes
    f = SuppressionSet(ids=list(range(0, K, 4)), num_prototypes=K, model_sha256=ckpt.manifest["model_sha256"])
    f = f.save(tmp_path / "s.json")
    extra = {"device": "cpu", "batch_size": 2}
    lm = PrismEvalLM.create_from_arg_string(f"pretrained={run},suppress={f},suppress_residual=project", extra)
    assert [iv.residual for iv in lm.interventions] == ["project"]
    keep = PrismEvalLM.create_from_arg_string(f"pretrained={run},suppress={f}", extra)
    req = [Instance("loglikelihood", {}, ("It was the best of times", " it was"), 0)]
    with lm.model.intervene(Suppress.of(range(0, K, 4), residual="project")):
        want = loglikelihoods(lm.model, tok, [req[0].args])[0]
    assert lm.loglikelihood(req)[0] == pytest.approx(want)
    assert keep.loglikelihood(req)[0][0] != pytest.approx(want[0])
    mean = PrismEvalLM.create_from_arg_string(f"pretrained={run},suppress={f},suppress_residual=mean", extra)
    assert [iv.residual for iv in mean.interventions] == ["mean"]
    with mean.model.intervene(Suppress.of(range(0, K, 4), residual="mean")):
        want_mean = loglikelihoods(mean.model, tok, [req[0].args])[0]
    assert mean.loglikelihood(req)[0] == pytest.approx(want_mean)
    assert want_mean[0] != pytest.approx(want[0])  # one direction, not the span
    with pytest.raises(ConfigError, match="'drop' is not a residual mode"):
        PrismEvalLM.create_from_arg_string(f"pretrained={run},suppress={f},suppress_residual=drop", extra)
    with pytest.raises(ConfigError, match="project needs a suppression set"):
        PrismEvalLM.create_from_arg_string(f"pretrained={run},suppress=none,suppress_residual=project", extra)


# ----- 4. bad model_args ---------------------------------------------------------------------------------
def test_bad_model_args_are_prism_errors(trained, tmp_path):
    _, run = trained
    lm_eval_extra = {"batch_size": 4, "max_batch_size": None, "device": "cpu"}  # what lm-eval's CLI adds
    with pytest.raises(ConfigError, match=r"unknown model_args bogus, dtype.*pretrained, suppress"):
        PrismEvalLM.create_from_arg_string(f"pretrained={run},bogus=1,dtype=float32", lm_eval_extra)
    with pytest.raises(PrismError, match="nowhere"):
        PrismEvalLM.create_from_arg_obj({"pretrained": str(tmp_path / "nowhere")}, lm_eval_extra)
    with pytest.raises(ConfigError, match="pretrained=RUN"):
        PrismEvalLM.create_from_arg_string("", lm_eval_extra)
    with pytest.raises(ConfigError, match="batch_size"):
        PrismEvalLM.create_from_arg_string(f"pretrained={run}", {**lm_eval_extra, "batch_size": "lots"})
    with pytest.raises(PrismError, match="suppression"):
        PrismEvalLM.create_from_arg_string(f"pretrained={run},suppress={tmp_path / 'none.json'}", lm_eval_extra)
    # what lm-eval itself passes is accepted: auto batch size (capped by max_batch_size), trust_remote_code
    lm = PrismEvalLM.create_from_arg_obj(
        {"pretrained": str(run), "trust_remote_code": True},
        {"batch_size": "auto:4", "max_batch_size": 8, "device": "cpu"},
    )
    assert lm.batch_size == 8 and str(lm.device) == "cpu"


def test_rolling_loglikelihood_equals_hflm_on_the_exported_model(trained, tmp_path, monkeypatch):
    """`lm_eval --model hf` on `prism export`'s folder scores rolling log-likelihood like `--model prism`."""
    pytest.importorskip("transformers")
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    from lm_eval.models.huggingface import HFLM

    import prismlm  # noqa: F401  (registers model_type "prism" with the Auto classes)
    from prismlm.app import Run
    from prismlm.integrations.export import export_run

    _, run = trained
    out = export_run(Run.open(run, device="cpu"), tmp_path / "exported")
    hflm = HFLM(pretrained=str(out), batch_size=2, device="cpu")
    texts = (long_text(200), "A short one.")
    ours = PrismEvalLM(pretrained=str(run), batch_size=2, device="cpu").loglikelihood_rolling(rolling(*texts))
    assert ours == pytest.approx(hflm.loglikelihood_rolling(rolling(*texts)), rel=1e-5)


@pytest.mark.parametrize(
    "model_args, batch, device",
    [
        ("batch_size=4", 4, "cpu"),
        ("device=cpu", 2, "cpu"),
        ("batch_size=3,device=cpu", 3, "cpu"),
    ],
)
def test_model_args_keys_that_lm_eval_also_passes_are_taken_once(trained, model_args, batch, device):
    """Issue 23: `--model_args pretrained=RUN,batch_size=4` (or device=cpu) — keys our own message lists as
    valid — crashed with `got multiple values`, because lm-eval passes its own --batch_size/--device too.
    The key given in model_args wins."""
    _, run = trained
    lm_eval_extra = {"batch_size": 2, "max_batch_size": None, "device": "cpu"}  # lm-eval's CLI defaults
    lm = PrismEvalLM.create_from_arg_string(f"pretrained={run},{model_args}", lm_eval_extra)
    assert lm.batch_size == batch and str(lm.device) == device
    lm = PrismEvalLM.create_from_arg_obj(
        {"pretrained": str(run), **dict(kv.split("=") for kv in model_args.split(","))}, lm_eval_extra
    )
    assert lm.batch_size == batch


def test_an_exported_folder_points_to_model_hf(trained, tmp_path):
    """`pretrained=EXPORT_FOLDER` said "manifest.json is missing"; it must say to use `--model hf`."""
    pytest.importorskip("transformers")
    from prismlm.app import Run
    from prismlm.integrations.export import export_run

    _, run = trained
    out = export_run(Run.open(run, device="cpu"), tmp_path / "exported")
    with pytest.raises(ConfigError, match="--model hf --model_args pretrained=.*exported,trust_remote_code=True"):
        PrismEvalLM.create_from_arg_string(f"pretrained={out}", {"batch_size": 1, "device": "cpu"})
