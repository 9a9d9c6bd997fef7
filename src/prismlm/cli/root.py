"""The ``prism`` entry point, quick to load: ``prism --help`` (and ``-h``) lists the commands without importing
the application layer (which imports torch: seconds). Each command's one-line help is read from the source of
the function it is derived from (``ast``, not an import); ``prismlm.cli.main``, which builds the commands
from the operations' signatures (``prismlm.cli.derive``), is imported only when a command runs or shows its
own help. ``tests/test_cli_help.py`` checks that this table and ``prismlm.cli.main`` agree.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from typer.core import TyperCommand, TyperGroup

from prismlm.cli.context import CONTEXT, HELP, root_options

if TYPE_CHECKING:  # typer's own click (vendored since typer 0.2x): for the types of the overridden methods
    from typer._click import Command, Context

_SRC = Path(__file__).resolve().parents[1]  # src/prismlm
COMMANDS: dict[str, tuple[str, str]] = {
    # command → (file under prismlm/, the function whose docstring, or the Typer whose help=, is its help)
    "prepare": ("app/training.py", "prepare"),
    "train": ("app/training.py", "train_from_options"),
    "retrofit": ("app/retrofit.py", "retrofit_model"),
    "demo": ("app/demos.py", "demo"),
    "generate": ("app/operations.py", "generate"),
    "eval": ("app/operations.py", "evaluate"),
    "index": ("app/indexing.py", "build_run_index"),
    "index-merge": ("app/indexing.py", "merge_index_parts"),
    "label": ("app/indexing.py", "label_prototypes"),
    "explain": ("app/reports.py", "explain_report"),
    "prototypes": ("app/operations.py", "prototypes"),
    "verify": ("app/operations.py", "verify_run"),
    "export": ("integrations/export.py", "export_run"),
    "attribute-cache": ("app/attribution.py", "build_run_cache"),
    "attribute-search": ("app/attribution.py", "build_run_search"),
    "attribute": ("app/reports.py", "attribute_report"),
    "concept": ("app/control.py", "find_run_concept"),
    "serve": ("cli/main.py", "serve_command"),
    "tasks": ("cli/main.py", "tasks_app"),
    "controller": ("cli/main.py", "controller_app"),
}


@cache
def _tree(file: str) -> ast.Module:
    return ast.parse((_SRC / file).read_text())


def command_help(name: str) -> str:
    """The help ``prismlm.cli.main`` gives command ``name``, read from the source: a function's docstring up
    to its ``Args:`` (``prismlm.cli.derive.summary``) or the ``help=`` of a ``typer.Typer(...)``."""
    file, symbol = COMMANDS[name]
    for node in ast.walk(_tree(file)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == symbol:
            doc = ast.get_docstring(node) or ""
            return doc.split("\nArgs:")[0].strip().replace("``", "`")
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and any(isinstance(t, ast.Name) and t.id == symbol for t in node.targets)
        ):
            for kw in node.value.keywords:
                if kw.arg == "help" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
    raise LookupError(f"{symbol} not found in prismlm/{file}")


@cache
def _commands() -> TyperGroup:
    """The real commands (imports the application layer)."""
    from prismlm.cli.main import app as full_app

    group = typer.main.get_command(full_app)
    assert isinstance(group, TyperGroup)
    return group


class LazyGroup(TyperGroup):
    """Lists the commands from ``COMMANDS`` (help read from the source); resolves a command to the real one
    only when it is invoked (its own ``--help`` included)."""

    def list_commands(self, ctx: Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name not in COMMANDS:
            return None
        return TyperCommand(cmd_name, help=command_help(cmd_name))  # a listing entry; never invoked

    def resolve_command(self, ctx: Context, args: list[str]) -> tuple[str | None, Command | None, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        if name is None or cmd is None:
            return name, cmd, rest
        return name, _commands().get_command(ctx, name), rest


app = typer.Typer(
    cls=LazyGroup,
    add_completion=False,
    no_args_is_help=True,
    help=HELP,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=CONTEXT,
)


main = app.callback()(root_options)  # --version, and the group's docstring
