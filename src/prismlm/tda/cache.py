"""Cached statistics for fast prototype-space attribution (spec §3.2): an inverted index prototype → postings.

For every (training sequence j, active prototype i) the cache stores a posting ``(j, s_{j,i})`` with the
r-dimensional sketch ``s_{j,i} = R H_i^{-1/2} G_{j,i}`` (``R``: a fixed r × d projection, the same for all
prototypes). For a query, ``s_{q,i} = R H_i^{-1/2} G_{q,i}`` and

    score(q, j) = Σ_{i ∈ A_q} Σ_{postings (j, s) of i} s_{q,i} · s   ≈ Σ_i G_{q,i}ᵀ H_i⁻¹ G_{j,i} = I(q, j),

exact when ``RᵀR = I`` (``projection="identity"``, or ``"orthogonal"``/``"pca"`` with r = d). For r < d:
``"orthogonal"`` (r random orthonormal rows scaled by √(d/r); E[RᵀR] = I), ``"gaussian"`` (a JL matrix
with N(0, 1/r) entries), or ``"pca"`` (the top-r principal directions of the whitened block gradients
H_i^{-1/2} G_{j,i}, fitted on the first ``pca_sequences`` training sequences: the data-dependent choice
the spec lists as a candidate). H_i^{-1/2} weights *low*-curvature directions most, so the sketch is taken after
whitening, never by keeping F's top eigenvectors.

**Building.** ``build_cache`` makes a curvature pass (or takes a ``Curvature``) and then one streaming pass
over the training sequences, appending postings to temporary files; at the end they are grouped by
prototype (stable, so within a prototype postings ascend by sequence id) into CSR arrays. A query is one
forward pass plus a vectorised scan of its prototypes' postings: ``Σ_{i∈A_q} |postings(i)| · r``
multiply-adds.

**Artifact.** A folder: ``offsets.npy`` (K+1 int64), ``seq.npy`` (P int32), ``sketch.npy`` (P × r,
float16/32/64), ``projection.npy`` (r × d float64), ``curvature.safetensors``, ``manifest.json`` (kind,
format, model_sha256, shard_key, r, projection, seed, covered sequences, tokens, postings, bytes per
training token, build seconds). The arrays are memory-mapped on load. Loading the cache for another
checkpoint or another corpus raises ``ArtifactMismatch`` (the prototype index's error), naming both.

**Parts.** ``build_cache(..., part=(i, n))`` caches one batch-aligned slice of the sequences (give every
part the same ``curvature``); ``merge_caches`` concatenates parts into one cache equal to a single pass.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

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
)
from prismlm.config import AttributionConfig
from prismlm.errors import ArtifactError, ArtifactMismatch, ConfigError, ModelError
from prismlm.model import eval_mode
from prismlm.progress import Progress, Reporter
from prismlm.tda.gradients import BlockGradients, block_gradients
from prismlm.tda.influence import Curvature, _batches, _forward, curvature_pass

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM

__all__ = ["AttributionCache", "build_cache", "make_projection", "merge_caches"]

KIND = "prismlm-attribution-cache"
FORMAT_VERSION = 1
_DTYPES: dict[str, type[np.floating]] = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def make_projection(d: int, r: int, kind: Literal["identity", "orthogonal", "gaussian", "pca"] = "orthogonal",
                    seed: int = 0) -> np.ndarray:
    """The fixed r × d sketch matrix R (float64)."""
    if kind == "identity":
        if r != d:
            raise ConfigError(f"projection 'identity' needs r = d = {d}, got r = {r}; leave r unset (--r) or "
                              f"choose another projection")
        return np.eye(d)
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return (torch.randn(r, d, generator=g, dtype=torch.float64) / math.sqrt(r)).numpy()
    if kind == "orthogonal":
        if r > d:
            raise ConfigError(f"projection 'orthogonal' needs r <= d = {d}, got r = {r} (option --r)")
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        return (q[:, :r].T * math.sqrt(d / r)).numpy()
    raise ConfigError(f"unknown projection {kind!r} (option --projection): use identity, orthogonal, gaussian or pca")


def _pca_projection(net: PrismLM, shards: ShardSet, curvature: Curvature, r: int, n: int, batch_size: int) -> np.ndarray:
    """Top-r eigenvectors (rows) of the second moment of whitened block gradients of sequences [0, n)."""
    d = net.config.n_embd
    if r > d:
        raise ConfigError(f"projection 'pca' needs r <= d = {d}, got r = {r} (option --r)")
    T, dev = net.config.block_size, next(net.parameters()).device
    C = torch.zeros(d, d, dtype=torch.float64)
    for j0, j1 in _batches(0, n, batch_size):
        fo, y = _forward(net, shards, j0, j1, T, dev)
        bg = block_gradients(net, fo, y)
        w = curvature.apply(bg.proto.cpu(), bg.grad.double().cpu(), -0.5)  # (rows, d)
        C += w.T @ w
    _, V = torch.linalg.eigh(C)
    return V[:, -r:].flip(1).T.contiguous().numpy()


@dataclass
class AttributionCache:
    """The inverted index prototype → postings (memory-mapped) and what it needs to sketch a query."""

    offsets: np.ndarray
    """(K+1,) int64: postings of prototype i are rows offsets[i]:offsets[i+1]."""
    seq: np.ndarray
    """(P,) int32: training sequence id of each posting (ascending within a prototype)."""
    sketch: np.ndarray
    """(P, r): R H_i^{-1/2} G_{j,i}."""
    projection: np.ndarray
    """(r, d) float64: R."""
    curvature: Curvature
    manifest: dict[str, Any]
    path: Path | None = field(default=None, compare=False)

    @property
    def num_prototypes(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def r(self) -> int:
        return int(self.projection.shape[0])

    @property
    def num_postings(self) -> int:
        return int(self.seq.shape[0])

    @property
    def num_train(self) -> int:
        return int(self.manifest["universe"])

    def nbytes(self) -> int:
        """Bytes of the postings (sequence ids + sketches), what a query scans."""
        return int(self.seq.nbytes + self.sketch.nbytes + self.offsets.nbytes)

    # ----- identity checks ------------------------------------------------------------------------------
    def check(self, *, model_sha256: str | None = None, shards: ShardSet | None = None,
              shard_key: str | None = None) -> None:
        """Raise ``ArtifactMismatch`` unless the cache was built from this model (``model_sha256``: a
        checkpoint's ``manifest["model_sha256"]``) and these shards (``shards`` or their ``shard_key``)."""
        where = f" {self.path}" if self.path else ""
        if shards is not None:
            shard_key = shards.manifest["key"]
        check_provenance(self.manifest, what=f"attribution cache{where}", rebuild="prism attribute-cache",
                         model_sha256=model_sha256, shard_key=shard_key)

    # ----- queries --------------------------------------------------------------------------------------
    def sketch_query(self, query: BlockGradients) -> torch.Tensor:
        """(Rq, r) sketches R H_i^{-1/2} G_{q,i} of a query's block gradients (float64)."""
        W = self.curvature.apply(query.proto.cpu(), query.grad.detach().double().cpu(), -0.5)  # (Rq, d)
        return W @ torch.from_numpy(self.projection).T  # (Rq, r)

    def scores(self, query: BlockGradients, num_queries: int, *, contributions: bool = False):
        """(num_queries, num_train) float64 scores from a postings scan. With ``contributions=True`` also
        returns, per query, the flat arrays (seq, proto, contribution) of every scanned posting."""
        sq = self.sketch_query(query)  # (Rq, r)
        out = torch.zeros(num_queries, self.num_train, dtype=torch.float64)
        contrib_out = []
        qseq, qproto = query.seq.cpu(), query.proto.cpu()
        for q in range(num_queries):  # queries are few; each scan below is vectorised
            sel = qseq == q
            protos = qproto[sel].numpy()
            lo, hi = self.offsets[protos], self.offsets[protos + 1]
            n = hi - lo
            if n.sum() == 0:
                contrib_out.append((np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)))
                continue
            # concatenated ranges lo_i..hi_i, with the query row of each posting
            rep = np.repeat(np.arange(len(protos)), n)
            rows = lo[rep] + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
            s = torch.from_numpy(np.asarray(self.sketch[rows], dtype=np.float64))  # (P_q, r)
            c = (s * sq[sel][torch.from_numpy(rep)]).sum(1)  # (P_q,)
            seq = torch.from_numpy(np.asarray(self.seq[rows], dtype=np.int64))
            out[q].index_add_(0, seq, c)
            if contributions:
                contrib_out.append((seq.numpy(), protos[rep], c.numpy()))
        return (out, contrib_out) if contributions else out

    # ----- persistence ----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with atomic_dir(path) as tmp:
            np.save(tmp / "offsets.npy", np.asarray(self.offsets))
            np.save(tmp / "seq.npy", np.asarray(self.seq))
            np.save(tmp / "sketch.npy", np.asarray(self.sketch))
            np.save(tmp / "projection.npy", self.projection)
            self.curvature.save(tmp / "curvature.safetensors")
            self.manifest["files"] = file_records(tmp)
            (tmp / "manifest.json").write_text(json.dumps(self.manifest, indent=2) + "\n")
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path, *, model_sha256: str | None = None, shards: ShardSet | None = None,
             mmap: bool = True) -> AttributionCache:
        """Open a saved cache (arrays memory-mapped when ``mmap``); with ``model_sha256`` and ``shards`` it
        is checked against them (``ArtifactMismatch``)."""
        path = Path(path)
        if not (path / "manifest.json").exists():
            raise ArtifactError(f"no attribution cache at {path}; build it with `prism attribute-cache`")
        with reading(path / "manifest.json", "attribution cache manifest", fix="prism attribute-cache RUN"):
            manifest = json.loads((path / "manifest.json").read_text())
        if manifest.get("kind") != KIND:
            raise ArtifactError(f"{path} is not an attribution cache (kind {manifest.get('kind')!r})")
        verify_files(path, manifest.get("files"), what="attribution cache",
                     fix="rebuild it with `prism attribute-cache RUN`")
        mode: Literal["r"] | None = "r" if mmap else None
        with reading(path, "attribution cache", fix="prism attribute-cache RUN"):
            c = cls(offsets=np.load(path / "offsets.npy"), seq=np.load(path / "seq.npy", mmap_mode=mode),
                    sketch=np.load(path / "sketch.npy", mmap_mode=mode), projection=np.load(path / "projection.npy"),
                    curvature=Curvature.load(path / "curvature.safetensors"), manifest=manifest, path=path)
        c.check(model_sha256=model_sha256, shards=shards)
        return c


def _finalise(seq: np.ndarray, proto: np.ndarray, sketch: np.ndarray, K: int, out_dir: Path | None,
              dtype: type[np.floating], r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group postings by prototype (stable: sequence order kept) into CSR arrays (memory-mapped when
    ``out_dir`` is given)."""
    order = np.argsort(proto, kind="stable")
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(proto, minlength=K), out=offsets[1:])
    P = len(order)
    seq_o: np.ndarray
    sk_o: np.ndarray
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        seq_o = np.lib.format.open_memmap(out_dir / "seq.npy", mode="w+", dtype=np.int32, shape=(P,))
        sk_o = np.lib.format.open_memmap(out_dir / "sketch.npy", mode="w+", dtype=dtype, shape=(P, r))
    else:
        seq_o, sk_o = np.empty(P, np.int32), np.empty((P, r), dtype)
    step = 1 << 16
    for s in range(0, P, step):  # chunks of postings bound the memory of the gather
        o = order[s:s + step]
        seq_o[s:s + step] = seq[o]
        sk_o[s:s + step] = sketch[o]
    return offsets, seq_o, sk_o


def build_cache(
    model: PrismLM,
    shards: ShardSet,
    config: AttributionConfig | None = None,
    *,
    out: str | Path | None = None,
    curvature: Curvature | None = None,
    part: tuple[int, int] = (0, 1),
    model_sha256: str | None = None,
    progress: Progress = False,
) -> AttributionCache:
    """Build the postings cache of a PRISM ``model`` over ``shards.train``.

    ``config``: the attribution options (sketch size and projection, curvature mode and damping, sequences,
    batch size, storage dtype; default ``AttributionConfig()``). ``out``: write the artifact there
    (postings go to memory-mapped files). ``curvature``: reuse one (required to make parts agree), else a
    curvature pass over the first ``config.max_sequences`` sequences is made first. ``part=(i, n)``: only
    the i-th batch-aligned slice. ``model_sha256``: the identity recorded in the manifest (pass the
    checkpoint's ``manifest["model_sha256"]``; None: a hash of the weights, ``model_identity``).
    """
    cfg = config if config is not None else AttributionConfig()
    net = model
    if net.prototypes is None:
        raise ModelError("an attribution cache needs a PRISM model; this is the dense baseline (it has no prototypes)")
    ident = model_sha256 or model_identity(net)
    d, K, T = net.config.n_embd, net.prototypes.num_prototypes, net.config.block_size
    r = d if cfg.r is None else int(cfg.r)
    projection, batch_size, dtype = cfg.projection, cfg.batch_size, cfg.dtype
    if projection != "pca":
        R = torch.from_numpy(make_projection(d, r, projection, cfg.seed))  # (r, d)
    n_all = shards.train.num_sequences(T)
    universe = n_all if cfg.max_sequences is None else min(n_all, cfg.max_sequences)
    if universe < 1:
        raise ArtifactError(f"the training split has no complete sequence of {T + 1} tokens")
    start, stop = part_range(universe, batch_size, part)
    t0 = time.perf_counter()
    if curvature is None:
        curvature = curvature_pass(net, shards, sequences=(0, universe), batch_size=batch_size,
                                   exact=cfg.curvature_mode == "exact", damping=cfg.damping, progress=progress)
    if projection == "pca":
        with eval_mode(net):
            R = torch.from_numpy(_pca_projection(net, shards, curvature, r, min(universe, cfg.pca_sequences),
                                                 batch_size))
    t_curv = time.perf_counter() - t0
    npdt = _DTYPES[dtype]
    dev = next(net.parameters()).device
    out_dir = Path(out) if out is not None else None
    tmp_dir = None
    files = {}
    lists: dict[str, list[np.ndarray]] = {"seq": [], "proto": [], "sketch": []}
    if out_dir is not None:
        tmp_dir = out_dir.with_name(out_dir.name + ".build")
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir(parents=True)
        files = {k: open(tmp_dir / f"{k}.raw", "wb") for k in ("seq", "proto", "sketch")}
    t1 = time.perf_counter()
    tokens = 0
    try:
        with eval_mode(net), Reporter(progress, "postings", stop - start, unit="seq") as bar:
            for j0, j1 in _batches(start, stop, batch_size):
                fo, y = _forward(net, shards, j0, j1, T, dev)
                bg = block_gradients(net, fo, y, seq_ids=torch.arange(j0, j1, device=dev))
                sk = curvature.apply(bg.proto.cpu(), bg.grad.double().cpu(), -0.5) @ R.T  # (rows, r)
                rows = {"seq": bg.seq.cpu().numpy().astype(np.int32),
                        "proto": bg.proto.cpu().numpy().astype(np.int32), "sketch": sk.numpy().astype(npdt)}
                tokens += (j1 - j0) * T
                bar.update(j1 - j0)
                for k, v in rows.items():
                    if out_dir is not None:
                        files[k].write(np.ascontiguousarray(v).tobytes())
                    else:
                        lists[k].append(v)
    finally:
        for f in files.values():
            f.close()
    t_pass = time.perf_counter() - t1
    manifest: dict[str, Any] = {
        "kind": KIND, "format_version": FORMAT_VERSION, "model_sha256": ident,
        "shard_key": shards.manifest["key"], "shards_root": str(Path(shards.root).resolve()),
        "split": "train", "num_prototypes": K, "d": d, "block_size": T, "r": r, "projection": projection,
        "seed": cfg.seed, "pca_sequences": cfg.pca_sequences if projection == "pca" else None, "dtype": dtype,
        "curvature_mode": curvature.mode, "damping": curvature.damping,
        "curvature_tokens": curvature.tokens, "batch_size": batch_size, "universe": universe,
        "part": list(part), "covered": [[start, stop]] if stop > start else [], "tokens": tokens,
    }

    def _finish(P: int) -> None:
        bytes_postings = P * (4 + r * np.dtype(npdt).itemsize)
        manifest.update({
            "postings": P, "postings_per_sequence": P / max(1, stop - start),
            "bytes_postings": bytes_postings, "bytes_per_token": bytes_postings / max(1, tokens),
            "curvature_seconds": t_curv, "postings_seconds": t_pass,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **provenance(),
        })

    if out_dir is None:
        seq = np.concatenate(lists["seq"]) if lists["seq"] else np.zeros(0, np.int32)
        proto = np.concatenate(lists["proto"]) if lists["proto"] else np.zeros(0, np.int32)
        sketch = np.concatenate(lists["sketch"]) if lists["sketch"] else np.zeros((0, r), npdt)
        offsets, seq_o, sk_o = _finalise(seq, proto, sketch, K, None, npdt, r)
        _finish(len(seq_o))
        return AttributionCache(offsets=offsets, seq=seq_o, sketch=sk_o, projection=R.numpy(), curvature=curvature,
                                manifest=manifest)
    assert tmp_dir is not None
    seq = np.fromfile(tmp_dir / "seq.raw", dtype=np.int32)
    proto = np.fromfile(tmp_dir / "proto.raw", dtype=np.int32)
    sketch = np.memmap(tmp_dir / "sketch.raw", dtype=npdt, mode="r", shape=(len(seq), r)) if len(seq) else \
        np.zeros((0, r), npdt)
    with atomic_dir(out_dir) as stage:  # the sorted arrays are written as .npy under the stage
        offsets, seq_o, sk_o = _finalise(seq, proto, sketch, K, stage, npdt, r)
        _finish(len(seq_o))
        for arr in (seq_o, sk_o):
            if isinstance(arr, np.memmap):
                arr.flush()
        del seq_o, sk_o, sketch
        np.save(stage / "offsets.npy", offsets)
        np.save(stage / "projection.npy", R.numpy())
        curvature.save(stage / "curvature.safetensors")
        manifest["files"] = file_records(stage)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    return AttributionCache.load(out_dir)


def merge_caches(parts: list[AttributionCache], out: str | Path | None = None) -> AttributionCache:
    """Combine caches of disjoint sequence ranges (same model, shards, curvature, projection) into one,
    equal to a single pass (postings grouped by prototype, ascending sequence id within each)."""
    if not parts:
        raise ArtifactError("nothing to merge")
    first = parts[0].manifest
    for p in parts[1:]:
        m = p.manifest
        for key in ("model_sha256", "shard_key"):
            if m[key] != first[key]:
                raise ArtifactMismatch(f"cannot merge caches: {key} differs ({first[key]} vs {m[key]})")
        for key in ("r", "projection", "seed", "dtype", "num_prototypes", "universe", "curvature_mode"):
            if m[key] != first[key]:
                raise ArtifactError(f"cannot merge caches: {key} differs ({first[key]} vs {m[key]})")
        if not (np.array_equal(p.projection, parts[0].projection)
                and torch.equal(p.curvature.F, parts[0].curvature.F) and torch.equal(p.curvature.m, parts[0].curvature.m)):
            raise ArtifactError("cannot merge caches built with different curvature or projection; pass the same "
                              "`curvature` to every part")
    covered: list[list[int]] = []
    for p in parts:
        ov = overlap(covered, merge_ranges(p.manifest["covered"]))
        if ov is not None:
            raise ArtifactError(f"cannot merge caches: parts overlap on sequences [{ov[0]}, {ov[1]})")
        covered = merge_ranges(covered + p.manifest["covered"])
    parts = sorted(parts, key=lambda p: p.manifest["covered"][0][0] if p.manifest["covered"] else 0)
    K = parts[0].num_prototypes
    seq = np.concatenate([np.asarray(p.seq) for p in parts])
    proto = np.concatenate([np.repeat(np.arange(K, dtype=np.int32), np.diff(p.offsets)) for p in parts])
    sketch = np.concatenate([np.asarray(p.sketch) for p in parts])
    order = np.lexsort((seq, proto))  # by prototype, then sequence: the single-pass order
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(proto, minlength=K), out=offsets[1:])
    manifest = dict(first)
    tokens = sum(int(p.manifest["tokens"]) for p in parts)
    P = len(seq)
    manifest.update({"covered": covered, "part": [0, 1], "tokens": tokens, "postings": P,
                     "postings_per_sequence": P / max(1, sum(b - a for a, b in covered)),
                     "bytes_postings": sum(int(p.manifest["bytes_postings"]) for p in parts),
                     "postings_seconds": sum(float(p.manifest["postings_seconds"]) for p in parts),
                     "merged_from": len(parts), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    manifest["bytes_per_token"] = manifest["bytes_postings"] / max(1, tokens)
    cache = AttributionCache(offsets=offsets, seq=seq[order], sketch=sketch[order], projection=parts[0].projection,
                             curvature=parts[0].curvature, manifest=manifest)
    if out is not None:
        cache.save(out)
        cache = AttributionCache.load(out)
    return cache
