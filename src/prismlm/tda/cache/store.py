"""The attribution cache artifact (``AttributionCache``): an inverted index prototype → postings, memory-
mapped, with the sketch map of its queries; opening (``load``: every file verified), ``verify``, ``save``
and exact queries (``scores``, ``top``). The cache depends on no search index: a ``Searcher`` (the
``prismlm.tda.search.SearchIndex``) is passed in.

Invariant: ``score(q, j) = Σ_{i ∈ A_q} s_{q,i} · s_{j,i}`` read only from the lists of the query's active
prototypes, in posting order (chunking never changes a sum). Format: docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import torch

from prismlm.artifacts import atomic_dir, check_provenance, file_records, reading, verify_files
from prismlm.errors import ArtifactCorrupt, ArtifactError
from prismlm.tda.cache.codecs import (
    FLOAT_DTYPES,
    PQ_CENTROIDS,
    QMAX,
    DeltaIds,
    FloatSketches,
    Ids,
    PlainIds,
    PQSketches,
    QuantDtype,
    QuantSketches,
    Sketches,
    concat_ranges,
)
from prismlm.tda.cache.manifest import FORMAT_VERSION, KIND, REBUILD, CacheManifest
from prismlm.tda.cache.projection import PostingSketcher
from prismlm.tda.gradients import BlockGradients
from prismlm.tda.influence import Curvature

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet

__all__ = ["QUERY_CHUNK", "AttributionCache", "Searcher", "best_n", "exact_top", "write_arrays"]

QUERY_CHUNK = 1 << 17
"""Postings decoded and multiplied at a time by a query: bounds its memory to ~3 × QUERY_CHUNK × r float64
(a query's active prototypes can hold half of all postings) without changing any sum's order."""


class Searcher(Protocol):
    """An approximate top-k search over a cache's postings (``prismlm.tda.search.SearchIndex``)."""

    def top(
        self,
        cache: AttributionCache,
        query: BlockGradients,
        num_queries: int,
        k: int = 10,
        *,
        m: int = 50,
        nprobe: int = 8,
        ef: int = 64,
    ) -> tuple[np.ndarray, np.ndarray]: ...


def best_n(scores: np.ndarray, ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n best of (scores (N,), ids (N,)) by score descending, ties by ascending id: (n',) each, n' = min(n, N)."""
    order = np.lexsort((ids, -scores))[:n]
    return scores[order], ids[order]


def exact_top(
    cache: AttributionCache, query: BlockGradients, num_queries: int, k: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """The exact scan's top-k (``cache.scores``, every posting of A_q): (scores (Q, k) float64, ids (Q, k)
    int64), ordered by score descending, ties by ascending id."""
    S = cache.scores(query, num_queries).numpy()  # (Q, U)
    k = min(k, S.shape[1])
    out_s, out_i = np.empty((num_queries, k)), np.empty((num_queries, k), dtype=np.int64)
    all_ids = np.arange(S.shape[1], dtype=np.int64)
    for q in range(num_queries):
        out_s[q], out_i[q] = best_n(S[q], all_ids, k)
    return out_s, out_i


@dataclass
class AttributionCache:
    """The inverted index prototype → postings (memory-mapped) and what it needs to sketch a query: K
    prototypes, P postings, sketch size r, d the model width."""

    offsets: np.ndarray
    """(K+1,) int64: postings of prototype i are rows offsets[i]:offsets[i+1]."""
    ids: Ids
    """Posting ids (training sequence, or document with ``aggregate="document"``), ascending within a
    prototype: ``PlainIds`` (int32) or ``DeltaIds``."""
    sketches: Sketches
    """(P, r) sketches R H_i^{-1/2} G_{j,i}: ``FloatSketches`` or ``QuantSketches``."""
    projection: np.ndarray
    """(r, d) float64: R; ``pca-local``: (K, r, d), one basis R_i per prototype."""
    curvature: Curvature
    """The block curvature H_i the sketches are whitened with (and a query is preconditioned with)."""
    manifest: CacheManifest
    """``manifest.json``: identity, build and storage options, postings statistics, file records."""
    path: Path | None = field(default=None, compare=False)
    """The cache's folder when it was loaded or saved; None in memory."""
    units_of: np.ndarray | None = None
    """Document aggregation: (universe,) the document of each sequence (int32, ascending); else None."""
    _query_sketcher: PostingSketcher | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_prototypes(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def r(self) -> int:
        return int(self.projection.shape[-2])

    @property
    def num_postings(self) -> int:
        return int(self.offsets[-1])

    @property
    def aggregate(self) -> Literal["sequence", "document"]:
        """What a posting id and a score column are: a training sequence or a document."""
        return "document" if self.manifest.get("aggregate") == "document" else "sequence"

    @property
    def num_train(self) -> int:
        """Columns of ``scores``: training sequences, or (document aggregation) documents 0 … last covered."""
        return int(self.manifest.get("units", self.manifest["universe"]))

    @property
    def seq(self) -> np.ndarray:
        """(P,) every posting's id, decoded (the stored int32 array itself for ``id_encoding="int32"``)."""
        return self.ids.decode(self.offsets)

    @property
    def sketch(self) -> np.ndarray:
        """(P, r) every sketch: the stored (memory-mapped) array for float formats, decoded float64 for
        int8/int4 (materialised)."""
        return self.sketches.decode()

    def first_sequence(self, units: np.ndarray) -> np.ndarray:
        """The first training sequence of each unit (a sequence id itself without document aggregation)."""
        units = np.asarray(units, dtype=np.int64)
        if self.units_of is None:
            return units
        return np.searchsorted(np.asarray(self.units_of), units, side="left").astype(np.int64)

    def nbytes(self) -> int:
        """Bytes of the postings (ids, sketches, scales, offsets, document map): what the queries read."""
        return int(
            self.ids.nbytes
            + self.sketches.nbytes
            + self.offsets.nbytes
            + (self.units_of.nbytes if self.units_of is not None else 0)
        )

    # ----- identity checks ------------------------------------------------------------------------------
    def check(
        self, *, model_sha256: str | None = None, shards: ShardSet | None = None, shard_key: str | None = None
    ) -> None:
        """Raise ``ArtifactMismatch`` unless the cache was built from this model (``model_sha256``: a
        checkpoint's ``manifest["model_sha256"]``) and these shards (``shards`` or their ``shard_key``)."""
        where = f" {self.path}" if self.path else ""
        if shards is not None:
            shard_key = shards.manifest["key"]
        check_provenance(
            self.manifest,
            what=f"attribution cache{where}",
            rebuild="prism attribute-cache",
            model_sha256=model_sha256,
            shard_key=shard_key,
        )

    # ----- queries --------------------------------------------------------------------------------------
    def sketch_query(self, query: BlockGradients) -> torch.Tensor:
        """(Rq, r) sketches R H_i^{-1/2} G_{q,i} of a query's block gradients (float64): the map the
        postings were made with (``PostingSketcher``), in float64, made once per open cache."""
        if self._query_sketcher is None:
            R = torch.from_numpy(np.asarray(self.projection))
            self._query_sketcher = PostingSketcher(self.curvature, R, torch.float64)
        return self._query_sketcher(query.proto.cpu(), query.grad.detach().cpu())  # (Rq, r)

    def scores(self, query: BlockGradients, num_queries: int, *, contributions: bool = False):
        """(num_queries, num_train) float64 scores. Only the lists of each query's active prototypes are
        read (one gather of their concatenated rows, decoded), and their dot products with the query's
        sketches are scatter-added into the scores: Σ_{i∈A_q} |postings(i)| · r multiply-adds, nothing
        proportional to the corpus. With ``contributions=True`` also returns, per query, the flat arrays
        (id, proto, contribution) of every posting read."""
        sq = self.sketch_query(query)  # (Rq, r)
        out = torch.zeros(num_queries, self.num_train, dtype=torch.float64)
        contrib_out = []
        qseq, qproto = query.seq.cpu(), query.proto.cpu()
        for q in range(num_queries):  # queries are few; each read below is vectorised over prototypes
            sel = qseq == q
            protos = qproto[sel].numpy()
            lo, hi = self.offsets[protos], self.offsets[protos + 1]
            n = hi - lo
            if n.sum() == 0:
                contrib_out.append((np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)))
                continue
            rep = np.repeat(np.arange(len(protos)), n)  # query row of each posting read
            rows = concat_ranges(lo, n)  # (P_q,)
            ids = torch.from_numpy(self.ids.gather(lo, n))  # (P_q,) int64
            sq_q = sq[sel]
            c = torch.empty(len(rows), dtype=torch.float64)
            sq_np = sq_q.numpy()
            for a in range(0, len(rows), QUERY_CHUNK):  # chunks bound memory; each row's sum is unchanged
                b = a + QUERY_CHUNK
                c[a:b] = torch.from_numpy(self.sketches.dots(rows[a:b], sq_np[rep[a:b]]))  # (chunk,) s_j · s_q
                out[q].index_add_(0, ids[a:b], c[a:b])  # in posting order, as one call would
            if contributions:
                contrib_out.append((ids.numpy(), protos[rep], c.numpy()))
        return (out, contrib_out) if contributions else out

    def top(
        self, query: BlockGradients, num_queries: int, k: int = 10, *, search: Searcher | None = None, **effort: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each query's k best units: (scores (Q, k) float64, ids (Q, k) int64), score descending, ties by
        ascending id. ``search=None``: the exact scan (``scores``); a ``prismlm.tda.search.SearchIndex`` of
        this cache: candidates from approximate top-M search in long lists, rescored exactly (``effort``:
        ``m``, ``nprobe``, ``ef``; see ``SearchIndex.top``)."""
        if search is None:
            return exact_top(self, query, num_queries, k)
        return search.top(self, query, num_queries, k, **effort)

    # ----- persistence ----------------------------------------------------------------------------------
    def _arrays(self) -> dict[str, np.ndarray]:
        arrays = {"offsets.npy": np.asarray(self.offsets), **self.ids.arrays(), **self.sketches.arrays()}
        if self.units_of is not None:
            arrays["units.npy"] = self.units_of
        return arrays

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with atomic_dir(path) as tmp:
            write_arrays(tmp, self._arrays())
            np.save(tmp / "projection.npy", self.projection)
            self.curvature.save(tmp / "curvature.safetensors")
            self.manifest["files"] = file_records(tmp)
            (tmp / "manifest.json").write_text(json.dumps(self.manifest, indent=2) + "\n")
        self.path = path
        return path

    def verify(self) -> list[str]:
        """``prism verify``: the full sha256 of every file the cache reads, and of its search sidecar's
        (``search/``, if any), against their manifests; a file without a record is refused as well
        (``ArtifactCorrupt`` naming it). Returns the files checked."""
        assert self.path is not None, "a cache opened from a folder"
        names = (*self._arrays(), "projection.npy", "curvature.safetensors")
        checked = verify_files(
            self.path,
            self.manifest.get("files"),
            what="attribution cache",
            full=True,
            fix=f"rebuild it with `{REBUILD}`",
            required=names,
        )
        side = self.path / "search" / "manifest.json"
        if side.exists():
            fix = "rebuild it with `prism attribute-search RUN`"
            with reading(side, "search index manifest", fix=fix):
                records = json.loads(side.read_text())["files"]
                if not records or not isinstance(records, dict):
                    raise ValueError("it records no files")
            checked += [
                f"search/{n}" for n in verify_files(side.parent, records, what="search index", fix=fix, full=True)
            ]
        return checked

    @classmethod
    def load(
        cls, path: str | Path, *, model_sha256: str | None = None, shards: ShardSet | None = None, mmap: bool = True
    ) -> AttributionCache:
        """Open a saved cache (arrays memory-mapped when ``mmap``); with ``model_sha256`` and ``shards`` it
        is checked against them (``ArtifactMismatch``). Format-1 caches load as int32 ids + float sketches;
        a newer format or unknown storage options raise ``ArtifactError`` naming the manifest."""
        path = Path(path)
        manifest = _read_manifest(path)
        mode: Literal["r"] | None = "r" if mmap else None

        def arr(name: str) -> np.ndarray:
            with reading(path / name, "attribution cache file", fix=REBUILD):
                return np.load(path / name, mmap_mode=mode)

        ids, sk = _open_postings(manifest, arr)
        with reading(path, "attribution cache", fix=REBUILD):
            c = cls(
                offsets=np.load(path / "offsets.npy"),
                ids=ids,
                sketches=sk,
                projection=np.load(path / "projection.npy"),
                curvature=Curvature.load(path / "curvature.safetensors"),
                manifest=manifest,
                path=path,
                units_of=arr("units.npy") if manifest.get("aggregate", "sequence") == "document" else None,
            )
        if not _shapes_agree(c):
            raise ArtifactCorrupt(
                f"attribution cache {path}: its arrays disagree in size with offsets.npy ({c.num_postings} postings)",
                fix=f"rebuild it with `{REBUILD}`",
                path=path,
            )
        c.check(model_sha256=model_sha256, shards=shards)
        return c


def _read_manifest(path: Path) -> CacheManifest:
    """The manifest of the cache at ``path``, once its kind, format and storage options are ones this
    prismlm reads and its files match their records (``ArtifactError`` otherwise)."""
    mpath = path / "manifest.json"
    if not mpath.exists():
        raise ArtifactError(f"no attribution cache at {path}; build it with `prism attribute-cache`")
    with reading(mpath, "attribution cache manifest", fix=REBUILD):
        manifest = json.loads(mpath.read_text())
    if manifest.get("kind") != KIND:
        raise ArtifactError(f"{path} is not an attribution cache (kind {manifest.get('kind')!r})")
    version = manifest.get("format_version", 1)
    ids_enc, dtype = manifest.get("id_encoding", "int32"), manifest.get("dtype", "float32")
    agg = manifest.get("aggregate", "sequence")
    if (
        not isinstance(version, int)
        or version > FORMAT_VERSION
        or ids_enc not in ("int32", "delta")
        or dtype not in (*FLOAT_DTYPES, *QMAX, "pq")
        or agg not in ("sequence", "document")
    ):
        raise ArtifactError(
            f"{mpath}: attribution cache format {version!r} (ids {ids_enc!r}, sketches "
            f"{dtype!r}, aggregate {agg!r}) is not one this prismlm reads (format <= "
            f"{FORMAT_VERSION})",
            fix=f"rebuild it with `{REBUILD}`, or upgrade prismlm",
            path=mpath,
        )
    verify_files(path, manifest.get("files"), what="attribution cache", fix=f"rebuild it with `{REBUILD}`")
    return manifest


def _open_postings(manifest: CacheManifest, arr: typing.Callable[[str], np.ndarray]) -> tuple[Ids, Sketches]:
    """The posting ids and sketches of the manifest's encodings, their arrays opened by ``arr(file name)``."""
    ids_enc, dtype = manifest.get("id_encoding", "int32"), manifest.get("dtype", "float32")
    ids: Ids = (
        PlainIds(arr("seq.npy"))
        if ids_enc == "int32"
        else DeltaIds(arr("ids_gap.npy"), arr("ids_exc_pos.npy"), arr("ids_exc_val.npy"))
    )
    if dtype in FLOAT_DTYPES:
        return ids, FloatSketches(arr("sketch.npy"))
    if dtype == "pq":
        return ids, PQSketches(
            arr("sketch_codes.npy"),
            arr("sketch_scale.npy"),
            float(manifest["scale_unit"]),
            np.asarray(arr("sketch_codebook.npy")),
        )
    return ids, QuantSketches(
        arr("sketch_codes.npy"),
        arr("sketch_scale.npy"),
        float(manifest["scale_unit"]),
        typing.cast(QuantDtype, dtype),
        int(manifest["r"]),
    )


def _shapes_agree(c: AttributionCache) -> bool:
    """Whether the cache's arrays agree in size with its offsets (P postings) and its manifest."""
    P = c.num_postings
    return (
        c.offsets.ndim == 1
        and len(c.offsets) == int(c.manifest["num_prototypes"]) + 1
        and len(c.ids.gaps if isinstance(c.ids, DeltaIds) else c.ids.seq) == P
        and (
            c.sketches.data.shape == (P, c.r)
            if isinstance(c.sketches, FloatSketches)
            else c.sketches.scales.shape == (P,)
        )
        and (
            not isinstance(c.sketches, PQSketches)
            or (
                c.sketches.r == c.r
                and c.sketches.codes.shape == (P, c.sketches.codebook.shape[0])
                and c.sketches.codebook.shape[1] == PQ_CENTROIDS
            )
        )
    )


def write_arrays(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    """Save arrays as ``folder/name`` .npy files; an array already memory-mapped at that file is flushed."""
    for name, a in arrays.items():
        f = folder / name
        if isinstance(a, np.memmap) and a.filename is not None and f.exists() and os.path.samefile(a.filename, f):
            a.flush()
        else:
            np.save(folder / name, np.asarray(a))
