"""The prototype index artifact: ``PrototypeIndex`` (tables, statistics, snippets, labels) and its folder.

A folder holds ``index.safetensors`` (tensors) and ``manifest.json`` (kind, format version, the
checkpoint's ``model_sha256``, the shards' key, settings, covered sequences). Loading it for another
checkpoint or corpus raises ``ArtifactMismatch`` naming both hashes; a loaded index is immutable, so its
decoded neighbours are cached. Built by ``prismlm.explain.index.build``; see docs/architecture.md.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from prismlm.artifacts import (
    atomic_dir,
    check_provenance,
    file_records,
    merge_ranges,
    reading,
    verify_files,
)
from prismlm.errors import ArtifactCorrupt, ArtifactError, UnknownPrototypeError
from prismlm.eval.faithfulness import FaithfulnessAccumulator
from prismlm.eval.metrics import coverage_metrics
from prismlm.explain.activation_sample import ActivationSample
from prismlm.explain.index.snippets import Neighbour, decode_snippets

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.tokenizer import Tokenizer

__all__ = [
    "FORMAT_VERSION",
    "IndexManifest",
    "KIND",
    "LABELS_FILE",
    "MANIFEST_FILE",
    "NO_OFFSET",
    "TENSORS_FILE",
    "LabelEntry",
    "Labels",
    "PrototypeIndex",
    "PrototypeStats",
]

FORMAT_VERSION = 1
KIND = "prismlm-prototype-index"
TENSORS_FILE = "index.safetensors"
MANIFEST_FILE = "manifest.json"
LABELS_FILE = "labels.json"
NO_OFFSET = -1  # empty slot of the (K, N) table (similarity -inf): fewer than N tokens seen


class PrototypeStats(TypedDict):
    """``PrototypeIndex.stats(i)``: one prototype's activation statistics over the indexed tokens."""

    id: int
    count: int
    """Tokens where it is active."""
    frequency: float
    """count / indexed tokens."""
    mean_activation: float
    """Mean of its non-zero activations (0.0 when it never fires)."""
    max_similarity: float
    """Similarity of its nearest context (-inf: none seen)."""
    histogram: list[int]
    """(bins,) counts of its non-zero activations on equal bins of [0, 1]."""
    bins: int


class LabelEntry(TypedDict, total=False):
    """A prototype's entry of ``labels.json`` (``prismlm.explain.labels``)."""

    label: str
    category: str
    """One of ``prismlm.explain.labels.CATEGORIES``."""
    quality: float
    """How often one of the tokens the label names (those the prototype pushes most) is the next token where
    the prototype fires, in [0, 1] (rule labels with the model's signatures)."""
    evidence: dict[str, object]
    """What the labeller based it on (its own record, passed through: counts, context words, ``labeller``…)."""


IndexManifest = dict[str, Any]  # Any: a JSON record whose fields (see ``manifest``) are read with int()/list()
"""``manifest.json`` of an index: kind, format_version, model_sha256, shard_key, covered, tokens, …"""

Labels = dict[int, LabelEntry]
"""Prototype id → its ``labels.json`` entry."""


@dataclass
class PrototypeIndex:
    """Per-prototype neighbourhoods and activation statistics over (part of) a training shard."""

    top_sim: torch.Tensor
    """(K, N) float32 (float64 for a float64 model): similarities of each prototype's N nearest contexts, descending (-inf = empty)."""
    top_offset: torch.Tensor
    """(K, N) int64: their global token offsets (-1 = empty); ties ordered by offset ascending."""
    counts: torch.Tensor
    """(K,) int64: tokens where the prototype is active (in the top-k with a > 0)."""
    act_sum: torch.Tensor
    """(K,) float64: sum of its activations over those tokens."""
    hist: torch.Tensor
    """(K, bins) int64: histogram of its non-zero activations on ``bins`` equal bins of [0, 1]."""
    manifest: IndexManifest
    """kind, format_version, model_sha256, shard_key, split, top_n, num_prototypes, block_size, bins,
    batch_size, universe, target, covered, tokens, token_max_cos_sum, residual_share_sum, created…"""
    sample: ActivationSample | None = field(default=None, compare=False)
    """Per prototype a uniform sample of ``manifest["sample_size"]`` of its firings (offset, activation):
    ``prismlm.explain.activation_sample``. None in an index written before it (or ``sample_size=0``)."""
    shards: ShardSet | None = field(default=None, repr=False, compare=False)
    """The ``ShardSet`` the offsets point into (needed for snippets)."""
    tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)
    """Decodes the snippets (default: the attached shards' tokenizer)."""
    path: Path | None = field(default=None, compare=False)
    """The folder the index was loaded from or saved to (None: in memory)."""
    snippet_cache_size: int = field(default=4096, repr=False, compare=False)
    """Most neighbour lists kept decoded, one per (prototype, n, before, after, shards) — an LRU (see
    ``neighbours``); 0 disables the cache."""
    _snippets: OrderedDict[tuple[int, ...], tuple[Neighbour, ...]] = field(
        default_factory=OrderedDict, init=False, repr=False, compare=False
    )
    _stat_rows: dict[int, tuple[int, float, float, tuple[int, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _cache_state: tuple[tuple[object, ...], tuple[int, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _pinned: dict[int, object] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _labels: tuple[tuple[int, ...], Labels] | None = field(default=None, init=False, repr=False, compare=False)

    lenient_labels: bool = field(default=False, init=False, repr=False, compare=False)
    """A corrupt labels.json reads as no labels (its error kept in ``labels_error``) instead of raising:
    the explorer serves on and reports it."""
    labels_error: str | None = field(default=None, init=False, repr=False, compare=False)
    """Why ``labels.json`` could not be read, with ``lenient_labels``; else None."""

    _CACHES = ("_snippets", "_stat_rows", "_cache_state", "_pinned", "_lock", "_labels")

    def __getstate__(self) -> dict[str, object]:  # copy/pickle: without the caches (and the lock)
        return {k: v for k, v in self.__dict__.items() if k not in self._CACHES}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._snippets, self._stat_rows, self._pinned = OrderedDict(), {}, {}
        self._cache_state, self._labels, self._lock = None, None, threading.Lock()

    # ----- sizes and metrics -------------------------------------------------------------------------
    @property
    def num_prototypes(self) -> int:
        return int(self.top_sim.shape[0])

    @property
    def top_n(self) -> int:
        return int(self.top_sim.shape[1])

    @property
    def tokens(self) -> int:
        return int(self.manifest["tokens"])

    @property
    def complete(self) -> bool:
        """True when the covered sequences are the whole target range (nothing left to resume)."""
        return merge_ranges(self.manifest["covered"]) == [list(self.manifest["target"])]

    @property
    def covers_all(self) -> bool:
        """True when every sequence of ``[0, universe)`` is indexed (a whole index, not a part)."""
        return merge_ranges(self.manifest["covered"]) == [[0, int(self.manifest["universe"])]]

    def coverage(self) -> dict[str, float]:
        """R̄1, R2, dead prototypes and residual share over the indexed tokens (definitions of
        ``prismlm.eval.metrics.CoverageAccumulator``), and the prototype-only prediction's top-1 agreement, KL,
        pooled margin share and slice logit share over those of them a model forward scored
        (``prismlm.eval.faithfulness``; not over stored z; ``faithfulness_tokens``)."""
        n = self.tokens
        metrics = coverage_metrics(
            self.top_sim[:, 0], self.counts, self.manifest["token_max_cos_sum"], self.manifest["residual_share_sum"], n
        )
        if metrics and "faithfulness_sums" in self.manifest:
            metrics.update(FaithfulnessAccumulator.from_sums(self.manifest["faithfulness_sums"]).result())
        return {**metrics, "tokens": n} if metrics else {}

    def dead_prototypes(self) -> list[int]:
        return (self.counts == 0).nonzero().squeeze(1).tolist()

    def _check_id(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise UnknownPrototypeError(f"prototype id must be an integer, got {i!r}")
        if not 0 <= int(i) < self.num_prototypes:
            raise UnknownPrototypeError(
                f"unknown prototype id {int(i)}: this index has {self.num_prototypes} prototypes (ids 0–"
                f"{self.num_prototypes - 1})"
            )
        return int(i)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        """``_check_id`` of each id, with a fast path for plain in-range ints."""
        K = self.num_prototypes
        if all(type(i) is int and 0 <= i < K for i in ids):
            return list(ids)
        return [self._check_id(i) for i in ids]

    def stats(self, i: int) -> PrototypeStats:
        """Activation count, mean activation, frequency and histogram of prototype ``i``."""
        i = self._check_id(i)
        return self.stats_of([i])[i]

    def stats_of(self, ids: Sequence[int]) -> dict[int, PrototypeStats]:
        """``stats(i)`` for every id of ``ids`` (each validated). The table rows are read once per id and
        kept with the neighbour cache (same invalidation); the dicts are new at every call."""
        ids = self._check_ids(ids)
        with self._lock:
            self._validate_cache()
            rows = self._stat_rows
            missing = [i for i in ids if i not in rows]
        if missing:
            sel = torch.tensor(missing, dtype=torch.long)
            new = dict(
                zip(
                    missing,
                    zip(
                        self.counts[sel].tolist(),
                        self.act_sum[sel].tolist(),
                        self.top_sim[sel, 0].tolist(),
                        map(tuple, self.hist[sel].tolist()),
                    ),
                )
            )
            with self._lock:
                if self._stat_rows is rows:  # not invalidated meanwhile
                    rows.update(new)
            rows = {**rows, **new}
        tokens, bins = max(1, self.tokens), int(self.manifest["bins"])
        out: dict[int, PrototypeStats] = {}
        for i in ids:
            c, a, m, h = rows[i]
            out[i] = {
                "id": i,
                "count": c,
                "frequency": c / tokens,
                "mean_activation": a / c if c else 0.0,
                "max_similarity": m,
                "histogram": list(h),
                "bins": bins,
            }
        return out

    def _validate_cache(self) -> tuple[tuple[object, ...], tuple[int, ...]]:
        """The cache state for the current tables, attached shards and tokenizer; the caches are emptied
        when any of them changed (another object, or a tensor modified in place: its ``_version``).
        Call with ``_lock`` held."""
        objs = (self.top_sim, self.top_offset, self.counts, self.act_sum, self.hist, self.shards, self.tokenizer)
        versions = tuple(t._version for t in objs[:5])
        state = self._cache_state
        if state is None or state[1] != versions or any(a is not b for a, b in zip(state[0], objs)):
            self._snippets.clear()
            self._pinned.clear()
            self._stat_rows = {}
            self._cache_state = state = (objs, versions)
        return state

    # ----- neighbourhoods ----------------------------------------------------------------------------
    def neighbours(
        self, i: int, n: int | None = None, *, before: int = 12, after: int = 3, shards: ShardSet | None = None
    ) -> list[Neighbour]:
        """Prototype ``i``'s nearest training contexts (at most ``n``), with snippets when shards are
        attached: ``before`` tokens of context and ``after`` tokens after the marked target, clipped to
        the target's document.

        **Cache.** A loaded index is an immutable artifact, so decoded neighbour lists are kept per
        (prototype, n, before, after, shards, tokenizer) in an LRU of ``snippet_cache_size`` entries:
        repeated explanations do not decode the shards again. ``Neighbour`` is frozen, so the cached
        objects are shared safely (the list is new at every call). The whole cache is dropped when the
        tables change (``top_sim``, ``top_offset``, ``counts``, ``act_sum`` or ``hist`` replaced, or modified
        in place: their ``_version``) or other shards/tokenizer are attached, so it never serves the
        neighbours of other tables."""
        i = self._check_id(i)
        return self.neighbours_of([i], n, before=before, after=after, shards=shards)[i]

    def neighbours_of(
        self,
        ids: Sequence[int],
        n: int | None = None,
        *,
        before: int = 12,
        after: int = 3,
        shards: ShardSet | None = None,
    ) -> dict[int, list[Neighbour]]:
        """``neighbours(i, n, …)`` for every id of ``ids`` (each validated), with one cache look-up."""
        ids = self._check_ids(ids)
        shards = shards if shards is not None else self.shards
        tok = (self.tokenizer or shards.tokenizer) if shards is not None else None
        n_eff = self.top_n if n is None else max(0, min(int(n), self.top_n))
        before, after = max(0, int(before)), max(0, int(after))
        if self.snippet_cache_size <= 0:
            return {i: list(nbs) for i, nbs in self._neighbours(ids, n_eff, before, after, shards, tok).items()}
        sub = (n_eff, before, after, id(shards), id(tok))
        out: dict[int, list[Neighbour]] = {}
        missing = []
        with self._lock:
            state = self._validate_cache()
            cache = self._snippets
            for i in ids:
                hit = cache.get((i, *sub))
                if hit is None:
                    missing.append(i)
                else:
                    cache.move_to_end((i, *sub))
                    out[i] = list(hit)
        if not missing:
            return out
        new = self._neighbours(missing, n_eff, before, after, shards, tok)
        with self._lock:
            if self._cache_state is state:  # not invalidated meanwhile
                self._pinned[id(shards)], self._pinned[id(tok)] = shards, tok  # their ids stay unique while cached
                for i, nbs in new.items():
                    self._snippets[(i, *sub)] = nbs
                while len(self._snippets) > self.snippet_cache_size:
                    self._snippets.popitem(last=False)
        out.update((i, list(nbs)) for i, nbs in new.items())
        return out

    def _neighbours(
        self, ids: list[int], n: int, before: int, after: int, shards: ShardSet | None, tokenizer: Tokenizer | None
    ) -> dict[int, tuple[Neighbour, ...]]:
        """The first ``n`` neighbours of each prototype of ``ids``, decoded now (no cache)."""
        sel = torch.tensor(ids, dtype=torch.long)
        sims, offs = self.top_sim[sel, :n].tolist(), self.top_offset[sel, :n].tolist()
        for r, row in enumerate(offs):
            if NO_OFFSET in row:  # empty slots come last
                offs[r], sims[r] = row[: row.index(NO_OFFSET)], sims[r][: row.index(NO_OFFSET)]
        if shards is None or tokenizer is None:
            return {
                i: tuple(Neighbour(offset=int(o), similarity=float(s)) for s, o in zip(ss, oo))
                for i, ss, oo in zip(ids, sims, offs)
            }
        flat = decode_snippets(
            [o for row in offs for o in row], [s for row in sims for s in row], shards, tokenizer, before, after
        )
        out, j = {}, 0
        for i, row in zip(ids, offs):
            out[i] = tuple(flat[j : j + len(row)])
            j += len(row)
        return out

    def contexts(self, offsets: Sequence[int], *, before: int = 12, after: int = 3) -> list[Neighbour]:
        """The training contexts ending at these global offsets (e.g. ``sample.offset``), with snippets when
        shards are attached, marked as ``neighbours`` (the target after the context); ``similarity`` 0."""
        offs = [int(o) for o in offsets]
        tok = (self.tokenizer or self.shards.tokenizer) if self.shards is not None else None
        if self.shards is None or tok is None:
            return [Neighbour(offset=o, similarity=0.0) for o in offs]
        return decode_snippets(offs, [0.0] * len(offs), self.shards, tok, max(0, before), max(0, after))

    def clear_cache(self) -> None:
        """Drop the decoded neighbour snippets, the statistics rows and the parsed labels (rebuilt on
        demand)."""
        with self._lock:
            self._snippets.clear()
            self._pinned.clear()
            self._stat_rows = {}
            self._cache_state = None
            self._labels = None

    # ----- identity checks ---------------------------------------------------------------------------
    def check(
        self, *, model_sha256: str | None = None, shards: ShardSet | None = None, shard_key: str | None = None
    ) -> None:
        """Raise ``ArtifactMismatch`` unless the index was built from this model (``model_sha256``: a
        checkpoint's ``manifest["model_sha256"]``) and these shards (``shards`` or their ``shard_key``)."""
        if shards is not None:
            shard_key = shards.manifest["key"]
        check_provenance(
            self.manifest,
            what=f"prototype index{_where(self.path)}",
            rebuild="prism index",
            model_sha256=model_sha256,
            shard_key=shard_key,
        )

    def attach(self, shards: ShardSet) -> PrototypeIndex:
        """Attach the shards the offsets point into (checked against the manifest); returns self."""
        self.check(shards=shards)
        self.shards = shards
        self.tokenizer = self.tokenizer or shards.tokenizer
        return self

    # ----- persistence -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write ``index.safetensors`` + ``manifest.json`` atomically (a ``.tmp`` folder renamed into
        place; ``labels.json`` already in the folder is kept)."""
        path = Path(path)
        manifest = dict(self.manifest)
        manifest["covered"] = merge_ranges(manifest["covered"])
        manifest["complete"] = manifest["covered"] == [list(manifest["target"])]
        manifest["saved"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with atomic_dir(path) as tmp:
            save_file(
                {
                    "top_sim": self.top_sim.contiguous(),
                    "top_offset": self.top_offset.contiguous(),
                    "counts": self.counts.contiguous(),
                    "act_sum": self.act_sum.contiguous(),
                    "hist": self.hist.contiguous(),
                    **(self.sample.tensors() if self.sample is not None else {}),
                },
                str(tmp / TENSORS_FILE),
            )
            manifest["files"] = file_records(tmp, [TENSORS_FILE])
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
            if (path / LABELS_FILE).exists():
                shutil.copy2(path / LABELS_FILE, tmp / LABELS_FILE)
        self.path = path
        self.manifest = manifest
        return path

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        model_sha256: str | None = None,
        shards: ShardSet | None = None,
        shard_key: str | None = None,
    ) -> PrototypeIndex:
        """Open a saved index; with ``model_sha256`` and ``shards``/``shard_key`` it is checked against
        them (``ArtifactMismatch``), and ``shards`` are attached for snippets."""
        path = Path(path)
        if not (path / MANIFEST_FILE).exists() or not (path / TENSORS_FILE).exists():
            raise ArtifactError(
                f"{path} is not a prototype index (expected {MANIFEST_FILE} and {TENSORS_FILE}); "
                f"build one with `prism index RUN`"
            )
        with reading(path / MANIFEST_FILE, "prototype index manifest", fix="prism index RUN"):
            manifest = json.loads((path / MANIFEST_FILE).read_text())
        if manifest.get("kind") != KIND:
            raise ArtifactError(f"{path}/{MANIFEST_FILE}: kind {manifest.get('kind')!r}, expected {KIND!r}")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{path}: index format {manifest.get('format_version')!r}, this prismlm reads "
                f"{FORMAT_VERSION}; rebuild it with `prism index`"
            )
        verify_files(path, manifest.get("files"), what="prototype index", fix="rebuild it with `prism index RUN`")
        with reading(path / TENSORS_FILE, "prototype index", fix="prism index RUN"):
            t = load_file(str(path / TENSORS_FILE))
        idx = cls(
            top_sim=t["top_sim"],
            top_offset=t["top_offset"],
            counts=t["counts"],
            act_sum=t["act_sum"],
            hist=t["hist"],
            manifest=manifest,
            path=path,
            sample=ActivationSample.from_tensors(
                t, manifest["num_prototypes"], int(manifest.get("sample_size", 0)), str(path)
            ),
        )
        if tuple(idx.top_sim.shape) != (manifest["num_prototypes"], manifest["top_n"]):
            raise ArtifactError(f"{path}: tensor shapes {tuple(idx.top_sim.shape)} do not match the manifest")
        idx.check(model_sha256=model_sha256, shards=shards, shard_key=shard_key)
        if shards is not None:
            idx.attach(shards)
        return idx

    def labels(self) -> Labels:
        """``labels.json`` of this index's folder (prototype id → {label, category, evidence}), or {}.
        Parsed once and kept while the file stays the same (inode, size, modification and change times;
        labelling rewrites it); the dict returned is a new one each call."""
        if self.path is None:
            return {}
        f = self.path / LABELS_FILE
        try:
            st = f.stat()
        except FileNotFoundError:
            self.labels_error = None
            return {}
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)  # a rewrite (atomic: a new inode) shows
        cached = self._labels
        if cached is None or cached[0] != stamp:
            try:
                cached, self.labels_error = (stamp, _parse_labels(f)), None
            except ArtifactCorrupt as e:
                if not self.lenient_labels:
                    raise
                cached, self.labels_error = (stamp, {}), str(e)
            self._labels = cached
        return dict(cached[1])


def _parse_labels(f: Path) -> Labels:
    """``labels.json`` → {prototype id: {label, category, …}}; ``ArtifactCorrupt`` naming the file (and the
    command that rewrites it) for a torn or hand-broken one."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError("expected an object of prototype id → {label, category}")
        return {int(k): v for k, v in data.items()}
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ArtifactCorrupt(
            f"labels file {f} cannot be read ({type(e).__name__}: {e})",
            fix="rewrite it with `prism label RUN` (or delete it)",
            path=f,
        ) from None


def _where(path: Path | None) -> str:
    return f" {path}" if path is not None else ""
