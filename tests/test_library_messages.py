"""Flag names live in cli/: the library's messages name its own options (``resume=True``, ``extend_to``) and
config fields (``train.lr``); the CLI maps the options to its flags (``cli.derive.cli_message``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prismlm.cli.derive import cli_message

SRC = Path(__file__).resolve().parents[1] / "src" / "prismlm"
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# Not CLI flags of prism: git's own options (env.json's revision) and a maintenance script's argparse.
NOT_PRISM_FLAGS = {"--porcelain", "--untracked-files", "--out"}


def _strings(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module (messages, f-string parts, docstrings of functions and classes),
    without the module docstring."""
    tree = ast.parse(path.read_text())
    module_doc = ast.get_docstring(tree, clean=False)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value != module_doc
    ]


def test_train_and_data_name_no_cli_flags():
    found = []
    for folder in ("train", "data"):
        for path in sorted((SRC / folder).rglob("*.py")):
            for line, text in _strings(path):
                flags = set(FLAG.findall(text)) - (
                    NOT_PRISM_FLAGS if path.name in ("records.py", "vendor_gutenberg.py") else set()
                )
                if flags:
                    found.append(f"{path.relative_to(SRC)}:{line}: {sorted(flags)}")
    assert found == []


# A command line the message suggests (``prism index RUN --out F``, ``pip install --no-deps …``): another
# command's flags, which the current command could not map.
COMMAND_LINE = re.compile(r"\b(?:prism|pip|git)\s+[a-z][\w-]*(?:\s+(?:--?[\w-]+|[\w./:{}-]+))*")


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(s.value)
        for node in ast.walk(tree)
        for s in (node.body if isinstance(getattr(node, "body", None), list) else [])  # type: ignore[attr-defined]
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)
    }


def _messages(path: Path) -> list[tuple[int, str]]:
    """Every string of a module but its docstrings (the app layer's docstrings are the CLI's help texts):
    an f-string as one text with ``{}`` for each value."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree) | {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, str(text)))
    return out


def test_app_web_and_render_messages_name_no_cli_flags():
    """The application layer and the front ends below cli/ name parameters (``require(..., "steps", ...)``,
    a backquoted `out`); the CLI shows its flags. Suggested command lines of other commands are allowed."""
    found = []
    for folder in ("app", "web", "render"):
        for path in sorted((SRC / folder).rglob("*.py")):
            for line, text in _messages(path):
                flags = FLAG.findall(COMMAND_LINE.sub("", text))
                if flags:
                    found.append(f"{path.relative_to(SRC)}:{line}: {sorted(set(flags))}")
    assert found == []


def test_cli_message_maps_library_options_to_flags():
    msg = (
        "/runs/extend_to/r is already at step 4; extend_to=3 would not train further "
        "(fix: pass resume=True with extend_to=N (> 4), replace it with overwrite=True, or a larger "
        "data.val_fraction or a smaller model.block_size; block_size=2048 is too long; source=/m/gpt2)"
    )
    assert cli_message(msg) == (
        "/runs/extend_to/r is already at step 4; --steps 3 would not train further "
        "(fix: pass --resume with --steps N (> 4), replace it with --overwrite, or a larger "
        "data.val_fraction or a smaller model.block_size; --block-size 2048 is too long; --from /m/gpt2)"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["retrofit", "--from", "m", "--steps", "0"], "error: --steps must be >= 1, got 0"),
        (
            ["retrofit", "--from", "m", "--steps", "10", "--frozen-steps", "20"],
            "error: --frozen-steps must be in [0, --steps=10], got 20",
        ),
        (
            ["retrofit", "--from", "m", "--prototypes", "4", "--top-k", "9"],
            "error: --top-k must be in [1, --prototypes=4], got 9",
        ),
        (["retrofit", "--from", "m", "--unfreeze", "lora", "--lora-rank", "0"], "error: --lora-rank must be >= 1"),
        ([], "error: --from is missing: name the pretrained model"),
        ([], "(fix: pass --from MODEL, or --resume to continue the run in --out)"),
        (
            ["demo", "--scratch", "--question", "x"],
            "error: --question applies to the real-model demo, not to --scratch",
        ),
        (["demo", "--preset", "tiny"], "(fix: add --scratch, or drop --preset tiny)"),
        (["demo", "--index-sequences", "0"], "error: --index-sequences must be >= 1, got 0"),
        (["prepare", "--val-fraction", "2"], "error: --val-fraction must be in (0, 1), got 2.0"),
        (["serve", "RUN", "--port", "0"], "error: --port must be in [1, 65535], got 0 (fix: e.g. --port 8000)"),
    ],
)
def test_the_cli_shows_its_flags_for_app_messages(args, expected, tmp_path):
    """The app layer names its parameters (``steps``, `source`, `port`); each command's message shows the
    flag the user typed. All are refused before any model is loaded or any file is written."""
    from prismlm.cli import app

    argv = args or ["retrofit"]
    if argv[0] == "retrofit":
        argv = [*argv, "--out", str(tmp_path / "r")]
    if argv[0] == "serve":
        argv = ["serve", str(tmp_path), *argv[2:]]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert expected in " ".join(res.output.split())
    assert list(tmp_path.iterdir()) == []
