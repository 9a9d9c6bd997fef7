"""The error model at the CLI boundary: a ``PrismError`` is one line and exit 2, anything else keeps its
traceback; ``--set`` values are converted to each field's type; options come from the operations."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prismlm import app as ops
from prismlm._version import __version__
from prismlm.cli import app
from prismlm.cli.derive import arg_help
from prismlm.config import RunConfig, parse_overrides
from prismlm.errors import (
    ArtifactError,
    ArtifactMismatch,
    CheckpointError,
    ConfigError,
    DataError,
    PrismError,
    ShardError,
    SuppressionError,
)
from prismlm.model.generation import Sampling
from prismlm.tda.attribute import SearchSpec


@pytest.fixture(scope="module")
def tiny_run(tiny_shards, tmp_path_factory):
    from conftest import train_tiny_run

    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("cli"), steps=4, batch_size=4, warmup_steps=1)[1]


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_version():
    res = _run("--version")
    assert res.exit_code == 0 and res.output.strip() == f"prismlm {__version__}"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lr=abc", "expected a number"),
        ("model.n_layer=1.5", "expected an integer"),
        ("model.n_embd=-32", "n_embd must be >= 1"),
        ("train.lr=nan", "expected a finite number"),
        ("train.lr=Infinity", "expected a finite number"),
        ("train.lrr=1", "unknown key"),
        ("train.schedule=linear", "expected one of"),
        ("nokey", "KEY=VALUE"),
    ],
)
def test_bad_set_values_are_one_line_errors(tmp_path, override, expected):
    res = _run("train", "--preset", "tiny", "--set", override, "--out", str(tmp_path / "r"))
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and expected in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "r").exists()  # nothing was started


def test_set_values_take_the_declared_types():
    got = parse_overrides(
        [
            "train.lr=3e-4",
            "model.n_layer=3",
            "model.prototypes=null",
            "train.compile=true",
            "data.corpus=builtin",
            "model.prototypes.num_prototypes=128",
        ]
    )
    assert got == {
        "train.lr": 3e-4,
        "model.n_layer": 3,
        "model.prototypes": None,
        "train.compile": True,
        "data.corpus": "builtin",
        "model.prototypes.num_prototypes": 128,
    }
    assert type(got["train.lr"]) is float and type(got["model.n_layer"]) is int
    cfg = RunConfig.from_name("tiny").override_strings(["model.prototypes.top_k=8", "train.lr=0.01"])
    assert cfg.model.prototypes is not None and cfg.model.prototypes.top_k == 8 and cfg.train.lr == 0.01
    with pytest.raises(ConfigError, match="top_k"):
        RunConfig.from_name("tiny").override_strings(["model.prototypes.top_k=x"])


def test_user_mistakes_on_a_missing_run_are_one_line(tmp_path):
    for cmd in (
        ["generate", str(tmp_path / "nope")],
        ["eval", str(tmp_path / "nope")],
        ["explain", str(tmp_path / "nope"), "x"],
        ["attribute", str(tmp_path / "nope"), "x"],
    ):
        res = _run(*cmd)
        assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output, (cmd, res.output)
        assert len(res.output.strip().splitlines()) == 1, res.output  # one line, not wrapped


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """Only PrismError is a user mistake: any other exception propagates (exit 1 with the exception)."""

    def boom(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(ops.training, "prepare_shards", boom)
    res = _run("prepare", "--out", str(tmp_path / "s"))
    assert res.exit_code == 1 and isinstance(res.exception, ZeroDivisionError)


def test_every_error_kind_is_a_prism_error_with_its_fix():
    for kind in (
        ConfigError,
        DataError,
        ShardError,
        CheckpointError,
        ArtifactError,
        ArtifactMismatch,
        SuppressionError,
    ):
        assert issubclass(kind, PrismError)
    e = ArtifactError("no prototype index at runs/a/index", fix="prism index runs/a")
    assert str(e) == "no prototype index at runs/a/index (fix: prism index runs/a)"
    assert isinstance(e, ValueError)  # callers' `except ValueError` keeps working


def test_cli_options_come_from_the_operation_signature_and_docstring():
    helps = arg_help(ops.generate)
    assert set(helps) == {"prompt", "chat", "tokens", "samples", "sampling"}
    res = _run("generate", "--help")
    for opt in (
        "--prompt",
        "--chat",
        "--tokens",
        "--samples",
        "--temperature",
        "--top-tokens",
        "--seed",
        "--device",
        "--suppress",
    ):
        assert opt in res.output
    assert "New tokens per sample." in res.output


def test_prepare_errors_name_the_corpus(tmp_path):
    res = _run("prepare", "--corpus", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "s"))
    assert res.exit_code == 2 and "missing.txt" in res.output


def test_suppression_value_round_trips_through_run(tiny_run, tiny_shards, tmp_path):
    """A suppression file given to ``Run.open`` is a value: generation is changed inside the operation and
    the model itself stays unmodified."""
    import torch

    from prismlm.app import Run
    from prismlm.control.suppress import SuppressionSet

    base = Run.open(tiny_run, device="cpu", suppress="none")
    K = base.model.prototypes.num_prototypes
    SuppressionSet(ids=list(range(0, K, 2)), num_prototypes=K).save(tmp_path / "s.json")
    run = Run.open(tiny_run, device="cpu", suppress=str(tmp_path / "s.json"))
    assert run.model.proto_multipliers is None  # opening changed nothing
    x = torch.tensor([run.tokenizer.encode("The sea was calm")])
    with run.intervened() as m:
        suppressed = m(x).logits
        assert m.proto_multipliers is not None
    assert run.model.proto_multipliers is None
    with base.model.suppress(range(0, K, 2)):
        want = base.model(x).logits
    assert torch.allclose(suppressed, want)
    assert ops.generate(run, "The", tokens=4, sampling=Sampling(0.8, 50, seed=1)) == ops.generate(
        run, "The", tokens=4, sampling=Sampling(0.8, 50, seed=1)
    )
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"kind": "prismlm-suppression", "format_version": 1, "ids": [1], "num_prototypes": K + 1})
    )
    with pytest.raises(SuppressionError, match="bank of"):
        Run.open(tiny_run, device="cpu", suppress=str(bad))


def test_attribution_options_are_the_attribution_config(tiny_run):
    """`prism attribute-cache` options are AttributionConfig's fields (help from their docstrings); a bad
    value is refused by the dataclass's own validation, as one line."""
    import dataclasses

    from prismlm.cli.derive import field_docs
    from prismlm.config import AttributionConfig

    res = _run("attribute-cache", "--help")
    assert res.exit_code == 0
    for f in dataclasses.fields(AttributionConfig):
        flag = {"curvature_mode": "--curvature"}.get(f.name, "--" + f.name.replace("_", "-"))
        assert flag in res.output, flag
    assert field_docs(AttributionConfig)["seed"] == "Seed of the random ``orthogonal``/``gaussian`` projection."
    res = _run("attribute-cache", str(tiny_run), "--damping", "-1", "--device", "cpu")
    assert res.exit_code == 2 and "damping" in res.output and "Traceback" not in res.output


def test_more_user_mistakes_are_one_line(tiny_run, tiny_shards, tmp_path):
    """Found by review: each of these printed a traceback or misbehaved before."""
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\nnot json\n')
    (tmp_path / "n.txt").write_text("neutral text\n\nmore neutral text\n")
    (tmp_path / "cfg.json").write_text("{not json")
    cases = [
        (["concept", str(tiny_run), "--concept", str(bad_json), "--neutral", str(tmp_path / "n.txt")], "bad.jsonl:2"),
        (["generate", str(tiny_run), "--top-tokens", "0", "-n", "2"], "--top-tokens"),
        (["explain", str(tiny_run), "x", "-g", "2", "--top-tokens", "-5"], "--top-tokens"),
        (
            ["index", str(tiny_run), "--batch-size", "0", "--no-progress", "--shards", str(tiny_shards.root)],
            "--batch-size",
        ),
        (["eval", str(tiny_run), "--batch-size", "0", "--shards", str(tiny_shards.root)], "--batch-size"),
        (["prototypes", str(tiny_run), "--limit", "-3"], "--limit"),
        (["train", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "r")], "not valid JSON"),
    ]
    for cmd, expected in cases:
        res = _run(*cmd)
        assert res.exit_code == 2 and expected in res.output and "Traceback" not in res.output, (cmd, res.output)


def test_a_truncated_index_is_reported_corrupt(tiny_run, tiny_shards, tmp_path):
    import shutil

    from prismlm.app import Run, build_run_index
    from prismlm.errors import ArtifactCorrupt

    run = Run.open(tiny_run, device="cpu", suppress="none")
    res = build_run_index(run, max_sequences=8, out=tmp_path / "idx", shards=tiny_shards.root, progress=False)
    assert run.index(tmp_path / "idx", tiny_shards.root) is run.index(tmp_path / "idx")  # opened once, kept
    broken = tmp_path / "broken"
    shutil.copytree(res.path, broken)
    f = broken / "index.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ArtifactCorrupt, match="index.safetensors"):
        Run.open(tiny_run, device="cpu").index(broken, tiny_shards.root)
    out = _run("explain", str(tiny_run), "x", "--index", str(broken), "--shards", str(tiny_shards.root))
    assert out.exit_code == 2 and "index.safetensors" in out.output and "Traceback" not in out.output


def test_suppress_is_offered_only_where_it_is_applied(tiny_run, tmp_path):
    """`--suppress` changes what `explain` shows (the suppressed slices are gone); commands that do not
    apply interventions do not offer the option."""
    from prismlm.control.suppress import SuppressionSet

    for cmd in ("generate", "eval", "explain"):
        assert "--suppress" in _run(cmd, "--help").output
    for cmd in ("index", "label", "prototypes", "attribute", "attribute-cache", "concept"):
        assert "--suppress" not in _run(cmd, "--help").output, cmd
    base = tmp_path / "base.json"
    assert (
        _run(
            "explain", str(tiny_run), "The sea was calm", "--no-index", "--suppress", "none", "--json", str(base)
        ).exit_code
        == 0
    )
    used = sorted({p["id"] for pos in json.loads(base.read_text())["positions"] for p in pos["prototypes"]})
    SuppressionSet(ids=used[:3], num_prototypes=64).save(tmp_path / "s.json")
    sup = tmp_path / "sup.json"
    res = _run(
        "explain",
        str(tiny_run),
        "The sea was calm",
        "--no-index",
        "--suppress",
        str(tmp_path / "s.json"),
        "--json",
        str(sup),
    )
    assert res.exit_code == 0, res.output
    shown = {
        p["id"]
        for pos in json.loads(sup.read_text())["positions"]
        for p in pos["prototypes"]
        if p.get("slice", 1.0) != 0.0
    }
    assert not shown & set(used[:3])


@pytest.mark.parametrize("ids", [[1.7], ["5"], [True], None, [[1, 2]]])
def test_malformed_suppression_ids_are_refused(tiny_run, tmp_path, ids):
    (tmp_path / "s.json").write_text(
        json.dumps({"kind": "prismlm-suppression", "format_version": 1, "ids": ids, "num_prototypes": 64})
    )
    res = _run("generate", str(tiny_run), "-n", "2", "--suppress", str(tmp_path / "s.json"))
    assert res.exit_code == 2 and "ids must be a list of integers" in res.output and "Traceback" not in res.output


def test_text_that_is_not_valid_unicode_is_handled_everywhere(tiny_run, tiny_shards, tmp_path):
    """Lone surrogates (what Python makes of undecodable argv bytes) go through generate, explain and
    attribute instead of crashing; other odd strings too."""
    from prismlm import app as ops
    from prismlm.app import Run

    run = Run.open(tiny_run, device="cpu", suppress="none")
    texts = ["\ud800", "a\udcffb", "\x00\x01", "é\u200b\U0001f600", "", " " * 300, "\ufffd" * 5]
    for t in texts:
        assert ops.generate(run, t, tokens=2)[0].startswith(t)
        expl = ops.explain_text(run, t, ops.ExplanationRequest(use_index=False))
        assert expl.positions
    ops.build_run_cache(
        run,
        ops.attribution.AttributionConfig(r=4, max_sequences=8, batch_size=4),
        out=tmp_path / "cache",
        shards=tiny_shards.root,
        progress=False,
    )
    res = ops.attribute_text(
        run, "The \udcff sea", search=SearchSpec(top=2), cache=tmp_path / "cache", shards=tiny_shards.root
    )
    assert res.top
    out = _run("explain", str(tiny_run), "lone \udcff surrogate", "--no-index")
    assert out.exit_code == 0, out.output


@pytest.mark.parametrize(
    "args, expected",
    [
        (["generate", "--samples", "0"], "--samples"),
        (["generate", "--temperature", "nan"], "--temperature"),
        (["generate", "-n", "-1"], "--tokens"),
        (["explain", "x", "--generate", "-5", "--no-index"], "--generate must be >= 0"),
        (["explain", "x", "--generate", "1000000", "--no-index"], "--generate"),
    ],
)
def test_numeric_options_are_range_checked(tiny_run, args, expected):
    res = _run(args[0], str(tiny_run), *args[1:])
    assert res.exit_code == 2 and expected in res.output and "Traceback" not in res.output, res.output


@pytest.mark.slow
def test_fuzzed_text_never_crashes_explain_or_generate(tiny_run):
    """300 random strings from a seeded generator over odd code points (lone surrogates, controls, combining
    marks, emoji, private use, NUL) through explain and generate: every one answered."""
    import random

    from prismlm import app as ops
    from prismlm.app import Run

    run = Run.open(tiny_run, device="cpu", suppress="none")
    rng = random.Random(1234)
    pools = [
        (0xD800, 0xDFFF),
        (0x0000, 0x001F),
        (0x0300, 0x036F),
        (0x1F600, 0x1F64F),
        (0xE000, 0xF8FF),
        (0x0020, 0x007E),
        (0x4E00, 0x4E80),
        (0xFFF0, 0xFFFF),
    ]
    for _ in range(300):
        n = rng.randint(0, 40)
        text = "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(n))
        expl = ops.explain_text(run, text, ops.ExplanationRequest(use_index=False))
        assert (
            expl.positions
            and abs(
                expl.positions[-1].logit
                - sum(p.slice for p in expl.positions[-1].prototypes)
                - expl.positions[-1].residual_slice
            )
            < 1e-3
        )
    assert ops.generate(run, "\udcff\x00\U0001f600", tokens=3, samples=2)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["index", "{run}", "--top-n", "0"], "--top-n"),
        (["index", "{run}", "--max-sequences", "0"], "--max-sequences"),
        (["attribute", "{run}", "x", "--top", "0"], "--top"),
        (["attribute", "{run}", "x", "--completion", "0"], "--completion"),
        (["attribute", "{run}", "x", "--rescore", "trak"], "'none', 'ekfac', 'gradient'"),
        (["attribute", "{run}", "x", "--rescore", "gradient", "--rescore-top", "0"], "--rescore-top"),
        (["concept", "{run}", "--concept", "c", "--neutral", "n", "--min-purity", "2"], "--min-purity"),
        (["controller", "fit", "{run}", "--task", "t", "--steps", "0"], "--steps"),
        (["controller", "fit", "{run}", "--task", "t", "--lr", "nan"], "--lr"),
        (["tasks", "eval", "{run}", "--split", "dev"], "--split"),
        (["tasks", "build", "--train-cap", "0"], "--train-cap"),
        (["explain", "{run}", "x", "--neighbours", "-1", "--no-index"], "--neighbours"),
    ],
)
def test_every_numeric_option_is_range_checked(tiny_run, args, flag):
    res = _run(*[a.replace("{run}", str(tiny_run)) for a in args])
    assert res.exit_code == 2 and flag in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("rank", ["1", "3"])
def test_only_rank_0_prints_under_torchrun(tiny_run, tmp_path, monkeypatch, rank):
    """Under torchrun (env RANK) every rank runs the command; only rank 0 prints results and status, and
    only rank 0 renders (writes --json/--html); an error is still printed by the rank that meets it."""
    page = tmp_path / "e.html"
    base = [
        "explain",
        str(tiny_run),
        "It is a truth",
        "--device",
        "cpu",
        "--json",
        str(tmp_path / "e.json"),
        "--html",
        str(page),
    ]
    monkeypatch.setenv("RANK", "0")
    shown = _run(*base)
    assert shown.exit_code == 0 and shown.output.strip() and page.exists(), shown.output
    page.unlink()
    (tmp_path / "e.json").unlink()
    monkeypatch.setenv("RANK", rank)
    for args in (
        base,
        ["generate", str(tiny_run), "--prompt", "It is", "--tokens", "3", "--device", "cpu"],
        ["prototypes", str(tiny_run), "--limit", "3", "--device", "cpu"],
        ["--version"],
    ):
        res = _run(*args)
        assert res.exit_code == 0, res.output
        assert res.output == "", (args, res.output)
    assert not page.exists() and not (tmp_path / "e.json").exists()
    res = _run("generate", str(tiny_run), "--tokens", "-1", "--device", "cpu")
    assert res.exit_code == 2 and f"rank {rank}: error:" in res.output and "Traceback" not in res.output


def test_cli_interrupted_cache_build_says_how_to_go_on(tiny_run, tiny_shards, monkeypatch):
    """Ctrl-C in `prism attribute-cache`: exit 130, no traceback, and the --resume that continues it."""
    import prismlm.app.attribution as attribution_app

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(attribution_app, "build_cache", interrupted)
    res = _run(
        "attribute-cache", str(tiny_run), "--max-sequences", "8", "--no-progress", "--shards", str(tiny_shards.root)
    )
    assert res.exit_code == 130 and "--resume" in res.output and "Traceback" not in res.output, res.output
