"""Operations on a run folder — load, sample, evaluate, index, explain — as importable functions.

The ``prism`` CLI (``prismlm.cli``) and the command modules of ``attribution`` and ``control`` are thin
wrappers over these; they raise the exceptions of ``user_errors()`` for user mistakes, which the CLI turns
into a one-line message and exit code 2.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from prismlm.errors import ConfigError

console = Console(stderr=True)


def generate_text(run: Path, prompt: str, *, tokens: int = 100, samples: int = 1, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, device: str = "auto",
                  suppress: str | None = "auto") -> list[str]:
    """``prism generate`` as a function: ``samples`` continuations of ``prompt`` (prompt included)."""
    import torch

    from prismlm.train.distributed import resolve_device

    ckpt = load_run(run, suppress, resolve_device(device))
    if ckpt.tokenizer is None:
        raise ValueError(f"{ckpt.path} has no tokenizer; cannot encode a prompt")
    dev = next(ckpt.model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    return [prompt + c for c in sample_continuations(ckpt.model, ckpt.tokenizer, prompt, samples=samples, tokens=tokens,
                                                     temperature=temperature, top_k=top_k, generator=gen)]


def sample_continuations(model, tokenizer, prompt: str, *, samples: int, tokens: int, temperature: float,
                         top_k: int | None, generator) -> list[str]:
    """``samples`` sampled continuations of ``prompt`` (continuation text only; an empty prompt starts
    from the end-of-text token), one batch through ``model.generate``."""
    import torch

    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    dev = next(model.parameters()).device
    x = torch.tensor([ids] * samples, dtype=torch.long, device=dev)
    y = model.generate(x, tokens, temperature=temperature, top_k=top_k, generator=generator)
    return [tokenizer.decode(row[len(ids) if prompt else 1:].tolist()) for row in y]


def load_run(run: Path, suppress: str | None, device):
    """load_checkpoint + the suppression set (``auto``: the checkpoint's own, ``none``, or a FILE);
    a bad set raises ``SuppressionError``."""
    from prismlm.control.suppress import load_with_suppression

    ckpt, sset = load_with_suppression(run, suppress, device=device)
    if sset is not None:
        console.print(f"suppressing {len(sset.ids)} prototypes ({100 * sset.share:.2f}% of the bank)"
                      + (f": {sset.concept}" if sset.concept else ""))
    return ckpt


def evaluate_run(run: Path, *, batches: int = 50, batch_size: int | None = None, device: str = "auto",
                 suppress: str | None = "auto") -> dict:
    """Validation loss/perplexity and coverage metrics of a trained run on its own validation split."""
    from prismlm.data.shards import prepare_from_config
    from prismlm.eval.metrics import evaluate
    from prismlm.train.distributed import resolve_device
    from prismlm.train.trainer import autocast_for

    dev = resolve_device(device)
    ckpt = load_run(run, suppress, dev)
    cfg = ckpt.config
    shards = prepare_from_config(cfg.data, show_progress=False)
    metrics = evaluate(ckpt.model, shards.val, seq_len=cfg.model.block_size,
                       batch_size=batch_size or cfg.train.batch_size, max_batches=batches, device=dev,
                       autocast=autocast_for(cfg, dev))
    metrics["step"] = ckpt.manifest.get("step")
    return metrics


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the user asked for something wrong (bad path, mismatched artifact, bad value): the
    CLI prints them as one line and exits 2, with no traceback."""
    from prismlm.errors import ArtifactError, CheckpointError, ShardError, SuppressionError, TokenizerError

    return (ArtifactError, ShardError, TokenizerError, CheckpointError, SuppressionError, ConfigError, ValueError,
            FileNotFoundError)


def run_dir(run: Path, ckpt) -> Path:
    """The run folder of a checkpoint (``RUN/checkpoints/step-N`` → ``RUN``); a bare checkpoint is its own."""
    p = ckpt.path
    return p.parent.parent if p.parent.name == "checkpoints" else Path(run)


def resolve_shards(ckpt, shards_dir: Path | None = None, index_manifest: dict | None = None):
    """The token shards of a run: ``--shards``, else the index's recorded folder, else prepared (reused) from
    the run's data config; refused if their key differs from the one the checkpoint was trained on."""
    from prismlm.data.shards import load_shards, prepare_from_config
    from prismlm.errors import ShardError

    want = (ckpt.manifest.get("data") or {}).get("key")
    if shards_dir is not None:
        shards = load_shards(shards_dir)
    else:
        shards = None
        root = (index_manifest or {}).get("shards_root")
        if root and Path(root).exists():
            try:
                shards = load_shards(root)
            except ShardError:
                shards = None
        if shards is None:
            shards = prepare_from_config(ckpt.config.data, show_progress=False)
    if want is not None and shards.manifest["key"] != want:
        raise ShardError(f"token shards {shards.root} (key {shards.manifest['key'][:16]}…) are not the ones checkpoint "
                         f"{ckpt.path} was trained on (key {want[:16]}…); pass --shards with the training shards")
    return shards


def build_run_index(run: Path, *, top_n: int = 32, max_sequences: int | None = None, batch_size: int = 16,
                    part: tuple[int, int] = (0, 1), out: Path | None = None, resume: bool = False,
                    checkpoint_every: int = 50, shards_dir: Path | None = None, labels: bool = True,
                    device: str = "auto", progress: bool = True):
    """``prism index`` as a function: build (or resume) a run's prototype index and, when complete, its
    rule labels. Returns the ``PrototypeIndex``."""
    from prismlm.errors import ArtifactError
    from prismlm.explain import build_index, rule_labels, save_labels
    from prismlm.train.checkpoint import load_checkpoint
    from prismlm.train.distributed import resolve_device
    from prismlm.train.trainer import autocast_for

    dev = resolve_device(device)
    ckpt = load_checkpoint(run, device=dev)
    if not ckpt.model.is_prism:
        raise ArtifactError(f"{ckpt.path} is a dense baseline: it has no prototypes to index")
    if out is None:
        out = run_dir(run, ckpt) / ("index" if part == (0, 1) else f"index-part-{part[0]}-of-{part[1]}")
    prev = None
    if resume and (out / "manifest.json").exists():
        from prismlm.explain import PrototypeIndex

        prev = PrototypeIndex.load(out)
        if prev.complete:
            console.print(f"{out} is already complete; nothing to resume")
    elif resume:
        console.print(f"[yellow]no partial index in {out}; starting from the beginning[/]")
    shards = resolve_shards(ckpt, shards_dir, prev.manifest if prev is not None else None)
    if prev is not None and prev.complete:
        idx = prev.attach(shards)
    else:
        idx = build_index(ckpt, shards, top_n=top_n, batch_size=batch_size, max_sequences=max_sequences, part=part,
                          resume_from=prev, out=out, checkpoint_every=checkpoint_every, device=dev,
                          autocast=autocast_for(ckpt.config, dev), progress=progress)
    if labels and idx.covers_all:
        save_labels(rule_labels(idx), out)
    return idx


def open_index(run: Path, ckpt, index_dir: Path | None, shards_dir: Path | None, *, required: bool):
    from prismlm.errors import ArtifactError
    from prismlm.explain import PrototypeIndex

    path = index_dir or run_dir(run, ckpt) / "index"
    if not (path / "manifest.json").exists():
        if required or index_dir is not None:
            raise ArtifactError(f"no prototype index at {path}; build it with `prism index {run}`")
        return None
    idx = PrototypeIndex.load(path, checkpoint=ckpt)
    idx.attach(resolve_shards(ckpt, shards_dir, idx.manifest))
    return idx


def explain_run(run: Path, prompt: str, *, generate: int = 0, index_dir: Path | None = None,
                use_index: bool = True, shards_dir: Path | None = None, temperature: float = 0.8,
                top_k: int | None = 50, seed: int = 0, neighbours: int = 5, device: str = "auto"):
    """``prism explain`` as a function: returns an ``Explanation`` of the prompt (or of a generation)."""
    from prismlm.explain import explain, explain_generation
    from prismlm.train.checkpoint import load_checkpoint
    from prismlm.train.distributed import resolve_device

    ckpt = load_checkpoint(run, device=resolve_device(device))
    if ckpt.tokenizer is None:
        raise ValueError(f"{ckpt.path} has no tokenizer; cannot encode a prompt")
    if not ckpt.model.is_prism:
        raise ValueError(f"{ckpt.path} is a dense baseline: it has no prototypes to explain with")
    idx = open_index(run, ckpt, index_dir, shards_dir, required=False) if use_index else None
    if generate > 0:
        return explain_generation(ckpt, None, prompt, generate, temperature=temperature, top_k=top_k, seed=seed,
                                  index=idx, neighbours=neighbours)
    expl = explain(ckpt, None, prompt, index=idx, neighbours=neighbours)
    if idx is None:
        expl.notes.append(f"no prototype index: build one with `prism index {run}` for neighbourhoods and labels")
    return expl
