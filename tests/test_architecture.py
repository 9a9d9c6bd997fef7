"""The layers import one way. Every import is counted, including those inside functions and under
``if TYPE_CHECKING:`` (ast walk): no import cycle between modules anywhere in src/, and no module imports
another module's private (``_name``) names.

    config, errors, artifacts, progress, _version  ←  data  ←  model  ←  eval  ←  train  ←  explain, tda  ←  control
    ←  app  ←  integrations  ←  render  ←  web  ←  cli

typer and rich (the terminal front end) are imported only by cli/ and render/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "prismlm"

LAYER = {
    "_version": 0,
    "errors": 0,
    "progress": 0,
    "artifacts": 0.3,
    "config": 0.5,
    "data": 0.9,  # tokenizers and token shards: a pretrained model is loaded with its tokenizer (model/pretrained)
    "model": 1,
    "eval": 2,
    "train": 2.5,
    "explain": 3,
    "tda": 3,
    "control": 4,
    "integrations": 5.5,  # transformers, export and lm-eval: the model seen through another library's API
    "app": 5,
    "render": 6,  # terminal and HTML views of results
    "web": 6.5,  # the explorer's HTTP server and its static files (serves render/'s shared assets)
    "cli": 7,
    "__init__": 10,  # the package facade re-exports the core classes for users
}
FRONT_END_ONLY = {"typer", "rich", "click"}


def _unit(module: str) -> str | None:
    """``prismlm.tda.cache`` → ``tda``; ``prismlm`` (the facade) → ``__init__``; other packages → None."""
    parts = module.split(".")
    if parts[0] != "prismlm":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every imported module of a file (absolute; relative imports resolved), with its line."""
    rel = path.relative_to(SRC.parent).with_suffix("") if path.is_relative_to(SRC.parent) else Path(path.stem)
    pkg = list(rel.parts[:-1])  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            # `from prismlm import app` imports the subpackage prismlm.app
            if mod == "prismlm":
                out += [(f"prismlm.{a.name}", node.lineno) for a in node.names]
    return out


def _edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for f in SRC.rglob("*.py"):
        rel = f.relative_to(SRC)
        src = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"
        for mod, line in _imports(f):
            dst = _unit(mod)
            if dst is None or dst == src:
                continue
            if mod == "prismlm" and dst == "__init__":
                continue  # `from prismlm import app`: counted through the subpackage above
            edges.setdefault((src, dst), []).append(f"{rel}:{line}")
    return edges


def test_every_unit_has_a_layer():
    units = {
        p.name.removesuffix(".py")
        for p in SRC.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert units - set(LAYER) == set(), "a new subpackage needs a place in LAYER"


def test_imports_point_down_the_layers():
    wrong = [
        f"{src} → {dst} ({', '.join(where[:3])})"
        for (src, dst), where in sorted(_edges().items())
        if dst != "__init__" and LAYER.get(dst, 99) >= LAYER.get(src, -1)
    ]
    assert wrong == [], "imports that climb up (or sideways) a layer:\n" + "\n".join(wrong)


def test_library_does_not_import_the_package_facade():
    # prismlm/__init__ imports the model; a low layer importing it would climb back up
    wrong = [
        f"{src} ({', '.join(where[:3])})"
        for (src, dst), where in _edges().items()
        if dst == "__init__" and src not in ("cli", "render", "web", "app")
    ]
    assert wrong == []


def test_no_cycles_between_units():
    graph: dict[str, dict[str, int]] = {}
    for src, dst in _edges():
        graph.setdefault(src, {})[dst] = 1
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


@pytest.mark.parametrize("package", sorted(p for p in LAYER if LAYER[p] < LAYER["render"]))
def test_no_terminal_front_end_below_the_cli(package):
    files = [SRC / f"{package}.py"] if (SRC / f"{package}.py").exists() else sorted((SRC / package).rglob("*.py"))
    bad = [
        f"{f.relative_to(SRC)}:{line} imports {mod}"
        for f in files
        for mod, line in _imports(f)
        if mod.split(".")[0] in FRONT_END_ONLY
    ]
    assert bad == []


def _module_name(path: Path) -> str:
    """``src/prismlm/tda/cache/store.py`` → ``prismlm.tda.cache.store``; a package's ``__init__`` → the package."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(f): f for f in SRC.rglob("*.py")}


def _from_imports(path: Path, me: str) -> list[tuple[str, str, int]]:
    """(module, name, line) of every ``from module import name`` in module ``me`` (file ``path``), relative
    imports resolved."""
    pkg = me.split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [(mod, a.name, node.lineno) for a in node.names]
    return out


def _module_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module → {imported prismlm module: line}. ``from pkg import sub`` imports the submodule ``pkg.sub``
    (not pkg's ``__init__``); the implicit import of a parent package is not counted (every module would
    be in a cycle with its package's ``__init__``)."""
    graph: dict[str, dict[str, int]] = {}
    for me, f in files.items():
        edges = graph.setdefault(me, {})
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                edges.update({a.name: node.lineno for a in node.names if a.name in MODULES})
        for mod, name, line in _from_imports(f, me):
            target = f"{mod}.{name}" if f"{mod}.{name}" in MODULES else mod
            if target in MODULES and target != me:
                edges.setdefault(target, line)
    return graph


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    seen: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(u: str, stack: list[str]) -> list[str] | None:
        seen[u] = 1
        for v in sorted(graph.get(u, {})):
            if seen.get(v) == 1:
                return stack[stack.index(v) :] + [u, v] if v in stack else stack + [u, v]
            if v not in seen:
                cycle = visit(v, stack + [u])
                if cycle:
                    return cycle
        seen[u] = 2
        return None

    for u in sorted(graph):
        if u not in seen:
            cycle = visit(u, [])
            if cycle:
                return cycle
    return None


def test_no_import_cycles_between_modules():
    """No module imports itself through others, counting lazy (in-function) and ``TYPE_CHECKING`` imports:
    a cycle hidden that way still ties two modules into one that cannot be read or tested alone."""
    cycle = _find_cycle(_module_graph(MODULES))
    assert cycle is None, "import cycle (lazy and TYPE_CHECKING imports count): " + " → ".join(cycle or [])


PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str, str]] = set()
"""(importer, module, name) private names still imported across modules: none left."""


def _private_imports() -> set[tuple[str, str, str]]:
    out = set()
    for me, f in MODULES.items():
        for mod, name, _ in _from_imports(f, me):
            if (
                mod.split(".")[0] == "prismlm"
                and name.startswith("_")
                and not name.startswith("__")
                and f"{mod}.{name}" not in MODULES
                and mod != me
            ):
                out.add((me, mod, name))
    return out


def test_no_module_imports_another_modules_private_names():
    """``from prismlm.a import _x`` reaches into a.py's internals: make ``_x`` public (or move it) instead."""
    wrong = sorted(_private_imports() - PRIVATE_IMPORTS_ALLOWED)
    assert wrong == [], "private names imported across modules:\n" + "\n".join(
        f"{a}: from {m} import {n}" for a, m, n in wrong
    )
    assert PRIVATE_IMPORTS_ALLOWED <= _private_imports(), "an allowed private import is gone: drop it from the list"


def test_the_cycle_checker_sees_lazy_and_type_checking_imports(tmp_path):
    """Two modules that import each other only inside a function and under ``TYPE_CHECKING`` are a cycle;
    a private name imported from another module is found."""
    pkg = tmp_path / "prismlm" / "fake"
    pkg.mkdir(parents=True)
    a, b = pkg / "a.py", pkg / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prismlm.fake.b import B\n")
    b.write_text("def f():\n    from prismlm.fake.a import _x\n    return _x\n")
    files = {"prismlm.fake.a": a, "prismlm.fake.b": b}
    MODULES.update(files)
    try:
        assert _find_cycle(_module_graph(files)) == ["prismlm.fake.a", "prismlm.fake.b", "prismlm.fake.a"]
        assert ("prismlm.fake.a", "_x", 2) in _from_imports(b, "prismlm.fake.b")
    finally:
        for k in files:
            MODULES.pop(k)


def test_the_checker_sees_function_level_imports(tmp_path):
    """The walk counts an import inside a function body (the kind that hid the old cycles)."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from prismlm.cli.main import app\n    return app\n")
    assert ("prismlm.cli.main", 2) in _imports(f)


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
def test_the_environment_imports_transformers_model_classes():
    """scripts/setup.sh must leave a venv where transformers' model classes import: kronfluence pulls a CUDA
    torchvision that breaks them next to the CPU torch ("operator torchvision::nms does not exist"), so the
    setup removes it. Not skipped: a broken environment must fail here, not silently skip the HF tests."""
    import subprocess
    import sys

    code = "from transformers import GPT2LMHeadModel, LlamaForCausalLM, GPTNeoXForCausalLM; import peft, lm_eval"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def _loader_calls(path: Path, root: Path = SRC) -> list[str]:
    """``X.from_pretrained(...)`` calls on a transformers model or config class (``AutoModelForCausalLM``,
    ``tf.AutoConfig``, …) and calls of the GGUF loader, as ``file:line``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        receiver = f.value if isinstance(f, ast.Attribute) else None
        owner = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
        weights = isinstance(f, ast.Attribute) and f.attr == "from_pretrained" and not owner.endswith("Tokenizer")
        gguf = (isinstance(f, ast.Name) and f.id == "load_causal_lm") or (
            isinstance(f, ast.Attribute) and f.attr == "load_causal_lm"
        )
        if weights or gguf:
            out.append(f"{path.relative_to(root)}:{node.lineno}")
    return out


def test_pretrained_models_load_in_model_or_integrations():
    """A newcomer finds model loading under ``model/`` (``prismlm.model.pretrained``) or ``integrations/``:
    no other package reads transformers weights or GGUF files itself."""
    from prismlm.model import pretrained

    assert pretrained.load_pretrained.__module__ == "prismlm.model.pretrained"
    elsewhere = [
        where
        for f in sorted(SRC.rglob("*.py"))
        if f.relative_to(SRC).parts[0] not in ("model", "integrations")
        for where in _loader_calls(f)
    ]
    assert elsewhere == [], "pretrained weights loaded outside model/ and integrations/:\n" + "\n".join(elsewhere)
    inside = [w for f in sorted((SRC / "model").rglob("*.py")) for w in _loader_calls(f)]
    assert any(w.startswith("model/pretrained.py") for w in inside)  # the check sees the calls it looks for


def test_the_loader_check_sees_a_stray_loader(tmp_path):
    f = tmp_path / "stray.py"
    f.write_text("def f(tf, s):\n    return tf.AutoModelForCausalLM.from_pretrained(s), load_causal_lm(s)\n")
    g = tmp_path / "ok.py"
    g.write_text("def f(tf, s):\n    return tf.AutoTokenizer.from_pretrained(s)\n")
    assert _loader_calls(f, tmp_path) == ["stray.py:2", "stray.py:2"]
    assert _loader_calls(g, tmp_path) == []


STORED_FILES = ("z.bin", "boundary.bin", "targets.bin")


def test_stored_activations_are_read_and_written_in_one_module():
    """z and stage 2's boundary activations are one artifact with one reader/writer/verifier
    (``prismlm.model.stored_activations``), read by both the trainer and the index: no other module names its
    files, and both import it."""
    named = sorted(
        str(f.relative_to(SRC))
        for f in SRC.rglob("*.py")
        if any(isinstance(n, ast.Constant) and n.value in STORED_FILES for n in ast.walk(ast.parse(f.read_text())))
    )
    assert named == ["model/stored_activations.py"]
    graph = _module_graph(MODULES)
    for reader in ("prismlm.train.bank_stage", "prismlm.train.stage2", "prismlm.explain.index.build"):
        assert "prismlm.model.stored_activations" in graph[reader], reader


def _passed_on(files: dict[str, Path]) -> dict[str, dict[str, str]]:
    """module → {name it imports from another prismlm module at top level: that module}, for every module
    but a package's ``__init__`` (a package facade re-exports on purpose)."""
    out: dict[str, dict[str, str]] = {}
    for me, f in files.items():
        if f.name == "__init__.py":
            continue
        tree = ast.parse(f.read_text(), str(f))
        out[me] = {
            a.asname or a.name: node.module
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prismlm")
            for a in node.names
        }
    return out


def _second_paths(files: dict[str, Path], roots: list[Path]) -> list[str]:
    """Imports of a name from a module that only imports it itself (a second path to one function), and
    modules that re-export an imported name (``import x as x`` or in ``__all__``)."""
    passed = _passed_on(files)
    bad = []
    for me, f in files.items():
        tree = ast.parse(f.read_text(), str(f))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and f.name != "__init__.py":
                bad += [f"{me} re-exports {a.name}" for a in node.names if a.asname == a.name]
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                names = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
                bad += [f"{me} re-exports {n} in __all__" for n in names if n in passed.get(me, {})]
    for f in (p for root in roots for p in sorted(root.rglob("*.py"))):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module in passed:
                bad += [
                    f"{f.name}:{node.lineno} imports {a.name} from {node.module}, not {passed[node.module][a.name]}"
                    for a in node.names
                    if a.name in passed[node.module]
                ]
    return bad


def test_each_public_name_has_one_import_path():
    """A function or class is imported from the module that defines it (or its package's facade): no module
    re-exports another's names, so ``build_run_index`` is not found in three places."""
    root = SRC.parents[1]
    assert _second_paths(MODULES, [SRC, root / "tests", root / "bench"]) == []


def test_the_import_path_check_sees_a_re_export(tmp_path):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("def f():\n    return 1\n")
    b.write_text("from prismlm.fake.a import f\n\n__all__ = ['f']\n")
    c.write_text("from prismlm.fake.b import f\n")
    files = {"prismlm.fake.a": a, "prismlm.fake.b": b}
    assert _second_paths(files, [tmp_path]) == [
        "prismlm.fake.b re-exports f in __all__",
        "c.py:1 imports f from prismlm.fake.b, not prismlm.fake.a",
    ]


# ----- bench/: the benchmark scripts follow the library's rules ---------------------------------------------
BENCH = SRC.parents[1] / "bench"
BENCH_SHARED = "_common"
"""The one helper module a bench script imports besides ``prismlm`` (argparse, profiles, JSON writing)."""
BENCH_MAX_FUNCTION_LINES, BENCH_MAX_FILE_LINES, BENCH_MAX_ANY, BENCH_MAX_DOCSTRING_LINES = 80, 800, 20, 15


def _bench_files() -> list[Path]:
    return sorted(BENCH.glob("*.py"))


def _bench_edges(files: list[Path]) -> dict[str, dict[str, int]]:
    """bench module → {bench module it imports: line} (bench/ is on sys.path when a script runs)."""
    names = {f.stem for f in BENCH.glob("*.py")}
    return {f.stem: {mod.split(".")[0]: line for mod, line in _imports(f) if mod.split(".")[0] in names} for f in files}


def test_bench_scripts_import_only_prismlm_and_the_shared_helper():
    """A bench module imports ``prismlm``, third-party packages and ``bench/_common.py`` — never another
    script or a private bench module (what two scripts share lives in the library, tested)."""
    wrong = [
        f"bench/{src}.py:{line} imports {dst}"
        for src, dsts in _bench_edges(_bench_files()).items()
        for dst, line in dsts.items()
        if dst != BENCH_SHARED or src == BENCH_SHARED
    ]
    assert wrong == [], "\n".join(wrong)


def test_bench_has_no_import_cycles():
    cycle = _find_cycle(_bench_edges(_bench_files()))
    assert cycle is None, "bench import cycle: " + " → ".join(cycle or [])


def test_bench_imports_no_private_names():
    """``from prismlm.x import _y`` or ``from _common import _y`` reaches into another module's internals."""
    wrong = [
        f"bench/{f.name}:{line}: from {mod} import {name}"
        for f in _bench_files()
        for mod, name, line in _from_imports(f, f.stem)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert wrong == [], "\n".join(wrong)


def _long_functions(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def _any_count(path: Path) -> int:
    """``Any`` used as a name (``Any``, ``typing.Any``), imports excluded."""
    tree = ast.parse(path.read_text(), str(path))
    return sum(
        (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(tree)
    )


def test_bench_functions_and_files_are_short():
    long_functions = [x for f in _bench_files() for x in _long_functions(f, BENCH_MAX_FUNCTION_LINES)]
    long_files = [
        f"{f.name} ({n} lines)" for f in _bench_files() if (n := len(f.read_text().splitlines())) > BENCH_MAX_FILE_LINES
    ]
    assert long_functions == [], f"functions over {BENCH_MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)
    assert long_files == [], f"files over {BENCH_MAX_FILE_LINES} lines: " + ", ".join(long_files)


def test_bench_uses_any_sparingly():
    counts = {f.name: c for f in _bench_files() if (c := _any_count(f))}
    assert sum(counts.values()) <= BENCH_MAX_ANY, f"{sum(counts.values())} Any in bench/ (≤ {BENCH_MAX_ANY}): {counts}"


def test_bench_module_docstrings_say_what_and_how_in_a_few_lines():
    """What a script measures and how to run it; the measurements belong in docs/results.md and the JSON."""
    wrong = []
    for f in _bench_files():
        doc = ast.get_docstring(ast.parse(f.read_text(), str(f)), clean=False)
        if doc is None or len(doc.strip().splitlines()) > BENCH_MAX_DOCSTRING_LINES:
            wrong.append(f"{f.name}: {'none' if doc is None else len(doc.strip().splitlines())} lines")
    assert wrong == [], f"module docstrings missing or over {BENCH_MAX_DOCSTRING_LINES} lines: " + ", ".join(wrong)


def test_the_bench_checks_see_what_they_forbid(tmp_path):
    """A long function, an ``Any`` and a script-to-script import are found."""
    f = tmp_path / "x.py"
    body = "\n".join(f"    y = {i}" for i in range(81))
    f.write_text(f"from typing import Any\nimport attribution\n\n\ndef g(a: Any) -> None:\n{body}\n")
    assert _long_functions(f, 80) == ["x.py:5 g (82 lines)"]
    assert _any_count(f) == 1
    assert ("attribution", 2) in _imports(f)


def test_mypy_covers_bench():
    import tomllib

    files = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert "bench" in files
