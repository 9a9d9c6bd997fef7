"""`prism --help` is quick (no torch), `-h` is `--help`, and help and reports stay readable at 80 columns."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from prismlm.cli import app
from prismlm.cli.root import COMMANDS, command_help


def test_top_level_help_imports_neither_torch_nor_the_commands():
    """What `prism --help` needs (the entry point and its listing) loads no torch, no numpy and not the
    application layer: the import that took 5-7 s. A fresh interpreter, so no earlier import can mask it."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from prismlm.cli import app\n"
        "res = CliRunner().invoke(app, ['--help'])\n"
        "assert res.exit_code == 0 and 'attribute-cache' in res.output, res.output\n"
        "print(sorted(m for m in ('torch', 'numpy', 'prismlm.app', 'prismlm.cli.main') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_dash_h_is_help_everywhere():
    for cmd in ([], ["train"], ["explain"], ["tasks"], ["tasks", "build"], ["controller", "fit"]):
        long, short = (CliRunner().invoke(app, [*cmd, flag]) for flag in ("--help", "-h"))
        assert long.exit_code == 0 and short.exit_code == 0, (cmd, short.output)
        assert short.output == long.output and "Usage:" in short.output


def _full_group():
    import typer

    from prismlm.cli.main import app as full_app

    return typer.main.get_command(full_app)


def test_the_quick_listing_is_the_commands_own_help():
    """The entry point lists every command of `prismlm.cli.main`, in its order, with the help the command
    itself shows (read from the source, so the two cannot drift apart silently)."""
    full = _full_group()
    assert list(COMMANDS) == list(full.commands)
    for name, cmd in full.commands.items():
        assert command_help(name) == cmd.help, name
    res = CliRunner().invoke(app, ["--help"])
    for name in COMMANDS:
        assert re.search(rf"^  {re.escape(name)}\s+\S", res.output, re.M), name


def _all_commands():
    full = _full_group()
    for name, cmd in full.commands.items():
        if hasattr(cmd, "commands"):
            for sub, subcmd in cmd.commands.items():
                yield [name, sub], subcmd
        else:
            yield [name], cmd


def test_help_is_readable_at_80_columns():
    """At 80 columns each option's description keeps a column of at least 30 characters (the rich panels
    gave `retrofit` ~20): the first 30 characters of every description stand on one line, and no line is
    cut at the edge."""
    checked = 0
    for cmd, command in _all_commands():
        res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "80"})
        assert res.exit_code == 0, (cmd, res.output)
        lines = [" ".join(ln.split()) for ln in res.output.splitlines()]
        assert max(len(ln) for ln in res.output.splitlines()) <= 80, cmd
        for param in command.params:
            text = " ".join((getattr(param, "help", None) or "").split())
            if len(text) < 30:
                continue
            head = text[: text.rfind(" ", 0, 31)]  # whole words, at most 30 characters
            assert any(head in ln for ln in lines), (cmd, param.name, head)
            checked += 1
    assert checked > 100


def test_explain_keeps_its_columns_at_80_columns(tiny_shards):
    """`prism explain` on an 80-column terminal: every row keeps its position and the table its right edge
    (the position column used to collapse to nothing and the prototypes column ran off the screen)."""
    import torch
    from rich.console import Console

    from prismlm import PrismLM, RunConfig
    from prismlm.explain import explain
    from prismlm.render.report import render_terminal

    torch.manual_seed(0)
    expl = explain(
        PrismLM(RunConfig.from_name("tiny").model).eval(),
        tiny_shards.tokenizer,
        "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    )
    for p in expl.positions:
        for s in p.prototypes:
            s.label = "a label as long as the labeller writes them, about speeches"
    out = io.StringIO()
    render_terminal(expl, Console(width=80, file=out, force_terminal=False))
    lines = out.getvalue().splitlines()
    assert max(len(ln) for ln in lines) <= 80
    body = [ln for ln in lines if ln.startswith("│")]
    assert body and all(ln.endswith("│") for ln in body)
    for p in expl.positions:  # a row is numbered by the token it explains: position + 1 (one token convention)
        assert any(re.match(rf"│\s+{p.position + 1} │", ln) for ln in body), p.position


@pytest.mark.parametrize("width", [80, 200])
def test_top_level_help_fits_the_terminal(width):
    res = CliRunner().invoke(app, ["--help"], env={"COLUMNS": str(width)})
    assert res.exit_code == 0 and max(len(ln) for ln in res.output.splitlines()) <= width
