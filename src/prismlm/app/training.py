"""Data and training operations: resolve a config, tokenize a corpus, train, and the end-to-end demo."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prismlm.app.operations import IndexResult, build_run_index, evaluate, explain_text, generate
from prismlm.app.run import Run, StageFn, no_stages, require, writable_folder
from prismlm.artifacts import check_out_folder
from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, is_shard_folder, prepare_shards
from prismlm.explain import Explanation
from prismlm.model.generation import TEXT_SAMPLING
from prismlm.progress import Progress
from prismlm.train.trainer import TrainResult
from prismlm.train.trainer import train as train_model


def build_config(
    preset: str = "cpu-small",
    config: Path | None = None,
    overrides: list[str] | None = None,
    *,
    dense: bool = False,
    steps: int | None = None,
    corpus: str | None = None,
    tokenizer: str | None = None,
) -> RunConfig:
    """Preset (or JSON file) → shortcuts (steps, corpus, tokenizer) → ``--set`` overrides converted to each
    field's type, validated at each stage (``ConfigError`` naming the key)."""
    cfg = RunConfig.from_json(config) if config is not None else RunConfig.from_name(preset)
    shortcuts = []
    if steps is not None:
        shortcuts.append(f"train.max_steps={steps}")
    if corpus is not None:
        shortcuts.append(f"data.corpus={corpus}")
    if tokenizer is not None:
        shortcuts.append(f"data.tokenizer={tokenizer}")
    cfg = cfg.override_strings([*shortcuts, *(overrides or [])])
    return cfg.dense() if dense else cfg


def default_run_folder(cfg: RunConfig) -> Path:
    """``runs/<preset>-<prism|dense>``."""
    return Path("runs") / f"{cfg.preset or 'custom'}-{'prism' if cfg.model.is_prism else 'dense'}"


def prepare(
    corpus: str = "builtin",
    tokenizer: str = "bpe-8192",
    *,
    out: Path | None = None,
    text_field: str = "text",
    val_fraction: float = 0.02,
    max_docs: int | None = None,
    overwrite: bool = False,
    progress: Progress = True,
) -> ShardSet:
    """Tokenize a corpus into memory-mapped token shards (reused if already built).

    Args:
        corpus: builtin, a folder/glob/file of .txt/.jsonl/.parquet, or hf:NAME.
        tokenizer: bpe-N (train), gpt2, hf:NAME, or a saved tokenizer path.
        out: Shard folder (default: a keyed folder under ~/.cache/prismlm/data).
        text_field: Text field of .jsonl/.parquet/HF corpora.
        val_fraction: Share of documents held out for validation.
        max_docs: Use only the first N documents.
        overwrite: Replace shards of another corpus or tokenizer already in --out (never any other folder;
            shards of the same corpus and tokenizer are reused).
        progress: Show a progress bar.
    """
    require(0.0 < val_fraction < 1.0, "--val-fraction", "in (0, 1)", val_fraction)
    if out is not None:  # the same shards are reused; others only with --overwrite (checked by prepare_shards)
        check_out_folder(out, "token shard folder", holds=is_shard_folder, resume=True)
    return prepare_shards(
        corpus,
        tokenizer,
        out,
        val_fraction=val_fraction,
        text_field=text_field,
        max_docs=max_docs,
        show_progress=progress,
        replace=overwrite or out is None,
    )


def train_from_options(
    *,
    preset: str = "cpu-small",
    config: Path | None = None,
    out: Path | None = None,
    overrides: list[str] | None = None,
    dense: bool = False,
    steps: int | None = None,
    corpus: str | None = None,
    tokenizer: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: Progress = True,
) -> TrainResult:
    """Train a PRISM model (or the dense baseline). Works under `torchrun` for data parallelism.

    Args:
        preset: Named preset: tiny, cpu-small, gpt2-124m, gpt2-medium, gpt2-large, xl-1.6b.
        config: A RunConfig JSON file (replaces the preset).
        out: Run folder (default runs/<preset>-<prism|dense>).
        overrides: Override a config field: --set train.lr=1e-3 (repeatable).
        dense: Train the matched dense baseline (no prototype head).
        steps: Optimizer steps (overrides train.max_steps; with --resume, train on to this step).
        corpus: Corpus spec (overrides data.corpus).
        tokenizer: Tokenizer spec (overrides data.tokenizer).
        resume: Continue the run in --out from its latest checkpoint.
        overwrite: Replace a run already in --out (without it, such a folder is refused).
        progress: Show a progress bar.
    """
    cfg = build_config(preset, config, overrides, dense=dense, steps=steps, corpus=corpus, tokenizer=tokenizer)
    return train_model(
        cfg,
        writable_folder(out or default_run_folder(cfg)),
        resume=resume,
        overwrite=overwrite,
        extend_to=steps if resume else None,
        progress=progress,
    )


@dataclass
class DemoResult:
    """Everything the demo made: the run, samples, metrics, the index and one explained generation."""

    run_folder: Path
    train: TrainResult
    samples: list[str]
    metrics: dict[str, float | int | None]
    index: IndexResult | None = None
    explanation: Explanation | None = None
    files: dict[str, Path] = field(default_factory=dict)
    question: str | None = None
    """The chat question the real-model demo explained the answer to (None: the scratch demo)."""


DEMO_PROMPTS = ("The ", "It is a truth universally acknowledged")


def scratch_demo(
    *,
    preset: str = "cpu-small",
    steps: int | None = None,
    out: Path = Path("runs/demo"),
    max_docs: int | None = None,
    max_chars_per_doc: int | None = None,
    overrides: list[str] | None = None,
    progress: Progress = True,
    index_sequences: int | None = None,
    overwrite: bool = False,
    on_stage: StageFn = no_stages,
) -> DemoResult:
    """The whole pipeline on the built-in corpus: prepare data, train a small PRISM, sample, evaluate,
    index a sample of the training data and explain one generation.

    Args:
        preset: Preset to train: tiny, cpu-small, gpt2-124m, gpt2-medium, gpt2-large, xl-1.6b.
        steps: Optimizer steps (default: the preset's).
        out: Run folder.
        max_docs: Use only the first N documents of the built-in corpus.
        max_chars_per_doc: Truncate each document (smoke tests).
        overrides: Override a config field (repeatable).
        progress: Show progress bars.
        index_sequences: Training sequences to index (default 1024; 64 for the tiny preset).
        overwrite: Replace an earlier run in --out (without it, such a folder is refused).
        on_stage: Called as ``on_stage(stage, i, n)`` when each of the n stages starts.
    """
    extra = list(overrides or [])
    if max_docs is not None:
        extra.append(f"data.max_docs={max_docs}")
    if max_chars_per_doc is not None:
        extra.append(f"data.max_chars_per_doc={max_chars_per_doc}")
    cfg = build_config(preset, None, extra, steps=steps, corpus="builtin")
    stages = 5 if cfg.model.is_prism else 3
    on_stage("train", 0, stages)
    result = train_model(cfg, out, progress=progress, overwrite=overwrite)
    run = Run.open(out, device="cpu")
    on_stage("sample", 1, stages)
    samples = [t for p in DEMO_PROMPTS for t in generate(run, p, tokens=40, samples=1, sampling=TEXT_SAMPLING)]
    on_stage("evaluate", 2, stages)
    metrics = evaluate(run, batches=cfg.train.eval_batches)
    demo_result = DemoResult(run_folder=out, train=result, samples=samples, metrics=metrics)
    if cfg.model.is_prism:
        # Why a cap: the demo indexes a sample so it stays a demo; `prism index RUN` indexes everything.
        n_index = index_sequences if index_sequences is not None else (64 if preset == "tiny" else 1024)
        on_stage(f"index ({n_index} training sequences)", 3, stages)
        demo_result.index = build_run_index(run, max_sequences=n_index, progress=progress, overwrite=overwrite)
        on_stage("explain", 4, stages)
        demo_result.explanation = explain_text(run, DEMO_PROMPTS[1], generate=12, sampling=TEXT_SAMPLING)
    return demo_result


__all__ = [
    "DEMO_PROMPTS",
    "DemoResult",
    "build_config",
    "default_run_folder",
    "prepare",
    "scratch_demo",
    "train_from_options",
]
