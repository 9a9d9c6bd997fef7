"""The ``prism`` command line. Each command is a thin wrapper over an importable function."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from prismlm.app.operations import build_run_index, evaluate_run, explain_run, generate_text, open_index, user_errors
from prismlm.cli.console import console
from prismlm.cli.console import fail as _fail
from prismlm.config import PRESETS, RunConfig
from prismlm.errors import ConfigError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="prismlm: train, sample and evaluate prototype language models (PRISM).",
    pretty_exceptions_enable=False,
)
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
    preset: str, config_file: Path | None, overrides: list[str], *, dense: bool = False,
    steps: int | None = None, corpus: str | None = None, tokenizer: str | None = None,
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


@app.command()
def prepare(
    corpus: str = typer.Option("builtin", help="builtin, a folder/glob/file of .txt/.jsonl/.parquet, or hf:NAME."),
    tokenizer: str = typer.Option("bpe-8192", help="bpe-N (train), gpt2, hf:NAME, or a saved tokenizer path."),
    out: Path | None = typer.Option(None, help="Shard folder (default: a keyed folder under ~/.cache/prismlm/data)."),
    text_field: str = typer.Option("text", help="Text field of .jsonl/.parquet/HF corpora."),
    val_fraction: float = typer.Option(0.02, help="Share of documents held out for validation."),
    max_docs: int | None = typer.Option(None, help="Use only the first N documents."),
) -> None:
    """Tokenize a corpus into memory-mapped token shards (reused if already built)."""
    from prismlm.data.shards import prepare_shards
    from prismlm.errors import CorpusError

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
    config: Path | None = typer.Option(None, help="A RunConfig JSON file (replaces the preset)."),
    out: Path | None = typer.Option(None, help="Run folder (default runs/<preset>-<prism|dense>)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config field: --set train.lr=1e-3 (repeatable)."),
    dense: bool = typer.Option(False, help="Train the matched dense baseline (no prototype head)."),
    steps: int | None = typer.Option(None, help="Optimizer steps (overrides train.max_steps)."),
    corpus: str | None = typer.Option(None, help="Corpus spec (overrides data.corpus)."),
    tokenizer: str | None = typer.Option(None, help="Tokenizer spec (overrides data.tokenizer)."),
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
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one line from rank 0 only
        console.print(f"checkpoint: {result.checkpoint}")


@app.command()
def generate(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder."),
    prompt: str = typer.Option("", help="Text to continue (empty: start from end-of-text)."),
    tokens: int = typer.Option(100, "--tokens", "-n", help="New tokens per sample."),
    samples: int = typer.Option(1, help="Number of samples."),
    temperature: float = typer.Option(0.8, help="Sampling temperature (0 = greedy)."),
    top_k: int | None = typer.Option(50, help="Sample from the top-k tokens only."),
    seed: int = typer.Option(0, help="Sampling seed."),
    device: str = typer.Option("auto", help="auto, cpu, cuda…"),
    suppress: str = typer.Option("auto", help="Suppression set: a JSON file from `prism concept`, 'auto' (the "
                                 "checkpoint's suppression.json if any) or 'none'."),
) -> None:
    """Sample text from a trained model."""
    try:
        texts = generate_text(run, prompt, tokens=tokens, samples=samples, temperature=temperature, top_k=top_k,
                              seed=seed, device=device, suppress=suppress)
    except user_errors() as e:
        _fail(str(e))
    for text in texts:
        print(text)
        print("-" * 40)


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
    batch_size: int | None = typer.Option(None, help="Sequences per batch (default: the run's)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the metrics to this JSON file."),
    device: str = typer.Option("auto", help="auto, cpu, cuda…"),
    suppress: str = typer.Option("auto", help="Suppression set: a JSON file, 'auto' (the checkpoint's "
                                 "suppression.json if any) or 'none'."),
) -> None:
    """Validation loss, perplexity and coverage metrics (R̄1, R2, dead prototypes, residual share)."""
    try:
        metrics = evaluate_run(run, batches=batches, batch_size=batch_size, device=device, suppress=suppress)
    except user_errors() as e:
        _fail(str(e))
    print_metrics(metrics, f"eval {run}")
    if json_out:
        json_out.write_text(json.dumps(metrics, indent=2) + "\n")


@app.command()
def demo(
    preset: str = typer.Option("cpu-small", help=f"Preset to train: {PRESET_NAMES}."),
    steps: int | None = typer.Option(None, help="Optimizer steps (default: the preset's)."),
    out: Path = typer.Option(Path("runs/demo"), help="Run folder."),
    max_docs: int | None = typer.Option(None, help="Use only the first N documents of the built-in corpus."),
    max_chars_per_doc: int | None = typer.Option(None, help="Truncate each document (smoke tests)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config field (repeatable)."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """The whole pipeline on the built-in corpus: prepare data, train a small PRISM, sample, evaluate."""
    run_demo(preset=preset, steps=steps, out=out, max_docs=max_docs, max_chars_per_doc=max_chars_per_doc,
             overrides=set_, progress=progress)


def run_demo(*, preset: str = "cpu-small", steps: int | None = None, out: Path = Path("runs/demo"),
             max_docs: int | None = None, max_chars_per_doc: int | None = None,
             overrides: list[str] = (), progress: bool = True, index_sequences: int | None = None) -> dict:
    from prismlm.train.trainer import train as run_train

    extra = list(overrides)
    if max_docs is not None:
        extra.append(f"data.max_docs={max_docs}")
    if max_chars_per_doc is not None:
        extra.append(f"data.max_chars_per_doc={max_chars_per_doc}")
    cfg = build_config(preset, None, extra, steps=steps, corpus="builtin")
    console.rule(f"[bold]prism demo[/]: {preset} PRISM on the built-in corpus")
    run_train(cfg, out, progress=progress)
    console.rule("samples")
    for prompt in ("The ", "It is a truth universally acknowledged"):
        for text in generate_text(out, prompt, tokens=40, samples=1, temperature=0.8, seed=0, device="cpu"):
            print(text.replace("\n", " ") + "\n")
    metrics = evaluate_run(out, batches=cfg.train.eval_batches, device="cpu")
    print_metrics(metrics, f"eval {out}")
    if cfg.model.is_prism:
        # Why a cap: the demo indexes a sample so it stays a demo; `prism index RUN` indexes everything.
        n_index = index_sequences if index_sequences is not None else (64 if preset == "tiny" else 1024)
        console.rule(f"prototype index ({n_index} training sequences) and one explained generation")
        idx = build_run_index(out, max_sequences=n_index, device="cpu", progress=progress)
        _print_index_summary(idx, idx.path)
        from prismlm.explore import render_terminal, write_html

        expl = explain_run(out, "It is a truth universally acknowledged", generate=12, seed=0, device="cpu")
        render_terminal(expl, Console())
        write_html(expl, out / "explain.html")
        expl.to_json(out / "explain.json")
        console.print(f"report → {out / 'explain.html'}; next: prism explain {out} \"your text\" --html report.html")
    return metrics




# ----- prototype index, labels, explanations (spec §3.1) ------------------------------------------------
def _parse_part(part: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in part.split("/"))
    except ValueError:
        _fail(f"--part expects i/n (e.g. 0/4), got {part!r}")
    if not (n >= 1 and 0 <= i < n):
        _fail(f"--part i/n needs 0 <= i < n, got {part!r}")
    return i, n


def _print_index_summary(idx, out: Path) -> None:
    cov = idx.coverage()
    m = idx.manifest
    console.print(f"index at {out}: {m['tokens']:,} tokens of {m['universe']:,} sequences × {m['block_size']} "
                  f"(covered {m['covered']}), K={idx.num_prototypes}, top-{idx.top_n} neighbours"
                  + (f", {m['tokens_per_s_last_run']:,.0f} tokens/s" if m.get("tokens_per_s_last_run") else "")
                  + ("" if idx.complete else " — [yellow]incomplete: rerun with --resume[/]")
                  + ("" if idx.covers_all or not idx.complete else " — a part: combine with `prism index-merge`"))
    print_metrics({k: v for k, v in cov.items()}, f"coverage over the indexed tokens ({out})")


@app.command("index")
def index_cmd(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder of a PRISM model."),
    top_n: int = typer.Option(32, help="Nearest training contexts kept per prototype."),
    max_sequences: int | None = typer.Option(None, help="Index only the first N training sequences (default: all)."),
    batch_size: int = typer.Option(16, help="Sequences per forward pass (keep it equal across parts)."),
    part: str = typer.Option("0/1", help="Build part i of n (i/n) of the sequences; combine with `prism index-merge`."),
    out: Path | None = typer.Option(None, help="Index folder (default RUN/index, or RUN/index-part-i-of-n)."),
    resume: bool = typer.Option(False, help="Continue a partial index in --out after its last saved batch."),
    checkpoint_every: int = typer.Option(50, help="Save the partial index every N batches (0: only at the end)."),
    shards: Path | None = typer.Option(None, help="Token shard folder (default: the run's, from its data config)."),
    labels: bool = typer.Option(True, help="Also write rule-based labels (labels.json) when the index is complete."),
    device: str = typer.Option("auto", help="auto, cpu, cuda…"),
    progress: bool = typer.Option(True, help="Show a progress bar with tokens/s."),
) -> None:
    """Build the prototype index: each prototype's nearest training contexts, activation statistics, coverage."""
    pt = _parse_part(part)
    try:
        idx = build_run_index(run, top_n=top_n, max_sequences=max_sequences, batch_size=batch_size, part=pt, out=out,
                              resume=resume, checkpoint_every=checkpoint_every, shards_dir=shards, labels=labels,
                              device=device, progress=progress)
    except user_errors() as e:
        _fail(str(e))
    _print_index_summary(idx, idx.path)


@app.command("index-merge")
def index_merge_cmd(
    out: Path = typer.Argument(..., help="Folder of the merged index."),
    parts: list[Path] = typer.Argument(..., help="Partial index folders (from `prism index --part i/n`)."),
    labels: bool = typer.Option(True, help="Write rule-based labels when the merged index is complete."),
) -> None:
    """Merge partial indexes (disjoint parts of the same model and shards) into one — equal to one pass."""
    from prismlm.data.shards import load_shards
    from prismlm.errors import ShardError
    from prismlm.explain import PrototypeIndex, merge_indexes, rule_labels, save_labels

    try:
        idx = merge_indexes([PrototypeIndex.load(p) for p in parts])
        idx.save(out)
        if labels and idx.covers_all:
            try:
                idx.attach(load_shards(idx.manifest["shards_root"]))
                save_labels(rule_labels(idx), out)
            except (ShardError, OSError) as e:
                console.print(f"[yellow]labels skipped ({e}); run `prism label` with the run folder[/]")
    except user_errors() as e:
        _fail(str(e))
    _print_index_summary(idx, out)


@app.command("label")
def label_cmd(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder (its index must exist)."),
    index: Path | None = typer.Option(None, help="Index folder (default RUN/index)."),
    labeller: str = typer.Option("rules", help="rules (offline) or openai (an OpenAI-compatible endpoint)."),
    endpoint: str | None = typer.Option(None, help="Base URL of the OpenAI-compatible API (with --labeller openai)."),
    model: str | None = typer.Option(None, "--model", help="Model name for the endpoint (with --labeller openai)."),
    api_key_env: str = typer.Option("OPENAI_API_KEY", help="Environment variable holding the API key."),
    ids: str | None = typer.Option(None, help="Comma-separated prototype ids to relabel with the LLM (default all)."),
    shards: Path | None = typer.Option(None, help="Token shard folder (default: the index's / the run's)."),
) -> None:
    """Label every prototype from its neighbourhood (rules; optionally an LLM endpoint). Writes labels.json."""
    from prismlm.explain import llm_labels, rule_labels, save_labels
    from prismlm.train.checkpoint import load_checkpoint

    if labeller not in ("rules", "openai"):
        _fail(f"--labeller must be 'rules' or 'openai', got {labeller!r}")
    if labeller == "openai" and (not endpoint or not model):
        _fail("--labeller openai needs --endpoint URL and --model NAME")
    try:
        ckpt = load_checkpoint(run)
        idx = open_index(run, ckpt, index, shards, required=True)
        labs = rule_labels(idx)
        if labeller == "openai":
            sel = [int(x) for x in ids.split(",")] if ids else None
            labs = llm_labels(idx, labs, endpoint=endpoint, model=model, api_key_env=api_key_env, ids=sel)
        path = save_labels(labs, idx.path)
    except user_errors() as e:
        _fail(str(e))
    cats: dict[str, int] = {}
    for v in labs.values():
        cats[v["category"]] = cats.get(v["category"], 0) + 1
    console.print(f"labels for {len(labs)} prototypes → {path}; categories: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])))


@app.command("explain")
def explain_cmd(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder of a PRISM model."),
    prompt: str = typer.Argument("", help="Text to explain (empty: the first prediction after end-of-text)."),
    generate_n: int = typer.Option(0, "--generate", "-g", help="Sample N tokens after the prompt and explain them."),
    index: Path | None = typer.Option(None, help="Index folder (default RUN/index if it exists)."),
    use_index: bool = typer.Option(True, "--use-index/--no-index", help="Use the prototype index if there is one."),
    shards: Path | None = typer.Option(None, help="Token shard folder (default: the index's / the run's)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the explanation as JSON."),
    html_out: Path | None = typer.Option(None, "--html", help="Write a self-contained HTML report."),
    top: int = typer.Option(3, help="Prototypes shown per token in the terminal."),
    neighbours: int = typer.Option(5, help="Training snippets per prototype card."),
    temperature: float = typer.Option(0.8, help="Sampling temperature for --generate (0 = greedy)."),
    top_k: int | None = typer.Option(50, help="Sample from the top-k tokens only."),
    seed: int = typer.Option(0, help="Sampling seed."),
    attribute: bool = typer.Option(False, "--attribute", help="Add the top training sequences for the text (its "
                                   "generated part with --generate) to the report: prototype-space influence "
                                   "from the run's attribution cache (`prism attribute-cache`)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda…"),
) -> None:
    """Explain each next-token logit: active prototypes with labels and shares, residual share, exactly."""
    from prismlm.cli.attribution import attribute_run
    from prismlm.explore import render_terminal, write_html

    attribution = None
    try:
        expl = explain_run(run, prompt, generate=generate_n, index_dir=index, use_index=use_index, shards_dir=shards,
                           temperature=temperature, top_k=top_k, seed=seed, neighbours=neighbours, device=device)
        if attribute:
            # attribute exactly the tokens that were explained (inputs + the last chosen token); with
            # --generate, measure the sampled tokens only
            ids = list(expl.token_ids)
            if expl.prompt_tokens is not None or len(ids) < 2:  # a generation ends with its last sampled token
                ids.append(expl.positions[-1].next_id)
            completion = len(ids) - expl.prompt_tokens if expl.prompt_tokens is not None else None
            attribution = attribute_run(run, expl.text, completion=completion or None, shards_dir=shards,
                                        device=device, token_ids=ids)
    except user_errors() as e:
        _fail(str(e))
    render_terminal(expl, Console(), top=top)
    if attribution is not None:
        Console().print("top training sequences: " + ", ".join(
            f"#{it.sequence} ({it.score:+.3g})" for it in attribution.top[:5]))
    if json_out:
        if attribution is None:
            expl.to_json(json_out)
        else:
            json_out.write_text(json.dumps({**expl.to_dict(), "attribution": attribution.to_dict()}, indent=2) + "\n")
        console.print(f"JSON → {json_out}")
    if html_out:
        write_html(expl, html_out, attribution=attribution)
        console.print(f"HTML → {html_out}")


@app.command("prototypes")
def prototypes_cmd(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder of a PRISM model."),
    search: str | None = typer.Option(None, help="Only prototypes whose label or category contains TEXT."),
    token: str | None = typer.Option(None, help="Prototypes that push this token most (signature W p_i)."),
    id_: int | None = typer.Option(None, "--id", help="Show one prototype's card (neighbours, histogram, tokens)."),
    index: Path | None = typer.Option(None, help="Index folder (default RUN/index if it exists)."),
    shards: Path | None = typer.Option(None, help="Token shard folder (default: the index's / the run's)."),
    limit: int = typer.Option(20, help="Rows to list."),
    neighbours: int = typer.Option(8, help="Snippets shown with --id."),
) -> None:
    """List or search prototypes by label, category or token; --id N shows one prototype's card."""
    import torch

    from prismlm.explain import prototype_card
    from prismlm.train.checkpoint import load_checkpoint

    try:
        ckpt = load_checkpoint(run)
        if not ckpt.model.is_prism:
            raise ValueError(f"{ckpt.path} is a dense baseline: it has no prototypes")
        idx = open_index(run, ckpt, index, shards, required=False)
        labs = idx.labels() if idx is not None else {}
        tok = ckpt.tokenizer
        K = ckpt.model.prototypes.num_prototypes
        out = Console()
        if id_ is not None:
            card = prototype_card(ckpt, tok, id_, index=idx, labels=labs, neighbours=neighbours)
            out.print(f"[bold]#{card.id}[/] {card.label or ''} [dim]({card.category or 'unlabelled'})[/]")
            if card.stats:
                s = card.stats
                out.print(f"active on {s['count']:,} tokens ({s['frequency']:.2%}), mean activation "
                          f"{s['mean_activation']:.3f}, nearest context cos {s['max_similarity']:.3f}")
                out.print("activation histogram [0,1]: " + " ".join(str(c) for c in s["histogram"]))
            out.print("top tokens of W p_i: " + "  ".join(f"{t!r} {v:.2f}" for t, v in card.top_tokens))
            for nb in card.neighbours:
                out.print(f"  {nb.similarity:.3f}  {nb.snippet!r}  [dim]{nb.doc_id}:{nb.position}[/]", markup=True,
                          highlight=False)
            if idx is None:
                out.print("[dim]no index: build one with `prism index` for neighbourhoods and labels[/]")
            return
        ids = list(range(K))
        score: dict[int, float] = {}
        if token is not None:
            tid = tok.encode(token)
            if len(tid) != 1:
                raise ValueError(f"--token {token!r} is {len(tid)} tokens {tid}; give a single token "
                                 f"(e.g. with its leading space: ' the')")
            with torch.no_grad():
                col = ckpt.model.signatures()[:, tid[0]].float()  # (K,)
            score = {i: float(col[i]) for i in ids}
            ids.sort(key=lambda i: -score[i])
        elif idx is not None:
            ids.sort(key=lambda i: -int(idx.counts[i]))
        if search:
            q = search.lower()
            ids = [i for i in ids if q in (labs.get(i, {}).get("label", "") + " " +
                                           labs.get(i, {}).get("category", "")).lower()]
        table = Table(title=f"prototypes of {run}" + (f" pushing {token!r}" if token else "")
                      + (f" matching {search!r}" if search else ""))
        for col_name in ("id", "label", "category", "active", "W p_i top tokens") + (("(W p_i)_tok",) if token else ()):
            table.add_column(col_name)
        with torch.no_grad():
            sig = ckpt.model.signatures(torch.tensor(ids[:limit], dtype=torch.long)).float() if ids else None
        for row, i in enumerate(ids[:limit]):
            v = sig[row].clone()
            v[tok.vocab_size:] = -float("inf")
            top = ", ".join(repr(tok.id_to_token(int(t))) for t in v.topk(5).indices)
            lab = labs.get(i, {})
            table.add_row(str(i), lab.get("label", ""), lab.get("category", ""),
                          f"{int(idx.counts[i]):,}" if idx is not None else "-", top,
                          *((f"{score[i]:.2f}",) if token else ()))
        out.print(table)
        out.print(f"[dim]{len(ids)} of {K} prototypes match[/]")
    except user_errors() as e:
        _fail(str(e))


from prismlm.cli.attribution import register as _register_attribution  # noqa: E402
from prismlm.cli.control import register as _register_control  # noqa: E402

_register_attribution(app)
_register_control(app)


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
