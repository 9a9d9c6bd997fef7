"""Typer commands derived from the application layer's function signatures and docstrings.

An operation such as ``generate(run: Run, prompt: str = "", *, tokens: int = 100, …)`` with an ``Args:``
section in its docstring becomes ``prism generate RUN [--prompt …] [--tokens …] [--device …] [--suppress …]``:
names, types, defaults and help come from the operation, so the CLI never re-declares them. A renderer
``render(result, *, json_out: Path | None = None, …)`` adds its own (output) options the same way.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from prismlm.app.run import Run
from prismlm.artifacts import check_out_file
from prismlm.cli.console import fail, interrupted, is_main_process, progress_for
from prismlm.errors import PrismError
from prismlm.progress import Progress

RUN_HELP = "Run folder or checkpoint folder."
DEVICE_HELP = "auto, cpu, cuda…"
SUPPRESS_HELP = (
    "Suppression set: a JSON file from `prism concept`, 'auto' (the checkpoint's suppression.json if any) or 'none'."
)


LIBRARY_OPTIONS = {
    "resume=True": "--resume",
    "overwrite=True": "--overwrite",
    "replace=True": "--overwrite",
    "extend_to=": "--steps ",
    "extend_to": "--steps",
    "block_size=": "--block-size ",
    "source=": "--from ",
    "val_fraction": "--val-fraction",
}
"""How the library's messages name an option (a keyword argument of ``train``, ``prepare_shards``,
``load_pretrained``; ``name=`` before a value) → the flag that sets it on the command line. Config fields
(``train.lr``) stay as they are: ``--set`` takes them by that name."""
_LIBRARY_OPTION = re.compile(
    r"(?<![\w./-])("
    + "|".join(re.escape(k) for k in sorted(LIBRARY_OPTIONS, key=len, reverse=True))
    + r")(?:(?<==)|(?![\w-]))"
)


def cli_message(message: str) -> str:
    """A library error message in the CLI's terms: each option it names (``resume=True``, ``extend_to``…)
    becomes its flag (``--resume``, ``--steps``); config fields and paths are left alone."""
    return _LIBRARY_OPTION.sub(lambda m: LIBRARY_OPTIONS[m.group(1)], message)


def arg_help(func: Callable[..., Any]) -> dict[str, str]:
    """The ``Args:`` section of a Google-style docstring → {parameter: help}."""
    doc = inspect.getdoc(func) or ""
    m = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, re.M)
    if not m:
        return {}
    known = set(inspect.signature(func).parameters)
    out: dict[str, str] = {}
    name = None
    for line in m.group(1).splitlines():
        head = re.match(r"^\s*(\w+):\s*(.*)$", line)
        if head and head.group(1) in known:
            name = head.group(1)
            out[name] = head.group(2).strip()
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def _first_parameter(func: Callable[..., Any]) -> str:
    """The name of a renderer's first parameter: the operation's result, not an option."""
    return next(iter(inspect.signature(func).parameters))


def summary(func: Callable[..., Any]) -> str:
    """The docstring up to its ``Args:`` section (the command's help)."""
    doc = inspect.getdoc(func) or ""
    return doc.split("\nArgs:")[0].strip().replace("``", "`")


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (``x: int = 0`` then ``\"\"\"doc\"\"\"``)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        for stmt, nxt in zip(body.body, body.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _config_params(name: str, cls: type, default: object, decls: dict[str, list[str]]) -> list[inspect.Parameter]:
    """One option per field of the config dataclass ``cls`` (help from the field's docstring; the flag
    named in it as (``--flag``) if any), defaults from ``default`` (an instance) or ``cls()``."""
    base = default if isinstance(default, cls) else cls()
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        doc = docs.get(f.name, "")
        flag = re.search(r"\(``(--[\w-]+)``\)", doc)
        names = decls.get(f.name) or ([flag.group(1)] if flag else [])
        help_text = re.sub(r"\s*\(``--[\w-]+``\)", "", doc).replace("``", "`")
        info = typer.Option(getattr(base, f.name), *names, help=help_text)
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=hints[f.name]))
    return out


def _params(
    func: Callable[..., Any],
    skip: set[str],
    decls: dict[str, list[str]],
    arguments: set[str],
    groups: dict[str, tuple[type, list[str]]] | None = None,
) -> list[inspect.Parameter]:
    """Typer parameters for ``func``'s parameters; a parameter typed with a config dataclass is expanded
    into one option per field and recorded in ``groups`` (name → (class, field names))."""
    hints = typing.get_type_hints(func)
    helps = arg_help(func)
    out = []
    for p in inspect.signature(func).parameters.values():
        if p.name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = hints.get(p.name, str)
        if annotation == Progress:  # the terminal shows a bar or nothing: a --progress/--no-progress flag
            annotation = bool
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) and groups is not None:
            fields = _config_params(p.name, annotation, p.default, decls)
            groups[p.name] = (annotation, [f.name for f in fields])
            out += fields
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        if isinstance(default, tuple):  # typer wants lists for repeatable options
            default = list(default)
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) is tuple and len(args) == 2 and args[1] is Ellipsis:
            annotation = list[args[0]]  # type: ignore[valid-type]  # tuple[X, ...] → a repeatable option
        if (
            default is None
            and typing.get_origin(annotation) in (typing.Union, type(int | None))
            and any(typing.get_origin(a) is list for a in typing.get_args(annotation))
        ):
            default = []  # an optional list becomes a repeatable option that may be absent
            annotation = next(a for a in typing.get_args(annotation) if typing.get_origin(a) is list)
        help_text = helps.get(p.name, "")
        if p.name in arguments:
            info = typer.Argument(default, help=help_text)
        else:
            info = typer.Option(default, *decls.get(p.name, []), help=help_text)
        out.append(inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation))
    return out


def os_error_message(e: OSError) -> str:
    """One line for an ``OSError`` on a path the user gave or made (a folder that cannot be created, a
    read-only or immutable folder, a folder where a file belongs): what failed, on which path, and the fix."""
    what = e.strerror or type(e).__name__
    where = f"{e.filename}" + (f" → {e.filename2}" if e.filename2 else "")
    if isinstance(e, IsADirectoryError):
        fix = "a folder stands where a file belongs: move it away (or restore the file)"
    elif isinstance(e, NotADirectoryError):
        fix = "a file stands where a folder belongs: move it away or choose another path"
    elif isinstance(e, PermissionError):
        fix = "choose a path you can write (check the folder's permissions and attributes)"
    else:
        fix = "check the path: its parent folder must exist and be writable"
    return f"{type(e).__name__}: {what}: {where} (fix: {fix})"


def command(
    app: typer.Typer,
    name: str,
    op: Callable[..., Any],
    render: Callable[..., None] | None = None,
    *,
    opens_run: bool = True,
    arguments: set[str] | None = None,
    decls: dict[str, list[str]] | None = None,
    skip: set[str] | None = None,
    suppressible: bool = False,
    fixed: dict[str, Any] | None = None,
    computed: dict[str, Callable[[dict[str, Any]], Any]] | None = None,
) -> None:
    """Register ``op`` as ``prism NAME``. With ``opens_run`` the first argument is RUN and ``--device``
    opens the ``Run`` passed to ``op``; ``suppressible`` (operations that apply the run's interventions)
    adds ``--suppress`` (default: the checkpoint's own set); other commands open the run unsuppressed. ``render(result, run=…, **its options)`` prints the
    result (on rank 0 only under torchrun). Positional arguments: ``arguments``. ``fixed``: keyword arguments the CLI itself gives ``op``
    (e.g. a progress callback that renders to the terminal); they are not options. ``computed``: keyword
    arguments of ``op`` derived from the command's options (name → function of all the parsed options),
    e.g. ``explain=lambda o: o["html_out"] is not None`` when a renderer's output needs more computed."""
    decls = decls or {}
    fixed = fixed or {}
    computed = computed or {}
    skip = set(skip or ()) | set(fixed) | set(computed) | ({"run"} if opens_run else set())
    positional = set(arguments or ())
    groups: dict[str, tuple[type, list[str]]] = {}
    op_params = _params(op, skip, decls, positional, groups)
    op_names = {p.name for p in op_params}
    op_hints = typing.get_type_hints(op)
    progress_names = {n for n in op_names if op_hints.get(n) == Progress}  # --progress/--no-progress flags
    # a renderer option with the name of an operation option (e.g. --shards) is one option, given to both
    render_all = _params(render, {"run", _first_parameter(render)}, decls, set()) if render is not None else []
    render_names = {p.name for p in render_all}
    render_params = [p for p in render_all if p.name not in op_names]
    head: list[inspect.Parameter] = []
    tail: list[inspect.Parameter] = []
    if opens_run:
        head.append(
            inspect.Parameter(
                "run", inspect.Parameter.KEYWORD_ONLY, annotation=Path, default=typer.Argument(..., help=RUN_HELP)
            )
        )
        tail.append(
            inspect.Parameter(
                "device", inspect.Parameter.KEYWORD_ONLY, annotation=str, default=typer.Option("auto", help=DEVICE_HELP)
            )
        )
        if suppressible:
            tail.append(
                inspect.Parameter(
                    "suppress",
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=str,
                    default=typer.Option("auto", help=SUPPRESS_HELP),
                )
            )

    def run_command(**kwargs: Any) -> None:
        op_kwargs = {
            **{k: v for k, v in kwargs.items() if k in op_names},
            **fixed,
            **{k: f(kwargs) for k, f in computed.items()},
        }
        for n in progress_names:
            op_kwargs[n] = progress_for(bool(op_kwargs[n]))
        for group, (cls, names) in groups.items():  # re-assemble config dataclasses (validated on construction)
            values = {n: op_kwargs.pop(n) for n in names}
            try:
                op_kwargs[group] = cls(**values)
            except PrismError as e:
                fail(cli_message(str(e)))
        render_kwargs = {k: v for k, v in kwargs.items() if k in render_names}
        try:
            for k, v in render_kwargs.items():  # output files (--json, --html): refused before any work
                if k.endswith("_out") and v is not None:
                    check_out_file(v, decls.get(k, [f"--{k.replace('_', '-')}"])[0])
            run = None
            if opens_run:
                run = Run.open(
                    kwargs["run"], device=kwargs["device"], suppress=kwargs["suppress"] if suppressible else "none"
                )
                if run.suppression is not None:
                    from prismlm.cli.console import console

                    s = run.suppression
                    console.print(
                        f"suppressing {len(s.ids)} prototypes ({100 * s.share:.2f}% of the bank)"
                        + (f": {s.concept}" if s.concept else "")
                    )
                result = op(run, **op_kwargs)
            else:
                result = op(**op_kwargs)
            if render is not None and is_main_process():  # under torchrun, rank 0 renders (prints, writes)
                extra = {"run": run} if "run" in inspect.signature(render).parameters else {}
                render(result, **extra, **render_kwargs)
        except PrismError as e:
            fail(cli_message(str(e)))
        except OSError as e:
            if e.filename is None:  # no file involved: not a user's path, a bug or the machine
                raise
            fail(os_error_message(e))
        except KeyboardInterrupt:  # no traceback: say what is kept and how to go on
            hint = "; rerun with --resume to continue it" if "resume" in op_names else ""
            interrupted(f"{name} interrupted{hint}")

    params = (
        head
        + [p for p in op_params if p.name in positional]
        + [p for p in op_params if p.name not in positional]
        + tail
        + render_params
    )
    run_command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run_command.__doc__ = summary(op)
    run_command.__name__ = name.replace("-", "_")
    app.command(name, help=summary(op))(run_command)
