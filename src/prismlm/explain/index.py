"""The prototype index (spec §3.1): every prototype's top-N nearest training contexts, in one pass.

One streaming pass of a trained model over its training shard records, for each of the K prototypes,

- its **neighbourhood**: the N training contexts with the highest ``cos(z_t, p_i)`` over *all* tokens
  (not only tokens where i is active — the R̄1 notion), as global token offsets and similarities;
- how often it is active (in a token's top-k with a > 0), the sum of its activations and a histogram of
  them (``bins`` fixed bins on [0, 1]);
- a uniform random sample of ``sample_size`` of the positions where it is active, with their activations
  (``prismlm.explain.activation_sample``: exact under merging and resume too);
- the coverage metrics of ``prismlm.eval.metrics`` over the indexed tokens: R̄1 = mean_i max_t cos
  (``top_sim[:, 0].mean()``), R2 = mean_t max_i cos, dead prototypes, residual share.

**Training contexts.** The trainer trains on aligned sequences ``shard.train.sequence(j, T)`` (tokens
``[j·T, j·T + T + 1)``). Position t of sequence j has hidden state z_t (context ``x_0..x_t`` of that
window) and target ``x_{t+1}``; the index stores the global offset ``j·T + t`` of the context's last
token (int64). ``shard.locate(offset + 1)`` gives the target's document and position.

**Memory** is O(K·N + chunk·K) plus O(K·bins + K·sample_size): independent of corpus size. The (tokens × K) cosine
matrix exists one chunk at a time.

**Exact merging.** Candidates are ordered by (similarity desc, offset asc) — a total order, because
offsets are unique — so the top-N of a union is the top-N of the top-Ns: ``merge(A, B)`` equals one pass
bit for bit, provided the similarities themselves are bit-identical. They are when the same sequences
go through the model in the same batches: batches always cover a fixed grid of sequence ids
``[b·B, (b+1)·B)`` (B = ``batch_size``) and parts are whole batches, so use the same ``batch_size`` for
the parts and the single pass. (With another batch size the similarities can differ in the last bit.)
The float sums behind R2 and the residual share add in a different order and agree to rounding.

**Parts and resume.** ``part=(i, n)`` indexes the i-th of n contiguous, batch-aligned slices of the
sequences ``[0, L)`` (``L = min(num_sequences, max_sequences)``); the index records the sequence ranges
it covers, so ``merge`` refuses overlapping parts and a resumed build continues after the last finished
batch (``checkpoint_every`` saves periodically).

**Artifact.** A folder with ``index.safetensors`` (tensors) and ``manifest.json`` (kind, format version,
the checkpoint's ``model_sha256``, the shards' key, split, top_n, K, T, covered sequences, tokens,
dates, prismlm version). Loading it for another checkpoint or corpus raises ``ArtifactMismatch``
naming both hashes.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from prismlm.artifacts import (
    atomic_dir,
    check_provenance,
    file_records,
    merge_ranges,
    model_identity,
    overlap,
    part_range,
    provenance,
    reading,
    verify_files,
    writes_folder,
)
from prismlm.data.tokenizer import Tokenizer as _Tokenizer
from prismlm.errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMismatch,
    ConfigError,
    ModelError,
    UnknownPrototypeError,
)
from prismlm.eval.metrics import active_prototypes, coverage_metrics, coverage_sums
from prismlm.explain.activation_sample import ActivationSample
from prismlm.model import PrismOutput, eval_mode
from prismlm.progress import Progress, Reporter
from prismlm.train.stored_z import StoredZ, backbone_identity

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.tokenizer import Tokenizer
    from prismlm.model import PrismLM

__all__ = [
    "FORMAT_VERSION",
    "Neighbour",
    "PrototypeIndex",
    "build_index",
    "merge_indexes",
    "part_range",
]

FORMAT_VERSION = 1
KIND = "prismlm-prototype-index"
TENSORS_FILE = "index.safetensors"
MANIFEST_FILE = "manifest.json"
LABELS_FILE = "labels.json"
_NO_OFFSET = -1  # empty slot of the (K, N) table (similarity -inf): fewer than N tokens seen


def _topn_merge(sim: torch.Tensor, off: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of (sim, off) candidates (K, M) → the top-n per row by (sim desc, offset asc), exactly.

    Two stable sorts: by offset ascending, then by similarity descending (ties keep offset order).
    """
    order = torch.argsort(off, dim=1, stable=True)
    sim, off = sim.gather(1, order), off.gather(1, order)
    order = torch.argsort(sim, dim=1, descending=True, stable=True)[:, :n]
    return sim.gather(1, order), off.gather(1, order)


def _chunk_topn(sim_t: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sim_t (K, M), columns in offset order → per row the top-n column indices by (sim desc, column asc).

    ``topk`` is fast but picks arbitrarily among equal values at the boundary (equal cosines do occur:
    identical contexts at position 0 of two sequences). Rows where the n-th value is tied beyond the
    cut are redone with a stable sort, so the result is exact.
    """
    n = min(n, sim_t.shape[1])
    vals, idx = sim_t.topk(n, dim=1)  # (K, n)
    tied = (sim_t >= vals[:, -1:]).sum(1) > n  # (K,)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        s, o = torch.sort(sim_t[rows], dim=1, descending=True, stable=True)
        vals[rows], idx[rows] = s[:, :n], o[:, :n]
    return vals, idx


@dataclass(frozen=True)
class Neighbour:
    """One training context of a prototype's neighbourhood (immutable: a loaded index hands the same
    decoded neighbours to every caller, see ``PrototypeIndex.neighbours``)."""

    offset: int
    """Global token offset j·T + t of the context's last token in the training shard."""
    similarity: float
    """cos(z_t, p_i)."""
    doc_index: int | None = None
    """Index of the target token's document in the shard."""
    doc_id: str | None = None
    """That document's id."""
    position: int | None = None
    """Position of the target token (x_{t+1}) in its document."""
    target_id: int | None = None
    """The next token x_{t+1} the context predicted in training."""
    target: str | None = None
    """Its text."""
    before: str = ""
    """Decoded context before the target (within the target's document)."""
    after: str = ""
    """Decoded text after the target."""

    @property
    def snippet(self) -> str:
        """Plain-text snippet with the target token marked: ``…context⟦target⟧after…``."""
        return f"{self.before}⟦{self.target}⟧{self.after}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "similarity": self.similarity,
            "doc_index": self.doc_index,
            "doc_id": self.doc_id,
            "position": self.position,
            "target_id": self.target_id,
            "target": self.target,
            "before": self.before,
            "after": self.after,
            "snippet": self.snippet,
        }


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
    manifest: dict[str, Any]
    """kind, format_version, model_sha256, shard_key, split, top_n, num_prototypes, block_size, bins,
    batch_size, universe, target, covered, tokens, token_max_cos_sum, residual_share_sum, created…"""
    sample: ActivationSample | None = field(default=None, compare=False)
    """Per prototype a uniform sample of ``manifest["sample_size"]`` of its firings (offset, activation):
    ``prismlm.explain.activation_sample``. None in an index written before it (or ``sample_size=0``)."""
    shards: ShardSet | None = field(default=None, repr=False, compare=False)
    """The ``ShardSet`` the offsets point into (needed for snippets)."""
    tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)
    path: Path | None = field(default=None, compare=False)
    snippet_cache_size: int = field(default=4096, repr=False, compare=False)
    """Most neighbour lists kept decoded, one per (prototype, n, before, after, shards) — an LRU (see
    ``neighbours``); 0 disables the cache."""
    _snippets: OrderedDict[tuple[int, ...], tuple[Neighbour, ...]] = field(
        default_factory=OrderedDict, init=False, repr=False, compare=False
    )
    _stat_rows: dict[int, tuple[int, float, float, tuple[int, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _cache_state: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _pinned: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _labels: tuple[tuple[int, ...], dict[int, dict[str, Any]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    lenient_labels: bool = field(default=False, init=False, repr=False, compare=False)
    """A corrupt labels.json reads as no labels (its error kept in ``labels_error``) instead of raising:
    the explorer serves on and reports it."""
    labels_error: str | None = field(default=None, init=False, repr=False, compare=False)

    _CACHES = ("_snippets", "_stat_rows", "_cache_state", "_pinned", "_lock", "_labels")

    def __getstate__(self) -> dict[str, Any]:  # copy/pickle: without the caches (and the lock)
        return {k: v for k, v in self.__dict__.items() if k not in self._CACHES}

    def __setstate__(self, state: dict[str, Any]) -> None:
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
        ``prismlm.eval.metrics.CoverageAccumulator``)."""
        n = self.tokens
        metrics = coverage_metrics(
            self.top_sim[:, 0], self.counts, self.manifest["token_max_cos_sum"], self.manifest["residual_share_sum"], n
        )
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

    def stats(self, i: int) -> dict[str, Any]:
        """Activation count, mean activation, frequency and histogram of prototype ``i``."""
        i = self._check_id(i)
        return self.stats_of([i])[i]

    def stats_of(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
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
        out = {}
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

    def _validate_cache(self) -> tuple[Any, ...]:
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
            if _NO_OFFSET in row:  # empty slots come last
                offs[r], sims[r] = row[: row.index(_NO_OFFSET)], sims[r][: row.index(_NO_OFFSET)]
        if shards is None or tokenizer is None:
            return {
                i: tuple(Neighbour(offset=int(o), similarity=float(s)) for s, o in zip(ss, oo))
                for i, ss, oo in zip(ids, sims, offs)
            }
        flat = _snippets(
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
        return _snippets(offs, [0.0] * len(offs), self.shards, tok, max(0, before), max(0, after))

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

    def labels(self) -> dict[int, dict[str, Any]]:
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


def _parse_labels(f: Path) -> dict[int, dict[str, Any]]:
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


def _snippets(
    offsets: list[int], sims: list[float], shards: ShardSet, tokenizer: Tokenizer, before: int, after: int
) -> list[Neighbour]:
    """The neighbours at context offsets ``offsets`` of ``shards.train`` with their snippets: ``before``
    tokens up to the target, the target, ``after`` tokens after it, clipped to the target's document.
    Located, gathered and decoded for all offsets together."""
    if not offsets:
        return []
    shard = shards.train
    target = np.asarray(offsets, dtype=np.int64) + 1  # the target token follows the context's last token
    bad = target[(target < 0) | (target >= len(shard))]
    if bad.size:
        raise IndexError(f"token offset {int(bad[0])} out of range [0, {len(shard)})")
    docs = np.searchsorted(shard.doc_offsets, target, side="right") - 1  # shard.locate, for all at once
    start, end = shard.doc_offsets[docs], shard.doc_offsets[docs + 1]  # end includes the eot
    a, b = np.maximum(start, target - before), np.minimum(end, target + 1 + after)  # window [a, b) ∋ target
    lens = b - a
    first = np.cumsum(lens) - lens  # where each window starts in the gathered tokens
    gathered = np.asarray(
        shard.tokens[np.arange(int(lens.sum())) - np.repeat(first - a, lens)], dtype=np.int64
    ).tolist()  # one gather of every window
    pieces: list[list[int]] = []
    for f, n, k in zip(first.tolist(), lens.tolist(), (target - a).tolist()):
        toks = gathered[f : f + n]
        pieces += [toks[:k], toks[k : k + 1], toks[k + 1 :]]  # before, target, after
    texts = _decode_many(tokenizer, pieces)
    doc_ids = shard.doc_ids
    out = []
    for j, (o, s, d, t, st) in enumerate(zip(offsets, sims, docs.tolist(), target.tolist(), start.tolist())):
        out.append(
            Neighbour(
                offset=int(o),
                similarity=float(s),
                doc_index=d,
                doc_id=doc_ids[d] if d < len(doc_ids) else None,
                position=t - st,
                target_id=pieces[3 * j + 1][0],
                target=texts[3 * j + 1],
                before=texts[3 * j],
                after=texts[3 * j + 2],
            )
        )
    return out


def _decode_many(tokenizer: Tokenizer, seqs: list[list[int]]) -> list[str]:
    """``[tokenizer.decode(s) for s in seqs]``, in one call of the backend when the tokenizer is prismlm's
    ``Tokenizer`` (its ``decode`` is the backend's, special tokens kept)."""
    if isinstance(tokenizer, _Tokenizer) and type(tokenizer).decode is _Tokenizer.decode:
        return list(tokenizer.backend.decode_batch(seqs, skip_special_tokens=False))
    return [tokenizer.decode(s) for s in seqs]


# ----- building --------------------------------------------------------------------------------------
class _Builder:
    """Streaming state: the running (K, N) table and the O(K) statistics."""

    def __init__(
        self, K: int, n: int, bins: int, device: torch.device, dtype: torch.dtype = torch.float32, sample_size: int = 0
    ):
        self.K, self.n, self.bins = K, n, bins
        self.sample = ActivationSample.empty(K, sample_size, device) if sample_size else None
        self.top_sim = torch.full((K, n), -math.inf, device=device, dtype=dtype)
        self.top_off = torch.full((K, n), _NO_OFFSET, dtype=torch.long, device=device)
        self.counts = torch.zeros(K, dtype=torch.long, device=device)
        self.act_sum = torch.zeros(K, dtype=torch.float64, device=device)
        self.hist = torch.zeros(K * bins, dtype=torch.long, device=device)
        self.token_cos_sum = 0.0
        self.residual_sum = 0.0
        self.tokens = 0

    @classmethod
    def from_index(cls, idx: PrototypeIndex, device: torch.device) -> _Builder:
        b = cls(idx.num_prototypes, idx.top_n, int(idx.manifest["bins"]), device, idx.top_sim.dtype)
        b.top_sim, b.top_off = idx.top_sim.to(device), idx.top_offset.to(device)
        b.counts, b.act_sum = idx.counts.to(device), idx.act_sum.to(device)
        b.hist = idx.hist.to(device).reshape(-1)
        b.sample = idx.sample.to(device) if idx.sample is not None else None
        b.token_cos_sum = float(idx.manifest["token_max_cos_sum"])
        b.residual_sum = float(idx.manifest["residual_share_sum"])
        b.tokens = int(idx.manifest["tokens"])
        return b

    @torch.no_grad()
    def update(self, out: PrismOutput, p_unit: torch.Tensor, base_offsets: torch.Tensor, chunk: int) -> None:
        """One model output over B aligned sequences; ``base_offsets`` (B,) = j·T of each sequence."""
        z = out.hidden  # (B, T, d)
        B, T, d = z.shape
        offsets = (base_offsets[:, None] + torch.arange(T, device=z.device)[None, :]).reshape(-1)  # (B·T,)
        z_unit = F.normalize(z.reshape(B * T, d).to(p_unit.dtype), dim=-1)  # (B·T, d)
        for s in range(0, B * T, chunk):  # offsets ascend along rows: column index order = offset order
            sim_t = p_unit @ z_unit[s : s + chunk].T  # (K, n_chunk) — the only K × tokens matrix
            vals, cols = _chunk_topn(sim_t, self.n)  # (K, ≤N)
            cand_sim = torch.cat([self.top_sim, vals.to(self.top_sim.dtype)], dim=1)  # (K, N + ≤N)
            cand_off = torch.cat([self.top_off, offsets[s : s + chunk][cols]], dim=1)
            self.top_sim, self.top_off = _topn_merge(cand_sim, cand_off, self.n)
        if self.sample is not None:
            self.sample.add(out, offsets)
        ids, act = active_prototypes(out)  # (n_active,) each
        act = act.float()
        self.counts += torch.bincount(ids, minlength=self.K)
        self.act_sum.index_add_(0, ids, act.double())
        b = (act * self.bins).long().clamp_(0, self.bins - 1)
        self.hist += torch.bincount(ids * self.bins + b, minlength=self.K * self.bins)
        token_cos, residual, n = coverage_sums(out)
        self.token_cos_sum += token_cos
        self.residual_sum += residual
        self.tokens += n

    def to_index(self, manifest: dict[str, Any]) -> PrototypeIndex:
        manifest = {
            **manifest,
            "tokens": self.tokens,
            "token_max_cos_sum": self.token_cos_sum,
            "residual_share_sum": self.residual_sum,
        }
        return PrototypeIndex(
            top_sim=self.top_sim.cpu(),
            top_offset=self.top_off.cpu(),
            counts=self.counts.cpu(),
            act_sum=self.act_sum.cpu(),
            hist=self.hist.reshape(self.K, self.bins).cpu(),
            manifest=manifest,
            sample=self.sample.to("cpu") if self.sample is not None else None,
        )


@writes_folder("out")  # one writer per index folder: a second build is refused by name
def build_index(
    model: PrismLM,
    shards: ShardSet,
    *,
    top_n: int = 32,
    batch_size: int = 8,
    max_sequences: int | None = None,
    part: tuple[int, int] = (0, 1),
    resume_from: str | Path | PrototypeIndex | None = None,
    out: str | Path | None = None,
    checkpoint_every: int = 0,
    bins: int = 20,
    chunk_size: int | None = None,
    model_sha256: str | None = None,
    device: str | torch.device | None = None,
    autocast: torch.autocast | None = None,
    progress: Progress = True,
    stop_after_batches: int | None = None,
    stored_z: StoredZ | None = None,
    sample_size: int = 64,
) -> PrototypeIndex:
    """One streaming pass of ``model`` over ``shards.train``; returns a ``PrototypeIndex``.

    ``model``: a PRISM ``PrismLM``; ``model_sha256``: its identity recorded in the index (pass the
    checkpoint's ``manifest["model_sha256"]``; None: a hash of the weights, ``model_identity``). ``part=(i, n)``: index only the
    i-th of n batch-aligned slices of the first ``max_sequences`` sequences; ``prism index-merge``
    combines the parts. ``resume_from``: a partial index (or its folder) to continue after its last
    finished batch. ``out`` + ``checkpoint_every``: save there every that many batches (and at the end).
    ``stop_after_batches``: stop early (simulates an interruption in tests).
    ``stored_z``: read the hidden states from this store (``prismlm.train.stored_z``, e.g. a retrofit's
    ``RUN/stored-z``) instead of running the backbone: only the prototype layer runs. It must hold z of this
    model's backbone over these shards' training split at this block size, covering the indexed sequences
    (``ArtifactMismatch`` otherwise). From a float32 store made with the same batch grid the index equals the
    model's pass bit for bit (tested); from float16 the similarities carry z's rounding.
    ``sample_size``: S, the firings kept per prototype in a uniform sample (``activation_sample``); 0: none.
    A resumed build keeps the partial index's S (none for one written before samples).
    """
    net = model
    if net.prototypes is None:
        raise ModelError("a prototype index needs a PRISM model; this is the dense baseline (it has no prototypes)")
    if top_n < 1:
        raise ConfigError(f"top_n must be >= 1, got {top_n} (option --top-n)")
    if sample_size < 0:
        raise ConfigError(f"sample_size must be >= 0, got {sample_size}")
    protos = net.prototypes
    ident = model_sha256 or model_identity(net)
    dev = torch.device(device) if device is not None else next(net.parameters()).device
    T = net.config.block_size
    K = protos.num_prototypes
    n_all = shards.train.num_sequences(T)
    universe = n_all if max_sequences is None else min(n_all, max_sequences)
    if universe < 1:
        raise ArtifactError(f"the training split has no complete sequence of {T + 1} tokens to index")

    if stored_z is not None:
        _check_stored_z(stored_z, net, shards, universe)
    if resume_from is not None:
        prev = resume_from if isinstance(resume_from, PrototypeIndex) else PrototypeIndex.load(resume_from)
        prev.check(model_sha256=ident, shards=shards)
        m = prev.manifest
        if (m["top_n"], m["universe"], m["bins"]) != (top_n, universe, bins) or list(m["part"]) != list(part):
            raise ArtifactError(
                f"cannot resume: the partial index has top_n={m['top_n']}, max sequences {m['universe']}, "
                f"bins={m['bins']}, part {m['part'][0]}/{m['part'][1]}; this build asks for top_n={top_n}, "
                f"{universe}, bins={bins}, part {part[0]}/{part[1]}"
            )
        batch_size = int(m["batch_size"])  # the batch grid must stay the same
        _check_resume_sample(m, sample_size)
        builder = _Builder.from_index(prev, dev)
        start, stop = m["target"]
        covered = merge_ranges(m["covered"])
        done_to = covered[-1][1] if covered else start
        if covered and covered != [[start, done_to]]:
            raise ArtifactError(
                f"cannot resume: covered ranges {covered} are not one prefix of the target {m['target']}"
            )
        manifest = dict(m)
    else:
        start, stop = part_range(universe, batch_size, part)
        done_to = start
        # similarities are stored in float32, or float64 for a float64 model (exactness tests)
        sim_dtype = torch.promote_types(protos.weight.dtype, torch.float32)
        builder = _Builder(K, top_n, bins, dev, sim_dtype, sample_size)
        manifest = {
            "kind": KIND,
            "format_version": FORMAT_VERSION,
            "model_sha256": ident,
            "shard_key": shards.manifest["key"],
            "shards_root": str(Path(shards.root).resolve()),
            "split": "train",
            "top_n": top_n,
            "num_prototypes": K,
            "block_size": T,
            "top_k": protos.cfg.top_k,
            "bins": bins,
            "sample_size": sample_size,
            "batch_size": batch_size,
            "universe": universe,
            "part": list(part),
            "target": [start, stop],
            "covered": [],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **provenance(),
        }
    manifest["hidden_from"] = "model" if stored_z is None else f"stored-z {stored_z.manifest['dtype']}"
    chunk = chunk_size or protos.chunk_size_for(batch_size * T, dev)
    p = protos.weight.detach()
    p_unit = F.normalize(p.to(torch.promote_types(p.dtype, torch.float32)), dim=-1).to(dev)  # (K, d)
    total_tokens = (stop - start) * T
    bar = Reporter(progress, "index", total_tokens, unit="tok", initial=(done_to - start) * T)
    t0, tok0 = time.perf_counter(), 0
    batches = 0
    elapsed = 0.0
    with eval_mode(net):
        try:
            j = done_to
            while j < stop:
                j1 = min(stop, (j // batch_size + 1) * batch_size)  # fixed grid of batches
                ids = np.arange(j, j1, dtype=np.int64)
                if stored_z is not None:  # z (B, T, d) read back; the prototype layer alone runs on it
                    z = stored_z.hidden(ids).to(dev)
                    with torch.no_grad():
                        fo = net.add_prototype_fields(PrismOutput(logits=z.new_empty(0), hidden=z))
                    x = z[..., 0]  # (B, T): counts the tokens below
                else:
                    x = torch.from_numpy(shards.train.sequences(ids, T)[:, :-1]).to(dev)  # (B, T)
                    with torch.no_grad(), autocast or nullcontext():
                        fo = net(x)  # the model's one PrismOutput
                builder.update(fo, p_unit, torch.from_numpy(ids * T).to(dev), chunk)
                manifest["covered"] = merge_ranges(manifest["covered"] + [[j, j1]])
                j = j1
                batches += 1
                tok0 += x.numel()
                elapsed = time.perf_counter() - t0
                bar.update(x.numel(), tokens_per_s=round(tok0 / max(elapsed, 1e-9)))
                if out is not None and checkpoint_every and batches % checkpoint_every == 0 and j < stop:
                    builder.to_index(manifest).save(out)
                if stop_after_batches is not None and batches >= stop_after_batches:
                    break
        finally:
            bar.close()
    manifest["build_seconds"] = manifest.get("build_seconds", 0.0) + elapsed
    manifest["tokens_per_s_last_run"] = tok0 / max(elapsed, 1e-9) if tok0 else None
    idx = builder.to_index(manifest)
    idx.shards, idx.tokenizer = shards, shards.tokenizer
    if out is not None:
        idx.save(out)
    return idx


def _check_resume_sample(m: dict[str, Any], sample_size: int) -> None:
    """A partial index with an activation sample of another size cannot be resumed into this one."""
    if "sample_size" in m and int(m["sample_size"]) != sample_size:
        raise ArtifactError(
            f"cannot resume: the partial index samples {m['sample_size']} firings per prototype; this build "
            f"asks for sample_size={sample_size}"
        )


def _check_stored_z(store: StoredZ, net: PrismLM, shards: ShardSet, universe: int) -> None:
    """Refuse stored z that is not this model's backbone over these shards' training split, or too short."""
    store.check(
        backbone=backbone_identity(net),
        shard_key=shards.manifest["key"],
        block_size=net.config.block_size,
        split="train",
    )
    if store.num_sequences < universe:
        raise ArtifactMismatch(
            f"the stored z at {store.path} covers {store.num_sequences} training sequences, fewer "
            f"than the {universe} to index",
            fix="pass --max-sequences or index from the model",
        )


def merge_indexes(parts: list[PrototypeIndex]) -> PrototypeIndex:
    """Combine partial indexes of the same model, shards and settings over disjoint sequence ranges.

    The result equals one pass over the union (exactly for the tables and counts, to rounding for the
    float sums) — see the module docstring for the batch-grid condition.
    """
    if not parts:
        raise ArtifactError("nothing to merge")
    first = parts[0].manifest
    for p in parts[1:]:
        m = p.manifest
        if m["model_sha256"] != first["model_sha256"]:
            raise ArtifactMismatch(
                f"cannot merge indexes of different models: {first['model_sha256']} vs {m['model_sha256']}"
            )
        if m["shard_key"] != first["shard_key"]:
            raise ArtifactMismatch(
                f"cannot merge indexes of different shards: {first['shard_key']} vs {m['shard_key']}"
            )
        for key in ("top_n", "num_prototypes", "block_size", "bins", "universe"):
            if m[key] != first[key]:
                raise ArtifactError(f"cannot merge: {key} differs ({first[key]} vs {m[key]})")
    covered: list[list[int]] = []
    for p in parts:
        ov = overlap(covered, merge_ranges(p.manifest["covered"]))
        if ov is not None:
            raise ArtifactError(
                f"cannot merge: parts overlap on sequences [{ov[0]}, {ov[1]}) — each sequence must be indexed once"
            )
        covered = merge_ranges(covered + p.manifest["covered"])
    sim = torch.cat([p.top_sim for p in parts], dim=1)
    off = torch.cat([p.top_offset for p in parts], dim=1)
    top_sim, top_off = _topn_merge(sim, off, parts[0].top_n)
    manifest = dict(first)
    targets = merge_ranges([list(p.manifest["target"]) for p in parts])
    manifest.update(
        {
            "covered": covered,
            "part": [0, 1],
            "target": [targets[0][0], targets[-1][1]] if len(targets) == 1 else [0, first["universe"]],
            "tokens": sum(int(p.manifest["tokens"]) for p in parts),
            "token_max_cos_sum": sum(float(p.manifest["token_max_cos_sum"]) for p in parts),
            "residual_share_sum": sum(float(p.manifest["residual_share_sum"]) for p in parts),
            "build_seconds": sum(float(p.manifest.get("build_seconds", 0.0)) for p in parts),
            "merged_from": len(parts),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )
    manifest.pop("tokens_per_s_last_run", None)
    samples = [p.sample for p in parts if p.sample is not None]  # a part without one: the union has none
    sample = ActivationSample.merged(samples) if len(samples) == len(parts) else None
    manifest["sample_size"] = sample.size if sample is not None else 0
    first_part, rest = parts[0], parts[1:]  # sums start from the first part (0 + x would change nothing)
    return PrototypeIndex(
        top_sim=top_sim,
        top_offset=top_off,
        counts=sum((p.counts for p in rest), first_part.counts),
        act_sum=sum((p.act_sum for p in rest), first_part.act_sum),
        hist=sum((p.hist for p in rest), first_part.hist),
        manifest=manifest,
        sample=sample,
        shards=parts[0].shards,
        tokenizer=parts[0].tokenizer,
    )
