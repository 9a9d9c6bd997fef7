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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prismlm.artifacts import atomic_dir, file_records, model_identity, part_range, provenance, writes_folder
from prismlm.config import AttributionConfig
from prismlm.errors import ArtifactError, ConfigError, ModelError
from prismlm.model import eval_mode
from prismlm.progress import Progress, Reporter
from prismlm.tda.build_state import PostingFiles, Resumed, record_fitted, resume_build
from prismlm.tda.cache.codecs import FLOAT_DTYPES, FloatSketches, Ids, PlainIds, Sketches
from prismlm.tda.cache.encoding import check_storage, document_of_sequences, encode_postings, to_csr
from prismlm.tda.cache.manifest import FORMAT_VERSION, KIND, cache_manifest, created
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


def _finished_build(out_dir: Path, started: dict[str, Any], shards: ShardSet) -> AttributionCache:
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
            fix="rerun without --resume to rebuild it, or choose another --out",
            path=out_dir,
        )
    return cache


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
    cfg = config if config is not None else AttributionConfig()
    net = model
    if net.prototypes is None:
        raise ModelError("an attribution cache needs a PRISM model; this is the dense baseline (it has no prototypes)")
    ident = model_sha256 or model_identity(net)
    d, K, T = net.config.n_embd, net.prototypes.num_prototypes, net.config.block_size
    r = d if cfg.r is None else int(cfg.r)
    projection, batch_size, dtype = cfg.projection, cfg.batch_size, cfg.dtype
    check_storage(cfg, r)  # before the passes, not after them
    if projection not in ("pca", "pca-local"):
        R = torch.from_numpy(make_projection(d, r, projection, cfg.seed))  # (r, d)
    n_all = shards.train.num_sequences(T)
    universe = n_all if cfg.max_sequences is None else min(n_all, cfg.max_sequences)
    if universe < 1:
        raise ArtifactError(f"the training split has no complete sequence of {T + 1} tokens")
    start, stop = part_range(universe, batch_size, part)
    out_dir = Path(out) if out is not None else None
    if resume and out_dir is None:
        raise ConfigError("resuming a cache build needs its output folder (out)")
    tmp_dir = None
    # what a resumed build must share with the one it continues (the storage options are applied at the end)
    started = {
        "model_sha256": ident,
        "shard_key": shards.manifest["key"],
        "part": list(part),
        "universe": universe,
        "options": cfg.to_dict(),
        "curvature_given": curvature is not None,
        "curvature_F": None if curvature is None else _tensor_digest(curvature.F),
    }
    # the raw postings keep float32 (float64/float16 when stored so); int8/int4/int3 are encoded from float32
    npdt = FLOAT_DTYPES[dtype] if dtype in FLOAT_DTYPES else np.float32
    widths = {"seq": 4, "proto": 4, "sketch": r * np.dtype(npdt).itemsize}  # bytes per row of each raw file
    resumed: Resumed | None = None
    if out_dir is not None:
        tmp_dir = out_dir.with_name(out_dir.name + ".build")
        if resume:
            if not tmp_dir.exists() and (out_dir / "manifest.json").exists():
                return _finished_build(out_dir, started, shards)
            # checked before anything is read: a damaged batch and those after it are built again
            resumed = resume_build(tmp_dir, started, widths)
        if resumed is None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir.mkdir(parents=True)
    state = resumed.state if resumed is not None else None
    # the batches the curvature and projection fits run through the model keep their block gradients for
    # the postings pass (up to curvature_sample + pca_sequences sequences: fewer forwards, same postings)
    kept = BatchStore(None if tmp_dir is None else tmp_dir / "fitted", start, stop, batch_size)
    t0 = time.perf_counter()
    if state is not None:  # a resumed build: the saved curvature and projection, no fit passes
        assert tmp_dir is not None
        curvature = curvature if curvature is not None else Curvature.load(tmp_dir / "curvature.safetensors")
        R = torch.from_numpy(np.load(tmp_dir / "projection.npy"))
    else:
        if curvature is None:
            curvature = sampled_curvature(net, shards, cfg, universe, progress=progress, keep=kept)
        if projection in ("pca", "pca-local"):
            with eval_mode(net):
                R = torch.from_numpy(
                    pca_projection(
                        net,
                        shards,
                        curvature,
                        r,
                        min(universe, cfg.pca_sequences),
                        batch_size,
                        local=projection == "pca-local",
                        universe=universe,
                        keep=kept,
                    )
                )
        if tmp_dir is not None:  # what a resumed build reads instead of fitting again (checked by its sha256)
            curvature.save(tmp_dir / "curvature.safetensors")
            np.save(tmp_dir / "projection.npy", R.numpy())
    t_curv = time.perf_counter() - t0 + (state["curvature_seconds"] if state else 0.0)
    model_dt = torch.promote_types(next(net.parameters()).dtype, torch.float32)
    # float16 and float64 sketches are rounded from float64 (what lossless_options' float64 parts give)
    sketcher = PostingSketcher(curvature, R, torch.float64 if dtype in ("float16", "float64") else model_dt)
    plain = dtype in FLOAT_DTYPES and cfg.prune == 0 and cfg.aggregate == "sequence" and cfg.id_encoding == "int32"
    units_of = document_of_sequences(shards, universe, T) if cfg.aggregate == "document" else None
    files: PostingFiles | None = None
    lists: dict[str, list[np.ndarray]] = {"seq": [], "proto": [], "sketch": []}
    done_to, tokens = (state["done_to"], state["tokens"]) if state else (start, 0)
    if tmp_dir is not None:  # rows after the last good batch (a torn write, a damaged batch) are dropped
        files = PostingFiles(tmp_dir, resumed)
        files.open(
            widths,
            None
            if resumed
            else {**started, "start": start, "fitted": record_fitted(tmp_dir), "curvature_seconds": t_curv},
        )
    t1 = time.perf_counter()
    pass_before = state["postings_seconds"] if state else 0.0
    try:
        with eval_mode(net), Reporter(progress, "postings", stop - start, unit="seq", initial=done_to - start) as bar:
            if resumed is not None and resumed.note:
                bar.message(resumed.note)
            for j0, j1 in batch_grid(done_to, stop, batch_size):
                bg = posting_batch(net, shards, j0, j1, kept)
                pr = bg.proto.cpu()
                sk = sketcher(pr, bg.grad.cpu())  # (rows, r)
                rows = {
                    "seq": bg.seq.cpu().numpy().astype(np.int32),
                    "proto": bg.proto.cpu().numpy().astype(np.int32),
                    "sketch": sk.numpy().astype(npdt),
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
    t_pass = pass_before + time.perf_counter() - t1
    base = {  # identity and fit options; cache_manifest adds the storage options and postings statistics
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "model_sha256": ident,
        "shard_key": shards.manifest["key"],
        "shards_root": str(Path(shards.root).resolve()),
        "split": "train",
        "num_prototypes": K,
        "d": d,
        "block_size": T,
        "r": r,
        "projection": projection,
        "seed": cfg.seed,
        "pca_sequences": cfg.pca_sequences if projection.startswith("pca") else None,
        "curvature_mode": curvature.mode,
        "damping": curvature.damping,
        "curvature_sample": cfg.curvature_sample,
        "curvature_tokens": curvature.tokens,
        "batch_size": batch_size,
        "universe": universe,
        "part": list(part),
    }
    encoded: dict[str, Any] = {}

    def _store(
        offsets: np.ndarray, seq: np.ndarray, sk: np.ndarray, work: Path | None, stage: Path | None
    ) -> tuple[np.ndarray, Ids, Sketches]:
        """CSR float postings → the configured storage (the CSR arrays themselves when plain)."""
        if plain:
            return offsets, PlainIds(seq), FloatSketches(sk)
        o, ids, sks, meta = encode_postings(offsets, seq, sk, K, r, cfg, units_of=units_of, work=work, out=stage)
        encoded.update(meta)
        return o, ids, sks

    def _manifest(ids: Ids, sks: Sketches) -> dict[str, Any]:
        return cache_manifest(
            base,
            ids=ids,
            sketches=sks,
            units_of=units_of,
            universe=universe,
            tokens=tokens,
            covered=[[start, stop]] if stop > start else [],
            storage=cfg,
            encoded=encoded,
            curvature_seconds=t_curv,
            postings_seconds=t_pass,
            created=created(),
            **provenance(),
        )

    if out_dir is None:
        seq = np.concatenate(lists["seq"]) if lists["seq"] else np.zeros(0, np.int32)
        proto = np.concatenate(lists["proto"]) if lists["proto"] else np.zeros(0, np.int32)
        sketch = np.concatenate(lists["sketch"]) if lists["sketch"] else np.zeros((0, r), npdt)
        offsets, ids, sks = _store(*to_csr(seq, proto, sketch, K, None, npdt, r), None, None)
        return AttributionCache(
            offsets=offsets,
            ids=ids,
            sketches=sks,
            projection=R.numpy(),
            curvature=curvature,
            manifest=_manifest(ids, sks),
            units_of=None if units_of is None else units_of.astype(np.int32),
        )
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
        csr = to_csr(seq, proto, sketch, K, stage if plain else tmp_dir / "csr", npdt, r)
        offsets, ids, sks = _store(*csr, tmp_dir, stage)
        manifest = _manifest(ids, sks)
        arrays = {"offsets.npy": offsets, **ids.arrays(), **sks.arrays()}
        if units_of is not None:
            arrays["units.npy"] = units_of.astype(np.int32)
        write_arrays(stage, arrays)
        del csr, ids, sks, sketch, arrays
        np.save(stage / "projection.npy", R.numpy())
        curvature.save(stage / "curvature.safetensors")
        manifest["files"] = file_records(stage)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    return AttributionCache.load(out_dir)
