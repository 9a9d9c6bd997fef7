"""Flag names live in cli/: the library's messages name its own options (``resume=True``, ``extend_to``) and
config fields (``train.lr``); the CLI maps the options to its flags (``cli.derive.cli_message``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
