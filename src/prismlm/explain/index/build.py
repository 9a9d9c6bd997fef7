"""Building a prototype index: one streaming pass of a model over its training shard, and merging parts.

Invariant: candidates are ordered by (similarity desc, offset asc), a total order, so the top-N of a union
is the top-N of the top-Ns — ``merge_indexes`` of parts equals one pass bit for bit when the parts use
the same ``batch_size`` (the same batch grid); the activation sample (top S by a hash key) merges the same
way. Memory is O(K·N + chunk·K + K·S), independent of corpus size.
See docs/architecture.md (prototype index).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from prismlm.artifacts import merge_ranges, model_identity, overlap, part_range, provenance, writes_folder
from prismlm.errors import ArtifactError, ArtifactMismatch, ConfigError, ModelError, named
from prismlm.eval.faithfulness import FaithfulnessAccumulator
from prismlm.eval.metrics import active_prototypes, coverage_sums
from prismlm.explain.activation_sample import ActivationSample
from prismlm.explain.index.artifact import FORMAT_VERSION, KIND, NO_OFFSET, IndexManifest, PrototypeIndex
from prismlm.model import PrismOutput, eval_mode
from prismlm.model.stored_activations import StoredZ, backbone_identity
from prismlm.progress import Progress, Reporter

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM

__all__ = ["IndexSettings", "build_index", "merge_indexes"]


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


class _Builder:
    """Streaming state: the running (K, N) table and the O(K) statistics."""

    def __init__(
        self, K: int, n: int, bins: int, device: torch.device, dtype: torch.dtype = torch.float32, sample_size: int = 0
    ):
        self.K, self.n, self.bins = K, n, bins
        self.sample = ActivationSample.empty(K, sample_size, device) if sample_size else None
        self.top_sim = torch.full((K, n), -math.inf, device=device, dtype=dtype)
        self.top_off = torch.full((K, n), NO_OFFSET, dtype=torch.long, device=device)
        self.counts = torch.zeros(K, dtype=torch.long, device=device)
        self.act_sum = torch.zeros(K, dtype=torch.float64, device=device)
        self.hist = torch.zeros(K * bins, dtype=torch.long, device=device)
        self.token_cos_sum = 0.0
        self.residual_sum = 0.0
        self.tokens = 0
        # the prototype-only prediction's sums (``FaithfulnessAccumulator`` without yardsticks: a fitted μ would
        # need a second pass) over the tokens a model forward gave logits for — not stored z, where the logits
        # would cost two V × d head products per token, ~V/K times the prototype layer's work
        self.faith = FaithfulnessAccumulator(yardsticks=False, median_cap=0)

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
        if "faithfulness_sums" in idx.manifest:
            b.faith = FaithfulnessAccumulator.from_sums(idx.manifest["faithfulness_sums"])
        return b

    @torch.no_grad()
    def update(
        self, net: PrismLM, out: PrismOutput, p_unit: torch.Tensor, base_offsets: torch.Tensor, chunk: int
    ) -> None:
        """One output of ``net`` over B aligned sequences; ``base_offsets`` (B,) = j·T of each sequence."""
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
        if out.logits.numel():  # a forward's logits (not stored z)
            self.faith.update(net, out)

    def to_index(self, manifest: IndexManifest) -> PrototypeIndex:
        manifest = {
            **manifest,
            "tokens": self.tokens,
            "token_max_cos_sum": self.token_cos_sum,
            "residual_share_sum": self.residual_sum,
        }
        if self.faith.tokens:
            manifest["faithfulness_sums"] = self.faith.sums()
        return PrototypeIndex(
            top_sim=self.top_sim.cpu(),
            top_offset=self.top_off.cpu(),
            counts=self.counts.cpu(),
            act_sum=self.act_sum.cpu(),
            hist=self.hist.reshape(self.K, self.bins).cpu(),
            manifest=manifest,
            sample=self.sample.to("cpu") if self.sample is not None else None,
        )


@dataclass(frozen=True)
class IndexSettings:
    """What an index is built with; all but ``chunk_size`` are recorded in its manifest, and a resumed
    build must ask for the same. Checked when made (``ConfigError`` naming the field)."""

    top_n: int = 32
    """Nearest training contexts kept per prototype (N of the (K, N) tables)."""
    batch_size: int = 8
    """Sequences per forward. Batches cover the fixed grid [b·B, (b+1)·B) of sequence ids: parts to be
    merged, and a resumed build, use the same batch size (the similarities are then bit-identical)."""
    max_sequences: int | None = None
    """Index only the first this-many training sequences (None: all)."""
    part: tuple[int, int] = (0, 1)
    """(i, n): index only the i-th of n contiguous, batch-aligned slices of the sequences."""
    bins: int = 20
    """Bins of the activation histogram on [0, 1]."""
    chunk_size: int | None = None
    """Tokens per (K × tokens) cosine block (None: sized to the device's memory); results do not depend
    on it."""
    sample_size: int = 64
    """S, the firings kept per prototype in a uniform sample (``prismlm.explain.activation_sample``); 0:
    none. A resumed build keeps the partial index's S (none for one written before samples)."""

    def __post_init__(self) -> None:
        for name, low in (("top_n", 1), ("batch_size", 1), ("bins", 1), ("sample_size", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{named(name)} must be an integer >= {low}, got {v!r}", param=name)
        for name in ("max_sequences", "chunk_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{named(name)} must be an integer >= 1 (or None), got {v!r}", param=name)
        i, n = self.part
        if not (n >= 1 and 0 <= i < n):
            raise ConfigError(f"`part` (i, n) needs 0 <= i < n, got {self.part!r}", param="part")


@dataclass
class _Plan:
    """Where a build starts: the streaming state, the manifest it extends and the sequences left."""

    builder: _Builder
    manifest: IndexManifest
    batch_size: int
    """The batch grid (a resumed build keeps the partial index's)."""
    done_to: int
    """First sequence not yet indexed."""
    start: int
    stop: int
    """The part's sequence range [start, stop)."""
    out: str | Path | None = None
    """Folder the partial index is saved to every ``checkpoint_every`` batches (0: never)."""
    checkpoint_every: int = 0
    stop_after_batches: int | None = None
    """Stop after this many batches (an interruption, in tests)."""


@writes_folder("out")  # one writer per index folder: a second build is refused by name
def build_index(
    model: PrismLM,
    shards: ShardSet,
    settings: IndexSettings = IndexSettings(),
    *,
    resume_from: str | Path | PrototypeIndex | None = None,
    out: str | Path | None = None,
    checkpoint_every: int = 0,
    model_sha256: str | None = None,
    device: str | torch.device | None = None,
    autocast: torch.autocast | None = None,
    progress: Progress = True,
    stop_after_batches: int | None = None,
    stored_z: StoredZ | None = None,
) -> PrototypeIndex:
    """One streaming pass of ``model`` over ``shards.train`` at ``settings``; returns a ``PrototypeIndex``.

    ``model``: a PRISM ``PrismLM``; ``model_sha256``: its identity recorded in the index (pass the
    checkpoint's ``manifest["model_sha256"]``; None: a hash of the weights, ``model_identity``).
    ``settings.part=(i, n)``: index only the i-th of n batch-aligned slices; ``merge_indexes`` combines
    the parts. ``resume_from``: a partial index (or its folder) to continue after its last finished batch.
    ``out`` + ``checkpoint_every``: save there every that many batches (and at the end).
    ``stop_after_batches``: stop early (simulates an interruption in tests).
    ``stored_z``: read the hidden states from this store (``prismlm.model.stored_activations``, e.g. a retrofit's
    ``RUN/stored-z``) instead of running the backbone: only the prototype layer runs. It must hold z of this
    model's backbone over these shards' training split at this block size, covering the indexed sequences
    (``ArtifactMismatch`` otherwise). From a float32 store made with the same batch grid the index equals the
    model's pass bit for bit (tested); from float16 the similarities carry z's rounding.
    """
    net = model
    if net.prototypes is None:
        raise ModelError("a prototype index needs a PRISM model; this is the dense baseline (it has no prototypes)")
    ident = model_sha256 or model_identity(net)
    dev = torch.device(device) if device is not None else next(net.parameters()).device
    T = net.config.block_size
    n_all = shards.train.num_sequences(T)
    universe = n_all if settings.max_sequences is None else min(n_all, settings.max_sequences)
    if universe < 1:
        raise ArtifactError(f"the training split has no complete sequence of {T + 1} tokens to index")
    if stored_z is not None:
        _check_stored_z(stored_z, net, shards, universe)
    if resume_from is not None:
        plan = _resume_plan(resume_from, settings, universe, ident, shards, dev)
    else:
        plan = _new_plan(net, shards, settings, universe, ident, dev)
    plan.manifest["hidden_from"] = "model" if stored_z is None else f"stored-z {stored_z.manifest['dtype']}"
    plan.out, plan.checkpoint_every, plan.stop_after_batches = out, checkpoint_every, stop_after_batches
    elapsed, tok0 = _index_batches(net, shards, plan, settings.chunk_size, dev, autocast, progress, stored_z)
    manifest = plan.manifest
    manifest["build_seconds"] = manifest.get("build_seconds", 0.0) + elapsed
    manifest["tokens_per_s_last_run"] = tok0 / max(elapsed, 1e-9) if tok0 else None
    idx = plan.builder.to_index(manifest)
    idx.shards, idx.tokenizer = shards, shards.tokenizer
    if out is not None:
        idx.save(out)
    return idx


def _resume_plan(
    resume_from: str | Path | PrototypeIndex,
    settings: IndexSettings,
    universe: int,
    ident: str,
    shards: ShardSet,
    dev: torch.device,
) -> _Plan:
    """The plan that continues a partial index after its last finished batch (same settings, same grid)."""
    prev = resume_from if isinstance(resume_from, PrototypeIndex) else PrototypeIndex.load(resume_from)
    prev.check(model_sha256=ident, shards=shards)
    m = prev.manifest
    top_n, bins, part = settings.top_n, settings.bins, settings.part
    if (m["top_n"], m["universe"], m["bins"]) != (top_n, universe, bins) or list(m["part"]) != list(part):
        raise ArtifactError(
            f"cannot resume: the partial index has top_n={m['top_n']}, max sequences {m['universe']}, "
            f"bins={m['bins']}, part {m['part'][0]}/{m['part'][1]}; this build asks for top_n={top_n}, "
            f"{universe}, bins={bins}, part {part[0]}/{part[1]}"
        )
    start, stop = m["target"]
    covered = merge_ranges(m["covered"])
    done_to = covered[-1][1] if covered else start
    if covered and covered != [[start, done_to]]:
        raise ArtifactError(f"cannot resume: covered ranges {covered} are not one prefix of the target {m['target']}")
    _check_resume_sample(m, settings.sample_size)
    # the batch grid must stay the same
    return _Plan(_Builder.from_index(prev, dev), dict(m), int(m["batch_size"]), done_to, start, stop)


def _new_plan(
    net: PrismLM, shards: ShardSet, settings: IndexSettings, universe: int, ident: str, dev: torch.device
) -> _Plan:
    """The plan of a fresh build of ``settings.part``: empty tables and the manifest it will record."""
    protos = net.require_prototypes()
    T, K = net.config.block_size, protos.num_prototypes
    start, stop = part_range(universe, settings.batch_size, settings.part)
    # similarities are stored in float32, or float64 for a float64 model (exactness tests)
    sim_dtype = torch.promote_types(protos.weight.dtype, torch.float32)
    builder = _Builder(K, settings.top_n, settings.bins, dev, sim_dtype, settings.sample_size)
    manifest = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "model_sha256": ident,
        "shard_key": shards.manifest["key"],
        "shards_root": str(Path(shards.root).resolve()),
        "split": "train",
        "top_n": settings.top_n,
        "num_prototypes": K,
        "block_size": T,
        "top_k": protos.cfg.top_k,
        "bins": settings.bins,
        "sample_size": settings.sample_size,
        "batch_size": settings.batch_size,
        "universe": universe,
        "part": list(settings.part),
        "target": [start, stop],
        "covered": [],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **provenance(),
    }
    return _Plan(builder, manifest, settings.batch_size, start, start, stop)


def _check_resume_sample(m: IndexManifest, sample_size: int) -> None:
    """A partial index with an activation sample of another size cannot be resumed into this one."""
    if "sample_size" in m and int(m["sample_size"]) != sample_size:
        raise ArtifactError(
            f"cannot resume: the partial index samples {m['sample_size']} firings per prototype; this build "
            f"asks for sample_size={sample_size}"
        )


def _index_batches(
    net: PrismLM,
    shards: ShardSet,
    plan: _Plan,
    chunk_size: int | None,
    dev: torch.device,
    autocast: torch.autocast | None,
    progress: Progress,
    stored_z: StoredZ | None,
) -> tuple[float, int]:
    """Run the plan's remaining batches through the model (or the prototype layer on stored z) into its
    builder, extending ``plan.manifest["covered"]``; returns (seconds, tokens) of this run."""
    protos = net.require_prototypes()
    T, B = net.config.block_size, plan.batch_size
    chunk = chunk_size or protos.chunk_size_for(B * T, dev)
    p = protos.weight.detach()
    p_unit = F.normalize(p.to(torch.promote_types(p.dtype, torch.float32)), dim=-1).to(dev)  # (K, d)
    bar = Reporter(progress, "index", (plan.stop - plan.start) * T, unit="tok", initial=(plan.done_to - plan.start) * T)
    t0, tok0, batches, elapsed = time.perf_counter(), 0, 0, 0.0
    with eval_mode(net):
        try:
            j = plan.done_to
            while j < plan.stop:
                j1 = min(plan.stop, (j // B + 1) * B)  # fixed grid of batches
                ids = np.arange(j, j1, dtype=np.int64)
                fo = _batch_output(net, shards, ids, dev, autocast, stored_z)
                plan.builder.update(net, fo, p_unit, torch.from_numpy(ids * T).to(dev), chunk)
                plan.manifest["covered"] = merge_ranges(plan.manifest["covered"] + [[j, j1]])
                j, batches, tok0 = j1, batches + 1, tok0 + len(ids) * T
                elapsed = time.perf_counter() - t0
                bar.update(len(ids) * T, tokens_per_s=round(tok0 / max(elapsed, 1e-9)))
                every = plan.checkpoint_every
                if plan.out is not None and every and batches % every == 0 and j < plan.stop:
                    plan.builder.to_index(plan.manifest).save(plan.out)
                if plan.stop_after_batches is not None and batches >= plan.stop_after_batches:
                    break
        finally:
            bar.close()
    return elapsed, tok0


def _batch_output(
    net: PrismLM,
    shards: ShardSet,
    ids: np.ndarray,
    dev: torch.device,
    autocast: torch.autocast | None,
    stored_z: StoredZ | None,
) -> PrismOutput:
    """The model's output for training sequences ``ids`` (B,): a forward over their tokens (B, T), or the
    prototype layer alone over their stored z (B, T, d)."""
    T = net.config.block_size
    if stored_z is not None:  # z (B, T, d) read back; the prototype layer alone runs on it
        z = stored_z.hidden(ids).to(dev)
        with torch.no_grad():
            return net.add_prototype_fields(PrismOutput(logits=z.new_empty(0), hidden=z))
    x = torch.from_numpy(shards.train.sequences(ids, T)[:, :-1]).to(dev)  # (B, T)
    with torch.no_grad(), autocast or nullcontext():
        return net(x)  # the model's one PrismOutput


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
            fix="index fewer sequences (max_sequences) or index from the model",
        )
    store.verify()  # each batch against its checksum (cached per open store): damaged z is refused by name


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
    sums = [p.manifest.get("faithfulness_sums") for p in parts]
    manifest.pop("faithfulness_sums", None)
    if all(x is not None for x in sums):  # only over every part's tokens
        manifest["faithfulness_sums"] = {k: sum(float(x[k]) for x in sums if x is not None) for k in sums[0] or {}}
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
