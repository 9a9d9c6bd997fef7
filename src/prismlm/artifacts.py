"""What every on-disk artifact shares: atomic writes, hashes, one writer per folder, provenance, ranges.

The lowest layer (standard library, torch, ``prismlm.errors`` only). Invariant: a crash leaves the old
artifact or the new one, never a torn one (``atomic_write_*``, ``atomic_dir``), and no command writes over
something it does not own (``check_out_folder`` / ``check_out_file``, the guard every writer calls first;
``output_lock`` for long writers). Messages name parameters in backquotes (`` `out` ``); the CLI turns
them into its flags. See docs/architecture.md.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, ParamSpec, TypeAlias, TypedDict, TypeVar

import torch

from prismlm.errors import ArtifactCorrupt, ArtifactError, ArtifactMismatch, ConfigError, PrismError, RunError, named

__all__ = [
    "FileLock",
    "atomic_dir",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_out_file",
    "check_out_folder",
    "check_provenance",
    "encodable",
    "folder_kind",
    "merge_ranges",
    "model_identity",
    "output_lock",
    "save_tensors",
    "overlap",
    "part_range",
    "provenance",
    "sha256_file",
    "write_output",
    "writes_folder",
]


# ----- atomic writes ---------------------------------------------------------------------------------------
def _tmp(path: Path, suffix: str = ".tmp") -> Path:
    return path.with_name(path.name + suffix)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through ``<path>.tmp`` (flushed to disk) renamed into place; a failed write
    (a full disk) removes the temp file and leaves ``path`` as it was. Returns ``path``."""
    path = Path(path)
    tmp = _tmp(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` through ``<path>.tmp`` renamed into place; returns ``path``."""
    return atomic_write_bytes(path, text.encode(encoding))


JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
"""A JSON value: what ``json.loads`` returns and ``json.dumps`` takes (manifests, ``to_dict()`` results)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """``text`` with every lone surrogate (what Python makes of undecodable argv bytes) replaced by U+FFFD,
    so that it encodes as UTF-8."""
    return _SURROGATE.sub("\ufffd", text)


def write_output(path: str | Path, text: str, *, option: str) -> Path:
    """Write a file the user named with ``option`` (e.g. ``json_out``): missing parent folders are
    created, lone surrogates are written as U+FFFD, and the write is atomic (never a 0-byte or torn file).
    A path that cannot be written raises ``ConfigError`` naming the option, the path and the OS's reason."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(path, encodable(text))
    except OSError as e:
        raise ConfigError(
            f"{named(option)} {path}: cannot write it ({e.strerror or e})",
            fix=f"give {named(option)} a file path in a folder you can write",
            path=path,
            param=option,
        ) from None


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Stage a folder and rename it into place: ``with atomic_dir(out) as stage: <write files in stage>``.

    ``stage`` is a fresh, empty ``<out>.tmp`` (a stale one from a crash is removed first). On a normal
    exit the existing ``out`` (if any) is renamed to ``<out>.old``, the stage to ``out``, and only then
    is ``<out>.old`` removed; on an exception the stage is removed and ``out`` is left untouched."""
    path = Path(path)
    stage, old = _tmp(path), _tmp(path, ".old")
    if old.exists() and not path.exists():  # a crash between the two renames below: put the live one back
        os.replace(old, path)
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _plain_file_modes(stage)
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(stage, path)
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    """The process umask (read by setting it and back: there is no getter before Python 3.13's os)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plain_file_modes(folder: Path) -> None:
    """Give every file under ``folder`` at least the permissions a plain ``open()`` would (0666 & ~umask,
    0644 under the usual umask 022). Why: writers that stage through ``mkstemp`` — safetensors ≥ 0.7's
    ``save_file``/``save_model`` — leave 0600 files, so a shared model folder was unreadable to others."""
    wanted = 0o666 & ~_umask()
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            mode = p.stat().st_mode & 0o7777
            if mode | wanted != mode:
                p.chmod(mode | wanted)


# ----- hashes ----------------------------------------------------------------------------------------------
@contextmanager
def reading(path: str | Path, what: str, fix: str | None = None) -> Iterator[None]:
    """Read an artifact's file inside this block: a truncated or garbled file (whatever the reader raises:
    safetensors, numpy, json, EOF) becomes ``ArtifactCorrupt`` naming the file and the rebuild command."""
    try:
        yield
    except PrismError:
        raise
    except Exception as e:  # noqa: BLE001 — any failure to parse the bytes is a corrupt artifact
        raise ArtifactCorrupt(f"{what} {path} cannot be read ({type(e).__name__}: {e})", fix=fix, path=path) from e


class FileLock:
    """An exclusive, non-blocking lock on ``path`` (``fcntl.flock``), released on exit or when the process
    dies — so a crashed writer never leaves a stale lock. The holder writes its pid, host and start time
    into the file so that a refused second writer can say who holds it (``error`` with ``fix``).
    ``remove``: delete the lock file on release (a waiter that then locks the deleted file sees that the
    path no longer names it and locks the path again). ``stages``: a command of several stages (``prism
    demo``: retrofit → index → explain → report) holds the lock to its end, and each stage's own lock of the
    same path in the same thread nests inside it (a second ``flock`` on a new fd would refuse its own holder);
    any other lock of the path, even in this thread, is refused as a second writer."""

    _held: ClassVar[dict[tuple[str, int], int]] = {}
    """(absolute path, thread) of a ``stages`` lock → how many acquires of it are open in this process."""

    def __init__(
        self,
        path: str | Path,
        what: str,
        *,
        wait: bool = False,
        error: type[PrismError] = RunError,
        fix: str = "wait for it to finish, or use another folder",
        remove: bool = False,
        stages: bool = False,
        param: str | None = None,
    ) -> None:
        self.path, self.what, self.wait, self.param = Path(path), what, wait, param
        self.error, self.fix, self.remove, self.stages = error, fix, remove, stages
        self._fd: int | None = None
        self._nested = False

    def _lock(self) -> int:
        """An fd of ``path`` locked exclusively (the file the path names once locked)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                # wait=True: block until the holder is done (e.g. another process preparing the same shards)
                fcntl.flock(fd, fcntl.LOCK_EX if self.wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raw = os.read(fd, 4096).decode("utf-8", "replace").strip()
                os.close(fd)
                try:
                    h = json.loads(raw)
                    holder = f"pid {h['pid']} on {h['host']} (since {h['since']})"
                except (ValueError, KeyError, TypeError):
                    holder = "another process"
                raise self.error(
                    f"{self.what} is being written by {holder} (lock {self.path})",
                    fix=self.fix,
                    path=self.path,
                    param=self.param,
                ) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed the file we locked: lock the one the path names now

    def _key(self) -> tuple[str, int]:
        return (os.path.abspath(self.path), threading.get_ident())

    def acquire(self) -> FileLock:
        key = self._key()
        if key in FileLock._held:  # this thread holds it already (an outer stage): count, do not lock again
            FileLock._held[key] += 1
            self._nested = True
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._lock()
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            ).encode(),
        )
        self._fd = fd
        if self.stages:
            FileLock._held[key] = 1
        return self

    def release(self) -> None:
        if self._nested:
            FileLock._held[self._key()] -= 1
            self._nested = False
            return
        if self._fd is not None:
            if self.stages:
                FileLock._held.pop(self._key(), None)
            if self.remove:  # while still held: no one can have locked the path's file in between
                self.path.unlink(missing_ok=True)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


_HELD: dict[tuple[str, int], int] = {}
"""Output folders this process holds a lock on, by (absolute path, thread): a writer that calls another
(``prism attribute-cache`` → ``build_cache``) holds the one lock once."""


@contextmanager
def output_lock(out: str | Path) -> Iterator[None]:
    """Hold the output folder ``out`` for one writer (``OUT.lock``, next to it, removed on release; the OS
    drops the lock when the process dies): a second writer — another process, or another thread of this
    one — gets ``ArtifactError`` ("OUT is being written by pid N …; wait for it or choose another `out`")
    before it touches anything. Re-entrant within a thread."""
    path = Path(os.path.abspath(out))
    key = (str(path), threading.get_ident())
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    lock = FileLock(
        path.with_name(path.name + ".lock"),
        str(out),
        error=ArtifactError,
        remove=True,
        fix="wait for it to finish, or choose another `out`",
        param="out",
    )
    try:
        lock.acquire()
    except OSError as e:
        raise ArtifactError(
            f"cannot write {out}: {e.strerror or e} ({lock.path})", fix="choose another `out`", path=out, param="out"
        ) from None
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        lock.release()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def writes_folder(param: str = "out") -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a writer whose argument ``param`` names its output folder: the call holds ``output_lock``
    on it (when it is not None) from start to end."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            out = sig.bind_partial(*args, **kwargs).arguments.get(param)
            if out is None:
                return fn(*args, **kwargs)
            with output_lock(out):
                return fn(*args, **kwargs)

        return locked

    return decorate


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> Path:
    """``safetensors.torch.save_file`` with a reproducible header: safetensors writes ``metadata`` in hash
    order, which changes from one call to the next, so identical builds had different bytes (and manifest
    sha256s). The header is written again with sorted keys (offsets are explicit, the data is unchanged),
    padded with spaces to 8 bytes as the format asks."""
    from safetensors.torch import save

    raw = save(tensors, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    Path(path).write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n :])
    return Path(path)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in chunks of ``chunk`` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# Files up to this size are hashed whole on every load; larger ones get their size and a sampled hash (64
# blocks of 64 KiB spread over the file, ~4 MiB read) on load, and a full sha256 with `prism verify`.
VERIFY_ON_LOAD_BYTES = 64 << 20
_SAMPLE_BLOCK, _SAMPLE_BLOCKS = 1 << 16, 64


def sampled_sha256(path: str | Path) -> str:
    """sha256 of 64 blocks of 64 KiB at evenly spread offsets (plus the size): a cheap check that catches
    truncation, zeroed regions and most overwrites of a large file without reading all of it."""
    path = Path(path)
    n = path.stat().st_size
    h = hashlib.sha256(str(n).encode())
    with open(path, "rb") as f:
        for k in range(_SAMPLE_BLOCKS):
            f.seek(max(0, (n - _SAMPLE_BLOCK) * k // max(1, _SAMPLE_BLOCKS - 1)))
            h.update(f.read(_SAMPLE_BLOCK))
    return h.hexdigest()


class FileRecord(TypedDict):
    """What a manifest records of one file, so that loading can verify it."""

    bytes: int
    sha256: str
    sample_sha256: str


def file_records(folder: str | Path, names: list[str] | None = None) -> dict[str, FileRecord]:
    """Size, sha256 and sampled sha256 of files in ``folder`` (``names``, or every file but manifest.json):
    what a manifest records so that loading can verify them."""
    folder = Path(folder)
    paths = (
        [folder / n for n in names]
        if names is not None
        else [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "manifest.json"]
    )
    return {
        p.relative_to(folder).as_posix(): {
            "bytes": p.stat().st_size,
            "sha256": sha256_file(p),
            "sample_sha256": sampled_sha256(p),
        }
        for p in paths
    }


def verify_files(
    folder: str | Path,
    records: Mapping[str, FileRecord] | None,
    *,
    what: str,
    fix: str,
    full: bool = False,
    skip: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
) -> list[str]:
    """Check files against their ``file_records``: present, same size; the full sha256 for files up to
    ``VERIFY_ON_LOAD_BYTES`` (all with ``full``), the sampled one for larger files. ``ArtifactCorrupt``
    naming the file and ``fix`` otherwise. Returns the names checked. No records (an artifact written
    before they existed): nothing to check — unless a name in ``required`` (files the artifact reads) has
    no record, which is refused (it could not be verified)."""
    folder = Path(folder)
    unrecorded = [n for n in required if n not in (records or {})]
    if unrecorded:
        raise ArtifactCorrupt(
            f"{what} {folder}: {unrecorded[0]} has no size and sha256 in "
            f"{folder / 'manifest.json'}, so it cannot be verified",
            fix=fix,
            path=folder / unrecorded[0],
        )
    checked = []
    for rel, rec in (records or {}).items():
        if rel in skip:
            continue
        f = folder / rel
        if not f.is_file():
            raise ArtifactCorrupt(f"{what} {folder} is incomplete: {rel} is missing", fix=fix, path=f)
        whole = full or rec["bytes"] <= VERIFY_ON_LOAD_BYTES
        if f.stat().st_size != rec["bytes"] or (
            sha256_file(f) != rec["sha256"] if whole else sampled_sha256(f) != rec.get("sample_sha256", "")
        ):
            raise ArtifactCorrupt(
                f"{f} was changed after the {what} was written (its size or sha256 differs "
                f"from {folder / 'manifest.json'})",
                fix=fix,
                path=f,
            )
        checked.append(rel)
    return checked


def model_identity(model: torch.nn.Module) -> str:
    """``weights:<sha256 of the state dict>`` — what ties an artifact to a model passed without its
    checkpoint (stable for equal weights, but not equal to a checkpoint's ``model_sha256``, the hash of
    its ``model.safetensors`` file: pass that where you have a checkpoint)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "weights:" + h.hexdigest()


# ----- provenance ------------------------------------------------------------------------------------------
def provenance() -> dict[str, str]:
    """The versions every artifact manifest records: ``prismlm_version`` and ``torch_version``."""
    from prismlm._version import __version__

    return {"prismlm_version": __version__, "torch_version": torch.__version__}


def check_provenance(
    manifest: Mapping[str, object],
    *,
    what: str,
    rebuild: str,
    model_sha256: str | None = None,
    shard_key: str | None = None,
) -> None:
    """Refuse an artifact (index, attribution cache, …) built from another model or corpus.

    ``manifest`` holds the ``model_sha256`` and ``shard_key`` the artifact was built from; ``what`` names
    it in the message and ``rebuild`` is the command that rebuilds it. A None ``model_sha256`` or
    ``shard_key`` is not checked. Raises ``ArtifactMismatch`` naming both hashes."""
    if model_sha256 is not None and model_sha256 != manifest["model_sha256"]:
        raise ArtifactMismatch(
            f"{what} was built for model {manifest['model_sha256']}, but this checkpoint's "
            f"model is {model_sha256}; rebuild it with `{rebuild}`"
        )
    if shard_key is not None and shard_key != manifest["shard_key"]:
        raise ArtifactMismatch(
            f"{what} was built on token shards {manifest['shard_key']}, but these shards are "
            f"{shard_key}; rebuild it with `{rebuild}` on this corpus"
        )


# ----- output folders --------------------------------------------------------------------------------------
RUN_FILES = ("config.json", "env.json", "metrics.jsonl", "checkpoints")
"""What a training run writes into its folder (besides its lock)."""
RUN, CHECKPOINTS, CHECKPOINT = "prismlm-run", "prismlm-checkpoints", "prismlm-checkpoint"
_NEVER = {RUN: "a run folder", CHECKPOINTS: "a run's checkpoints folder", CHECKPOINT: "a checkpoint"}
_IGNORED = {".lock"}  # a writer's lock file: nothing of the user's


def _manifest_kind(folder: Path) -> str | None:
    try:
        m = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return m.get("kind") if isinstance(m, dict) and isinstance(m.get("kind"), str) else None


def folder_kind(folder: str | Path) -> str | None:
    """Which prismlm artifact ``folder`` holds: its ``manifest.json`` kind (index, cache, search index,
    checkpoint, …), ``prismlm-run`` for a run folder (even one killed before its first checkpoint),
    ``prismlm-checkpoints`` for a run's ``checkpoints/``; None for anything else."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    kind = _manifest_kind(folder)
    if kind is not None:
        return kind
    if (folder / "checkpoints").is_dir() or any((folder / n).is_file() for n in ("env.json", "metrics.jsonl")):
        return RUN
    if (folder / "latest").is_file() or any(_manifest_kind(p) == CHECKPOINT for p in folder.glob("step-*")):
        return CHECKPOINTS
    return None


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _describe(kind: str) -> str:
    """``prismlm-prototype-index`` → "a prototype index"; a run, its checkpoints, a checkpoint by name."""
    return _NEVER.get(kind) or _a(kind.removeprefix("prismlm-").replace("-", " "))


def _inside_checkpoints(path: Path) -> bool:
    # abspath, not Path.absolute: RUN/checkpoints/.. is RUN, not a folder inside the checkpoints
    return any(folder_kind(a) in (CHECKPOINTS, CHECKPOINT) for a in Path(os.path.abspath(path)).parents)


def check_out_folder(
    out: str | Path,
    what: str,
    *,
    holds: str | Callable[[Path], bool],
    overwrite: bool = False,
    resume: bool = False,
    option: str = "out",
    can_resume: bool = False,
) -> None:
    """Refuse to write the folder ``out`` (a ``what``) unless nothing of value is lost: it is new or empty
    (a lock file aside), or it ``holds`` that kind of artifact (a manifest kind, or a test of the folder)
    and ``overwrite`` or ``resume`` was given. Never a file, a run folder, a run's ``checkpoints/`` or
    anything inside them, or a non-empty foreign folder, whatever the flags. ``RunError`` (a one-line
    message naming ``option`` and how to proceed) otherwise; ``can_resume``: the caller takes ``resume``."""
    out = Path(out)
    shown = named(option)
    same = (lambda p: folder_kind(p) == holds) if isinstance(holds, str) else holds
    if out.exists() and not out.is_dir():
        raise RunError(
            f"{shown} {out} is an existing file, not a folder", fix=f"choose another {shown}", path=out, param=option
        )
    if _inside_checkpoints(out):
        raise RunError(
            f"{shown} {out} is inside a run's checkpoints; writing there could replace them",
            fix=f"choose another {shown} (e.g. beside the run's checkpoints/)",
            path=out,
            param=option,
        )
    if not out.exists() or all(p.name in _IGNORED for p in out.iterdir()):
        return
    if same(out):
        if overwrite or resume:
            return
        how = ["pass `overwrite` to replace it"] + (["`resume` to continue it"] if can_resume else [])
        raise RunError(
            f"{shown} {out} already holds {_a(what)}",
            fix=f"{', or '.join(how)}, or choose another {shown}",
            path=out,
            param=(option, "overwrite", "resume"),
        )
    kind = folder_kind(out)
    held = _describe(kind) if kind else "a folder that is not empty"
    raise RunError(
        f"{shown} {out} is {held} and not {_a(what)}; nothing in it is replaced, even with `overwrite`",
        fix=f"choose a new or empty folder for {shown}",
        path=out,
        param=(option, "overwrite"),
    )


def check_out_file(path: str | Path, option: str) -> None:
    """Refuse an output file (e.g. ``json_out``) that is a folder, lies inside a run's checkpoints, or
    would replace a file of an artifact (a run's config.json or metrics.jsonl, an index's manifest.json, …).
    ``RunError`` naming ``option`` otherwise; a missing parent folder is left to the writer."""
    path = Path(path)
    shown = named(option)
    if path.is_dir():
        raise RunError(
            f"{shown} {path} is a folder",
            fix=f"give {shown} a file name (e.g. one inside that folder)",
            path=path,
            param=option,
        )
    kind = folder_kind(path.parent)
    owned = kind is not None and path.exists() and (kind != RUN or path.name in RUN_FILES)
    if _inside_checkpoints(path) or owned:
        raise RunError(
            f"{shown} {path} would write into {_describe(kind or CHECKPOINT)} ({path.parent})",
            fix=f"write {shown} to another file",
            path=path,
            param=option,
        )


# ----- sequence ranges -------------------------------------------------------------------------------------
def merge_ranges(ranges: list[list[int]]) -> list[list[int]]:
    """Sorted, disjoint, non-empty ``[start, stop)`` ranges covering the same sequences as ``ranges``
    (adjacent and overlapping ranges are joined; empty ones dropped)."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(r1: list[list[int]], r2: list[list[int]]) -> list[int] | None:
    """The first ``[start, stop)`` shared by a range of ``r1`` and a range of ``r2``, or None."""
    for a, b in r1:
        for c, d in r2:
            if max(a, c) < min(b, d):
                return [max(a, c), min(b, d)]
    return None


def part_range(num_sequences: int, batch_size: int, part: tuple[int, int]) -> tuple[int, int]:
    """Sequence range [start, stop) of part i of n of ``[0, num_sequences)``: contiguous, whole batches of
    ``batch_size`` (so parts built separately go through the model in the same batches as one pass)."""
    i, n = part
    if batch_size < 1:
        raise ConfigError(f"`batch_size` must be >= 1, got {batch_size}", param="batch_size")
    if not (n >= 1 and 0 <= i < n):
        raise ConfigError(
            f"`part` must be i/n with 0 <= i < n, got {i}/{n} (e.g. 0/4 for the first of 4)", param="part"
        )
    nb = math.ceil(num_sequences / batch_size)
    b0, b1 = (i * nb) // n, ((i + 1) * nb) // n
    return min(b0 * batch_size, num_sequences), min(b1 * batch_size, num_sequences)
