"""Register the ``prism`` model type with transformers' Auto classes once transformers is imported.

``import prismlm`` must stay fast, so the facade never imports transformers: ``register_when_imported()``
registers at once when transformers is loaded, or else puts a finder on ``sys.meta_path`` that registers
right after transformers has been imported and then removes itself. Invariant: a registration failure never
breaks ``import transformers`` (it becomes a warning). Imports only the standard library. See
docs/modules.md; the startup hook
``prismlm-transformers.pth`` calls ``find_spec_registering`` for programs that never import prismlm.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED_MODULES", "alias_moved_modules", "find_spec_registering", "register_now", "register_when_imported"]

_TARGET = "transformers"
_MODULE = "prismlm.integrations.hf_model"
_lock = threading.Lock()


def register_now() -> bool:
    """Register ``prism`` with the Auto classes; False (with a warning) when that fails."""
    being_imported = sys.modules.get(_MODULE)
    if being_imported is not None and getattr(being_imported.__spec__, "_initializing", False):
        # transformers was first imported by prismlm.integrations.hf_model itself (``prism export``): that module is
        # half executed, its ``register`` not defined yet, and it registers at its own end
        return True
    try:
        from prismlm.integrations.hf_model import register

        register()
    except Exception as e:  # noqa: BLE001 — never break the user's import of transformers
        warnings.warn(
            f"prismlm could not register the 'prism' model type with transformers "
            f"({type(e).__name__}: {e}); AutoModelForCausalLM will not know exported PRISM models "
            "(load them with trust_remote_code=True)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it asks the other finders for ``transformers`` and wraps the found loader's
    ``exec_module`` so that the registration runs when the package has executed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None) if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec  # not installed (the import fails as usual), or an exotic loader: leave it alone
        original = loader.exec_module
        hook = self

        def exec_module(module: ModuleType) -> None:
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module  # the loader's own method again
                except AttributeError:
                    pass
            hook.remove()
            register_now()

        loader.exec_module = exec_module
        return spec

    def remove(self) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def _installed() -> _RegisterAfterImport | None:
    return next((f for f in sys.meta_path if isinstance(f, _RegisterAfterImport)), None)


def register_when_imported() -> _RegisterAfterImport | None:
    """Register now if transformers is imported, else once it is (see the module docstring). Returns the
    installed finder, or None when it registered (or tried to) right away. Idempotent."""
    if _TARGET in sys.modules:
        register_now()
        return None
    with _lock:
        hook = _installed()
        if hook is None:
            hook = _RegisterAfterImport()
            sys.meta_path.insert(0, hook)
    return hook


def find_spec_registering(
    name: str, path: Sequence[str] | None, target: ModuleType | None = None
) -> importlib.machinery.ModuleSpec | None:
    """Called by the startup hook (``prismlm-transformers.pth``, installed beside prismlm) when a program
    that never imported prismlm imports transformers: the spec the other finders give, registering ``prism``
    once transformers has executed. So ``AutoTokenizer``/``AutoConfig.from_pretrained(exported folder)`` know
    the model type without ``trust_remote_code`` and never stop at transformers' ``[y/N]`` prompt."""
    hook = register_when_imported()
    return None if hook is None else hook.find_spec(name, path, target)


# Folders exported before the move import the old path in their ``modeling_prism.py``; they keep loading.
MOVED_MODULES = {"prismlm.model.hf_model": "prismlm.integrations.hf_model"}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name of ``MOVED_MODULES`` and fills it with the new module's public names."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def exec_module(self, module: ModuleType) -> None:
        new = importlib.import_module(MOVED_MODULES[module.__name__])
        module.__dict__.update({k: v for k, v in vars(new).items() if not k.startswith("__")})


def alias_moved_modules() -> None:
    """Let ``import`` find the old names of moved modules (idempotent; standard library only)."""
    with _lock:
        if not any(isinstance(f, _MovedModule) for f in sys.meta_path):
            sys.meta_path.append(_MovedModule())
