"""Data and training operations: resolve a config, tokenize a corpus, train, and the end-to-end demo."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prismlm.app.indexing import IndexResult, build_run_index
from prismlm.app.operations import ExplanationRequest, evaluate, explain_text, generate
from prismlm.app.run import Run, StageFn, no_stages, require, writable_folder
from prismlm.artifacts import check_out_folder
from prismlm.config import RunConfig
from prismlm.data.shards import ShardSet, is_shard_folder, prepare_shards
from prismlm.errors import CheckpointError, params_renamed
from prismlm.explain import Explanation
from prismlm.model.generation import TEXT_SAMPLING
from prismlm.progress import Progress
from prismlm.train.checkpoint import find_checkpoint, load_checkpoint
from prismlm.train.state import TrainResult
from prismlm.train.trainer import train as train_model


@dataclass(frozen=True)
class ConfigChoice:
    """Which run config to train: a preset or a JSON file, then shortcuts for the fields most often changed.
    Each field is a ``prism train`` option of the same name."""

    preset: str = "cpu-small"
    """Named preset: tiny, cpu-small, gpt2-124m, gpt2-medium, gpt2-large, xl-1.6b."""
    config: Path | None = None
    """A RunConfig JSON file (replaces the preset)."""
    dense: bool = False
    """Train the matched dense baseline (no prototype head)."""
    steps: int | None = None
    """Optimizer steps (overrides train.max_steps; with --resume, train on to this step)."""
    corpus: str | None = None
    """Corpus spec (overrides data.corpus)."""
    tokenizer: str | None = None
    """Tokenizer spec (overrides data.tokenizer)."""


def build_config(choice: ConfigChoice = ConfigChoice(), overrides: list[str] | None = None) -> RunConfig:
    """Preset (or JSON file) → shortcuts (steps, corpus, tokenizer) → ``--set`` overrides converted to each
    field's type, validated at each stage (``ConfigError`` naming the key)."""
    cfg = RunConfig.from_json(choice.config) if choice.config is not None else RunConfig.from_name(choice.preset)
    shortcuts = []
    if choice.steps is not None:
        shortcuts.append(f"train.max_steps={choice.steps}")
    if choice.corpus is not None:
        shortcuts.append(f"data.corpus={choice.corpus}")
    if choice.tokenizer is not None:
        shortcuts.append(f"data.tokenizer={choice.tokenizer}")
    cfg = cfg.override_strings([*shortcuts, *(overrides or [])])
    return cfg.dense() if choice.dense else cfg


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
    require(0.0 < val_fraction < 1.0, "val_fraction", "in (0, 1)", val_fraction)
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
    choice: ConfigChoice = ConfigChoice(),
    *,
    out: Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: Progress = True,
) -> TrainResult:
    """Train a PRISM model (or the dense baseline). Works under `torchrun` for data parallelism.

    Args:
        choice: The config to train (preset or JSON file, dense, steps, corpus, tokenizer): ``ConfigChoice``,
            one option per field.
        out: Run folder (default runs/<preset>-<prism|dense>).
        overrides: Override a config field: --set train.lr=1e-3 (repeatable).
        resume: Continue the run in --out from its latest checkpoint.
        overwrite: Replace a run already in --out (without it, such a folder is refused).
        progress: Show a progress bar.
    """
    cfg = build_config(choice, overrides)
    with params_renamed(extend_to="steps"):  # the trainer's extend_to is this command's steps
        return train_model(
            cfg,
            writable_folder(out or default_run_folder(cfg)),
            resume=resume,
            overwrite=overwrite,
            extend_to=choice.steps if resume else None,
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


@dataclass(frozen=True)
class DemoOptions:
    """What both demos (the real model's and the toy from scratch) take besides their model."""

    out: Path = Path("runs/demo")
    """Run folder."""
    steps: int | None = None
    """Optimizer steps (default: the demo's own)."""
    max_docs: int | None = None
    """Use only the first N documents of the built-in corpus."""
    max_chars_per_doc: int | None = None
    """Truncate each document (smoke tests)."""
    overrides: tuple[str, ...] = ()
    """Run config overrides (``train.log_interval=5``)."""
    index_sequences: int | None = None
    """Training sequences to index (default: the demo's own)."""
    overwrite: bool = False
    """Replace an earlier run in ``out`` (without it, such a folder is refused)."""
    resume: bool = False
    """Continue a stopped demo in ``out``: its training from the last checkpoint, its index, the rest."""
    progress: Progress = True
    """Show progress bars (or report to a callback)."""
    on_stage: StageFn = no_stages
    """Called as ``on_stage(stage, i, n)`` when each of the n stages starts."""


def scratch_demo(preset: str = "cpu-small", options: DemoOptions = DemoOptions()) -> DemoResult:
    """The whole pipeline on the built-in corpus: prepare data, train a small PRISM (``preset``: tiny,
    cpu-small, gpt2-124m, …), sample, evaluate, index a sample of the training data (default 1024 sequences;
    64 for the tiny preset) and explain one generation."""
    o = options
    extra = list(o.overrides)
    if o.max_docs is not None:
        extra.append(f"data.max_docs={o.max_docs}")
    if o.max_chars_per_doc is not None:
        extra.append(f"data.max_chars_per_doc={o.max_chars_per_doc}")
    cfg = build_config(ConfigChoice(preset=preset, steps=o.steps, corpus="builtin"), extra)
    stages = 5 if cfg.model.is_prism else 3
    o.on_stage("train", 0, stages)
    result = finished_training(o.out) if o.resume else None
    if result is None:
        resume = o.resume and has_checkpoint(o.out)
        # resumed before the first checkpoint: nothing to continue, start it again in its folder
        result = train_model(cfg, o.out, progress=o.progress, overwrite=o.overwrite or o.resume, resume=resume)
    run = Run.open(o.out, device="cpu")
    o.on_stage("sample", 1, stages)
    samples = [t for p in DEMO_PROMPTS for t in generate(run, p, tokens=40, samples=1, sampling=TEXT_SAMPLING)]
    o.on_stage("evaluate", 2, stages)
    metrics = evaluate(run, batches=cfg.train.eval_batches)
    demo_result = DemoResult(run_folder=o.out, train=result, samples=samples, metrics=metrics)
    if cfg.model.is_prism:
        # Why a cap: the demo indexes a sample so it stays a demo; `prism index RUN` indexes everything.
        n_index = o.index_sequences if o.index_sequences is not None else (64 if preset == "tiny" else 1024)
        o.on_stage(f"index ({n_index} training sequences)", 3, stages)
        demo_result.index = build_run_index(
            run, max_sequences=n_index, progress=o.progress, overwrite=o.overwrite, resume=o.resume
        )
        o.on_stage("explain", 4, stages)
        demo_result.explanation = explain_text(run, DEMO_PROMPTS[1], ExplanationRequest(generate=12), TEXT_SAMPLING)
    return demo_result


def has_checkpoint(out: Path) -> bool:
    """Whether the run folder ``out`` holds a checkpoint."""
    try:
        find_checkpoint(out)
    except CheckpointError:
        return False
    return True


def finished_training(out: Path) -> TrainResult | None:
    """A demo resumed after its training finished: the result read back from the last checkpoint and
    metrics.jsonl (its last validation); None when training has steps left or no checkpoint."""
    if not has_checkpoint(out):
        return None
    ckpt = load_checkpoint(find_checkpoint(out), device="cpu")
    if ckpt.manifest["step"] < ckpt.config.train.max_steps:
        return None
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    metrics: dict[str, float] = next((m for m in reversed(lines) if "val_loss" in m), {})
    return TrainResult(run_dir=out, checkpoint=ckpt.path, step=ckpt.manifest["step"], metrics=metrics, model=ckpt.model)


__all__ = [
    "DEMO_PROMPTS",
    "ConfigChoice",
    "DemoOptions",
    "DemoResult",
    "build_config",
    "default_run_folder",
    "prepare",
    "scratch_demo",
    "train_from_options",
]
