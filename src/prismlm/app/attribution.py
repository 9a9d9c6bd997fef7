"""Training-data attribution operations: build the postings cache (one process or torchrun) and its search
sidecar, attribute a text to training sequences (``attribute_text``, taking ``QuerySpec``, ``SearchSpec``
and ``Rescoring``). Method and measurements: docs/attribution.md.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prismlm.app.run import Run
from prismlm.artifacts import check_out_folder
from prismlm.config import AttributionConfig, SearchConfig
from prismlm.errors import ArtifactError, ConfigError, DependencyError
from prismlm.explain import Explanation
from prismlm.progress import Progress, Reporter
from prismlm.tda.attribute import Attribution, QuerySpec, Rescorer, Rescoring, SearchSpec, attribute
from prismlm.tda.cache import KIND as CACHE_KIND
from prismlm.tda.cache import AttributionCache, build_cache, compress_cache, merge_caches
from prismlm.tda.influence import FullGradients
from prismlm.tda.search import KIND as SEARCH_KIND
from prismlm.tda.search import SearchIndex, build_search_index
from prismlm.train.distributed import DistInfo, barrier, cleanup, init_distributed

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM

DEFAULT_ATTRIBUTION = AttributionConfig()
DEFAULT_SEARCH = SearchConfig()
DEFAULT_QUERY = QuerySpec()
DEFAULT_SEARCH_SPEC = SearchSpec()
NO_RESCORING = Rescoring()


def build_run_cache(
    run: Run,
    config: AttributionConfig = DEFAULT_ATTRIBUTION,
    *,
    out: Path | None = None,
    shards: Path | None = None,
    compress_from: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: Progress = True,
) -> AttributionCache:
    """Build the postings cache for fast prototype-space attribution (one pass over the training data).

    Under ``torchrun`` every process computes the same curvature (and pca bases), builds its batch-aligned
    share of the postings into OUT.part-RANK-of-WORLD, and rank 0 merges the shares into OUT, applies the
    storage options (dtype, prune, aggregate, id_encoding) and removes the shares: the same cache as one
    process, bit for bit.

    Args:
        config: How to build it (sketch size, projection, curvature, damping, storage: dtype, prune,
            aggregate, id_encoding, …): ``AttributionConfig``, the one set of options the CLI, the cache
            builder and the bench read. A compact cache: projection pca-local, r 40, dtype pq, id_encoding
            delta (docs/attribution.md).
        out: Output folder (default RUN/attribution-cache).
        shards: Token shard folder (default: the run's).
        compress_from: Re-encode this lossless cache (float32/float64, no pruning, sequence postings) with
            the storage options (dtype, prune, aggregate, id_encoding) into ``out`` instead of
            building one: no pass over the data; the sketch and curvature options are the cache's own.
        resume: Continue an interrupted build of ``out`` (its OUT.build folder: the batches written, the
            curvature and projection) instead of starting over; the same options, model and shards are
            required. Without it a left-over build folder is discarded.
        overwrite: Replace a cache already in ``out`` (never a run or any other folder).
        progress: Show progress bars (curvature pass, postings pass).
    """
    model = run.prism_model("prototype-space attribution")
    out = out or run.folder / "attribution-cache"
    if compress_from is not None:
        return compress_run_cache(run, compress_from, config, out=out, shards=shards, overwrite=overwrite)
    check_out_folder(out, "attribution cache", holds=CACHE_KIND, overwrite=overwrite, resume=resume, can_resume=True)
    shard_set = run.shards(shards)
    info, _ = init_distributed(str(run.device))
    if not info.enabled:
        cache = build_cache(
            model, shard_set, config, out=out, model_sha256=run.identity, resume=resume, progress=progress
        )
        run.forget(out)
        return cache
    try:
        return _build_distributed(run, model, shard_set, config, out, info, progress, resume)
    finally:
        cleanup(info)


def lossless_options(config: AttributionConfig) -> AttributionConfig:
    """The options parts of a cache are built with so that merging them and then applying ``config``'s
    storage options gives what one pass with ``config`` gives: sequence postings, no pruning, int32 ids,
    float32 sketches (float64 when ``config`` stores float16/float64, which one pass casts from float64; for
    float16 the merged sketches are then rounded to float16 before the storage options, as one pass does)."""
    return replace(
        config,
        dtype="float64" if config.dtype in ("float16", "float64") else "float32",
        prune=0.0,
        aggregate="sequence",
        id_encoding="int32",
    )


def _build_distributed(
    run: Run,
    model: PrismLM,
    shard_set: ShardSet,
    config: AttributionConfig,
    out: Path,
    info: DistInfo,
    progress: Progress,
    resume: bool = False,
) -> AttributionCache:
    """One torchrun process's share of ``build_run_cache`` (see there); every rank returns the cache.
    ``resume``: every rank continues its part's build folder; a finished ``out`` is returned as it is."""
    if resume and (out / "manifest.json").exists() and not any(out.parent.glob(f"{out.name}.part-*")):
        return AttributionCache.load(out, model_sha256=run.identity)
    T = model.config.block_size
    n_all = shard_set.train.num_sequences(T)
    universe = n_all if config.max_sequences is None else min(n_all, config.max_sequences)
    if universe < 1:
        raise ArtifactError(
            f"the training split of {shard_set.root} has no complete sequence of {T + 1} tokens",
            fix="prepare more data or use a model with a smaller block_size",
        )
    show = progress if info.is_main else False
    parts_cfg = lossless_options(config)  # the same curvature and projection options as config

    def part_dir(rank: int) -> Path:
        return out.with_name(f"{out.name}.part-{rank}-of-{info.world_size}")

    # every rank fits the same curvature and projection (the same sequences, batches and accumulation order:
    # bit for bit, no collective) and keeps the fitted batches of its own part for its postings pass
    built = build_cache(
        model,
        shard_set,
        parts_cfg,
        out=part_dir(info.rank),
        part=(info.rank, info.world_size),
        model_sha256=run.identity,
        resume=resume,
        progress=show,
    )
    del built
    barrier(info)
    if info.is_main:
        parts = [AttributionCache.load(part_dir(r), model_sha256=run.identity) for r in range(info.world_size)]
        merged_dir = out if parts_cfg == config else out.with_name(f"{out.name}.merged")
        merged = merge_caches(parts, out=merged_dir)  # memory-mapped: the sketches are never all in memory
        del parts
        if merged_dir != out:
            if config.dtype == "float16":  # one pass rounds each sketch to float16 before summing or pruning
                _round_in_place(merged_dir / "sketch.npy", np.float16)
            merged.path = None  # an intermediate: not recorded as the source of the result
            compress_cache(merged, config, shards=shard_set, out=out)
        del merged
        for d in [part_dir(r) for r in range(info.world_size)] + ([merged_dir] if merged_dir != out else []):
            shutil.rmtree(d, ignore_errors=True)
    barrier(info)
    run.forget(out)
    return AttributionCache.load(out, model_sha256=run.identity)


def _round_in_place(path: Path, dtype: type[np.floating]) -> None:
    """Round the float64 rows of the .npy at ``path`` to ``dtype`` (kept as float64), in chunks."""
    a = np.load(path, mmap_mode="r+")
    step = 1 << 16
    for s in range(0, a.shape[0], step):
        a[s : s + step] = a[s : s + step].astype(dtype)
    a.flush()
    del a


def compress_run_cache(
    run: Run,
    source: Path,
    config: AttributionConfig = DEFAULT_ATTRIBUTION,
    *,
    out: Path | None = None,
    shards: Path | None = None,
    overwrite: bool = False,
) -> AttributionCache:
    """Re-encode the lossless cache ``source`` of this run with ``config``'s storage options (dtype, prune,
    aggregate, id_encoding) into ``out`` (default RUN/attribution-cache): ``compress_cache`` without a
    pass over the data. ``overwrite``: replace a cache already in ``out`` (never ``source`` itself)."""
    out = out or run.folder / "attribution-cache"
    if out.resolve() == Path(source).resolve():
        raise ConfigError(
            f"`out` {out} is the cache being compressed (`compress_from`)",
            fix="write the compressed cache to another `out`",
            param=("out", "compress_from"),
        )
    check_out_folder(out, "attribution cache", holds=CACHE_KIND, overwrite=overwrite)
    cache = run.cache(source, shards)
    shard_set = run.shards(shards, cache.manifest.get("shards_root"))
    result = compress_cache(cache, config, shards=shard_set, out=out)
    run.forget(out)
    return result


def build_run_search(
    run: Run,
    config: SearchConfig = DEFAULT_SEARCH,
    *,
    cache: Path | None = None,
    shards: Path | None = None,
    overwrite: bool = False,
    progress: Progress = True,
) -> SearchIndex:
    """Build the approximate-search sidecar of the run's attribution cache (CACHE/search): one faiss index per
    long posting list, so that `prism attribute` reads a few candidates per list instead of every posting of
    the query's prototypes (scores stay exact; only which sequences are considered is approximate).

    Args:
        config: The index (kind ivf or hnsw, lists shorter than min_list scanned exactly, IVF cells and
            vector encoding, HNSW degree, seed): ``SearchConfig``.
        cache: Cache folder (default RUN/attribution-cache).
        shards: Token shard folder (default: the cache's / the run's).
        overwrite: Replace the search index already in CACHE/search.
        progress: Show a progress bar (one step per indexed list).
    """
    c = run.cache(cache, shards)
    assert c.path is not None  # a loaded cache knows its folder
    out = c.path / "search"
    check_out_folder(out, "search index", holds=SEARCH_KIND, overwrite=overwrite, option="CACHE/search")
    lists = int((np.diff(np.asarray(c.offsets)) > config.min_list).sum())
    with Reporter(progress, "search index", lists, unit="list") as bar:
        idx = build_search_index(c, config, out=out, on_list=lambda i, n: bar.update(1, postings=n))
    run.forget(out)
    return idx


class _EkfacRescorer:
    """EK-FAC influence (kronfluence, every ``nn.Linear``) on chosen training sequences; the factors are
    fitted once per run, model, corpus and cached sequence count into ``RUN/attribution-factors`` and reused."""

    name = "ekfac"

    def __init__(self, run: Run, shard_set: ShardSet, num_train: int) -> None:
        try:
            import kronfluence  # noqa: F401
        except ImportError as e:
            raise DependencyError(
                f"Rescoring.method ekfac needs the kronfluence package ({e})",
                fix="pip install 'prismlm[attribution]'",
                param="Rescoring.method",
            ) from e
        from prismlm.tda.baselines import KronfluenceBaseline

        key = f"ekfac-{(run.identity or 'model')[:12]}-{shard_set.manifest['key'][:12]}-n{num_train}"
        self.factors = run.folder / "attribution-factors" / key
        self.baseline = KronfluenceBaseline(
            run.model, shard_set, strategy="ekfac", max_sequences=num_train, out_dir=self.factors, reuse_factors=True
        )
        self.pad = run.tokenizer.eot_id

    def scores(self, query: tuple[list[int], int], train_ids: list[int]) -> np.ndarray:
        return self.baseline.scores_on([query], train_ids, self.pad)[0].numpy()


class _GradientRescorer:
    """Whole-network gradient dot products (every parameter; one backward pass per candidate)."""

    name = "gradient"

    def __init__(self, run: Run, shard_set: ShardSet) -> None:
        from prismlm.tda.baselines import WholeNetworkGradients

        self.wn = WholeNetworkGradients(run.model, shard_set, memo=False)

    def scores(self, query: tuple[list[int], int], train_ids: list[int]) -> np.ndarray:
        return self.wn.dot(self.wn.query(*query), train_ids).numpy()


def _rescorer(run: Run, rescoring: Rescoring, shard_set: ShardSet, num_train: int) -> Rescorer | None:
    """The whole-network score ``rescoring.method`` names, or None for ``none``."""
    if rescoring.method == "ekfac":
        return _EkfacRescorer(run, shard_set, num_train)
    return _GradientRescorer(run, shard_set) if rescoring.method == "gradient" else None


def attribute_text(
    run: Run,
    text: str = "",
    query: QuerySpec = DEFAULT_QUERY,
    search: SearchSpec = DEFAULT_SEARCH_SPEC,
    rescoring: Rescoring = NO_RESCORING,
    *,
    cache: Path | None = None,
    shards: Path | None = None,
    token_ids: list[int] | None = None,
    chat: str | None = None,
) -> Attribution:
    """The training sequences that most influenced TEXT (or its completion), with the prototypes that
    connect them and snippets. The printed time is the wall time of all of it (a gradient build included).

    Args:
        text: Prompt (or prompt + completion, measuring its last tokens).
        query: What of the text is measured: an answer, its last tokens or generated tokens (``QuerySpec``).
        search: How the top sequences are found and how many are shown: the cache (its exact scan or its
            search index, CACHE/search from `prism attribute-search`) or the full block gradients
            (``SearchSpec``).
        rescoring: The hybrid: re-rank the best sequences by prototype space with a whole-network score,
            EK-FAC (factors fitted once per run into RUN/attribution-factors, then reused) or gradient dot
            products (``Rescoring``; what it buys: docs/attribution.md).
        cache: Cache folder (default RUN/attribution-cache).
        shards: Token shard folder (default: the cache's / the run's).
        token_ids: Attribute exactly these token ids (library use; the text is then only a label).
        chat: A chat message instead of a text: written with the run's chat template, the model's answer is
            generated (greedy, up to the end-of-turn token) and its tokens are measured.
    """
    t0 = time.perf_counter()
    run.prism_model("prototype-space attribution")
    if chat is not None:
        if text or query.answer is not None or query.completion or query.generate:
            raise ConfigError(
                "`chat` was given with a text, an answer, a completion or a generation",
                fix="give the chat message alone: the model's answer to it is what is measured",
                param="chat",
            )
        prompt_ids = run.tokenizer.encode(run.chat_prompt(chat))
        answer = run.chat_ids(prompt_ids)
        if not answer:
            raise ConfigError("the answer to `chat` is empty: nothing to attribute", param="chat")
        token_ids = [run.tokenizer.eot_id, *prompt_ids, *answer]
        query = replace(query, completion=len(answer), answer=None, generate=0)
        text = run.tokenizer.decode(prompt_ids + answer)
    built = ""
    if search.method == "cached":
        c = run.cache(cache, shards)
        index = None if search.search == "exact" else run.search(cache, shards, required=search.search == "approximate")
        shard_set = run.shards(shards, c.manifest.get("shards_root"))
        source: AttributionCache | FullGradients = c
    else:
        shard_set = run.shards(shards)
        t_build = time.perf_counter()
        source, index = FullGradients.build(run.model, shard_set, max_sequences=search.max_sequences), None
        built = f" ({time.perf_counter() - t_build:.1f} s of it building the full gradients)"
    att = attribute(
        run.model,
        run.tokenizer,
        text,
        query,
        source=source,
        search=search,
        index=index,
        rescorer=_rescorer(run, rescoring, shard_set, source.num_train),
        rescoring=rescoring,
        shards=shard_set,
        token_ids=token_ids,
    )
    att.seconds = time.perf_counter() - t0  # wall time of what the command did, not only the scoring
    if built:
        att.notes.append(f"{att.seconds:.1f} s in all{built}")
    return att


def attribute_explanation(run: Run, expl: Explanation, *, shards: Path | None = None) -> Attribution:
    """Attribute exactly the tokens an explanation explained (its inputs + the last chosen token); for an
    explained generation, measure the sampled tokens only."""
    ids = list(expl.token_ids)
    if expl.prompt_tokens is not None or len(ids) < 2:  # a generation ends with its last sampled token
        ids.append(expl.positions[-1].next_id)
    completion = len(ids) - expl.prompt_tokens if expl.prompt_tokens is not None else None
    return attribute_text(run, expl.text, QuerySpec(completion=completion or None), shards=shards, token_ids=ids)


__all__ = [
    "DEFAULT_ATTRIBUTION",
    "DEFAULT_QUERY",
    "DEFAULT_SEARCH",
    "DEFAULT_SEARCH_SPEC",
    "NO_RESCORING",
    "attribute_explanation",
    "attribute_text",
    "build_run_cache",
    "build_run_search",
    "compress_run_cache",
    "lossless_options",
]
