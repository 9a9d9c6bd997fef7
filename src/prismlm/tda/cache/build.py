"""``build_cache``: one PRISM model's attribution cache over a corpus — the fit passes (curvature,
projection), a streaming postings pass to files under ``OUT.build``, then grouping and encoding into the
artifact; resumable after its last written batch (``tda.build_state``).

Invariant: a resumed, a partial-then-merged or an uninterrupted build of the same options give the same
cache, bit for bit. Stages and files: docs/architecture.md ("The attribution cache").
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import torch

from prismlm.artifacts import atomic_dir, file_records, model_identity, part_range, provenance, writes_folder
from prismlm.config import AttributionConfig
from prismlm.errors import ArtifactError, ConfigError, ModelError
from prismlm.model import eval_mode
from prismlm.progress import Progress, Reporter
from prismlm.tda.build_state import BuildStart, BuildState, PostingFiles, Resumed, record_fitted, resume_build
from prismlm.tda.cache.codecs import FLOAT_DTYPES, FloatSketches, Ids, PlainIds, Sketches
from prismlm.tda.cache.encoding import EncodedEntries, check_storage, document_of_sequences, encode_postings, to_csr
from prismlm.tda.cache.manifest import FORMAT_VERSION, KIND, CacheManifest, cache_manifest, created
from prismlm.tda.cache.passes import BatchStore, pca_projection, posting_batch, sampled_curvature
from prismlm.tda.cache.projection import PostingSketcher, make_projection
from prismlm.tda.cache.store import AttributionCache, write_arrays
from prismlm.tda.influence import Curvature, batch_grid

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM

__all__ = ["build_cache"]


def _tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _finished_build(out_dir: Path, started: BuildStart, shards: ShardSet) -> AttributionCache:
    """``resume`` when the build already finished: the cache at ``out_dir``, if it is this build's."""
    cache = AttributionCache.load(out_dir, model_sha256=started["model_sha256"], shards=shards)
    m, opts = cache.manifest, started["options"]
    mine = (
        m.get("universe") == started["universe"]
        and list(m.get("part", [])) == started["part"]
        and opts["r"] in (None, m.get("r"))
        and all(m.get(k) == opts[k] for k in ("projection", "dtype", "prune", "aggregate", "id_encoding"))
    )
    if not mine:
        raise ArtifactError(
            f"cannot resume: {out_dir} holds a finished cache built with other options or sequences",
            fix="rebuild it without resuming, or choose another output folder (out)",
            path=out_dir,
        )
    return cache


class _Timing(TypedDict):
    tokens: int
    """Target tokens of the postings pass."""
    curvature_seconds: float
    postings_seconds: float


@dataclass
class _Build:
    """What one build knows before its passes: the model's sizes, the sequences, the folders, the resume."""

    net: PrismLM
    shards: ShardSet
    cfg: AttributionConfig
    ident: str
    """The model identity recorded in the manifest."""
    d: int
    K: int
    T: int
    r: int
    universe: int
    """Sequences the cache covers (the first ``universe`` of the training split)."""
    start: int
    stop: int
    """This part's sequences: [start, stop)."""
    part: tuple[int, int]
    out_dir: Path | None
    started: BuildStart
    """What a resumed build must share with the one it continues (the storage options apply at the end)."""
    npdt: type[np.floating]
    """dtype of the raw postings: float32 (float64/float16 when stored so); int8/int4/int3 encode from it."""
    widths: dict[str, int]
    """Bytes per row of each raw file."""
    R: torch.Tensor | None = None
    """(r, d) a projection made, not fitted (identity, orthogonal, gaussian): made before any pass."""
    tmp_dir: Path | None = None
    resumed: Resumed | None = None
    units_of: np.ndarray | None = None
    """(universe,) the document of each sequence, with ``aggregate="document"``."""
    encoded: EncodedEntries = field(default_factory=EncodedEntries)
    """``encode_postings``' manifest entries."""

    @property
    def state(self) -> BuildState | None:
        return self.resumed.state if self.resumed is not None else None

    @property
    def plain(self) -> bool:
        """Whether the CSR float postings are stored as they are (no encoding pass)."""
        c = self.cfg
        return c.dtype in FLOAT_DTYPES and c.prune == 0 and c.aggregate == "sequence" and c.id_encoding == "int32"


@writes_folder("out")  # one writer per output folder: a second build is refused, never deletes this one's
def build_cache(
    model: PrismLM,
    shards: ShardSet,
    config: AttributionConfig | None = None,
    *,
    out: str | Path | None = None,
    curvature: Curvature | None = None,
    part: tuple[int, int] = (0, 1),
    model_sha256: str | None = None,
    resume: bool = False,
    progress: Progress = False,
) -> AttributionCache:
    """Build the postings cache of a PRISM ``model`` over ``shards.train``.

    ``config``: the attribution options (sketch size and projection, curvature mode and damping, sequences,
    batch size, storage: dtype, prune, aggregate, id_encoding; default ``AttributionConfig()``). ``out``:
    write the artifact there (postings go to memory-mapped files). ``curvature``: reuse one (required to
    make parts agree), else one is computed first (``sampled_curvature``: over ``config.curvature_sample``
    of the cached sequences, spread over them). ``part=(i, n)``: only the i-th batch-aligned slice. ``model_sha256``: the identity recorded in
    the manifest (pass the checkpoint's ``manifest["model_sha256"]``; None: a hash of the weights,
    ``model_identity``). ``resume`` (with ``out``): continue the interrupted build in ``OUT.build`` after its
    last written batch, with the curvature and projection it saved (the same cache as one uninterrupted
    build, bit for bit; ``ArtifactError`` if it was started with another model, corpus, part or options),
    or return ``out`` when that build already finished; without ``resume`` a left-over build folder is
    discarded. A resume first checks the build files (``tda.build_state``): a changed curvature or
    projection is refused by name (``ArtifactCorrupt``), damaged or missing posting rows are built again
    from the last intact batch. ``out`` is locked for the whole build (``output_lock``: a second writer
    gets ``ArtifactError``).
    """
    b = _plan(model, shards, config if config is not None else AttributionConfig(), out, curvature, part, model_sha256)
    if resume and b.out_dir is None:
        raise ConfigError("resuming a cache build needs its output folder (out)")
    if b.out_dir is not None:
        b.tmp_dir = b.out_dir.with_name(b.out_dir.name + ".build")
        if resume:
            if not b.tmp_dir.exists() and (b.out_dir / "manifest.json").exists():
                return _finished_build(b.out_dir, b.started, shards)
            # checked before anything is read: a damaged batch and those after it are built again
            b.resumed = resume_build(b.tmp_dir, b.started, b.widths)
        if b.resumed is None:
            shutil.rmtree(b.tmp_dir, ignore_errors=True)
            b.tmp_dir.mkdir(parents=True)
    # the batches the curvature and projection fits run through the model keep their block gradients for
    # the postings pass (up to curvature_sample + pca_sequences sequences: fewer forwards, same postings)
    kept = BatchStore(None if b.tmp_dir is None else b.tmp_dir / "fitted", b.start, b.stop, b.cfg.batch_size)
    curvature, R, t_curv = _fit(b, curvature, kept, progress)
    model_dt = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    # float16 and float64 sketches are rounded from float64 (what lossless_options' float64 parts give)
    sketcher = PostingSketcher(curvature, R, torch.float64 if b.cfg.dtype in ("float16", "float64") else model_dt)
    b.units_of = document_of_sequences(shards, b.universe, b.T) if b.cfg.aggregate == "document" else None
    lists, tokens, t_pass = _postings_pass(b, sketcher, kept, t_curv, progress)
    timing: _Timing = {"tokens": tokens, "curvature_seconds": t_curv, "postings_seconds": t_pass}
    if b.out_dir is None:
        return _in_memory(b, lists, curvature, R, timing)
    return _on_disk(b, b.out_dir, curvature, R, timing)


def _plan(
    net: PrismLM,
    shards: ShardSet,
    cfg: AttributionConfig,
    out: str | Path | None,
    curvature: Curvature | None,
    part: tuple[int, int],
    model_sha256: str | None,
) -> _Build:
    """Check the model and the options (before any pass) and size the build."""
    if net.prototypes is None:
        raise ModelError("an attribution cache needs a PRISM model; this is the dense baseline (it has no prototypes)")
    ident = model_sha256 or model_identity(net)
    d, K, T = net.config.n_embd, net.prototypes.num_prototypes, net.config.block_size
    r = d if cfg.r is None else int(cfg.r)
    check_storage(cfg, r)  # before the passes, not after them
    R = None
    if cfg.projection not in ("pca", "pca-local"):
        R = torch.from_numpy(make_projection(d, r, cfg.projection, cfg.seed))  # (r, d)
    n_all = shards.train.num_sequences(T)
    universe = n_all if cfg.max_sequences is None else min(n_all, cfg.max_sequences)
    if universe < 1:
        raise ArtifactError(f"the training split has no complete sequence of {T + 1} tokens")
    start, stop = part_range(universe, cfg.batch_size, part)
    started: BuildStart = {
        "model_sha256": ident,
        "shard_key": shards.manifest["key"],
        "part": list(part),
        "universe": universe,
        "options": cfg.to_dict(),
        "curvature_given": curvature is not None,
        "curvature_F": None if curvature is None else _tensor_digest(curvature.F),
    }
    npdt = FLOAT_DTYPES[cfg.dtype] if cfg.dtype in FLOAT_DTYPES else np.float32
    widths = {"seq": 4, "proto": 4, "sketch": r * np.dtype(npdt).itemsize}
    out_dir = Path(out) if out is not None else None
    return _Build(net, shards, cfg, ident, d, K, T, r, universe, start, stop, part, out_dir, started, npdt, widths, R)


def _fit(
    b: _Build, curvature: Curvature | None, kept: BatchStore, progress: Progress
) -> tuple[Curvature, torch.Tensor, float]:
    """(curvature, projection R (r, d), seconds): fitted (and saved for a resume), or a resumed build's."""
    projection, tmp_dir, state = b.cfg.projection, b.tmp_dir, b.state
    t0 = time.perf_counter()
    if state is not None:  # a resumed build: the saved curvature and projection, no fit passes
        assert tmp_dir is not None
        curvature = curvature if curvature is not None else Curvature.load(tmp_dir / "curvature.safetensors")
        R = torch.from_numpy(np.load(tmp_dir / "projection.npy"))
        return curvature, R, time.perf_counter() - t0 + state["curvature_seconds"]
    if curvature is None:
        curvature = sampled_curvature(b.net, b.shards, b.cfg, b.universe, progress=progress, keep=kept)
    if b.R is not None:
        R = b.R
    else:
        with eval_mode(b.net):
            pca = pca_projection(
                b.net,
                b.shards,
                curvature,
                b.r,
                min(b.universe, b.cfg.pca_sequences),
                b.cfg.batch_size,
                local=projection == "pca-local",
                universe=b.universe,
                keep=kept,
            )
        R = torch.from_numpy(pca)
    if tmp_dir is not None:  # what a resumed build reads instead of fitting again (checked by its sha256)
        curvature.save(tmp_dir / "curvature.safetensors")
        np.save(tmp_dir / "projection.npy", R.numpy())
    return curvature, R, time.perf_counter() - t0


def _postings_pass(
    b: _Build, sketcher: PostingSketcher, kept: BatchStore, t_curv: float, progress: Progress
) -> tuple[dict[str, list[np.ndarray]], int, float]:
    """The streaming postings pass over [done_to, stop): each batch's (seq, proto, sketch) rows go to the
    build folder's raw files (or to in-memory ``lists`` without ``out``). Returns (lists, tokens, seconds)."""
    state, tmp_dir, T = b.state, b.tmp_dir, b.T
    files: PostingFiles | None = None
    lists: dict[str, list[np.ndarray]] = {"seq": [], "proto": [], "sketch": []}
    done_to, tokens = (state["done_to"], state["tokens"]) if state else (b.start, 0)
    if tmp_dir is not None:  # rows after the last good batch (a torn write, a damaged batch) are dropped
        files = PostingFiles(tmp_dir, b.resumed)
        files.open(
            b.widths,
            None
            if b.resumed
            else {**b.started, "start": b.start, "fitted": record_fitted(tmp_dir), "curvature_seconds": t_curv},
        )
    t1 = time.perf_counter()
    pass_before = state["postings_seconds"] if state else 0.0
    try:
        with (
            eval_mode(b.net),
            Reporter(progress, "postings", b.stop - b.start, unit="seq", initial=done_to - b.start) as bar,
        ):
            if b.resumed is not None and b.resumed.note:
                bar.message(b.resumed.note)
            for j0, j1 in batch_grid(done_to, b.stop, b.cfg.batch_size):
                bg = posting_batch(b.net, b.shards, j0, j1, kept)
                sk = sketcher(bg.proto.cpu(), bg.grad.cpu())  # (rows, r)
                rows = {
                    "seq": bg.seq.cpu().numpy().astype(np.int32),
                    "proto": bg.proto.cpu().numpy().astype(np.int32),
                    "sketch": sk.numpy().astype(b.npdt),
                }
                tokens += (j1 - j0) * T
                bar.update(j1 - j0)
                if files is not None:  # the batch whole on disk, then recorded (a resume continues after it)
                    files.append(rows, j1=j1, tokens=tokens, seconds=pass_before + time.perf_counter() - t1)
                else:
                    for k, v in rows.items():
                        lists[k].append(v)
    finally:
        if files is not None:
            files.close()
    return lists, tokens, pass_before + time.perf_counter() - t1


def _store(
    b: _Build, offsets: np.ndarray, seq: np.ndarray, sk: np.ndarray, work: Path | None, stage: Path | None
) -> tuple[np.ndarray, Ids, Sketches]:
    """CSR float postings → the configured storage (the CSR arrays themselves when plain)."""
    if b.plain:
        return offsets, PlainIds(seq), FloatSketches(sk)
    o, ids, sks, meta = encode_postings(offsets, seq, sk, b.K, b.r, b.cfg, units_of=b.units_of, work=work, out=stage)
    b.encoded.update(meta)
    return o, ids, sks


def _manifest(b: _Build, curvature: Curvature, ids: Ids, sks: Sketches, timing: _Timing) -> CacheManifest:
    """The cache's manifest: identity and fit options; ``cache_manifest`` adds the storage options and
    postings statistics. ``timing``: tokens, curvature_seconds, postings_seconds."""
    cfg, projection = b.cfg, b.cfg.projection
    base: CacheManifest = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "model_sha256": b.ident,
        "shard_key": b.shards.manifest["key"],
        "shards_root": str(Path(b.shards.root).resolve()),
        "split": "train",
        "num_prototypes": b.K,
        "d": b.d,
        "block_size": b.T,
        "r": b.r,
        "projection": projection,
        "seed": cfg.seed,
        "pca_sequences": cfg.pca_sequences if projection.startswith("pca") else None,
        "curvature_mode": curvature.mode,
        "damping": curvature.damping,
        "curvature_sample": cfg.curvature_sample,
        "curvature_tokens": curvature.tokens,
        "batch_size": cfg.batch_size,
        "universe": b.universe,
        "part": list(b.part),
    }
    return cache_manifest(
        base,
        ids=ids,
        sketches=sks,
        units_of=b.units_of,
        universe=b.universe,
        tokens=timing["tokens"],
        covered=[[b.start, b.stop]] if b.stop > b.start else [],
        storage=cfg,
        encoded=b.encoded,
        curvature_seconds=timing["curvature_seconds"],
        postings_seconds=timing["postings_seconds"],
        created=created(),
        **provenance(),
    )


def _in_memory(
    b: _Build, lists: dict[str, list[np.ndarray]], curvature: Curvature, R: torch.Tensor, timing: _Timing
) -> AttributionCache:
    """The cache of a build without ``out``: the postings pass's rows grouped in memory."""
    seq = np.concatenate(lists["seq"]) if lists["seq"] else np.zeros(0, np.int32)
    proto = np.concatenate(lists["proto"]) if lists["proto"] else np.zeros(0, np.int32)
    sketch = np.concatenate(lists["sketch"]) if lists["sketch"] else np.zeros((0, b.r), b.npdt)
    offsets, ids, sks = _store(b, *to_csr(seq, proto, sketch, b.K, None, b.npdt, b.r), None, None)
    return AttributionCache(
        offsets=offsets,
        ids=ids,
        sketches=sks,
        projection=R.numpy(),
        curvature=curvature,
        manifest=_manifest(b, curvature, ids, sks, timing),
        units_of=None if b.units_of is None else b.units_of.astype(np.int32),
    )


def _on_disk(b: _Build, out_dir: Path, curvature: Curvature, R: torch.Tensor, timing: _Timing) -> AttributionCache:
    """The artifact at ``out_dir`` from the build folder's raw files (written atomically), then loaded."""
    tmp_dir, r, npdt = b.tmp_dir, b.r, b.npdt
    assert tmp_dir is not None
    seq = np.fromfile(tmp_dir / "seq.raw", dtype=np.int32)
    proto = np.fromfile(tmp_dir / "proto.raw", dtype=np.int32)
    sketch = (
        np.memmap(tmp_dir / "sketch.raw", dtype=npdt, mode="r", shape=(len(seq), r))
        if len(seq)
        else np.zeros((0, r), npdt)
    )
    with atomic_dir(out_dir) as stage:  # the sorted arrays are written as .npy under the stage
        # plain: sorted straight into the stage; otherwise sorted under the build folder, then encoded
        csr = to_csr(seq, proto, sketch, b.K, stage if b.plain else tmp_dir / "csr", npdt, r)
        offsets, ids, sks = _store(b, *csr, tmp_dir, stage)
        manifest = _manifest(b, curvature, ids, sks, timing)
        arrays = {"offsets.npy": offsets, **ids.arrays(), **sks.arrays()}
        if b.units_of is not None:
            arrays["units.npy"] = b.units_of.astype(np.int32)
        write_arrays(stage, arrays)
        del csr, ids, sks, sketch, arrays
        np.save(stage / "projection.npy", R.numpy())
        curvature.save(stage / "curvature.safetensors")
        manifest["files"] = file_records(stage)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    return AttributionCache.load(out_dir)
