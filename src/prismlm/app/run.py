"""``Run``: a run folder opened once — model, tokenizer, identity, shards, index, cache, interventions.

Every operation of the application layer (``prismlm.app``) takes a ``Run``. Opening resolves the checkpoint
(``RUN`` or ``RUN/checkpoints/step-N``), its suppression set and the device; the derived artifacts (token
shards, prototype index, attribution cache) are opened lazily, checked against the checkpoint, and kept.
Interventions (suppression sets, controllers, scaling) are values held by the run and applied only inside
``with run.intervened():`` — the model itself is never changed for good.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import torch

from prismlm.config import RunConfig
from prismlm.control.suppress import CHECKPOINT_FILE, SuppressionSet
from prismlm.data.shards import ShardSet, load_shards, prepare_from_config
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import ArtifactError, ConfigError, PrismError, ShardError, named
from prismlm.model import Intervention, PrismLM
from prismlm.model.generation import GREEDY, Sampling
from prismlm.model.interventions import MODES_HELP, RESIDUAL_MODES
from prismlm.train.checkpoint import Checkpoint, load_checkpoint
from prismlm.train.distributed import resolve_device
from prismlm.train.state import autocast_for

if TYPE_CHECKING:
    from prismlm.explain.index import PrototypeIndex
    from prismlm.tda.cache import AttributionCache
    from prismlm.tda.search import SearchIndex

StageFn = Callable[[str, int, int | None], None]
"""Called as ``on_stage(stage, i, n)`` when stage i of n of a multi-stage operation starts. Progress
within a stage goes through ``prismlm.progress`` (``progress=`` arguments): the application layer never
prints."""


def no_stages(stage: str, i: int, n: int | None) -> None:
    """The default stage callback: report nothing."""


def require(ok: bool, name: str, rule: str, value: object, *, also: tuple[str, ...] = ()) -> None:
    """``ConfigError`` "`NAME` must be RULE, got VALUE" unless ``ok``: the range check of every numeric option.
    ``name`` is the parameter's name (``top_n``), carried as the error's ``param`` with ``also``, the other
    parameters ``rule`` names (as ``named(p)``): a front end spells them its own way (the CLI as ``--top-n``)."""
    if not ok:
        raise ConfigError(f"{named(name)} must be {rule}, got {value!r}", param=(name, *also))


Stamp = tuple[int, ...] | None
"""What ``_stamp`` reads off an artifact's manifest."""


def _stamp(manifest: Path) -> Stamp:
    """(inode, size, mtime, ctime) of an artifact's manifest, or None: every build writes a new manifest
    (an atomic rename: a new inode), so a changed stamp means the artifact was rebuilt."""
    try:
        st = manifest.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


A = TypeVar("A")


class Opened(NamedTuple, Generic[A]):
    """An artifact a ``Run`` opened, with its manifest's stamp then (``_stamp``; None where not tracked)."""

    artifact: A
    stamp: Stamp = None


@dataclass
class OpenedArtifacts(Generic[A]):
    """The artifacts of one kind (indexes, caches, search sidecars) a ``Run`` has opened, by folder."""

    by_folder: dict[Path, Opened[A]] = field(default_factory=dict)

    def get(self, folder: Path) -> Opened[A] | None:
        return self.by_folder.get(folder)

    def keep(self, folder: Path, artifact: A, stamp: Stamp = None) -> A:
        self.by_folder[folder] = Opened(artifact, stamp)
        return artifact

    def drop(self, folder: Path) -> None:
        self.by_folder.pop(folder, None)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, what: str) -> None:
    """``ConfigError`` naming ``what`` when ``text`` holds a lone surrogate (a JSON ``\\udcff`` escape, or
    undecodable bytes): such a string cannot be encoded, so no answer about it could be sent back."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise ConfigError(
            f"{what} holds a lone surrogate (U+{ord(m.group()):04X} at character {m.start()}), "
            "which is not Unicode text",
            fix="send valid Unicode (UTF-8) text",
        )


def writable_folder(path: Path, option: str = "out") -> Path:
    """``path`` created (with its parents) if it is not there: a folder that cannot be created (``/proc/x``,
    a read-only parent, a file in the way) is a ``ConfigError`` naming ``option`` instead of a traceback
    from deep inside the writer."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{named(option)} {path}: cannot create this folder ({e.strerror or e})",
            fix=f"give {named(option)} a folder path you can write",
            path=path,
            param=option,
        ) from None
    return path


def open_device(spec: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda``, ``cuda:1`` → a device; ``PrismError`` for one that is not there. Under
    ``torchrun``, ``auto`` and ``cuda`` mean this process's GPU (``LOCAL_RANK``)."""
    try:
        return resolve_device(spec, int(os.environ.get("LOCAL_RANK", "0")))
    except (RuntimeError, ValueError) as e:
        raise PrismError(
            f"`device` {spec!r}: {e.message if isinstance(e, PrismError) else e}",
            fix="use `device` cpu or auto",
            param="device",
        ) from e


def resolve_suppression(
    checkpoint: Checkpoint, suppress: str | Path | None, residual: str = "auto"
) -> SuppressionSet | None:
    """``auto``: the checkpoint's own ``suppression.json`` if it has one; ``none``/``None``: nothing; else a
    file. The set is checked against the checkpoint (bank size, model hash). ``residual``: ``auto`` (the
    mode the set records), ``keep``, ``project`` or ``mean`` (overrides it; ``ConfigError`` when there is no set)."""
    return with_residual_mode(_suppression_set(checkpoint, suppress), residual)


def with_residual_mode(sset: SuppressionSet | None, residual: str = "auto") -> SuppressionSet | None:
    """``sset`` with the residual mode ``residual`` (``auto``: its own; ``keep``; ``project``; ``mean``;
    ``contrast``);
    ``ConfigError`` for another value, or for an explicit mode without a set (the mode would be silently ignored)."""
    mode = str(residual).lower()
    if mode not in ("auto", *RESIDUAL_MODES):
        raise ConfigError(
            f"{named('suppress_residual')} {residual!r} is not a residual mode",
            fix=f"use 'auto' (the suppression set's own mode), 'keep' (remove the slices only), {MODES_HELP}",
            param="suppress_residual",
        )
    if sset is None and mode != "auto":
        raise ConfigError(
            f"{named('suppress_residual')} {mode} needs a suppression set, and none is applied",
            fix=f"name one with {named('suppress')} FILE (from `prism concept`), or leave "
            f"{named('suppress_residual')} at auto",
            param=("suppress_residual", "suppress"),
        )
    if sset is not None and mode != "auto" and mode != sset.residual:
        sset = dataclasses.replace(sset, residual=mode)
    return sset


def _suppression_set(checkpoint: Checkpoint, suppress: str | Path | None) -> SuppressionSet | None:
    if suppress is None or str(suppress).lower() == "none":
        return None
    if str(suppress).lower() == "auto":
        f = checkpoint.path / CHECKPOINT_FILE
        if not f.exists():
            return None
        sset = SuppressionSet.load(f)
    else:
        sset = SuppressionSet.load(suppress)
    sset.check(checkpoint.model, checkpoint.manifest.get("model_sha256"))
    return sset


@dataclass
class Run:
    """A trained run, opened once. Build with ``Run.open(path)``."""

    path: Path
    """What the user named: a run folder or a checkpoint folder."""
    checkpoint: Checkpoint
    """The loaded checkpoint (model in eval mode on ``device``)."""
    device: torch.device
    suppression: SuppressionSet | None = None
    """The suppression set applied by default (the checkpoint's own or ``--suppress FILE``)."""
    interventions: tuple[Intervention, ...] = ()
    """Every intervention applied inside ``intervened()``, the suppression set's first."""
    _shards_at: dict[Path, ShardSet] = field(default_factory=dict, repr=False)
    """Opened shards by their resolved folder (asked for as ``shards_dir``, or opened another way)."""
    _shards_recorded: dict[str | None, ShardSet] = field(default_factory=dict, repr=False)
    """Shards opened for an artifact, by the root it recorded (each is opened once)."""
    _shards_from_config: ShardSet | None = field(default=None, repr=False)
    """The shards prepared (reused) from the run's data config, once."""
    _indexes: OpenedArtifacts[PrototypeIndex] = field(default_factory=OpenedArtifacts, repr=False)
    _caches: OpenedArtifacts[AttributionCache] = field(default_factory=OpenedArtifacts, repr=False)
    """With the manifest stamp of each: a cache rebuilt since (a new manifest) is re-opened."""
    _searches: OpenedArtifacts[SearchIndex] = field(default_factory=OpenedArtifacts, repr=False)

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        suppress: str | Path | None = "auto",
        interventions: tuple[Intervention, ...] = (),
        suppress_residual: str = "auto",
    ) -> Run:
        """Load the checkpoint of ``path`` on ``device`` with its suppression set (``auto``: the
        checkpoint's own, ``none``, or a FILE) and any further ``interventions``. ``suppress_residual``:
        ``auto`` (the set's recorded mode), ``keep`` or ``project`` (see ``resolve_suppression``)."""
        dev = open_device(device)
        ckpt = load_checkpoint(path, device=dev)
        ckpt.model.eval()
        sset = resolve_suppression(ckpt, suppress, suppress_residual)
        ivs = ((sset.intervention(),) if sset is not None else ()) + tuple(interventions)
        return cls(path=Path(path), checkpoint=ckpt, device=dev, suppression=sset, interventions=ivs)

    # ----- what the run is ---------------------------------------------------------------------------------
    @property
    def model(self) -> PrismLM:
        return self.checkpoint.model

    @property
    def config(self) -> RunConfig:
        return self.checkpoint.config

    @property
    def identity(self) -> str | None:
        """The checkpoint's model hash (``model_sha256`` of its manifest): what artifacts are tied to."""
        return self.checkpoint.manifest.get("model_sha256")

    @property
    def step(self) -> int | None:
        return self.checkpoint.manifest.get("step")

    @property
    def folder(self) -> Path:
        """The run folder (``RUN/checkpoints/step-N`` → ``RUN``); a bare checkpoint is its own."""
        p = self.checkpoint.path
        return p.parent.parent if p.parent.name == "checkpoints" else self.path

    @property
    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.require_tokenizer()

    def prism_model(self, what: str = "this operation") -> PrismLM:
        """The model, or ``ModelError`` if it is the dense baseline (no prototypes)."""
        from prismlm.errors import ModelError

        if not self.model.is_prism:
            raise ModelError(
                f"{self.checkpoint.path} is a dense baseline: {what} needs a PRISM model (one with a prototype head)"
            )
        return self.model

    def autocast(self) -> torch.autocast | None:
        """The run's autocast context (bf16 on GPU by default, per ``train.dtype``), or ``None``."""
        return autocast_for(self.config, self.device)

    @contextmanager
    def intervened(self, *extra: Intervention) -> Iterator[PrismLM]:
        """``with run.intervened() as model:`` — the model with the run's interventions (and ``extra``
        ones, e.g. a controller given to one operation) applied; restored on exit."""
        with self.model.intervene(*self.interventions, *extra) as m:
            yield m

    # ----- chat ---------------------------------------------------------------------------------------------
    def chat_prompt(self, message: str, system: str | None = None) -> str:
        """The prompt of a one-message chat: ``message`` as the user's turn (after ``system``, the system prompt,
        when given), written with the run's chat template, the assistant's turn opened. ``ModelError`` naming
        the run when it has no template."""
        from prismlm.errors import ModelError

        tok = self.tokenizer
        if not tok.chat_template:
            raise ModelError(
                f"the run {self.path} has no chat template (its tokenizer {tok.name!r} came without "
                "one), so a chat message cannot be written as a prompt",
                fix="pass the text itself instead of a chat message, or retrofit a chat model "
                "(e.g. prism retrofit --from smollm2-135m-instruct)",
            )
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        return tok.apply_chat_template(turns, add_generation_prompt=True)

    @torch.no_grad()
    def chat_ids(self, prompt_ids: list[int], tokens: int = 64, sampling: Sampling = GREEDY) -> list[int]:
        """The answer's ids after ``prompt_ids`` (a chat prompt), with the run's interventions: at most
        ``tokens``, greedy unless told, up to and including the first end-of-turn token
        (``Tokenizer.end_of_turn_ids``)."""
        stops = set(self.tokenizer.end_of_turn_ids)
        x = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # (1, p)
        out: list[int] = []
        with self.intervened() as m:
            for _, nxt in m.generate_steps(x, tokens, sampling, generator=sampling.generator(self.device)):
                out.append(int(nxt[0, 0]))
                if out[-1] in stops:
                    break
        return out

    def chat(self, message: str, *, system: str | None = None, tokens: int = 64, sampling: Sampling = GREEDY) -> str:
        """The model's answer to a chat ``message`` (after ``system``): written with the run's chat template,
        generated greedily (unless ``sampling`` says otherwise) up to the end-of-turn token, which is cut."""
        ids = self.chat_ids(self.tokenizer.encode(self.chat_prompt(message, system)), tokens, sampling)
        if ids and ids[-1] in self.tokenizer.end_of_turn_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    # ----- derived artifacts, opened lazily and checked against the checkpoint ------------------------------
    def forget(self, path: Path) -> None:
        """Drop an opened index or cache at ``path`` (after rebuilding it), so the next call re-reads it."""
        for opened in (self._indexes, self._caches, self._searches):
            opened.drop(path)

    def shards(self, shards_dir: Path | None = None, recorded_root: str | None = None) -> ShardSet:
        """The token shards the run was trained on: ``shards_dir``, else the folder an artifact recorded
        (``recorded_root``), else prepared (reused) from the run's data config. Refused (``ShardError``)
        if their key differs from the checkpoint's."""
        asked = Path(shards_dir).resolve() if shards_dir is not None else None
        known = self._shards_at.get(asked) if asked is not None else self._shards_recorded.get(recorded_root)
        if known is not None:
            return known
        if asked is None and self._shards_from_config is not None:  # already prepared from the data config
            return self._shards_from_config
        recorded = self.checkpoint.manifest.get("data")
        want = recorded.get("key") if recorded else None
        shards: ShardSet | None = None
        if shards_dir is not None:
            shards = load_shards(shards_dir)
        else:
            if recorded_root and Path(recorded_root).exists():
                try:
                    shards = load_shards(recorded_root)
                except ShardError:
                    shards = None
            if shards is None:
                shards = prepare_from_config(self.config.data, show_progress=False)
                self._shards_from_config = shards
        if want is not None and shards.manifest["key"] != want:
            raise ShardError(
                f"token shards {shards.root} (key {shards.manifest['key'][:16]}…) are not the ones "
                f"checkpoint {self.checkpoint.path} was trained on (key {want[:16]}…)",
                fix="pass `shards` with the training shards",
                param="shards",
            )
        if asked is not None:
            self._shards_at[asked] = shards
        else:
            self._shards_recorded[recorded_root] = shards
        self._shards_at.setdefault(Path(shards.root).resolve(), shards)
        return shards

    def index(
        self, index_dir: Path | None = None, shards_dir: Path | None = None, *, required: bool = False
    ) -> PrototypeIndex | None:
        """The prototype index (``index_dir`` or ``RUN/index``) checked against the checkpoint, shards
        attached; ``None`` if there is none and it is not ``required`` (then ``ArtifactError``)."""
        from prismlm.explain.index import PrototypeIndex

        path = index_dir or self.folder / "index"
        opened = self._indexes.get(path)
        if opened is not None:
            return opened.artifact
        if not (path / "manifest.json").exists():
            if required or index_dir is not None:
                raise ArtifactError(f"no prototype index at {path}", fix=f"prism index {self.path}")
            return None
        idx = PrototypeIndex.load(path, model_sha256=self.identity)
        idx.attach(self.shards(shards_dir, idx.manifest.get("shards_root")))
        return self._indexes.keep(path, idx)

    def cache(self, cache_dir: Path | None = None, shards_dir: Path | None = None) -> AttributionCache:
        """The attribution cache (``cache_dir`` or ``RUN/attribution-cache``) checked against the
        checkpoint and the shards."""
        from prismlm.tda.cache import AttributionCache

        path = cache_dir or self.folder / "attribution-cache"
        stamp = _stamp(path / "manifest.json")
        opened = self._caches.get(path)
        if opened is not None:
            if opened.stamp == stamp:
                return opened.artifact
            self.forget(path)  # rebuilt (or removed) since it was opened: its manifest is another file now
            self.forget(path / "search")  # its search sidecar belonged to the old cache
        if not (path / "manifest.json").exists():
            raise ArtifactError(
                f"no attribution cache at {path}",
                fix=f"prism attribute-cache {self.path} (or use `method` full)",
                param="method",
            )
        cache = AttributionCache.load(path, model_sha256=self.identity)
        cache.check(shards=self.shards(shards_dir, cache.manifest.get("shards_root")))
        return self._caches.keep(path, cache, stamp)

    def search(
        self, cache_dir: Path | None = None, shards_dir: Path | None = None, *, required: bool = False
    ) -> SearchIndex | None:
        """The approximate-search sidecar of the attribution cache (``CACHE/search``), checked against that
        cache; ``None`` if there is none and it is not ``required`` (then ``ArtifactError``)."""
        from prismlm.tda.search import SearchIndex

        cache = self.cache(cache_dir, shards_dir)
        assert cache.path is not None  # a loaded cache knows its folder
        path = cache.path / "search"
        opened = self._searches.get(path)
        if opened is not None:
            return opened.artifact
        if not (path / "manifest.json").exists():
            if required:
                raise ArtifactError(
                    f"no search index at {path}",
                    fix=f"prism attribute-search {self.path}"
                    if cache_dir is None
                    else f"prism attribute-search {self.path} --cache {cache_dir}",
                )
            return None
        return self._searches.keep(path, SearchIndex.load(path, cache))
