"""Options of training-data attribution: the postings cache and its approximate-search sidecar."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from prismlm.config.validation import check, from_dict

if TYPE_CHECKING:  # only for annotations: importing artifacts loads torch, the config stays light
    from prismlm.artifacts import JSON


@dataclass
class AttributionConfig:
    """Options of training-data attribution in prototype space (spec §3.2): the postings cache built by
    ``prismlm.tda.build_cache`` and ``prism attribute-cache``. Recorded in the cache's manifest."""

    r: int | None = None
    """Sketch size per posting. None: d (the model width), for which ``identity``,
    ``orthogonal`` and ``pca`` projections give exact scores; smaller r trades accuracy for bytes."""
    projection: Literal["identity", "orthogonal", "gaussian", "pca", "pca-local"] = "orthogonal"
    """The fixed r × d sketch matrix R: ``identity`` (r = d), ``orthogonal`` (random
    orthonormal rows scaled by √(d/r)), ``gaussian`` (JL, N(0, 1/r)), ``pca`` (top-r principal
    directions of the whitened block gradients, fitted on ``pca_sequences`` sequences), or ``pca-local``
    (one such r × d basis per prototype, fitted on that prototype's postings: far better top-k agreement
    at small r, and better the more sequences it is fitted on — at r = 32 on a 12k-sequence corpus, top-10
    overlap with the full method 0.62 fitted on 2,048 of them, 0.74 on all; K·r·d floats stored)."""
    seed: int = 0
    """Seed of the random ``orthogonal``/``gaussian`` projection."""
    pca_sequences: int = 256
    """Training sequences the ``pca``/``pca-local`` projections are fitted on (blocks of ``batch_size``
    spread evenly over the cached sequences)."""
    curvature_mode: Literal["shared", "exact"] = "shared"
    """Block curvature: ``shared`` (H_i = m_i F + λ_i I, one d × d eigendecomposition)
    or ``exact`` (each diagonal block exactly: K eigendecompositions, K·d² memory)."""
    damping: float = 0.1
    """Relative damping ρ: λ_i = ρ · tr(H_i)/d."""
    curvature_sample: int | None = 1024
    """Training sequences the curvature statistics are taken over: blocks of
    ``batch_size`` spread evenly over the cached sequences (all of them when there are fewer). None or 0:
    every cached sequence (the behaviour before this option). The statistics are averages (a d × d second
    moment and per-prototype masses), so a sample estimates them at a fraction of a full pass: on the
    K=512 cpu-small run (4,096 sequences of 128 tokens), 1,024 spread sequences gave F within 2.7% and m
    within 7.7% (relative L2/L1) of all 4,096, and the same top-10 of 64 training sequences for 4 queries."""
    max_sequences: int | None = None
    """Cache only the first N training sequences; None: all of them. The curvature
    statistics are taken over (up to ``curvature_sample`` of) the same sequences."""
    batch_size: int = 16
    """Sequences per forward pass. Parts built separately and merged must use the
    same value (batches follow a fixed grid of sequence ids)."""
    dtype: Literal["float16", "float32", "float64", "int8", "int4", "int3", "pq"] = "float32"
    """Storage type of the sketches: ``float16``/``float32``/``float64``, ``int8`` / ``int4``
    / ``int3`` (symmetric, one float16 scale per posting; every entry within scale/2 of its float value;
    int4 packs two entries per byte, int3 eight per three bytes), or ``pq`` (product quantisation: the
    posting's direction as r / ``pq_dims`` one-byte codes into 256-centroid codebooks trained on the cache's
    own postings, its norm as a float16 scale; needs faiss, ``prismlm[search]``). int8 keeps top-10 rankings
    nearly unchanged at a quarter of float32's bytes; on the K=512 cpu-small run, pca-local r=40 ``pq`` took
    22 B/token at top-10 overlap 0.82 with the full method where int4 took 39 at 0.84 (docs/results.md)."""
    pq_dims: int = 4
    """``dtype="pq"``: sketch dimensions per sub-quantizer (must divide r): a posting stores
    r / pq_dims bytes of codes plus a 2-byte norm (4: two bits per dimension)."""
    pq_sample: int = 131072
    """``dtype="pq"``: postings the codebooks are trained on (drawn with ``seed`` from
    all of them; all when there are fewer)."""
    prune: float = 0.0
    """Drop the postings that matter least (in [0, 1); 0 keeps all), as ``prune_by`` says. A
    posting can move a score by at most ‖s_q‖·‖s_j‖, so small-norm postings matter least; pruning trades
    top-k agreement for bytes."""
    prune_by: Literal["list", "unit"] = "list"
    """How ``prune`` picks them: ``list`` drops postings whose norm is below ``prune`` × the
    largest norm in the same prototype's list; ``unit`` drops, per unit (sequence or document), its
    smallest-norm postings holding at most ``prune`` of the unit's squared-norm mass (its largest postings
    are kept until they hold ≥ 1 − prune). On the cpu-small run (1,024 sequences, pca-local r=48 float32,
    24 queries): ``unit`` 0.1 kept 63% of the postings at top-10 overlap 0.825 with the full method, where
    ``list`` 0.15 kept 92% for the same overlap (0.85 with all)."""
    aggregate: Literal["sequence", "document"] = "sequence"
    """Unit of attribution: ``sequence`` (one posting per training sequence and active
    prototype) or ``document`` (sketches summed over the sequences of a document, so scores are per
    document and exact sums of the sequence scores; a sequence belongs to the document holding its middle
    target token). Fewer postings when documents span many sequences."""
    id_encoding: Literal["int32", "delta"] = "int32"
    """How posting ids are stored: ``int32`` (4 bytes each, the format-1 layout) or
    ``delta`` (the gaps between consecutive ids of a prototype's sorted list in 1 or 2 bytes, larger gaps
    as exceptions; exact, ~1 byte per posting on a dense corpus)."""

    def __post_init__(self) -> None:
        check(
            self.r is None or (isinstance(self.r, int) and self.r >= 1),
            f"attribution option `r` must be a positive integer or None (= d), got {self.r!r}",
            param="r",
        )
        check(
            self.projection in ("identity", "orthogonal", "gaussian", "pca", "pca-local"),
            f"attribution option `projection` must be identity, orthogonal, gaussian, pca or "
            f"pca-local, got {self.projection!r}",
            param="projection",
        )
        check(
            isinstance(self.seed, int), f"attribution option `seed` must be an integer, got {self.seed!r}", param="seed"
        )
        check(
            self.pca_sequences >= 1,
            f"attribution option `pca_sequences` must be >= 1, got {self.pca_sequences}",
            param="pca_sequences",
        )
        check(
            self.curvature_mode in ("shared", "exact"),
            f"attribution option `curvature_mode` must be shared or exact, got {self.curvature_mode!r}",
            param="curvature_mode",
        )
        check(
            math.isfinite(self.damping) and self.damping >= 0,
            f"attribution option `damping` must be a finite number >= 0, got {self.damping!r}",
            param="damping",
        )
        check(
            self.curvature_sample is None or (isinstance(self.curvature_sample, int) and self.curvature_sample >= 0),
            f"attribution option `curvature_sample` must be an integer >= 0 or None "
            f"(0/None: all), got {self.curvature_sample!r}",
            param="curvature_sample",
        )
        check(
            self.max_sequences is None or self.max_sequences >= 1,
            f"attribution option `max_sequences` must be >= 1 or None (all), got {self.max_sequences!r}",
            param="max_sequences",
        )
        self._check_storage()

    def _check_storage(self) -> None:
        """The batch size and how the cache is stored: dtype, pruning, product quantisation, id encoding."""
        check(
            self.batch_size >= 1,
            f"attribution option `batch_size` must be >= 1, got {self.batch_size}",
            param="batch_size",
        )
        check(
            self.dtype in ("float16", "float32", "float64", "int8", "int4", "int3", "pq"),
            f"attribution option `dtype` must be float16, float32, float64, int8, int4, int3 or pq, got {self.dtype!r}",
            param="dtype",
        )
        check(
            isinstance(self.prune, (int, float)) and math.isfinite(self.prune) and 0 <= self.prune < 1,
            f"attribution option `prune` must be a number in [0, 1), got {self.prune!r}",
            param="prune",
        )
        check(
            isinstance(self.pq_dims, int) and self.pq_dims >= 1,
            f"attribution option `pq_dims` must be a positive integer, got {self.pq_dims!r}",
            param="pq_dims",
        )
        check(
            isinstance(self.pq_sample, int) and self.pq_sample >= 256,
            f"attribution option `pq_sample` must be an integer >= 256 (one per centroid), got {self.pq_sample!r}",
            param="pq_sample",
        )
        check(
            self.prune_by in ("list", "unit"),
            f"attribution option `prune_by` must be list or unit, got {self.prune_by!r}",
            param="prune_by",
        )
        check(
            self.aggregate in ("sequence", "document"),
            f"attribution option `aggregate` must be sequence or document, got {self.aggregate!r}",
            param="aggregate",
        )
        check(
            self.id_encoding in ("int32", "delta"),
            f"attribution option `id_encoding` must be int32 or delta, got {self.id_encoding!r}",
            param="id_encoding",
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> AttributionConfig:
        return from_dict(cls, data, "attribution config")

    def to_dict(self) -> dict[str, JSON]:
        return asdict(self)


@dataclass
class SearchConfig:
    """Options of the approximate-search sidecar of an attribution cache (``prismlm.tda.search``): one
    maximum-inner-product index (faiss) per long posting list, whose candidates are rescored exactly.
    Recorded in the sidecar's manifest; the query-time knobs (M, nprobe, ef) are arguments of the query."""

    kind: Literal["ivf", "hnsw"] = "ivf"
    """Index per list: ``ivf`` (faiss IndexIVF, inner-product coarse quantiser; build ∝ list length, query
    ∝ nprobe · list/nlist + nlist) or ``hnsw`` (faiss IndexHNSWFlat; better recall per probe, ~3× the build
    time and 4r + 8·hnsw_m bytes per posting)."""
    min_list: int = 512
    """Lists with at most this many postings get no index: a query scans them exactly (cheap, and an index
    over a short list costs more than it saves). 512 is what ``bench/attribution_scaling.py`` measured."""
    nlist_factor: float = 1.0
    """IVF cells per list: ceil(nlist_factor · √n) for a list of n postings, so that coarse search and one
    cell both cost ~√n."""
    encoding: Literal["cache", "flat", "sq8", "sq4"] = "sq8"
    """How an IVF index stores the vectors it ranks: a faiss IVF index holding a copy — ``flat`` (float32,
    4r bytes), ``sq8`` / ``sq4`` (8/4-bit scalar quantiser, r or r/2 bytes; faiss adds an 8-byte id per
    vector) — or ``cache`` (no copy: each cell lists its postings' 4-byte positions and a probed cell is
    decoded from the cache itself and scored exactly; faiss only trains the cells). Measured on the
    cpu-small run from 10^5 to 10^7 tokens (``bench/attribution_scaling.py``): ``sq8`` 96 bytes per token
    beside the cache's 42, query time ∝ tokens^0.34; ``cache`` 14 bytes per token but ∝ tokens^0.62, no
    faster than the exact scan at 10^7 tokens (its probed postings are gathered row by row, where faiss
    scans its codes contiguously). Only the candidates' *order* depends on it: candidates are rescored
    exactly."""
    hnsw_m: int = 16
    """HNSW graph degree (``kind="hnsw"``)."""
    seed: int = 0
    """Seed of the k-means training sample."""

    def __post_init__(self) -> None:
        check(
            self.kind in ("ivf", "hnsw"), f"search option `kind` must be ivf or hnsw, got {self.kind!r}", param="kind"
        )
        check(
            isinstance(self.min_list, int) and self.min_list >= 1,
            f"search option `min_list` must be an integer >= 1, got {self.min_list!r}",
            param="min_list",
        )
        check(
            math.isfinite(self.nlist_factor) and self.nlist_factor > 0,
            f"search option `nlist_factor` must be a finite number > 0, got {self.nlist_factor!r}",
            param="nlist_factor",
        )
        check(
            self.encoding in ("cache", "flat", "sq8", "sq4"),
            f"search option `encoding` must be cache, flat, sq8 or sq4, got {self.encoding!r}",
            param="encoding",
        )
        check(
            isinstance(self.hnsw_m, int) and self.hnsw_m >= 2,
            f"search option `hnsw_m` must be an integer >= 2, got {self.hnsw_m!r}",
            param="hnsw_m",
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SearchConfig:
        return from_dict(cls, data, "search config")

    def to_dict(self) -> dict[str, JSON]:
        return asdict(self)
