"""The ``prism`` command line: each command is an operation of ``prismlm.app`` plus a renderer.

Options come from the operations' signatures and docstrings (``prismlm.cli.derive``); this module only
renders results. A ``PrismError`` becomes one ``error: …`` line and exit code 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from prismlm import app as ops
from prismlm.app.control import ConceptResult, ControllerResult
from prismlm.app.indexing import IndexResult, LabelResult
from prismlm.app.operations import PrototypeListing, PrototypeView, VerifyReport
from prismlm.app.reports import AttributionReport, ExplanationReport, attribute_report, explain_report
from prismlm.app.run import Run, require
from prismlm.app.training import DemoResult
from prismlm.artifacts import write_output
from prismlm.cli.console import console, echo, fail, stdout
from prismlm.cli.context import CONTEXT, HELP, root_options
from prismlm.cli.derive import DEVICE_HELP, SUPPRESS_HELP, SUPPRESS_RESIDUAL_HELP, command, flags_of
from prismlm.data.shards import ShardSet
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import PrismError
from prismlm.integrations.export import export_run
from prismlm.model import PrismLM
from prismlm.render import RunHeader, render_terminal, write_html
from prismlm.tda import AttributionCache, SearchIndex
from prismlm.train.state import TrainResult

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=HELP,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: readable at 80 columns (rich's panels squeeze descriptions)
    context_settings=CONTEXT,
)


main = app.callback()(root_options)  # --version, and the group's docstring


def print_metrics(metrics: dict, title: str = "evaluation") -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    stdout.print(table)


def _write_json(path: Path, data: object) -> None:
    write_output(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n", option="--json")
    console.print(f"JSON → {path}")


# ----- data and training ---------------------------------------------------------------------------------
def render_shards(shards: ShardSet) -> None:
    console.print(
        f"shards at {shards.root}: train {len(shards.train):,} tokens, val {len(shards.val):,} tokens, "
        f"vocab {shards.tokenizer.vocab_size}"
    )


command(app, "prepare", ops.prepare, render_shards, opens_run=False)


def render_trained(result: TrainResult) -> None:
    console.print(f"checkpoint: {result.checkpoint}")  # under torchrun, rank 0 only (cli.console)


def _on_stage(stage: str, i: int, n: int | None) -> None:
    console.rule(f"[bold]prism demo[/] {i + 1}/{n}: {stage}")


command(app, "train", ops.train_from_options, render_trained, opens_run=False, decls={"overrides": ["--set"]})
command(
    app,
    "retrofit",
    ops.retrofit_model,
    render_trained,
    opens_run=False,
    decls={"source": ["--from"], "overrides": ["--set"]},
)


def _demo_report_name(res: DemoResult) -> str:
    return "explain" if res.question is None else "demo"  # the real-model demo's report: RUN/demo.html


def write_demo_report(res: DemoResult) -> None:
    """RUN/demo.html and .json (or explain.*), written while the demo still holds the run folder's lock: a
    second demo on the same folder cannot swap the weights under the report."""
    if res.explanation is None:
        return
    out = res.run_folder
    protos = res.train.model.config.prototypes if res.train.model is not None else None
    header = RunHeader(
        run=out.name,
        step=res.train.step,
        model_sha256=res.explanation.model_sha256,
        num_prototypes=protos.num_prototypes if protos else None,
        top_k=protos.top_k if protos else None,
    )
    name = _demo_report_name(res)
    write_html(res.explanation, out / f"{name}.html", run=header)
    res.explanation.to_json(out / f"{name}.json")


def render_demo(res: DemoResult) -> None:
    if res.question is not None:
        stdout.print(f"[bold]user:[/] {escape(res.question)}\n[bold]assistant:[/] {escape(res.samples[0])}")
    else:
        console.rule("samples")
        for text in res.samples:
            stdout.print(text.replace("\n", " ") + "\n", markup=False)
    print_metrics(res.metrics, f"eval {res.run_folder}")
    if res.index is not None:
        render_index(res.index)
    if res.explanation is not None:
        render_terminal(res.explanation, stdout)
        out = res.run_folder
        if res.question is None:
            console.print(f'report → {out / "explain.html"}; next: prism explain {out} "your text" --html report.html')
        else:
            console.print(
                f"report → {out / 'demo.html'}; next: prism serve {out}  (the explorer: ask it anything, "
                f'or prism explain {out} --chat "your question")',
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


command(
    app,
    "demo",
    ops.demo,
    render_demo,
    opens_run=False,
    decls={"overrides": ["--set"]},
    fixed={"on_stage": _on_stage, "on_done": write_demo_report},
)


# ----- sampling and evaluation ----------------------------------------------------------------------------
def render_texts(texts: list[str]) -> None:
    for text in texts:
        echo(text)
        echo("-" * 40)
    for note in getattr(texts, "notes", []):  # which suppressed prototypes were active, and a warning if none
        console.print(
            note, markup=False, highlight=False, soft_wrap=True, style="yellow" if "warning" in note else None
        )


def render_eval(metrics: dict, run: Run, *, json_out: Path | None = None) -> None:
    """Output options.

    Args:
        json_out: Also write the metrics to this JSON file.
    """
    print_metrics(metrics, f"eval {run.path}")
    if json_out:
        _write_json(json_out, metrics)


command(app, "generate", ops.generate, render_texts, suppressible=True, decls={"tokens": ["--tokens", "-n"]})
command(app, "eval", ops.evaluate, render_eval, suppressible=True, decls={"json_out": ["--json"]})


# ----- prototype index, labels, explanations (spec §3.1) ------------------------------------------------
def render_index(res: IndexResult) -> None:
    idx, out = res.index, res.path
    for note in res.notes:
        console.print(f"[yellow]{note}[/]")
    m = idx.manifest
    console.print(
        f"index at {out}: {m['tokens']:,} tokens of {m['universe']:,} sequences × {m['block_size']} "
        f"(covered {m['covered']}), K={idx.num_prototypes}, top-{idx.top_n} neighbours"
        + (f", {m['tokens_per_s_last_run']:,.0f} tokens/s" if m.get("tokens_per_s_last_run") else "")
        + ("" if idx.complete else " — [yellow]incomplete: rerun with --resume[/]")
        + ("" if idx.covers_all or not idx.complete else " — a part: combine with `prism index-merge`")
    )
    print_metrics(dict(idx.coverage()), f"coverage over the indexed tokens ({out})")


def render_labels(res: LabelResult) -> None:
    console.print(
        f"labels for {len(res.labels)} prototypes → {res.path}; categories: "
        + ", ".join(f"{k} {v}" for k, v in res.categories().items())
    )


def render_explanation(
    res: ExplanationReport, run: Run, *, json_out: Path | None = None, html_out: Path | None = None, top: int = 3
) -> None:
    """Output options.

    Args:
        json_out: Write the explanation as JSON.
        html_out: Write a self-contained HTML report.
        top: Prototypes shown per token in the terminal.
    """
    require(top >= 1, "--top", ">= 1", top)
    expl, attribution = res.explanation, res.attribution
    render_terminal(expl, stdout, top=top)
    if attribution is not None:
        stdout.print(
            "top training sequences: " + ", ".join(f"#{it.sequence} ({it.score:+.3g})" for it in attribution.top[:5])
        )
    if json_out:
        _write_json(json_out, res.to_dict())
    if html_out:
        write_html(expl, html_out, attribution=attribution, run=run)
        console.print(f"HTML → {html_out}")


command(app, "index", ops.build_run_index, render_index)
command(app, "index-merge", ops.merge_index_parts, render_index, opens_run=False, arguments={"out", "parts"})
command(app, "label", ops.label_prototypes, render_labels)
command(
    app,
    "explain",
    explain_report,
    render_explanation,
    arguments={"prompt"},
    suppressible=True,
    decls={
        "generate": ["--generate", "-g"],
        "use_index": ["--use-index/--no-index"],
        "json_out": ["--json"],
        "html_out": ["--html"],
    },
)


def render_prototypes(res: PrototypeListing | PrototypeView, run: Run) -> None:
    if isinstance(res, PrototypeView):
        card = res.card
        stdout.print(
            f"[bold]#{card.id}[/] {escape(card.label or '')} [dim]({escape(card.category or 'unlabelled')})[/]"
        )
        if card.stats:
            s = card.stats
            stdout.print(
                f"active on {s['count']:,} tokens ({s['frequency']:.2%}), mean activation "
                f"{s['mean_activation']:.3f}, nearest context cos {s['max_similarity']:.3f}"
            )
            stdout.print("activation histogram [0,1]: " + " ".join(str(c) for c in s["histogram"]), markup=False)
        quality = (card.evidence or {}).get("quality")
        if isinstance(quality, float):
            stdout.print(f"label quality {quality:.2f} (how often a token the label names comes next where it fires)")
        stdout.print("top tokens of W p_i: " + "  ".join(f"{t!r} {v:.2f}" for t, v in card.top_tokens), markup=False)
        stdout.print("pushes down most:   " + "  ".join(f"{t!r} {v:.2f}" for t, v in card.bottom_tokens), markup=False)
        for nb in card.neighbours:
            stdout.print(f"  {nb.similarity:.3f}  {nb.snippet!r}  {nb.doc_id}:{nb.position}", markup=False)
        if not res.has_index:
            stdout.print("[dim]no index: build one with `prism index` for neighbourhoods and labels[/]")
        return
    table = Table(title=f"prototypes of {run.path}")
    token_col = any(row.token_push is not None for row in res.rows)
    cols = ("id", "label", "quality", "category", "active", "W p_i top tokens") + (
        ("(W p_i)_tok",) if token_col else ()
    )
    for col_name in cols:
        table.add_column(col_name)
    for row in res.rows:
        table.add_row(
            str(row.id),
            escape(row.label),
            f"{row.quality:.2f}" if row.quality is not None else "-",
            escape(row.category),
            f"{row.active_tokens:,}" if row.active_tokens is not None else "-",
            escape(", ".join(repr(t) for t in row.top_tokens)),
            *((f"{row.token_push:.2f}",) if row.token_push is not None else ()),
        )
    stdout.print(table)
    if res.token is not None:
        stdout.print(
            f"{res.matched} of {res.num_prototypes} prototypes have {res.token!r} among the {res.match_top} "
            f"tokens they push most; {min(len(res.rows), res.matched)} shown, strongest push first",
            markup=False,
            style="dim",
        )
    else:
        stdout.print(f"[dim]{res.matched} of {res.num_prototypes} prototypes match[/]")
    if any(row.quality is not None for row in res.rows):
        stdout.print("[dim]quality: how often a token the label names is the next token where it fires[/]")


command(app, "prototypes", ops.prototypes, render_prototypes)


def render_verify(res: VerifyReport) -> None:
    for f in res.checked:
        console.print(f"ok  {f}", markup=False, highlight=False, soft_wrap=True)
    for n in res.notes:
        console.print(f"[dim]{n}[/]")
    console.print(f"verified {len(res.checked)} artifacts against their manifests")


command(app, "verify", ops.verify_run, render_verify, suppressible=True)


def render_export(out: Path) -> None:
    stdout.print(f"exported → {out}", markup=False)
    for f in sorted(out.iterdir()):
        stdout.print(f"  {f.name}  {f.stat().st_size:,} bytes", markup=False)
    console.print(
        f"load: AutoModelForCausalLM / AutoTokenizer .from_pretrained({str(out)!r}) after `import prismlm` "
        f"(or both with trust_remote_code=True); lm_eval --model hf --model_args "
        f"pretrained={out},trust_remote_code=True",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


command(app, "export", export_run, render_export, suppressible=True, arguments={"out"})


# ----- training-data attribution (spec §3.2) ------------------------------------------------------------
def render_cache(c: AttributionCache) -> None:
    m = c.manifest
    console.print(
        f"attribution cache → {c.path}: {m['postings']:,} postings over {m['universe']:,} sequences "
        f"({m['postings_per_sequence']:.1f}/sequence), r={m['r']} {m['projection']}, "
        f"{m['bytes_per_token']:.1f} bytes/training token, curvature {m['curvature_seconds']:.1f}s + "
        f"postings {m['postings_seconds']:.1f}s"
    )


def render_search(idx: SearchIndex) -> None:
    m = idx.manifest
    console.print(
        f"search index → {idx.path}: {m['lists_indexed']:,} lists indexed ({m['postings_indexed']:,} of "
        f"{m['postings']:,} postings; shorter lists are scanned), {m['config']['kind']}, "
        f"{m['bytes_per_token']:.1f} bytes/training token beside the cache, {m['build_seconds']:.1f}s"
    )


def render_attribution(
    report: AttributionReport, run: Run, *, json_out: Path | None = None, html_out: Path | None = None
) -> None:
    """Output options.

    Args:
        json_out: Write the result as JSON.
        html_out: Write the `prism explain` HTML report of the text with a Training data section.
    """
    res = report.attribution
    console.print(
        f"[bold]{escape(repr(res.prompt))}[/] → measured {res.measured_tokens} token(s)"
        + (f" of completion {escape(repr(res.completion))}" if res.completion else "")
        + f"; loss {res.query_loss:.3f}; {res.method} over {res.num_train:,} sequences in "
        f"{res.seconds * 1000:.0f} ms"
    )
    table = Table(show_lines=False)
    for col in ("#", "seq", "score", "prototypes (contribution)", "snippet"):
        table.add_column(col)
    for it in res.top:
        protos = ", ".join(f"{p['id']} ({p['contribution']:+.3g})" for p in it.prototypes[:3])
        table.add_row(str(it.rank), str(it.sequence), f"{it.score:+.4g}", protos, it.snippet.replace("\n", " ")[-90:])
    stdout.print(table)
    for n in res.notes:
        console.print(f"[dim]{n}[/]")
    if json_out:
        res.to_json(json_out, option="--json")
        console.print(f"JSON → {json_out}")
    if html_out and report.explanation is not None:  # the explanation of the attributed text (prompt + completion)
        write_html(report.explanation, html_out, attribution=res, run=run)
        console.print(f"HTML → {html_out}")


# The flags of AttributionConfig's fields where they differ from --field-name. --sketch-size: the same as --r, for
# torchrun (whose argument parser takes --r for an abbreviation of its own flags).
ATTRIBUTION_FLAGS = {"r": ["--r", "--sketch-size"], "curvature_mode": ["--curvature"]}
command(app, "attribute-cache", ops.build_run_cache, render_cache, decls=ATTRIBUTION_FLAGS)
command(app, "attribute-search", ops.build_run_search, render_search)
command(
    app,
    "attribute",
    attribute_report,
    render_attribution,
    arguments={"text"},
    computed={"explain": lambda options: options.get("html_out") is not None},
    prefixed={"rescoring"},
    decls={
        "generate": ["--generate", "-g"],
        "rescoring_method": ["--rescore"],
        "rescoring_candidates": ["--rescore-top"],
        "json_out": ["--json"],
        "html_out": ["--html"],
    },
)


# ----- control (spec §4) ----------------------------------------------------------------------------------
def render_concept(res: ConceptResult, *, top: int = 15) -> None:
    """Output options.

    Args:
        top: Rows of the ranking to print.
    """
    sset, ranking = res.suppression, res.ranking
    t = Table(
        title=f"concept {sset.concept or ''}: {len(sset.ids)} of {len(ranking)} candidates selected "
        f"({100 * sset.share:.2f}% of K={sset.num_prototypes})"
    )
    cols = ("id", "target effect", "contribution", "log2 enr.", "concept/neutral rate", "purity", "selected")
    for col in (*cols, "top tokens"):
        t.add_column(col)
    for r in ranking[:top]:
        ev = sset.evidence.get(r["id"], {})
        t.add_row(
            str(r["id"]),
            f"{r.get('target_effect', 0.0):+.3f}",
            f"{r['contribution_nats_per_token']:.4f}",
            f"{r['log2_enrichment']:.2f}",
            f"{r['concept_rate']:.4f}/{r['neutral_rate']:.4f}",
            "-" if r.get("purity") is None else f"{r['purity']:.2f}",
            "yes" if r["selected"] else "",
            " ".join(repr(x) for x in ev.get("signature_top_tokens", [])[:5]),
        )
    stdout.print(t)
    targets = sset.meta.get("target_strings") or []
    console.print(
        f"ranked by {sset.meta.get('rank_by')}; target tokens "
        + (
            f"{' '.join(repr(x) for x in targets)} ({sset.meta.get('target_positions')} positions in the concept "
            "texts; target effect: each prototype's slice on them where they come next, logits per position — "
            "what suppressing it takes off them)"
            if isinstance(targets, list) and targets
            else "none (no token is over-represented in the concept texts)"
        ),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for path in res.saved:
        console.print(f"suppression set: {path}")


def render_task_folders(folders: dict[str, Path]) -> None:
    for n, f in folders.items():
        console.print(
            f"{n}: {f} (prism-lm-eval --model prism --model_args pretrained=RUN --include_path {f} --tasks prism_{n})"
        )


def render_task_results(results: dict, *, json_out: Path | None = None) -> None:
    """Output options.

    Args:
        json_out: Write the accuracies here.
    """
    for n, r in results.items():
        console.print(f"{n}: {r}")
    if json_out:
        _write_json(json_out, results)


def render_controller(res: ControllerResult) -> None:
    for e in res.trace[:10]:
        console.print(
            f"  prototype {e['id']}: c={e['c']:+.3f} {e.get('label') or ''} "
            f"tokens {e['signature_top_tokens'][:5]}"
            + (f" | {e['neighbours'][0]['snippet'][-70:]!r}" if e.get("neighbours") else ""),
            markup=False,
        )
    console.print(
        f"test acc {res.before['acc']:.4f} → {res.after['acc']:.4f} with {len(res.controller.nonzero)} "
        f"non-zero coefficients (λ={res.controller.l1}); controller: {res.path}"
    )
    if res.activity is not None:  # which of its prototypes fire on the test examples, and a warning if none
        warning = res.activity.warning("controlled")
        for line in [res.activity.summary("controlled")] + ([warning] if warning else []):
            console.print(line, markup=False, highlight=False, soft_wrap=True)


command(app, "concept", ops.find_run_concept, render_concept)


# ----- the explorer web app -------------------------------------------------------------------------------
@app.command("serve")
def serve_command(
    run: Path = typer.Argument(..., help="Run folder or checkpoint folder (the only run served)."),
    index: Path | None = typer.Option(None, "--index", help="Index folder (default RUN/index if it exists)."),
    cache: Path | None = typer.Option(
        None,
        "--cache",
        help="Attribution cache folder (default RUN/attribution-cache "
        "if it exists; otherwise exact attribution over the first sequences).",
    ),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to bind; anything but loopback is warned about (the explorer has no authentication).",
    ),
    concept: list[Path] = typer.Option(
        [],
        "--concept",
        help="A suppression set (from `prism concept --out`) the Steer view can apply; repeat for more.",
    ),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    suppress: str = typer.Option("auto", "--suppress", help=SUPPRESS_HELP),
    suppress_residual: str = typer.Option("auto", "--suppress-residual", help=SUPPRESS_RESIDUAL_HELP),
    max_text_chars: int = typer.Option(4000, "--max-text-chars", help="Longest text a request may send."),
    max_generate: int = typer.Option(128, "--max-generate", help="Most tokens a request may generate."),
) -> None:
    """Start the explorer: a local web app (Explain, Prototype, Map, Steer, Training data) over one run."""
    from prismlm.app.explorer import Limits
    from prismlm.web.server import serve

    try:
        serve(
            run,
            index=index,
            cache=cache,
            host=host,
            port=port,
            device=device,
            suppress=suppress,
            suppress_residual=suppress_residual,
            concepts=concept,
            limits=Limits(max_text_chars=max_text_chars, max_generate=max_generate),
        )
    except PrismError as e:  # the library names its parameters (`port`): the user sees this command's flags
        fail(e.spelled(flags_of(list(inspect.signature(serve_command).parameters.values()))))


def _lm_eval_scorer(
    model: PrismLM, tokenizer: Tokenizer, task_folders: dict[str, str | Path]
) -> dict[str, dict[str, float]]:
    # lm-eval imports slowly: only when --lm-eval asks for it
    from prismlm.integrations.lm_eval_adapter import evaluate_with_lm_eval

    return evaluate_with_lm_eval(model, tokenizer, task_folders)


tasks_app = typer.Typer(
    help="Multiple-choice tasks: build them, evaluate a model on them.", no_args_is_help=True, rich_markup_mode=None
)
controller_app = typer.Typer(
    help="Sparse linear controllers over prototypes.", no_args_is_help=True, rich_markup_mode=None
)
command(tasks_app, "build", ops.build_task_folders, render_task_folders, opens_run=False)
command(
    tasks_app,
    "eval",
    ops.evaluate_tasks,
    render_task_results,
    suppressible=True,
    decls={"json_out": ["--json"]},
    fixed={"lm_eval_scorer": _lm_eval_scorer},
)
command(controller_app, "fit", ops.fit_controller, render_controller)
app.add_typer(tasks_app, name="tasks")
app.add_typer(controller_app, name="controller")
