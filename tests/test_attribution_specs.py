"""The attribution parameter objects (``QuerySpec``, ``SearchSpec``, ``Rescoring``): validated on
construction with messages that name ``Class.field``; the library never names a CLI flag, and the CLI
shows the flag of the field a message names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import prismlm.tda
from prismlm.cli import app
from prismlm.errors import ConfigError
from prismlm.tda.attribute import QuerySpec, Rescoring, SearchSpec

BAD = [
    (QuerySpec, {"completion": 0}, "QuerySpec.completion"),
    (QuerySpec, {"generate": -1}, "QuerySpec.generate"),
    (QuerySpec, {"temperature": float("nan")}, "QuerySpec.temperature"),
    (QuerySpec, {"answer": " x", "generate": 2}, "QuerySpec.answer"),
    (SearchSpec, {"top": 0}, "SearchSpec.top"),
    (SearchSpec, {"method": "fast"}, "SearchSpec.method"),
    (SearchSpec, {"search": "fuzzy"}, "SearchSpec.search"),
    (SearchSpec, {"candidates": 0}, "SearchSpec.candidates"),
    (SearchSpec, {"nprobe": 0}, "SearchSpec.nprobe"),
    (SearchSpec, {"max_sequences": 0}, "SearchSpec.max_sequences"),
    (Rescoring, {"method": "trak"}, "Rescoring.method"),
    (Rescoring, {"candidates": 0}, "Rescoring.candidates"),
]


@pytest.mark.parametrize("cls, kwargs, field", BAD)
def test_specs_refuse_bad_values_naming_the_field(cls, kwargs, field):
    with pytest.raises(ConfigError) as e:
        cls(**kwargs)
    assert field in str(e.value) and "--" not in str(e.value), str(e.value)


def test_specs_defaults_are_valid_and_frozen():
    q, s, r = QuerySpec(), SearchSpec(), Rescoring()
    assert (s.top, s.method, s.search, s.candidates, s.nprobe) == (10, "cached", "auto", 32, 16)
    assert (r.method, r.candidates, q.generate, q.temperature) == ("none", 128, 0, 0.0)
    with pytest.raises(AttributeError):
        s.top = 3  # type: ignore[misc]


def test_tda_names_no_cli_flag():
    """No string in prismlm.tda (messages, docstrings) names a `--flag`: the CLI maps field names to flags."""
    root = Path(prismlm.tda.__file__).parent
    found = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"--[a-z]", node.value):
                found.append(f"{f.relative_to(root)}:{node.lineno}: {node.value[:60]!r}")
    assert not found, found


def test_cli_shows_the_flag_of_the_field_a_library_message_names(tiny_shards, tmp_path):
    """A message raised deep in the cache build (``pq_layout``: AttributionConfig.pq_dims / .r) is printed
    by `prism attribute-cache` with --pq-dims / --r; a spec refused on construction (Rescoring.candidates,
    QuerySpec.answer / .generate) with --rescore-top / --answer / --generate (exit 2, no traceback)."""
    from conftest import train_tiny_run

    run = train_tiny_run(tiny_shards, tmp_path, steps=2, batch_size=4, warmup_steps=1)[1]
    shards = ["--shards", str(tiny_shards.root)]
    res = CliRunner().invoke(
        app,
        [
            "attribute-cache",
            str(run),
            "--dtype",
            "pq",
            "--pq-dims",
            "7",
            "--r",
            "8",
            "--out",
            str(tmp_path / "c"),
            *shards,
        ],
    )
    assert res.exit_code == 2 and "choose --pq-dims dividing 8 (or --r a multiple of 7)" in res.output, res.output
    assert "AttributionConfig." not in res.output and "Traceback" not in res.output, res.output
    res = CliRunner().invoke(app, ["attribute", str(run), "x", "--rescore-top", "0", *shards])
    assert res.exit_code == 2 and "--rescore-top must be >= 1" in res.output, res.output
    res = CliRunner().invoke(app, ["attribute", str(run), "x", "--answer", " y", "-g", "2", *shards])
    assert res.exit_code == 2 and "--answer" in res.output and "--generate" in res.output, res.output
    assert "QuerySpec." not in res.output, res.output
    # an operation's own parameter, named ``out`` / ``compress_from`` by the application layer
    same = str(tmp_path / "same")
    res = CliRunner().invoke(app, ["attribute-cache", str(run), "--compress-from", same, "--out", same, *shards])
    assert res.exit_code == 2 and f"--out {same} is the cache being compressed (--compress-from)" in res.output
    assert "another --out" in res.output and "`" not in res.output, res.output


def test_attribution_records_declare_the_fields_to_dict_writes():
    """``Attribution.to_dict()`` is typed ``AttributionRecord`` (its ``top`` entries ``AttributedRecord``):
    the same keys in the same order as the dataclasses' fields, which ``asdict`` writes."""
    from dataclasses import fields

    from prismlm.tda.attribute import AttributedRecord, AttributedSequence, Attribution, AttributionRecord

    assert list(AttributionRecord.__annotations__) == [f.name for f in fields(Attribution)]
    assert list(AttributedRecord.__annotations__) == [f.name for f in fields(AttributedSequence)]
    top = AttributedSequence(rank=1, sequence=4, score=0.5, prototypes=[{"id": 2.0, "contribution": 0.5}])
    d = Attribution("p", "c", "cached", 1.0, 1, [top], 10, 0.1).to_dict()
    assert list(d) == list(AttributionRecord.__annotations__) and list(d["top"][0]) == list(
        AttributedRecord.__annotations__
    )
