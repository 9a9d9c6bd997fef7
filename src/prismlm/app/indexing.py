"""Operations that build and label a run's prototype index: ``prism index``, ``index-merge``, ``label``.

Plain functions over an opened ``Run`` (as in ``app.operations``): they return values and never print;
the CLI derives its options from their signatures and docstrings. Under torchrun ``build_run_index``
builds one part per rank and merges them, equal to one process at the same batch size.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from prismlm.app.run import Run, require
from prismlm.artifacts import check_out_folder, output_lock, writes_folder
from prismlm.data.shards import ShardSet, load_shards
from prismlm.errors import ArtifactError, ArtifactMismatch, ConfigError, PrismError
from prismlm.explain import (
    IndexSettings,
    PrototypeIndex,
    build_index,
    llm_labels,
    merge_indexes,
    pushed_tokens,
    rule_labels,
    save_labels,
)
from prismlm.explain.index import KIND as INDEX_KIND
from prismlm.explain.index import Labels
from prismlm.model import PrismLM
from prismlm.model.stored_activations import StoredZ, backbone_identity, open_stored_z
from prismlm.progress import Progress
from prismlm.train.distributed import DistInfo, barrier, cleanup, init_distributed
from prismlm.train.run_folder import STORED_Z_DIR

__all__ = ["IndexResult", "LabelResult", "build_run_index", "label_prototypes", "merge_index_parts", "parse_part"]


def parse_part(part: str) -> tuple[int, int]:
    """``"i/n"`` → (i, n) with 0 <= i < n; ``ConfigError`` otherwise."""
    try:
        i, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise ConfigError(f"`part` expects i/n (e.g. 0/4), got {part!r}", param="part") from None
    if not (n >= 1 and 0 <= i < n):
        raise ConfigError(f"`part` i/n needs 0 <= i < n, got {part!r}", param="part")
    return i, n


# ----- prototype index and labels ------------------------------------------------------------------------
@dataclass
class IndexResult:
    """What ``build_run_index`` made, and what a user should know about it."""

    index: PrototypeIndex
    path: Path
    notes: list[str] = field(default_factory=list)


def build_run_index(
    run: Run,
    *,
    top_n: int = 32,
    max_sequences: int | None = None,
    batch_size: int = 16,
    part: str = "0/1",
    out: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    checkpoint_every: int = 50,
    shards: Path | None = None,
    labels: bool = True,
    stored_z: bool = True,
    progress: Progress = True,
) -> IndexResult:
    """Build the prototype index: each prototype's nearest training contexts, activation statistics,
    coverage; with ``labels``, rule-based labels once complete.

    Args:
        top_n: Nearest training contexts kept per prototype.
        max_sequences: Index only the first N training sequences (default: all).
        batch_size: Sequences per forward pass (keep it equal across parts).
        part: Build part i of n (i/n) of the sequences; combine with `prism index-merge`.
        out: Index folder (default RUN/index, or RUN/index-part-i-of-n).
        resume: Continue a partial index in ``out`` after its last saved batch.
        overwrite: Replace an index already in ``out`` (never a run or any other folder).
        checkpoint_every: Save the partial index every N batches (0: only at the end).
        shards: Token shard folder (default: the run's, from its data config).
        labels: Also write rule-based labels (labels.json) when the index is complete.
        stored_z: Read the hidden states a retrofit stored (RUN/stored-z) instead of running the backbone, when they are this checkpoint's backbone over these shards (else the model runs).
        progress: Show a progress bar with tokens/s.
    """
    settings = IndexSettings(top_n=top_n, batch_size=batch_size, max_sequences=max_sequences, part=parse_part(part))
    require(checkpoint_every >= 0, "checkpoint_every", ">= 0", checkpoint_every)
    pt = settings.part
    out = out or run.folder / ("index" if pt == (0, 1) else f"index-part-{pt[0]}-of-{pt[1]}")
    check_out_folder(out, "prototype index", holds=INDEX_KIND, overwrite=overwrite, resume=resume, can_resume=True)
    info, _ = init_distributed(str(run.device))
    build_part = partial(
        _build_index_part, run, resume=resume, checkpoint_every=checkpoint_every, shards=shards, stored_z=stored_z
    )
    if not info.enabled:
        with output_lock(out):  # the index and its labels: one writer, a second `prism index` is refused
            result = build_part(out, settings, progress=progress)
            if labels and result.index.covers_all:
                save_labels(rule_labels(result.index, pushes=run_pushes(run)), out)
        return result
    require(pt == (0, 1), "part", "left out under torchrun (each process builds its own part)", part)
    return _build_index_distributed(run, out, settings, info, build_part, labels=labels, progress=progress)


def run_pushes(run: Run) -> list[list[int]]:
    """The tokens each prototype of the run pushes most (``pushed_tokens``): what a rule label leads with."""
    return pushed_tokens(run.prism_model("labels"), vocab_size=run.tokenizer.vocab_size)


def _build_index_distributed(
    run: Run,
    out: Path,
    settings: IndexSettings,
    info: DistInfo,
    build_part: Callable[..., IndexResult],
    *,
    labels: bool,
    progress: Progress,
) -> IndexResult:
    """Under torchrun: rank r builds part r/world into OUT.part-r-of-world (resumable there), then rank 0
    merges the parts into OUT — equal to one process with the same batch size (neighbourhoods, counts and
    histograms bit for bit, float64 sums to rounding) — and removes them. Every rank returns the merged
    index."""
    try:

        def part_dir(rank: int) -> Path:
            return out.with_name(f"{out.name}.part-{rank}-of-{info.world_size}")

        built = build_part(
            part_dir(info.rank),
            replace(settings, part=(info.rank, info.world_size)),
            progress=progress if info.is_main else False,
        )
        barrier(info)
        if info.is_main:
            merged = merge_index_parts(
                out, [part_dir(r) for r in range(info.world_size)], labels=labels, overwrite=True
            )  # OUT was checked on entry
            for r in range(info.world_size):
                shutil.rmtree(part_dir(r), ignore_errors=True)
        barrier(info)
        if not info.is_main:
            merged = IndexResult(index=PrototypeIndex.load(out, model_sha256=run.identity), path=out)
        merged.notes = built.notes + merged.notes
        run.forget(out)
        return merged
    finally:
        cleanup(info)


@writes_folder("out")
def _build_index_part(
    run: Run,
    out: Path,
    settings: IndexSettings,
    *,
    resume: bool,
    checkpoint_every: int,
    shards: Path | None,
    progress: Progress,
    stored_z: bool = True,
) -> IndexResult:
    """Build (or resume) the run's index at ``settings`` (its ``part``) into ``out``."""
    model = run.prism_model("a prototype index")
    notes: list[str] = []
    prev = None
    if resume and (out / "manifest.json").exists():
        prev = PrototypeIndex.load(out, model_sha256=run.identity)  # never resume another model's index
        if prev.complete:
            notes.append(f"{out} is already complete; nothing to resume")
    elif resume:
        notes.append(f"no partial index in {out}; started from the beginning")
    shard_set = run.shards(shards, prev.manifest.get("shards_root") if prev is not None else None)
    if prev is not None and prev.complete:
        idx = prev.attach(shard_set)
    else:
        store = _usable_stored_z(run, model, shard_set, settings.max_sequences, notes) if stored_z else None
        idx = build_index(
            model,
            shard_set,
            settings,
            resume_from=prev,
            out=out,
            model_sha256=run.identity,
            checkpoint_every=checkpoint_every,
            device=run.device,
            autocast=run.autocast(),
            progress=progress,
            stored_z=store,
        )
    run.forget(out)
    return IndexResult(index=idx, path=out, notes=notes)


def _usable_stored_z(
    run: Run, model: PrismLM, shards: ShardSet, max_sequences: int | None, notes: list[str]
) -> StoredZ | None:
    """The run's stored z (``RUN/stored-z``) when it holds this checkpoint's backbone over ``shards`` (after a
    stage 2 the backbone moved on: the model runs, and a note says why)."""
    path = run.folder / STORED_Z_DIR
    if not (path / "manifest.json").exists() or model.is_intervened:
        return None
    try:
        store = open_stored_z(path)
        T = model.config.block_size
        universe = (
            shards.train.num_sequences(T)
            if max_sequences is None
            else min(max_sequences, shards.train.num_sequences(T))
        )
        store.check(backbone=backbone_identity(model), shard_key=shards.manifest["key"], block_size=T, split="train")
        if store.num_sequences < universe:
            raise ArtifactMismatch(f"{path} covers {store.num_sequences} sequences, fewer than {universe}")
        store.verify()  # every batch against its checksum: a damaged store is never read, the model runs
    except ArtifactError as e:
        notes.append(f"the stored z was not used ({e.message}); the index ran the model")
        return None
    notes.append(f"hidden states read from {path} ({store.manifest['dtype']}); the backbone did not run")
    return store


@writes_folder("out")
def merge_index_parts(out: Path, parts: list[Path], *, labels: bool = True, overwrite: bool = False) -> IndexResult:
    """Merge partial indexes (disjoint parts of the same model and shards) into one — equal to one pass.

    Args:
        out: Folder of the merged index.
        parts: Partial index folders (from `prism index --part i/n`).
        labels: Write rule-based labels when the merged index is complete.
        overwrite: Replace an index already in OUT (never a run or any other folder).
    """
    check_out_folder(out, "prototype index", holds=INDEX_KIND, overwrite=overwrite, option="OUT")
    idx = merge_indexes([PrototypeIndex.load(p) for p in parts])
    idx.save(out)
    notes: list[str] = []
    if labels and idx.covers_all:
        try:
            idx.attach(load_shards(idx.manifest["shards_root"]))
            save_labels(rule_labels(idx), out)
        except (PrismError, OSError) as e:
            notes.append(f"labels skipped ({e}); run `prism label` with the run folder")
    return IndexResult(index=idx, path=out, notes=notes)


@dataclass
class LabelResult:
    labels: Labels
    path: Path

    def categories(self) -> dict[str, int]:
        """How many prototypes fall in each category, most common first."""
        cats: dict[str, int] = {}
        for v in self.labels.values():
            cats[v["category"]] = cats.get(v["category"], 0) + 1
        return dict(sorted(cats.items(), key=lambda kv: -kv[1]))


def label_prototypes(
    run: Run,
    *,
    index: Path | None = None,
    labeller: str = "rules",
    endpoint: str | None = None,
    model: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    ids: str | None = None,
    shards: Path | None = None,
) -> LabelResult:
    """Label every prototype from its neighbourhood (rules; optionally an LLM endpoint). Writes labels.json.

    Args:
        index: Index folder (default RUN/index).
        labeller: rules (offline) or openai (an OpenAI-compatible endpoint).
        endpoint: Base URL of the OpenAI-compatible API (with labeller openai).
        model: Model name for the endpoint (with labeller openai).
        api_key_env: Environment variable holding the API key.
        ids: Comma-separated prototype ids to relabel with the LLM (default all).
        shards: Token shard folder (default: the index's / the run's).
    """
    if labeller not in ("rules", "openai"):
        raise ConfigError(f"`labeller` must be 'rules' or 'openai', got {labeller!r}", param="labeller")
    if labeller == "openai" and (not endpoint or not model):
        raise ConfigError(
            "`labeller` openai needs `endpoint` URL and `model` NAME", param=("labeller", "endpoint", "model")
        )
    try:
        sel = [int(x) for x in ids.split(",")] if ids and labeller == "openai" else None
    except ValueError:
        raise ConfigError(f"`ids` expects comma-separated integers, got {ids!r}", param="ids") from None
    # the index folder is held from reading the neighbourhoods to writing labels.json: a `prism index
    # --overwrite` meanwhile would leave labels of the old index beside the new one
    with output_lock(index or run.folder / "index"):
        idx = run.index(index, shards, required=True)
        assert idx is not None and idx.path is not None  # an index opened from a folder knows it
        labs = rule_labels(idx, pushes=run_pushes(run))
        if labeller == "openai":
            assert endpoint is not None and model is not None
            labs = llm_labels(idx, labs, endpoint=endpoint, model=model, api_key_env=api_key_env, ids=sel)
        return LabelResult(labels=labs, path=save_labels(labs, idx.path))
