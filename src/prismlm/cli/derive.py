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
SUPPRESS_RESIDUAL_HELP = (
    "What the suppression set does to the residual: 'auto' (the mode the set records), 'keep' (remove the "
    "prototypes' slices only), 'project' (also project the residual off the suppressed prototypes' span), "
    "'mean' (off their unit mean direction only) or 'contrast' (off the unit difference between their mean and "
    "the bank's mean)."
)

_RESIDUAL_NOTE = {
    "project": "; the residual projected off their span",
    "mean": "; the residual projected off their unit mean direction",
    "contrast": "; the residual projected off their contrast with the bank's mean",
}
"""What the line naming the applied suppression set adds for each residual-editing mode."""


def arg_help(func: Callable[..., object]) -> dict[str, str]:
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


def _option_decls(p: inspect.Parameter) -> list[str]:
    """The names a typer option was declared with (``["--tokens", "-n"]``); [] when typer derives them."""
    return [d for d in (getattr(p.default, "param_decls", None) or ()) if isinstance(d, str)]


def _first_parameter(func: Callable[..., object]) -> str:
    """The name of a renderer's first parameter: the operation's result, not an option."""
    return next(iter(inspect.signature(func).parameters))


def summary(func: Callable[..., object]) -> str:
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


def _config_params(
    name: str, cls: type, default: object, decls: dict[str, list[str]], prefix: str = ""
) -> list[inspect.Parameter]:
    """One option per field of the config dataclass ``cls`` (help from the field's docstring, the other fields
    it names given as their flags; the flag from ``decls`` when the command names one, else
    ``--field-name``), defaults from ``default`` (an instance) or ``cls()``. ``prefix``
    (e.g. ``rescoring_``) goes before each field's name, for fields whose names another group also uses."""
    base = default if isinstance(default, cls) else cls()
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    names = {f.name: decls.get(f.name, ["--" + f.name.replace("_", "-")])[0] for f in dataclasses.fields(cls)}
    out = []
    for f in dataclasses.fields(cls):
        help_text = with_flags(docs.get(f.name, "").replace("``", "`"), names)  # `prune_by` → --prune-by
        info = typer.Option(getattr(base, f.name), *decls.get(prefix + f.name, []), help=help_text)
        out.append(
            inspect.Parameter(prefix + f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=hints[f.name])
        )
    return out


def _field_flags(groups: dict[str, tuple[type, list[str], str]], params: list[inspect.Parameter]) -> dict[str, str]:
    """{"Class.field": "--flag"} for every option of a config dataclass (``params``: the command's typer
    parameters): an error about a field (its ``param``, e.g. ``QuerySpec.top``) is shown with its flag."""
    decls = {p.name: [d for d in (getattr(p.default, "param_decls", None) or ()) if d.startswith("--")] for p in params}
    return {
        f"{cls.__name__}.{n[len(prefix) :]}": (decls.get(n) or ["--" + n.replace("_", "-")])[0]
        for cls, names, prefix in groups.values()
        for n in names
    }


def flags_of(params: list[inspect.Parameter]) -> dict[str, str]:
    """What the user types for each parameter of a command: its first long flag (``json_out`` → ``--json``,
    ``curvature_mode`` → ``--curvature``), typer's ``--name-with-dashes`` when none is declared, or the
    metavar (``OUT``) of a positional argument."""
    out = {}
    for p in params:
        info = p.default
        if isinstance(info, typer.models.ArgumentInfo):
            out[p.name] = p.name.upper()
            continue
        long = [d.split("/")[0] for d in getattr(info, "param_decls", None) or () if d.startswith("--")]
        out[p.name] = long[0] if long else "--" + p.name.replace("_", "-")
    return out


def with_flags(help_text: str, flags: dict[str, str]) -> str:
    """A field's help (its docstring) for ``--help``: each backquoted field it names (`` `prune_by` ``)
    becomes the command's flag for it (``--prune-by``). Help text only: errors name their parameters
    structurally (``PrismError.params``, shown by ``PrismError.spelled``)."""
    return re.sub(r"`(\w+)`", lambda m: flags.get(m.group(1), m.group(0)), help_text)


def _params(
    func: Callable[..., object],
    skip: set[str],
    decls: dict[str, list[str]],
    arguments: set[str],
    groups: dict[str, tuple[type, list[str], str]] | None = None,
    prefixed: set[str] | None = None,
) -> list[inspect.Parameter]:
    """Typer parameters for ``func``'s parameters; a parameter typed with a config dataclass is expanded
    into one option per field and recorded in ``groups`` (name → (class, option names, prefix)); the
    options of a parameter in ``prefixed`` are named PARAMETER_FIELD."""
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
            prefix = f"{p.name}_" if p.name in (prefixed or set()) else ""
            fields = _config_params(p.name, annotation, p.default, decls, prefix)
            groups[p.name] = (annotation, [f.name for f in fields], prefix)
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
        help_text = helps.get(p.name, "").replace("``", "`")
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


def _run_options(opens_run: bool, suppressible: bool) -> tuple[list[inspect.Parameter], list[inspect.Parameter]]:
    """The typer parameters a command that opens a run adds: RUN first; ``--device`` (and ``--suppress``)
    after the operation's own options."""
    if not opens_run:
        return [], []
    head = [
        inspect.Parameter(
            "run", inspect.Parameter.KEYWORD_ONLY, annotation=Path, default=typer.Argument(..., help=RUN_HELP)
        )
    ]
    tail = [
        inspect.Parameter(
            "device", inspect.Parameter.KEYWORD_ONLY, annotation=str, default=typer.Option("auto", help=DEVICE_HELP)
        )
    ]
    if suppressible:
        tail.append(
            inspect.Parameter(
                "suppress",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=str,
                default=typer.Option("auto", help=SUPPRESS_HELP),
            )
        )
        tail.append(
            inspect.Parameter(
                "suppress_residual",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=str,
                default=typer.Option("auto", "--suppress-residual", help=SUPPRESS_RESIDUAL_HELP),
            )
        )
    return head, tail


def _check_out_files(render_kwargs: dict[str, object]) -> None:
    """The renderer's output files (``--json``, ``--html``: options named ``*_out``), refused before any work."""
    for k, v in render_kwargs.items():
        if k.endswith("_out") and isinstance(v, (str, Path)):
            check_out_file(v, k)


def _announce_suppression(run: Run) -> None:
    """One line saying which suppression set the opened run applies (nothing when none)."""
    if run.suppression is not None:
        from prismlm.cli.console import console

        s = run.suppression
        console.print(
            f"suppressing {len(s.ids)} prototypes ({100 * s.share:.2f}% of the bank)"
            + (f": {s.concept}" if s.concept else "")
            + _RESIDUAL_NOTE.get(s.residual, "")
        )


@dataclasses.dataclass(frozen=True)
class _Invocation:
    """What a derived command does with its parsed options: assemble the operation's keyword arguments, check
    the output files, open the run, call the operation, render its result, and map errors to one line."""

    name: str
    op: Callable[..., object]
    render: Callable[..., None] | None
    opens_run: bool
    suppressible: bool
    fixed: dict[str, object]
    computed: dict[str, Callable[[dict[str, object]], object]]
    groups: dict[str, tuple[type, list[str], str]]
    """Parameter typed with a config dataclass → (the class, its option names, their prefix)."""
    op_names: set[str]
    progress_names: set[str]
    render_names: set[str]
    flags: dict[str, str]
    """Parameter or config field name → what the user types."""
    field_flags: dict[str, str]
    """``Class.field`` (an error's ``param`` for a field of a config dataclass) → flag."""

    def message(self, e: PrismError) -> str:
        """The error as one line, each parameter it names (``e.params``) spelled as this command's flag."""
        return e.spelled({**self.flags, **self.field_flags})

    def op_kwargs(self, kwargs: dict[str, object]) -> dict[str, object]:
        """The operation's keyword arguments: its options, ``fixed``, ``computed``, progress callbacks, and
        each config dataclass re-assembled from its options (validated then: an error exits with its flag)."""
        op_kwargs = {
            **{k: v for k, v in kwargs.items() if k in self.op_names},
            **self.fixed,
            **{k: f(kwargs) for k, f in self.computed.items()},
        }
        for n in self.progress_names:
            op_kwargs[n] = progress_for(bool(op_kwargs[n]))
        for group, (cls, names, prefix) in self.groups.items():
            values = {n[len(prefix) :]: op_kwargs.pop(n) for n in names}
            try:
                op_kwargs[group] = cls(**values)
            except PrismError as e:
                fail(self.message(e))
        return op_kwargs

    def open_run(self, kwargs: dict[str, object]) -> Run:
        """The run RUN names; typer parsed these three as declared: a Path and two strings."""
        run = Run.open(
            Path(str(kwargs["run"])),
            device=str(kwargs["device"]),
            suppress=str(kwargs["suppress"]) if self.suppressible else "none",
            suppress_residual=str(kwargs["suppress_residual"]) if self.suppressible else "auto",
        )
        _announce_suppression(run)
        return run

    def __call__(self, kwargs: dict[str, object]) -> None:
        op_kwargs = self.op_kwargs(kwargs)
        render_kwargs = {k: v for k, v in kwargs.items() if k in self.render_names}
        try:
            _check_out_files(render_kwargs)
            run = None
            if self.opens_run:
                run = self.open_run(kwargs)
                result = self.op(run, **op_kwargs)
            else:
                result = self.op(**op_kwargs)
            if self.render is not None and is_main_process():  # under torchrun, rank 0 renders (prints, writes)
                extra = {"run": run} if "run" in inspect.signature(self.render).parameters else {}
                self.render(result, **extra, **render_kwargs)
        except PrismError as e:
            fail(self.message(e))
        except OSError as e:
            if e.filename is None:  # no file involved: not a user's path, a bug or the machine
                raise
            fail(os_error_message(e))
        except KeyboardInterrupt:  # no traceback: say what is kept and how to go on
            hint = f"; rerun with {self.flags['resume']} to continue it" if "resume" in self.op_names else ""
            interrupted(f"{self.name} interrupted{hint}")


def _register(app: typer.Typer, params: list[inspect.Parameter], invocation: _Invocation) -> None:
    """Add ``prism NAME`` to ``app``: a function whose signature is the typer parameters ``params`` (what typer
    parses) and which runs ``invocation`` on them; its help is the operation's summary."""

    def run_command(**kwargs: object) -> None:
        invocation(kwargs)

    run_command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run_command.__doc__ = summary(invocation.op)
    run_command.__name__ = invocation.name.replace("-", "_")
    app.command(invocation.name, help=summary(invocation.op))(run_command)


def command(
    app: typer.Typer,
    name: str,
    op: Callable[..., object],
    render: Callable[..., None] | None = None,
    *,
    opens_run: bool = True,
    arguments: set[str] | None = None,
    decls: dict[str, list[str]] | None = None,
    skip: set[str] | None = None,
    suppressible: bool = False,
    fixed: dict[str, object] | None = None,
    computed: dict[str, Callable[[dict[str, object]], object]] | None = None,
    prefixed: set[str] | None = None,
) -> None:
    """Register ``op`` as ``prism NAME``. With ``opens_run`` the first argument is RUN and ``--device``
    opens the ``Run`` passed to ``op``; ``suppressible`` (operations that apply the run's interventions)
    adds ``--suppress`` (default: the checkpoint's own set); other commands open the run unsuppressed. ``render(result, run=…, **its options)`` prints the
    result (on rank 0 only under torchrun). Positional arguments: ``arguments``. ``fixed``: keyword arguments the CLI itself gives ``op``
    (e.g. a progress callback that renders to the terminal); they are not options. ``computed``: keyword
    arguments of ``op`` derived from the command's options (name → function of all the parsed options),
    e.g. ``explain=lambda o: o["html_out"] is not None`` when a renderer's output needs more computed.
    ``prefixed``: parameters typed with a config dataclass whose options are named PARAMETER_FIELD (their
    flags: ``decls``); an error naming a field as ``Class.field`` is shown with the field's flag."""
    decls = decls or {}
    fixed = fixed or {}
    computed = computed or {}
    skip = set(skip or ()) | set(fixed) | set(computed) | ({"run"} if opens_run else set())
    positional = set(arguments or ())
    groups: dict[str, tuple[type, list[str], str]] = {}
    op_params = _params(op, skip, decls, positional, groups, prefixed)
    op_names = {p.name for p in op_params}
    op_hints = typing.get_type_hints(op)
    # a renderer option with the name of an operation option (e.g. --shards) is one option, given to both
    render_all = _params(render, {"run", _first_parameter(render)}, decls, set()) if render is not None else []
    head, tail = _run_options(opens_run, suppressible)
    params = (
        head
        + [p for p in op_params if p.name in positional]
        + [p for p in op_params if p.name not in positional]
        + tail
        + [p for p in render_all if p.name not in op_names]
    )
    invocation = _Invocation(
        name=name,
        op=op,
        render=render,
        opens_run=opens_run,
        suppressible=suppressible,
        fixed=fixed,
        computed=computed,
        groups=groups,
        op_names=op_names,
        progress_names={n for n in op_names if op_hints.get(n) == Progress},  # --progress/--no-progress flags
        render_names={p.name for p in render_all},
        flags=flags_of(params),
        field_flags=_field_flags(groups, op_params),
    )
    _register(app, params, invocation)
