"""Approximate search over an attribution cache: per long posting list a maximum-inner-product index (faiss)
proposes candidates, which are then rescored exactly with the cache's own sketches (``SearchIndex``,
``build_search_index``; the sidecar folder ``CACHE/search``).

Invariant: only the candidate set is approximate — a candidate's score equals its exact-scan score bit
for bit (the same per-posting products, added in the same order), and with ``m`` at least the longest
list (``exhaustive_m``) the top is the exact scan's. Method, the library choice, the sidecar's files and
the measurements: docs/attribution.md ("Approximate search").
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TypedDict, cast

import numpy as np
import torch

from prismlm.artifacts import JSON, FileRecord, atomic_dir, file_records, provenance, reading, verify_files
from prismlm.config import SearchConfig
from prismlm.errors import ArtifactError, ArtifactMismatch, ConfigError
from prismlm.tda.cache import concat_ranges
from prismlm.tda.cache.store import best_n

if TYPE_CHECKING:
    from prismlm.tda.cache import AttributionCache
    from prismlm.tda.gradients import BlockGradients

__all__ = ["SearchIndex", "SearchManifest", "build_search_index", "cache_fingerprint"]

KIND = "prismlm-search-index"
FORMAT_VERSION = 1
_KMEANS_ITERS = 10
_TRAIN_PER_CELL = 32
"""k-means of an IVF list: 10 iterations (faiss: 25) on ≤ 32 points per cell (faiss: ≤ 256). The cells only
route the search (candidates are rescored exactly), and this keeps a 10^7-token corpus's build in minutes
on one core."""
_REBUILD = "prismlm.tda.search.build_search_index(cache, SearchConfig(...), out=CACHE/search)"


def _faiss() -> ModuleType:
    try:
        import faiss
    except ImportError as e:  # an optional extra
        raise ConfigError("approximate attribution search needs faiss", fix="pip install 'prismlm[search]'") from e
    return faiss


class FaissIndex(Protocol):
    """What this module calls on a faiss index (faiss ships no type stubs)."""

    nlist: int
    """Cells of an IVF index (read for IVF indexes only)."""

    def search(self, x: np.ndarray, k: int, *, params: object = None) -> tuple[np.ndarray, np.ndarray]:
        """(distances (n, k), labels (n, k)) of the ``k`` best of each query row of ``x`` (n, r)."""
        ...


class SearchManifest(TypedDict, total=False):
    """``manifest.json`` of a search sidecar, in the order ``build_search_index`` writes it, then ``files``."""

    kind: str
    format_version: int
    cache_fingerprint: str
    cache_path: str | None
    model_sha256: str | None
    shard_key: str | None
    config: dict[str, JSON]
    """``SearchConfig.to_dict()``."""
    faiss_version: str
    faiss_threads: int
    lists_indexed: int
    postings_indexed: int
    postings: int
    index_seconds: float
    forward_seconds: float
    build_seconds: float
    bytes_indexes: int
    bytes_forward: int
    bytes: int
    bytes_per_token: float
    created: str
    prismlm_version: str
    torch_version: str
    files: dict[str, FileRecord]


def cache_fingerprint(cache: AttributionCache) -> str:
    """A sha256 that tells caches apart without reading them whole: the offsets, the identity in the
    manifest, and a strided sample (≤ 4096 postings) of the stored id and sketch bytes."""
    h = hashlib.sha256(np.ascontiguousarray(cache.offsets, dtype=np.int64).tobytes())
    m = cache.manifest
    h.update(
        json.dumps(
            [
                m.get("model_sha256"),
                m.get("shard_key"),
                m.get("dtype"),
                m.get("r"),
                m.get("tokens"),
                m.get("aggregate", "sequence"),
            ]
        ).encode()
    )
    P = cache.num_postings
    rows = np.unique(np.linspace(0, max(P - 1, 0), num=min(P, 4096)).astype(np.int64)) if P else np.zeros(0, np.int64)
    for a in (*cache.ids.arrays().values(), *cache.sketches.arrays().values()):
        if len(a) == P:  # per-posting arrays (delta exceptions are not)
            h.update(np.ascontiguousarray(a[rows]).tobytes())
        else:
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _posting_dots(cache: AttributionCache, rows: np.ndarray, sq_rows: torch.Tensor) -> torch.Tensor:
    """Contributions s_q · s of postings ``rows`` (n,) with the query sketches ``sq_rows`` (n, r) float64:
    (n,) float64, computed exactly as ``AttributionCache.scores`` computes them (``Sketches.dots``)."""
    return torch.from_numpy(cache.sketches.dots(np.asarray(rows), sq_rows.numpy()))


class SearchIndex:
    """The approximate-search sidecar of one attribution cache (K lists, U units, P postings): per long
    list a serialised faiss index or IVF cells, and the forward index unit → posting rows."""

    def __init__(
        self,
        *,
        config: SearchConfig,
        manifest: SearchManifest,
        index_offsets: np.ndarray,
        blobs: np.ndarray,
        fwd_offsets: np.ndarray,
        fwd_rows: np.ndarray,
        cells: Cells | None = None,
        path: Path | None = None,
    ) -> None:
        self.config = config
        """The options it was built with."""
        self.cells = cells
        """IVF cells over the cache's own postings (``encoding="cache"``); None for faiss-stored indexes."""
        self.manifest = manifest
        """``manifest.json``: the cache's fingerprint, config, build seconds, bytes, file records."""
        self.index_offsets = index_offsets
        """(K+1,) int64: the serialised index of list i is ``blobs[index_offsets[i]:index_offsets[i+1]]``."""
        self.blobs = blobs
        """(B,) uint8, memory-mapped on load."""
        self.fwd_offsets = fwd_offsets
        """(U+1,) int64: rows of unit j's postings are ``fwd_rows[fwd_offsets[j]:fwd_offsets[j+1]]``."""
        self.fwd_rows = fwd_rows
        """(P,) uint32/int64 posting rows, grouped by unit (ascending rows, hence prototypes, within one)."""
        self.path = path
        """The sidecar's folder when loaded or saved; None in memory."""
        self._open: dict[int, FaissIndex] = {}
        self._checked: AttributionCache | None = None  # the cache last verified (held, so its id stays unique)

    # ----- sizes ------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the sidecar's arrays (indexes + forward index), apart from the postings."""
        return int(
            self.blobs.nbytes
            + self.index_offsets.nbytes
            + self.fwd_offsets.nbytes
            + self.fwd_rows.nbytes
            + (self.cells.nbytes() if self.cells is not None else 0)
        )

    def _has_index(self, protos: np.ndarray) -> np.ndarray:
        """(a,) bool: which of the lists ``protos`` have an index."""
        bounds = self.cells.list_cells if self.cells is not None else self.index_offsets
        return bounds[protos + 1] > bounds[protos]

    def indexed(self) -> np.ndarray:
        """Prototypes whose list has an index: (n,) int64."""
        return np.flatnonzero(self._has_index(np.arange(len(self.index_offsets) - 1)))

    def _index(self, i: int) -> FaissIndex:
        """The faiss index of list i, deserialised on first use (kept: a query reuses the hot lists)."""
        ix = self._open.get(i)
        if ix is None:
            a, b = int(self.index_offsets[i]), int(self.index_offsets[i + 1])
            with reading(self.path or "<memory>", "search index", fix=_REBUILD):
                ix = _faiss().deserialize_index(np.ascontiguousarray(self.blobs[a:b]))
            self._open[i] = ix
        return ix

    def warm(self) -> None:
        """Deserialise every index now (else on first use); cells over the cache: read their arrays."""
        if self.cells is not None:
            np.asarray(self.cells.positions).sum()  # page the memory-mapped positions in
            return
        for i in self.indexed().tolist():
            self._index(i)

    # ----- queries ----------------------------------------------------------------------------------------
    def candidates(
        self,
        cache: AttributionCache,
        protos: np.ndarray,
        sq: torch.Tensor,
        *,
        m: int = 50,
        nprobe: int = 8,
        ef: int = 64,
    ) -> np.ndarray:
        """Candidate units of one query with active prototypes ``protos`` (a,) and sketches ``sq`` (a, r)
        float64: the union over its lists of each list's top ``m`` by s_q · s (approximate for indexed lists
        longer than m, exact otherwise; a list of at most m postings gives all of them). → (c,) int64 sorted."""
        faiss = _faiss()
        protos = np.asarray(protos, dtype=np.int64)
        lo, n = cache.offsets[protos], cache.offsets[protos + 1] - cache.offsets[protos]
        has = self._has_index(protos) & (n > m)
        out = []
        whole = ~has & (n <= m)  # every posting is a candidate: no ranking needed
        if whole.any():
            out.append(cache.ids.gather(lo[whole], n[whole]))
        scan = ~has & (n > m)  # short lists without an index: exact contributions, top m per list
        if scan.any():
            ls, ns = lo[scan], n[scan]
            rows = concat_ranges(ls, ns)
            rep = np.repeat(np.arange(len(ls)), ns)
            c = _posting_dots(cache, rows, sq[torch.from_numpy(np.flatnonzero(scan)[rep])]).numpy()
            out.append(cache.ids.gather(ls, ns)[_top_per_group(c, rep, len(ls), m)])
        if self.cells is not None:
            if has.any():
                out.append(self._cell_candidates(cache, np.flatnonzero(has), protos, sq, m, nprobe))
            return np.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)
        xq = sq.numpy().astype(np.float32)
        for a in np.flatnonzero(has).tolist():  # a loop over the few active long lists, not postings
            ix = self._index(int(protos[a]))
            if self.config.kind == "ivf":
                params = faiss.SearchParametersIVF(nprobe=int(min(nprobe, ix.nlist)))
            else:
                params = faiss.SearchParametersHNSW(efSearch=int(max(ef, m)))
            ids = ix.search(xq[a : a + 1], int(m), params=params)[1][0]
            out.append(ids[ids >= 0])
        return np.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)

    def _cell_candidates(
        self, cache: AttributionCache, lists: np.ndarray, protos: np.ndarray, sq: torch.Tensor, m: int, nprobe: int
    ) -> np.ndarray:
        """Top ``m`` units of each of the query's indexed lists (rows ``lists`` of ``protos``/``sq``) by the
        exact contributions of the postings in its ``nprobe`` best cells (inner product with the
        centroids), decoded from the cache itself. Vectorised over the lists. → (c,) int64 units."""
        assert self.cells is not None
        cl = self.cells
        p = protos[lists]
        c_lo, c_n = cl.list_cells[p], cl.list_cells[p + 1] - cl.list_cells[p]
        cidx = concat_ranges(c_lo, c_n)  # (C,) the lists' cells
        rep = np.repeat(np.arange(len(lists)), c_n)
        sq_l = sq[torch.from_numpy(lists)].numpy()  # (L, r) float64
        csc = np.einsum("cr,cr->c", np.asarray(cl.centroids[cidx], dtype=np.float64), sq_l[rep])
        probe = _top_per_group(csc, rep, len(lists), nprobe)  # each list's best cells
        best, best_rep = cidx[probe], rep[probe]
        r_lo, r_n = cl.cell_offsets[best], cl.cell_offsets[best + 1] - cl.cell_offsets[best]
        pos = np.asarray(cl.positions[concat_ranges(r_lo, r_n)], dtype=np.int64)  # (R,) forward-index positions
        prep = np.repeat(best_rep, r_n)
        rows = np.asarray(self.fwd_rows[pos], dtype=np.int64)
        units = np.searchsorted(self.fwd_offsets, pos, side="right") - 1
        by_row = np.argsort(rows, kind="stable")  # read the postings in storage order
        contrib = np.empty(len(rows))
        contrib[by_row] = _posting_dots(cache, rows[by_row], sq[torch.from_numpy(lists[prep[by_row]])]).numpy()
        return units[_top_per_group(contrib, prep, len(lists), m)]

    def terms(
        self, cache: AttributionCache, protos: np.ndarray, sq: torch.Tensor, cand: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The per-posting terms of the exact scores of units ``cand`` (c,) for a query with active prototypes
        ``protos`` (a,) and sketches ``sq`` (a, r): (candidate position (R,) int64 into ``cand``, prototype
        (R,) int64, contribution s_q · s (R,) float64), one per posting of a candidate in a list of A_q, in
        query-prototype order (the order in which the exact scan adds them). Read through the forward index:
        the cost is the candidates' postings, not the lists' lengths."""
        cand = np.asarray(cand, dtype=np.int64)
        n = self.fwd_offsets[cand + 1] - self.fwd_offsets[cand]
        rows = np.asarray(self.fwd_rows[concat_ranges(self.fwd_offsets[cand], n)], dtype=np.int64)  # (R,)
        cpos = np.repeat(np.arange(len(cand)), n)  # candidate of each row
        proto = np.searchsorted(cache.offsets, rows, side="right") - 1  # (R,) prototype of each row
        table = np.full(cache.num_prototypes, -1, dtype=np.int64)
        table[np.asarray(protos, dtype=np.int64)] = np.arange(len(protos))
        qrow = table[proto]
        keep = qrow >= 0
        rows, cpos, qrow, proto = rows[keep], cpos[keep], qrow[keep], proto[keep]
        order = np.argsort(qrow, kind="stable")  # the exact scan adds a unit's terms in query-prototype order
        rows, cpos, qrow, proto = rows[order], cpos[order], qrow[order], proto[order]
        return cpos, proto, _posting_dots(cache, rows, sq[torch.from_numpy(qrow)]).numpy()

    def rescore(self, cache: AttributionCache, protos: np.ndarray, sq: torch.Tensor, cand: np.ndarray) -> np.ndarray:
        """Exact scores of units ``cand`` (c,) for a query with active prototypes ``protos`` (a,) and sketches
        ``sq`` (a, r): Σ over every posting of the candidate in a list of A_q. → (c,) float64, equal to the
        exact scan's scores (same products, added in the same prototype order)."""
        cpos, _, c = self.terms(cache, protos, sq, cand)
        # bincount adds its weights sequentially in input order, from 0.0: the exact scan's sums, bit for bit
        return np.bincount(cpos, weights=c, minlength=len(cand))

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
    ) -> tuple[np.ndarray, np.ndarray]:
        """Approximate top-k of each query: (scores (Q, k) float64, ids (Q, k) int64), score descending,
        ties by ascending id, scores exact. ``m``: candidates per list; ``nprobe`` (IVF cells probed) and
        ``ef`` (HNSW beam): the search's effort. ``m`` ≥ the longest list: exactly ``exact_top``.

        The k smallest-id units that were not proposed are rescored too and compete for the top-k, so k
        units are always returned with their exact scores; units with no posting in A_q score exactly 0 and,
        with exhaustive settings, fill the top-k smallest ids first, as in the exact scan."""
        self.check(cache)
        return self.top_sketches(
            cache,
            query.seq.cpu().numpy(),
            query.proto.cpu().numpy(),
            cache.sketch_query(query),
            num_queries,
            k,
            m=m,
            nprobe=nprobe,
            ef=ef,
        )

    def top_sketches(
        self,
        cache: AttributionCache,
        qseq: np.ndarray,
        qproto: np.ndarray,
        sq: torch.Tensor,
        num_queries: int,
        k: int = 10,
        *,
        m: int = 50,
        nprobe: int = 8,
        ef: int = 64,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``top`` from query sketches already made: ``qseq`` (Rq,) query of each row, ``qproto`` (Rq,) its
        prototype, ``sq`` (Rq, r) float64 its sketch (``cache.sketch_query``). No identity check."""
        if m < 1:
            raise ConfigError(f"m (candidates per list) must be >= 1, got {m}")
        U = cache.num_train
        k = min(k, U)
        out_s, out_i = np.zeros((num_queries, k)), np.zeros((num_queries, k), dtype=np.int64)
        for q in range(num_queries):  # queries are few
            sel = np.flatnonzero(np.asarray(qseq) == q)
            protos, sq_q = np.asarray(qproto)[sel], sq[torch.from_numpy(sel)]
            cand = (
                self.candidates(cache, protos, sq_q, m=m, nprobe=nprobe, ef=ef) if len(sel) else np.zeros(0, np.int64)
            )
            s = self.rescore(cache, protos, sq_q, cand)
            # k more units (the smallest ids not proposed) so that k are always returned; rescored like the
            # candidates, since a unit the search did not propose may still have postings in A_q
            fill = np.setdiff1d(np.arange(min(U, len(cand) + k), dtype=np.int64), cand)[:k]
            s_fill = self.rescore(cache, protos, sq_q, fill) if len(sel) else np.zeros(len(fill))
            s, ids = np.concatenate([s, s_fill]), np.concatenate([cand, fill])
            out_s[q], out_i[q] = best_n(s, ids, k)
        return out_s, out_i

    def exhaustive_m(self, cache: AttributionCache) -> int:
        """The ``m`` at which ``top`` is exact: the longest list."""
        return max(1, int(np.diff(cache.offsets).max(initial=0)))

    # ----- identity and persistence -------------------------------------------------------------------------
    def check(self, cache: AttributionCache) -> None:
        """``ArtifactMismatch`` unless this sidecar was built from ``cache`` (remembered for the last cache
        checked: the fingerprint reads a 4096-posting sample, too much to repeat per query)."""
        if self._checked is cache:
            return
        if self.manifest.get("cache_fingerprint") != cache_fingerprint(cache):
            where = self.path / "manifest.json" if self.path else "this search index"
            raise ArtifactMismatch(
                f"{where} was built from another attribution cache ({self.manifest.get('cache_path')}) than "
                f"{cache.path or 'the one given'} (their fingerprints differ)",
                fix=f"rebuild it for this cache: {_REBUILD}",
                path=self.path,
            )
        self._checked = cache

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with atomic_dir(path) as tmp:
            np.save(tmp / "index_offsets.npy", self.index_offsets)
            np.asarray(self.blobs).tofile(tmp / "indexes.bin")
            np.save(tmp / "fwd_offsets.npy", self.fwd_offsets)
            np.save(tmp / "fwd_rows.npy", np.asarray(self.fwd_rows))
            if self.cells is not None:
                self.cells.save(tmp)
            self.manifest["files"] = file_records(tmp)
            (tmp / "manifest.json").write_text(json.dumps(self.manifest, indent=2) + "\n")
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path, cache: AttributionCache) -> SearchIndex:
        """Open a sidecar (arrays memory-mapped), verify its files and that it belongs to ``cache``."""
        path = Path(path)
        mpath = path / "manifest.json"
        if not mpath.exists():
            raise ArtifactError(f"no search index at {path}", fix=f"build one: {_REBUILD}", path=path)
        with reading(mpath, "search index manifest", fix=_REBUILD):
            manifest = json.loads(mpath.read_text())
        if manifest.get("kind") != KIND or manifest.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{mpath} is not a search index of format {FORMAT_VERSION} (kind "
                f"{manifest.get('kind')!r}, format {manifest.get('format_version')!r})",
                fix=f"rebuild it: {_REBUILD}",
                path=mpath,
            )
        verify_files(path, manifest.get("files"), what="search index", fix=f"rebuild it: {_REBUILD}")
        with reading(path, "search index", fix=_REBUILD):
            idx = cls(
                config=SearchConfig.from_dict(manifest["config"]),
                manifest=manifest,
                index_offsets=np.load(path / "index_offsets.npy"),
                blobs=np.memmap(path / "indexes.bin", dtype=np.uint8, mode="r")
                if (path / "indexes.bin").stat().st_size
                else np.zeros(0, np.uint8),
                fwd_offsets=np.load(path / "fwd_offsets.npy"),
                fwd_rows=np.load(path / "fwd_rows.npy", mmap_mode="r"),
                cells=Cells.load(path) if (path / "cell_offsets.npy").exists() else None,
                path=path,
            )
        if len(idx.index_offsets) != cache.num_prototypes + 1 or int(idx.index_offsets[-1]) != len(idx.blobs):
            raise ArtifactError(
                f"{path / 'index_offsets.npy'} disagrees with indexes.bin or the cache's "
                f"{cache.num_prototypes} prototypes",
                fix=f"rebuild it: {_REBUILD}",
                path=path,
            )
        if idx.cells is not None and len(idx.cells.list_cells) != cache.num_prototypes + 1:
            raise ArtifactError(
                f"{path / 'list_cells.npy'} disagrees with the cache's {cache.num_prototypes} prototypes",
                fix=f"rebuild it: {_REBUILD}",
                path=path,
            )
        idx.check(cache)
        return idx


@dataclass
class Cells:
    """IVF over the cache's own postings (``SearchConfig.encoding="cache"``): per indexed list, k-means
    cells of its sketches; a cell holds the forward-index positions of its postings (4 bytes each), so no
    vector is copied — a probed cell's postings are decoded from the cache and scored exactly."""

    list_cells: np.ndarray
    """(K+1,) int64: the cells of list i are ``list_cells[i]:list_cells[i+1]`` (empty: no index)."""
    centroids: np.ndarray
    """(C, r) float32 cell centroids."""
    cell_offsets: np.ndarray
    """(C+1,) int64: the postings of cell c are ``positions[cell_offsets[c]:cell_offsets[c+1]]``."""
    positions: np.ndarray
    """(P_indexed,) uint32/int64 forward-index positions k (row ``fwd_rows[k]``, unit: the j with
    ``fwd_offsets[j] <= k < fwd_offsets[j+1]``), ascending within a cell."""

    _FILES = ("list_cells", "centroids", "cell_offsets", "positions")

    def nbytes(self) -> int:
        return int(sum(np.asarray(getattr(self, f)).nbytes for f in self._FILES))

    def save(self, folder: Path) -> None:
        for f in self._FILES:
            np.save(folder / f"{f}.npy", np.asarray(getattr(self, f)))

    @classmethod
    def load(cls, folder: Path) -> Cells:
        return cls(**{f: np.load(folder / f"{f}.npy", mmap_mode="r" if f == "positions" else None) for f in cls._FILES})


def _top_per_group(score: np.ndarray, group: np.ndarray, num_groups: int, m: int) -> np.ndarray:
    """Indices of the ``m`` highest ``score`` (n,) within each group (``group`` (n,) in 0..num_groups−1):
    (≤ num_groups·m,) int64, by group, score descending, ties in input order."""
    order = np.lexsort((-score, group))
    counts = np.bincount(group, minlength=num_groups)
    rank = np.arange(len(score)) - np.repeat(np.cumsum(counts) - counts, counts)  # position within its group
    return order[rank < m]


def _build_list(X: np.ndarray, ids: np.ndarray, cfg: SearchConfig) -> FaissIndex:
    """A faiss inner-product index over one list's sketches ``X`` (n, r) float32 labelled by unit ids (n,)."""
    faiss = _faiss()
    n, r = X.shape
    if cfg.kind == "hnsw":
        ix = faiss.IndexIDMap(faiss.IndexHNSWFlat(r, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT))
        ix.add_with_ids(X, ids)
        return ix
    nlist = max(1, min(n, math.ceil(cfg.nlist_factor * math.sqrt(n))))
    quant = faiss.IndexFlatIP(r)
    if cfg.encoding == "flat":
        ix = faiss.IndexIVFFlat(quant, r, nlist, faiss.METRIC_INNER_PRODUCT)
    else:
        qt = faiss.ScalarQuantizer.QT_8bit if cfg.encoding == "sq8" else faiss.ScalarQuantizer.QT_4bit
        ix = faiss.IndexIVFScalarQuantizer(quant, r, nlist, qt, faiss.METRIC_INNER_PRODUCT)
    ix.own_fields = True
    quant.this.disown()  # the IVF index owns (and frees) its quantiser
    ix.cp.seed = cfg.seed
    ix.cp.min_points_per_centroid = 1  # short lists train few points per cell: no warning, no refusal
    ix.cp.niter = _KMEANS_ITERS
    sample = np.random.default_rng(cfg.seed).choice(n, size=min(n, _TRAIN_PER_CELL * nlist), replace=False)
    ix.train(X[np.sort(sample)])
    ix.add_with_ids(X, ids)
    return ix


def _cells(X: np.ndarray, cfg: SearchConfig) -> tuple[np.ndarray, np.ndarray]:
    """k-means cells of one list's sketches ``X`` (n, r) float32, as faiss trains an IVF coarse quantiser
    (same cell count, sample and iterations as ``_build_list``), and each posting's cell by the largest
    inner product with the centroids, as an inner-product IVF assigns them: (centroids (c, r), cell (n,))."""
    faiss = _faiss()
    n, r = X.shape
    nlist = max(1, min(n, math.ceil(cfg.nlist_factor * math.sqrt(n))))
    sample = np.random.default_rng(cfg.seed).choice(n, size=min(n, _TRAIN_PER_CELL * nlist), replace=False)
    km = faiss.Kmeans(r, nlist, niter=_KMEANS_ITERS, seed=cfg.seed, min_points_per_centroid=1, verbose=False)
    km.train(np.ascontiguousarray(X[np.sort(sample)]))
    C = np.ascontiguousarray(km.centroids, dtype=np.float32)
    flat = faiss.IndexFlatIP(r)
    flat.add(C)
    cell = flat.search(X, 1)[1][:, 0].astype(np.int64)
    return C, cell


def build_search_index(
    cache: AttributionCache,
    config: SearchConfig | None = None,
    *,
    out: str | Path | None = None,
    on_list: Callable[[int, int], None] | None = None,
) -> SearchIndex:
    """Build the sidecar of ``cache``: a faiss index per list of more than ``config.min_list`` postings
    (one list in memory at a time, decoded from the memory-mapped storage) and the forward index. ``out``:
    save it there (convention: ``CACHE/search``) and return it loaded. ``on_list(i, n)``: called after
    each indexed list (progress). The build time and bytes are in ``manifest`` apart from the cache's."""
    cfg = config if config is not None else SearchConfig()
    faiss = _faiss()
    threads = faiss.omp_get_max_threads()
    t1 = time.perf_counter()
    fwd_offsets, fwd_rows = _forward_index(cache)
    t_fwd = time.perf_counter() - t1
    t0 = time.perf_counter()
    blobs, index_offsets, cells, sizes = _index_lists(cache, cfg, fwd_rows, on_list)
    t_index = time.perf_counter() - t0
    idx = SearchIndex(
        config=cfg,
        manifest={},
        index_offsets=index_offsets,
        blobs=blobs,
        fwd_offsets=fwd_offsets,
        fwd_rows=fwd_rows,
        cells=cells,
    )
    m, n = cache.manifest, np.diff(np.asarray(cache.offsets, dtype=np.int64))
    tokens = int(m.get("tokens", 0))
    idx.manifest.update(
        {
            "kind": KIND,
            "format_version": FORMAT_VERSION,
            "cache_fingerprint": cache_fingerprint(cache),
            "cache_path": str(cache.path) if cache.path else None,
            "model_sha256": m.get("model_sha256"),
            "shard_key": m.get("shard_key"),
            "config": cfg.to_dict(),
            "faiss_version": faiss.__version__,
            "faiss_threads": threads,
            "lists_indexed": int((sizes > 0).sum()),
            "postings_indexed": int(n[sizes > 0].sum()),
            "postings": len(fwd_rows),
            "index_seconds": t_index,
            "forward_seconds": t_fwd,
            "build_seconds": t_index + t_fwd,
            "bytes_indexes": int(idx.blobs.nbytes) + (cells.nbytes() if cells is not None else 0),
            "bytes_forward": int(fwd_offsets.nbytes + fwd_rows.nbytes),
            "bytes": idx.nbytes(),
            "bytes_per_token": idx.nbytes() / max(1, tokens),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )
    idx.manifest.update(cast(SearchManifest, provenance()))  # prismlm_version, torch_version: last, as before
    if out is not None:
        idx.save(out)
        return SearchIndex.load(out, cache)
    return idx


def _forward_index(cache: AttributionCache) -> tuple[np.ndarray, np.ndarray]:
    """(fwd_offsets (U+1,) int64, fwd_rows (P,) uint32, int64 beyond 2^32 postings): the posting rows of
    unit j are ``fwd_rows[fwd_offsets[j]:fwd_offsets[j+1]]``, ascending (a stable sort keeps rows, hence
    prototypes, in order)."""
    units = np.asarray(cache.seq, dtype=np.int64)  # (P,) decoded ids
    P, U = len(units), cache.num_train
    fwd_offsets = np.zeros(U + 1, dtype=np.int64)
    np.cumsum(np.bincount(units, minlength=U), out=fwd_offsets[1:])
    pos_dtype = np.uint32 if P < 2**32 else np.int64
    return fwd_offsets, np.argsort(units, kind="stable").astype(pos_dtype)


def _index_lists(
    cache: AttributionCache,
    cfg: SearchConfig,
    fwd_rows: np.ndarray,
    on_list: Callable[[int, int], None] | None,
) -> tuple[np.ndarray, np.ndarray, Cells | None, np.ndarray]:
    """Index every list of more than ``cfg.min_list`` postings, list by list (memory ~ one list's float32
    sketches): (faiss blobs (bytes,) uint8, index_offsets (K+1,) int64, the cells of
    ``encoding="cache"`` or None, indexed size per list (K,): > 0 where a list is indexed)."""
    faiss = _faiss()
    K, P = cache.num_prototypes, len(fwd_rows)
    off = np.asarray(cache.offsets, dtype=np.int64)
    n = np.diff(off)
    in_cache = cfg.kind == "ivf" and cfg.encoding == "cache"
    position_of = np.empty(P, dtype=fwd_rows.dtype) if in_cache else None  # row → its forward-index position
    if position_of is not None:
        position_of[fwd_rows] = np.arange(P, dtype=fwd_rows.dtype)
    blobs: list[np.ndarray] = []
    sizes = np.zeros(K, dtype=np.int64)
    list_cells = np.zeros(K + 1, dtype=np.int64)
    cents: list[np.ndarray] = []
    cell_sizes: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    for i in np.flatnonzero(n > cfg.min_list).tolist():
        lo, ln = off[i : i + 1], n[i : i + 1]
        X = np.ascontiguousarray(cache.sketches.gather(concat_ranges(lo, ln)), dtype=np.float32)  # (n_i, r)
        if position_of is not None:
            C, cell = _cells(X, cfg)
            order = np.lexsort((position_of[lo[0] : lo[0] + ln[0]], cell))  # by cell, then position
            cents.append(C)
            cell_sizes.append(np.bincount(cell, minlength=len(C)))
            positions.append(position_of[lo[0] : lo[0] + ln[0]][order])
            list_cells[i + 1] = len(C)
        else:
            b = faiss.serialize_index(_build_list(X, cache.ids.gather(lo, ln), cfg))
            blobs.append(b)
            sizes[i] = len(b)
        if on_list is not None:
            on_list(i, int(ln[0]))
    del position_of
    index_offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(sizes, out=index_offsets[1:])
    blob = np.concatenate(blobs) if blobs else np.zeros(0, np.uint8)
    if not in_cache:
        return blob, index_offsets, None, sizes
    np.cumsum(list_cells, out=list_cells)
    sizes_all = np.concatenate(cell_sizes) if cell_sizes else np.zeros(0, np.int64)
    cell_offsets = np.zeros(len(sizes_all) + 1, dtype=np.int64)
    np.cumsum(sizes_all, out=cell_offsets[1:])
    cells = Cells(
        list_cells=list_cells,
        centroids=np.concatenate(cents) if cents else np.zeros((0, cache.r), np.float32),
        cell_offsets=cell_offsets,
        positions=np.concatenate(positions) if positions else np.zeros(0, fwd_rows.dtype),
    )
    return blob, index_offsets, cells, np.diff(list_cells)  # lists with cells count as indexed
