"""Operations on an opened ``Run``: sample, evaluate, index, label, explain, look up prototypes.

Each ``prism`` command is one of these plain functions (or one in ``app.attribution``, ``app.control``,
``app.training``). They return values — dataclasses, lists, dicts — and never print; user mistakes raise
``prismlm.errors.PrismError``. The CLI derives its options from their signatures and docstrings.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from prismlm.app.run import Run, require
from prismlm.artifacts import verify_files
from prismlm.data.shards import ShardSet, load_shards
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import ArtifactError, ArtifactMismatch, ConfigError, DataError, PrismError
from prismlm.eval.metrics import evaluate as evaluate_model
from prismlm.explain import (
    Explanation,
    PrototypeCard,
    PrototypeIndex,
    build_index,
    explain,
    explain_generation,
    llm_labels,
    merge_indexes,
    prototype_card,
    rule_labels,
    save_labels,
)
from prismlm.model import PrismLM
from prismlm.progress import Progress
from prismlm.train.checkpoint import verify_checkpoint
from prismlm.train.distributed import barrier, cleanup, init_distributed
from prismlm.train.retrofit import STORED_Z_DIR
from prismlm.train.stored_z import StoredZ, backbone_identity, open_stored_z


def parse_part(part: str) -> tuple[int, int]:
    """``"i/n"`` → (i, n) with 0 <= i < n; ``ConfigError`` otherwise."""
    try:
        i, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise ConfigError(f"--part expects i/n (e.g. 0/4), got {part!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ConfigError(f"--part i/n needs 0 <= i < n, got {part!r}")
    return i, n


def check_sampling(tokens: int, temperature: float, top_k: int | None, samples: int = 1,
                   tokens_flag: str = "--tokens") -> None:
    """``ConfigError`` naming the option for sampling settings that cannot work."""
    require(tokens >= 0, tokens_flag, ">= 0", tokens)
    require(samples >= 1, "--samples", ">= 1", samples)
    require(math.isfinite(temperature) and temperature >= 0, "--temperature", "a finite number >= 0", temperature)
    require(top_k is None or top_k >= 1, "--top-k", ">= 1 (or omitted for the whole vocabulary)", top_k)


# ----- sampling and evaluation ----------------------------------------------------------------------------
def sample_continuations(model: PrismLM, tokenizer: Tokenizer, prompt: str, *, samples: int, tokens: int,
                         temperature: float, top_k: int | None, generator: torch.Generator | None) -> list[str]:
    """``samples`` sampled continuations of ``prompt`` (continuation text only; an empty prompt starts
    from the end-of-text token), one batch through ``model.generate``."""
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    dev = next(model.parameters()).device
    x = torch.tensor([ids] * samples, dtype=torch.long, device=dev)  # (samples, T)
    y = model.generate(x, tokens, temperature=temperature, top_k=top_k, generator=generator)
    return [tokenizer.decode(row[len(ids) if prompt else 1:].tolist()) for row in y]


def generate(run: Run, prompt: str = "", *, tokens: int = 100, samples: int = 1, temperature: float = 0.8,
             top_k: int | None = 50, seed: int = 0) -> list[str]:
    """Sample text from a trained model (with the run's interventions applied).

    Args:
        prompt: Text to continue (empty: start from end-of-text).
        tokens: New tokens per sample.
        samples: Number of samples.
        temperature: Sampling temperature (0 = greedy).
        top_k: Sample from the top-k tokens only.
        seed: Sampling seed.
    """
    check_sampling(tokens, temperature, top_k, samples)
    gen = torch.Generator(device=run.device).manual_seed(seed)
    with run.intervened() as model:
        conts = sample_continuations(model, run.tokenizer, prompt, samples=samples, tokens=tokens,
                                     temperature=temperature, top_k=top_k, generator=gen)
    return [prompt + c for c in conts]


def evaluate(run: Run, *, batches: int = 50, batch_size: int | None = None,
             shards: Path | None = None) -> dict[str, float | int | None]:
    """Validation loss, perplexity and coverage metrics (R̄1, R2, dead prototypes, residual share) on the
    run's own validation split.

    Args:
        batches: Validation batches (a fixed, evenly spread sample).
        batch_size: Sequences per batch (default: the run's).
        shards: Token shard folder the run was trained on (default: prepared from its data config).
    """
    require(batches >= 1, "--batches", ">= 1", batches)
    require(batch_size is None or batch_size >= 1, "--batch-size", ">= 1", batch_size)
    cfg = run.config
    shard_set = run.shards(shards)
    with run.intervened() as model:
        metrics: dict[str, float | int | None] = dict(evaluate_model(
            model, shard_set.val, seq_len=cfg.model.block_size, batch_size=batch_size or cfg.train.batch_size,
            max_batches=batches, device=run.device, autocast=run.autocast()))
    metrics["step"] = run.step
    return metrics


# ----- prototype index and labels ------------------------------------------------------------------------
@dataclass
class IndexResult:
    """What ``build_run_index`` made, and what a user should know about it."""

    index: PrototypeIndex
    path: Path
    notes: list[str] = field(default_factory=list)


def build_run_index(run: Run, *, top_n: int = 32, max_sequences: int | None = None, batch_size: int = 16,
                    part: str = "0/1", out: Path | None = None, resume: bool = False, checkpoint_every: int = 50,
                    shards: Path | None = None, labels: bool = True, stored_z: bool = True,
                    progress: Progress = True) -> IndexResult:
    """Build the prototype index: each prototype's nearest training contexts, activation statistics,
    coverage; with ``labels``, rule-based labels once complete.

    Args:
        top_n: Nearest training contexts kept per prototype.
        max_sequences: Index only the first N training sequences (default: all).
        batch_size: Sequences per forward pass (keep it equal across parts).
        part: Build part i of n (i/n) of the sequences; combine with `prism index-merge`.
        out: Index folder (default RUN/index, or RUN/index-part-i-of-n).
        resume: Continue a partial index in --out after its last saved batch.
        checkpoint_every: Save the partial index every N batches (0: only at the end).
        shards: Token shard folder (default: the run's, from its data config).
        labels: Also write rule-based labels (labels.json) when the index is complete.
        stored_z: Read the hidden states a retrofit stored (RUN/stored-z) instead of running the backbone, when they are this checkpoint's backbone over these shards (else the model runs).
        progress: Show a progress bar with tokens/s.
    """
    require(top_n >= 1, "--top-n", ">= 1", top_n)
    require(max_sequences is None or max_sequences >= 1, "--max-sequences", ">= 1", max_sequences)
    require(checkpoint_every >= 0, "--checkpoint-every", ">= 0", checkpoint_every)
    pt = parse_part(part)
    info, _ = init_distributed(str(run.device))
    build_part = partial(_build_index_part, run, top_n=top_n, max_sequences=max_sequences, batch_size=batch_size,
                         resume=resume, checkpoint_every=checkpoint_every, shards=shards, stored_z=stored_z)
    if not info.enabled:
        out = out or run.folder / ("index" if pt == (0, 1) else f"index-part-{pt[0]}-of-{pt[1]}")
        result = build_part(pt, out, progress=progress)
        if labels and result.index.covers_all:
            save_labels(rule_labels(result.index), out)
        return result
    # Under torchrun: rank r builds part r/world into OUT.part-r-of-world (resumable there), then rank 0 merges
    # the parts into OUT — equal to one process with the same batch size (neighbourhoods, counts and
    # histograms bit for bit, float64 sums to rounding) — and removes them. Every rank returns the merged index.
    require(pt == (0, 1), "--part", "left out under torchrun (each process builds its own part)", part)
    out = out or run.folder / "index"
    try:
        def part_dir(rank: int) -> Path:
            return out.with_name(f"{out.name}.part-{rank}-of-{info.world_size}")

        built = build_part((info.rank, info.world_size), part_dir(info.rank),
                           progress=progress if info.is_main else False)
        barrier(info)
        if info.is_main:
            merged = merge_index_parts(out, [part_dir(r) for r in range(info.world_size)], labels=labels)
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


def _build_index_part(run: Run, pt: tuple[int, int], out: Path, *, top_n: int, max_sequences: int | None,
                      batch_size: int, resume: bool, checkpoint_every: int, shards: Path | None,
                      progress: Progress, stored_z: bool = True) -> IndexResult:
    """Build (or resume) part ``pt`` of the run's index into ``out``."""
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
        store = _usable_stored_z(run, model, shard_set, max_sequences, notes) if stored_z else None
        idx = build_index(model, shard_set, top_n=top_n, batch_size=batch_size,
                          max_sequences=max_sequences, part=pt, resume_from=prev, out=out, model_sha256=run.identity,
                          checkpoint_every=checkpoint_every, device=run.device,
                          autocast=run.autocast(), progress=progress, stored_z=store)
    run.forget(out)
    return IndexResult(index=idx, path=out, notes=notes)


def _usable_stored_z(run: Run, model: PrismLM, shards: ShardSet, max_sequences: int | None,
                     notes: list[str]) -> StoredZ | None:
    """The run's stored z (``RUN/stored-z``) when it holds this checkpoint's backbone over ``shards`` (after a
    stage 2 the backbone moved on: the model runs, and a note says why)."""
    path = run.folder / STORED_Z_DIR
    if not (path / "manifest.json").exists() or model.proto_multipliers is not None:
        return None
    try:
        store = open_stored_z(path)
        T = model.config.block_size
        universe = shards.train.num_sequences(T) if max_sequences is None else min(max_sequences,
                                                                                   shards.train.num_sequences(T))
        store.check(backbone=backbone_identity(model), shard_key=shards.manifest["key"], block_size=T, split="train")
        if store.num_sequences < universe:
            raise ArtifactMismatch(f"{path} covers {store.num_sequences} sequences, fewer than {universe}")
    except ArtifactError as e:
        notes.append(f"the stored z was not used ({e.message}); the index ran the model")
        return None
    notes.append(f"hidden states read from {path} ({store.manifest['dtype']}); the backbone did not run")
    return store


def merge_index_parts(out: Path, parts: list[Path], *, labels: bool = True) -> IndexResult:
    """Merge partial indexes (disjoint parts of the same model and shards) into one — equal to one pass.

    Args:
        out: Folder of the merged index.
        parts: Partial index folders (from `prism index --part i/n`).
        labels: Write rule-based labels when the merged index is complete.
    """
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
    labels: dict[int, dict]
    path: Path

    def categories(self) -> dict[str, int]:
        """How many prototypes fall in each category, most common first."""
        cats: dict[str, int] = {}
        for v in self.labels.values():
            cats[v["category"]] = cats.get(v["category"], 0) + 1
        return dict(sorted(cats.items(), key=lambda kv: -kv[1]))


def label_prototypes(run: Run, *, index: Path | None = None, labeller: str = "rules", endpoint: str | None = None,
                     model: str | None = None, api_key_env: str = "OPENAI_API_KEY", ids: str | None = None,
                     shards: Path | None = None) -> LabelResult:
    """Label every prototype from its neighbourhood (rules; optionally an LLM endpoint). Writes labels.json.

    Args:
        index: Index folder (default RUN/index).
        labeller: rules (offline) or openai (an OpenAI-compatible endpoint).
        endpoint: Base URL of the OpenAI-compatible API (with --labeller openai).
        model: Model name for the endpoint (with --labeller openai).
        api_key_env: Environment variable holding the API key.
        ids: Comma-separated prototype ids to relabel with the LLM (default all).
        shards: Token shard folder (default: the index's / the run's).
    """
    if labeller not in ("rules", "openai"):
        raise ConfigError(f"--labeller must be 'rules' or 'openai', got {labeller!r}")
    if labeller == "openai" and (not endpoint or not model):
        raise ConfigError("--labeller openai needs --endpoint URL and --model NAME")
    idx = run.index(index, shards, required=True)
    assert idx is not None
    labs = rule_labels(idx)
    if labeller == "openai":
        assert endpoint is not None and model is not None
        try:
            sel = [int(x) for x in ids.split(",")] if ids else None
        except ValueError:
            raise ConfigError(f"--ids expects comma-separated integers, got {ids!r}") from None
        labs = llm_labels(idx, labs, endpoint=endpoint, model=model, api_key_env=api_key_env, ids=sel)
    assert idx.path is not None  # an index opened from a folder knows it
    return LabelResult(labels=labs, path=save_labels(labs, idx.path))


# ----- explanations ----------------------------------------------------------------------------------------
def explain_text(run: Run, prompt: str = "", *, generate: int = 0, index: Path | None = None,
                 use_index: bool = True, shards: Path | None = None, temperature: float = 0.8,
                 top_k: int | None = 50, seed: int = 0, neighbours: int = 5) -> Explanation:
    """Explain each next-token logit: active prototypes with labels and shares, residual share, exactly.

    Args:
        prompt: Text to explain (empty: the first prediction after end-of-text).
        generate: Sample N tokens after the prompt and explain them.
        index: Index folder (default RUN/index if it exists).
        use_index: Use the prototype index if there is one.
        shards: Token shard folder (default: the index's / the run's).
        temperature: Sampling temperature for --generate (0 = greedy).
        top_k: Sample from the top-k tokens only.
        seed: Sampling seed.
        neighbours: Training snippets per prototype card.
    """
    require(neighbours >= 0, "--neighbours", ">= 0", neighbours)
    model = run.prism_model("an explanation")
    check_sampling(generate, temperature, top_k, tokens_flag="--generate")
    if generate > model.config.block_size:  # one explanation covers one context window
        raise ConfigError(f"--generate must be at most the context window ({model.config.block_size} tokens), "
                          f"got {generate}")
    tokenizer = run.tokenizer
    idx = run.index(index, shards) if use_index else None
    with run.intervened():  # a suppressed or controlled run is explained as it predicts (decompose stays exact)
        if generate > 0:
            expl = explain_generation(model, tokenizer, prompt, generate, model_sha256=run.identity,
                                      temperature=temperature, top_k=top_k, seed=seed, index=idx,
                                      neighbours=neighbours)
        else:
            expl = explain(model, tokenizer, prompt, model_sha256=run.identity, index=idx, neighbours=neighbours)
    if idx is None:
        expl.notes.append(f"no prototype index: build one with `prism index {run.path}` for neighbourhoods and labels")
    return expl


# ----- verification ---------------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    """What ``verify_run`` checked (each file against its manifest), and what it could not find."""

    checked: list[str]
    notes: list[str] = field(default_factory=list)


def verify_run(run: Run, *, shards: Path | None = None, index: Path | None = None,
               cache: Path | None = None) -> VerifyReport:
    """Check every artifact of a run against its manifest with full checksums: checkpoint files (weights,
    trainer state, config, tokenizer), token shards, prototype index, attribution cache. A corrupt or
    foreign one is refused with its file name and the command that rebuilds it.

    Args:
        shards: Token shard folder (default: the run's).
        index: Index folder (default RUN/index if it exists).
        cache: Attribution cache folder (default RUN/attribution-cache if it exists).
    """
    ckpt = run.checkpoint
    checked = [str(ckpt.path / f) for f in verify_checkpoint(ckpt.path, ckpt.manifest, full=True)]
    notes: list[str] = []
    shard_set = run.shards(shards)
    load_shards(shard_set.root, verify=True)  # sha256 of every shard file
    checked.append(f"{shard_set.root} (train.bin, val.bin, offsets, tokenizer)")
    idx = run.index(index) if run.model.is_prism else None
    if idx is not None and idx.path is not None:
        verify_files(idx.path, idx.manifest.get("files"), what="prototype index", fix="prism index RUN", full=True)
        checked.append(str(idx.path))
    else:
        notes.append("no prototype index")
    cache_dir = cache or run.folder / "attribution-cache"
    if run.model.is_prism and (cache is not None or (cache_dir / "manifest.json").exists()):
        c = run.cache(cache, shards)
        assert c.path is not None  # a cache opened from a folder knows it
        verify_files(c.path, c.manifest.get("files"), what="attribution cache", fix="prism attribute-cache RUN",
                     full=True)
        checked.append(str(c.path))
    else:
        notes.append("no attribution cache")
    if run.suppression is not None:
        checked.append(str(ckpt.path / "suppression.json"))
    return VerifyReport(checked=checked, notes=notes)


# ----- looking prototypes up -----------------------------------------------------------------------------
@dataclass
class PrototypeRow:
    """One line of a prototype listing."""

    id: int
    label: str
    category: str
    active_tokens: int | None
    """How many indexed tokens it is active on (None without an index)."""
    top_tokens: list[str]
    """The tokens W p_i pushes most."""
    token_push: float | None = None
    """(W p_i)_tok for the token searched for, if any."""


@dataclass
class PrototypeListing:
    rows: list[PrototypeRow]
    matched: int
    num_prototypes: int
    has_index: bool


def find_prototypes(run: Run, *, search: str | None = None, token: str | None = None, index: Path | None = None,
                    shards: Path | None = None, limit: int = 20) -> PrototypeListing:
    """List or search prototypes by label, category or token.

    Args:
        search: Only prototypes whose label or category contains TEXT.
        token: Prototypes that push this token most (signature W p_i).
        index: Index folder (default RUN/index if it exists).
        shards: Token shard folder (default: the index's / the run's).
        limit: Rows to list.
    """
    require(limit >= 1, "--limit", ">= 1", limit)
    model = run.prism_model("listing prototypes")
    assert model.prototypes is not None
    tok = run.tokenizer
    idx = run.index(index, shards)
    labs = idx.labels() if idx is not None else {}
    K = model.prototypes.num_prototypes
    ids = list(range(K))
    score: dict[int, float] = {}
    if token is not None:
        tid = tok.encode(token)
        if len(tid) != 1:
            raise DataError(f"--token {token!r} is {len(tid)} tokens {tid}; give a single token "
                            f"(e.g. with its leading space: ' the')")
        with torch.no_grad():
            col = model.signatures()[:, tid[0]].float()  # (K,)
        score = {i: float(col[i]) for i in ids}
        ids.sort(key=lambda i: -score[i])
    elif idx is not None:
        ids.sort(key=lambda i: -int(idx.counts[i]))
    if search:
        q = search.lower()
        ids = [i for i in ids if q in (labs.get(i, {}).get("label", "") + " "
                                       + labs.get(i, {}).get("category", "")).lower()]
    rows: list[PrototypeRow] = []
    if ids:
        with torch.no_grad():
            sig = model.signatures(torch.tensor(ids[:limit], dtype=torch.long, device=run.device)).float()  # (n, V)
        sig[:, tok.vocab_size:] = -float("inf")
        top = sig.topk(5, dim=-1).indices  # (n, 5)
        for row, i in enumerate(ids[:limit]):
            lab = labs.get(i, {})
            rows.append(PrototypeRow(id=i, label=lab.get("label", ""), category=lab.get("category", ""),
                                     active_tokens=int(idx.counts[i]) if idx is not None else None,
                                     top_tokens=[tok.id_to_token(int(t)) for t in top[row]],
                                     token_push=score.get(i) if token is not None else None))
    return PrototypeListing(rows=rows, matched=len(ids), num_prototypes=K, has_index=idx is not None)


@dataclass
class PrototypeView:
    """One prototype's card, and whether an index was there to fill its neighbourhood."""

    card: PrototypeCard
    has_index: bool


def show_prototype(run: Run, prototype: int, *, index: Path | None = None, shards: Path | None = None,
                   neighbours: int = 8) -> PrototypeView:
    """One prototype's card: label, statistics, top tokens of W p_i, nearest training contexts."""
    require(neighbours >= 0, "--neighbours", ">= 0", neighbours)
    model = run.prism_model("a prototype card")
    idx = run.index(index, shards)
    labs = idx.labels() if idx is not None else {}
    card = prototype_card(model, run.tokenizer, prototype, index=idx, labels=labs, neighbours=neighbours)
    return PrototypeView(card=card, has_index=idx is not None)


def prototypes(run: Run, *, search: str | None = None, token: str | None = None, id: int | None = None,
               index: Path | None = None, shards: Path | None = None, limit: int = 20,
               neighbours: int = 8) -> PrototypeListing | PrototypeView:
    """List or search prototypes by label, category or token; --id N shows one prototype's card.

    Args:
        search: Only prototypes whose label or category contains TEXT.
        token: Prototypes that push this token most (signature W p_i).
        id: Show one prototype's card (neighbours, histogram, tokens).
        index: Index folder (default RUN/index if it exists).
        shards: Token shard folder (default: the index's / the run's).
        limit: Rows to list.
        neighbours: Snippets shown with --id.
    """
    if id is not None:
        return show_prototype(run, id, index=index, shards=shards, neighbours=neighbours)
    return find_prototypes(run, search=search, token=token, index=index, shards=shards, limit=limit)


__all__ = ["VerifyReport", "verify_run", "IndexResult", "LabelResult", "PrototypeListing", "PrototypeRow", "PrototypeView", "prototypes", "build_run_index", "evaluate",
           "explain_text", "find_prototypes", "generate", "label_prototypes", "merge_index_parts",
           "parse_part", "sample_continuations", "show_prototype"]
