"""The ``prism`` command line. Each command is a thin wrapper over an importable function."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from prismlm.config import PRESETS, ConfigError, RunConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="prismlm: train, sample and evaluate prototype language models (PRISM).",
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
PRESET_NAMES = ", ".join(sorted(PRESETS))


def _parse_overrides(pairs: list[str]) -> dict:
    """``["train.lr=1e-3", "model.prototypes=null"]`` → dict; values parsed as JSON, else kept as strings."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise typer.BadParameter(f"--set expects KEY=VALUE, got {pair!r}")
        key, raw = pair.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def build_config(
    preset: str, config_file: Optional[Path], overrides: list[str], *, dense: bool = False,
    steps: Optional[int] = None, corpus: Optional[str] = None, tokenizer: Optional[str] = None,
) -> RunConfig:
    """Preset (or JSON file) → CLI shortcuts → ``--set`` overrides, validated at each stage."""
    cfg = RunConfig.from_json(config_file) if config_file else RunConfig.from_name(preset)
    shortcuts = {}
    if steps is not None:
        shortcuts["train.max_steps"] = steps
    if corpus is not None:
        shortcuts["data.corpus"] = corpus
    if tokenizer is not None:
        shortcuts["data.tokenizer"] = tokenizer
    cfg = cfg.override({**shortcuts, **_parse_overrides(overrides)})
    return cfg.dense() if dense else cfg


def _fail(msg: str) -> None:
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code=2)


@app.command()
def prepare(
    corpus: str = typer.Option("builtin", help="builtin, a folder/glob/file of .txt/.jsonl/.parquet, or hf:NAME."),
    tokenizer: str = typer.Option("bpe-8192", help="bpe-N (train), gpt2, hf:NAME, or a saved tokenizer path."),
    out: Optional[Path] = typer.Option(None, help="Shard folder (default: a keyed folder under ~/.cache/prismlm/data)."),
    text_field: str = typer.Option("text", help="Text field of .jsonl/.parquet/HF corpora."),
    val_fraction: float = typer.Option(0.02, help="Share of documents held out for validation."),
    max_docs: Optional[int] = typer.Option(None, help="Use only the first N documents."),
) -> None:
    """Tokenize a corpus into memory-mapped token shards (reused if already built)."""
    from prismlm.data.corpus import CorpusError
    from prismlm.data.shards import prepare_shards

    try:
        shards = prepare_shards(corpus, tokenizer, out, val_fraction=val_fraction, text_field=text_field,
                                max_docs=max_docs)
    except (CorpusError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    console.print(f"shards at {shards.root}: train {len(shards.train):,} tokens, val {len(shards.val):,} tokens, "
                  f"vocab {shards.tokenizer.vocab_size}")


@app.command()
def train(
    preset: str = typer.Option("cpu-small", help=f"Named preset: {PRESET_NAMES}."),
    config: Optional[Path] = typer.Option(None, help="A RunConfig JSON file (replaces the preset)."),
    out: Optional[Path] = typer.Option(None, help="Run folder (default runs/<preset>-<prism|dense>)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config field: --set train.lr=1e-3 (repeatable)."),
    dense: bool = typer.Option(False, help="Train the matched dense baseline (no prototype head)."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps (overrides train.max_steps)."),
    corpus: Optional[str] = typer.Option(None, help="Corpus spec (overrides data.corpus)."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer spec (overrides data.tokenizer)."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its latest checkpoint."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Train a PRISM model (or the dense baseline). Works under ``torchrun`` for data parallelism."""
    from prismlm.train.trainer import train as run_train

    try:
        cfg = build_config(preset, config, set_, dense=dense, steps=steps, corpus=corpus, tokenizer=tokenizer)
    except ConfigError as e:
        _fail(str(e))
    out = out or Path("runs") / f"{cfg.preset or 'custom'}-{'prism' if cfg.model.is_prism else 'dense'}"
    result = run_train(cfg, out, resume=resume, progress=progress)
    console.print(f"checkpoint: {result.checkpoint}")


@app.command()
def generate(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder."),
    prompt: str = typer.Option("", help="Text to continue (empty: start from end-of-text)."),
    tokens: int = typer.Option(100, "--tokens", "-n", help="New tokens per sample."),
    samples: int = typer.Option(1, help="Number of samples."),
    temperature: float = typer.Option(0.8, help="Sampling temperature (0 = greedy)."),
    top_k: Optional[int] = typer.Option(50, help="Sample from the top-k tokens only."),
    seed: int = typer.Option(0, help="Sampling seed."),
    device: str = typer.Option("auto", help="auto, cpu, cuda…"),
) -> None:
    """Sample text from a trained model."""
    for text in generate_text(run, prompt, tokens=tokens, samples=samples, temperature=temperature,
                              top_k=top_k, seed=seed, device=device):
        print(text)
        print("-" * 40)


def generate_text(run: Path, prompt: str, *, tokens: int = 100, samples: int = 1, temperature: float = 0.8,
                  top_k: Optional[int] = 50, seed: int = 0, device: str = "auto") -> list[str]:
    import torch

    from prismlm.train.checkpoint import load_checkpoint
    from prismlm.train.distributed import resolve_device

    ckpt = load_checkpoint(run, device=resolve_device(device))
    tok = ckpt.tokenizer
    if tok is None:
        _fail(f"{ckpt.path} has no tokenizer; cannot encode a prompt")
    ids = tok.encode(prompt) if prompt else [tok.eot_id]
    dev = next(ckpt.model.parameters()).device
    x = torch.tensor([ids] * samples, dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    y = ckpt.model.generate(x, tokens, temperature=temperature, top_k=top_k, generator=gen)
    return [tok.decode(row[len(ids) if prompt else 1:].tolist()) if not prompt else prompt + tok.decode(row[len(ids):].tolist())
            for row in y]


def evaluate_run(run: Path, *, batches: int = 50, batch_size: Optional[int] = None, device: str = "auto") -> dict:
    """Validation loss/perplexity and coverage metrics of a trained run on its own validation split."""
    from prismlm.data.shards import prepare_from_config
    from prismlm.eval.metrics import evaluate
    from prismlm.train.checkpoint import load_checkpoint
    from prismlm.train.distributed import resolve_device
    from prismlm.train.trainer import autocast_for

    dev = resolve_device(device)
    ckpt = load_checkpoint(run, device=dev)
    cfg = ckpt.config
    shards = prepare_from_config(cfg.data, show_progress=False)
    metrics = evaluate(ckpt.model, shards.val, seq_len=cfg.model.block_size,
                       batch_size=batch_size or cfg.train.batch_size, max_batches=batches, device=dev,
                       autocast=autocast_for(cfg, dev))
    metrics["step"] = ckpt.manifest.get("step")
    return metrics


def print_metrics(metrics: dict, title: str = "evaluation") -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    Console().print(table)


@app.command("eval")
def eval_cmd(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder."),
    batches: int = typer.Option(50, help="Validation batches (a fixed, evenly spread sample)."),
    batch_size: Optional[int] = typer.Option(None, help="Sequences per batch (default: the run's)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the metrics to this JSON file."),
    device: str = typer.Option("auto", help="auto, cpu, cuda…"),
) -> None:
    """Validation loss, perplexity and coverage metrics (R̄1, R2, dead prototypes, residual share)."""
    metrics = evaluate_run(run, batches=batches, batch_size=batch_size, device=device)
    print_metrics(metrics, f"eval {run}")
    if json_out:
        json_out.write_text(json.dumps(metrics, indent=2) + "\n")


@app.command()
def demo(
    preset: str = typer.Option("cpu-small", help=f"Preset to train: {PRESET_NAMES}."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps (default: the preset's)."),
    out: Path = typer.Option(Path("runs/demo"), help="Run folder."),
    max_docs: Optional[int] = typer.Option(None, help="Use only the first N documents of the built-in corpus."),
    max_chars_per_doc: Optional[int] = typer.Option(None, help="Truncate each document (smoke tests)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config field (repeatable)."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """The whole pipeline on the built-in corpus: prepare data, train a small PRISM, sample, evaluate."""
    run_demo(preset=preset, steps=steps, out=out, max_docs=max_docs, max_chars_per_doc=max_chars_per_doc,
             overrides=set_, progress=progress)


def run_demo(*, preset: str = "cpu-small", steps: Optional[int] = None, out: Path = Path("runs/demo"),
             max_docs: Optional[int] = None, max_chars_per_doc: Optional[int] = None,
             overrides: list[str] = (), progress: bool = True) -> dict:
    from prismlm.train.trainer import train as run_train

    extra = list(overrides)
    if max_docs is not None:
        extra.append(f"data.max_docs={max_docs}")
    if max_chars_per_doc is not None:
        extra.append(f"data.max_chars_per_doc={max_chars_per_doc}")
    cfg = build_config(preset, None, extra, steps=steps, corpus="builtin")
    console.rule(f"[bold]prism demo[/]: {preset} PRISM on the built-in corpus")
    result = run_train(cfg, out, progress=progress)
    console.rule("samples")
    for prompt in ("The ", "It is a truth universally acknowledged"):
        for text in generate_text(out, prompt, tokens=40, samples=1, temperature=0.8, seed=0, device="cpu"):
            print(text.replace("\n", " ") + "\n")
    metrics = evaluate_run(out, batches=cfg.train.eval_batches, device="cpu")
    print_metrics(metrics, f"eval {out}")
    return metrics


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
