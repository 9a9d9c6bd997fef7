"""Flag names live in cli/: the library's errors name their own parameters (`` `resume` ``, `` `extend_to` ``,
listed in ``PrismError.params``) and config fields (``train.lr``); the CLI shows each parameter as its flag
(``PrismError.spelled`` with the command's signature-derived flags), never by rewriting message text."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prismlm.errors import ConfigError, PrismError, RunError, named, params_renamed

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


def test_an_error_names_its_parameters_and_a_front_end_spells_them():
    """Only the parameters the error lists are spelled, each where the text names it (``named``); the one
    it is about goes in front when the text does not name it; text that merely looks like a name is kept."""
    e = RunError(
        "/runs/extend_to/r is already at step 4; `extend_to` 3 would not train further",
        fix="pass `resume` with `extend_to` N (> 4), or `overwrite`",
        param=("extend_to", "resume"),
    )
    flags = {"extend_to": "--steps", "resume": "--resume", "overwrite": "--overwrite"}
    assert e.param == "extend_to" and e.params == ("extend_to", "resume")
    assert e.spelled(flags) == (
        "/runs/extend_to/r is already at step 4; --steps 3 would not train further "
        "(fix: pass --resume with --steps N (> 4), or `overwrite`)"  # `overwrite` is not in params: kept
    )
    assert str(e).startswith("/runs/extend_to/r is already at step 4; `extend_to` 3")  # the library's own text
    assert ConfigError("the answer is empty", param="chat").spelled({"chat": "--chat"}) == "--chat: the answer is empty"
    assert ConfigError("`top_n` must be >= 1", param="top_n").spelled({}) == "`top_n` must be >= 1"
    assert named("top_n") == "`top_n`" and named("QuerySpec.top") == "QuerySpec.top" and named("OUT") == "OUT"


def test_a_forwarded_parameter_is_renamed_for_the_caller():
    with pytest.raises(PrismError) as e, params_renamed(extend_to="steps"):
        raise RunError("`extend_to` 3 would not train further", fix="pass `extend_to` > 4", param="extend_to")
    assert e.value.params == ("steps",) and str(e.value) == "`steps` 3 would not train further (fix: pass `steps` > 4)"
    with pytest.raises(PrismError) as e, params_renamed(extend_to="steps"):
        raise RunError("`resume` was not given", param="resume")
    assert e.value.params == ("resume",) and e.value.message == "`resume` was not given"


def test_a_library_error_with_a_param_is_shown_with_the_cli_flag(tmp_path, monkeypatch):
    """A ``ConfigError`` raised deep in the library with ``param`` reaches the terminal with the flag the
    command declares for that parameter (``attribute --top-n``: typer's name from the signature)."""
    from prismlm.app import Run
    from prismlm.cli import app

    def refuse(*a: object, **k: object) -> None:
        raise ConfigError("`top_n` is too large for this run, got 7", param="top_n")

    monkeypatch.setattr(Run, "open", refuse)
    res = CliRunner().invoke(app, ["index", str(tmp_path), "--top-n", "7"])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "error: --top-n is too large for this run, got 7" in out and "`top_n`" not in out


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


BACKQUOTED = re.compile(r"(?<![`\w])`([a-z_][a-z0-9_]*)`(?!`)")
BUILT_APART = {  # fix texts built before the raise that uses them, which lists their parameters itself
    ("artifacts.py", "wait for it to finish, or choose another `out`"),  # output_lock → FileLock(param="out")
    ("artifacts.py", "pass `overwrite` to replace it"),  # check_out_folder's `how`
    ("artifacts.py", "`resume` to continue it"),
    ("run_folder.py", "nothing to resume: start it again with `overwrite`"),  # restart_fix: param="overwrite"
}


def _unlisted_parameters(path: Path, root: Path = SRC) -> list[str]:
    """Strings (not docstrings) that name a parameter in backquotes outside an error raised with ``param=``
    (or ``require``/``check``, which pass it on): the CLI would show them unspelled."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    parent = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
            continue
        if not BACKQUOTED.search(node.value) or any(
            path.name == f and node.value.startswith(t) for f, t in BUILT_APART
        ):
            continue
        up: ast.AST = node
        listed = False
        while id(up) in parent:
            up = parent[id(up)]
            name = getattr(up, "func", None)
            fn = getattr(name, "id", None) or getattr(name, "attr", None) or ""
            if isinstance(up, ast.Call) and (fn.endswith("Error") or fn in ("error", "require", "check", "_check")):
                listed = fn == "require" or any(k.arg == "param" for k in up.keywords)
                break
        if not listed:
            out.append(f"{path.relative_to(root)}:{node.lineno}: {node.value[:60]!r}")
    return out


def test_every_parameter_a_message_names_is_listed_on_its_error():
    found = [w for f in sorted(SRC.rglob("*.py")) if "cli" not in f.parts for w in _unlisted_parameters(f)]
    assert found == []


def test_the_parameter_audit_sees_an_unlisted_name(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text(
        'def f(x):\n    raise ConfigError(f"`top_n` is {x}")\n\n\ndef g(x):\n    raise ConfigError("`a`", param="a")\n'
    )
    assert _unlisted_parameters(f, tmp_path) == ["probe.py:2: '`top_n` is '"]
