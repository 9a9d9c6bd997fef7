"""Library messages and config docs name parameters and config fields; only the CLI knows its flags.

Old main wrote flag names (``--pq-sample``, ``--set``, ``--out``) into config docstrings and library
messages, and the CLI read them back from the docstrings by regex.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import prismlm
from prismlm import config
from prismlm.artifacts import check_out_file, check_out_folder, part_range
from prismlm.cli.derive import command, field_docs
from prismlm.cli.main import app
from prismlm.config import AttributionConfig, RunConfig, SearchConfig
from prismlm.data.shards import prepare_shards
from prismlm.errors import ConfigError, PrismError, RunError

FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
CONFIGS = [getattr(config, n) for n in config.__all__ if dataclasses.is_dataclass(getattr(config, n))]


def test_config_field_docs_name_no_flags():
    assert len(CONFIGS) == 8
    for cls in CONFIGS:
        for name, doc in field_docs(cls).items():
            assert not FLAG.search(doc), f"{cls.__name__}.{name}: {doc}"


@pytest.mark.parametrize(
    "make",
    [
        lambda: AttributionConfig(pq_sample=10),
        lambda: AttributionConfig(damping=-1.0),
        lambda: SearchConfig(min_list=0),
        lambda: RunConfig().override_strings(["train.lr=abc"]),
        lambda: RunConfig().override_strings(["train.lr"]),
        lambda: RunConfig().override_strings(["train.betas=[2,3]"]),
        lambda: prepare_shards("builtin", "bpe-300", None, val_fraction=2.0),
        lambda: part_range(10, 0, (0, 1)),
        lambda: part_range(10, 4, (2, 2)),
    ],
)
def test_config_messages_name_fields_not_flags(make):
    with pytest.raises(ConfigError) as e:
        make()
    assert not FLAG.search(str(e.value)), str(e.value)


def test_output_guards_name_the_parameter(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    for call in (
        lambda: check_out_folder(tmp_path / "f", "index", holds="index"),
        lambda: check_out_folder(tmp_path / "busy", "index", holds="index"),
        lambda: check_out_file(tmp_path, "json_out"),
    ):
        with pytest.raises(RunError) as e:
            call()
        assert not FLAG.search(str(e.value)) and re.search(r"`(out|json_out)`", str(e.value)), str(e.value)


def _cli(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 2, res.output
    return res.output


def test_cli_errors_name_the_flag_to_change(tmp_path):
    assert "attribution option --pq-sample must be" in _cli("attribute-cache", str(tmp_path), "--pq-sample", "10")
    assert "search option --min-list must be" in _cli("attribute-search", str(tmp_path), "--min-list", "0")
    assert "train.lr='abc' in --set: expected a number" in _cli("train", "--preset", "tiny", "--set", "train.lr=abc")
    out = _cli("explain", str(tmp_path), "The", "--no-index", "--json", str(tmp_path))
    assert "--json" in out and "`" not in out


def test_cli_maps_a_field_to_its_declared_flag():
    """A field whose flag differs from its name (curvature_mode → --curvature) is named by that flag."""

    def op(config: AttributionConfig = AttributionConfig()) -> None:
        """Fail as a library does.

        Args:
            config: the options.
        """
        raise PrismError(
            f"attribution option `curvature_mode` is {config.curvature_mode}; see `nothing`", param="curvature_mode"
        )

    toy = typer.Typer()
    command(toy, "op", op, opens_run=False, decls={"curvature_mode": ["--curvature"]})
    command(toy, "other", op, opens_run=False)
    res = CliRunner().invoke(toy, ["op", "--curvature", "exact"])
    assert res.exit_code == 2 and "attribution option --curvature is exact; see `nothing`" in res.output, res.output
    assert "--curvature-mode" in CliRunner().invoke(toy, ["other", "--help"]).output


def _prism_flags() -> set[str]:
    """Every long flag of every `prism` command."""
    flags: set[str] = set()
    todo = [typer.main.get_command(app)]
    while todo:
        cmd = todo.pop()
        todo += list(getattr(cmd, "commands", {}).values())
        for p in cmd.params:
            flags |= {o for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    return flags


def test_base_layers_name_no_prism_flag():
    """No string of the base layers (messages, docstrings) names a `prism` flag: the CLI owns them.
    ``data/vendor_gutenberg.py`` is a script with its own argparse options."""
    flags = _prism_flags() - {"--help"}
    assert {"--out", "--overwrite", "--set", "--curvature", "--pq-sample"} <= flags
    src = Path(prismlm.__file__).parent
    files = [src / "errors.py", src / "artifacts.py", src / "progress.py"]
    for sub in ("config", "model", "data", "eval"):
        files += sorted((src / sub).rglob("*.py"))
    files += [src / "train" / f for f in ("checkpoint.py", "bank_stage.py", "sampler.py")]
    found = []
    for f in files:
        if f.name == "vendor_gutenberg.py":
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{f.relative_to(src)}:{node.lineno} {m}" for m in FLAG.findall(node.value) if m in flags]
    assert not found, found
